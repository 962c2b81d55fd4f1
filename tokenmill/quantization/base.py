"""The weight-format seam: one small interface every storage format implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from tokenmill.kernels.fused_layer import DecodeOperand


class LinearWeights(ABC):
    """A linear layer's weight W [out_features, in_features] in some storage format.

    `apply` computes x @ W^T for any number of rows (each format picks its own kernels
    for few rows and for many); the layer adds its bias. `dequantize` gives the weight as
    float32, the reference every format is tested against.
    """

    out_features: int
    in_features: int

    @property
    @abstractmethod
    def format_name(self) -> str:
        """Short name for logs and facts, e.g. 'float32', 'bfloat16-tiled', 'q4_1'."""

    @abstractmethod
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in x's dtype."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """W as float32 [out_features, in_features]."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the weight occupies (all copies a format keeps)."""

    @property
    def decode_nbytes(self) -> int:
        """Bytes a decode step streams from this weight (one copy)."""
        return self.nbytes

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as float32 [len(ids), in_features]: a tied LM head serves the
        embedding lookup from its own storage, so the table is not kept twice."""
        return self.dequantize()[ids]

    def move_streamed(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Hand each tensor a decode step streams from this weight to `place` and keep what it
        returns: the same values elsewhere (on huge pages: kernels/huge_pages.py). Before the
        fused layer gathers its operands. None by default."""

    @property
    def gemm_panels_nbytes(self) -> int:
        """Bytes `unpack_gemm_panels` would add (0: the format has no such copy)."""
        return 0

    def unpack_gemm_panels(self) -> None:
        """Keep a copy of the weight unpacked for the many-row kernel, so that it is not unpacked
        again on every call (quantized weights on the integer GEMM). None by default."""

    def fused_decode_operand(self) -> DecodeOperand | None:
        """What the native fused decode layer reads for this weight, or None when the
        format has no such path (the execution plan then refuses the fused layer at load)."""
        return None


class WeightFormat(ABC):
    """How every linear weight of a model is stored; chosen once at load."""

    name: str
    # Tensor parallelism cuts a row-parallel weight's columns (K) at multiples of this, so
    # each rank's part holds whole quantization groups; rows (N, column-parallel) are cut
    # anywhere. A rank's part is cut from the checkpoint before `make`, so no rank holds
    # more than its part in this format.
    shard_alignment: int = 1

    @abstractmethod
    def make(self, weight: torch.Tensor, many_rows: bool = True) -> LinearWeights:
        """A float checkpoint weight [N, K] in this format. `many_rows=False`: an LM head,
        which multiplies a row per sampling sequence (few at batch 1, tens in a batch of
        decodes), never a whole prompt: a format may keep less for many rows there."""

    @property
    def float_format(self) -> WeightFormat:
        """The format this one keeps float weights in (itself, unless it quantizes): for a
        weight that is not to be quantized (a mixture of experts' router, as vLLM keeps it)."""
        return self

    @property
    def row_invariant(self) -> bool:
        """Whether a linear computes a row with one arithmetic at every row count (its bits do
        not depend on the step's other rows): the panel kernel, the integer GEMM."""
        return False

    def describe(self) -> str:
        return self.name
