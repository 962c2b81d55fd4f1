"""PyTorch references of the quantized-linear kernels (cpu_quant.cpp), for the tests and as
documentation of what the kernels compute."""

from __future__ import annotations

import torch

from tokenmill.quantization.qtensor import QuantizedTensor

ACT_BLOCK = 32  # activation values per int8 scale (llama.cpp's Q8_1 block)
TINY_BLOCK = 1e-30  # blocks whose max |x| is at most this quantize to zero (127 / max would overflow)


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] (K % 32 == 0) -> int8 q [M, K], float32 d [M, K / 32]:
    d = max|x| / 127 per 32 values, q = round-half-even(x * (127 / max|x|)); what the
    kernel does, bit for bit."""
    m, k = x.shape
    if k % ACT_BLOCK:
        raise ValueError(f"K must be a multiple of {ACT_BLOCK}, got {k}")
    blocks = x.float().reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    live = amax > TINY_BLOCK
    # Both quotients correctly rounded to float32, as the kernel forms them (in double, rounded
    # once): torch's float32 `127 / amax` is a reciprocal times 127, two roundings, which
    # differed in the last bit often enough to flip a tie in one activation of ~300 rows.
    d = torch.where(live, (amax.double() / 127).float(), 0.0)
    inv = torch.where(live, (127 / torch.where(live, amax, 1.0).double()).float(), 0.0)
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
    return q.reshape(m, k), d


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the integer kernel sees it: d * q per 32 (K padded with zeros to a multiple of 32
    for the quantization, then cut back), float64."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % ACT_BLOCK))
    q, d = quantize_activations_reference(padded)
    xq = q.double().view(m, -1, ACT_BLOCK) * d.double().unsqueeze(-1)
    return xq.reshape(m, -1)[:, :k]


def quant_linear_reference(x: torch.Tensor, weight: QuantizedTensor, integer_path: bool = True) -> torch.Tensor:
    """y = x W^T, float32 [M, N]. integer_path: what quant_linear computes for up to 16 rows,
    exactly (in float64, rounded once): x quantized per 32 (after act-order's column gather)
    times the dequantized weight. Otherwise the product of float32 x and the dequantized
    weight, the quantity both kernel paths approximate."""
    w = weight.dequantize().double()
    if not integer_path:
        return (x.double() @ w.T).float()
    if weight.col_perm is not None:  # the kernel quantizes the gathered columns
        xs = dequantized_activations(x[:, weight.col_perm])
        return (xs @ w[:, weight.col_perm].T).float()
    return (dequantized_activations(x) @ w.T).float()
