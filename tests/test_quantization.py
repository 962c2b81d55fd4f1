"""Weight quantization: the QuantizedTensor representation, its converters (GGUF blocks,
int8/int4 from float, GPTQ, AWQ) against independent references, and the native
quant_linear / quant_dequantize kernels against their PyTorch references."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.quantization.checkpoints import AWQ_ORDER, from_awq, from_gptq
from tokenmill.quantization.gguf_blocks import GGUF_BLOCK_TYPES, from_gguf_blocks
from tokenmill.quantization.qtensor import QuantizedTensor
from tokenmill.quantization.reference import (
    dequantized_activations,
    quant_linear_reference,
    quantize_activations_reference,
)
from tokenmill.quantization.rtn import quantize_int4, quantize_int8

GGUF_TYPES = {name: t for t, (name, _, _) in GGUF_BLOCK_TYPES.items()}
ALL_ROWS = 1 << 20  # max_integer_rows that keeps every row count on the integer kernel


@pytest.fixture(scope="module")
def native() -> None:
    if not kernels.cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")


def _random_qtensor(n, k, bits, group, symmetric, scale_dtype=torch.float16, seed=0) -> QuantizedTensor:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(scale_dtype).float()
    mins = None if symmetric else (torch.randn(n, k // group, generator=gen) * 0.1).to(scale_dtype).float()
    return QuantizedTensor.pack(codes, scales, mins, bits=bits, group_size=group,
                                code_offset=2 ** (bits - 1) if symmetric else None, scale_dtype=scale_dtype)


def _gguf_blocks(name: str, rows: int, k: int, seed: int = 0, max_scale: float = 0.05) -> np.ndarray:
    """Blocks of a GGUF type: gguf's own quantizer where it has one, else random bytes with
    sane float16 super-block scales (up to `max_scale`)."""
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    sane = lambda: rng.uniform(max_scale / 50, max_scale, (rows, k // block, 1)).astype(np.float16).view(np.uint8)
    if name in ("Q4_K", "Q5_K"):  # d, dmin lead the block
        raw[..., 0:2], raw[..., 2:4] = sane(), sane()
    else:  # Q6_K: d ends it
        raw[..., -2:] = sane()
    return raw.reshape(rows, -1)


# ----- the representation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,k,bits,group,symmetric,scale_dtype",
    [(5, 96, 4, 32, False, torch.float16), (8, 128, 4, 64, True, torch.float32), (3, 256, 8, 128, True, torch.float16),
     (9, 48, 8, 16, True, torch.float32), (6, 96, 8, 96, True, torch.float32), (4, 64, 4, 32, True, torch.float16)],
    ids=["q4-g32-mins", "q4-g64-sym", "q8-g128", "q8-g16", "q8-per-channel-unaligned", "one-tile"],
)
def test_pack_round_trips_codes_scales_and_mins(n, k, bits, group, symmetric, scale_dtype) -> None:
    gen = torch.Generator().manual_seed(n * k)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen).to(scale_dtype).float()
    mins = None if symmetric else torch.randn(n, k // group, generator=gen).to(scale_dtype).float()
    offset = 2 ** (bits - 1) if symmetric else None
    qt = QuantizedTensor.pack(codes, scales, mins, bits=bits, group_size=group, code_offset=offset, scale_dtype=scale_dtype)
    assert torch.equal(qt.codes(), codes) and torch.equal(qt.scales(), scales)
    expected_mins = -float(offset) * scales if symmetric else mins
    assert torch.equal(qt.mins(), expected_mins)
    s, m = scales.repeat_interleave(group, 1), expected_mins.repeat_interleave(group, 1)
    torch.testing.assert_close(qt.dequantize(), s * codes.float() + m, rtol=1e-5, atol=1e-5)


def test_q4_1_storage_is_exactly_five_bits_per_weight() -> None:
    """The default model's shapes hold whole tiles and spans: nothing but GGUF's 5 bits."""
    blocks = _gguf_blocks("Q4_1", 576, 576)
    qt = from_gguf_blocks(blocks, GGUF_TYPES["Q4_1"])
    assert qt.nbytes == blocks.nbytes and qt.bits_per_weight == 5.0
    q8 = from_gguf_blocks(_gguf_blocks("Q8_0", 192, 576), GGUF_TYPES["Q8_0"])
    assert q8.bits_per_weight == 8.5


def test_rows_narrow_take_and_concatenate_without_dequantizing() -> None:
    a, b, c = (_random_qtensor(n, 96, 4, 32, False, seed=s) for s, n in enumerate((12, 7, 5)))
    dense = torch.cat([a.dequantize(), b.dequantize(), c.dequantize()])
    fused = QuantizedTensor.cat_rows([a, b, c])  # b has a partial tile: repacked
    assert fused.shape == (24, 96) and torch.equal(fused.dequantize(), dense)
    aligned = QuantizedTensor.cat_rows([a, a])  # whole tiles: the streams are joined
    assert torch.equal(aligned.dequantize(), torch.cat([a.dequantize()] * 2))
    view = fused.narrow_rows(4, 10)  # tile-aligned start: a view of the same bytes
    assert view.packed.data_ptr() == fused.packed.data_ptr() + fused.packed[0].numel()
    assert torch.equal(view.dequantize(), dense[4:14])
    assert torch.equal(fused.narrow_rows(3, 9).dequantize(), dense[3:12])  # unaligned: repacked
    perm = torch.tensor([5, 0, 23, 11, 11])
    assert torch.equal(fused.take_rows(perm).dequantize(), dense[perm])
    with pytest.raises(ValueError, match="not inside"):
        fused.narrow_rows(20, 5)
    with pytest.raises(ValueError, match="same K, bits"):
        QuantizedTensor.cat_rows([a, _random_qtensor(4, 96, 4, 32, True)])


def test_columns_split_on_group_boundaries_only() -> None:
    qt = _random_qtensor(6, 256, 4, 64, False)
    dense = qt.dequantize()
    assert torch.equal(qt.narrow_cols(64, 128).dequantize(), dense[:, 64:192])
    with pytest.raises(ValueError, match="group boundaries"):
        qt.narrow_cols(32, 64)
    per_channel = quantize_int8(torch.randn(5, 96))  # one scale per row: any column range works
    part = per_channel.narrow_cols(10, 50)
    assert part.group_size == 50 and torch.equal(part.dequantize(), per_channel.dequantize()[:, 10:60])


@pytest.mark.parametrize(
    "kwargs,match",
    [({"bits": 5, "group_size": 32}, "bits must be 4 or 8"),
     ({"bits": 4, "group_size": 48}, "not divisible by the group size"),
     ({"bits": 4, "group_size": 24, "k": 48}, "group_size 24 is not supported"),
     ({"bits": 4, "group_size": 32, "both": True}, "either mins"),
     ({"bits": 4, "group_size": 32, "big_codes": True}, "below 16")],
)
def test_pack_rejects_what_it_cannot_hold(kwargs, match) -> None:
    k = kwargs.pop("k", 64)
    codes = torch.full((4, k), 20 if kwargs.pop("big_codes", False) else 3, dtype=torch.uint8)
    both = kwargs.pop("both", False)
    groups = max(1, k // kwargs["group_size"])
    with pytest.raises(ValueError, match=match):
        QuantizedTensor.pack(codes, torch.ones(4, groups), torch.zeros(4, groups), code_offset=8 if both else None,
                             **kwargs)


# ----- GGUF blocks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GGUF_TYPES))
def test_gguf_blocks_dequantize_exactly_as_gguf_does(name) -> None:
    k = 512 if name.endswith("_K") else 96  # 96: K not a multiple of the kernel's 64-column step
    blocks = _gguf_blocks(name, 37, k)
    qt = from_gguf_blocks(blocks, GGUF_TYPES[name])
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name]))
    assert qt.shape == (37, k)
    torch.testing.assert_close(qt.dequantize(), expected, rtol=0, atol=0)


def test_gguf_tensors_of_the_default_model_dequantize_as_the_loader_does() -> None:
    from tokenmill.gguf_file import GGUFFile
    from tokenmill.model.loader import default_model_path

    file = GGUFFile(default_model_path())
    infos = {t.name: t for t in file.tensors}
    for name, rows in (("blk.0.attn_k.weight", None), ("token_embd.weight", 300)):
        info = infos[name]
        _, block, size = GGUF_BLOCK_TYPES[info.ggml_type]
        n, row_bytes = rows or info.shape[1], info.shape[0] // block * size
        raw = np.frombuffer(file._data, dtype=np.uint8, count=n * row_bytes, offset=info.offset).reshape(n, row_bytes)
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.ggml_type))
        assert torch.equal(from_gguf_blocks(raw, info.ggml_type).dequantize(), torch.from_numpy(expected))


def test_a_read_gguf_tensors_file_pages_leave_the_resident_set_and_read_back_the_same() -> None:
    """The loader releases each tensor's pages once read: a whole file stayed resident
    through the load beside the weights made of it (an 8B Q4_0 model's peak 4 GB higher)."""
    from tokenmill.gguf_file import GGUFFile
    from tokenmill.model.loader import default_model_path

    def resident_kib() -> int:  # this file's mapping, from /proc/self/smaps
        lines = open("/proc/self/smaps").read().splitlines()
        starts = [i for i, line in enumerate(lines) if line.endswith(path)]
        return sum(int(lines[j].split()[1]) for i in starts for j in range(i + 1, i + 8) if lines[j].startswith("Rss:"))

    path = default_model_path()
    file = GGUFFile(path)
    info = max(file.tensors, key=lambda t: t.shape[0] * t.shape[-1])  # token_embd, ~30 MB
    before = torch.from_numpy(file.blocks(info).copy())  # every page read
    touched = resident_kib()
    file.release(info)
    released = resident_kib()
    assert touched - released >= before.numel() // 1024 - 8, (touched, released)
    assert torch.equal(torch.from_numpy(file.blocks(info).copy()), before)  # faulted back from the file


def test_unsupported_gguf_type_names_itself_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"Q2_K cannot be kept quantized; supported: Q4_0, Q4_1, .*Q6_K"):
        from_gguf_blocks(np.zeros((2, 84), np.uint8), int(gguf.GGMLQuantizationType.Q2_K))
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        from_gguf_blocks(np.zeros((2, 30), np.uint8), GGUF_TYPES["Q4_1"])


