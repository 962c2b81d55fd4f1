"""Dense float weights: as a plain tensor (any device), or laid out for the CPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.quantization.base import LinearWeights, WeightFormat

SKINNY_MAX_ROWS = 16  # up to here the tiled kernel beats oneDNN (measured: docs/benchmarks.md)

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class PlainWeights(LinearWeights):
    """A float weight used as it is: F.linear (BLAS/oneDNN on CPU, cuBLAS on GPU)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    @property
    def format_name(self) -> str:
        return _NAMES.get(self.weight.dtype, str(self.weight.dtype))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class CPUDenseWeights(LinearWeights):
    """A float weight laid out for the CPU, for float32 activations:

    - up to SKINNY_MAX_ROWS rows (decode): tokenmill's skinny kernel on the weight in a
      tiled layout (`tiled`), float32 or bfloat16. A decode step is a stream of weight
      reads; the kernel reads at 20-28 GB/s where BLAS reads at 10-12, and bfloat16 halves
      the bytes;
    - more rows (prefill, large batches): oneDNN on a float32 copy in its blocked layout
      (`packed`), 1.2-1.3x F.linear on the same weights, when kept;
    - otherwise F.linear on the weight rebuilt from the tiles.
    """

    def __init__(self, weight: torch.Tensor, tile_dtype: torch.dtype, onednn: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), None) if onednn else None
        self.tiled = kernels.tile_for_skinny(weight, tile_dtype)

    @property
    def format_name(self) -> str:
        return f"{_NAMES[self.tiled.dtype]}-tiled" + ("+float32-onednn" if self.packed is not None else "")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if x.shape[0] <= SKINNY_MAX_ROWS:
                return kernels.skinny_linear(x.contiguous(), self.tiled, self.out_features)
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
        return F.linear(x, self.dequantize().to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return kernels.untile_skinny(self.tiled, self.out_features).float()

    @property
    def nbytes(self) -> int:
        packed = self.out_features * self.in_features * 4 if self.packed is not None else 0
        return self.tiled.numel() * self.tiled.element_size() + packed

    @property
    def decode_nbytes(self) -> int:
        return self.tiled.numel() * self.tiled.element_size()

    def fused_decode_operand(self) -> torch.Tensor:
        return self.tiled


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class DenseFormat(WeightFormat):
    """Float weights stored in `weight_dtype`. `cpu_layout`: the CPU kernels' layouts for
    float32 activations (needs the native kernels); else a plain tensor."""

    def __init__(self, weight_dtype: torch.dtype, cpu_layout: bool = False, onednn: bool = False) -> None:
        self.weight_dtype = weight_dtype
        self.cpu_layout = cpu_layout
        self.onednn = onednn and onednn_available()
        self.name = _NAMES.get(weight_dtype, str(weight_dtype))

    def make(self, weight: torch.Tensor) -> LinearWeights:
        if self.cpu_layout and kernels.can_tile_for_skinny(weight):
            return CPUDenseWeights(weight, self.weight_dtype, self.onednn)
        return PlainWeights(weight.detach().to(self.weight_dtype))

    def describe(self) -> str:
        if not self.cpu_layout:
            return self.name
        return f"{self.name} tiled for decode" + (", float32 oneDNN copies for prefill" if self.onednn else "")
