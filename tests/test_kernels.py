"""The native CPU kernels against their pure-PyTorch fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.kernels import cpu_kernels_available, paged_decode_attention, skinny_linear, tile_for_skinny


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")


def _reference(q, k_cache, v_cache, tables, lens, scale, window=0):
    """The pure-PyTorch decode path: gather each sequence's history (its last `window`
    tokens when `window`), then SDPA."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        first = max(0, n - window) if window else 0
        slots = (tables[s].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[first:n]
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].float().transpose(0, 1).unsqueeze(0)
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].float().transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            q[s].float()[None, :, None, :], k, v, scale=scale, enable_gqa=q.shape[1] != num_kv_heads
        )
        out.append(o[0, :, 0, :])
    return torch.stack(out)


def _case(num_seqs, heads, kv_heads, head_dim, block_size, lens, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = num_seqs * max_blocks + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    # Each sequence gets its own shuffled blocks; unused table entries point anywhere.
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks).int()
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 4, 32), (8, 2, 64), (6, 2, 20), (2, 1, 128)],
    ids=["gqa3-d64", "mha-d32", "gqa4-d64", "gqa3-d20", "mqa-d128"],
)
def test_paged_decode_attention_matches_sdpa(heads, kv_heads, head_dim) -> None:
    lens = [1, 17, 64, 5, 200]
    q, k_cache, v_cache, tables, lens_t = _case(len(lens), heads, kv_heads, head_dim, 16, lens)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_decode_attention(out, q, k_cache, v_cache, tables, lens_t, scale)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, lens_t, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (4, 4, 32)], ids=["gqa3", "gqa4", "mha"])
