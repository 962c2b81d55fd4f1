"""The packed bf16 KV cache (kv_cache.py's packed layout): the same values as the token layout,
written and read alike by PyTorch and the native ops; prompt chunks over it give the bits they
get from a token-layout cache, and a decode token the bits of the same token as the last row of
a prompt chunk (the prefill kernel's arithmetic, whichever step computes the token)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import kernels
from tokenmill.attention.kv_cache import KVCacheSpec, LayerKVCache, packed_as_tokens, tokens_as_packed
from tokenmill.hardware import cpu_info

HEADS, KV_HEADS = 9, 3


def _needs_kernel(d: int = 64) -> None:
    if not kernels.cpu_kernels_available() or not kernels.has_prefill_attention(d):
        assert not kernels.cpu_kernels_available() or not cpu_info().has("avx512_bf16")
        pytest.skip("the packed cache's attention is the AVX-512 BF16 prefill kernel's; this CPU has none")


def _caches(blocks: int, block_size: int, d: int, slots: torch.Tensor, gen: torch.Generator, stale=float("nan")):
    """A token-layout and a packed bf16 cache holding the same K and V in `slots`; the packed
    one's other slots hold `stale` (a freed request's leftovers)."""
    tokens, packed = (LayerKVCache.allocate(blocks, block_size, KV_HEADS, d, torch.bfloat16, packed=p)
                      for p in (False, True))
    packed.k.fill_(stale)
    packed.v.fill_(stale)
    k = torch.randn(len(slots), KV_HEADS, d, generator=gen)
    v = torch.randn(len(slots), KV_HEADS, d, generator=gen)
    tokens.write(k, v, slots)
    kernels.write_kv_cache(k, v, (packed.k, packed.v), None, slots)
    return tokens, packed


def test_packed_layout_round_trips_and_both_writes_agree() -> None:
    """Python's write (advanced indexing) and the native write (float32 and bf16 rows) give the
    same packed bytes; `read` gives the rows back as a token-layout cache gives them; the
    packed blocks are the token blocks permuted."""
    gen = torch.Generator().manual_seed(0)
    blocks, block_size, d = 6, 32, 64
    slots = torch.randperm(blocks * block_size, generator=gen)[:100]
    k = torch.randn(100, KV_HEADS, d, generator=gen)
    v = torch.randn(100, KV_HEADS, d, generator=gen)
    tokens = LayerKVCache.allocate(blocks, block_size, KV_HEADS, d, torch.bfloat16)
    tokens.write(k, v, slots)
    by_python, by_native, by_native_bf16 = (
        LayerKVCache.allocate(blocks, block_size, KV_HEADS, d, torch.bfloat16, packed=True) for _ in range(3))
    by_python.write(k, v, slots)
    assert by_python.packed and by_python.block_size == block_size
    assert by_python.k.shape == (blocks, KV_HEADS, block_size // 16, d // 2, 16, 2)
    assert by_python.v.shape == (blocks, KV_HEADS, block_size // 2, d, 2)
    if kernels.cpu_kernels_available():
        kernels.write_kv_cache(k, v, (by_native.k, by_native.v), None, slots)
        kernels.write_kv_cache(k.bfloat16(), v.bfloat16(), (by_native_bf16.k, by_native_bf16.v), None, slots)
        for other in (by_native, by_native_bf16):
            assert torch.equal(other.k, by_python.k) and torch.equal(other.v, by_python.v)
    for got, want in zip(by_python.read(slots[:37].view(37), torch.float32), tokens.read(slots[:37], torch.float32)):
        assert torch.equal(got, want)
    assert torch.equal(packed_as_tokens(by_python.k), tokens.k) and torch.equal(packed_as_tokens(by_python.v), tokens.v)
    assert torch.equal(tokens_as_packed(tokens.k, by_python.k), by_python.k)
    assert torch.equal(tokens_as_packed(tokens.v, by_python.v), by_python.v)
    with pytest.raises(ValueError, match="multiple of 16"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=8, dtype=torch.bfloat16, packed=True)
    with pytest.raises(ValueError, match="bfloat16"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.int8, packed=True)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_over_a_packed_cache_get_the_token_layouts_bits(block_size, threads) -> None:
    """The step's prompt chunks (a shared prefix, a private context, one without context,
    lengths off the 16- and 32-key groups) read in place from a packed cache whose unused slots
    hold NaN: the same bits as over the token-layout cache (where they are packed per call)."""
    _needs_kernel()
    gen = torch.Generator().manual_seed(block_size)
    blocks, d = 1024 // block_size, 64
    order = torch.randperm(blocks, generator=gen)

    def positions(table_blocks, length):  # keys 0 .. length - 1 through a block table
        return (table_blocks.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)[:length]

    prefix_blocks, rest = order[:4], iter(order[4:].tolist())

    def take(length):  # blocks enough for `length` keys
        return torch.tensor([next(rest) for _ in range(-(-length // block_size))], dtype=torch.long)

    chunks = [  # (keys in position order, query rows: the last n)
        (positions(torch.cat([prefix_blocks, take(45)]), 4 * block_size + 45), 45),
        (positions(torch.cat([prefix_blocks, take(1)]), 4 * block_size + 1), 1),
        (positions(take(77), 77), 77),
        (positions(take(block_size + 3), block_size + 3), 5),
    ]
    written = torch.unique(torch.cat([keys for keys, _ in chunks]))
    tokens, packed = _caches(blocks, block_size, d, written, gen)
    n_total = sum(n for _, n in chunks)
    q = torch.randn(n_total, HEADS, d, generator=gen).bfloat16()
    row_starts = torch.tensor([0] + torch.tensor([n for _, n in chunks]).cumsum(0).tolist())
    key_starts = torch.tensor([0] + torch.tensor([len(k) for k, _ in chunks]).cumsum(0).tolist())
    key_slots = torch.cat([keys for keys, _ in chunks]).contiguous()
    want, got = torch.empty_like(q), torch.empty_like(q)
    flat = [t.view(-1, KV_HEADS, d) for t in tokens]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.prefill_attention_chunks(want, q, *flat, 0.125, row_starts, key_slots, key_starts)
        kernels.prefill_attention_chunks(got, q, packed.k, packed.v, 0.125, row_starts, key_slots, key_starts)
    finally:
        torch.set_num_threads(previous)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)
    shifted = key_slots.clone()
    shifted[: len(chunks[0][0])] = (shifted[: len(chunks[0][0])] + 1) % (blocks * block_size)  # off the 16-key groups
    with pytest.raises(RuntimeError, match="position order"):
        kernels.prefill_attention_chunks(got, q, packed.k, packed.v, 0.125, row_starts, shifted, key_starts)


@pytest.mark.parametrize("io_dtype", [torch.float32, torch.bfloat16])
def test_a_decode_token_gets_the_bits_of_the_same_token_in_a_prompt_chunk(io_dtype) -> None:
    """Decodes over a packed cache (context 1 to 300 keys, block tables in any order, one thread
    or two, alone or in a batch): each row equals the same query as the last row of a prompt
    chunk over the same keys (float32 q rounded to bf16 as torch rounds it, the output the bf16
    result widened), bit for bit."""
    _needs_kernel()
    gen = torch.Generator().manual_seed(3)
    blocks, block_size, d = 80, 16, 64
    lens = [1, 15, 16, 17, 31, 32, 33, 100, 300]
    perm = torch.randperm(blocks, generator=gen)
    tables, used = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(perm[used : used + count])
        used += count
    width = max(len(t) for t in tables)
    block_tables = torch.stack([torch.cat([t, torch.zeros(width - len(t), dtype=t.dtype)]) for t in tables]).int()
    slots = [(t.unsqueeze(1) * block_size + torch.arange(block_size)).reshape(-1)[:n] for t, n in zip(tables, lens)]
    _, packed = _caches(blocks, block_size, d, torch.cat(slots), gen)
    q = torch.randn(len(lens), HEADS, d, generator=gen).to(io_dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    batch = torch.empty_like(q)
    kernels.paged_decode_attention(batch, q, packed.k, packed.v, block_tables, context_lens, 0.125)
    previous = torch.get_num_threads()
    for s, n in enumerate(lens):
        row = torch.empty(1, HEADS, d, dtype=torch.bfloat16)
        kernels.prefill_attention_chunks(row, q[s : s + 1].bfloat16(), packed.k, packed.v, 0.125,
                                         torch.tensor([0, 1]), slots[s].contiguous(), torch.tensor([0, n]))
        assert torch.equal(batch[s], row[0].to(io_dtype)), (s, n)
        torch.set_num_threads(1)
        try:
            alone = torch.empty_like(q[s : s + 1])
            kernels.paged_decode_attention(alone, q[s : s + 1].clone(), packed.k, packed.v, block_tables[s : s + 1].clone(),
                                           context_lens[s : s + 1].clone(), 0.125)
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(alone[0], batch[s])
    with pytest.raises(RuntimeError, match="sliding-window"):
        kernels.paged_decode_attention(batch, q, packed.k, packed.v, block_tables, context_lens, 0.125, window=8)
