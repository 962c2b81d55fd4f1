"""Native CPU kernels, compiled on this machine with `torch.utils.cpp_extension`.

The sources live in `csrc/`. `make setup` builds them once (`python -m tokenmill.kernels`)
into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions),
so an engine start only loads the built library. They are compiled with
`-march=native`, so the build is named by a digest of the sources, the CPU's SIMD flags
and the torch version (`build_name()`): a cache copied to a CPU with other vector units
rebuilds instead of dying of an illegal instruction, and two checkouts with different
sources keep a build each instead of evicting each other.

Every kernel has a pure-PyTorch fallback that the tests compare it against; the engine
uses the fallback when the build fails (no compiler) or when its config says so
(`native_kernels`, default from `TOKENMILL_KERNELS`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tokenmill.kernels.fused_layer import PANEL_COLS, FusedLayerOperands

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name for name in ("cpu_attention.cpp", "cpu_linear.cpp", "cpu_ops.cpp", "cpu_decoder.cpp", "cpu_quant.cpp",
                              "cpu_prefill_attention.cpp", "cpu_activations.cpp")
]
_OPS = ("argmax_rows", "paged_decode_attention", "skinny_linear", "panel_linear", "grouped_skinny_linear", "rms_norm", "add_rms_norm", "silu_and_mul", "rotary_",
        "llama_decode_layer", "column_parts_linear", "write_kv_cache", "hadamard_", "quant_linear", "quant_dequantize",
        "quantize_activations_q8", "quant_isa", "quant_gemm_panels", "prefill_attention", "prefill_attention_chunks",
        "has_prefill_attention", "activation_cache_stats")
_NAME = "tokenmill_cpu_kernels"


@functools.cache
def build_name() -> str:
    """`tokenmill_cpu_kernels_<digest>` of what the binary depends on: sources, CPU flags,
    torch, and where it is used: the venv (sys.prefix) and the source directory. torch
    rebuilds a cached extension whose build arguments changed (our include path is the
    checkout's), so two venvs or checkouts sharing one name rebuilt it in turn, 25-90 s at
    each start-up (issue 31); with their own names each builds once."""
    from tokenmill.hardware import cpu_info

    digest = hashlib.sha256()
    digest.update(f"{sys.prefix}\0{_CSRC.resolve()}\0".encode())
    for path in sorted(_CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(sorted(cpu_info().flags)).encode())
    digest.update(torch.__version__.encode())
    return f"{_NAME}_{digest.hexdigest()[:12]}"


@functools.cache
def cpu_kernels_available() -> bool:
    """Builds (first time) or loads the CPU kernels; False, with a warning, if that fails."""
    try:
        build_cpu_kernels()
    except Exception as exc:  # a missing compiler must not stop the engine
        logger.warning("native CPU kernels unavailable, using the PyTorch fallback: %s", exc)
        return False
    return True


def build_cpu_kernels(verbose: bool = False) -> None:
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    load(
        name=build_name(),
        sources=[str(s) for s in _SOURCES],
        # -fopenmp: at::parallel_for is OpenMP in the header, so without it the kernels run
        # on one thread. The libgomp.so.1 they need is the one torch already loaded.
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
        extra_include_paths=[str(_CSRC)],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=verbose,
    )
    missing = [op for op in _OPS if not hasattr(torch.ops.tokenmill, op)]
    if missing:  # a stale build in the extension cache
        raise RuntimeError(f"the built kernels lack {missing}; delete {build_name()} under TORCH_EXTENSIONS_DIR and rebuild")
    logger.info("native CPU kernels ready in %.1f s", time.perf_counter() - start)


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,
) -> None:
    """out[s] = softmax(q[s] K_s^T * scale) V_s over sequence s's first context_lens[s]
    cached tokens (`window` > 0: its last `window` of them, a sliding-window layer's), read
    through its block table (int32 [num_seqs, max_blocks]). An int8/fp8 cache comes with its
    float16 scales per (token, head), `kv_scales` = (k, v) (reference: `LayerKVCache.read`
    then SDPA). A row's keys are reduced in position order whatever else is in the call. A
    bf16 cache on a CPU with AVX-512 BF16 is read with bf16 dot products (q and the softmax
    weights rounded to bf16, float32 sums), as torch's flash attention computes bf16."""
    torch.ops.tokenmill.paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale,
                                               *(kv_scales or (None, None)), window)


@functools.cache
def has_prefill_attention(head_dim: int) -> bool:
    """Whether this build has the native bf16 prefill attention for this head_dim (AVX-512
    BF16 dot products; head_dim 32, 64, 96 or 128)."""
    return bool(torch.ops.tokenmill.has_prefill_attention(head_dim))


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      key_slots: torch.Tensor | None = None) -> None:
    """out [n, heads, d] = softmax(q k^T * scale) v, bf16 (rows of d contiguous, any other
    strides), q [n, heads, d] over k, v [L, kv_heads, d], L >= n, bottom-right causal (query
    row i sees keys 0 .. L - n + i), float32 scores and softmax, probabilities rounded to bf16
    for the value product (what SDPA's bf16 flash kernel computes; reference: SDPA).
    `key_slots` (int64 [L]): k and v are a bf16 paged cache viewed as [slots, kv_heads, d] and
    key j is its row key_slots[j], read in place (the bits of gathering k[key_slots] first)."""
    torch.ops.tokenmill.prefill_attention(out, q, k, v, scale, key_slots)