# ----- int8 / int4 from float weights -----------------------------------------------------------------


def test_int8_per_channel_is_symmetric_round_to_nearest() -> None:
    w = torch.randn(10, 96)
    w[3] = 0  # a zero row stays zero
    qt = quantize_int8(w)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    assert qt.group_size == 96 and qt.code_offset == 128 and int(qt.codes().min()) >= 1
    assert torch.equal(qt.dequantize()[3], torch.zeros(96))
    assert bool(((qt.dequantize() - w).abs() <= scale / 2 + 1e-7).all())
    torch.testing.assert_close(qt.dequantize().abs().amax(dim=1), w.abs().amax(dim=1))  # max|w| exact


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_group_asymmetric_round_to_nearest(group) -> None:
    w = torch.randn(12, 256)
    qt = quantize_int4(w, group)
    scales = qt.scales().repeat_interleave(group, 1)
    err = (qt.dequantize() - w).abs()
    assert qt.group_size == group and qt.scale_dtype == torch.float16 and int(qt.codes().max()) <= 15
    # round to nearest against the stored (float16) scale and min: half a step, plus the
    # rounding of the min to float16 at the ends of the range
    assert bool((err <= scales * 0.5 + 2e-3).all())
    # a step of (max - min) / 15 of a group of Gaussians (~4-5 sigma) rounds to ~0.08-0.1 sigma
    assert float((qt.dequantize() - w).norm() / w.norm()) < (0.085 if group == 32 else 0.11)


