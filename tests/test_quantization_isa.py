"""quant_linear's other instruction sets, built for CPUs this machine can stand in for:
AVX-VNNI without AVX-512 (Alder Lake), AVX2 without VNNI (Haswell: maddubs + madd, and the
sign trick for 8-bit codes), and plain C (x86-64). Each build must compute what the native
one computes: bit for bit on exact inputs, to float32 rounding otherwise.

Slow (each build compiles cpu_quant.cpp, ~1 min; cached afterwards in TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import pytest
import torch
from test_quantization import ALL_ROWS, FORMATS, _exact_case

from tokenmill.kernels import _CSRC
from tokenmill.quantization.reference import (
    quant_linear_reference,
    quantize_activations_reference,
)

pytestmark = pytest.mark.slow

VARIANTS = {  # op namespace -> (-march, expected quant_isa())
    "tmq_alderlake": ("alderlake", "avx_vnni"),
    "tmq_haswell": ("haswell", "avx2"),
    "tmq_x86_64": ("x86-64", "scalar"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def ops(request):
    from torch.utils.cpp_extension import load

    namespace = request.param
    march, isa = VARIANTS[namespace]
    load(
        name=namespace,
        sources=[str(_CSRC / "cpu_quant.cpp")],
        extra_cflags=["-O3", f"-march={march}", "-fopenmp", "-ffast-math", f"-DTOKENMILL_OPS_NS={namespace}"],
        extra_include_paths=[str(_CSRC)],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    built = getattr(torch.ops, namespace)
    assert built.quant_isa() == isa
    return built


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True), (8, False)])
def test_exact_inputs_bit_for_bit(ops, bits, symmetric) -> None:
    for m in (1, 2, 3, 5, 8, 16, 17):
        qt, x = _exact_case(bits, symmetric, m, seed=m)
        assert torch.equal(ops.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS), quant_linear_reference(x, qt))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "Q5_1", "Q4_K", "Q6_K", "int8", "int4-g128", "q4-g16"])
def test_every_format_against_the_reference(ops, fmt) -> None:
    qt = FORMATS[fmt]()
    gen = torch.Generator().manual_seed(2)
    for m in (1, 3, 4, 7):
        x = torch.randn(m, qt.shape[1], generator=gen)
        y = ops.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS)
        ref = quant_linear_reference(x, qt)
        assert float((y - ref).norm() / ref.norm()) < 2e-6
    ref = qt.dequantize()
    torch.testing.assert_close(ops.quant_dequantize(qt.packed, qt.format, torch.float32), ref, rtol=1e-6, atol=1e-7)
    # arbitrary float32 scales (q4-g16): a fused multiply-add may round 1 ulp away, which bf16 can show
    tol = 2**-8 if fmt == "q4-g16" else 0
    torch.testing.assert_close(ops.quant_dequantize(qt.packed, qt.format, torch.bfloat16), ref.bfloat16(), rtol=tol, atol=0)


def test_activation_quantization(ops) -> None:
    x = torch.randn(5, 128) * torch.logspace(-2, 2, 128)
    x[0, :8] = torch.tensor([127.0, 2.5, -2.5, 0.5, 1.5, -0.5, 3.5, 0.0])
    q, d = ops.quantize_activations_q8(x)
    q_ref, d_ref = quantize_activations_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