def prefill_attention_chunks(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             scale: float, row_starts: torch.Tensor, key_slots: torch.Tensor,
                             key_starts: torch.Tensor) -> None:
    """Every prompt chunk of a step in one call, each row with the bits `prefill_attention`
    gives its chunk alone: chunk c is rows row_starts[c] .. row_starts[c + 1] of q and out [N,
    heads, d], over the keys in rows key_slots[key_starts[c] : key_starts[c + 1]] of a bf16
    paged cache viewed as [slots, kv_heads, d] (its context and itself, in position order).
    A key block several chunks hold in the same slots (a shared prefix) is packed once."""
    torch.ops.tokenmill.prefill_attention_chunks(out, q, k_cache, v_cache, scale, row_starts, key_slots, key_starts)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   kv_scales: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor) -> None:
    """K and V rows (float32 [tokens, kv_heads, head_dim], rows contiguous) into their cache
    slots (int64): cast, or quantized to int8/fp8 with a scale per (token, head), to the
    bytes `LayerKVCache.write` (the reference) gives. A bad slot writes nothing."""
    torch.ops.tokenmill.write_kv_cache(k, v, *kv_cache, *(kv_scales or (None, None)), slots)


def hadamard_(x: torch.Tensor, block: int) -> None:
    """x [tokens, heads, head_dim] float32 (rows contiguous) <- x times the block-diagonal
    orthonormal Hadamard matrix, in place, by fast Walsh-Hadamard transforms (reference:
    `kv_quant.rotate`)."""
    torch.ops.tokenmill.hadamard_(x, block)


SKINNY_TILE_ROWS, SKINNY_K_BLOCK = 4, 16  # the tiled weight layout of skinny_linear


def can_tile_for_skinny(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % SKINNY_K_BLOCK == 0 and weight.dtype in (torch.float32, torch.bfloat16)


def tile_for_skinny(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 4), K / 16, 4, 16] in `dtype`: tiles of four rows whose
    elements the kernel reads strictly in memory order (see cpu_linear.cpp)."""
    n, k = weight.shape
    if k % SKINNY_K_BLOCK:
        raise ValueError(f"skinny_linear needs in_features divisible by {SKINNY_K_BLOCK}, got {k}")
    w = weight.detach().to(dtype or weight.dtype)
    pad = -n % SKINNY_TILE_ROWS
    if pad:
        w = torch.cat((w, w.new_zeros(pad, k)))
    return w.view(-1, SKINNY_TILE_ROWS, k // SKINNY_K_BLOCK, SKINNY_K_BLOCK).transpose(1, 2).contiguous()


def untile_skinny(tiled: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of tile_for_skinny: [N, K] (same dtype), a new tensor."""
    tiles, blocks = tiled.shape[:2]
    return tiled.transpose(1, 2).reshape(tiles * SKINNY_TILE_ROWS, blocks * SKINNY_K_BLOCK)[:n]