def test_int4_and_int8_refuse_bad_shapes() -> None:
    with pytest.raises(ValueError, match="K divisible by it; this weight has K = 100"):
        quantize_int4(torch.randn(4, 100), 32)
    with pytest.raises(ValueError, match="group size must be one of"):
        quantize_int4(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.randn(8))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]))


# ----- GPTQ and AWQ checkpoints -------------------------------------------------------------------------


def _pack_gptq(intweight: np.ndarray, zeros: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's QuantLinear.pack loops: qweight along K, qzeros (stored as zero - 1 by the
    caller) along N, little end first."""
    per = 32 // bits
    qweight = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j].astype(np.uint32) << (bits * j)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= zeros[:, col * per + j].astype(np.uint32) << (bits * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def _pack_awq(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ's WQLinear_GEMM.from_linear loop: along N, nibble i <- column order_map[i]."""
    packed = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i, c in enumerate(AWQ_ORDER):
            packed[:, col] |= intweight[:, col * 8 + c].astype(np.uint32) << (4 * i)
    return packed.view(np.int32)


@pytest.mark.parametrize(
    "bits,sym,act_order,fmt",
    [(4, True, False, "gptq"), (4, False, False, "gptq"), (4, True, True, "gptq"), (4, False, True, "gptq_v2"),
     (8, True, False, "gptq")],
    ids=["sym", "asym", "sym-act-order", "asym-act-order-v2", "8bit"],
)
def test_gptq_tensors_dequantize_to_scale_times_code_minus_zero(bits, sym, act_order, fmt) -> None:
    rng = np.random.default_rng(bits + 2 * sym + 4 * act_order)
    k, n, group = 128, 24, 32
    groups = k // group
    q = rng.integers(0, 2**bits, (k, n))  # [in, out], as GPTQ stores it
    zeros = np.full((groups, n), 2 ** (bits - 1)) if sym else rng.integers(1, 2**bits, (groups, n))
    scales = rng.uniform(0.001, 0.02, (groups, n)).astype(np.float16)
    order = rng.permutation(k) if act_order else np.arange(k)  # GPTQ's act order: columns by Hessian
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[order] = np.arange(k) // group  # column order[i] is quantized i-th, into group i // group
    stored_zeros = zeros - 1 if fmt == "gptq" else zeros
    qweight, qzeros = _pack_gptq(q, stored_zeros, bits)
    qt = from_gptq(torch.from_numpy(qweight), torch.from_numpy(qzeros), torch.from_numpy(scales),
                   torch.from_numpy(g_idx), bits=bits, group_size=group, sym=sym, desc_act=act_order,
                   checkpoint_format=fmt)
    expected = scales.astype(np.float32)[g_idx] * (q - zeros[g_idx]).astype(np.float32)  # [in, out]
    assert torch.equal(qt.dequantize(), torch.from_numpy(expected.T.copy()))
    assert (qt.col_perm is not None) == act_order and (qt.code_offset is not None) == sym


