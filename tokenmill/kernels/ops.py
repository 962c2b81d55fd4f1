"""The element-wise ops a model runs, as one object the execution plan hands it at load.

`TorchOps` is the reference (plain PyTorch: any device, any dtype, autograd);
`NativeOps` runs tokenmill's fused CPU kernels where a tensor fits them (float32 or bf16
rows, contiguous, not recording autograd) and the reference otherwise. The norms take an
`out_dtype`: the bf16 activation path (runner/plan.py) keeps the residual stream float32
and has the norm write the next GEMM's bf16 input, with the bits a float32 norm followed
by a cast gives. A model holds one of
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

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`out_dtype` given: computed in float32 from x as it is, the result cast to it."""
        if out_dtype is not None:
            return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(out_dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        # Normalise in float32 (as the reference does), scale in the model dtype.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); the sum in the residual's dtype."""
        residual = residual + x.to(residual.dtype)
        return self.rms_norm(residual, weight, eps, out_dtype), residual

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

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and x.dtype in _NATIVE and weight.dtype == torch.float32:
            return kernels.rms_norm(x, weight, eps, out_dtype)
        return super().rms_norm(x, weight, eps, out_dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and x.is_contiguous() and x.dtype in _NATIVE and residual.dtype == torch.float32 \
                and weight.dtype == torch.float32 and residual.is_contiguous() and not residual.requires_grad:
            return kernels.add_rms_norm(x, residual, weight, eps, out_dtype), residual  # residual updated in place
        return super().add_rms_norm(x, residual, weight, eps, out_dtype)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) == 1 and x.dtype in _NATIVE:
            kernels.rotary_(x, cos, sin)  # in place
            return x
        return super().rotary(x, cos, sin)

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        if act == "silu" and gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.dtype in _NATIVE:
            return kernels.silu_and_mul(gate_up)
        return super().act_and_mul(gate_up, act)


_NATIVE = (torch.float32, torch.bfloat16)  # the activation dtypes the native ops take

REFERENCE_OPS = TorchOps()
NATIVE_OPS = NativeOps()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [tokens, heads, head_dim] (rotate-half pairing) in float32, cos/sin
    [tokens, head_dim / 2]: the PyTorch reference of the native op."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
