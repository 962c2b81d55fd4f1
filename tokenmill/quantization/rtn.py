"""Float weights -> QuantizedTensor by round-to-nearest, computed at load.

- `quantize_int8`: per output channel, symmetric (`--quantization int8`, vLLM's W8A16):
  scale = max|w| / 127 per row, q = round(w / scale) in [-127, 127], stored as u = q + 128.
- `quantize_int4`: per group of 32/64/128 columns, asymmetric (`--quantization int4`):
  scale = (max - min) / 15 and min per group, both float16 (as GGUF's Q4_1 stores them),
  u = round((w - min) / scale) in [0, 15] computed against the stored float16 values.
"""

from __future__ import annotations

import torch

from tokenmill.quantization.qtensor import QuantizedTensor

INT4_GROUP_SIZES = (32, 64, 128)


def _check_weight(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"a weight to quantize must be a 2-D float tensor, got {tuple(weight.shape)} {weight.dtype}")
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight holding inf or NaN")
    return w


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Per-output-channel symmetric int8 of a float weight [N, K]."""
    w = _check_weight(weight)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)), 0.0)
    codes = (q.clamp(-127, 127) + 128).to(torch.uint8)
    return QuantizedTensor.pack(
        codes, scale, bits=8, group_size=w.shape[1], code_offset=128, scale_dtype=torch.float32
    )


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedTensor:
    """Group-wise asymmetric int4 of a float weight [N, K]."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    w = _check_weight(weight)
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 with group size {group_size} needs K divisible by it; this weight has K = {k}")
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    dtype = torch.float16
    if max(float(lo.abs().max()), float(hi.abs().max())) > torch.finfo(torch.float16).max / 2:
        dtype = torch.float32  # weights too large for float16 scales
    scale = ((hi - lo) / 15).to(dtype).float()
    low = lo.to(dtype).float()
    inv = torch.where(scale > 0, 1 / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    codes = torch.round((g - low.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return QuantizedTensor.pack(codes.view(n, k), scale, low, bits=4, group_size=group_size, scale_dtype=dtype)
