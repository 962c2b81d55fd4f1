"""Tests of tokenmill.engine.block_manager on tiny sizes (block_size 4, ten blocks):
exact block ids, hash chains, reference counts, the LRU free queue, prefix-cache hits
and stats. `check_integrity()` runs after every operation."""

from __future__ import annotations

import copy

import pytest
from fakes import make_request

from tokenmill.engine.block_manager import KVBlockManager, hash_block
from tokenmill.engine.request import Request

BS = 4
NUM_BLOCKS = 10


@pytest.fixture
def kv() -> KVBlockManager:
    manager = KVBlockManager(NUM_BLOCKS, BS)
    manager.check_integrity()
    return manager


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def free_order(kv: KVBlockManager) -> list[int]:
    return list(kv.free_queue)


def admit(kv: KVBlockManager, request: Request, num_new: int | None = None) -> list[int]:
    """What the scheduler does at admission: look up hits, allocate the rest (all, or a
    chunk of `num_new`), mark them computed. Returns the hit block ids."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    kv.check_integrity()
    if num_new is None:
        num_new = request.num_tokens - num_hit_tokens
    assert kv.allocate_slots(request, num_new, hits)
    kv.check_integrity()
    request.num_computed_tokens = num_hit_tokens + num_new
    return hits


def compute(kv: KVBlockManager, request: Request, num_new: int) -> None:
    """A later step of a running request: the next `num_new` tokens."""
    assert kv.allocate_slots(request, num_new)
    kv.check_integrity()
    request.num_computed_tokens += num_new


def decode(kv: KVBlockManager, request: Request, token: int) -> None:
    """Sample `token`, then compute it in the next step."""
    request.append_output_token(token)
    compute(kv, request, 1)


def free(kv: KVBlockManager, request: Request) -> None:
    kv.free(request)
    kv.check_integrity()
    assert kv.get_block_ids(request.request_id) == []


def refs(kv: KVBlockManager) -> list[int]:
    return [block.ref_count for block in kv.blocks]


def chain(token_ids: list[int], salt: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(token_ids) // BS):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * BS : (i + 1) * BS], salt if i == 0 else None))
    return hashes


def snapshot(kv: KVBlockManager) -> dict:
    return {
        "free": list(kv.free_queue),
        "blocks": [(b.block_id, b.ref_count, b.block_hash) for b in kv.blocks],
        "cached": dict(kv.cached_blocks),
        "req_blocks": copy.deepcopy(kv.req_blocks),
        "req_num_hashed": dict(kv.req_num_hashed_blocks),
        "stats": (kv.stats.queries, kv.stats.hits),
    }


# ----- basics ------------------------------------------------------------------------


def test_fresh_manager(kv: KVBlockManager) -> None:
    assert kv.num_free_blocks == NUM_BLOCKS
    assert free_order(kv) == list(range(NUM_BLOCKS))
    assert kv.usage == 0.0
    assert kv.cached_blocks == {}
    assert kv.blocks_needed(0) == 0
    assert kv.blocks_needed(1) == 1
    assert kv.blocks_needed(4) == 1
    assert kv.blocks_needed(5) == 2


def test_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        KVBlockManager(0, BS)


def test_exact_block_ids_in_allocation_order(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(100, 10))
    assert admit(kv, a) == []
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert free_order(kv) == [3, 4, 5, 6, 7, 8, 9]
    b = make_request("b", tokens(200, 5))
    admit(kv, b)
    assert kv.get_block_ids("b") == [3, 4]
    assert refs(kv) == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(0.5)
    # Decoding fills b's second block, then needs a third, from the head of the queue.
    decode(kv, b, 7)  # 6 tokens computed
    decode(kv, b, 7)
    decode(kv, b, 7)  # 8 tokens: block 4 full
    assert kv.get_block_ids("b") == [3, 4]
    decode(kv, b, 7)  # 9th token
    assert kv.get_block_ids("b") == [3, 4, 5]
    assert free_order(kv) == [6, 7, 8, 9]


def test_chunked_allocation_grows_the_table(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 14))
    admit(kv, a, num_new=5)
    assert kv.get_block_ids("a") == [0, 1]
    compute(kv, a, 3)  # 8 tokens
    assert kv.get_block_ids("a") == [0, 1]
    compute(kv, a, 6)  # 14 tokens
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert [kv.blocks[i].block_hash for i in range(4)] == [*chain(a.all_token_ids), None]


# ----- hashes ------------------------------------------------------------------------


def test_full_blocks_are_hashed_as_a_chain(kv: KVBlockManager) -> None:
    prompt = tokens(100, 10)
    a = make_request("a", prompt)
    admit(kv, a)
    h0 = hash_block(None, prompt[0:4])
    h1 = hash_block(h0, prompt[4:8])
    assert kv.blocks[0].block_hash == h0
    assert kv.blocks[1].block_hash == h1
    assert kv.blocks[2].block_hash is None  # partial: 2 of 4 tokens
    assert kv.cached_blocks == {h0: 0, h1: 1}
    # Recomputing the chain gives the same hashes, and the request's own list agrees.
    assert chain(prompt) == [h0, h1]
    assert kv.req_hashes["a"] == [h0, h1]
    assert hash_block(None, prompt[0:4]) == h0  # deterministic
    assert len(h0) == 32


def test_changing_an_earlier_block_changes_every_later_hash() -> None:
    base = tokens(0, 16)
    h = chain(base)
    assert len(set(h)) == 4
    changed_first = [999, *base[1:]]
    assert all(x != y for x, y in zip(chain(changed_first), h))
    changed_second = [*base[:5], 999, *base[6:]]
    h2 = chain(changed_second)
    assert h2[0] == h[0]
    assert all(x != y for x, y in zip(h2[1:], h[1:]))
    # Same block content under a different parent hashes differently.
    assert hash_block(h[0], base[4:8]) != hash_block(None, base[4:8])
    assert hash_block(None, base[0:4]) != hash_block(None, base[0:3])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [4, 3, 2, 1])


def test_cache_salt_changes_the_first_hash_and_so_the_chain() -> None:
    base = tokens(0, 12)
    plain, salted, other = chain(base), chain(base, "alice"), chain(base, "bob")
    assert all(p != s for p, s in zip(plain, salted))
    assert all(s != o for s, o in zip(salted, other))
    assert chain(base, "alice") == salted
    assert hash_block(None, base[0:4], "alice") == salted[0]
    # The salt enters only the first block: later blocks follow the chain.
    assert salted[1] == hash_block(salted[0], base[4:8])


def test_cache_salt_isolates_prefix_cache_entries(kv: KVBlockManager) -> None:
    prompt = tokens(0, 9)
    admit(kv, make_request("a", prompt, cache_salt="alice"))
    assert kv.blocks[0].block_hash == chain(prompt, "alice")[0]
    assert kv.get_computed_blocks(make_request("plain", prompt)) == ([], 0)
    assert kv.get_computed_blocks(make_request("bob", prompt, cache_salt="bob")) == ([], 0)
    assert kv.get_computed_blocks(make_request("alice2", prompt, cache_salt="alice")) == ([0, 1], 8)
    kv.check_integrity()


def test_partial_blocks_are_not_cached(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 7))
    admit(kv, a)
    assert [kv.blocks[i].block_hash is not None for i in range(2)] == [True, False]
    # A request with the same 7 tokens and more hits only the one full block.
    b = make_request("b", tokens(0, 12))
    assert kv.get_computed_blocks(b) == ([0], 4)


def test_hit_never_covers_the_last_token(kv: KVBlockManager) -> None:
    prompt = tokens(0, 8)  # exactly two full blocks
    admit(kv, make_request("a", prompt))
    assert [kv.blocks[i].block_hash for i in range(2)] == chain(prompt)
    same = make_request("b", prompt)
    assert kv.get_computed_blocks(same) == ([0], 4)
    one_more = make_request("c", [*prompt, 50])
    assert kv.get_computed_blocks(one_more) == ([0, 1], 8)
    four = make_request("d", prompt[:4])
    assert kv.get_computed_blocks(four) == ([], 0)
    # Allocating with the hit gives b one new block for its last 4 tokens.
    hits = admit(kv, same)
    assert hits == [0]
    assert kv.get_block_ids("b") == [0, 2]
    assert refs(kv)[:3] == [2, 1, 1]
    # b recomputed the second block: same content as block 1, so block 2 stays unhashed.
    assert kv.blocks[2].block_hash is None


def test_decoded_tokens_are_hashed_when_their_block_is_computed(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 6))
    admit(kv, a)
    assert kv.blocks[1].block_hash is None
    decode(kv, a, 500)  # 7 computed
    decode(kv, a, 501)  # 8 computed: block 1 full
    assert kv.blocks[1].block_hash == chain(a.all_token_ids)[1]
    a.append_output_token(502)  # sampled, not yet computed: no new block, nothing hashed
    assert kv.get_block_ids("a") == [0, 1]
    # A later request with the generated text as its prompt hits both blocks.
    follower = make_request("f", [*tokens(0, 6), 500, 501, 502])
    assert kv.get_computed_blocks(follower) == ([0, 1], 8)


def test_without_generated_blocks_only_prompt_blocks_join_the_cache() -> None:
    """cache_generated=False (EngineFacts.cache_generated_kv: decodes do not compute what a
    prompt computes): a block holding a generated token stays out of the prefix cache, so a
    next turn whose prompt holds the answer hits the prompt's full blocks and computes the rest;
    computed again as a prompt, the answer's blocks then join the cache as that turn's."""
    kv = KVBlockManager(NUM_BLOCKS, BS, cache_generated=False)
    a = make_request("a", tokens(0, 6))
    admit(kv, a)
    for token in (500, 501, 502, 503, 504, 505):  # 12 computed: block 1 with two generated tokens, block 2 all four
        decode(kv, a, token)
    assert kv.blocks[0].block_hash == chain(a.all_token_ids)[0]
    assert kv.blocks[1].block_hash is None and kv.blocks[2].block_hash is None
    turn2 = make_request("b", [*a.all_token_ids, 600, 601])
    free(kv, a)
    hits, num_hit_tokens = kv.get_computed_blocks(turn2)
    assert (hits, num_hit_tokens) == ([0], BS)
    admit(kv, turn2)  # the answer computed as this turn's prompt: its full blocks join the cache
    assert set(kv.cached_blocks) == set(chain(turn2.all_token_ids))
    free(kv, turn2)
    turn3 = make_request("c", [*turn2.all_token_ids, 700])
    assert kv.get_computed_blocks(turn3)[1] == len(chain(turn2.all_token_ids)) * BS
    # A request whose output was preempted away hits its prompt's blocks only, not another's
    # prompt blocks holding the same tokens it decoded.
    resumed = make_request("r", tokens(0, 6))
    for token in (500, 501, 502, 503, 504, 505, 600):
        resumed.append_output_token(token)
    assert kv.get_computed_blocks(resumed) == ([0], BS) and kv.peek_cached_tokens(resumed) == BS


def test_no_hits_for_prompt_logprobs(kv: KVBlockManager) -> None:
    admit(kv, make_request("a", tokens(0, 9)))
    wants_logprobs = make_request("b", tokens(0, 9), prompt_logprobs=0)
    assert kv.get_computed_blocks(wants_logprobs) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", tokens(0, 9))) == ([0, 1], 8)


# ----- reference counts and sharing --------------------------------------------------


def test_shared_prefix_reference_counts(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 12))
    admit(kv, a)
    assert kv.get_block_ids("a") == [0, 1, 2]
    b = make_request("b", [*tokens(0, 8), 90, 91, 92, 93])
    assert admit(kv, b) == [0, 1]
    assert kv.get_block_ids("b") == [0, 1, 3]
    c = make_request("c", [*tokens(0, 4), 70, 71])
    assert admit(kv, c) == [0]
    assert kv.get_block_ids("c") == [0, 4]
    assert refs(kv) == [3, 2, 1, 1, 1, 0, 0, 0, 0, 0]
    assert kv.num_free_blocks == 5
    free(kv, a)
    assert refs(kv) == [2, 1, 0, 1, 1, 0, 0, 0, 0, 0]
    assert free_order(kv) == [5, 6, 7, 8, 9, 2]
    free(kv, b)
    assert refs(kv) == [1, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    # b's blocks, last first, at the tail (block 0 is still held by c).
    assert free_order(kv) == [5, 6, 7, 8, 9, 2, 3, 1]
    free(kv, c)
    # c's partial block 4 has no hash: to the head; its block 0 to the tail.
    assert free_order(kv) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert kv.num_free_blocks == NUM_BLOCKS
    assert len(kv.cached_blocks) == 4  # blocks 0, 1, 2, 3 keep their hashes while free


def test_free_order_hashed_reversed_at_tail_unhashed_at_head(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 10))  # blocks 0, 1 hashed, 2 partial
    admit(kv, a)
    b = make_request("b", tokens(50, 9))  # blocks 3, 4 hashed, 5 partial
    admit(kv, b)
    assert free_order(kv) == [6, 7, 8, 9]
    free(kv, a)
    assert free_order(kv) == [2, 6, 7, 8, 9, 1, 0]
    free(kv, b)
    assert free_order(kv) == [5, 2, 6, 7, 8, 9, 1, 0, 4, 3]


def test_free_order_without_caching_keeps_table_order_at_head() -> None:
    kv = KVBlockManager(NUM_BLOCKS, BS, enable_caching=False)
    a = make_request("a", tokens(0, 12))
    admit(kv, a)
    admit(kv, make_request("b", tokens(50, 4)))
    free(kv, a)
    assert free_order(kv) == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert all(block.block_hash is None for block in kv.blocks)


def test_lru_eviction_order_and_eviction_forgets_the_hash(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 12))  # blocks 0, 1, 2, all hashed
    admit(kv, a)
    free(kv, a)
    assert free_order(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    h = chain(tokens(0, 12))
    assert kv.cached_blocks == {h[0]: 0, h[1]: 1, h[2]: 2}
    # Eight blocks: the seven never-used ones first, then a's last block.
    big = make_request("big", tokens(500, 32))
    admit(kv, big)
    assert kv.get_block_ids("big") == [3, 4, 5, 6, 7, 8, 9, 2]
    assert free_order(kv) == [1, 0]
    assert h[2] not in kv.cached_blocks
    assert kv.cached_blocks[h[0]] == 0 and kv.cached_blocks[h[1]] == 1
    assert kv.blocks[2].block_hash == chain(tokens(500, 32))[7]
    # a's prefix is still served up to the evicted block.
    again = make_request("again", tokens(0, 13))
    assert kv.get_computed_blocks(again) == ([0, 1], 8)
    free(kv, big)
    # One more block evicts a's second block (head: 1), leaving block 0 cached.
    assert free_order(kv)[:2] == [1, 0]
    admit(kv, make_request("x", tokens(900, 3)))
    assert kv.get_block_ids("x") == [1]
    assert h[1] not in kv.cached_blocks and kv.cached_blocks[h[0]] == 0
    assert kv.get_computed_blocks(make_request("again2", tokens(0, 13))) == ([0], 4)


def test_free_cached_block_is_revived_by_a_hit(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 10))
    admit(kv, a)
    free(kv, a)
    assert free_order(kv) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    b = make_request("b", [*tokens(0, 8), 77])
    hits = admit(kv, b)
    assert hits == [0, 1]
    assert kv.get_block_ids("b") == [0, 1, 2]  # the new block comes from the head
    assert refs(kv)[:3] == [1, 1, 1]
    assert free_order(kv) == [3, 4, 5, 6, 7, 8, 9]
    assert 0 not in kv.free_queue and 1 not in kv.free_queue
    assert kv.num_free_blocks == 7


def test_hit_on_a_held_block_takes_no_free_block(kv: KVBlockManager) -> None:
    admit(kv, make_request("a", tokens(0, 12)))
    b = make_request("b", tokens(0, 12))
    assert admit(kv, b) == [0, 1]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.num_free_blocks == 6


def test_same_content_computed_twice_at_once(kv: KVBlockManager) -> None:
    """b hits a's first block while a is mid-prefill; both then compute blocks 2 and 3
    of the same content. The first to compute owns the hash; the duplicate stays
    unhashed and is freed to the head."""
    prompt = tokens(0, 13)
    a = make_request("a", prompt)
    admit(kv, a, num_new=4)
    assert kv.get_block_ids("a") == [0]
    b = make_request("b", prompt)
    assert admit(kv, b) == [0]
    assert kv.get_block_ids("b") == [0, 1, 2, 3]
    compute(kv, a, 9)
    assert kv.get_block_ids("a") == [0, 4, 5, 6]
    h = chain(prompt)
    assert kv.cached_blocks == {h[0]: 0, h[1]: 1, h[2]: 2}
    assert [kv.blocks[i].block_hash for i in (4, 5, 6)] == [None, None, None]
    free(kv, a)
    assert free_order(kv) == [4, 5, 6, 7, 8, 9]
    free(kv, b)
    assert free_order(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


# ----- allocation failure ------------------------------------------------------------


def test_allocation_failure_changes_nothing(kv: KVBlockManager) -> None:
    admit(kv, make_request("a", tokens(0, 24)))  # six blocks
    before = snapshot(kv)
    big = make_request("big", tokens(100, 20))  # five blocks, four free
    assert kv.get_computed_blocks(big) == ([], 0)
    assert not kv.allocate_slots(big, 20)
    kv.check_integrity()
    after = snapshot(kv)
    assert after == before
    assert kv.get_block_ids("big") == []
    # Exactly the free count succeeds.
    fits = make_request("fits", tokens(200, 16))
    assert kv.allocate_slots(fits, 16)
    kv.check_integrity()
    assert kv.num_free_blocks == 0
    # A running request that cannot grow fails without change, too.
    fits.num_computed_tokens = 16
    fits.append_output_token(5)
    before = snapshot(kv)
    assert not kv.allocate_slots(fits, 1)
    kv.check_integrity()
    assert snapshot(kv) == before


def test_allocation_failure_with_free_hits_changes_nothing(kv: KVBlockManager) -> None:
    """Hits sitting in the free queue are not free for new blocks."""
    a = make_request("a", tokens(0, 8))
    admit(kv, a)
    free(kv, a)  # blocks 1, 0 cached and free at the tail
    admit(kv, make_request("filler", tokens(500, 24)))  # blocks 2..7
    assert free_order(kv) == [8, 9, 1, 0]
    # Two hits (both free) + three new blocks: 5 > 4 - 2 free.
    b = make_request("b", [*tokens(0, 8), *tokens(40, 9)])
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits, num_hit) == ([0, 1], 8)
    before = snapshot(kv)
    assert not kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    kv.check_integrity()
    assert snapshot(kv) == before
    # Two hits + two new blocks fits exactly: the new ones come from the head.
    c = make_request("c", [*tokens(0, 8), *tokens(40, 5)])
    hits, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num_hit, hits)
    kv.check_integrity()
    assert kv.get_block_ids("c") == [0, 1, 8, 9]
    assert kv.num_free_blocks == 0


# ----- stats, switches, reset --------------------------------------------------------


def test_prefix_cache_stats_count_tokens_at_admission(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 12))
    admit(kv, a)
    assert (kv.stats.queries, kv.stats.hits) == (12, 0)
    b = make_request("b", [*tokens(0, 8), 60, 61, 62])
    admit(kv, b)
    assert (kv.stats.queries, kv.stats.hits) == (23, 8)
    decode(kv, a, 5)  # later allocations are not admissions
    decode(kv, b, 5)
    assert (kv.stats.queries, kv.stats.hits) == (23, 8)
    # A failed admission is not counted.
    big = make_request("big", tokens(100, 40))
    assert not kv.allocate_slots(big, 40)
    assert (kv.stats.queries, kv.stats.hits) == (23, 8)
    # A chunked admission counts the whole prompt once.
    c = make_request("c", [*tokens(0, 4), *tokens(300, 9)])
    admit(kv, c, num_new=3)
    assert (kv.stats.queries, kv.stats.hits) == (36, 12)
    compute(kv, c, 6)
    assert (kv.stats.queries, kv.stats.hits) == (36, 12)


def test_caching_disabled_never_hits() -> None:
    kv = KVBlockManager(NUM_BLOCKS, BS, enable_caching=False)
    a = make_request("a", tokens(0, 12))
    admit(kv, a)
    assert kv.cached_blocks == {}
    assert all(block.block_hash is None for block in kv.blocks)
    b = make_request("b", tokens(0, 12))
    assert admit(kv, b) == []
    assert kv.get_block_ids("b") == [3, 4, 5]
    assert (kv.stats.queries, kv.stats.hits) == (24, 0)
    free(kv, a)
    free(kv, b)
    assert kv.get_computed_blocks(make_request("c", tokens(0, 12))) == ([], 0)
    assert kv.num_free_blocks == NUM_BLOCKS


def test_reset_prefix_cache(kv: KVBlockManager) -> None:
    a = make_request("a", tokens(0, 12))
    admit(kv, a)
    before = snapshot(kv)
    assert kv.reset_prefix_cache() is False  # a request still holds blocks
    kv.check_integrity()
    assert snapshot(kv) == before
    free(kv, a)
    assert kv.reset_prefix_cache() is True
    kv.check_integrity()
    assert kv.cached_blocks == {}
    assert all(block.block_hash is None for block in kv.blocks)
    assert kv.num_free_blocks == NUM_BLOCKS
    assert kv.get_computed_blocks(make_request("b", tokens(0, 12))) == ([], 0)
    # The cache works again afterwards.
    admit(kv, make_request("c", tokens(0, 12)))
    assert kv.get_computed_blocks(make_request("d", tokens(0, 12))) == ([kv.get_block_ids("c")[0], kv.get_block_ids("c")[1]], 8)


def test_free_of_unknown_request_is_a_no_op(kv: KVBlockManager) -> None:
    admit(kv, make_request("a", tokens(0, 6)))
    before = snapshot(kv)
    free(kv, make_request("ghost", tokens(0, 3)))
    assert snapshot(kv) == before


def test_every_block_comes_back_after_a_mixed_sequence(kv: KVBlockManager) -> None:
    """Admissions with hits, chunking, decoding across block boundaries and frees in
    a different order: in the end every block is free, nothing per-request is left."""
    reqs = [
        make_request("a", tokens(0, 11)),
        make_request("b", [*tokens(0, 8), 40, 41]),
        make_request("c", tokens(0, 5)),
        make_request("d", tokens(300, 6)),
    ]
    for request in reqs:
        admit(kv, request)
    for step in range(5):
        for request in reqs:
            if kv.num_free_blocks or kv.blocks_needed(request.num_tokens + 1) <= len(kv.get_block_ids(request.request_id)):
                decode(kv, request, 600 + step)
    for request in (reqs[2], reqs[0], reqs[3], reqs[1]):
        free(kv, request)
    assert kv.num_free_blocks == NUM_BLOCKS
    assert all(block.ref_count == 0 for block in kv.blocks)
    assert not kv.req_blocks and not kv.req_hashes and not kv.req_num_hashed_blocks


def test_snapshot_reports_free_cached_and_held_blocks() -> None:
    kv = KVBlockManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(100, 109)))  # 2 full blocks + 1 partial
    assert kv.allocate_slots(a, a.num_tokens)
    snap = kv.snapshot()
    assert (snap.num_free, snap.num_cached, snap.num_cached_free, snap.blocks_per_request) == (7, 2, 0, {"a": 3})
    assert snap.usage == pytest.approx(0.3)
    kv.free(a)
    snap = kv.snapshot()
    assert (snap.num_free, snap.num_cached, snap.num_cached_free, snap.blocks_per_request) == (10, 2, 2, {})
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits, snap.usage) == (9, 0, 0.0)


# ----- the hybrid manager: a sliding-window pool beside the full one ----------------------------


def test_sliding_pool_lets_go_of_blocks_before_the_window_and_hits_on_the_window() -> None:
    """Window 6, blocks of 4: a query at position p reads blocks from (p - 5) // 4 on."""
    from tokenmill.engine.block_manager import NULL_BLOCK, HybridKVBlockManager

    kv = HybridKVBlockManager(num_blocks=10, num_sliding_blocks=6, block_size=BS, window=6)
    first = make_request("a", tokens(0, 17))
    hits, n = kv.get_computed_blocks(first)
    assert n == 0
    assert kv.allocate_slots(first, 8, hits)  # a chunk of 8: 2 blocks in each pool
    first.num_computed_tokens = 8
    assert kv.allocate_slots(first, 9)  # queries from 8 read from (8 - 5) // 4 = 0: nothing let go
    assert NULL_BLOCK not in kv.get_sliding_block_ids("a")
    first.num_computed_tokens = 17
    first.append_output_token(100)
    assert kv.allocate_slots(first, 1)  # the query at 17 reads from block 3: blocks 0-2 let go
    sliding = kv.get_sliding_block_ids("a")
    assert sliding[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in sliding[3:] and len(sliding) == 5
    assert len(kv.get_block_ids("a")) == 5
    kv.check_integrity()
    first.num_computed_tokens = 18
    kv.free(first)
    kv.check_integrity()
    # The same 16 tokens and more: the full pool hits 4 blocks; the sliding pool needs only
    # the window of the query at 16, block 2 (let go but still cached) and block 3.
    second = make_request("b", tokens(0, 18) + [7, 7])
    (full_hit, sliding_hit), n = kv.get_computed_blocks(second)
    assert n == 16 and len(full_hit) == 4 and sliding_hit[:2] == [NULL_BLOCK] * 2 and NULL_BLOCK not in sliding_hit[2:]
    assert kv.allocate_slots(second, 4, (full_hit, sliding_hit))
    kv.check_integrity()
    kv.free(second)
    kv.check_integrity()
    assert kv.sliding.num_free_blocks == kv.sliding.num_usable_blocks == 5


def test_hybrid_allocation_fails_whole_when_one_pool_is_short() -> None:
    from tokenmill.engine.block_manager import HybridKVBlockManager

    kv = HybridKVBlockManager(num_blocks=10, num_sliding_blocks=3, block_size=BS, window=16)
    request = make_request("a", tokens(0, 12))
    assert not kv.allocate_slots(request, 12)  # 3 blocks: the full pool has them, the sliding pool 2
    assert kv.full.num_free_blocks == 10 and not kv.get_block_ids("a")
    kv.check_integrity()
