"""One torch-level representation for every weight-only quantized format.

A `QuantizedTensor` is a weight W [N, K] (y = x W^T) stored as unsigned integer codes u
with one affine map per (row, group of `group_size` consecutive columns):

    w[n, k] = scale[n, g] * u[n, k] + min[n, g],        g = k // group_size

This one form covers every format tokenmill reads (gguf_blocks.py, rtn.py, checkpoints.py):
GGUF Q4_0 (min = -8 d), Q4_1, Q8_0 (u = q + 128, min = -128 d), Q5_0/Q5_1 and Q6_K (codes
held in 8 bits), the K-quants Q4_K/Q5_K (per-32 sub-block scale d * sc and min -dmin * m in
float32), int8 per-channel, int4 group-wise, GPTQ and AWQ. Symmetric formats store no mins:
their min is -code_offset * scale, which the kernel folds into its integer dot products.

The codes, scales and mins live in one uint8 buffer, `packed`, in the order the native
kernel reads them (cpu_quant.cpp), so a decode matmul is one sequential stream per tile:

    packed[tile, span, :] = scales[4 rows][n_sc] | mins[4 rows][n_sc] (if any) | codes
    codes of a span       = for each 64-column step: for each of the tile's 4 rows:
                            64 bytes (8-bit), or 32 bytes (4-bit: byte j holds column j
                            in its low nibble and column 32 + j in its high nibble)

A tile is 4 rows (the last one zero-padded); a span is the columns sharing a run of
scales: 64 columns holding 64 / group_size groups (group_size 16, 32 or 64), or one group
of group_size columns (a multiple of 64; per-channel formats whose K is not one pad their
single group up to one). K is padded with zero codes to whole spans: the kernel pads the
activations with zeros, so padding never contributes. Scales and mins are float16 where the
source format's are (exact: GGUF's legacy types, GPTQ/AWQ symmetric), float32 otherwise.

GPTQ's act-order (`desc_act`) is held as `col_perm`: the codes' column j is the weight's
column col_perm[j], so y = x[:, col_perm] . W_sorted^T; the kernel gathers x that way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

TILE_ROWS = 4  # rows of W per kernel tile
STEP = 64  # columns per kernel step (one 512-bit vector of 8-bit codes)
SCALE_DTYPES = (torch.float16, torch.float32)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A quantized weight [N, K]; build it with `QuantizedTensor.pack` or the converters
    (gguf_blocks.from_gguf_blocks, rtn.quantize_int8/int4, checkpoints.from_gptq/from_awq)."""

    packed: torch.Tensor  # uint8 [tiles, spans, span_bytes], the kernel's stream
    shape: tuple[int, int]  # (N, K)
    bits: int  # storage width of a code: 4 or 8
    group_size: int  # columns per scale group
    scale_dtype: torch.dtype  # of scales and mins in `packed`: float16 or float32
    code_offset: int | None  # symmetric: min = -code_offset * scale, no mins stored; None: mins stored
    col_perm: torch.Tensor | None = None  # int64 [K]: codes' column j is the weight's column col_perm[j]

    # ----- building and taking apart ---------------------------------------------------

    @classmethod
    def pack(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None = None,
        *,
        bits: int,
        group_size: int,
        code_offset: int | None = None,
        scale_dtype: torch.dtype | None = None,
        col_perm: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """codes uint8 [N, K] (< 2**bits, or < 2**(bits of the source) for 5/6-bit codes in
        8-bit storage), scales and mins [N, K / group_size]. Exactly one of `mins` and
        `code_offset` is given. `scale_dtype` defaults to float16 when scales and mins are
        exactly representable in it, else float32."""
        if codes.dim() != 2 or codes.dtype != torch.uint8:
            raise ValueError(f"codes must be a 2-D uint8 tensor, got {tuple(codes.shape)} {codes.dtype}")
        n, k = codes.shape
        _check_format(n, k, bits, group_size)
        groups = k // group_size
        if (mins is None) == (code_offset is None):
            raise ValueError("give either mins (asymmetric) or code_offset (symmetric), not both or neither")
        for name, t in (("scales", scales), ("mins", mins)):
            if t is not None and tuple(t.shape) != (n, groups):
                raise ValueError(f"{name} must be [N, K / group_size] = [{n}, {groups}], got {tuple(t.shape)}")
        if code_offset is not None and not 0 <= code_offset < 2**bits:
            raise ValueError(f"code_offset {code_offset} is not a {bits}-bit code")
        if bits == 4 and n * k and int(codes.max()) > 15:
            raise ValueError("4-bit codes must be below 16")
        if scale_dtype is None:
            scale_dtype = torch.float16 if _fits_float16(scales, mins) else torch.float32
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be float16 or float32, got {scale_dtype}")
        if col_perm is not None:
            col_perm = _check_perm(col_perm, k)
        layout = _Layout(n, k, bits, group_size, scale_dtype, mins is not None)
        packed = layout.pack(codes, scales.to(scale_dtype), None if mins is None else mins.to(scale_dtype))
        return cls(packed, (n, k), bits, group_size, scale_dtype, code_offset, col_perm)

    def codes(self) -> torch.Tensor:
        """uint8 [N, K], in the stored (possibly act-order sorted) column order."""
        return self._layout.codes(self.packed)

    def scales(self) -> torch.Tensor:
        """float32 [N, K / group_size]."""
        return self._layout.scales(self.packed)

    def mins(self) -> torch.Tensor:
        """float32 [N, K / group_size] (computed as -code_offset * scale for symmetric formats)."""
        if self.code_offset is not None:
            return self.scales() * -float(self.code_offset)
        return self._layout.mins(self.packed)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [N, K] in its original column order: the reference every
        kernel is tested against (float32 scale * u + min, rounded once, as gguf does)."""
        codes = self.codes().float()
        scales = self.scales().repeat_interleave(self.group_size, dim=1)
        if self.code_offset is not None:  # scale * (u - offset): exact for every stored format
            w = scales * (codes - float(self.code_offset))
        else:
            w = scales * codes + self.mins().repeat_interleave(self.group_size, dim=1)
        if self.col_perm is not None:
            out = torch.empty_like(w)
            out[:, self.col_perm] = w
            w = out
        return w

    # ----- what the kernels and the engine need ----------------------------------------

    @property
    def format(self) -> tuple[int, int, int, int, int, int]:
        """(N, K, bits, group_size, scale_bytes, code_offset or -1 when mins are stored):
        the `int[] format` argument of the native ops (cpu_kernels.h, QuantWeight)."""
        n, k = self.shape
        offset = -1 if self.code_offset is None else self.code_offset
        return (n, k, self.bits, self._layout.kernel_group, self._layout.scale_bytes, offset)

    @property
    def nbytes(self) -> int:
        """Bytes held (the packed stream, padding included, and the act-order permutation)."""
        extra = 0 if self.col_perm is None else self.col_perm.numel() * self.col_perm.element_size()
        return self.packed.numel() + extra

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.packed.numel() / (self.shape[0] * self.shape[1])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T for x [M, K] float32 or bfloat16: the native kernel at its default row
        split, or, without the kernels, dequantize + F.linear. A standalone convenience: a
        model's weights (formats.QuantizedWeights) call `native_linear` with the plan's rows."""
        from tokenmill.kernels import cpu_kernels_available

        if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and cpu_kernels_available():
            return self.native_linear(x, -1)
        return torch.nn.functional.linear(x, self.dequantize().to(x.dtype))

    def native_linear(self, x: torch.Tensor, max_integer_rows: int, integer_gemm: bool = False,
                      gemm_panels: torch.Tensor | None = None, column_splits: tuple[int, ...] = ()) -> torch.Tensor:
        """y = x W^T by the native kernel (x [M, K] float32 or bfloat16 on the CPU): up to
        `max_integer_rows` rows x is quantized to int8 per 32 and multiplied on integers; beyond,
        the whole-block integer GEMM if `integer_gemm`, else a bf16 GEMM on the dequantized
        weight (see kernels.quant_linear; `gemm_panels`: the GEMM's panels unpacked at load;
        `column_splits`: the sums of consecutive column parts added in order)."""
        from tokenmill.kernels import quant_linear

        return quant_linear(x.contiguous(), self.packed, self.format, self.col_perm, max_integer_rows,
                            integer_gemm=integer_gemm, gemm_panels=gemm_panels, column_splits=column_splits)

    @property
    def gemm_panels_nbytes(self) -> int:
        """Bytes of `kernels.quant_gemm_panels` of this weight (cpu_quant.cpp's PanelStore): panels
        of 16 rows, a byte per code over the padded K, float32 scales (and mins) per group."""
        n, _ = self.shape
        layout = self._layout
        panels = -(-n // 16)
        k_padded = layout.spans * layout.span
        groups = k_padded // layout.kernel_group
        return panels * 16 * (k_padded + groups * 4 * (1 if self.code_offset is not None else 2))

    def lookup_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the weight as float32 [len(index), K] (an embedding lookup in a
        quantized table, e.g. a tied Q8_0 token embedding), original column order: by the
        native kernel when there is one (`native_rows`), else by dequantizing."""
        from tokenmill.kernels import cpu_kernels_available

        if cpu_kernels_available():
            return self.native_rows(index)
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        return self.take_rows(index).dequantize() if index.numel() else torch.empty(0, self.shape[1])

    def native_rows(self, index: torch.Tensor) -> torch.Tensor:
        """lookup_rows by the native dequantize kernel."""
        from tokenmill.kernels import quant_dequantize

        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        rows = quant_dequantize(self.packed, self.format, torch.float32, index)
        if self.col_perm is not None:
            out = torch.empty_like(rows)
            out[:, self.col_perm] = rows
            rows = out
        return rows

    # ----- rows and columns without dequantizing ----------------------------------------

    def take_rows(self, index: torch.Tensor | Sequence[int]) -> QuantizedTensor:
        """Rows `index` in that order (e.g. to undo llama.cpp's Q/K row permutation)."""
        index = torch.as_tensor(index, dtype=torch.long)
        n, _ = self.shape
        if index.dim() != 1 or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= n)):
            raise ValueError(f"row index must be 1-D with values in [0, {n})")
        mins = None if self.code_offset is not None else self._layout.mins(self.packed, raw=True)[index]
        return self._repack(self.codes()[index], self._layout.scales(self.packed, raw=True)[index], mins)

    def narrow_rows(self, start: int, length: int) -> QuantizedTensor:
        """Rows [start, start + length): a view of the stream when start is a multiple of 4
        (tensor-parallel column shards, q/k/v splits), else a repacked copy."""
        n, k = self.shape
        if not (0 <= start and length > 0 and start + length <= n):
            raise ValueError(f"rows [{start}, {start + length}) are not inside [0, {n})")
        if start % TILE_ROWS:
            return self.take_rows(torch.arange(start, start + length))
        tiles = slice(start // TILE_ROWS, -(-(start + length) // TILE_ROWS))
        return replace(self, packed=self.packed[tiles], shape=(length, k))

    @staticmethod
    def cat_rows(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """The rows of `parts` one after another (fusing q/k/v or gate/up): all must share
        K, bits, group size, scale storage, symmetry and column permutation."""
        if not parts:
            raise ValueError("cat_rows needs at least one tensor")
        first = parts[0]
        for p in parts[1:]:
            same_perm = (p.col_perm is None) == (first.col_perm is None) and (
                p.col_perm is None or torch.equal(p.col_perm, first.col_perm)
            )
            if (p.shape[1], p.bits, p.group_size, p.scale_dtype, p.code_offset) != (
                first.shape[1], first.bits, first.group_size, first.scale_dtype, first.code_offset
            ) or not same_perm:
                raise ValueError(
                    "cat_rows needs the same K, bits, group size, scale dtype, code offset and column "
                    f"order in every part; got {p.describe()} after {first.describe()}"
                )
        n = sum(p.shape[0] for p in parts)
        if all(p.shape[0] % TILE_ROWS == 0 and p.packed.is_contiguous() for p in parts[:-1]):  # whole tiles
            return replace(first, packed=torch.cat([p.packed for p in parts]), shape=(n, first.shape[1]))
        codes = torch.cat([p.codes() for p in parts])
        scales = torch.cat([p._layout.scales(p.packed, raw=True) for p in parts])
        mins = None if first.code_offset is not None else torch.cat([p._layout.mins(p.packed, raw=True) for p in parts])
        return first._repack(codes, scales, mins)

    def narrow_cols(self, start: int, length: int) -> QuantizedTensor:
        """Columns [start, start + length) (row-parallel shards along K). The boundaries must
        fall on scale groups (any column for per-channel formats); act-order weights
        cannot be split along K."""
        k = self.shape[1]
        if not (0 <= start and length > 0 and start + length <= k):
            raise ValueError(f"columns [{start}, {start + length}) are not inside [0, {k})")
        if self.col_perm is not None:
            raise ValueError("an act-order (desc_act) weight cannot be split along K: its groups span all columns")
        per_channel = self.group_size == k
        if not per_channel and (start % self.group_size or length % self.group_size):
            raise ValueError(
                f"columns [{start}, {start + length}) do not fall on group boundaries (group_size {self.group_size})"
            )
        groups = slice(0, 1) if per_channel else slice(start // self.group_size, (start + length) // self.group_size)
        mins = None if self.code_offset is not None else self._layout.mins(self.packed, raw=True)[:, groups]
        scales = self._layout.scales(self.packed, raw=True)[:, groups]
        codes = self.codes()[:, start : start + length]
        return QuantizedTensor.pack(
            codes, scales, mins, bits=self.bits, group_size=length if per_channel else self.group_size,
            code_offset=self.code_offset, scale_dtype=self.scale_dtype,
        )

    def describe(self) -> str:
        sym = "mins" if self.code_offset is None else f"offset {self.code_offset}"
        perm = ", act-order" if self.col_perm is not None else ""
        return (f"QuantizedTensor({self.shape[0]}x{self.shape[1]}, {self.bits}-bit codes, group {self.group_size}, "
                f"{str(self.scale_dtype).removeprefix('torch.')} scales, {sym}{perm})")

    __repr__ = describe

    # ----- internals ---------------------------------------------------------------------

    @property
    def _layout(self) -> _Layout:
        n, k = self.shape
        return _Layout(n, k, self.bits, self.group_size, self.scale_dtype, self.code_offset is None)

    def _repack(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> QuantizedTensor:
        return QuantizedTensor.pack(
            codes, scales, mins, bits=self.bits, group_size=self.group_size, code_offset=self.code_offset,
            scale_dtype=self.scale_dtype, col_perm=self.col_perm,
        )


def kernel_span(k: int, group_size: int) -> tuple[int, int]:
    """(columns per span, kernel group size) for a weight of K columns: see the module doc."""
    if group_size % STEP == 0:
        return group_size, group_size
    if STEP % group_size == 0:
        return STEP, group_size
    if group_size == k:  # per-channel: one group padded up to whole steps
        span = -(-k // STEP) * STEP
        return span, span
    raise ValueError(f"group_size {group_size} is not supported: use 16, 32, a multiple of 64, or K (per channel)")


def _check_format(n: int, k: int, bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8 (codes of 5 or 6 bits are held in 8), got {bits}")
    if n <= 0 or k <= 0:
        raise ValueError(f"a quantized weight needs N, K > 0, got {n}x{k}")
    if group_size <= 0 or k % group_size:
        raise ValueError(f"K = {k} is not divisible by the group size {group_size}")
    kernel_span(k, group_size)


def _check_perm(perm: torch.Tensor, k: int) -> torch.Tensor:
    perm = torch.as_tensor(perm, dtype=torch.long).contiguous()
    if perm.shape != (k,) or not torch.equal(torch.sort(perm).values, torch.arange(k)):
        raise ValueError(f"col_perm must be a permutation of range({k})")
    return perm


def _fits_float16(*tensors: torch.Tensor | None) -> bool:
    for t in tensors:
        if t is not None and not torch.equal(t.to(torch.float16).to(t.dtype), t):
            return False
    return True


@dataclass(frozen=True)
class _Layout:
    """Where codes, scales and mins sit in `packed` (module doc); pure reshapes."""

    n: int
    k: int
    bits: int
    group_size: int
    scale_dtype: torch.dtype
    has_mins: bool

    @property
    def span(self) -> int:
        return kernel_span(self.k, self.group_size)[0]

    @property
    def kernel_group(self) -> int:
        return kernel_span(self.k, self.group_size)[1]

    @property
    def tiles(self) -> int:
        return -(-self.n // TILE_ROWS)

    @property
    def spans(self) -> int:
        return -(-self.k // self.span)

    @property
    def groups_per_span(self) -> int:
        return self.span // self.kernel_group

    @property
    def scale_bytes(self) -> int:
        return torch.empty((), dtype=self.scale_dtype).element_size()

    @property
    def scale_block(self) -> int:  # bytes of one tile's scales (or mins) in a span
        return TILE_ROWS * self.groups_per_span * self.scale_bytes

    @property
    def code_bytes(self) -> int:  # bytes of one tile's codes in a span
        return TILE_ROWS * self.span * self.bits // 8

    @property
    def span_bytes(self) -> int:
        return self.scale_block * (2 if self.has_mins else 1) + self.code_bytes

    def pack(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
        # Each part is copied once, straight into its place in the stream (loading a model
        # packs every weight: whole-tensor temporaries and concatenations tripled that time).
        packed = torch.empty(self.tiles, self.spans, self.span_bytes, dtype=torch.uint8)
        self._place_scales(packed, 0, scales)
        if mins is not None:
            self._place_scales(packed, self.scale_block, mins)
        start = self.scale_block * (2 if mins is not None else 1)
        steps, width = self.span // STEP, STEP * self.bits // 8
        c = self._padded(codes.contiguous(), self.spans * self.span).view(self.tiles, TILE_ROWS, self.spans, steps, STEP)
        if self.bits == 4:
            c = torch.bitwise_left_shift(c[..., 32:], 4).bitwise_or_(c[..., :32])
        dst = packed[:, :, start:].view(self.tiles, self.spans, steps, TILE_ROWS, width)
        dst.permute(0, 3, 1, 2, 4).copy_(c)
        return packed

    def _padded(self, t: torch.Tensor, cols: int) -> torch.Tensor:
        """t [n, <= cols] zero-padded to whole tiles of rows and `cols` columns (t itself when
        it already has that shape)."""
        rows = self.tiles * TILE_ROWS
        if tuple(t.shape) == (rows, cols):
            return t
        padded = t.new_zeros(rows, cols)
        padded[: t.shape[0], : t.shape[1]] = t
        return padded

    def _place_scales(self, packed: torch.Tensor, start: int, s: torch.Tensor) -> None:
        # Per-channel formats whose K is padded keep their one group; others pad groups with zeros.
        gps = self.groups_per_span
        raw = self._padded(s.contiguous(), self.spans * gps).view(self.tiles, TILE_ROWS, self.spans, gps)
        dst = packed[:, :, start : start + self.scale_block].view(self.scale_dtype)  # [tiles, spans, 4 * gps]
        dst.view(self.tiles, self.spans, TILE_ROWS, gps).permute(0, 2, 1, 3).copy_(raw)

    def _region(self, packed: torch.Tensor, start: int, size: int) -> torch.Tensor:
        return packed.reshape(-1, self.spans, self.span_bytes)[:, :, start : start + size]

    def _unpack_scales(self, packed: torch.Tensor, start: int) -> torch.Tensor:
        raw = self._region(packed, start, self.scale_block).contiguous().view(self.scale_dtype)
        s = raw.reshape(-1, self.spans, TILE_ROWS, self.groups_per_span).permute(0, 2, 1, 3)
        return s.reshape(-1, self.spans * self.groups_per_span)[: self.n, : self.k // self.group_size]

    def scales(self, packed: torch.Tensor, raw: bool = False) -> torch.Tensor:
        s = self._unpack_scales(packed, 0)
        return s if raw else s.float()

    def mins(self, packed: torch.Tensor, raw: bool = False) -> torch.Tensor:
        s = self._unpack_scales(packed, self.scale_block)
        return s if raw else s.float()

    def codes(self, packed: torch.Tensor) -> torch.Tensor:
        steps = self.span // STEP
        start = self.scale_block * (2 if self.has_mins else 1)
        c = self._region(packed, start, self.code_bytes)
        c = c.reshape(-1, self.spans, steps, TILE_ROWS, self.code_bytes // (steps * TILE_ROWS))
        if self.bits == 4:
            c = torch.cat((c & 0x0F, c >> 4), dim=-1)
        c = c.permute(0, 3, 1, 2, 4).reshape(-1, self.spans * self.span)
        return c[: self.n, : self.k].contiguous()
