"""Dense float weights: as a plain tensor (any device), or laid out for the CPU kernels."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dataclasses import dataclass

from tokenmill import kernels
from tokenmill.dtypes import dtype_name
from tokenmill.quantization.base import DecodeOperand, LinearWeights, WeightFormat


class PlainWeights(LinearWeights):
    """A float weight used as it is: F.linear (BLAS/oneDNN on CPU, cuBLAS on GPU)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    @property
    def format_name(self) -> str:
        return dtype_name(self.weight.dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


@dataclass(frozen=True)
class CPUMatmulChoice:
    """Which kernel multiplies float32 activations by a CPU-tiled weight, by row count: the
    execution plan's data (runner/plan.py, measured per machine by runner/tune.py; on an
    AVX2 EPYC the skinny kernel won up to 16 rows and float32 oneDNN beyond; with AMX,
    oneDNN's bf16 GEMM wins from a few rows on; on a Zen 4 EPYC the panel kernel matched or
    beat both at every row count). No default here: the plan holds it.

    `gemm` "panels": the panel kernel (kernels.panel_linear) at every row count, one
    arithmetic whatever the rows of the step, so a row's outputs do not depend on what
    shares its step (issue 24); `skinny_max_rows` is then only the rows up to which a pure
    decode step runs the fused decode layer."""

    skinny_max_rows: int  # the skinny kernel up to here (0: never)
    gemm: str = "onednn_f32"  # beyond: "onednn_f32" (float32 copy), "onednn_bf16" (bf16 copy, bf16 inputs)

    @property
    def panels(self) -> bool:
        return self.gemm == PANELS

    def describe(self) -> str:
        if self.panels:
            return "panel kernel at every row count (a row's bits do not depend on the step's rows)"
        gemm = {"onednn_f32": "float32 oneDNN", "onednn_bf16": "bf16 oneDNN (bf16 inputs)"}[self.gemm]
        return f"skinny kernel up to {self.skinny_max_rows} rows, {gemm} beyond"


GEMM_KINDS = ("onednn_f32", "onednn_bf16")
PANELS = "panels"  # not a oneDNN GEMM: the panel kernel at every row count


class CPUDenseWeights(LinearWeights):
    """A float weight laid out for the CPU, for float32 activations:

    - up to `choice.skinny_max_rows` rows (decode): tokenmill's skinny kernel on the
      weight in a tiled layout (`tiled`), float32 or bfloat16. A decode step is a stream of
      weight reads; the kernel reads at 20-28 GB/s where BLAS reads at 10-12, and bfloat16
      halves the bytes;
    - more rows (prefill, large batches): oneDNN on a copy in its blocked layout (`packed`),
      float32 (1.2-1.3x F.linear on the same weights) or, where the CPU computes bf16
      natively (AMX, AVX-512 BF16), bf16 with the inputs rounded to bf16 (4-5x float32);
    - without a packed copy, the skinny kernel a chunk of rows at a time (rebuilding the
      weight for F.linear would rewrite all of it every call);
    - or, where `choice.panels`, neither: the weight in panels (`panels`) for the panel
      kernel at every row count (bf16 weights: activations rounded to bf16), as fast as the
      skinny kernel on decode rows and oneDNN on prompts where it was measured, and a row's
      outputs the same bits whatever else the step holds.
    """

    def __init__(self, weight: torch.Tensor, tile_dtype: torch.dtype, choice: CPUMatmulChoice,
                 onednn: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.choice = choice
        self.tiled: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.packed = None
        if choice.panels:
            self.panels = kernels.pack_panels(weight, tile_dtype)
            return
        self.tiled = kernels.tile_for_skinny(weight, tile_dtype)
        if onednn:
            gemm_dtype = torch.bfloat16 if self.choice.gemm == "onednn_bf16" else torch.float32
            # From the tiles' values: a bf16-tiled weight is the same matrix in both paths.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(tile_dtype).to(gemm_dtype), None)

    @property
    def format_name(self) -> str:
        if self.panels is not None:
            return f"{dtype_name(self.panels.dtype)}-panels"
        packed = "" if self.packed is None else f"+{dtype_name(self.packed.dtype)}-onednn"
        return f"{dtype_name(self.tiled.dtype)}-tiled{packed}"

    @property
    def _stored(self) -> torch.Tensor:
        """The layout the kernels read: panels or skinny tiles."""
        return self.panels if self.panels is not None else self.tiled

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.is_cpu:
            if x.dtype == torch.float32:
                return kernels.panel_linear(x.contiguous(), self.panels, self.out_features)
            return self.apply(x.float()).to(x.dtype)
        if x.dtype == torch.bfloat16 and self.tiled.is_cpu:
            if self.packed is not None and self.packed.dtype == torch.bfloat16 \
                    and x.shape[0] > self.choice.skinny_max_rows:
                return self._onednn(x)  # the bf16 activation path: bf16 in, bf16 out, no casts
            return self.apply(x.float()).to(torch.bfloat16)
        if x.dtype == torch.float32:
            if x.shape[0] <= self.choice.skinny_max_rows:
                return kernels.skinny_linear(x.contiguous(), self.tiled, self.out_features)
            if self.packed is not None:
                if self.packed.dtype == torch.bfloat16:
                    return self._onednn(x.to(torch.bfloat16)).float()
                return self._onednn(x)
            if self.choice.skinny_max_rows > 0:  # no copy: the tiles, a chunk of rows at a time
                chunk = self.choice.skinny_max_rows
                return torch.cat([kernels.skinny_linear(part.contiguous(), self.tiled, self.out_features)
                                  for part in x.split(chunk)])
        return F.linear(x, self.dequantize().to(x.dtype))

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """x (in the packed copy's dtype) times the oneDNN copy, [rows, out] in that dtype."""
        rows = x.shape[0]
        padded = onednn_rows(rows)
        if padded != rows:  # zero rows up to the bucket: one oneDNN primitive per bucket
            x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")[:rows]

    def dequantize(self) -> torch.Tensor:
        if self.panels is not None:
            return kernels.unpack_panels(self.panels, self.out_features).float()
        return kernels.untile_skinny(self.tiled, self.out_features).float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return kernels.panel_rows(self.panels, ids).float()
        return kernels.tiled_rows(self.tiled, ids).float()

    @property
    def nbytes(self) -> int:
        packed = 0 if self.packed is None else self.out_features * self.in_features * self.packed.element_size()
        return self.decode_nbytes + packed

    @property
    def decode_nbytes(self) -> int:
        return self._stored.numel() * self._stored.element_size()

    def move_streamed(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.panels is not None:
            self.panels = place(self.panels)
        else:
            self.tiled = place(self.tiled)

    def fused_decode_operand(self) -> DecodeOperand:
        return DecodeOperand(self._stored, self.out_features, in_features=self.in_features)


# oneDNN compiles a primitive (JIT code and buffers, ~0.6 MB each for the default model's
# matrices on a Zen 4 core) for every (input rows, weight) shape it multiplies, and keeps it
# in two LRU caches: its own (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's, PyTorch's
# wrapper (LRU_CACHE_CAPACITY), 1,024 entries each by default; an entry is freed only when
# both have let it go. A step's row count is the sum of its chunks' tokens, so prompts of
# every length made a new shape nearly every prefill step: under prefix-cache churn the
# server grew by ~620 MB until the caches were full (issue 31). Two bounds: the rows are
# padded up to a bucket (`onednn_rows`: about 8 shapes per doubling), and both caches hold
# ONEDNN_CACHE_CAPACITY entries (`bound_onednn_caches`), unless the user set them.
ONEDNN_CACHE_CAPACITY = 128
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> dict[str, str]:
    """Both oneDNN caches' capacity, set in the environment where the user has not set it.
    oneDNN and ideep read them when the process makes its first primitive, so this is
    called before any (the start of `runner.worker.build_rank`). Returns the values in
    effect."""
    return {name: os.environ.setdefault(name, str(capacity)) for name in ONEDNN_CACHE_VARIABLES}


def onednn_rows(rows: int) -> int:
    """The rows a oneDNN multiply of `rows` rows is run with (zero rows added): a multiple
    of 8 up to 64, beyond a multiple of an eighth of the power of two below `rows` (at most
    12.5% more rows; 65-128 in steps of 8, 129-256 in steps of 16, ...)."""
    if rows <= 64:
        return -(-rows // 8) * 8
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class DenseFormat(WeightFormat):
    """Float weights stored in `weight_dtype`. `cpu_layout`: the CPU kernels' layouts for
    float32 activations (needs the native kernels), multiplied as the plan's `choice` says,
    with a oneDNN copy for many rows when `onednn`; else a plain tensor."""

    def __init__(self, weight_dtype: torch.dtype, cpu_layout: bool = False, onednn: bool = False,
                 choice: CPUMatmulChoice | None = None) -> None:
        if cpu_layout and choice is None:
            raise ValueError("CPU-laid-out weights need the execution plan's matmul choice (runner/plan.py)")
        self.weight_dtype = weight_dtype
        self.cpu_layout = cpu_layout
        self.onednn = onednn and onednn_available()
        self.choice = choice
        self.name = dtype_name(weight_dtype)

    def make(self, weight: torch.Tensor, many_rows: bool = True) -> LinearWeights:
        if self.cpu_layout and kernels.can_tile_for_skinny(weight):
            # An LM head (many_rows False) sees a row per sampling sequence: 64 in a batch of
            # 64 decodes. Its bf16 oneDNN copy (57 MB for the default model) is worth having
            # there (64 rows: 3 ms instead of 21); a float32 one is not (the skinny kernel
            # takes such rows in chunks).
            onednn = self.onednn and (many_rows or self.choice.gemm == "onednn_bf16")
            return CPUDenseWeights(weight, self.weight_dtype, self.choice, onednn)
        return PlainWeights(weight.detach().to(self.weight_dtype))

    @property
    def row_invariant(self) -> bool:
        return self.cpu_layout and self.choice.panels

    def describe(self) -> str:
        if not self.cpu_layout:
            return self.name
        if self.choice.panels:
            inputs = ", inputs rounded to bf16" if self.weight_dtype == torch.bfloat16 else ""
            return f"{self.name} in panels{inputs}; {self.choice.describe()}"
        if not self.onednn:
            return f"{self.name} tiled, skinny kernel up to {self.choice.skinny_max_rows} rows, F.linear beyond"
        return f"{self.name} tiled; {self.choice.describe()}"
