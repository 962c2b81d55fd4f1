"""Pre-quantized Hugging Face checkpoints (GPTQ, AWQ) -> QuantizedTensor, exactly.

Both store int4 (GPTQ also int8) codes packed into int32 words, little nibble first, with
float16 `scales` and packed integer zero points per (group, output feature), and the weight
transposed ([K, N], in_features first):

- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [K * bits / 32, N] packed along K (word i
  of column n holds rows 32/bits * i + j at bits * j), `qzeros` int32 [G, N * bits / 32]
  packed along N the same way, `scales` [G, N], `g_idx` int32 [K] (the group of each input
  column; not sorted with act-order, `desc_act`). w = scale * (q - zero). The classic
  "gptq" checkpoint format stores zero - 1 (vLLM's GPTQ layers add the 1 back); GPTQModel's
  "gptq_v2" stores the zero itself.
- AWQ (AutoAWQ GEMM): `qweight` int32 [K, N / 8] packed along N in the interleaved order
  0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column 8c + order[i]), `qzeros` [G, N / 8] packed
  the same way, `scales` [G, N]. w = scale * (q - zero).

GPTQ `sym=True` means zero = 2**(bits - 1) whatever qzeros holds (as vLLM's GPTQ-Marlin
reads it). Zero points all equal become a symmetric code offset with
the float16 scales kept as stored; otherwise each group gets min = -zero * scale in float32
(exact). Act-order is a column permutation that sorts the columns by group (col_perm).

`prequantized_config` reads a checkpoint's `quantization_config` into what serving it needs
and refuses what cannot be served; the loader hands each linear's tensors to its `convert`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tokenmill.quantization.qtensor import QuantizedTensor, kernel_span

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column order[i] of its 8
GPTQ_FORMATS = ("gptq", "gptq_v2")
SUPPORTED_CHECKPOINTS = "gptq (4- or 8-bit), awq (4-bit gemm), or a float checkpoint"
# A quantized linear's tensors beside its `qweight` (AWQ has no g_idx).
COMPANIONS = (".qzeros", ".scales", ".g_idx")


@dataclass(frozen=True)
class PrequantizedConfig:
    """A checkpoint's `quantization_config` as far as serving it needs."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group per output channel
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"

    @property
    def column_unit(self) -> int:
        """Tensor-parallel cuts along K fall on whole groups."""
        return max(self.group_size, 1)

    def check_in_features(self, in_features: Mapping[str, int]) -> None:
        """Refuse at open a group size the model's linears (named by what sets their K)
        cannot take, before any tensor is read."""
        if self.group_size == -1:
            return
        for what, k in in_features.items():
            if k % self.group_size:
                raise ValueError(f"quantization_config group_size {self.group_size} does not divide the in_features "
                                 f"{k} ({what}) of the model's linears")
            kernel_span(k, self.group_size)

    def convert(self, prefix: str, tensor: Callable[[str], torch.Tensor | None]) -> QuantizedTensor:
        """The linear `prefix`'s tensors (`tensor(".qweight")`, ...; None when absent) ->
        QuantizedTensor [N, K]; a problem names the linear."""
        needed = (".qweight", ".qzeros", ".scales")
        missing = [s for s in needed if tensor(s) is None]
        if missing:
            raise ValueError(f"{self.method} linear {prefix!r} lacks {', '.join(prefix + s for s in missing)}")
        qweight, qzeros, scales = (tensor(s) for s in needed)
        try:
            if self.method == "awq":
                return from_awq(qweight, qzeros, scales, group_size=self.group_size)
            return from_gptq(qweight, qzeros, scales, tensor(".g_idx"), bits=self.bits, group_size=self.group_size,
                             sym=self.sym, desc_act=self.desc_act, checkpoint_format=self.checkpoint_format)
        except ValueError as e:
            raise ValueError(f"{self.method} linear {prefix!r}: {e}") from e


