"""The scheduler's side of prefill-decode disaggregation (engine/kv_transfer.py), on the
real Scheduler and KVBlockManager with an in-memory connector in place of the ZMQ transport
(the transport and the whole path run in tests/test_disaggregation.py): what a producer
holds and frees, what a consumer allocates, pulls, hashes and computes, and the faults."""

from __future__ import annotations

from fakes import make_request

from tokenmill.engine.block_manager import KVBlockManager
from tokenmill.engine.kv_transfer import KVTransferStats, PullResult, RemotePrefill
from tokenmill.engine.request import RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.engine.batch import RunnerOutput

BLOCK = 4


class MemoryConnector:
    is_producer = True
    is_consumer = True
    writes_in_place = False

    def __init__(self) -> None:
        self.holds: dict[str, list[int]] = {}
        self.to_release: list[str] = []
        self.pulls: list[tuple[str, RemotePrefill, list[int]]] = []
        self.results: list[PullResult] = []
        self.local: dict[str, list[int]] = {}

    def hold(self, key, block_ids):
        self.holds[key] = list(block_ids)
        return {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": list(block_ids),
                "remote_host": "h", "remote_port": 1, "remote_request_id": key}

    def released(self):
        out, self.to_release = self.to_release, []
        return out

    def start_pull(self, request_id, remote, remote_block_ids, local_block_ids):
        self.pulls.append((request_id, remote, remote_block_ids))
        self.local[request_id] = list(local_block_ids)

    def take_pulled(self):
        out, self.results = self.results, []
        return out

    def wait(self, timeout):
        pass

    def stats(self):
        return KVTransferStats()


def scheduler(num_blocks: int = 16) -> tuple[Scheduler, KVBlockManager, MemoryConnector]:
    kv = KVBlockManager(num_blocks, BLOCK)
    sched = Scheduler(SchedulerConfig(8, 64, 64), kv)
    sched.connector = MemoryConnector()
    return sched, kv, sched.connector


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {item.request_id: [token] for item in out.scheduled if item.sample}
    sched.update_from_output(out, RunnerOutput(sampled_token_ids=sampled))
    sched.kv.check_integrity()
    return out


def remote_params(n_blocks: int, key: str = "p-kv0") -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": list(range(100, 100 + n_blocks)),
            "remote_host": "h", "remote_port": 1, "remote_request_id": key}


