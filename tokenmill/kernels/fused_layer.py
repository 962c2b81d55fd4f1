"""What the native fused decoder layer (`llama_decode_layer`, csrc/cpu_decoder.cpp) covers.

This is the one place that says it. A decoder layer declares, once at load, the features
it computes (`LayerFeatures`, from `DecoderLayer.features()`); the execution plan asks
`uncovered(...)` and refuses the fused path for a model with any feature the op does not
compute, with a log line naming it (the model then runs op by op, which computes
everything). Nothing is skipped silently at run time.

To cover a feature (Qwen3's q/k norms, Gemma 3's sliding windows and sandwich norms, ...):
give `LayerFeatures` a field the layer sets, implement it in cpu_decoder.cpp, and list it
in `COVERED` here; the layer's operands (`FusedLayerOperands`) carry what the op then reads.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# Layer features the native op computes (True) or not (False). Every field of
# LayerFeatures that is "on" for a layer must be True here for the op to run it.
COVERED: dict[str, bool] = {
    "rms_norm": True,  # pre-attention and pre-MLP RMSNorm, each fused with its residual add
    "rotary_neox": True,  # rotate-half rotary embedding from the step's cos/sin table
    "grouped_query_attention": True,  # any num_heads / num_kv_heads ratio
    "silu_mlp": True,  # gate/up fused, SiLU-and-mul, down
    "qkv_bias": False,  # Qwen2's q/k/v biases
    "qk_norm": False,  # Qwen3 / Gemma 3: per-head RMSNorm of q and k before RoPE
    "sliding_window": False,  # Mistral / Gemma 3 windowed attention (a layer with a window)
    "sandwich_norms": False,  # Gemma: norms around the attention output and the MLP
    "geglu_mlp": False,  # Gemma: tanh-approximated gelu gate
    "logit_softcap": False,  # Gemma 2's attention soft-capping
    "tensor_parallel": False,  # the all-reduces after o_proj and down_proj would fall inside the op
    "qk_norm_whole": False,  # OLMoE: RMSNorm over the whole q and k vectors
    "mixture_of_experts": False,  # Qwen3-MoE / Mixtral / OLMoE: a router and experts in place of the MLP
}

# Weight operands the op multiplies (DecodeOperand kinds): skinny tiles, panels, quantized streams.
COVERED_WEIGHTS = ("tiled float32", "tiled bfloat16", "panels float32", "panels bfloat16", "quantized")

PANEL_COLS = 64  # outputs per panel of the panel kernel's layout (kernels.pack_panels)

# KV cache element types the op reads and writes (8-bit ones with scales, maybe rotated).
COVERED_KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3")


@dataclass(frozen=True)
class LayerFeatures:
    """What one decoder layer computes, as the layer declares it at load. A feature that is
    on (True, or a window / cap that is set) must be in COVERED for the fused op to run it."""

    rms_norm: bool = True
    rotary_neox: bool = True
    grouped_query_attention: bool = True
    silu_mlp: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sandwich_norms: bool = False
    geglu_mlp: bool = False
    logit_softcap: float | None = None
    tensor_parallel: bool = False
    qk_norm_whole: bool = False
    mixture_of_experts: bool = False
    weights: tuple[str | None, ...] = ()  # each linear's operand kind; None: its format has none

    def on(self) -> list[str]:
        return [name for name in COVERED if getattr(self, name) not in (False, None)]


def uncovered(layers: Iterable[LayerFeatures], kv_cache_dtype: str | None = None) -> list[str]:
    """The features of a model's layers (and its KV cache, when given) the native fused op
    does not compute, named for a log line; empty: the op runs every layer exactly."""
    layers = list(dict.fromkeys(layers))  # layers alike are checked once
    missing = list(dict.fromkeys(name for f in layers for name in f.on() if not COVERED[name]))
    kinds = dict.fromkeys(kind for f in layers for kind in f.weights)
    missing += [f"weights in a format with no fused operand ({kind or 'plain tensor'})"
                for kind in kinds if kind not in COVERED_WEIGHTS]
    if kv_cache_dtype is not None and kv_cache_dtype not in COVERED_KV_DTYPES:
        missing.append(f"a {kv_cache_dtype} KV cache")
    return missing


@dataclass(frozen=True)
class DecodeOperand:
    """A weight as the native fused decode layer reads it: tiles for the skinny kernel or
    panels for the panel kernel (`format` None; the op tells them by shape) or a
    QuantizedTensor's packed stream, format row and permutation."""

    tensor: torch.Tensor
    out_features: int
    format: tuple[int, ...] | None = None
    col_perm: torch.Tensor | None = None
    in_features: int = 0
    # A weight computed as column parts (deterministic inference's row-parallel linears,
    # ModelParallel.reduce_as): each part multiplies its own consecutive input columns and
    # the products are added in order. Empty: this operand is the whole weight.
    column_parts: tuple[DecodeOperand, ...] = ()
    # A quantized weight's kernel settings, the plan's (QuantizedWeights): integer dot products
    # up to `integer_rows` rows (-1: the op's default), the whole-block integer GEMM past them
    # if `integer_gemm` (else a bf16 GEMM), as the op-by-op path runs the weight.
    integer_rows: int = -1
    integer_gemm: bool = False
    # Its panels for the integer GEMM, unpacked at load (kernels.quant_gemm_panels), or None.
    gemm_panels: torch.Tensor | None = None
    # A quantized weight's column splits (QuantizedWeights.column_splits): the sums of its
    # column parts, each from zero, added in order, in one call. Empty: one sum.
    column_splits: tuple[int, ...] = ()

    @property
    def kind(self) -> str:
        if self.column_parts:
            return self.column_parts[0].kind
        if self.format is not None:
            return "quantized"
        layout = "panels" if self.tensor.dim() >= 3 and self.tensor.shape[2] == PANEL_COLS else "tiled"
        return f"{layout} {'bfloat16' if self.tensor.dtype == torch.bfloat16 else 'float32'}"

    @property
    def pieces(self) -> tuple[DecodeOperand, ...]:
        return self.column_parts or (self,)

    @property
    def format_row(self) -> tuple[int, ...]:
        """The op's row for this weight: a quantized tensor's format, or for tiles N, K and zeros."""
        return self.format if self.format is not None else (self.out_features, self.in_features, 0, 0, 0, 0)


