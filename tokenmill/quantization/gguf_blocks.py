"""GGUF quantized blocks -> QuantizedTensor, exactly (no value is rounded on the way).

The block layouts are ggml's (ggml-common.h), decoded as the `gguf` package's
`gguf.quants` decodes them; tests compare `dequantize()` with `gguf.quants.dequantize` on
the same bytes. Input: the tensor's raw bytes as `GGUFFile` memory-maps them, uint8
[rows, row_bytes] (rows = N output features, a row = K / block_size blocks).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.quantization.qtensor import QuantizedTensor

QK_K = 256  # elements of a K-quant super-block

# GGML type id -> (name, elements per block, bytes per block), for the types kept as stored.
GGUF_BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176),
    14: ("Q6_K", QK_K, 210),
}


def supported_gguf_types() -> list[str]:
    return [name for name, _, _ in GGUF_BLOCK_TYPES.values()]


def gguf_type_name(ggml_type: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"GGML type {ggml_type}"


def from_gguf_blocks(blocks: np.ndarray, ggml_type: int) -> QuantizedTensor:
    """A [N, K] weight from its GGUF blocks, uint8 [N, row_bytes]."""
    if ggml_type not in GGUF_BLOCK_TYPES:
        raise ValueError(
            f"GGUF tensor type {gguf_type_name(ggml_type)} cannot be kept quantized; "
            f"supported: {', '.join(supported_gguf_types())} (or load with --dtype float32/bfloat16 to dequantize)"
        )
    name, block_size, type_size = GGUF_BLOCK_TYPES[ggml_type]
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] % type_size:
        raise ValueError(f"{name} data must be uint8 [rows, whole {type_size}-byte blocks], got {blocks.dtype} {blocks.shape}")
    rows, nb = blocks.shape[0], blocks.shape[1] // type_size
    b = blocks.reshape(rows * nb, type_size)
    return _DECODERS[name](b, rows, nb * block_size)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] -> [blocks, 32]: byte j holds element j (low nibble) and j + 16 (high)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] little-endian uint32 -> [blocks, 32] of bit j << 4."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits << 4


def _make(codes, scales, mins, rows, k, *, bits, group, offset=None, scale_dtype=torch.float16) -> QuantizedTensor:
    return QuantizedTensor.pack(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, k)),
        torch.from_numpy(np.ascontiguousarray(scales).reshape(rows, k // group)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins).reshape(rows, k // group)),
        bits=bits, group_size=group, code_offset=offset, scale_dtype=scale_dtype,
    )


def _q4_0(b, rows, k):  # d | qs[16]; w = d * (q - 8)
    return _make(_nibbles(b[:, 2:]), _f16(b[:, :2]), None, rows, k, bits=4, group=32, offset=8)


def _q4_1(b, rows, k):  # d | m | qs[16]; w = d * q + m
    return _make(_nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), rows, k, bits=4, group=32)


def _q5_0(b, rows, k):  # d | qh[4] | qs[16]; w = d * (q - 16)
    codes = _nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6])
    return _make(codes, _f16(b[:, :2]), None, rows, k, bits=8, group=32, offset=16)


def _q5_1(b, rows, k):  # d | m | qh[4] | qs[16]; w = d * q + m
    codes = _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])
    return _make(codes, _f16(b[:, :2]), _f16(b[:, 2:4]), rows, k, bits=8, group=32)


def _q8_0(b, rows, k):  # d | qs[32] int8; w = d * q, stored as u = q + 128
    return _make(b[:, 2:] ^ np.uint8(0x80), _f16(b[:, :2]), None, rows, k, bits=8, group=32, offset=128)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: d | dmin | scales[12] -> per-32 scale d * sc and min -(dmin * m), float32
    (as gguf computes them: products of a float16 and a 6-bit integer, exact)."""
    import gguf

    d = _f16(b[:, :2]).astype(np.float32)[:, None]
    dmin = _f16(b[:, 2:4]).astype(np.float32)[:, None]
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] -> [blocks, 256]: 64-element chunk i is bytes 32i..32i+31, low
    nibbles first (sub-block 2i), then high nibbles (sub-block 2i + 1)."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, QK_K)


def _q4_k(b, rows, k):
    scales, mins = _k_scales(b)
    return _make(_k_low_nibbles(b[:, 16:]), scales, mins, rows, k, bits=4, group=32, scale_dtype=torch.float32)


def _q5_k(b, rows, k):  # d | dmin | scales[12] | qh[32] | qs[128]
    scales, mins = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = _k_low_nibbles(b[:, 48:]) | ((qh & 1) << 4).reshape(-1, QK_K)
    return _make(codes, scales, mins, rows, k, bits=8, group=32, scale_dtype=torch.float32)


def _q6_k(b, rows, k):  # ql[128] | qh[64] | scales[16] int8 | d; w = d * sc * (q - 32), per 16
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (ql & 0x0F).reshape(-1, QK_K) | ((qh & 3) << 4).reshape(-1, QK_K)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    scales = _f16(b[:, 208:210]).astype(np.float32)[:, None] * sc
    return _make(codes, scales, None, rows, k, bits=8, group=16, offset=32, scale_dtype=torch.float32)


_DECODERS = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}