def test_paged_decode_attention_with_many_sequences(heads, kv_heads, head_dim) -> None:
    """Enough sequences that a work item is a whole sequence (all KV heads) rather than
    one head of it; ragged lengths exercise the 4-row tiles' tails."""
    lens = [1, 2, 3, 4, 5, 16, 17, 31, 33, 64, 100, 130]
    q, k_cache, v_cache, tables, lens_t = _case(len(lens), heads, kv_heads, head_dim, 16, lens, seed=3)
    out = torch.empty_like(q)
    paged_decode_attention(out, q, k_cache, v_cache, tables, lens_t, head_dim**-0.5)
    expected = _reference(q, k_cache, v_cache, tables, lens_t, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_attention_reduced_precision(dtype) -> None:
    """A bf16/fp16 cache and queries (float32 arithmetic inside; bf16 dot products for a bf16
    cache on AVX-512 BF16)."""
    lens = [3, 40, 129]
    q, k_cache, v_cache, tables, lens_t = _case(len(lens), 9, 3, 64, 16, lens, dtype=dtype, seed=1)
    out = torch.empty_like(q)
    paged_decode_attention(out, q, k_cache, v_cache, tables, lens_t, 0.125)
    expected = _reference(q, k_cache, v_cache, tables, lens_t, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def _bf16_dots_reference(q, k_cache, v_cache, tables, lens, scale):
    """What the kernel computes for a bf16 cache on AVX-512 BF16 (vdpbf16ps, as torch's flash
    attention does bf16): the scaled q rounded to bf16, exact products, the softmax weights
    rounded to bf16 for the value sum; here in float64."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(q.shape[0]):
        n = int(lens[s])
        slots = (tables[s].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:n]
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        qs = (q[s].float() * scale).bfloat16().double()
        p = torch.softmax(torch.einsum("hd,thd->ht", qs, k), dim=-1)
        out[s] = torch.einsum("ht,thd->hd", p.float().bfloat16().double(), v)
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (8, 2, 64, 16), (7, 7, 64, 16), (5, 1, 128, 16), (12, 2, 96, 32), (16, 2, 32, 8)],
    ids=["gqa3", "gqa4", "mha", "gqa5-d128", "gqa6-d96-bs32", "gqa8-d32-bs8"],
)
def test_paged_decode_attention_on_a_bf16_cache_uses_bf16_dot_products(heads, kv_heads, head_dim, block_size) -> None:
    """A bf16 cache on a CPU with AVX-512 BF16 takes bf16 dot products for both passes, with
    up to 8 query heads per KV head tiled (ragged lengths: odd token pairs, 4-row tails):
    within float32 accumulation of the bf16-rounded reference, and within bf16 error of the
    float32 one. Elsewhere (no AVX-512 BF16) the float32 path, which is closer still."""
    lens = [1, 2, 3, 5, 16, 17, 33, 70, 129]
    q, k_cache, v_cache, tables, lens_t = _case(len(lens), heads, kv_heads, head_dim, block_size, lens,
                                                dtype=torch.bfloat16, seed=heads + head_dim)
    q = q.float()
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    paged_decode_attention(out, q, k_cache, v_cache, tables, lens_t, scale)
    torch.testing.assert_close(out.double(), _bf16_dots_reference(q, k_cache, v_cache, tables, lens_t, scale),
                               atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, lens_t, scale), atol=2e-2, rtol=2e-2)


def test_paged_decode_attention_writes_into_a_view_and_reads_only_its_blocks() -> None:
    """Output rows may be a slice of a larger tensor; blocks outside the tables
    (here NaN) are never read."""
    lens = [20, 33]
    q, k_cache, v_cache, tables, lens_t = _case(len(lens), 6, 2, 32, 8, lens, seed=2)
    used = set(tables[0, :3].tolist()) | set(tables[1, :5].tolist())
    for b in range(k_cache.shape[0]):
        if b not in used:
            k_cache[b] = float("nan")
            v_cache[b] = float("nan")
    big = torch.zeros(5, 6, 32)
    paged_decode_attention(big[1:3], q, k_cache, v_cache, tables, lens_t, 0.2)
    torch.testing.assert_close(big[1:3], _reference(q, k_cache, v_cache, tables, lens_t, 0.2), atol=1e-5, rtol=1e-5)
    assert big[0].abs().sum() == 0 and big[3:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 500])
def test_paged_decode_attention_with_a_sliding_window(window, dtype) -> None:
    """`window`: each row attends its last `window` keys (a Gemma 3 / Mistral sliding
    layer's), starting mid-block; blocks wholly before the window are never read (NaN
    here, as the hybrid cache's freed sliding blocks may be reused by anything)."""
    lens = [1, 17, 64, 5, 200, 33, 48]
    q, k_cache, v_cache, tables, lens_t = _case(len(lens), 9, 3, 64, 16, lens, dtype=dtype, seed=4)
    read = {int(t) for s, n in enumerate(lens) for t in tables[s, max(0, n - window) // 16: -(-n // 16)]}
    for b in set(range(k_cache.shape[0])) - read:
        k_cache[b] = v_cache[b] = float("nan")
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(out, q, k_cache, v_cache, tables, lens_t, 0.125, window=window)
    expected = _reference(q, k_cache, v_cache, tables, lens_t, 0.125, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 24])
def test_paged_decode_attention_rows_are_batch_and_thread_invariant(window) -> None:
    """Deterministic inference (runner/plan.py batch_invariant_plan) rests on this: a row's
    output is bitwise the same whether it is computed alone, among other rows (which change
    the work split from one head per item to whole sequences) or on one thread."""
    lens = [1, 2, 3, 16, 17, 31, 33, 64, 100, 130, 7, 90]
    q, k_cache, v_cache, tables, lens_t = _case(len(lens), 9, 3, 64, 16, lens, seed=5)
    together = torch.empty_like(q)
    paged_decode_attention(together, q, k_cache, v_cache, tables, lens_t, 0.125, window=window)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = torch.empty_like(q)
        paged_decode_attention(one_thread, q, k_cache, v_cache, tables, lens_t, 0.125, window=window)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together)
    for s in range(len(lens)):
        alone = torch.empty_like(q[s:s + 1])
        paged_decode_attention(alone, q[s:s + 1], k_cache, v_cache, tables[s:s + 1], lens_t[s:s + 1], 0.125,
                               window=window)
        assert torch.equal(alone, together[s:s + 1]), f"row {s} differs alone and in the batch"


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "int8", "fp8"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 32, 16), (2, 1, 128, 16), (8, 2, 64, 16), (6, 2, 20, 5)],
    ids=["gqa3-d64", "mha-d32", "mqa-d128", "gqa4-d64-untiled", "gqa3-d20-bs5"],
)
def test_paged_decode_attention_prompt_rows_read_blocks_once_with_each_rows_bits(
        cache, heads, kv_heads, head_dim, block_size) -> None:
    """A prompt laid out as one-token rows over one block table (deterministic inference's
    prefill) runs as runs of rows that read each K/V block once (attend_rows); every row must
    keep the bits it has alone: 1, 7, 64 and 300 rows (ragged: the last block of each row
    partial, runs split into items of up to 16 rows), two prompts and a decode row in one
    call, every cache dtype (8-bit ones with their scales), tiled and untiled head groups, one
    thread and two."""
    from tokenmill.attention import kv_quant

    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    for rows in (1, 7, 64, 300):
        lens = list(range(1, rows + 1)) + list(range(20, 29)) + [45]  # a prompt, another's chunk, a decode row
        seqs = [0] * rows + [1] * 9 + [2]
        blocks = -(-max(lens) // block_size)
        k = torch.randn(3 * blocks + 2, block_size, kv_heads, head_dim, generator=gen)
        v = torch.randn(3 * blocks + 2, block_size, kv_heads, head_dim, generator=gen)
        scales = {}
        if cache in ("int8", "fp8"):
            dtype = torch.int8 if cache == "int8" else kv_quant.fp8_dtype()
            if dtype is None:
                pytest.skip("no float8_e4m3fn in this torch")
            (k, ks), (v, vs) = kv_quant.quantize(k, dtype), kv_quant.quantize(v, dtype)
            scales = {"kv_scales": (ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous())}
        else:
            k, v = k.to(getattr(torch, cache)), v.to(getattr(torch, cache))
        perm = torch.randperm(k.shape[0], generator=gen)[: 3 * blocks].view(3, blocks).int()
        tables = perm[seqs].contiguous()
        lens_t = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(len(lens), heads, head_dim, generator=gen)
        together = torch.empty_like(q)
        paged_decode_attention(together, q, k, v, tables, lens_t, 0.125, **scales)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one_thread = torch.empty_like(q)
            paged_decode_attention(one_thread, q, k, v, tables, lens_t, 0.125, **scales)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one_thread, together)
        for s in range(len(lens)):
            alone = torch.empty_like(q[s:s + 1])
            paged_decode_attention(alone, q[s:s + 1], k, v, tables[s:s + 1], lens_t[s:s + 1], 0.125, **scales)
            assert torch.equal(alone, together[s:s + 1]), f"{rows} rows: row {s} differs alone and in its run"
        if cache == "float32":
            torch.testing.assert_close(together, _reference(q, k, v, tables, lens_t, 0.125), atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_rejects_bad_shapes() -> None:
    q, k_cache, v_cache, tables, lens_t = _case(2, 6, 4, 32, 8, [4, 4])  # 6 heads, 4 KV heads
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, tables, lens_t, 1.0)
    q, k_cache, v_cache, tables, lens_t = _case(2, 4, 2, 32, 8, [4, 4])
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, tables.long(), lens_t, 1.0)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, tables, torch.tensor([4, 99], dtype=torch.int32), 1.0)


