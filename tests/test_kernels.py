"""The native CPU kernels against their pure-PyTorch fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import SKINNY_MAX_ROWS, cpu_kernels_available, paged_decode_attention, skinny_linear


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")


def _reference(q, k_cache, v_cache, tables, lens, scale):
    """The pure-PyTorch decode path: gather each sequence's history, then SDPA."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        slots = (tables[s].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:n]
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_attention_reduced_precision(dtype) -> None:
    """A bf16/fp16 cache and queries, float32 arithmetic inside."""
    lens = [3, 40, 129]
    q, k_cache, v_cache, tables, lens_t = _case(len(lens), 9, 3, 64, 16, lens, dtype=dtype, seed=1)
    out = torch.empty_like(q)
    paged_decode_attention(out, q, k_cache, v_cache, tables, lens_t, 0.125)
    expected = _reference(q, k_cache, v_cache, tables, lens_t, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


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


def test_paged_decode_attention_rejects_bad_shapes() -> None:
    q, k_cache, v_cache, tables, lens_t = _case(2, 6, 4, 32, 8, [4, 4])  # 6 heads, 4 KV heads
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, tables, lens_t, 1.0)
    q, k_cache, v_cache, tables, lens_t = _case(2, 4, 2, 32, 8, [4, 4])
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, tables.long(), lens_t, 1.0)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, tables, torch.tensor([4, 99], dtype=torch.int32), 1.0)


# ----- skinny_linear ---------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("n,k", [(96, 64), (33, 20), (7, 129)], ids=["even", "odd-rows-short-k", "odd-k"])
def test_skinny_linear_matches_f_linear(rows, n, k) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-4)


def test_skinny_linear_bf16_weights_compute_in_float32() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 576, generator=gen)
    weight = torch.randn(1000, 576, generator=gen).bfloat16()
    torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight.float()), atol=1e-3, rtol=1e-4)


def test_skinny_linear_is_what_decode_shaped_linears_use() -> None:
    from tokenmill.model.layers import Linear

    layer = Linear(64, 40, bias=True)
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        big = torch.randn(SKINNY_MAX_ROWS + 1, 64)  # past the kernel's limit: BLAS
        torch.testing.assert_close(layer(big), F.linear(big, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        skinny_linear(big, layer.weight.detach())


# ----- oneDNN-packed weights -------------------------------------------------------------


def test_packed_linear_matches_f_linear_for_every_row_count() -> None:
    from tokenmill.model.layers import PACKED_MIN_ROWS, Linear

    layer = Linear(48, 70, bias=True)
    layer.pack_for_cpu()
    assert layer.packed is not None
    with torch.no_grad():
        for rows in (1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 33, 300):
            x = torch.randn(rows, 48)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-4)


def test_packing_a_model_keeps_its_logits() -> None:
    from tokenmill.model.config import ModelArchConfig
    from tokenmill.model.layers import pack_linears_for_cpu
    from tokenmill.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = ModelArchConfig(
        architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (40,))
    with torch.inference_mode():
        before = model.compute_logits(model(ids, torch.arange(40)))
        assert pack_linears_for_cpu(model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
        after = model.compute_logits(model(ids, torch.arange(40)))
        one = model.compute_logits(model(ids[:1], torch.arange(1)))  # 1 row: the skinny path
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(one, before[:1], atol=1e-4, rtol=1e-4)


# ----- choosing the backend ----------------------------------------------------------------


def test_attention_backend_choice_and_its_errors() -> None:
    from tokenmill.attention.cpu_native import CPUNativeBackend
    from tokenmill.attention.torch_sdpa import TorchSDPABackend
    from tokenmill.config import EngineConfig
    from tokenmill.runner.factory import select_attention_backend

    cpu = torch.device("cpu")
    assert isinstance(select_attention_backend("auto", cpu), CPUNativeBackend)
    assert type(select_attention_backend("torch_sdpa", cpu)) is TorchSDPABackend
    assert type(select_attention_backend("auto", torch.device("cuda"))) is TorchSDPABackend  # no CUDA touched
    with pytest.raises(ValueError, match="runs on the CPU only"):
        select_attention_backend("cpu_native", torch.device("cuda"))
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
