"""The element-wise ops a model runs, as one object the execution plan hands it at load.

`TorchOps` is the reference (plain PyTorch: any device, any dtype, autograd);
`NativeOps` runs tokenmill's fused CPU kernels where a tensor fits them (float32 rows,
contiguous, not recording autograd) and the reference otherwise. A model holds one of
them from load on (`LlamaForCausalLM.use_ops`), so no module asks per call whether the
native kernels exist: the plan asked once (`ops_for`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill import kernels


class TorchOps:
    """The reference ops (plain PyTorch)."""

    name = "PyTorch element-wise ops"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        # Normalise in float32 (as the reference does), scale in the model dtype.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated (rotate-half pairing) by cos/sin [tokens, head_dim / 2]."""
        return apply_rotary(x, cos, sin)

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """[tokens, 2I] holding gate | up -> act(gate) * up: `act` "silu" (SwiGLU) or
        "gelu_tanh" (GeGLU, tanh-approximated gelu)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


class NativeOps(TorchOps):
    """tokenmill's native CPU kernels (float32), the reference for tensors they do not take."""

    name = "native element-wise ops"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():
            return kernels.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and not residual.requires_grad:
            return kernels.add_rms_norm(x, residual, weight, eps), residual  # residual updated in place
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) == 1:
            kernels.rotary_(x, cos, sin)  # in place
            return x
        return super().rotary(x, cos, sin)

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        if act == "silu" and gate_up.dim() == 2 and gate_up.is_contiguous():
            return kernels.silu_and_mul(gate_up)
        return super().act_and_mul(gate_up, act)


REFERENCE_OPS = TorchOps()
NATIVE_OPS = NativeOps()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [tokens, heads, head_dim] (rotate-half pairing) in float32, cos/sin
    [tokens, head_dim / 2]: the PyTorch reference of the native op."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
