"""A weight whose products over consecutive column parts are added in order: deterministic
inference's row-parallel linears (`split_in_columns`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill import kernels
from tokenmill.kernels.fused_layer import DecodeOperand, FusedLayerOperands
from tokenmill.quantization.base import LinearWeights, WeightFormat
from tokenmill.quantization.dense import CPUDenseWeights
from tokenmill.quantization.formats import QuantizedWeights
from tokenmill.quantization.qtensor import QuantizedTensor


def split_in_columns(fmt: WeightFormat, weight, cuts: tuple[int, ...], many_rows: bool = True) -> LinearWeights:
    """`weight` [N, K] in `fmt`, its products over the column parts cut before `cuts` added in
    order (x W^T = x[:, :c] W[:, :c]^T + x[:, c:] W[:, c:]^T, each part's sum from zero).
    A quantized weight whose parts are its own groups runs whole, the block-order kernels
    keeping each part's sum apart (QuantizedWeights.column_splits): the same bits as the parts
    computed apart, in one call (one activation quantization, no padded part, no copies), for
    float32 activations (deterministic inference's); otherwise the parts are stored and
    computed apart (ColumnParts)."""
    if kernels.quant_integer_gemm_built() and _may_split(fmt, weight, cuts):  # the block-order kernels
        whole = fmt.make(weight, many_rows=many_rows)
        if isinstance(whole, QuantizedWeights) and _parts_are_groups(whole.qt, cuts, isinstance(weight, QuantizedTensor)):
            whole.column_splits = cuts
            return whole
    return ColumnParts.make(fmt, weight, cuts, many_rows)


def _may_split(fmt: WeightFormat, weight, cuts: tuple[int, ...]) -> bool:
    """Whether `fmt` makes `weight` a quantized weight that may run whole with these cuts, as far
    as is known before making it (else it goes to parts without being formatted whole first)."""
    if isinstance(weight, QuantizedTensor):
        return _parts_are_groups(weight, cuts, stored=True)
    group = getattr(fmt, "group_size", 0)  # a QuantizedFormat's for weights it quantizes (int4)
    return getattr(fmt, "method", None) == "int4" and group % 32 == 0 and all(c % group == 0 for c in cuts)


def _parts_are_groups(qt: QuantizedTensor, cuts: tuple[int, ...], stored: bool) -> bool:
    """Whether cutting `qt` before `cuts` gives the parts a rank of the split holds (`_columns`):
    whole groups of 32 or more, no act-order permutation, and, for a weight quantized here from
    float values, float16 scales (a part's own quantization picks float32 scales only when its
    values are too large for float16, and its values are among the whole's)."""
    group, scale_bytes = qt.format[3], qt.format[4]
    return (qt.col_perm is None and group % 32 == 0 and all(c % group == 0 for c in cuts)
            and (stored or scale_bytes == 2))


class ColumnParts(LinearWeights):
    """A weight computed as consecutive column (input, K) parts, each in its own format
    instance, their products added in order: x W^T = x[:, :c] W[:, :c]^T + x[:, c:] W[:, c:]^T.
    Deterministic inference stores the row-parallel linears so (ModelParallel.reduce_as):
    one process then adds the same partial products, in the same order, as the ranks of a
    2-way tensor-parallel split and their all-reduce do, and the two give the same bits."""

    def __init__(self, parts: list[LinearWeights]) -> None:
        self.parts = parts
        self.out_features = parts[0].out_features
        self.in_features = sum(p.in_features for p in parts)
        self._native_operand: DecodeOperand | None = None  # the parts' native operands, gathered once

    @classmethod
    def make(cls, fmt: WeightFormat, weight, cuts: tuple[int, ...], many_rows: bool = True) -> ColumnParts:
        """`weight` [N, K] (a float tensor or a QuantizedTensor, cut in its groups) in `fmt`,
        cut before the columns `cuts`."""
        bounds = [0, *cuts, weight.shape[1]]
        return cls([fmt.make(_columns(weight, start, stop), many_rows=many_rows)
                    for start, stop in zip(bounds, bounds[1:])])

    @property
    def format_name(self) -> str:
        return self.parts[0].format_name

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        native = self._native_args(x)
        if native is not None:  # one native call: no Python between the parts (same kernels, same bits)
            tensors, formats, perms, _ = FusedLayerOperands.flatten([self._operand()])
            panels = FusedLayerOperands.flatten_gemm_panels([self._operand()])
            return kernels.column_parts_linear(x, tensors, formats, perms, *native, gemm_panels=panels)
        y, start = None, 0
        for part in self.parts:
            product = part.apply(x[:, start : start + part.in_features].contiguous())
            y = product if y is None else torch.add(y, product)  # as the all-reduce adds the ranks' products
            start += part.in_features
        return y

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], dim=1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def decode_nbytes(self) -> int:
        return sum(p.decode_nbytes for p in self.parts)

    def move_streamed(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for part in self.parts:
            part.move_streamed(place)
        self._native_operand = None

    @property
    def gemm_panels_nbytes(self) -> int:
        return sum(p.gemm_panels_nbytes for p in self.parts)

    def unpack_gemm_panels(self) -> None:
        for part in self.parts:
            part.unpack_gemm_panels()
        self._native_operand = None

    def _operand(self) -> DecodeOperand | None:
        if self._native_operand is None:
            self._native_operand = self.fused_decode_operand()
        return self._native_operand

    def _native_args(self, x: torch.Tensor) -> tuple[int, bool] | None:
        """(max_integer_rows, integer_gemm) with which `kernels.column_parts_linear` runs
        exactly the kernels each part's `apply` would for float32 `x`, or None when it would
        not (oneDNN rows of a dense weight, no native operand)."""
        if x.dtype != torch.float32 or not x.is_cpu or self._operand() is None:
            return None
        first = self.parts[0]
        if all(isinstance(p, QuantizedWeights) for p in self.parts):
            return first.integer_rows, first.integer_gemm
        if all(isinstance(p, CPUDenseWeights) for p in self.parts) and \
                (first.panels is not None or x.shape[0] <= first.choice.skinny_max_rows):
            return -1, False
        return None

    def fused_decode_operand(self) -> DecodeOperand | None:
        operands = [p.fused_decode_operand() for p in self.parts]
        if any(o is None for o in operands):
            return None
        return DecodeOperand(operands[0].tensor, self.out_features, in_features=self.in_features,
                             column_parts=tuple(operands))


def _columns(weight, start: int, stop: int):
    """Columns [start, stop) of a weight, as a tensor-parallel rank receives them
    (model/llama.py, `_rank_part`): a quantized tensor cut in its groups, or, where the cut
    falls inside a group (or the weight is act-order), dequantized and then cut."""
    if isinstance(weight, torch.Tensor):
        return weight[:, start:stop].contiguous()
    try:
        return weight.narrow_cols(start, stop - start)
    except ValueError:
        return weight.dequantize()[:, start:stop].contiguous()