@dataclass(frozen=True)
class FusedLayerOperands:
    """Everything the native op reads of one layer besides the step's tensors, gathered once
    at load by the layer itself (`DecoderLayer.fused_operands`)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    weights: Sequence[DecodeOperand]  # qkv, o, gate_up, down
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    @functools.cached_property
    def flat_weights(self) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor | None], list[int]]:
        """The weights as the op's arguments: tensors, their format rows one after another
        (a tiled weight's row: N, K, then zeros), act-order permutations, and how many of them
        each of the four linears has (more than one: its column parts, added in order)."""
        return self.flatten(self.weights)

    @functools.cached_property
    def quantized_settings(self) -> tuple[list[int], bool]:
        """The op's `integer_rows` (one per weight, as flat_weights lists them) and
        `integer_gemm` (the plan's, one for every quantized weight of the layer)."""
        pieces = [piece for operand in self.weights for piece in operand.pieces]
        gemm = {piece.integer_gemm for piece in pieces if piece.format is not None}
        if len(gemm) > 1:
            raise ValueError("a layer's quantized weights disagree on the integer GEMM (one plan sets it for all)")
        return [piece.integer_rows for piece in pieces], gemm == {True}

    @functools.cached_property
    def gemm_panels(self) -> list[torch.Tensor | None]:
        """The op's `gemm_panels`: one per weight (as flat_weights lists them), or none at all."""
        return self.flatten_gemm_panels(self.weights)

    @functools.cached_property
    def column_splits(self) -> list[int]:
        """The op's `column_splits`: per weight (as flat_weights lists them) a count, then that many
        columns; empty where no weight has any."""
        pieces = [piece for operand in self.weights for piece in operand.pieces]
        if not any(piece.column_splits for piece in pieces):
            return []
        return [value for piece in pieces for value in (len(piece.column_splits), *piece.column_splits)]

    @staticmethod
    def flatten_gemm_panels(operands: Sequence[DecodeOperand]) -> list[torch.Tensor | None]:
        panels = [piece.gemm_panels for operand in operands for piece in operand.pieces]
        return panels if any(p is not None for p in panels) else []

    @staticmethod
    def flatten(operands: Sequence[DecodeOperand]) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor | None],
                                                            list[int]]:
        pieces = [piece for operand in operands for piece in operand.pieces]
        formats = [value for piece in pieces for value in piece.format_row]
        return ([p.tensor for p in pieces], formats, [p.col_perm for p in pieces],
                [len(operand.pieces) for operand in operands])
