"""The host KV tier (docs/kv-tiers.md): the block manager's bookkeeping on tiny sizes
(exact transfers, LRU, pinning, integrity after every operation), then the default model
with a pool too small to keep a prefix: demoted, promoted back, the same greedy tokens."""

from __future__ import annotations

import pytest
from fakes import make_request

from tests.conftest import assert_engine_idle, sibling
from tokenmill import SamplingParams
from tokenmill.engine.batch import KVTransfers
from tokenmill.engine.block_manager import KVBlockManager, hash_block
from tokenmill.engine.kv_tiers import HostTier

BS = 4


def chain(token_ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(token_ids) // BS):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * BS : (i + 1) * BS]))
    return hashes


def run_once(kv: KVBlockManager, request) -> tuple[list[int], int]:
    """Admit, compute the whole prompt, finish: (its pool hits, its hit tokens)."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    kv.check_integrity()
    request.num_computed_tokens = request.num_tokens
    kv.free(request)
    kv.check_integrity()
    return list(hits), num_hit


def make_kv(num_blocks: int = 4, host_blocks: int = 8) -> KVBlockManager:
    return KVBlockManager(num_blocks, BS, host_tier=HostTier(host_blocks, bytes_per_block=100))


def test_evicted_block_is_demoted_and_a_later_hit_promotes_it() -> None:
    kv = make_kv()
    a = list(range(100, 109))  # two full blocks and one token
    run_once(kv, make_request("a", a))
    assert kv.take_transfers() is None  # nothing evicted yet
    block_of = {h: kv.cached_blocks[h] for h in chain(a)}
    # 13 tokens: four blocks, so both of a's cached blocks are evicted (LRU: free-queue head first).
    run_once(kv, make_request("b", list(range(200, 213))))
    transfers = kv.take_transfers()
    assert sorted(transfers.store) == sorted((block_of[h], kv.host_tier.entries[h]) for h in chain(a))
    assert transfers.load == [] and transfers.num_host_blocks == 8
    assert all(h not in kv.cached_blocks for h in chain(a))
    # a again: both blocks come back from the host tier into new pool blocks, before the forward.
    again = make_request("a2", a)
    hits, num_hit = kv.get_computed_blocks(again)
    assert list(hits) == [] and hits.host == chain(a) and num_hit == 8
    assert kv.allocate_slots(again, again.num_tokens - num_hit, hits)
    kv.check_integrity()
    transfers = kv.take_transfers()
    blocks = kv.get_block_ids("a2")
    assert transfers.load == [(kv.host_tier.entries[h], b) for h, b in zip(chain(a), blocks[:2])]
    assert [kv.cached_blocks[h] for h in chain(a)] == blocks[:2]  # cached in the pool again
    assert kv.stats.hits == 8 and kv.host_tier.stats.hit_tokens == 8
    assert kv.host_tier.stats.loaded_blocks == 2


def test_a_promoted_block_evicted_again_needs_no_copy() -> None:
    kv = make_kv()
    a = list(range(100, 109))
    run_once(kv, make_request("a", a))
    run_once(kv, make_request("b", list(range(200, 213))))
    kv.take_transfers()
    run_once(kv, make_request("a2", a))
    kv.take_transfers()
    stored = kv.host_tier.stats.stored_blocks
    run_once(kv, make_request("c", list(range(300, 313))))  # evicts a's blocks again
    transfers = kv.take_transfers()
    assert kv.host_tier.stats.stored_blocks - stored == len(transfers.store)
    stored_hashes = {h for h, s in kv.host_tier.entries.items() if s in {slot for _, slot in transfers.store}}
    assert not stored_hashes & set(chain(a))  # a's blocks were still in the tier, unchanged


def test_host_tier_is_lru_bounded_and_reports_what_it_dropped() -> None:
    kv = make_kv(num_blocks=4, host_blocks=2)
    a, b = list(range(100, 109)), list(range(200, 209))
    run_once(kv, make_request("a", a))
    run_once(kv, make_request("b", b))  # a's two blocks: free, still cached in the pool
    run_once(kv, make_request("c", list(range(300, 313))))  # evicts a and b (4 blocks) into 2 slots
    kv.check_integrity()
    assert len(kv.host_tier) == 2 and kv.host_tier.stats.evicted_blocks == 2
    assert set(kv.host_tier.entries) == set(chain(b))  # the least recently used (a's) went out
    transfers = kv.take_transfers()
    assert len(transfers.store) == 2  # a reused slot keeps only its last store
    assert {kv.host_tier.entries[h] for h in chain(b)} == {slot for _, slot in transfers.store}


def test_a_slot_being_loaded_is_never_reused_in_the_same_step() -> None:
    # One host slot: a's first block is loaded while the allocation of its new pool blocks
    # evicts another cached block; that demotion must be refused, not overwrite the slot.
    kv = make_kv(num_blocks=3, host_blocks=1)
    a = list(range(100, 105))  # one full block and one token
    run_once(kv, make_request("a", a))
    run_once(kv, make_request("b", list(range(200, 209))))  # evicts a's block -> host slot 0
    kv.take_transfers()
    again = make_request("a2", a)
    hits, num_hit = kv.get_computed_blocks(again)
    assert hits.host == chain(a)
    assert kv.allocate_slots(again, again.num_tokens - num_hit, hits)  # evicts a cached block of b
    kv.check_integrity()
    transfers = kv.take_transfers()
    assert transfers.store == [] and transfers.load == [(0, kv.get_block_ids("a2")[0])]
    assert kv.host_tier.stats.rejected_blocks >= 1
    assert list(kv.host_tier.entries) == chain(a)


def test_no_prefix_caching_means_no_tier() -> None:
    kv = KVBlockManager(4, BS, enable_caching=False, host_tier=HostTier(4, 100))
    assert kv.host_tier is None and kv.take_transfers() is None


def test_reset_prefix_cache_clears_the_host_tier() -> None:
    kv = make_kv()
    run_once(kv, make_request("a", list(range(100, 109))))
    run_once(kv, make_request("b", list(range(200, 213))))
    assert len(kv.host_tier) == 2
    assert kv.reset_prefix_cache()
    assert len(kv.host_tier) == 0 and kv.take_transfers() is None
    kv.check_integrity()


def test_transfers_are_falsy_when_empty() -> None:
    assert not KVTransfers(4)
    assert KVTransfers(4, store=[(1, 0)])


# ----- the default model ----------------------------------------------------------------

TEXT = ("The history of the lighthouse keepers of the northern coast is a story of long winters, "
        "careful records and small kindnesses passed from one keeper to the next. ")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_prefix_evicted_from_a_small_pool_comes_back_from_the_host_tier(llm_f32) -> None:
    ids = llm_f32.tokenizer.encode(TEXT * 20)
    prefix = ids[:384]  # 24 blocks of 16
    returning = prefix + ids[400:420]
    others = [[t + 1 + i for t in ids[:400]] for i in range(2)]  # no shared blocks with the prefix
    # 32 blocks (512 tokens): one request at a time fits; the next one evicts the prefix.
    tiered = sibling(llm_f32, num_blocks=32, enable_prefix_caching=True, kv_offloading_size=0.05)
    plain = sibling(llm_f32, num_blocks=32, enable_prefix_caching=True)
    outputs = {}
    for name, llm in (("tiered", tiered), ("plain", plain)):
        first = llm.generate([prefix + ids[384:390]], GREEDY)[0]
        for other in others:
            llm.generate([other], GREEDY)
        outputs[name] = llm.generate([returning], GREEDY)[0]
        assert_engine_idle(llm)
        assert first.num_cached_tokens == 0
    host = tiered.engine.scheduler.kv.host_tier
    assert outputs["plain"].num_cached_tokens == 0  # the pool alone lost the prefix
    assert outputs["tiered"].num_cached_tokens == 384  # every prefix block came back from the host tier
    assert host.stats.hit_tokens == 384 and host.stats.loaded_blocks == 24
    stats = tiered.engine.stats()
    assert stats.external_prefix_cache_hits == 384 and stats.kv_offload_loaded_blocks == 24
    assert stats.kv_offload_used_blocks == len(host) > 0
    assert outputs["tiered"].outputs[0].token_ids == outputs["plain"].outputs[0].token_ids
    reference = sibling(llm_f32, enable_prefix_caching=False).generate([returning], GREEDY)[0]
    assert outputs["tiered"].outputs[0].token_ids == reference.outputs[0].token_ids


@pytest.mark.parametrize("gib", [0.0, -1.0])
def test_offloading_size_must_be_positive(gib) -> None:
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig().replace(kv_offloading_size=gib)


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_server_metrics_count_the_host_tier() -> None:
    from tests.server_utils import ServerProcess

    # 34 blocks of 16 (f32 KV of the default model: 720 KiB a block): one 400-token prompt at a time.
    server = ServerProcess("--kv-cache-memory", "24MiB", "--kv-offloading-size", "0.05").start()
    try:
        def complete(prompt: list[int]) -> dict:
            response = server.post("/v1/completions", json={"model": server.model, "prompt": prompt,
                                                            "max_tokens": 2, "temperature": 0})
            assert response.status_code == 200, response.text
            return response.json()

        prefix = list(range(1000, 1384))  # 24 blocks
        complete(prefix + [7, 8, 9])
        complete(list(range(2000, 2400)))
        complete(list(range(3000, 3400)))  # the prefix is in the host tier now
        complete(prefix + [5, 6])
        text = server.get("/metrics").text
        bytes_per_block = 16 * 46080  # 30 layers x 3 KV heads x 64 x 4 bytes x K and V, per token
        assert _metric(text, "tokenmill:external_prefix_cache_hits_total") == 384
        assert _metric(text, "tokenmill:external_prefix_cache_queries_total") >= 384
        assert _metric(text, "tokenmill:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 24 * bytes_per_block
        assert _metric(text, "tokenmill:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") >= 24 * bytes_per_block
        assert 0 < _metric(text, "tokenmill:kv_offload_cpu_cache_usage_perc") <= 1
    finally:
        assert server.stop() == 0, server.log_tail()


def test_reset_prefix_cache_route_clears_both_tiers_and_publishes_it() -> None:
    import json

    import msgspec
    import zmq

    from tests.server_utils import ServerProcess, free_port

    port = free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv"}
    server = ServerProcess("--kv-cache-memory", "24MiB", "--kv-offloading-size", "0.05",
                           "--kv-events-config", json.dumps(events)).start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
    try:
        import time

        time.sleep(0.5)  # the subscription reaches the publisher
        for prompt in (list(range(1000, 1384)), list(range(2000, 2400)), list(range(3000, 3400))):
            response = server.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 2})
            assert response.status_code == 200, response.text
        assert _metric(server.get("/metrics").text, "tokenmill:kv_offload_cpu_cache_usage_perc") > 0
        response = server.post("/reset_prefix_cache")
        assert response.status_code == 200 and response.json() == {"reset": True}
        assert _metric(server.get("/metrics").text, "tokenmill:kv_offload_cpu_cache_usage_perc") == 0
        cleared = False
        deadline = time.monotonic() + 10
        while not cleared and time.monotonic() < deadline:
            if sub.poll(100):
                _, _, payload = sub.recv_multipart()
                cleared = any(e["type"] == "AllBlocksCleared" for e in msgspec.msgpack.decode(payload)[1])
        assert cleared
        again = server.post("/v1/completions", json={"model": server.model, "prompt": list(range(1000, 1386)),
                                                     "max_tokens": 2})
        assert again.status_code == 200
        assert _metric(server.get("/metrics").text, "tokenmill:external_prefix_cache_hits_total") == 0
    finally:
        ctx.destroy(linger=0)
        assert server.stop() == 0, server.log_tail()


# ----- an 8-bit host tier below a 16/32-bit pool (--kv-offloading-cache-dtype) -------------------


@pytest.mark.parametrize("pool_dtype,packed", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_an_8bit_host_tier_round_trips_as_an_8bit_cache_would(pool_dtype, packed, tmp_path) -> None:
    """A block stored in and loaded back from the int8 host tier equals what an int8 KV
    cache (rotated) would have given for the same K and V, bit for bit; a disk-tier file
    written from the host slot equals one written from the pool block. A packed bf16 pool
    (the prefill kernel's layout) goes through the tier in the token layout and back."""
    import dataclasses

    import torch

    from tokenmill.attention import kv_quant
    from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache, packed_as_tokens
    from tokenmill.config import EngineConfig
    from tokenmill.engine.kv_tiers import decode_block_file, kv_fingerprint
    from tokenmill.runner.kv_offload import HostKVBuffer
    from tokenmill.runner.worker import offload_cache_spec

    dtype = getattr(torch, pool_dtype)
    block_size = 16 if packed else 4
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=block_size, dtype=dtype, packed=packed)
    host_spec = dataclasses.replace(spec, dtype=torch.int8, rotation=64, packed=False)
    config = EngineConfig.from_kwargs(kv_offloading_size=1, kv_offloading_cache_dtype="int8")
    assert offload_cache_spec(config, spec, torch.device("cpu")) == host_spec  # what the worker builds from the pool's
    tokens = packed_as_tokens if packed else (lambda x: x)
    pool = PagedKVCache(spec, 6, torch.device("cpu"))
    torch.manual_seed(0)
    for layer in pool:
        layer.k.copy_(torch.randn_like(layer.k, dtype=torch.float32) * 3)
        layer.v.copy_(torch.randn_like(layer.v, dtype=torch.float32))
    original = [(layer.k.clone(), layer.v.clone()) for layer in pool]
    buffer = HostKVBuffer(pool, host_spec)
    assert sum(t[0].numel() for t in buffer.pool) == spec.bytes_per_block
    fingerprint = kv_fingerprint("test")
    buffer.apply(KVTransfers(2, store=[(0, 0), (1, 1)], load=[]))  # blocks 0, 1 -> slots 0, 1
    assert buffer.nbytes == 2 * host_spec.bytes_per_block  # about 1/4 (float32) or 1/2 (bfloat16) of the pool's
    from_pool = buffer.tier_block_bytes(1)
    buffer.apply(KVTransfers(2, store=[], load=[(0, 4), (1, 5)], disk_header=fingerprint,
                             spill=[(1, None, str(tmp_path / "slot"), b"h" * 32, b"")]))
    assert buffer.finish_step() == ([b"h" * 32], [])  # the step's end: its file written (on the writer thread)
    assert decode_block_file((tmp_path / "slot").read_bytes(), fingerprint, b"h" * 32, len(from_pool)) == from_pool
    assert len(from_pool) == host_spec.bytes_per_block
    reference = PagedKVCache(host_spec, 1, torch.device("cpu"))
    for layer, (k, v), ref in zip(pool, original, reference):
        k, v, got_k, got_v = tokens(k), tokens(v), tokens(layer.k), tokens(layer.v)
        for block, source in ((4, 0), (5, 1)):
            slots = torch.arange(block_size)
            rows = [kv_quant.rotate(t[source].float(), 64) for t in (k, v)]
            ref.write(rows[0], rows[1], slots)
            expect = [kv_quant.rotate(t, 64).to(dtype) for t in ref.read(slots, torch.float32)]
            assert torch.equal(got_k[block], expect[0]) and torch.equal(got_v[block], expect[1])
            assert (got_k[block].float() - k[source].float()).abs().max() < 0.05 * k[source].float().abs().max()
        assert torch.equal(got_k[:4], k[:4]) and torch.equal(got_v[:4], v[:4])  # the sources are untouched


def test_an_8bit_host_tier_holds_4x_the_blocks_and_keeps_greedy_output(llm_f32) -> None:
    """The default model in float32 with a 32-block pool: the int8 host tier holds ~3.9x the
    blocks of a float32 one in the same GiB, serves the returning prefix from it, and the
    returning request's greedy tokens match the cache-less engine's (logprobs within 0.05)."""
    from tokenmill import LLM

    ids = llm_f32.tokenizer.encode(TEXT * 20)
    prefix = ids[:384]
    returning = prefix + ids[400:420]
    others = [[t + 1 + i for t in ids[:400]] for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    reference = sibling(llm_f32, enable_prefix_caching=False).generate([returning], params)[0].outputs[0]
    pool_bytes = 32 * 16 * 46080  # 32 blocks of the float32 KV (30 layers x 3 heads x 64 x 4 bytes x K, V)
    llm = LLM(dtype="float32", max_model_len=2048, kv_cache_memory=pool_bytes, seed=0, enable_prefix_caching=True,
              kv_offloading_size=0.02, kv_offloading_cache_dtype="int8")
    host = llm.engine.scheduler.kv.host_tier
    assert llm.engine.facts.kv_offload_bytes_per_token == 30 * 2 * 3 * (64 + 2)
    assert host.num_blocks == int(0.02 * 2**30) // (16 * 30 * 2 * 3 * 66)  # 3.88x the float32 tier's 28
    llm.generate([prefix + ids[384:390]], params)
    for other in others:
        llm.generate([other], params)
    out = llm.generate([returning], params)[0]
    assert_engine_idle(llm)
    assert out.num_cached_tokens == 384 and host.stats.hit_tokens == 384  # all from the host tier
    assert out.outputs[0].token_ids == reference.token_ids
    deltas = [abs(a[t].logprob - b[t].logprob) for t, a, b in
              zip(reference.token_ids, out.outputs[0].logprobs, reference.logprobs)]
    assert max(deltas) < 0.05, deltas
    with pytest.raises(ValueError, match="sibling"):
        llm.engine.sibling(kv_offloading_cache_dtype="auto")


def test_an_8bit_host_tier_needs_a_host_tier_and_a_wide_pool() -> None:
    from tokenmill import LLM
    from tokenmill.config import CacheConfig

    with pytest.raises(ValueError, match="set kv_offloading_size"):
        CacheConfig(kv_offloading_cache_dtype="int8")
    with pytest.raises(ValueError, match="already 8-bit"):
        LLM(kv_cache_dtype="int8", kv_offloading_size=0.01, kv_offloading_cache_dtype="int8", max_model_len=256)
