"""The execution plan: what runs a model's steps on this machine, chosen once at load.

Three tiers, from fastest to plainest:
- fused decode layer: pure decode steps of up to `fused_decode_max_rows` tokens run each
  decoder layer as one native op (no Python between its kernels);
- per-op native: every other step runs op by op, with the native element-wise ops
  (RMSNorm, rotary, SiLU-and-mul) and the weight format's kernels;
- reference: plain PyTorch ops (any device; CPU without the native kernels).

Nothing decides per step what the plan decided at load: the model's modules are set up
once (`apply_plan`) and the runner only asks "is this step a pure decode that fits?".
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from tokenmill.model.layers import set_weight_format
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.quantization import DenseFormat, WeightFormat
from tokenmill.quantization.dense import SKINNY_MAX_ROWS, CPUMatmulChoice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutionPlan:
    weight_format: WeightFormat
    embedding_dtype: torch.dtype | None  # None: as loaded
    native_ops: bool  # the fused native element-wise ops
    fused_decode: bool  # one native op per decoder layer for pure decode steps
    fused_decode_max_rows: int = SKINNY_MAX_ROWS  # past this the per-op path is faster (oneDNN)
    # Prefill attention (SDPA) in this dtype, None: the activations'. bf16 where the GEMMs
    # measured fastest in bf16 (native bf16 arithmetic): 2.8x float32 SDPA at 1024 tokens on
    # AMX, and the K/V it reads are bf16 in the cache anyway.
    prefill_attention_dtype: torch.dtype | None = None

    @property
    def tier(self) -> str:
        if self.fused_decode:
            return "fused decode layer"
        return "per-op native" if self.native_ops else "reference"

    def describe(self) -> str:
        parts = [f"weights {self.weight_format.describe()}"]
        if self.fused_decode:
            parts.append(f"fused native decode layer for pure decode steps of <= {self.fused_decode_max_rows} tokens")
        parts.append("native element-wise ops" if self.native_ops else "PyTorch element-wise ops")
        if self.prefill_attention_dtype is not None:
            parts.append(f"prefill attention in {str(self.prefill_attention_dtype).removeprefix('torch.')}")
        return "; ".join(parts)

    def use_fused_decode(self, num_tokens: int, all_decode: bool) -> bool:
        return self.fused_decode and all_decode and num_tokens <= self.fused_decode_max_rows


def apply_plan(model: LlamaForCausalLM, plan: ExecutionPlan) -> ExecutionPlan:
    """Set the model up for `plan`; returns the plan it really runs (the fused decode
    layer is dropped, with a log line saying why, when a weight cannot feed it)."""
    set_weight_format(model, plan.weight_format, plan.embedding_dtype)
    model.use_native_ops(plan.native_ops)
    if plan.fused_decode and not model.can_fuse_decode():
        logger.info("the fused decode layer does not take these weights (%s): decode steps run op by op",
                    plan.weight_format.describe())
        plan = dataclasses.replace(plan, fused_decode=False)
    return plan


def cpu_native_plan(weight_dtype: torch.dtype = torch.float32, onednn: bool = True,
                    fused_decode: bool = True, choice: CPUMatmulChoice | None = None) -> ExecutionPlan:
    """Float32 activations on the CPU with the native kernels: weights tiled in
    `weight_dtype` for the skinny kernel and (when `onednn`) packed for oneDNN, multiplied
    as `choice` says; the native element-wise ops; and the fused decode layer (when
    attention reads the cache natively) for the row counts the skinny kernel takes; prefill
    attention in bf16 where the GEMMs are (`choice.gemm` onednn_bf16: measured faster)."""
    choice = choice or CPUMatmulChoice()
    embedding_dtype = weight_dtype if weight_dtype != torch.float32 else None
    return ExecutionPlan(DenseFormat(weight_dtype, cpu_layout=True, onednn=onednn, choice=choice), embedding_dtype,
                         native_ops=True, fused_decode=fused_decode and choice.skinny_max_rows > 0,
                         fused_decode_max_rows=choice.skinny_max_rows,
                         prefill_attention_dtype=torch.bfloat16 if choice.gemm == "onednn_bf16" else None)


def reference_plan(weight_dtype: torch.dtype) -> ExecutionPlan:
    """Plain weights in `weight_dtype` and PyTorch ops: any device, any compute dtype."""
    return ExecutionPlan(DenseFormat(weight_dtype), None, native_ops=False, fused_decode=False)


def quantized_plan(dense: ExecutionPlan, method: str, group_size: int = 32) -> ExecutionPlan:
    """`dense` with weight-only quantized linears (`method`: "stored", "int8" or "int4"): the
    quantized kernels (integer dot products up to 8 rows of 4-bit codes, 12 of 8-bit; a bf16
    GEMM on dequantized tiles beyond), the dense format for any float weight left, and the
    fused decode layer up to the rows the integer path takes."""
    from tokenmill.kernels import QUANT_INTEGER_ROWS
    from tokenmill.quantization.formats import QuantizedFormat

    fmt = QuantizedFormat(method, dense.weight_format, group_size)
    return dataclasses.replace(dense, weight_format=fmt,
                               fused_decode_max_rows=min(QUANT_INTEGER_ROWS.values()))
