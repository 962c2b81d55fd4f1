"""Building blocks of Llama-family models: linear layers, RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import SKINNY_MAX_ROWS, cpu_kernels_available, skinny_linear


class Linear(nn.Linear):
    """nn.Linear that sends decode-shaped inputs (a few rows) on the CPU to tokenmill's
    skinny-matmul kernel, which streams the weight at close to memory bandwidth where
    BLAS reaches about half of it. Everything else goes to F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_skinny(x, self.weight):
            y = skinny_linear(x, self.weight)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def _use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and x.is_contiguous()
        and weight.is_contiguous()
        and cpu_kernels_available()
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op, bit-identical to the steps below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 (as the reference does), scale in the model dtype.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "factors":  # explicit per-frequency divisors (GGUF rope_freqs)
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear")
    return inv_freq.float()


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent stretch: long wavelengths are divided by
    `factor`, short ones kept, the band between interpolated smoothly."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # [positions, head_dim / 2]
        self.register_buffer("sin", angles.sin(), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, [tokens, 1, head_dim / 2]: looked up once
        per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.table(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [tokens, heads, head_dim] (rotate-half pairing), in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class SwiGLU(nn.Module):
    """Gate and up projections fused into one matmul, then silu(gate) * up, down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
