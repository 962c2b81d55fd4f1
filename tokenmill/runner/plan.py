"""The execution plan: the one place that decides what runs a model's steps on this machine.

This module (with what it imports) answers "which kernel runs for this step":
- `ExecutionPlan.step_kind(num_rows, all_decode)`: the step's tier, asked once per step by
  the runner:
  - fused: a pure decode step of up to `fused_decode_max_rows` tokens runs each decoder
    layer as one native op (`kernels.llama_decode_layer`; what it covers: kernels/fused_layer.py);
  - per-op: every other step runs op by op, with the native element-wise ops
    (`kernels.ops.NativeOps`) and the weight format's kernels;
  - reference: plain PyTorch ops (any device; CPU without the native kernels).
- Every row threshold is data of the plan (`RowThresholds`, defaults measured on an AVX2
  EPYC, the dense split re-measured per machine by runner/tune.py): the dense weight format
  multiplies with the skinny kernel up to `skinny_max_rows` rows and oneDNN beyond (its
  `CPUMatmulChoice`, built here); quantized weights use integer dot products up to
  `quant_integer_rows[bits]` rows and a bf16 GEMM beyond; a chunk of up to
  `short_chunk_tokens` tokens after earlier context attends as one-token rows
  (`chunk_as_rows`), so a step of such rows can run fused.
- `ExecutionPlan.activation_dtype(kind, num_tokens)`: the bf16 activation path. Where every
  linear of a many-row step multiplies in bf16 anyway (the dense format's bf16 oneDNN copy
  where it measured fastest; quantized weights' GEMM on bf16 tiles, on a CPU with native
  bf16 arithmetic), a per-op step of more than `bf16_activation_rows` tokens keeps its
  activations bf16 between the linears: the norms write the GEMMs' bf16 inputs, the GEMMs
  return bf16, rotary, attention and SiLU-and-mul run on bf16 (float32 arithmetic inside),
  and the residual stream stays float32. It computes the same bits as float32 activations
  cast at every GEMM (the GEMMs round their inputs and outputs to bf16 there too), without
  the casts; prefill attention is then bf16 as well. Steps of fewer tokens, the fused and
  reference tiers, deterministic inference and `--dtype float32` keep float32 activations.
- `batch_invariant_plan(plan)`: deterministic inference (SGLang's
  `--enable-deterministic-inference`): every row of every step is computed by the same
  kernels in the same order whatever else the step holds, so a request's tokens do not
  depend on the batch, the chunking, the prefix cache, the thread count or preemption.
- `apply_plan` hands the model, once at load, its weight format, its element-wise ops object
  and (for the fused tier) every layer's fused operands; a model whose layers declare a
  feature the fused op does not cover is refused the fused tier there, with a log line
  naming the feature. Nothing is decided again per call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import torch

from tokenmill.attention.backend import StepKind
from tokenmill import kernels
from tokenmill.kernels import fused_layer, huge_pages
from tokenmill.kernels.ops import NATIVE_OPS, REFERENCE_OPS, TorchOps
from tokenmill.model.layers import place_weights_on_huge_pages, set_weight_format, unpack_gemm_panels
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.quantization import DenseFormat, WeightFormat
from tokenmill.quantization.dense import PANELS, CPUMatmulChoice

__all__ = ["ExecutionPlan", "RowThresholds", "StepKind", "apply_plan", "batch_invariant_plan",
           "bf16_activations_uncovered", "cpu_native_plan", "invariant_dense_choice", "quantized_plan", "reference_plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowThresholds:
    """Every row count at which a kernel choice changes (measured: docs/benchmarks.md)."""

    # Dense CPU-tiled weights: the skinny kernel up to here, oneDNN beyond (runner/tune.py
    # measures this per machine; 16 on an AVX2 EPYC). Also the fused layer's limit for them.
    skinny_max_rows: int = 16
    # Quantized weights, by code width: int8 activations and integer dot products up to
    # here, a bf16 GEMM on dequantized tiles beyond (the op's built-in default is the same).
    quant_integer_rows: dict[int, int] = field(default_factory=lambda: {4: 8, 8: 12})
    # A chunk of at most this many tokens after earlier context (a verification: the last
    # known token and its proposals; a draft catching up) attends as that many one-token
    # rows, each over its own context length. Every backend writes the step's KV before any
    # attention reads it, so row j sees exactly the positions up to its own (the chunk's
    # bottom-right causal mask) with no per-chunk gather and SDPA call, and a step made only
    # of such rows can run the fused decode layer.
    short_chunk_tokens: int = 8


ROWS = RowThresholds()


@dataclass(frozen=True)
class AttentionSpan:
    """Consecutive tokens of one request that attend alike: as one chunk (a query of
    `count` rows over the context up to the last), or as rows (each token a one-token
    query over its own context, as a decode)."""

    start: int  # position of the first token
    count: int
    as_rows: bool


@dataclass(frozen=True)
class ExecutionPlan:
    weight_format: WeightFormat
    embedding_dtype: torch.dtype | None  # None: as loaded
    native_ops: bool  # the fused native element-wise ops
    fused_decode: bool  # one native op per decoder layer for pure decode steps
    fused_decode_max_rows: int = ROWS.skinny_max_rows  # past this the per-op path is faster (oneDNN)
    # Prefill attention (SDPA) in this dtype, None: the activations'. bf16 where the GEMMs
    # measured fastest in bf16 (native bf16 arithmetic): 2.8x float32 SDPA at 1024 tokens on
    # AMX, and the K/V it reads are bf16 in the cache anyway.
    prefill_attention_dtype: torch.dtype | None = None
    short_chunk_tokens: int = ROWS.short_chunk_tokens
    # Every chunk of a prompt, one token or many, attends as a chunk (never as rows), where
    # the backend's prefill kernel gives a prompt row the same bits in any chunk
    # (AttentionBackend.chunk_invariant): a prompt then computes alike cold, chunked or after
    # a prefix-cache hit. Set by the worker once the backend is known.
    prompts_as_chunks: bool = False
    # Every prompt token attends as a one-token row of the paged kernel, as a decode does,
    # where prompt chunks would otherwise attend through a kernel that is not chunk-invariant
    # (float32 SDPA) and the linears are row-invariant (the panel kernel): a prompt's
    # attention then has the same bits cold, chunked, after a prefix-cache hit (a generated
    # prefix included) and after a preemption. Set by the worker (`prompts_as_rows_here`).
    prompts_as_rows: bool = False
    # Deterministic inference (batch_invariant_plan): every linear runs one row-invariant
    # kernel at any row count, and every token of every chunk attends as a one-token row of the
    # paged kernel, unless prompts attend as chunks (`prompts_as_chunks`: the prefill kernel
    # gives a row the same bits in any chunk and any batch).
    batch_invariant: bool = False
    # The bf16 activation path (module doc): per-op steps of more tokens than this run their
    # activations in bf16, the residual stream in float32. None: never.
    bf16_activation_rows: int | None = None
    # What decode steps stream of the weights, copied into one arena on 2 MiB pages at load
    # (kernels/huge_pages.py); the KV cache likewise (worker.py).
    huge_pages: bool = False
    # Quantized weights on the integer GEMM keep its panels unpacked from load, so a many-row call
    # (a batched decode step, a prompt) does not unpack the weight again: the same bits, a second
    # copy of the weight (a byte per code: as large again at 8 bits, twice at 4). apply_plan does
    # it where the copies fit GEMM_PANELS_MEMORY_FRACTION of the machine's memory and a quarter of
    # what is free.
    gemm_panels: bool = False

    @property
    def tier(self) -> str:
        if self.fused_decode:
            return "fused decode layer"
        return "per-op native" if self.native_ops else "reference"

    @property
    def ops(self) -> TorchOps:
        """The element-wise ops this plan hands the model at load."""
        return NATIVE_OPS if self.native_ops else REFERENCE_OPS

    def describe(self) -> str:
        parts = [f"weights {self.weight_format.describe()}"]
        if self.fused_decode:
            size = "any size" if self.fused_decode_max_rows >= EVERY_ROW else f"<= {self.fused_decode_max_rows} tokens"
            parts.append(f"fused native decode layer for pure decode steps of {size}")
        parts.append(self.ops.name)
        if self.prefill_attention_dtype is not None:
            parts.append(f"prefill attention in {str(self.prefill_attention_dtype).removeprefix('torch.')}")
        if self.bf16_activation_rows is not None:
            parts.append(f"bf16 activations (float32 residual) for steps of > {self.bf16_activation_rows} tokens")
        if self.huge_pages:
            parts.append("weights and KV cache on 2 MiB pages where the kernel gives them")
        if self.gemm_panels:
            parts.append("the integer GEMM's panels unpacked at load")
        if self.prompts_as_chunks:
            parts.append("every prompt chunk through the prefill attention kernel (a prompt's attention the same "
                         "bits cold, chunked or after a prefix-cache hit)")
        if self.prompts_as_rows:
            parts.append("every prompt token attends as a row of the paged kernel, as decodes do (a prompt's "
                         "attention the same bits cold, chunked or after a prefix-cache hit)")
        if self.batch_invariant:
            attention = ("" if self.prompts_as_chunks else
                         ", every prompt token attends as a row of the paged kernel")
            parts.append(f"batch-invariant (deterministic inference): one kernel per op at every row count{attention}")
        return "; ".join(parts)

    def activation_dtype(self, kind: StepKind, num_tokens: int) -> torch.dtype | None:
        """The dtype of a step's activations between the linears, None: the model's (float32).
        bf16 for a per-op step of more than `bf16_activation_rows` tokens (module doc)."""
        if self.bf16_activation_rows is None or kind is not StepKind.PER_OP or num_tokens <= self.bf16_activation_rows:
            return None
        return torch.bfloat16

    def step_kind(self, num_rows: int, all_decode: bool) -> StepKind:
        """What runs a step of `num_rows` attention rows (`all_decode`: each row is one
        sequence's next token, short chunks laid out as rows included)."""
        if self.fused_decode and all_decode and num_rows <= self.fused_decode_max_rows:
            return StepKind.FUSED
        return StepKind.PER_OP if self.native_ops else StepKind.REFERENCE

    def chunk_as_rows(self, start_pos: int, num_tokens: int) -> bool:
        """Whether a request's chunk of `num_tokens` after `start_pos` cached tokens attends
        as that many one-token rows (see RowThresholds.short_chunk_tokens). Under a
        batch-invariant plan, or under `prompts_as_rows`, every chunk does: a row then reads
        its keys in the same order whether its prompt came in one chunk, in several, or after
        a prefix-cache hit."""
        if self.batch_invariant or self.prompts_as_rows:
            return num_tokens > 1
        return start_pos > 0 and 1 < num_tokens <= self.short_chunk_tokens

    def attention_spans(self, start_pos: int, num_tokens: int, prompt_len: int) -> list[AttentionSpan]:
        """How a request's tokens at positions start_pos .. start_pos + num_tokens - 1 attend,
        in order. Under `prompts_as_chunks` a token's kernel follows what the token is, not the
        step that computes it: prompt tokens as a chunk (the prefill kernel, even one token),
        generated ones (decodes, verifications, their recomputation after a preemption) as
        rows (the paged kernel), so a request computes alike cold, chunked, after a prefix-cache
        hit or after a preemption. Otherwise by the chunk's length (`chunk_as_rows`)."""
        if self.prompts_as_chunks:
            in_prompt = min(max(prompt_len - start_pos, 0), num_tokens)
            spans = [AttentionSpan(start_pos, in_prompt, as_rows=False)] if in_prompt else []
            if num_tokens > in_prompt:
                spans.append(AttentionSpan(start_pos + in_prompt, num_tokens - in_prompt, as_rows=True))
            return spans
        return [AttentionSpan(start_pos, num_tokens, num_tokens == 1 or self.chunk_as_rows(start_pos, num_tokens))]


def apply_plan(model: LlamaForCausalLM, plan: ExecutionPlan, kv_cache_dtype: str | None = None) -> ExecutionPlan:
    """Set the model up for `plan`, once: its weights in the plan's format, its element-wise
    ops, and for the fused tier every layer's operands. Returns the plan it really runs: the
    fused tier is refused, with a log line naming why, when the layers (or the KV cache, given
    its dtype name) have a feature the native fused layer does not cover."""
    set_weight_format(model, plan.weight_format, plan.embedding_dtype)
    if plan.huge_pages:
        placed = place_weights_on_huge_pages(model)
        logger.info("weights on huge pages: %.0f MiB%s", placed / 2**20, "" if placed else
                    f" (transparent huge pages are {huge_pages.thp_mode() or 'unknown'} on this machine)")
    if plan.gemm_panels:
        plan = _unpack_gemm_panels(model, plan)
    model.use_ops(plan.ops)
    if plan.bf16_activation_rows is not None:
        missing = bf16_activations_uncovered(model.layer_features(), kv_cache_dtype)
        if missing:
            logger.info("bf16 activations do not cover this %s model's %s: many-row steps keep float32 activations",
                        model.cfg.architecture, ", ".join(missing))
            plan = dataclasses.replace(plan, bf16_activation_rows=None)
    if plan.fused_decode:
        missing = fused_layer.uncovered(model.layer_features(), kv_cache_dtype)
        if missing:
            logger.info("the fused decode layer does not cover this %s model's %s: decode steps run op by op",
                        model.cfg.architecture, ", ".join(missing))
            plan = dataclasses.replace(plan, fused_decode=False)
    if plan.fused_decode and plan.fused_decode_max_rows > (dense_limit := min(ROWS.quant_integer_rows.values())):
        kinds = {kind for features in model.layer_features() for kind in features.weights}
        if kinds != {"quantized"}:  # float weights' skinny / panel kernels: oneDNN is faster past its rows
            plan = dataclasses.replace(plan, fused_decode_max_rows=dense_limit)
    model.use_fused_layers(plan.fused_decode)
    return plan


# At most this share of the machine's memory goes to the integer GEMM's panels unpacked at load
# (each process's, e.g. each tensor-parallel rank's), and at most a quarter of what is free then.
GEMM_PANELS_MEMORY_FRACTION = 1 / 8


def _available_memory() -> int | None:
    """MemAvailable (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _unpack_gemm_panels(model: LlamaForCausalLM, plan: ExecutionPlan) -> ExecutionPlan:
    budget = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * GEMM_PANELS_MEMORY_FRACTION)
    if (available := _available_memory()) is not None:
        budget = min(budget, available // 4)
    unpacked, needed = unpack_gemm_panels(model, budget)
    if unpacked:
        logger.info("the integer GEMM's panels unpacked at load: %.0f MiB", unpacked / 2**20)
        return plan
    if needed:
        logger.info("the integer GEMM's panels would take %.0f MiB, over %.0f MiB (1/%d of memory, at most a "
                    "quarter of what is free): the GEMM unpacks each weight per call", needed / 2**20, budget / 2**20,
                    round(1 / GEMM_PANELS_MEMORY_FRACTION))
    return dataclasses.replace(plan, gemm_panels=False)


def cpu_native_plan(weight_dtype: torch.dtype = torch.float32, onednn: bool = True, fused_decode: bool = True,
                    choice: CPUMatmulChoice | None = None, rows: RowThresholds = ROWS) -> ExecutionPlan:
    """Float32 activations on the CPU with the native kernels: weights tiled in
    `weight_dtype` for the skinny kernel and (when `onednn`) packed for oneDNN, multiplied
    as `choice` says (default: the skinny kernel up to `rows.skinny_max_rows`, float32
    oneDNN beyond); the native element-wise ops; and the fused decode layer (when
    attention reads the cache natively) for the row counts the skinny kernel takes. Where
    the GEMMs are bf16 (`choice.gemm` onednn_bf16: measured faster), prefill attention is
    bf16 and steps past the skinny kernel's rows run the bf16 activation path. With the
    panel kernel (`choice.panels`: every row count, one arithmetic) activations stay float32
    between the linears; its bf16 panels compute in bf16, so prefill attention is bf16 there."""
    choice = choice or CPUMatmulChoice(rows.skinny_max_rows)
    embedding_dtype = weight_dtype if weight_dtype != torch.float32 else None
    fmt = DenseFormat(weight_dtype, cpu_layout=True, onednn=onednn and not choice.panels, choice=choice)
    bf16_gemm = choice.gemm == "onednn_bf16"
    bf16_compute = bf16_gemm or (choice.panels and weight_dtype == torch.bfloat16)
    return ExecutionPlan(fmt, embedding_dtype,
                         native_ops=True, fused_decode=fused_decode and choice.skinny_max_rows > 0,
                         fused_decode_max_rows=choice.skinny_max_rows,
                         prefill_attention_dtype=torch.bfloat16 if bf16_compute else None,
                         short_chunk_tokens=rows.short_chunk_tokens,
                         bf16_activation_rows=choice.skinny_max_rows if bf16_gemm and fmt.onednn else None)


def reference_plan(weight_dtype: torch.dtype, rows: RowThresholds = ROWS) -> ExecutionPlan:
    """Plain weights in `weight_dtype` and PyTorch ops: any device, any compute dtype."""
    return ExecutionPlan(DenseFormat(weight_dtype), None, native_ops=False, fused_decode=False,
                         short_chunk_tokens=rows.short_chunk_tokens)


def quantized_plan(dense: ExecutionPlan, method: str, group_size: int = 32,
                   rows: RowThresholds = ROWS, native_bf16: bool = False, integer_gemm: bool = False) -> ExecutionPlan:
    """`dense` with weight-only quantized linears (`method`: "stored", "int8" or "int4"): the
    quantized kernels (integer dot products up to `rows.quant_integer_rows[bits]` rows;
    beyond, the whole-block integer GEMM where `integer_gemm` (measured faster on this
    machine: runner/tune.py), else a bf16 GEMM on dequantized tiles), the dense format for
    any float weight left, and the fused decode layer up to the rows the integer path takes.
    Prefill attention is bf16 on a CPU with native bf16 arithmetic (`native_bf16`); there,
    when the many-row GEMM is the bf16 one, steps past the integer rows also run the bf16
    activation path (the GEMMs multiply bf16 anyway). The integer GEMM takes float32 rows, and
    AVX2-only CPUs emulate bf16: activations stay float32 then."""
    from tokenmill.quantization.formats import QuantizedFormat

    fmt = QuantizedFormat(method, dense.weight_format, group_size, dict(rows.quant_integer_rows), integer_gemm)
    plan = dataclasses.replace(dense, weight_format=fmt, fused_decode_max_rows=min(rows.quant_integer_rows.values()))
    if integer_gemm:  # float32 rows into the integer kernels (bf16 ones would be rounded twice)
        # The fused layer then runs the op-by-op path's kernels at any row count (the integer
        # GEMM past the integer rows), without its Python between the ops: W4's 32-row decode
        # steps of the default model 50.7 -> 46.8 ms (apply_plan caps this for float weights).
        return dataclasses.replace(plan, bf16_activation_rows=None, fused_decode_max_rows=EVERY_ROW, gemm_panels=True,
                                   prefill_attention_dtype=torch.bfloat16 if native_bf16 else plan.prefill_attention_dtype)
    if native_bf16 or dense.bf16_activation_rows is not None:  # past the integer kernel's rows
        plan = dataclasses.replace(plan, prefill_attention_dtype=torch.bfloat16, bf16_activation_rows=max(
            dense.bf16_activation_rows or 0, *rows.quant_integer_rows.values()))
    return plan


# Layer features the bf16 activation path computes (True) or not (False); a model with any
# feature that is on and not covered keeps float32 activations (apply_plan, with a log line).
BF16_ACTIVATIONS_COVER: dict[str, bool] = {
    "rms_norm": True, "rotary_neox": True, "grouped_query_attention": True, "silu_mlp": True, "sliding_window": True,
    "qkv_bias": False, "qk_norm": False, "sandwich_norms": False, "geglu_mlp": False, "logit_softcap": False,
    "tensor_parallel": False, "qk_norm_whole": False, "mixture_of_experts": False,
}


def bf16_activations_uncovered(layers: list[fused_layer.LayerFeatures], kv_cache_dtype: str | None) -> list[str]:
    """What the bf16 activation path does not compute of these layers (and KV cache), named."""
    missing = list(dict.fromkeys(name for f in layers for name in f.on() if not BF16_ACTIVATIONS_COVER[name]))
    if kv_cache_dtype not in (None, "bfloat16"):
        missing.append(f"a {kv_cache_dtype} KV cache")
    return missing


# A row count no step reaches: "this kernel at every row count".
EVERY_ROW = 2**31 - 1


def invariant_dense_choice(weight_dtype: torch.dtype) -> CPUMatmulChoice:
    """One dense kernel at every row count: the panel kernel where this build has it for
    the dtype (as fast as the split where measured), else the skinny kernel."""
    if kernels.panel_linear_built(weight_dtype):
        return CPUMatmulChoice(ROWS.skinny_max_rows, PANELS)
    return CPUMatmulChoice(EVERY_ROW)


def batch_invariant_plan(plan: ExecutionPlan) -> ExecutionPlan:
    """`plan` made batch-invariant, for deterministic inference. The default plan switches
    kernels by row count (skinny kernel / oneDNN, integer dot products / bf16 GEMM, fused
    layer / op by op, paged rows / SDPA over a chunk), and each switch changes a row's
    rounding: a request's greedy tokens then depend on what shares its step. Here every
    linear runs its row-wise kernel at any row count (the skinny kernel on dense tiles, no
    oneDNN copy; on quantized weights the integer kernel, or where the plan has the integer
    GEMM the default's pair, row kernel and GEMM, which give a row the same bits at any row
    count, so the two modes run them at the same speed), each of which computes an output
    row from that input row alone, in a fixed order, whatever the thread split; the fused
    decode layer (handed each weight's kernels, so it gives the per-op path's bits:
    tests/test_determinism.py, tests/test_execution_paths.py) up to the rows the plan gives it on
    the integer GEMM (every decode size where all linears are quantized), else up to the integer
    rows; attention runs
    every token as a row of the paged kernel (`chunk_as_rows`), whose reduction over keys is
    per row and in position order, except where the worker finds the prefill kernel
    chunk-invariant (`prompts_as_chunks`: each row computed alone, over keys in fixed blocks
    from position 0, whatever the chunk and batch): prompts then attend as chunks, as in the
    default plan, so the prefill dtype stays the plan's. Slower on prompts (docs/determinism.md)."""
    from tokenmill.quantization.formats import QuantizedFormat

    def dense_rowwise(fmt: DenseFormat) -> DenseFormat:
        if not fmt.cpu_layout:
            raise ValueError("deterministic inference needs the CPU-tiled weight layout of the native kernels")
        return DenseFormat(fmt.weight_dtype, cpu_layout=True, onednn=False, choice=invariant_dense_choice(fmt.weight_dtype))

    fmt = plan.weight_format
    if isinstance(fmt, QuantizedFormat) and fmt.row_invariant:  # kept (worker.choose_plan: by the build)
        fmt = QuantizedFormat(fmt.method, dense_rowwise(fmt.dense), fmt.group_size, dict(fmt.integer_rows), True)
    elif isinstance(fmt, QuantizedFormat):
        fmt = QuantizedFormat(fmt.method, dense_rowwise(fmt.dense), fmt.group_size,
                              {bits: EVERY_ROW for bits in fmt.integer_rows})
    elif isinstance(fmt, DenseFormat):
        fmt = dense_rowwise(fmt)
    else:
        raise ValueError(f"deterministic inference does not cover the weight format {fmt.describe()}")
    fused_rows = plan.fused_decode_max_rows
    if not (isinstance(fmt, QuantizedFormat) and fmt.integer_gemm):  # the pair above, else as in the default plan
        fused_rows = min(fused_rows, min(ROWS.quant_integer_rows.values()))
    return dataclasses.replace(plan, weight_format=fmt, batch_invariant=True,
                               bf16_activation_rows=None, fused_decode_max_rows=fused_rows)
