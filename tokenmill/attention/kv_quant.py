"""8-bit KV cache formats: codes with one float16 scale per (token, KV head), and the
Hadamard rotation around the cache that makes their error smaller.

- int8: symmetric, scale = amax / 127, code = round-half-even(x / scale).
- fp8_e4m3: scale = amax / 448, code = e4m3(x / scale) (round to nearest even, saturating).
  vLLM's default is one scale of 1.0 for the whole cache (per-tensor, uncalibrated); a scale
  per (token, head) needs no calibration and uses the whole e4m3 range for every row.

The scale is rounded to float16 first and the codes are computed with the rounded scale,
so dequantizing (code * scale) is consistent; quantizing multiplies by 1 / scale, exactly
as the native write (kernels/csrc/cpu_attention.cpp `quantize_kv_row`) does, so both give
the same bytes. A row of zeros has scale 0 and codes 0.

Rotation (as llama.cpp's PR #21038): K, V and Q are multiplied by an orthonormal
Sylvester-Hadamard matrix H (blocks of 64 along head_dim) before the cache write, and the
attention output by H again (H = H^T = H^-1): q.k and the weighted sum of V are unchanged,
while the outliers of a row are spread over all its elements, so one scale per row loses
less. These functions are the PyTorch reference of the native kernels' versions.
"""

from __future__ import annotations

import functools

import torch

SCALE_DTYPE = torch.float16
_FP16_MAX = 65504.0
ROTATION_BLOCK = 64  # the Hadamard size llama.cpp uses and the notes measured


def fp8_dtype() -> torch.dtype | None:
    """torch.float8_e4m3fn, or None on a torch without float8 tensors."""
    return getattr(torch, "float8_e4m3fn", None)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == torch.int8 or (fp8_dtype() is not None and dtype == fp8_dtype())


def code_max(dtype: torch.dtype) -> float:
    """The largest code magnitude: 127 for int8, 448 (e4m3's largest finite) for fp8."""
    if dtype == torch.int8:
        return 127.0
    if dtype == fp8_dtype():
        return 448.0
    raise ValueError(f"{dtype} is not a quantized KV cache dtype")


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] in `dtype`, scales [...] float16)."""
    x = x.float()
    qmax = code_max(dtype)
    amax = x.abs().amax(dim=-1)
    scales = (amax * (1.0 / qmax)).clamp(max=_FP16_MAX).to(SCALE_DTYPE)
    s = scales.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    y = (x * inv.unsqueeze(-1)).clamp(-qmax, qmax)
    codes = torch.round(y).to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


def rotation_block(head_dim: int) -> int:
    """The Hadamard block for this head_dim: 64, or the largest power of two dividing it when
    that is smaller (0: none, for head dims with no power-of-two factor of at least 16)."""
    block = min(ROTATION_BLOCK, head_dim & -head_dim)
    return block if block >= 16 else 0


@functools.cache
def _hadamard(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester: [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n**0.5).to(device=device, dtype=dtype)


def hadamard(n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n x n orthonormal Sylvester-Hadamard matrix (symmetric, its own inverse)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two size, got {n}")
    return _hadamard(n, torch.device(device), dtype)


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., head_dim] times the block-diagonal Hadamard matrix (blocks of `block`)."""
    h = hadamard(block, x.device, x.dtype)
    return (x.reshape(-1, block) @ h).view(x.shape)  # one matmul over every block of every row
