"""Building blocks of Llama-family models: linear layers, RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import SKINNY_MAX_ROWS, cpu_kernels_available, skinny_linear


PACKED_MIN_ROWS = 5  # from here on oneDNN's packed weights beat the skinny kernel


class Linear(nn.Linear):
    """nn.Linear with two CPU fast paths.

    - Up to PACKED_MIN_ROWS - 1 rows (batch-1 and small-batch decode): tokenmill's skinny-
      matmul kernel, which streams the weight at close to memory bandwidth where BLAS
      reaches about half of it.
    - `pack_for_cpu()` (float32): a second copy of the weight in oneDNN's blocked layout for
      larger inputs. Against F.linear on the same weights: 1.2-2.5x for 16-128 rows
      (batched decode), ~1.3x for 512 (prefill); with one row it was slower than the
      skinny kernel in the model (462 us per call against ~265), hence the split.
    Everything else goes to F.linear."""

    packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] >= PACKED_MIN_ROWS and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if _use_skinny(x, self.weight):
            y = skinny_linear(x, self.weight)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Pack every float32 `Linear` of a CPU model for oneDNN (see `Linear`); returns how
    many were packed, 0 where this torch has no oneDNN."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.pack_for_cpu()
            count += 1
    return count


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