def test_awq_tensors_dequantize_to_scale_times_code_minus_zero() -> None:
    rng = np.random.default_rng(7)
    k, n, group = 128, 32, 64
    q = rng.integers(0, 16, (k, n))
    zeros = rng.integers(0, 16, (k // group, n))
    scales = rng.uniform(0.001, 0.02, (k // group, n)).astype(np.float16)
    qt = from_awq(torch.from_numpy(_pack_awq(q)), torch.from_numpy(_pack_awq(zeros)), torch.from_numpy(scales),
                  group_size=group)
    expected = np.repeat(scales.astype(np.float32), group, 0) * (q - np.repeat(zeros, group, 0)).astype(np.float32)
    assert torch.equal(qt.dequantize(), torch.from_numpy(expected.T.copy()))


def test_gptq_and_awq_errors_name_the_problem() -> None:
    qweight, qzeros = torch.zeros(16, 8, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="GPTQ with 3 bits is not supported; supported: 4, 8"):
        from_gptq(qweight, qzeros, torch.ones(4, 8), bits=3, group_size=32)
    with pytest.raises(ValueError, match="does not divide in_features 128"):
        from_gptq(qweight, qzeros, torch.ones(4, 8), group_size=48)
    with pytest.raises(ValueError, match="scales must be"):
        from_gptq(qweight, qzeros, torch.ones(3, 8), group_size=32)
    with pytest.raises(ValueError, match="qweight must be a 2-D int32"):
        from_awq(qweight.float(), qzeros, torch.ones(2, 64), group_size=64)
    with pytest.raises(ValueError, match="exactly group_size"):
        from_gptq(qweight, qzeros, torch.ones(4, 8), torch.zeros(128, dtype=torch.int32), group_size=32)


# ----- the native kernels --------------------------------------------------------------------------


def _exact_case(bits, symmetric, m, k=256, n=13, seed=0):
    """Inputs on which every float operation of the kernel and of the reference is exact:
    scales 1 or 1/2, mins multiples of 1/16, activations small integers with one +-127 per
    32 (so d = 1 and q = x). Their results must agree bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.where(torch.rand(n, k // 32, generator=gen) < 0.5, 1.0, 0.5)
    mins = None if symmetric else torch.randint(-64, 64, (n, k // 32), generator=gen) / 16
    qt = QuantizedTensor.pack(codes, scales, mins, bits=bits, group_size=32,
                              code_offset=2 ** (bits - 1) if symmetric else None)
    x = torch.randint(-6, 7, (m, k), generator=gen).float()
    x.view(m, k // 32, 32)[:, :, 5] = torch.where(torch.rand(m, k // 32, generator=gen) < 0.5, 127.0, -127.0)
    return qt, x


def test_activation_quantization_matches_the_reference_bit_for_bit(native) -> None:
    x = torch.randn(7, 256) * torch.logspace(-3, 3, 256)
    x[1, :32] = 0  # an all-zero block
    x[2, 32:64] = 1e-35  # a block too small to invert
    x[3, :32] = torch.tensor([127.0, 2.5, -2.5, 0.5, 1.5, -0.5, 3.5] + [0.0] * 25)  # ties: half to even
    q, d = kernels.quantize_activations_q8(x)
    q_ref, d_ref = quantize_activations_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    assert q[3, :7].tolist() == [127, 2, -2, 0, 2, 0, 4]
    assert torch.equal(q[1, :32], torch.zeros(32, dtype=torch.int8)) and float(d[2, 1]) == 0.0


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True), (8, False)])
def test_integer_kernel_agrees_bit_for_bit_on_exact_inputs(native, bits, symmetric) -> None:
    for m in range(1, 18):
        qt, x = _exact_case(bits, symmetric, m, seed=m)
        y = kernels.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS)
        assert torch.equal(y, quant_linear_reference(x, qt)), f"M = {m}"
        assert torch.equal(dequantized_activations(x).float(), x)  # the inputs really are exact


def _format_cases():
    cases = {name: (lambda name=name, n=37: from_gguf_blocks(_gguf_blocks(name, n, 512 if name.endswith("_K") else 96),
                                                             GGUF_TYPES[name]))
             for name in GGUF_TYPES}
    cases["int8"] = lambda: quantize_int8(torch.randn(37, 96))
    for g in (32, 64, 128):
        cases[f"int4-g{g}"] = lambda g=g: quantize_int4(torch.randn(37, 256), g)
    cases["q4-g16"] = lambda: _random_qtensor(37, 96, 4, 16, False, torch.float32)
    return cases


FORMATS = _format_cases()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_linear_matches_its_reference_for_every_format(native, fmt) -> None:
    """The integer path against the exact product of the same int8 activations with the
    dequantized weight (float32 accumulation order is all that differs), and against float32
    activations: within 2% (the activations' 8-bit rounding; ~0.5% on these inputs)."""
    qt = FORMATS[fmt]()
    gen = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 5, 8, 16, 17):
        x = torch.randn(m, qt.shape[1], generator=gen)
        y = kernels.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS)
        ref = quant_linear_reference(x, qt)
        assert float((y - ref).norm() / ref.norm()) < 2e-6, f"M = {m}"
        exact = quant_linear_reference(x, qt, integer_path=False)
        assert float((y - exact).norm() / exact.norm()) < 0.02


def test_odd_shapes_partial_tiles_and_padded_columns(native) -> None:
    for n, k in ((1, 32), (2, 96), (5, 160), (13, 544)):
        qt = _random_qtensor(n, k, 4, 32, False, seed=n)
        x = torch.randn(3, k)
        y = kernels.quant_linear(x, qt.packed, qt.format)
        assert y.shape == (3, n)
        torch.testing.assert_close(y, quant_linear_reference(x, qt), rtol=1e-5, atol=1e-5)


def test_gemm_path_for_many_rows_and_the_row_threshold(native) -> None:
    """Above the plan's quant_integer_rows[bits] rows W is dequantized to bf16 for a GEMM: bf16 rounding
    of x, W and y (<1% here); max_integer_rows moves the switch either way."""
    qt = from_gguf_blocks(_gguf_blocks("Q4_1", 70, 576), GGUF_TYPES["Q4_1"])
    from tokenmill.runner.plan import ROWS

    for m in (ROWS.quant_integer_rows[4] + 1, 40, 130):
        x = torch.randn(m, 576)
        exact = quant_linear_reference(x, qt, integer_path=False)
        y = kernels.quant_linear(x, qt.packed, qt.format)
        assert float((y - exact).norm() / exact.norm()) < 0.01
        torch.testing.assert_close(kernels.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS),
                                   quant_linear_reference(x, qt), rtol=1e-5, atol=1e-4)
    for m in (3, 40, 130):  # bf16 activations: a bf16 result, the integer path through float32
        x = torch.randn(m, 576).bfloat16()
        y = kernels.quant_linear(x, qt.packed, qt.format)
        exact = quant_linear_reference(x.float(), qt, integer_path=False)
        assert y.dtype == torch.bfloat16 and float((y.float() - exact).norm() / exact.norm()) < 0.01
    x = torch.randn(2, 576)
    y = kernels.quant_linear(x, qt.packed, qt.format, None, 0)  # GEMM even for 2 rows
    assert float((y - quant_linear_reference(x, qt, integer_path=False)).norm() / y.norm()) < 0.01
    assert kernels.quant_linear(torch.empty(0, 576), qt.packed, qt.format).shape == (0, 70)


def test_act_order_weights_gather_the_activations(native) -> None:
    rng = np.random.default_rng(3)
    k, n, group = 128, 16, 32
    q, scales = rng.integers(0, 16, (k, n)), rng.uniform(0.01, 0.02, (k // group, n)).astype(np.float16)
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[rng.permutation(k)] = np.arange(k) // group
    qweight, qzeros = _pack_gptq(q, np.full((k // group, n), 7), 4)
    qt = from_gptq(torch.from_numpy(qweight), torch.from_numpy(qzeros), torch.from_numpy(scales),
                   torch.from_numpy(g_idx), group_size=group, desc_act=True)
    x = torch.randn(3, k)
    dense = F.linear(x, qt.dequantize())
    for rows in (ALL_ROWS, 0):
        y = kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, rows)
        assert float((y - dense).norm() / dense.norm()) < 0.02
    torch.testing.assert_close(qt.linear(x), quant_linear_reference(x, qt), rtol=1e-5, atol=1e-5)
    assert torch.equal(qt.lookup_rows(torch.tensor([3, 0])), qt.dequantize()[[3, 0]])


def test_a_rows_result_depends_neither_on_the_other_rows_nor_on_threads(native) -> None:
    """On the integer path each row is computed alike for any M and thread count: verifying
    k speculative tokens in one call gives what k one-token decode steps give."""
    qt = _random_qtensor(203, 256, 4, 32, False)
    x = torch.randn(9, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS)
        torch.set_num_threads(2)
        two = kernels.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS)
        singles = torch.cat([kernels.quant_linear(x[i : i + 1], qt.packed, qt.format) for i in range(9)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, singles)


def test_native_dequantization_matches_the_reference(native) -> None:
    for fmt in ("Q4_1", "Q8_0", "Q6_K", "int4-g128", "q4-g16"):
        qt = FORMATS[fmt]()
        ref = qt.dequantize()
        if fmt == "q4-g16":  # arbitrary float32 scales: scale * u is rounded, and a fused multiply-add differs
            torch.testing.assert_close(kernels.quant_dequantize(qt.packed, qt.format), ref, rtol=1e-6, atol=1e-7)
            continue
        # stored formats: scale * u is exact, so the kernel's fused multiply-add rounds as the reference
        assert torch.equal(kernels.quant_dequantize(qt.packed, qt.format), ref)
        assert torch.equal(kernels.quant_dequantize(qt.packed, qt.format, torch.bfloat16), ref.bfloat16())
        rows = torch.tensor([36, 0, 5, 5])
        assert torch.equal(kernels.quant_dequantize(qt.packed, qt.format, torch.float32, rows), ref[rows])
    with pytest.raises(RuntimeError, match="outside"):
        kernels.quant_dequantize(qt.packed, qt.format, torch.float32, torch.tensor([37]))


def test_quant_linear_rejects_bad_inputs(native) -> None:
    qt = _random_qtensor(8, 64, 4, 32, False)
    with pytest.raises(RuntimeError, match="x has 32 columns but the quantized weight has K = 64"):
        kernels.quant_linear(torch.randn(2, 32), qt.packed, qt.format)
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        kernels.quant_linear(torch.randn(2, 64).double(), qt.packed, qt.format)
    with pytest.raises(RuntimeError, match="packed must be contiguous uint8 holding"):
        kernels.quant_linear(torch.randn(2, 64), qt.packed[:1], qt.format)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        kernels.quant_linear(torch.randn(2, 64), qt.packed, (8, 64, 2, 32, 2, -1))
    with pytest.raises(RuntimeError, match="format must be"):
        kernels.quant_linear(torch.randn(2, 64), qt.packed, (8, 64, 4))
    with pytest.raises(RuntimeError, match="col_perm"):
        kernels.quant_linear(torch.randn(2, 64), qt.packed, qt.format, torch.arange(32))


def test_linear_and_row_lookup_with_and_without_the_kernels(native, monkeypatch) -> None:
    qt = _random_qtensor(9, 96, 4, 32, False)
    x, ids = torch.randn(4, 96), torch.tensor([[8, 0], [3, 3]])
    torch.testing.assert_close(qt.linear(x), quant_linear_reference(x, qt), rtol=1e-5, atol=1e-5)
    assert torch.equal(qt.lookup_rows(ids), qt.dequantize()[ids.flatten()])
    monkeypatch.setattr(kernels, "cpu_kernels_available", lambda: False)
    torch.testing.assert_close(qt.linear(x), F.linear(x, qt.dequantize()))
    assert torch.equal(qt.lookup_rows(ids), qt.dequantize()[ids.flatten()])


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_K", "Q6_K", "Q8_0", "int8", "int4-g32"])
def test_integer_rows_are_batch_and_thread_invariant(native, fmt) -> None:
    """Deterministic inference (runner/plan.py batch_invariant_plan) runs the integer kernel
    at every row count: a row's output must be bitwise the same alone, among 1-130 other
    rows (the kernel's row tiles and their tails) and on one thread."""
    from tokenmill.runner.plan import EVERY_ROW

    qt = FORMATS[fmt]()
    x = torch.randn(130, qt.shape[1], generator=torch.Generator().manual_seed(7))
    together = kernels.quant_linear(x, qt.packed, qt.format, None, EVERY_ROW)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.quant_linear(x, qt.packed, qt.format, None, EVERY_ROW), together)
    finally:
        torch.set_num_threads(threads)
    for m in (1, 2, 3, 5, 17, 64):
        part = kernels.quant_linear(x[-m:].contiguous(), qt.packed, qt.format, None, EVERY_ROW)
        assert torch.equal(part, together[-m:]), f"the last {m} rows differ from the same rows among 130"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_many_row_integer_kernel_gives_the_row_kernels_bits(native, fmt) -> None:
    """The integer path's many-row kernel (16 activation rows in the vector lanes; it runs
    from 16 rows on, so deterministic inference's prompts take it) must give every output
    the row kernel's bits: 1, 7, 64 and 300 rows (partial lane blocks), ragged N (37 rows:
    a partial weight tile) and K (96: padded to whole spans), every stored format and group
    size, one thread and two. (On builds without AVX512-VNNI both are the row kernel.)"""
    qt = FORMATS[fmt]()
    gen = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    for m in (1, 7, 64, 300):
        x = torch.randn(m, qt.shape[1], generator=gen) * torch.logspace(-2, 1, qt.shape[1])
        row = kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, ALL_ROWS, many_rows=ALL_ROWS)
        many = kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, ALL_ROWS, many_rows=1)
        assert torch.equal(many, row), f"{m} rows: {int((many != row).sum())} outputs differ"
        try:
            torch.set_num_threads(1)
            assert torch.equal(kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, ALL_ROWS, many_rows=1), row)
        finally:
            torch.set_num_threads(threads)
        ref = quant_linear_reference(x, qt)
        assert float((many - ref).norm() / ref.norm()) < 2e-6
    # 300 rows: the op's default (many_rows=-1) takes the many-row kernel
    assert torch.equal(kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, ALL_ROWS), row)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True), (8, False)])