def tiled_rows(tiled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight a tile_for_skinny layout holds: [len(ids), K] (same dtype)."""
    ids = ids.reshape(-1)
    tiles, blocks = tiled.shape[:2]
    picked = tiled[ids // SKINNY_TILE_ROWS, :, ids % SKINNY_TILE_ROWS]  # [n, K / 16, 16]
    return picked.reshape(ids.shape[0], blocks * SKINNY_K_BLOCK)


def skinny_linear(x: torch.Tensor, tiled: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ W[n, K]^T with W given by tile_for_skinny (float32
    or bfloat16). Built for few rows; any M works."""
    return torch.ops.tokenmill.skinny_linear(x, tiled, n)


def pack_panels(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] -> panel_linear's layout in `dtype`: panels of 64 outputs, k-major
    (cpu_linear.cpp); float32 [ceil(N/64), K, 64], bf16 [ceil(N/64), K/2, 64, 2] (pairs of
    consecutive k, as vdpbf16ps reads them). Rows past N are zero."""
    n, k = weight.shape
    if dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"bf16 panels need an even in_features, got {k}")
    w = weight.detach().to(dtype)
    pad = -n % PANEL_COLS
    if pad:
        w = torch.cat((w, w.new_zeros(pad, k)))
    w = w.view(-1, PANEL_COLS, k)
    if dtype == torch.bfloat16:
        return w.view(w.shape[0], PANEL_COLS, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_panels: [N, K] (same dtype), a new tensor."""
    if panels.dim() == 4:
        return panels.permute(0, 2, 1, 3).reshape(panels.shape[0] * PANEL_COLS, -1)[:n]
    return panels.transpose(1, 2).reshape(panels.shape[0] * PANEL_COLS, -1)[:n]


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight held in panels: [len(ids), K] (same dtype)."""
    ids = ids.reshape(-1)
    picked = panels[ids // PANEL_COLS, :, ids % PANEL_COLS]  # [n, K] or [n, K/2, 2]
    return picked.reshape(ids.shape[0], -1)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ W[n, K]^T with W given by pack_panels: every output a
    float32 sum over K in order (bf16 panels: x rounded to bf16, products of pairs), the
    same bits for a row at any M and thread count."""
    return torch.ops.tokenmill.panel_linear(x, panels, n)


def panel_linear_built(dtype: torch.dtype) -> bool:
    """Whether this build has panel_linear for `dtype` panels: AVX-512 (float32), AVX-512
    BF16 (bf16)."""
    return cpu_kernels_available() and torch.ops.tokenmill.panel_linear_built(dtype)


def grouped_skinny_linear(x: torch.Tensor, offsets: Sequence[int], tiled: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """Rows offsets[g]:offsets[g + 1] of x [M, K] float32 (contiguous) times the g-th tiled
    weight [n, K] (all of one shape and dtype), as one parallel loop: a mixture of experts'
    matrix for the step's tokens grouped by expert. [M, n]."""
    return torch.ops.tokenmill.grouped_skinny_linear(x, list(offsets), list(tiled), n)


def quant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    format: Sequence[int],
    col_perm: torch.Tensor | None = None,
    max_integer_rows: int = -1,
    many_rows: int = -1,
    integer_gemm: bool = False,
    gemm_panels: torch.Tensor | None = None,
    column_splits: Sequence[int] = (),
) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 (contiguous) @ W^T for a quantized W given as a
    QuantizedTensor's `packed`, `format` and `col_perm` (tokenmill/quantization/qtensor.py):
    [M, N] in x's dtype.
    Up to `max_integer_rows` rows x is quantized to int8 per 32 (llama.cpp's Q8_1) and
    multiplied on integers; beyond, W is dequantized to bf16 for a GEMM. The engine passes the
    execution plan's row count (runner/plan.py, `RowThresholds.quant_integer_rows`); -1 is the
    op's built-in default, equal to the plan's (the fused decode layer uses that one).
    From `many_rows` rows on (-1: the op's default, 16) the integer path runs its many-row
    kernel, whose every output is bit for bit the row kernel's (AVX512-VNNI builds; others
    keep the row kernel); a large `many_rows` keeps the row kernel at any row count.
    `integer_gemm`: past `max_integer_rows` rows, the whole-block integer GEMM (int32 sums over
    each 32-column block, then one scale product; weight groups of 32 or more; groups of 16,
    Q6_K's, the integer kernel's many-row form) instead of the bf16 GEMM, on AVX512-VNNI builds
    (others: the bf16 GEMM): the plan turns it on where measured faster. A row then gets the
    row kernel's bits at any row count.
    `column_splits`: columns (multiples of 32 and of the weight's group) where each output's
    sum starts again, the parts' sums then added in order: what the products of W's column
    parts, each times its own input columns, added in order give, bit for bit, in one call
    (deterministic inference's row-parallel linears; the block-order kernels only: AVX512-VNNI
    builds, groups of 32 or more, no act-order permutation, `integer_gemm` past the integer
    rows; otherwise an error)."""
    return torch.ops.tokenmill.quant_linear(x, packed, format, col_perm, max_integer_rows, many_rows, integer_gemm,
                                            gemm_panels, list(column_splits))


def quant_gemm_panels(packed: torch.Tensor, format: Sequence[int]) -> torch.Tensor:
    """The integer GEMM's panels of a quantized W, unpacked once (uint8; `panels` of
    quant_linear): the GEMM then reads them instead of unpacking W on every call."""
    return torch.ops.tokenmill.quant_gemm_panels(packed, format)


def quant_dequantize(
    packed: torch.Tensor, format: Sequence[int], dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The quantized W (or its rows `rows`, e.g. embedding lookups) as float32 or bfloat16
    [rows, K], in the stored column order."""
    return torch.ops.tokenmill.quant_dequantize(packed, format, dtype, rows)


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32, K % 32 == 0 -> (int8 q [M, K], float32 d [M, K / 32]) as quant_linear
    quantizes its input: d = max|x| / 127 per 32 values, q = round-half-even(x * 127 / max|x|)."""
    return torch.ops.tokenmill.quantize_activations_q8(x)


def quant_integer_gemm_built() -> bool:
    """Whether quant_linear's whole-block integer GEMM (`integer_gemm`) is in this build:
    AVX512-VNNI CPUs; elsewhere `integer_gemm` runs the bf16 GEMM."""
    return cpu_kernels_available() and quant_isa() == "avx512_vnni"


def quant_isa() -> str:
    """The integer dot product this build of quant_linear uses: avx512_vnni, avx_vnni, avx2, scalar."""
    return torch.ops.tokenmill.quant_isa()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, row by row; x [tokens, hidden] float32 or bfloat16,
    computed in float32, the result in `out_dtype` (default x's; bf16 rounded to nearest even)."""
    return torch.ops.tokenmill.rms_norm(x, weight, eps, out_dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """residual (float32) += x (float32 or bfloat16) in place, then returns
    rms_norm(residual, weight, eps) in `out_dtype` (default x's)."""
    return torch.ops.tokenmill.add_rms_norm(x, residual, weight, eps, out_dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for logits [rows, V]: the native op for float32 rows on the CPU (first of
    equal maxima, the first NaN where there is one, as torch), torch's reduction otherwise."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_cpu and x.stride(1) == 1 and x.shape[1] > 0 \
            and cpu_kernels_available():
        return torch.ops.tokenmill.argmax_rows(x)
    return x.argmax(dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[tokens, 2I] holding gate | up -> silu(gate) * up, [tokens, I], in x's dtype (float32
    or bfloat16; computed in float32)."""
    return torch.ops.tokenmill.silu_and_mul(x)


def activation_cache_stats() -> tuple[int, int]:
    """(buffers, bytes) the kernels' output cache holds free for the next large output
    (csrc/cpu_activations.cpp: outputs of 1 MiB or more reuse freed buffers' resident pages)."""
    count, nbytes = torch.ops.tokenmill.activation_cache_stats()
    return int(count), int(nbytes)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half rotary embedding in place on x [tokens, heads, head_dim] float32 or
    bfloat16 (rows contiguous, any other strides; computed in float32); cos/sin [tokens,
    head_dim / 2]."""
    torch.ops.tokenmill.rotary_(x, cos, sin)


def column_parts_linear(x: torch.Tensor, tensors: list[torch.Tensor], formats: list[int],
                        perms: list[torch.Tensor | None], max_integer_rows: int = -1,
                        integer_gemm: bool = False, gemm_panels: list[torch.Tensor | None] = ()) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a weight in consecutive column parts (quantization's
    ColumnParts; the fused layer's format rows): each part times its own input columns,
    quantized parts as `quant_linear` with these settings, tiled ones by the skinny kernel,
    the products added in order. `gemm_panels`: the parts' panels unpacked at load (one per
    part, None where absent), or none."""
    return torch.ops.tokenmill.column_parts_linear(x.contiguous(), tensors, formats, perms, list(gemm_panels),
                                                   max_integer_rows, integer_gemm)


def llama_decode_layer(
    h: torch.Tensor,
    residual: torch.Tensor,
    layer: FusedLayerOperands,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_rotation: int = 0,
) -> torch.Tensor:
    """One Llama decoder layer over decode tokens (cpu_decoder.cpp): adds h into residual
    (in place), runs attention (writing K/V at `slots`) and the MLP, returns the MLP output.
    `layer` holds the layer's norms, weights and head shape, gathered once at load (what the
    op covers: fused_layer.py). A weight is tiles for skinny_linear (operand.format None) or a
    quantized stream, or several of either over consecutive input columns, added in order
    (operand.column_parts); a quantized one runs with the plan's integer rows and integer GEMM
    (operand.integer_rows, operand.integer_gemm; its GEMM panels unpacked at load, operand.gemm_panels;
    its column splits, operand.column_splits), as op by op. An int8/fp8 cache comes with its scales; `kv_rotation` is the Hadamard
    block it stores K and V rotated by (0: none)."""
    tensors, formats, perms, parts = layer.flat_weights
    integer_rows, integer_gemm = layer.quantized_settings
    return torch.ops.tokenmill.llama_decode_layer(
        h, residual, layer.input_norm, layer.post_norm, layer.eps, tensors, formats, perms, layer.gemm_panels, *rope,
        *kv_cache, slots,
        block_tables, context_lens, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale,
        *(kv_scales or (None, None)), kv_rotation, parts, integer_rows, integer_gemm, layer.column_splits,
    )