def test_producer_holds_the_blocks_of_a_length_capped_prefill_until_released() -> None:
    sched, kv, conn = scheduler()
    held = make_request("p", list(range(1, 11)), max_tokens=1)
    held.kv_transfer_params = {"do_remote_decode": True}
    stopped = make_request("q", list(range(1, 11)), max_tokens=1, stop_token_ids=[7])
    stopped.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(held)
    sched.add_request(stopped)
    run_step(sched)
    assert held.status == RequestStatus.FINISHED_LENGTH
    assert list(conn.holds) == ["p-kv0"] and len(conn.holds["p-kv0"]) == 3
    assert held.kv_transfer_params_out["remote_block_ids"] == conn.holds["p-kv0"]
    assert stopped.kv_transfer_params_out is None  # stopped by a stop token: nothing to decode, freed
    assert kv.num_free_blocks == kv.num_blocks - 3
    conn.to_release.append("p-kv0")
    run_step(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_consumer_pulls_into_unhashed_blocks_then_computes_the_last_prompt_token() -> None:
    sched, kv, conn = scheduler()
    request = make_request("d", list(range(1, 11)), max_tokens=3)  # 10 tokens: 9 pulled (3 blocks), 1 computed
    request.kv_transfer_params = remote_params(3)
    sched.add_request(request)
    out = run_step(sched)
    assert out.scheduled == [] and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (rid, remote, blocks), = conn.pulls
    assert (rid, remote.request_id, blocks) == ("d", "p-kv0", [100, 101, 102])
    local = kv.get_block_ids("d")
    assert len(local) == 3 and not kv.cached_blocks  # no prefix hit on KV not yet there
    assert conn.local["d"] == local  # where the pulled blocks go
    conn.results.append(PullResult("d", [b"a", b"b", b"c"]))
    out = run_step(sched)
    (item,) = out.scheduled
    assert (item.start_pos, item.num_new_tokens, item.sample) == (9, 1, True)
    assert out.kv_transfers.remote_load == list(zip([b"a", b"b", b"c"], local))
    assert len(kv.cached_blocks) == 2  # the two full blocks of pulled KV are now prefix-cacheable
    while not request.is_finished:
        run_step(sched)
    assert request.output_token_ids == [7, 7, 7] and kv.num_free_blocks == kv.num_blocks


def test_consumer_pulls_only_what_its_prefix_cache_lacks() -> None:
    sched, kv, conn = scheduler()
    first = make_request("a", list(range(1, 11)), max_tokens=1)
    sched.add_request(first)
    run_step(sched)  # blocks [1..4], [5..8] now cached here
    request = make_request("d", list(range(1, 15)), max_tokens=1)  # 13 tokens to pull: 4 blocks, 2 cached
    request.kv_transfer_params = remote_params(4)
    sched.add_request(request)
    run_step(sched)
    (_, _, blocks), = conn.pulls
    assert blocks == [102, 103] and request.num_cached_tokens == 8
    local = kv.get_block_ids("d")
    assert len(local) == 4 and conn.local["d"] == local[2:4]
    conn.results.append(PullResult("d", [b"c", b"d"]))
    out = run_step(sched)
    assert out.kv_transfers.remote_load == list(zip([b"c", b"d"], local[2:4]))


def test_a_failed_pull_recomputes_and_an_abort_while_pulling_frees() -> None:
    sched, kv, conn = scheduler()
    failed = make_request("f", list(range(1, 11)), max_tokens=1)
    failed.kv_transfer_params = remote_params(3)
    aborted = make_request("x", list(range(20, 30)), max_tokens=1)
    aborted.kv_transfer_params = remote_params(3, "p-kv1")
    sched.add_request(failed)
    sched.add_request(aborted)
    run_step(sched)
    assert set(sched.pulling) == {"f", "x"}
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    assert kv.get_block_ids("x") == [] and "x" not in sched.pulling
    conn.results += [PullResult("f", None, "gone"), PullResult("x", [b"1", b"2", b"3"])]  # x's comes too late
    out = run_step(sched)
    (item,) = out.scheduled
    assert (item.request_id, item.start_pos, item.num_new_tokens) == ("f", 0, 10)
    assert not (out.kv_transfers and out.kv_transfers.remote_load)
    assert failed.is_finished and kv.num_free_blocks == kv.num_blocks


def test_under_the_priority_policy_a_pulled_request_runs_in_rank_order() -> None:
    kv = KVBlockManager(32, BLOCK)
    sched = Scheduler(SchedulerConfig(8, 64, 64, policy="priority"), kv)
    sched.connector = conn = MemoryConnector()
    low = make_request("low", list(range(1, 6)), max_tokens=8, priority=5)
    sched.add_request(low)
    run_step(sched)
    high = make_request("high", list(range(10, 20)), max_tokens=8, priority=0)
    high.kv_transfer_params = remote_params(3)
    sched.add_request(high)
    run_step(sched)
    conn.results.append(PullResult("high", [b"a", b"b", b"c"]))
    out = run_step(sched)
    assert [r.request_id for r in sched.running] == ["high", "low"]
    assert [item.request_id for item in out.scheduled] == ["high", "low"]


def test_a_connector_writing_in_place_hands_no_bytes_to_the_runner() -> None:
    sched, kv, conn = scheduler()
    conn.writes_in_place = True
    request = make_request("d", list(range(1, 11)), max_tokens=2)
    request.kv_transfer_params = remote_params(3)
    sched.add_request(request)
    run_step(sched)
    conn.results.append(PullResult("d", [], written=True))  # the puller thread copied them into the pool
    out = run_step(sched)
    (item,) = out.scheduled
    assert (item.start_pos, item.num_new_tokens) == (9, 1)
    assert not (out.kv_transfers and out.kv_transfers.remote_load)
    assert len(kv.cached_blocks) == 2
    while not request.is_finished:
        run_step(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_an_abort_while_a_writer_pulls_keeps_the_blocks_until_the_pull_is_reported() -> None:
    # The puller thread may still be writing into the request's blocks: freeing them at the abort
    # would let another request take them and have its KV overwritten.
    sched, kv, conn = scheduler(num_blocks=6)
    conn.writes_in_place = True
    aborted = make_request("x", list(range(20, 30)), max_tokens=1)
    aborted.kv_transfer_params = remote_params(3)
    sched.add_request(aborted)
    run_step(sched)
    blocks = kv.get_block_ids("x")
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    assert "x" not in sched.pulling and kv.num_free_blocks == 6 - 3
    other = make_request("o", list(range(40, 52)), max_tokens=1)  # needs 3 blocks: only the 3 free ones
    sched.add_request(other)
    run_step(sched)
    assert not set(kv.get_block_ids("o")) & set(blocks)
    conn.results.append(PullResult("x", [], written=True))
    run_step(sched)
    assert kv.num_free_blocks == 6


def test_pulled_blocks_copy_into_the_pool_in_staged_chunks_bit_for_bit() -> None:
    """The consumer's copy-in (runner/kv_offload.copy_in_blocks): blocks' bytes as the producer
    reads them (`block_bytes`: K, V and an 8-bit cache's scales, every layer) land in other pool
    blocks bit for bit, in chunks smaller than the pull (a staging buffer of 2 blocks), and no
    other block changes."""
    import torch

    from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache
    from tokenmill.runner.kv_offload import HostKVBuffer, block_tensors, copy_in_blocks, read_blocks, word_dtype

    # bfloat16 and int8 with scales copy as int32 words; 3-byte blocks (one token of an odd
    # head_dim) as bytes.
    for dtype, heads, head_dim, block_size, words in ((torch.bfloat16, 2, 32, 4, torch.int32),
                                                      (torch.int8, 2, 32, 4, torch.int32),
                                                      (torch.int8, 1, 3, 1, torch.uint8)):
        spec = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
        source = PagedKVCache(spec, 8, torch.device("cpu"))
        for t in block_tensors(source):
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        assert word_dtype(block_tensors(source)) == words
        payloads = [HostKVBuffer(source).block_bytes(b) for b in (1, 2, 3, 5, 6)]
        assert all(len(p) == spec.bytes_per_block for p in payloads)
        assert read_blocks(block_tensors(source), [1, 2, 3, 5, 6]) == payloads  # the producer's gathered read
        pool = PagedKVCache(spec, 10, torch.device("cpu"))
        before = [t.clone() for t in block_tensors(pool)]
        staging = torch.zeros((2, spec.bytes_per_block), dtype=torch.uint8)
        copy_in_blocks(block_tensors(pool), payloads, [9, 0, 4, 7, 2], staging)
        reader = HostKVBuffer(pool)
        assert [reader.block_bytes(b) for b in (9, 0, 4, 7, 2)] == payloads, dtype
        for t, old in zip(block_tensors(pool), before):
            untouched = [b for b in range(10) if b not in (9, 0, 4, 7, 2)]
            assert torch.equal(t[untouched], old[untouched])