def test_many_row_integer_kernel_is_exact_on_exact_inputs(native, bits, symmetric) -> None:
    """On inputs whose products and sums are exact in float32 the many-row kernel equals the
    PyTorch reference bit for bit, as the row kernel does."""
    for m in (1, 16, 17, 40):
        qt, x = _exact_case(bits, symmetric, m, seed=100 + m)
        y = kernels.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS, many_rows=1)
        assert torch.equal(y, quant_linear_reference(x, qt)), f"M = {m}"


@pytest.mark.parametrize("tile_dtype", [torch.float32, torch.bfloat16])
def test_skinny_rows_are_batch_and_thread_invariant(native, tile_dtype) -> None:
    """The dense half of the same guarantee: the skinny kernel at any row count."""
    w = torch.randn(200, 576, generator=torch.Generator().manual_seed(8))
    tiled = kernels.tile_for_skinny(w, tile_dtype)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(9))
    together = kernels.skinny_linear(x, tiled, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.skinny_linear(x, tiled, 200), together)
    finally:
        torch.set_num_threads(threads)
    for m in (1, 3, 16, 33):
        assert torch.equal(kernels.skinny_linear(x[-m:].contiguous(), tiled, 200), together[-m:]), f"last {m} rows"


# ----- the whole-block integer GEMM (many rows, where the plan measured it faster) ----------------


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_integer_gemm_matches_its_reference_for_every_format(native, fmt) -> None:
    """Past the integer rows with `integer_gemm`, every format with groups of 32 or more runs
    the whole-block integer GEMM: the same int8 activations as the reference, float32 sums in
    another order (within 2e-6); ragged N (37: a partial panel) and K (96: padded spans); 9-130
    rows (partial row blocks). Groups of 16 (Q6_K) keep the row kernel's integer arithmetic
    (its many-row form), the same int8 activations as the reference; builds without
    AVX512-VNNI take the bf16 GEMM: within 1% of the float product."""
    qt = FORMATS[fmt]()
    covered = kernels.quant_integer_gemm_built()
    gen = torch.Generator().manual_seed(5)
    for m in (9, 17, 40, 130):
        x = torch.randn(m, qt.shape[1], generator=gen)
        y = kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, 8, integer_gemm=True)
        if covered:
            ref = quant_linear_reference(x, qt)
            assert float((y - ref).norm() / ref.norm()) < 2e-6, f"M = {m}"
        else:
            exact = quant_linear_reference(x, qt, integer_path=False)
            assert float((y - exact).norm() / exact.norm()) < 0.01, f"M = {m}"


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, True), (8, False)])
def test_integer_gemm_is_exact_on_exact_inputs(native, bits, symmetric) -> None:
    """On inputs whose products and sums are exact in float32, the block GEMM equals the
    PyTorch reference bit for bit: every code, scale, min and activation lands where it must."""
    if not kernels.quant_integer_gemm_built():  # nothing else to check: the bf16 GEMM rounds
        return
    for m in (9, 16, 23, 40):
        qt, x = _exact_case(bits, symmetric, m, k=320, n=37, seed=200 + m)
        y = kernels.quant_linear(x, qt.packed, qt.format, None, 8, integer_gemm=True)
        assert torch.equal(y, quant_linear_reference(x, qt)), f"M = {m}"


