"""Weight-only quantized formats behind the `WeightFormat` seam.

- GGUF blocks as stored (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the loader hands
  the format a `QuantizedTensor` converted exactly from the file's blocks.
- `--quantization int8` (per-output-channel symmetric) and `int4` (group-wise asymmetric,
  round to nearest) computed at load from float weights.
- GPTQ / AWQ checkpoints: the loader converts their packed tensors to a `QuantizedTensor`.

Weights a format cannot keep quantized (a float tensor inside a GGUF, a linear the
checkpoint left in float) go to its dense format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from tokenmill.quantization.base import DecodeOperand, LinearWeights, WeightFormat
from tokenmill.quantization.dense import DenseFormat
from tokenmill.quantization.qtensor import QuantizedTensor

QUANTIZATION_METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


class QuantizedWeights(LinearWeights):
    """A linear weight as a QuantizedTensor, multiplied by the native quantized kernels
    (int8 activations and integer dot products up to `integer_rows` rows, the plan's; for more
    the whole-block integer GEMM where the plan measured it faster (`integer_gemm`), else a
    bf16 GEMM on dequantized tiles; kernels.quant_linear)."""

    def __init__(self, qt: QuantizedTensor, name: str, integer_rows: int, integer_gemm: bool = False) -> None:
        self.qt = qt
        self.name = name
        self.integer_rows = integer_rows
        self.integer_gemm = integer_gemm
        self.out_features, self.in_features = qt.shape
        self.gemm_panels: torch.Tensor | None = None  # unpack_gemm_panels
        # Input columns where each output's sum starts again, the parts' sums added in order
        # (column_parts.py, `split_in_columns`: deterministic inference's row-parallel linears
        # in one call). Empty: one sum.
        self.column_splits: tuple[int, ...] = ()

    @property
    def format_name(self) -> str:
        return self.name

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 rows (the bf16 activation path) go in as they are: the GEMM path multiplies
        # bf16 anyway and then returns bf16 without casts.
        if x.dtype not in (torch.float32, torch.bfloat16):
            return self.qt.native_linear(x.float(), self.integer_rows, self.integer_gemm, self.gemm_panels,
                                         self.column_splits).to(x.dtype)
        return self.qt.native_linear(x, self.integer_rows, self.integer_gemm, self.gemm_panels, self.column_splits)

    def dequantize(self) -> torch.Tensor:
        return self.qt.dequantize()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qt.native_rows(ids)

    @property
    def nbytes(self) -> int:
        return self.qt.nbytes + (0 if self.gemm_panels is None else self.gemm_panels.numel())

    @property
    def decode_nbytes(self) -> int:
        return self.qt.nbytes  # a one-row step reads the packed stream; the GEMM's panels are its own copy

    @property
    def gemm_panels_nbytes(self) -> int:
        """Bytes of the integer GEMM's panels of this weight, where the plan runs the GEMM and it
        covers the weight (groups of 32 or more), else 0."""
        from tokenmill.kernels import quant_integer_gemm_built

        if not self.integer_gemm or self.gemm_panels is not None or self.qt.format[3] % 32 or \
                not quant_integer_gemm_built():
            return 0
        return self.qt.gemm_panels_nbytes

    def unpack_gemm_panels(self) -> None:
        """The integer GEMM's panels unpacked once (kernels.quant_gemm_panels): the GEMM then
        skips unpacking the weight on every call, with the same bits (the default model's Q8_0
        LM head, 32 rows: 4.6 -> 3.3 ms a call)."""
        if self.gemm_panels_nbytes:
            from tokenmill.kernels import quant_gemm_panels

            self.gemm_panels = quant_gemm_panels(self.qt.packed, self.qt.format)

    def move_streamed(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.qt = replace(self.qt, packed=place(self.qt.packed))

    def fused_decode_operand(self) -> DecodeOperand:
        return DecodeOperand(self.qt.packed, self.out_features, tuple(self.qt.format), self.qt.col_perm,
                             self.in_features, integer_rows=self.integer_rows, integer_gemm=self.integer_gemm,
                             gemm_panels=self.gemm_panels, column_splits=self.column_splits)


class QuantizedFormat(WeightFormat):
    """Quantized linear weights; `method`: "stored" (the checkpoint's own quantized tensors,
    GGUF blocks or GPTQ/AWQ, float tensors go dense), "int8" or "int4" (from float weights).
    `integer_rows`: code width -> rows up to which the integer kernel runs (the plan's);
    `integer_gemm`: more rows run the whole-block integer GEMM, not the bf16 GEMM (measured)."""

    def __init__(self, method: str, dense: DenseFormat, group_size: int, integer_rows: dict[int, int],
                 integer_gemm: bool = False) -> None:
        if method not in ("stored", *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} (or the checkpoint's own), "
                             f"got {method!r}")
        if method == "int4" and group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {GROUP_SIZES}, got {group_size}")
        self.method = method
        self.dense = dense
        self.group_size = group_size
        self.integer_rows = integer_rows
        self.integer_gemm = integer_gemm
        # Tensor-parallel cuts along K fall on whole scale groups (GGUF blocks: 32 columns,
        # K-quant super-blocks 256, which the loader's column unit adds).
        self.shard_alignment = {"stored": 32, "int8": 1, "int4": group_size}[method]
        self.name = {"stored": "as stored", "int8": "int8", "int4": f"int4-g{group_size}"}[method]

    @property
    def float_format(self) -> WeightFormat:
        return self.dense

    @property
    def row_invariant(self) -> bool:
        return self.integer_gemm  # integer dot products up to the integer rows, the integer GEMM past them

    def make(self, weight: torch.Tensor | QuantizedTensor, many_rows: bool = True) -> LinearWeights:
        if isinstance(weight, QuantizedTensor):
            return self._weights(weight, describe_quantized(weight))
        if self.method == "stored":
            return self.dense.make(weight, many_rows)
        from tokenmill.quantization import rtn

        # The LM head is kept at 8 bits under int4, as llama.cpp's *_K_M files keep their
        # output matrix at 6 bits: its error goes straight into every logit.
        if self.method == "int8" or not many_rows:
            return self._weights(rtn.quantize_int8(weight.float()), "int8")
        return self._weights(rtn.quantize_int4(weight.float(), self.group_size), self.name)

    def _weights(self, qt: QuantizedTensor, name: str) -> QuantizedWeights:
        return QuantizedWeights(qt, name, self.integer_rows[qt.bits], self.integer_gemm)

    def describe(self) -> str:
        if min(self.integer_rows.values()) >= 2**31 - 1:  # deterministic inference's plan
            many = "integer kernels at every row count"
        else:
            many = ("integer GEMM" if self.integer_gemm else "bf16 GEMM") + " past the integer rows"
        if self.method == "stored":
            return f"quantized as stored, {many} (float tensors: {self.dense.describe()})"
        return f"{self.name} quantized at load (LM head int8; native quantized kernels, {many})"


def describe_quantized(qt: QuantizedTensor) -> str:
    """A short name of a quantized weight's storage, e.g. 'q4-g32' or 'q8-channel'."""
    group = "channel" if qt.group_size >= qt.shape[1] else f"g{qt.group_size}"
    return f"q{qt.bits}-{group}"
