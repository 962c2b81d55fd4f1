"""Building blocks of Llama-family models: linear layers, RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.kernels import cpu_kernels_available


SKINNY_MAX_ROWS = 16  # up to here the tiled kernel beats oneDNN (measured: docs/benchmarks.md)


class Linear(nn.Linear):
    """nn.Linear with CPU fast paths, set up by `prepare_for_cpu` once the weights are loaded.

    - Up to SKINNY_MAX_ROWS rows (decode): tokenmill's skinny kernel on the weight in a tiled
      layout (`tiled`), float32 or bfloat16. A decode step is a stream of weight reads; the
      kernel reads at 20-28 GB/s where BLAS reads at 10-12, and bfloat16 halves the bytes.
    - More rows (prefill, large batches): oneDNN on a float32 copy in its blocked layout
      (`packed`), 1.2-1.3x F.linear on the same weights.
    Once prepared, the plain `weight` is dropped (None): F.linear, used only where neither
    path applies, then rebuilds it from the tiles."""

    tiled: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    def prepare_for_cpu(self, weight_dtype: torch.dtype, onednn: bool) -> None:
        """Lay the float32 weight out for the CPU paths above; `weight_dtype` (float32 or
        bfloat16) is what the skinny kernel reads. A weight the kernel cannot take keeps
        its plain form (cast to `weight_dtype`)."""
        weight = self.weight.detach()
        if onednn:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), None)
        if cpu_kernels_available() and kernels.can_tile_for_skinny(weight):
            self.tiled = kernels.tile_for_skinny(weight, weight_dtype)
            self.weight = None
        elif weight.dtype != weight_dtype:
            self.weight = nn.Parameter(weight.to(weight_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            if self.tiled is not None and x.shape[0] <= SKINNY_MAX_ROWS:
                y = kernels.skinny_linear(x.contiguous(), self.tiled, self.out_features)
                return y if self.bias is None else y + self.bias
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        weight = self.weight if self.weight is not None else kernels.untile_skinny(self.tiled, self.out_features)
        return F.linear(x, weight.to(x.dtype), self.bias)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepare_for_cpu(model: nn.Module, weight_dtype: torch.dtype, onednn: bool = True) -> int:
    """Prepare every `Linear` of a float32 CPU model (see `Linear`), and store embeddings in
    `weight_dtype` too (the model casts looked-up rows back). `onednn`: keep the float32
    oneDNN copies for inputs of many rows (faster prefill, twice the weight memory in
    float32). Returns how many linears were prepared."""
    onednn = onednn and onednn_available()
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight is not None]
    for linear in linears:  # before the embeddings: a tied head is read in float32 here
        linear.prepare_for_cpu(weight_dtype, onednn)
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.weight.dtype != weight_dtype:
            module.weight = nn.Parameter(module.weight.detach().to(weight_dtype), requires_grad=False)
    return len(linears)


def use_native_ops(x: torch.Tensor) -> bool:
    """Whether the fused native element-wise ops (tokenmill.kernels) take this tensor:
    float32 on the CPU, outside autograd, kernels built."""
    # Called ~4 times per layer per step: the cheapest checks (`is`, `is_cpu`) first.
    return x.dtype is torch.float32 and x.is_cpu and not x.requires_grad and cpu_kernels_available()


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream too, it first adds x into it (vLLM's fused
    add + norm): `norm(x, residual)` returns (normed, residual + x)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_native_ops(x) and x.dim() == 2 and x.is_contiguous():
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps)
            if residual.is_contiguous() and not residual.requires_grad:
                return kernels.add_rms_norm(x, residual, self.weight, self.eps), residual  # residual updated in place
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
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
        """cos and sin of the step's positions, [tokens, head_dim / 2]: looked up once
        per step and shared by every layer."""
        return self.cos[positions], self.sin[positions]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.table(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [tokens, heads, head_dim] (rotate-half pairing) in float32, cos/sin
    [tokens, head_dim / 2]. Float32 CPU tensors are rotated in place by the native op."""
    if use_native_ops(x) and x.stride(-1) == 1:
        kernels.rotary_(x, cos, sin)
        return x
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class SwiGLU(nn.Module):
    """Gate and up projections fused into one matmul, then silu(gate) * up, down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_native_ops(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