@pytest.mark.parametrize("fmt", ["Q4_0", "Q5_0", "Q8_0", "int8"])
def test_symmetric_formats_give_a_row_the_same_bits_at_any_row_count(native, fmt) -> None:
    """A symmetric format's block dot starts from -offset * the block's sum of q, in the block
    GEMM (its activation rows read four at a time) and in the row kernel alike: a row's output
    is the same bits among 130 rows (two 128-row passes, a last quad of two rows), among 21,
    on one thread or two, and alone through the row kernel; within 1% of the float product."""
    qt = FORMATS[fmt]()
    assert qt.format[5] >= 0, f"{fmt} should be symmetric (a code offset, no mins)"
    if not kernels.quant_integer_gemm_built():
        return  # the bf16 GEMM past the integer rows there
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(130, qt.shape[1], generator=gen) * torch.logspace(-1, 1, qt.shape[1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, 8, integer_gemm=True)
        torch.set_num_threads(2)
        two = kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, 8, integer_gemm=True)
    finally:
        torch.set_num_threads(threads)
    part = kernels.quant_linear(x[-21:].contiguous(), qt.packed, qt.format, qt.col_perm, 8, integer_gemm=True)
    alone = kernels.quant_linear(x[-1:].contiguous(), qt.packed, qt.format, qt.col_perm, ALL_ROWS)
    assert torch.equal(one, two), f"{int((one != two).sum())} outputs differ between one thread and two"
    assert torch.equal(part, one[-21:]), f"{int((part != one[-21:]).sum())} outputs differ among 21 rows"
    assert torch.equal(alone, one[-1:]), "the row kernel's bits differ from the block GEMM's"
    exact = quant_linear_reference(x, qt, integer_path=False)
    assert float((one - exact).norm() / exact.norm()) < 0.01


