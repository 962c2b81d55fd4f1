"""Disaggregation on one host through shared memory (kv_transfer/shared_memory.py,
runner/shared_kv_pool.py): a producer's pool carved from its memfd, a consumer's copy from
it bit for bit, the ZMQ connector's pin / copy / unpin with the real transport in one
process, a pin that outlives its time (the copy is discarded: the prompt is recomputed), and
consumers that cannot or will not map the region pulling over TCP. The two-server path
behind vllm-router runs in tests/test_disaggregation.py."""

from __future__ import annotations

import time

import pytest
import torch

from tests.server_utils import free_port
from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache
from tokenmill.config import KVTransferConfig
from tokenmill.engine.kv_transfer import RemotePrefill
from tokenmill.kv_transfer.connector import ZmqKVConnector
from tokenmill.kv_transfer.shared_memory import SharedRegion, open_peer_region
from tokenmill.runner.kv_offload import COPY_IN_CHUNK, HostKVBuffer, block_tensors, copy_in_blocks
from tokenmill.runner.shared_kv_pool import copy_from_peer, pool_layout, shared_allocator

FACTS = {"model_name": "m", "architecture": "a", "weight_format": "w", "kv_cache_dtype": "bfloat16",
         "kv_cache_format": "f", "block_size": 4, "kv_bytes_per_token": 1}


def shared_pool(spec: KVCacheSpec, num_blocks: int) -> tuple[SharedRegion, PagedKVCache]:
    region = SharedRegion(spec.bytes_per_block * num_blocks + 4 * spec.num_layers * 4096)
    cache = PagedKVCache(spec, num_blocks, torch.device("cpu"), empty=shared_allocator(region))
    for t in block_tensors(cache):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    return region, cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_consumer_copies_blocks_from_a_producers_shared_pool_bit_for_bit(dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=32, block_size=4, dtype=dtype)
    region, source = shared_pool(spec, 2 * COPY_IN_CHUNK + 5)
    # The pool's tensors are the region's bytes: a write through one shows in the other.
    layout = pool_layout(region, source)
    assert len(layout) == (4 if dtype == torch.int8 else 2) * spec.num_layers
    first = layout[0]
    assert region.mapping[first.offset:first.offset + 8] == bytes(block_tensors(source)[0][0].flatten()[:8].tolist())

    peer, why = open_peer_region(region.describe(layout))
    assert peer is not None, why
    remote = list(range(3, 3 + COPY_IN_CHUNK + 7))  # more than one chunk
    local = [(7 * i + 1) % 80 for i in range(len(remote))]  # scattered, distinct
    assert len(set(local)) == len(local)
    pool = PagedKVCache(spec, 80, torch.device("cpu"))
    before = [t.clone() for t in block_tensors(pool)]
    copy_from_peer(block_tensors(pool), peer, remote, local)
    theirs, ours = HostKVBuffer(source), HostKVBuffer(pool)
    assert [ours.block_bytes(b) for b in local] == [theirs.block_bytes(b) for b in remote]
    untouched = [b for b in range(80) if b not in local]
    for t, old in zip(block_tensors(pool), before):
        assert torch.equal(t[untouched], old[untouched])
    with pytest.raises(RuntimeError, match="past the prefill instance's pool"):
        copy_from_peer(block_tensors(pool), peer, [source.num_blocks], [0])


def test_a_region_that_is_not_the_producers_is_refused_with_the_reason() -> None:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.bfloat16)
    region, cache = shared_pool(spec, 4)
    description = region.describe(pool_layout(region, cache))
    assert open_peer_region(None) == (None, "the prefill instance has no shared KV pool")
    peer, why = open_peer_region({**description, "token": "f" * 32})
    assert peer is None and "not the prefill instance's region" in why
    peer, why = open_peer_region({**description, "path": "/proc/1/fd/999999"})
    assert peer is None and "cannot open" in why
    peer, why = open_peer_region({**description, "tensors": [[4096, 10**9, 10]]})
    assert peer is None and "do not fit" in why