# ----- skinny_linear and the CPU linear paths ------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 40])
@pytest.mark.parametrize("n,k", [(96, 64), (33, 48), (2, 16)], ids=["even", "ragged-tile", "one-tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_linear_matches_f_linear(rows, n, k, dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    expected = F.linear(x, weight.float())  # bf16 weights, float32 arithmetic
    torch.testing.assert_close(skinny_linear(x, tile_for_skinny(weight), n), expected, atol=1e-4, rtol=1e-4)


def test_tiled_layout_round_trips_and_rejects_what_it_cannot_hold() -> None:
    weight = torch.randn(37, 32)
    tiled = tile_for_skinny(weight, torch.bfloat16)
    assert tiled.shape == (10, 2, 4, 16) and tiled.dtype == torch.bfloat16
    torch.testing.assert_close(kernels.untile_skinny(tiled, 37), weight.bfloat16())
    assert not kernels.can_tile_for_skinny(torch.randn(8, 20))
    with pytest.raises(ValueError, match="divisible by 16"):
        tile_for_skinny(torch.randn(8, 20))
    with pytest.raises(RuntimeError, match="disagree on K"):
        skinny_linear(torch.randn(2, 16), tiled, 37)
    with pytest.raises(RuntimeError, match="number of weight tiles"):
        skinny_linear(torch.randn(2, 32), tiled, 41)


def _panels_or_refused(dtype: torch.dtype) -> bool:
    """Whether this build has the panel kernel for `dtype`; where it does not, the op says so."""
    if kernels.panel_linear_built(dtype):
        return True
    with pytest.raises(RuntimeError, match="needs an AVX-512 build"):
        kernels.panel_linear(torch.randn(2, 64), kernels.pack_panels(torch.randn(8, 64), dtype), 8)
    return False


@pytest.mark.parametrize("n,k", [(70, 48), (64, 2050), (130, 1100), (5, 6)],
                         ids=["ragged-panel", "k-blocks-bf16", "k-blocks-f32", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_matches_a_float64_reference_and_gives_a_row_its_bits_at_any_row_count(n, k, dtype) -> None:
    """The panel kernel computes x . W^T (bf16 panels: x rounded to bf16 as torch rounds it)
    within float32 rounding of a float64 reference, and a row's outputs are bit for bit the
    same alone, among 1-130 rows at any position, and on one thread (its sum over K is in
    order, K blocks through y included, never split over threads)."""
    if not _panels_or_refused(dtype):
        return
    gen = torch.Generator().manual_seed(n * 31 + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    panels = kernels.pack_panels(weight, dtype)
    x = torch.randn(130, k, generator=gen)
    y = kernels.panel_linear(x, panels, n)
    expected = x.to(dtype).double() @ weight.double().T
    assert (y.double() - expected).abs().max() <= 1e-5 * k ** 0.5 * (1 + expected.abs().max())
    for rows in (1, 2, 5, 6, 7, 13, 48, 49, 130):
        for start in (0, 130 - rows):
            part = kernels.panel_linear(x[start:start + rows].contiguous(), panels, n)
            assert torch.equal(part, y[start:start + rows]), (rows, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.panel_linear(x, panels, n), y)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_layout_round_trips_gives_rows_and_rejects_what_it_cannot_hold(dtype) -> None:
    weight = torch.randn(70, 48).to(dtype)
    panels = kernels.pack_panels(weight, dtype)
    assert panels.shape == ((2, 48, 64) if dtype == torch.float32 else (2, 24, 64, 2))
    assert torch.equal(kernels.unpack_panels(panels, 70), weight)
    ids = torch.tensor([0, 69, 64, 3])
    assert torch.equal(kernels.panel_rows(panels, ids), weight[ids])
    if dtype == torch.bfloat16:
        with pytest.raises(ValueError, match="even in_features"):
            kernels.pack_panels(torch.randn(8, 7), dtype)
    if not kernels.panel_linear_built(dtype):
        return
    with pytest.raises(RuntimeError, match="disagree on K"):
        kernels.panel_linear(torch.randn(2, 50), panels, 70)
    with pytest.raises(RuntimeError, match="number of panels"):
        kernels.panel_linear(torch.randn(2, 48), panels, 129)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "no-onednn"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_prepared_linear_matches_f_linear_for_every_row_count(onednn, weight_dtype) -> None:
    """Prepared for the CPU, a Linear computes the same product (on its weights as stored)
    through the skinny kernel, oneDNN or F.linear, whatever the row count; the plain
    weight is gone."""
    from tokenmill.model.layers import Linear
    from tokenmill.quantization import DenseFormat
    from tokenmill.runner.plan import cpu_native_plan

    layer = Linear(48, 70, bias=True)
    reference = layer.weight.detach().to(weight_dtype).float()
    bias = layer.bias.detach().clone()
    plan = cpu_native_plan(weight_dtype, onednn=onednn)
    SKINNY_MAX_ROWS = plan.weight_format.choice.skinny_max_rows
    layer.set_format(plan.weight_format)
    weights = layer.weights
    assert layer.weight is None and weights.tiled is not None and (weights.packed is not None) == onednn
    with torch.no_grad():
        for rows in (1, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 300):
            x = torch.randn(rows, 48)
            # oneDNN multiplies the float32 weight: bf16 rounding shows only below the threshold.
            exact = weight_dtype == torch.float32 or rows <= SKINNY_MAX_ROWS or not onednn
            tol = 1e-4 if exact else 2e-2
            torch.testing.assert_close(layer(x), F.linear(x, reference, bias), atol=tol, rtol=tol)


def _tiny_llama(tie: bool = True):
    from tokenmill.model_arch import ModelArchConfig
    from tokenmill.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = ModelArchConfig(
        architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_preparing_a_model_keeps_its_logits(tie) -> None:
    from tokenmill.kernels.ops import NATIVE_OPS
    from tokenmill.model.layers import set_weight_format
    from tokenmill.runner.plan import cpu_native_plan

    model = _tiny_llama(tie)
    ids = torch.randint(0, 300, (40,))
    with torch.inference_mode():
        before = model.compute_logits(model(ids, torch.arange(40)))
        prepared = set_weight_format(model, cpu_native_plan(torch.float32).weight_format)
        assert prepared == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
        model.use_ops(NATIVE_OPS)
        after = model.compute_logits(model(ids, torch.arange(40)))
        one = model.compute_logits(model(ids[:1], torch.arange(1)))  # 1 row: the skinny path
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(one, before[:1], atol=1e-4, rtol=1e-4)


def test_bfloat16_weights_compute_in_float32_like_a_rounded_float32_model() -> None:
    """--dtype bfloat16 on a CPU without bf16 arithmetic: the weights are stored in bf16,
    activations stay float32. Decode-shaped steps then equal a float32 model whose
    weights were rounded to bf16."""
    from tokenmill.runner.plan import apply_plan, cpu_native_plan

    model, rounded = _tiny_llama(), _tiny_llama()
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.bfloat16().float())
    ids = torch.randint(0, 300, (12,))
    with torch.inference_mode():
        apply_plan(model, cpu_native_plan(torch.bfloat16, onednn=False))
        # The tied embedding is served by the head's bf16 tiles (no table of its own).
        assert model.dtype == torch.float32 and model.embed_tokens.weight is None
        assert model.lm_head.weights.tiled.dtype == torch.bfloat16
        got = model.compute_logits(model(ids, torch.arange(12)))
        expected = rounded.compute_logits(rounded(ids, torch.arange(12)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_dtype_plan_on_a_cpu_without_bf16_arithmetic(monkeypatch) -> None:
    from tokenmill.runner import worker as factory

    cpu = torch.device("cpu")
    monkeypatch.setattr(factory, "cpu_has_native_bf16", lambda: False)
    plan = factory.resolve_dtype("bfloat16", cpu)
    assert plan == factory.DtypePlan(compute="float32", weights="bfloat16", kv="bfloat16")
    assert str(plan) == "bfloat16 weights and KV cache, float32 compute" and plan.kv_cache == "bfloat16"
    assert factory.resolve_dtype("auto", cpu) == factory.DtypePlan("float32", "float32")
    monkeypatch.setattr(factory, "cpu_has_native_bf16", lambda: True)
    assert factory.resolve_dtype("bfloat16", cpu) == factory.DtypePlan("bfloat16", "bfloat16")
    assert factory.resolve_dtype("auto", cpu) == factory.DtypePlan("bfloat16", "bfloat16")


# ----- fused element-wise ops ---------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_fused_norms_match_torch(tokens) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x, residual = torch.randn(tokens, 72, generator=gen), torch.randn(tokens, 72, generator=gen)
    weight = torch.rand(72, generator=gen) + 0.5
    expected = F.rms_norm(x, (72,), weight, 1e-6)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), expected, atol=1e-5, rtol=1e-5)
    summed = x + residual
    out = kernels.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, summed)  # updated in place
    torch.testing.assert_close(out, F.rms_norm(summed, (72,), weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [1, 7, 16, 23, 49152])
def test_argmax_rows_is_torchs_argmax_ties_nans_and_infinities_included(width) -> None:
    """Greedy sampling's native argmax gives torch.argmax(x, -1) exactly: the first of equal
    maxima (ties planted across and within lanes, and in the tail), the first NaN where a row
    has one (in the vector part or the tail), -inf rows, rows of a strided view; bf16 logits
    go to torch's reduction."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, width + 3, generator=gen)[:, :width]  # rows apart: stride != width
    if width >= 3:
        x[1, [width // 3, width - 1, 0]] = 50.0  # a tie: the first wins
        x[2, width // 2] = float("nan")
        x[2, width - 1] = float("nan")
        x[3, width - 1] = float("nan")  # in the tail for most widths
        x[4] = float("-inf")
        x[5, -1] = float("inf")
        x[6] = 0.0
        x[7, width - 2 :] = 7.0
    x[8, 0] = float("nan")
    for rows in (x, x[:1], x[5:]):
        assert torch.equal(kernels.argmax_rows(rows), rows.argmax(dim=-1))
    assert torch.equal(kernels.argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=-1))


def test_the_runners_sampler_takes_the_native_argmax_with_torchs_answers() -> None:
    from tokenmill.sampling.params import SamplingParams
    from tokenmill.sampling.sampler import Sampler, SamplingRow

    logits = torch.randn(32, 1000)
    logits[3, [10, 500]] = 40.0
    rows = [SamplingRow(SamplingParams(temperature=0), None, [1], [], []) for _ in range(32)]
    native, plain = Sampler(0, kernels.argmax_rows), Sampler(0)
    assert native(logits, rows).token_ids == plain(logits, rows).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_silu_and_mul_matches_torch(tokens) -> None:
    x = torch.randn(tokens, 2 * 100) * 8  # wide range: the exp approximation at both ends
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -88.0])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_large_kernel_outputs_reuse_freed_buffers_and_never_alias_live_ones() -> None:
    """glibc maps outputs of 32 MiB or more afresh and the kernel faults in every page at
    every call: the kernels' large outputs come from a cache of freed buffers instead."""
    x = torch.randn(512, 2 * 8192)  # silu_and_mul writes 16 MiB
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    first = kernels.silu_and_mul(x)
    address = first.data_ptr()
    del first  # back to the cache, pages resident
    assert kernels.activation_cache_stats()[1] >= 16 << 20
    second = kernels.silu_and_mul(x)
    assert second.data_ptr() == address  # the freed buffer, not a fresh mapping
    third = kernels.silu_and_mul(x * 2)  # while `second` lives: a buffer of its own
    assert third.data_ptr() != address
    torch.testing.assert_close(second, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(third, F.silu(2 * gate) * 2 * up, atol=1e-5, rtol=1e-5)
    small = kernels.silu_and_mul(torch.randn(4, 200))  # under 1 MiB: the heap's
    del second, third, small
    assert kernels.activation_cache_stats()[1] >= 32 << 20


def test_the_output_cache_returns_the_least_recently_freed_buffers_past_its_bound() -> None:
    outputs = [kernels.silu_and_mul(torch.zeros(rows, 2 * 8192)) for rows in range(512, 512 + 40 * 64, 64)]
    assert sum(o.numel() * 4 for o in outputs) > 1 << 30  # more than the cache keeps
    del outputs
    buffers, nbytes = kernels.activation_cache_stats()
    assert 0 < nbytes <= 512 << 20 and buffers < 40


def test_rotary_in_place_matches_the_torch_rotation_on_a_strided_view() -> None:
    from tokenmill.model.layers import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(32, 64, 10000.0, None)
    cos, sin = rope.table(torch.tensor([0, 5, 63]))
    qkv = torch.randn(3, 7 * 32 + 16)  # q/k heads are a column slice: rows are strided
    view = qkv[:, : 7 * 32].view(3, 7, 32)
    x1, x2 = view.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    tail = qkv[:, 7 * 32 :].clone()
    kernels.rotary_(view, cos, sin)
    torch.testing.assert_close(view, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 7 * 32 :], tail)
    # apply_rotary takes the native op for float32 CPU tensors, its torch path under autograd.
    x = torch.randn(3, 7, 32)
    native = apply_rotary(x.clone(), cos, sin)
    fallback = apply_rotary(x.clone().requires_grad_(True), cos, sin)
    assert fallback.requires_grad
    torch.testing.assert_close(native, fallback.detach(), atol=1e-6, rtol=1e-6)


# ----- choosing the backend ----------------------------------------------------------------


def test_attention_backend_choice_and_its_errors() -> None:
    from tokenmill.attention.cpu_native import CPUNativeBackend
    from tokenmill.attention.torch_sdpa import TorchSDPABackend
    from tokenmill.runner.worker import select_attention_backend
    from tokenmill.config import EngineConfig

    cpu = torch.device("cpu")
    assert isinstance(select_attention_backend("auto", cpu, kernels_ok=True), CPUNativeBackend)
    assert type(select_attention_backend("torch_sdpa", cpu, kernels_ok=True)) is TorchSDPABackend
    assert type(select_attention_backend("auto", cpu, kernels_ok=False)) is TorchSDPABackend  # kernels off
    assert type(select_attention_backend("auto", torch.device("cuda"), kernels_ok=False)) is TorchSDPABackend
    with pytest.raises(ValueError, match="runs on the CPU only"):
        select_attention_backend("cpu_native", torch.device("cuda"), kernels_ok=False)
    with pytest.raises(ValueError, match="needs the native CPU kernels"):
        select_attention_backend("cpu_native", cpu, kernels_ok=False)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig.from_kwargs(attention_backend="flash")


def test_fused_decode_layer_rejects_bad_slots_and_caches() -> None:
    """The fused decode layer checks what it writes before it writes: a slot outside the
    cache and a cache it cannot read (int8 codes without their scales) are named errors,
    and nothing is written."""
    h, residual = torch.zeros(1, 32), torch.randn(1, 32)
    norm = torch.ones(32)
    from tokenmill.kernels.fused_layer import DecodeOperand, FusedLayerOperands

    shapes = ((96, 32), (32, 32), (64, 32), (32, 32))  # qkv, o, gate_up, down
    weights = [DecodeOperand(tile_for_skinny(torch.randn(n, k)), n) for n, k in shapes]
    layer = FusedLayerOperands(norm, norm, 1e-6, weights, 2, 2, 16, 0.25)
    rope = (torch.ones(1, 8), torch.zeros(1, 8))
    cache = (torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16))
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)

    def run(kv_cache, slot):
        return kernels.llama_decode_layer(h, residual.clone(), layer, rope, kv_cache, torch.tensor([slot]), tables,
                                          lens)

    assert run(cache, 3).shape == (1, 32) and cache[0][0, 3].abs().sum() > 0  # slot 3 written
    fresh = (torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16))
    with pytest.raises(RuntimeError, match="KV slot out of range"):
        run(fresh, 8)
    assert fresh[0].abs().sum() == 0 and fresh[1].abs().sum() == 0
    codes = tuple(torch.zeros(2, 4, 2, 16, dtype=torch.int8) for _ in range(2))
    with pytest.raises(RuntimeError, match="needs its k and v scales"):
        run(codes, 0)
    assert codes[0].abs().sum() == 0 and codes[1].abs().sum() == 0


def test_tiled_rows_are_the_weight_rows() -> None:
    weight = torch.randn(37, 48)
    tiled = tile_for_skinny(weight, torch.bfloat16)
    ids = torch.tensor([0, 36, 5, 5, 17])
    torch.testing.assert_close(kernels.tiled_rows(tiled, ids).float(), weight.bfloat16().float()[ids])


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_loading_straight_into_a_weight_format_equals_formatting_afterwards(tie) -> None:
    """load_weights(fmt): each linear goes into the format as soon as its parts are in (no
    float copy of the whole model); the result equals loading plain and formatting after."""
    from tokenmill.runner.plan import apply_plan, cpu_native_plan

    source = _tiny_llama(tie)
    state = _checkpoint_of(source)
    plan = cpu_native_plan(torch.bfloat16)
    streamed, after = _tiny_llama(tie), _tiny_llama(tie)
    streamed.load_weights(iter(state), plan.weight_format)
    assert all(lin.weight is None for lin in (streamed.layers[0].self_attn.qkv_proj, streamed.layers[1].mlp.down_proj))
    apply_plan(streamed, plan)
    after.load_weights(iter(state))
    apply_plan(after, plan)
    ids = torch.randint(0, 300, (9,))
    with torch.inference_mode():
        torch.testing.assert_close(streamed.compute_logits(streamed(ids, torch.arange(9))),
                                   after.compute_logits(after(ids, torch.arange(9))))
    assert (streamed.embed_tokens.weight is None) == tie  # a tied head serves the embedding


def _checkpoint_of(model) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters under Hugging Face names (q/k/v and gate/up unfused)."""
    cfg = model.cfg
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out = []
    for name, param in model.named_parameters():
        p = param.detach().clone()
        if "qkv_proj" in name:
            out += [(name.replace("qkv_proj", part), t) for part, t in zip(("q_proj", "k_proj", "v_proj"),
                                                                            p.split([q, kv, kv]))]
        elif "gate_up_proj" in name:
            out += [(name.replace("gate_up_proj", part), t) for part, t in zip(("gate_proj", "up_proj"),
                                                                                p.split([inter, inter]))]
        else:
            out.append((name, p))
    return out


def test_prefill_attention_follows_the_measured_gemm_dtype() -> None:
    """Where the GEMMs measured fastest in bf16 (native bf16 arithmetic), prefill attention
    runs in bf16 too; with float32 GEMMs (or float32 weights) it stays in float32. The bf16
    result is the float32 one within bf16 rounding, chunked (context from the cache) or not."""
    from tokenmill.attention.backend import BatchLayout
    from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache
    from tokenmill.attention.paged_sdpa import attend_prefills, prefill_spans
    from tokenmill.quantization.dense import CPUMatmulChoice
    from tokenmill.runner.plan import cpu_native_plan, quantized_plan

    bf16_plan = cpu_native_plan(torch.bfloat16, choice=CPUMatmulChoice(8, "onednn_bf16"))
    assert bf16_plan.prefill_attention_dtype == torch.bfloat16 and "prefill attention in bfloat16" in bf16_plan.describe()
    assert quantized_plan(bf16_plan, "int8").prefill_attention_dtype == torch.bfloat16
    assert cpu_native_plan(torch.bfloat16, choice=CPUMatmulChoice(8, "onednn_f32")).prefill_attention_dtype is None
    assert cpu_native_plan(torch.float32).prefill_attention_dtype is None
    from tokenmill.attention.torch_sdpa import TorchSDPABackend

    shared = TorchSDPABackend()
    for_bf16 = shared.for_plan(torch.bfloat16)  # a copy: a draft's plan may differ from its target's
    assert for_bf16.prefill_dtype == torch.bfloat16 and shared.prefill_dtype is None

    torch.manual_seed(0)
    cache = PagedKVCache(KVCacheSpec(1, 2, 16, 4, torch.bfloat16), 16, torch.device("cpu"))[0]
    # request 0: 10 new tokens after 6 cached ones (a chunk reading its context); request 1: 7 fresh tokens
    layout = BatchLayout(query_lens=[10, 7], context_lens=[16, 7], block_tables=[[0, 1, 2, 3], [4, 5]],
                         slot_mapping=list(range(6, 16)) + list(range(16, 23)), block_size=4)
    cache.write(torch.randn(6, 2, 16), torch.randn(6, 2, 16), torch.arange(6))
    q, k, v = torch.randn(17, 4, 16), torch.randn(17, 2, 16), torch.randn(17, 2, 16)
    slots = torch.tensor(layout.slot_mapping)
    cache.write(k, v, slots)
    spans = prefill_spans(layout, torch.device("cpu"))
    outs = {}
    for dtype in (None, torch.bfloat16):
        out = torch.empty_like(q)
        attend_prefills(q, k, v, cache, spans, 0.25, out, slots, dtype)
        outs[dtype] = out
    assert outs[torch.bfloat16].dtype == torch.float32
    torch.testing.assert_close(outs[torch.bfloat16], outs[None], atol=3e-2, rtol=3e-2)
    assert not torch.equal(outs[torch.bfloat16], outs[None])  # it did run in bf16


def test_lm_head_weights_for_many_rows() -> None:
    """An LM head gets a row per sampling sequence. With bf16 GEMMs it keeps a bf16 oneDNN
    copy; without one, rows past the skinny kernel's go through it a chunk at a time; both
    equal the plain product (within the weights' dtype)."""
    from tokenmill.quantization.dense import CPUMatmulChoice, DenseFormat

    weight, x = torch.randn(200, 64), torch.randn(21, 64)
    bf16_head = DenseFormat(torch.bfloat16, cpu_layout=True, onednn=True,
                            choice=CPUMatmulChoice(4, "onednn_bf16")).make(weight, many_rows=False)
    assert bf16_head.packed is not None
    f32_head = DenseFormat(torch.float32, cpu_layout=True, onednn=True,
                           choice=CPUMatmulChoice(4, "onednn_f32")).make(weight, many_rows=False)
    assert f32_head.packed is None
    torch.testing.assert_close(f32_head.apply(x), x @ weight.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bf16_head.apply(x), x @ weight.bfloat16().float().T, atol=0.15, rtol=0.02)


def test_the_build_name_includes_the_venv(monkeypatch) -> None:
    """Two venvs (or checkouts) with the same torch used one cache name, and torch rebuilt
    the kernels whenever the other had built them last (issue 31)."""
    import sys

    from tokenmill import kernels

    kernels.build_name.cache_clear()
    here = kernels.build_name()
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    kernels.build_name.cache_clear()
    try:
        assert kernels.build_name() != here
        assert kernels.build_name().startswith("tokenmill_cpu_kernels_")
    finally:
        monkeypatch.undo()
        kernels.build_name.cache_clear()
    assert kernels.build_name() == here


def test_onednn_row_buckets_are_few_and_tight() -> None:
    """oneDNN's row counts are padded to buckets (issue 31: a primitive per shape grew the
    server by ~620 MB): never fewer rows than asked, at most 12.5% more beyond 64 rows,
    and at most 8 buckets per doubling."""
    from tokenmill.quantization.dense import onednn_rows

    for rows in range(1, 5000):
        padded = onednn_rows(rows)
        assert rows <= padded <= (rows + 7 if rows <= 64 else rows * 1.125), rows
        assert onednn_rows(padded) == padded
    assert len({onednn_rows(r) for r in range(3, 65)}) == 8
    for low in (64, 128, 1024):
        assert len({onednn_rows(r) for r in range(low + 1, 2 * low + 1)}) == 8


_PRIMITIVE_GROWTH = r"""
import json, os, torch
from tokenmill.quantization.dense import CPUMatmulChoice, DenseFormat, bound_onednn_caches
env = bound_onednn_caches()
torch.set_num_threads(1)
rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
weights = DenseFormat(torch.float32, cpu_layout=True, onednn=True, choice=CPUMatmulChoice(2)).make(torch.randn(1536, 576))
weights.apply(torch.randn(3, 576))
before = rss()
for rows in range(3, 401):  # a new row count every call, as prompts of every length make
    weights.apply(torch.randn(rows, 576))
print(json.dumps({"growth_mb": rss() - before, "env": env}))
"""


def test_onednn_primitives_do_not_grow_with_row_counts() -> None:
    """398 multiplies of 398 different row counts, in a fresh process: oneDNN's compiled
    primitives (~0.6 MB per shape) stay bounded (without the row buckets: ~230 MB), and
    both oneDNN caches are bounded unless the user set them."""
    import json
    import os
    import subprocess
    import sys

    from tokenmill.quantization.dense import ONEDNN_CACHE_CAPACITY

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", _PRIMITIVE_GROWTH], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["env"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY),
                             "LRU_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY)}
    assert result["growth_mb"] < 60, result
    user = subprocess.run([sys.executable, "-c", "from tokenmill.quantization.dense import bound_onednn_caches as b; "
                           "print(b()['LRU_CACHE_CAPACITY'])"], env={**env, "LRU_CACHE_CAPACITY": "7"},
                          capture_output=True, text=True, timeout=60)
    assert user.stdout.strip() == "7", user.stderr[-2000:]


@pytest.mark.parametrize("n,L,heads,kv_heads,d", [(200, 200, 9, 3, 64), (37, 37, 4, 2, 32), (5, 50, 8, 8, 128),
                                                  (33, 70, 6, 2, 96), (1, 1, 2, 1, 64)])
def test_native_bf16_prefill_attention_matches_sdpa(n, L, heads, kv_heads, d) -> None:
    """The AVX-512 BF16 prefill kernel: n query rows over L keys (the last n are the chunk's
    own: bottom-right causal), grouped heads, strided views of one qkv tensor as the model
    gives them; against float32 SDPA it is as close as torch's bf16 SDPA is (bf16 inputs and
    probabilities, float32 softmax). Where the CPU lacks AVX-512 BF16 the op says so."""
    from tokenmill.hardware import cpu_info

    gen = torch.Generator().manual_seed(n + L)
    qkv = torch.randn(L, (heads + 2 * kv_heads) * d, generator=gen).bfloat16()
    q = qkv[L - n:, : heads * d].view(n, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(L, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(L, kv_heads, d)
    out = torch.empty(n, heads, d, dtype=torch.bfloat16)
    if not kernels.has_prefill_attention(d):
        assert not cpu_info().has("avx512_bf16")
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            kernels.prefill_attention(out, q, k, v, d**-0.5)
        return
    kernels.prefill_attention(out, q, k, v, d**-0.5)
    mask = torch.arange(L).unsqueeze(0) <= torch.arange(n).unsqueeze(1) + (L - n)

    def sdpa(dtype):
        qp, kp, vp = (t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=d**-0.5, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1).float()

    exact, torch_bf16 = sdpa(torch.float32), sdpa(torch.bfloat16)
    err = float((out.float() - exact).abs().max())
    assert err <= 1.5 * float((torch_bf16 - exact).abs().max()) + 4e-3, err
    assert not kernels.has_prefill_attention(80)  # head sizes without a kernel go to SDPA


@pytest.mark.parametrize("n,L", [(32, 544), (1, 17), (40, 40)])
def test_prefill_attention_reads_a_paged_cache_in_place(n, L) -> None:
    """With `key_slots` the kernel reads each key from its cache slot (blocks of 16 in any
    order, as a block table scatters them) while packing: the same bits as gathering the keys
    into a copy first, which it no longer needs. A slot outside the cache is refused."""
    from tokenmill.hardware import cpu_info

    if not kernels.has_prefill_attention(64):  # no kernel on this CPU: the other test checks the op says so
        assert not cpu_info().has("avx512_bf16")
        return
    gen = torch.Generator().manual_seed(n * L)
    blocks, block_size, kv_heads, heads, d = 64, 16, 3, 9, 64
    k_cache = torch.randn(blocks, block_size, kv_heads, d, generator=gen).bfloat16()
    v_cache = torch.randn(blocks, block_size, kv_heads, d, generator=gen).bfloat16()
    table = torch.randperm(blocks, generator=gen)[: -(-L // block_size)]
    slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)[:L].contiguous()
    q = torch.randn(n, heads, d, generator=gen).bfloat16()
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    gathered, in_place = torch.empty_like(q), torch.empty_like(q)
    kernels.prefill_attention(gathered, q, flat_k[slots], flat_v[slots], 0.125)
    kernels.prefill_attention(in_place, q, flat_k, flat_v, 0.125, slots)
    assert torch.equal(gathered, in_place)
    bad = slots.clone()
    bad[-1] = blocks * block_size
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.prefill_attention(in_place, q, flat_k, flat_v, 0.125, bad)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_attention_chunks_gives_each_chunk_its_own_bits(threads) -> None:
    """A step's prompt chunks in one call: chunks sharing a prefix (the same cache slots:
    blocks packed once for all of them), a chunk with a private context, one without context
    (its keys are its own rows), lengths not a multiple of the 32-key block; every chunk's
    rows equal `prefill_attention` over that chunk alone, bit for bit, on one thread or two.
    Rows outside the chunks are left as they were; bad tables are refused."""
    from tokenmill.hardware import cpu_info

    if not kernels.has_prefill_attention(64):
        assert not cpu_info().has("avx512_bf16")
        return
    gen = torch.Generator().manual_seed(7)
    blocks, block_size, kv_heads, heads, d = 96, 16, 3, 9, 64
    k_cache = torch.randn(blocks, block_size, kv_heads, d, generator=gen).bfloat16()
    v_cache = torch.randn(blocks, block_size, kv_heads, d, generator=gen).bfloat16()
    flat_k, flat_v = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    order = torch.randperm(blocks * block_size, generator=gen)
    prefix = order[:200]  # 200 keys shared by three chunks (6 whole blocks of 32 and a partial one)
    chunks = [  # (keys, query rows = the last n keys)
        (torch.cat([prefix, order[200:232]]), 32), (torch.cat([prefix, order[232:245]]), 13),
        (torch.cat([prefix, order[245:246]]), 1), (order[300:377], 20), (order[400:440], 40),
    ]
    decode_rows = 3  # rows before the chunks (a step's decodes): untouched
    n_total = decode_rows + sum(n for _, n in chunks)
    q = torch.randn(n_total, heads, d, generator=gen).bfloat16()
    out = torch.full_like(q, 7.0)
    row_starts = [decode_rows]
    for _, n in chunks:
        row_starts.append(row_starts[-1] + n)
    key_starts = [0]
    for keys, _ in chunks:
        key_starts.append(key_starts[-1] + len(keys))
    tables = (torch.tensor(row_starts), torch.cat([keys for keys, _ in chunks]).contiguous(), torch.tensor(key_starts))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.prefill_attention_chunks(out, q, flat_k, flat_v, 0.125, *tables)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(out[:decode_rows], torch.full_like(out[:decode_rows], 7.0))
    for c, (keys, n) in enumerate(chunks):
        alone = torch.empty(n, heads, d, dtype=torch.bfloat16)
        kernels.prefill_attention(alone, q[row_starts[c] : row_starts[c + 1]], flat_k, flat_v, 0.125, keys)
        assert torch.equal(out[row_starts[c] : row_starts[c + 1]], alone), c
    with pytest.raises(RuntimeError, match="must include its own rows"):
        kernels.prefill_attention_chunks(out, q, flat_k, flat_v, 0.125, torch.tensor([0, 50]), tables[1][:40],
                                         torch.tensor([0, 40]))
    bad = tables[1].clone()
    bad[5] = blocks * block_size
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.prefill_attention_chunks(out, q, flat_k, flat_v, 0.125, tables[0], bad, tables[2])