def test_integer_gemm_rows_do_not_depend_on_the_batch_or_threads(native) -> None:
    """Each output of the block GEMM is one row's int32 block sums added in block order:
    the same bits for that row among 130 rows, among 20, on one thread or two; act-order
    columns gathered; bf16 rows give a bf16 result through float32."""
    qt = from_gguf_blocks(_gguf_blocks("Q4_1", 70, 576), GGUF_TYPES["Q4_1"])
    x = torch.randn(130, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.quant_linear(x, qt.packed, qt.format, None, 8, integer_gemm=True)
        torch.set_num_threads(2)
        two = kernels.quant_linear(x, qt.packed, qt.format, None, 8, integer_gemm=True)
    finally:
        torch.set_num_threads(threads)
    part = kernels.quant_linear(x[-20:].contiguous(), qt.packed, qt.format, None, 8, integer_gemm=True)
    assert torch.equal(one, two) and torch.equal(part, one[-20:])
    xb = x.bfloat16()
    yb = kernels.quant_linear(xb, qt.packed, qt.format, None, 8, integer_gemm=True)
    exact = quant_linear_reference(xb.float(), qt, integer_path=False)
    assert yb.dtype == torch.bfloat16 and float((yb.float() - exact).norm() / exact.norm()) < 0.01
    # act order (GPTQ desc_act): the kernel gathers the activations' columns first
    rng = np.random.default_rng(4)
    k, n, group = 128, 40, 32
    q, scales = rng.integers(0, 16, (k, n)), rng.uniform(0.01, 0.02, (k // group, n)).astype(np.float16)
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[rng.permutation(k)] = np.arange(k) // group
    qweight, qzeros = _pack_gptq(q, np.full((k // group, n), 7), 4)
    gq = from_gptq(torch.from_numpy(qweight), torch.from_numpy(qzeros), torch.from_numpy(scales),
                   torch.from_numpy(g_idx), group_size=group, desc_act=True)
    xa = torch.randn(33, k)
    ya = kernels.quant_linear(xa, gq.packed, gq.format, gq.col_perm, 8, integer_gemm=True)
    dense = F.linear(xa, gq.dequantize())
    assert float((ya - dense).norm() / dense.norm()) < 0.02
    if kernels.quant_integer_gemm_built():
        ref = quant_linear_reference(xa, gq)
        assert float((ya - ref).norm() / ref.norm()) < 2e-6


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_integer_gemm_gives_the_row_kernels_bits(native, fmt) -> None:
    """With `integer_gemm` on an AVX512-VNNI build a row's output is the same bits through the
    row kernel (decode, 1-16 rows), the many-row kernel and what runs past the integer rows
    (the block GEMM, whose order the row kernel follows, for groups of 32 or more; the integer
    kernel itself for Q6_K's groups of 16, which took the bf16 GEMM until Gemma 3's Q6_K
    tensors changed its chunked prompts' bits), so the default plan's linears do not depend on
    the batch, the chunking or a prefix-cache hit."""
    qt = FORMATS[fmt]()
    if not kernels.quant_integer_gemm_built():
        return  # the bf16 GEMM past the integer rows there
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(70, qt.shape[1], generator=gen) * torch.logspace(-2, 1, qt.shape[1])
    gemm = kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, 8, integer_gemm=True)
    for m in (1, 3, 8, 16, 70):
        row = kernels.quant_linear(x[-m:].contiguous(), qt.packed, qt.format, qt.col_perm, ALL_ROWS,
                                   many_rows=ALL_ROWS)
        assert torch.equal(row, gemm[-m:]), f"{m} rows: {int((row != gemm[-m:]).sum())} outputs differ"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gemm_panels_unpacked_at_load_give_the_gemms_bits(native, fmt) -> None:
    """The integer GEMM's panels unpacked once (kernels.quant_gemm_panels; what the plan keeps
    for quantized weights on the integer GEMM) give every output the bits of the GEMM that
    unpacks the weight on each call: past the integer rows (9-130 rows: partial quads, two
    128-row passes) and in the integer kernel's many-row form (deterministic inference's
    prompts); they take QuantizedTensor.gemm_panels_nbytes; another weight's are refused by
    name. Groups of 16 (Q6_K) and builds without the block GEMM have none."""
    qt = FORMATS[fmt]()
    if not kernels.quant_integer_gemm_built():
        with pytest.raises(RuntimeError, match="no block GEMM"):
            kernels.quant_gemm_panels(qt.packed, qt.format)
        return
    if qt.format[3] % 32:
        with pytest.raises(RuntimeError, match="does not cover groups of 16"):
            kernels.quant_gemm_panels(qt.packed, qt.format)
        return
    panels = kernels.quant_gemm_panels(qt.packed, qt.format)
    assert panels.dtype == torch.uint8 and panels.numel() == qt.gemm_panels_nbytes
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(130, qt.shape[1], generator=gen) * torch.logspace(-2, 1, qt.shape[1])
    for m in (9, 32, 130):
        xm = x[:m].contiguous()
        unpacked = kernels.quant_linear(xm, qt.packed, qt.format, qt.col_perm, 8, integer_gemm=True)
        loaded = kernels.quant_linear(xm, qt.packed, qt.format, qt.col_perm, 8, integer_gemm=True, gemm_panels=panels)
        assert torch.equal(loaded, unpacked), f"{m} rows: {int((loaded != unpacked).sum())} outputs differ"
    rows = kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, ALL_ROWS)
    assert torch.equal(kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, ALL_ROWS, gemm_panels=panels), rows)
    with pytest.raises(RuntimeError, match="not quant_gemm_panels of this weight"):
        kernels.quant_linear(x, qt.packed, qt.format, qt.col_perm, 8, integer_gemm=True, gemm_panels=panels[:-64])


def _parts_apart(x: torch.Tensor, qt: QuantizedTensor, cuts: tuple[int, ...], **settings) -> torch.Tensor:
    """The products of qt's column parts, each times its own input columns by its own call (as
    the ranks of a tensor-parallel split compute them), added in order (as their all-reduce)."""
    bounds = [0, *cuts, qt.shape[1]]
    y = None
    for start, stop in zip(bounds, bounds[1:]):
        part = qt.narrow_cols(start, stop - start)
        product = kernels.quant_linear(x[:, start:stop].contiguous(), part.packed, part.format, None, **settings)
        y = product if y is None else y + product
    return y


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_column_splits_give_the_parts_bits_in_one_call(native, fmt) -> None:
    """quant_linear's column_splits (deterministic inference's row-parallel linears, whole):
    each output's sum starts again at every split and the parts' sums are added in order,
    which gives the bits of the parts computed apart (each padded to its own 64 columns) and
    added, at every row count: the row kernel (1-8 rows: a split inside a 64-column step and
    at its start), the block GEMM (9-130 rows, with and without its panels from load), the
    integer kernel at every row count. Where the block-order kernels do not run (Q6_K's
    groups of 16, builds without AVX512-VNNI, an act-order weight) or a split is not on a
    group, a clear error."""
    qt = FORMATS[fmt]()
    k, group = qt.shape[1], qt.format[3]
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 1, k)
    if not kernels.quant_integer_gemm_built() or group % 32:
        with pytest.raises(RuntimeError, match="column_splits need the block-order integer kernels"):
            kernels.quant_linear(x[:4], qt.packed, qt.format, None, 8, integer_gemm=True, column_splits=[2 * group])
        return
    cut_sets = [c for c in ([group], [k - group], [group, 2 * group], [2 * group, 3 * group], [k // 2])
                if all(0 < v < k and v % group == 0 for v in c)]
    if not cut_sets:  # one group a row (per-channel int8): nowhere to split
        with pytest.raises(RuntimeError, match="multiples of 32 and of the group"):
            kernels.quant_linear(x[:4], qt.packed, qt.format, None, 8, column_splits=[k // 2])
        return
    if group == 32 and k % 64 == 32:
        assert any(v % 64 == 32 for c in cut_sets for v in c)  # a split inside a 64-column step
    panels = kernels.quant_gemm_panels(qt.packed, qt.format)
    for cuts in cut_sets:
        for m in (1, 3, 8, 9, 32, 130):
            xm = x[:m].contiguous()
            apart = _parts_apart(xm, qt, tuple(cuts), max_integer_rows=8, integer_gemm=True)
            for loaded in (None, panels):
                whole = kernels.quant_linear(xm, qt.packed, qt.format, None, 8, integer_gemm=True, gemm_panels=loaded,
                                             column_splits=cuts)
                assert torch.equal(whole, apart), f"cuts {cuts}, {m} rows: {int((whole != apart).sum())} outputs differ"
        every = kernels.quant_linear(x, qt.packed, qt.format, None, ALL_ROWS, column_splits=cuts)
        assert torch.equal(every, _parts_apart(x, qt, tuple(cuts), max_integer_rows=ALL_ROWS)), f"cuts {cuts}"
    assert not torch.equal(kernels.quant_linear(x[:9], qt.packed, qt.format, None, 8, integer_gemm=True),
                           kernels.quant_linear(x[:9], qt.packed, qt.format, None, 8, integer_gemm=True,
                                                column_splits=cut_sets[0]))  # the splits change the sums
    if group == 32 and k >= 128:
        assert [2 * group, 3 * group] in cut_sets  # two cuts in one 64-column step: a one-block part
    with pytest.raises(RuntimeError, match="multiples of 32 and of the group"):
        kernels.quant_linear(x[:4], qt.packed, qt.format, None, 8, column_splits=[group + 16])
    with pytest.raises(RuntimeError, match="at most 7"):
        kernels.quant_linear(x[:4], qt.packed, qt.format, None, 8, column_splits=list(range(32, 32 * 9, 32)))
    with pytest.raises(RuntimeError, match="float32 activations"):
        kernels.quant_linear(x[:4].bfloat16(), qt.packed, qt.format, None, 8, column_splits=cut_sets[0])
    with pytest.raises(RuntimeError, match="column_splits need the block-order integer kernels"):
        kernels.quant_linear(x[:9], qt.packed, qt.format, None, 8, integer_gemm=False, column_splits=cut_sets[0])


def test_a_quantized_row_parallel_linear_runs_whole_with_its_parts_bits(native) -> None:
    """split_in_columns (deterministic inference's o_proj / down_proj): a stored quantized weight
    cut on its groups is kept whole with column splits where the block-order kernels run, and
    computes what the parts stored and computed apart (ColumnParts) do, bit for bit, at 1-40
    rows; an int4 weight quantized here likewise; Q6_K's groups of 16 and a cut inside a group
    stay in parts."""
    from tokenmill.quantization import ColumnParts, split_in_columns
    from tokenmill.quantization.formats import QuantizedWeights
    from tokenmill.runner.plan import cpu_native_plan, quantized_plan

    fmt = quantized_plan(cpu_native_plan(torch.float32), "stored", integer_gemm=True).weight_format
    int4 = quantized_plan(cpu_native_plan(torch.float32), "int4", integer_gemm=True).weight_format
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(8))
    block_order = kernels.quant_integer_gemm_built()
    cases = [(fmt, FORMATS["Q4_1"](), (32,), block_order), (fmt, FORMATS["Q8_0"](), (64,), block_order),
             (int4, torch.randn(37, 96, generator=torch.Generator().manual_seed(9)), (32,), block_order),
             (fmt, FORMATS["Q6_K"](), (256,), False), (fmt, FORMATS["Q4_1"](), (48,), False)]
    for weight_format, weight, cuts, whole in cases:
        weights = split_in_columns(weight_format, weight, cuts)
        parts = ColumnParts.make(weight_format, weight, cuts)
        assert isinstance(weights, QuantizedWeights if whole else ColumnParts)
        if whole:
            assert weights.column_splits == cuts and weights.fused_decode_operand().column_splits == cuts
        xk = x[:, :weight.shape[1]] if weight.shape[1] <= 96 else torch.randn(40, weight.shape[1])
        for m in (1, 8, 9, 40):
            assert torch.equal(weights.apply(xk[:m].contiguous()), parts.apply(xk[:m].contiguous())), (cuts, m)