class Pair:
    """A producer with its pool in shared memory and a consumer, real ZMQ in one process."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, consumer_shared_memory: bool = True,
                 copy_hook=None) -> None:
        self.spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype)
        self.region, self.source = shared_pool(self.spec, 24)
        self.pool = PagedKVCache(self.spec, 24, torch.device("cpu"))
        self.now = 100.0
        port = free_port()
        producer = KVTransferConfig(kv_role="kv_producer", kv_port=port,
                                    kv_connector_extra_config={"abort_request_timeout": 60})
        consumer = KVTransferConfig(kv_role="kv_consumer", kv_connector_extra_config={
            "pull_timeout": 5, "shared_memory": consumer_shared_memory})
        reader = HostKVBuffer(self.source)
        self.producer = ZmqKVConnector(producer, FACTS, self.spec.bytes_per_block,
                                       lambda ids: [reader.block_bytes(b) for b in ids], clock=lambda: self.now,
                                       shared_pool=self.region.describe(pool_layout(self.region, self.source)))

        def copy_shared(peer, remote, local):
            if copy_hook is not None:
                copy_hook()
            copy_from_peer(block_tensors(self.pool), peer, remote, local)

        self.consumer = ZmqKVConnector(
            consumer, FACTS, self.spec.bytes_per_block, None,
            write_blocks=lambda ids, payloads: copy_in_blocks(block_tensors(self.pool), payloads, ids),
            copy_shared=copy_shared)

    def pull(self, key: str, remote: list[int], local: list[int]):
        params = self.producer.hold(key, remote)
        self.consumer.start_pull("r", RemotePrefill.from_params(params), remote, local)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.consumer.wait(0.2)
            pulled = self.consumer.take_pulled()
            if pulled:
                return pulled[0]
        raise AssertionError("the pull did not finish")

    def same_blocks(self, remote: list[int], local: list[int]) -> bool:
        theirs, ours = HostKVBuffer(self.source), HostKVBuffer(self.pool)
        return [ours.block_bytes(b) for b in local] == [theirs.block_bytes(b) for b in remote]

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_the_connector_pins_copies_from_shared_memory_and_releases(dtype: torch.dtype) -> None:
    pair = Pair(dtype)
    try:
        result = pair.pull("p-kv0", [5, 6, 7, 9], [0, 3, 2, 1])
        assert result.error is None and result.written, result
        assert pair.same_blocks([5, 6, 7, 9], [0, 3, 2, 1])
        consumer, producer = pair.consumer.stats(), pair.producer.stats()
        assert (consumer.pulled_blocks, consumer.shared_memory_blocks, consumer.failed_pulls) == (4, 4, 0)
        assert (producer.sent_blocks, producer.held_blocks, producer.expired_requests) == (4, 0, 0)
        assert pair.producer.released() == ["p-kv0"]  # the scheduler frees the blocks now
    finally:
        pair.close()


def test_a_pin_that_ends_before_the_copy_discards_it() -> None:
    """The producer's engine frees a pinned hold whose time ran out (the consumer may be gone);
    a consumer still copying then learns at unpin that the blocks may have been reused under
    it, and reports a failed pull (the prompt is recomputed) instead of using the copy."""
    pair: Pair
    stalls = [True]

    def stall() -> None:  # the first copy takes longer than the pin: the producer's engine frees it
        if stalls.pop() if stalls else False:
            pair.now += 6
            assert pair.producer.released() == ["p-kv0"]

    pair = Pair(copy_hook=stall)
    try:
        result = pair.pull("p-kv0", [5, 6], [0, 1])
        assert result.payloads is None and "ended before the copy did" in result.error
        assert pair.consumer.stats().failed_pulls == 1
        assert pair.consumer.stats().shared_memory_blocks == 0
        assert pair.producer.stats().expired_requests == 1
        # The next pull maps the region again and succeeds.
        pair.now += 1
        result = pair.pull("p-kv1", [8], [4])
        assert result.written and pair.same_blocks([8], [4])
    finally:
        pair.close()


def test_a_consumer_without_shared_memory_pulls_over_tcp_the_same_bytes() -> None:
    pair = Pair(consumer_shared_memory=False)
    try:
        result = pair.pull("p-kv0", [5, 6, 7], [2, 0, 1])
        assert result.written and pair.same_blocks([5, 6, 7], [2, 0, 1])
        stats = pair.consumer.stats()
        assert (stats.pulled_blocks, stats.shared_memory_blocks) == (3, 0)
        assert pair.producer.stats().sent_blocks == 3
    finally:
        pair.close()


def test_a_producer_pool_in_shared_memory_serves_the_model_unchanged(tmp_path) -> None:
    """An engine whose pool is in shared memory (a kv_producer) computes what one with a
    private pool does: the allocator changes where the tensors live, not what they hold."""
    from tests.tiny_checkpoint import write_tiny_llama
    from tokenmill import LLM, SamplingParams

    model = str(write_tiny_llama(tmp_path / "tiny"))
    prompts = [[1, 5, 9, 13, 2, 7, 3] * 3, [4, 8, 15, 16, 23, 42]]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    outputs = []
    for transfer in (None, {"kv_role": "kv_producer", "kv_port": free_port()}):
        llm = LLM(model, dtype="float32", block_size=4, kv_transfer_config=transfer)
        runner = llm.engine.executor
        assert (runner.shared_kv_region is not None) == (transfer is not None)
        outputs.append([(o.outputs[0].token_ids, [round(next(iter(lp.values())).logprob, 6) for lp in
                                                  o.outputs[0].logprobs])
                        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)])
        if transfer is not None:
            llm.engine.scheduler.connector.close()
    assert outputs[0] == outputs[1]