def prequantized_config(config: Mapping | None) -> PrequantizedConfig | None:
    """A Hugging Face `quantization_config` -> what tokenmill serves of it, None for a float
    checkpoint; anything else is refused with what was found and what is supported. Keys
    as transformers' GPTQConfig / AwqConfig write them (AutoAWQ's `w_bit`, `q_group_size`
    too)."""
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    bits = config.get("bits", config.get("w_bit"))
    group_size = config.get("group_size", config.get("q_group_size", -1 if method == "gptq" else 128))
    if method not in ("gptq", "awq"):
        raise ValueError(f"quantization_config quant_method {config.get('quant_method')!r} is not supported; "
                         f"supported: {SUPPORTED_CHECKPOINTS}")
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"quantization_config group_size must be a positive integer or -1, got {group_size!r}")
    if method == "gptq":
        if bits not in (4, 8):
            raise ValueError(f"quantization_config: gptq with bits {bits!r} is not supported; "
                             f"supported: {SUPPORTED_CHECKPOINTS}")
        fmt = str(config.get("checkpoint_format") or "gptq").lower()
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"quantization_config: gptq checkpoint_format {fmt!r} is not supported; "
                             f"supported: {', '.join(GPTQ_FORMATS)}")
        return PrequantizedConfig("gptq", bits, group_size, bool(config.get("sym", True)),
                                  bool(config.get("desc_act", False)), fmt)
    version = str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(f"quantization_config: awq with bits {bits!r}, version {config.get('version')!r} is not "
                         f"supported; supported: {SUPPORTED_CHECKPOINTS}")
    if not config.get("zero_point", True):
        raise ValueError("quantization_config: awq without zero points (zero_point false) is not supported; "
                         f"supported: {SUPPORTED_CHECKPOINTS}")
    return PrequantizedConfig("awq", 4, group_size, sym=False)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits codes (little end first) laid out along `dim`."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32).unsqueeze(-1)
    codes = torch.bitwise_right_shift(p, shifts) & ((1 << bits) - 1)  # [..., per_word]
    if dim in (0, -2):
        codes = codes.movedim(-1, 1)  # [rows, per_word, cols] -> rows * per_word
        return codes.reshape(packed.shape[0] * per_word, packed.shape[1])
    return codes.reshape(packed.shape[0], packed.shape[1] * per_word)


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    bits: int = 4,
    group_size: int,
    sym: bool = True,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
) -> QuantizedTensor:
    """A GPTQ linear's tensors -> QuantizedTensor [N, K]. `group_size` -1 is per channel."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported; supported: 4, 8")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format must be one of {GPTQ_FORMATS}, got {checkpoint_format!r}")
    _check_int32("qweight", qweight)
    _check_int32("qzeros", qzeros)
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    group_size = k if group_size == -1 else group_size
    if group_size <= 0 or k % group_size:
        raise ValueError(f"GPTQ group_size {group_size} does not divide in_features {k}")
    groups = k // group_size
    codes = unpack_int32(qweight, bits, dim=0)  # [K, N]
    zeros = unpack_int32(qzeros, bits, dim=1)  # [G, N]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    _check_shapes("GPTQ", scales, zeros, groups, n)
    perm = None
    if g_idx is not None:
        g_idx = torch.as_tensor(g_idx).long()
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"g_idx must be [{k}] with groups in [0, {groups})")
        if not torch.equal(g_idx, torch.arange(k) // group_size):
            perm = _act_order_perm(g_idx, group_size, groups)
    elif desc_act:
        raise ValueError("a desc_act GPTQ checkpoint needs its g_idx tensor")
    codes = codes.t()
    if perm is not None:
        codes = codes[:, perm]
    if sym:  # as vLLM's GPTQ-Marlin layer: a symmetric checkpoint's zero point is 2**(bits - 1), qzeros unread
        zeros = torch.full_like(zeros, 2 ** (bits - 1))
    return _from_zero_points(codes.contiguous().to(torch.uint8), scales, zeros, bits, group_size, perm)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int) -> QuantizedTensor:
    """An AutoAWQ GEMM linear's tensors (4-bit) -> QuantizedTensor [N, K]."""
    _check_int32("qweight", qweight)
    _check_int32("qzeros", qzeros)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group_size = k if group_size == -1 else group_size
    if group_size <= 0 or k % group_size:
        raise ValueError(f"AWQ group_size {group_size} does not divide in_features {k}")
    codes = _awq_columns(unpack_int32(qweight, 4, dim=1))  # [K, N]
    zeros = _awq_columns(unpack_int32(qzeros, 4, dim=1))  # [G, N]
    _check_shapes("AWQ", scales, zeros, k // group_size, n)
    return _from_zero_points(codes.t().contiguous().to(torch.uint8), scales, zeros, 4, group_size, None)


def _awq_columns(unpacked: torch.Tensor) -> torch.Tensor:
    """Undo AWQ's interleave: within each 8 columns, nibble i holds column AWQ_ORDER[i]."""
    rows, cols = unpacked.shape
    out = torch.empty_like(unpacked).view(rows, cols // 8, 8)
    out[:, :, list(AWQ_ORDER)] = unpacked.view(rows, cols // 8, 8)
    return out.view(rows, cols)


def _from_zero_points(codes, scales, zeros, bits, group_size, perm) -> QuantizedTensor:
    """w = scale * (u - zero) per (row, group), codes [N, K] uint8, scales/zeros [G, N]."""
    scales = scales.t().contiguous()
    zeros = zeros.t().contiguous()
    if bool((zeros == zeros.flatten()[0]).all()) and 0 <= int(zeros.flatten()[0]) < 2**bits:
        return QuantizedTensor.pack(
            codes, scales.float(), bits=bits, group_size=group_size, code_offset=int(zeros.flatten()[0]),
            scale_dtype=torch.float16 if scales.dtype == torch.float16 else torch.float32, col_perm=perm,
        )
    s = scales.float()
    return QuantizedTensor.pack(
        codes, s, -zeros.float() * s, bits=bits, group_size=group_size, scale_dtype=torch.float32, col_perm=perm
    )


def _act_order_perm(g_idx: torch.Tensor, group_size: int, groups: int) -> torch.Tensor:
    counts = torch.bincount(g_idx, minlength=groups)
    if not bool((counts == group_size).all()):
        raise ValueError(f"g_idx must put exactly group_size = {group_size} columns in every group")
    return torch.argsort(g_idx, stable=True)


def _check_int32(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype != torch.int32:
        raise ValueError(f"{name} must be a 2-D int32 tensor, got {tuple(t.shape)} {t.dtype}")


def _check_shapes(fmt: str, scales: torch.Tensor, zeros: torch.Tensor, groups: int, n: int) -> None:
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"{fmt} scales must be [groups, out_features] = [{groups}, {n}], got {tuple(scales.shape)}")
    if tuple(zeros.shape) != (groups, n):
        raise ValueError(f"{fmt} qzeros unpack to {tuple(zeros.shape)}, expected [{groups}, {n}]")
