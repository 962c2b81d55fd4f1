"""The disk KV tier (docs/kv-tiers.md): files per chained block hash below the host tier.
The file format and the tier's bookkeeping on tiny sizes, then the default model with a pool
and a host tier too small to keep a prefix: served from disk, after a restart, never from a
corrupt file, and an unwritable directory does not stop serving."""

from __future__ import annotations

import logging
import os

import pytest

from tests.conftest import assert_engine_idle, sibling
from tokenmill import SamplingParams
from tokenmill.config import KVEventsConfig
from tokenmill.engine.kv_events import BlockStored
from tokenmill.engine.request import RequestStatus
from tokenmill.engine.kv_tiers import DiskTier, decode_block_file, encode_block_file, kv_fingerprint

FP = kv_fingerprint("model", "q4_1", "bfloat16", 16, 1000)
H = bytes(range(32))


def test_block_file_round_trip_and_every_kind_of_bad_file_is_refused() -> None:
    payload = os.urandom(100)
    data = encode_block_file(FP, H, payload)
    assert decode_block_file(data, FP, H, 100) == payload
    flipped = bytearray(data)
    flipped[-7] ^= 0xFF
    assert decode_block_file(bytes(flipped), FP, H, 100) is None  # corrupt payload: checksum
    assert decode_block_file(data[:-1], FP, H, 100) is None  # truncated
    assert decode_block_file(data, kv_fingerprint("other model"), H, 100) is None  # foreign
    assert decode_block_file(data, FP, bytes(32), 100) is None  # another block's file
    assert decode_block_file(data, FP, H, 99) is None  # another layout


def _write(tier: DiskTier, block_hash: bytes, payload: bytes) -> None:
    path = tier.admit(block_hash)
    assert path is not None
    with open(path, "wb") as f:
        f.write(encode_block_file(tier.fingerprint, block_hash, payload))
    tier.writes_done([block_hash], [])  # the runner's writer reports it written


def test_disk_tier_lru_cap_restart_and_corruption(tmp_path) -> None:
    file_bytes = DiskTier(str(tmp_path), FP, 100, 10**6).file_bytes
    tier = DiskTier(str(tmp_path), FP, 100, 3 * file_bytes)
    hashes = [bytes([i]) * 32 for i in range(4)]
    for i, h in enumerate(hashes):
        _write(tier, h, bytes([i]) * 100)
    assert list(tier.entries) == hashes[1:] and tier.stats.evicted_blocks == 1  # the LRU file went
    assert not os.path.exists(tier.path(hashes[0]))
    assert tier.read(hashes[1]) == bytes([1]) * 100
    # A restart: the same directory and settings find the files; other settings do not.
    again = DiskTier(str(tmp_path), FP, 100, 3 * file_bytes)
    assert set(again.entries) == set(hashes[1:])
    assert len(DiskTier(str(tmp_path), kv_fingerprint("other"), 100, 3 * file_bytes)) == 0
    with open(again.path(hashes[2]), "r+b") as f:  # corrupt one file's KV
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\x00\xff")
    assert again.read(hashes[2]) is None and again.stats.corrupt_blocks == 1
    assert hashes[2] not in again and not os.path.exists(again.path(hashes[2]))  # deleted, never used
    # A file admitted in this step is not read before the runner wrote it.
    pending = bytes([9]) * 32
    again.admit(pending)
    assert again.read(pending) is None and pending in again


def test_a_file_not_written_is_forgotten_counted_and_never_read(tmp_path) -> None:
    tier = DiskTier(str(tmp_path), FP, 100, 10**6)
    a, b = bytes([1]) * 32, bytes([2]) * 32
    tier.admit(a), tier.admit(b)
    assert tier.read(a) is None and a in tier  # not written yet: never read
    tier.writes_done([], [a])  # dropped behind a slow disk (or a failed write)
    assert a not in tier and tier.stats.dropped_writes == 1 and a in tier.removed
    with open(tier.path(b), "wb") as f:  # b's file lands before its report does
        f.write(encode_block_file(FP, b, bytes(100)))
    assert not tier.is_pending(b) and tier.read(b) == bytes(100)
    tier.writes_done([b], [])
    c = bytes([3]) * 32
    tier.admit(c)
    tier.clear()  # a reset while c's file is being written: the late file is deleted on its report
    with open(tier.path(c), "wb") as f:
        f.write(encode_block_file(FP, c, bytes(100)))
    tier.writes_done([c], [])
    assert not os.path.exists(tier.path(c))


def test_the_writer_drops_past_its_buffer_when_the_disk_falls_behind(tmp_path, caplog) -> None:
    """A stalled disk, for real: the writer's first file is a FIFO no one reads yet, so its
    write blocks, as on a disk that stopped answering. Steps never wait on a disk that is
    behind; writes queue up to the buffer, then are dropped, and the report says which."""
    from tokenmill.runner.kv_offload import DiskWriter

    writer = DiskWriter(buffer_bytes=250)
    stuck = tmp_path / "stuck.kv"
    os.mkfifo(f"{stuck}.{os.getpid()}.tmp")  # write_block_file's temporary name
    hashes = [bytes([i]) * 32 for i in range(4)]
    with caplog.at_level(logging.WARNING):
        writer.submit(str(stuck), b"x" * 100, hashes[0])  # blocks in open() until read
        assert not writer.wait(0.2) and writer.behind
        writer.submit(str(tmp_path / "1.kv"), b"y" * 100, hashes[1])  # queued: 200 bytes
        writer.submit(str(tmp_path / "2.kv"), b"z" * 100, hashes[2])  # past 250: dropped
    assert "dropping writes" in caplog.text
    assert writer.take_report() == ([], [hashes[2]])
    with open(f"{stuck}.{os.getpid()}.tmp", "rb") as fifo:  # the disk answers again
        assert fifo.read() == b"x" * 100
    assert writer.wait(5.0) and not writer.behind
    written, failed = writer.take_report()
    assert written == hashes[:2] and failed == []
    assert (tmp_path / "1.kv").read_bytes() == b"y" * 100 and not (tmp_path / "2.kv").exists()
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone").rmdir()
    writer.submit(str(tmp_path / "gone" / "3.kv"), b"w" * 10, hashes[3])  # a directory that vanished
    assert writer.wait(5.0) and writer.take_report() == ([], [hashes[3]])


def test_unwritable_directory_disables_the_tier_with_one_warning(tmp_path, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(str(blocker / "kv"), FP, 100, 10**6)
    assert not tier.enabled and "disk KV tier is off" in caplog.text
    assert tier.admit(H) is None and tier.read(H) is None


# ----- the default model ----------------------------------------------------------------

TEXT = ("The history of the lighthouse keepers of the northern coast is a story of long winters, "
        "careful records and small kindnesses passed from one keeper to the next. ")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
HOST_GIB = 0.003  # 4 blocks of the f32 KV (720 KiB a block): the prefix (24 blocks) goes past it to disk


def _prompts(llm):
    ids = llm.tokenizer.encode(TEXT * 20)
    prefix = ids[:384]  # 24 blocks of 16
    others = [[t + 1 + i for t in ids[:400]] for i in range(2)]  # no shared blocks with the prefix
    return prefix, prefix + ids[400:420], prefix + ids[384:390], others


def _disk_engine(llm, disk_dir: str, **overrides):
    # 32 blocks (512 tokens): one request at a time fits; the next one evicts the prefix.
    return sibling(llm, num_blocks=32, enable_prefix_caching=True, kv_offloading_size=HOST_GIB,
                   kv_offloading_disk_dir=disk_dir, **overrides)


EVENTS = KVEventsConfig(enable_kv_cache_events=True, publisher="null")  # the event log on, nothing sent


def test_prefix_evicted_past_the_host_tier_comes_back_from_disk_and_after_a_restart(llm_f32, tmp_path) -> None:
    prefix, returning, first_turn, others = _prompts(llm_f32)
    reference = sibling(llm_f32, enable_prefix_caching=False).generate([returning], GREEDY)[0].outputs[0].token_ids
    tiered = _disk_engine(llm_f32, str(tmp_path), kv_events_config=EVENTS)
    assert tiered.generate([first_turn], GREEDY)[0].num_cached_tokens == 0
    for other in others:
        tiered.generate([other], GREEDY)
    host = tiered.engine.scheduler.kv.host_tier
    assert host.num_blocks == 4 and len(host.disk) >= 24
    out = tiered.generate([returning], GREEDY)[0]
    assert_engine_idle(tiered)
    assert out.num_cached_tokens == 384  # every prefix block, all of them from disk
    assert host.disk.stats.hit_tokens == 384 and host.disk.stats.loaded_blocks == 24
    assert host.stats.hit_tokens == 0
    assert out.outputs[0].token_ids == reference
    # A restart: a new engine (empty pool and host tier) over the same directory. With KV
    # events on, it announces the files it found (their records: parent and tokens), so a
    # KV-aware router knows this replica holds the prefix before anyone asks for it.
    restarted = _disk_engine(llm_f32, str(tmp_path), kv_events_config=EVENTS)
    events: list = []
    restarted.engine.kv_event_sink = events.extend
    disk = restarted.engine.scheduler.kv.host_tier.disk
    assert len(disk) >= 24
    out = restarted.generate([returning], GREEDY)[0]
    assert_engine_idle(restarted)
    assert out.num_cached_tokens == 384 and disk.stats.hit_tokens == 384
    assert disk.stats.read_ahead_blocks == 24  # every file read in the background, none by a step
    assert out.outputs[0].token_ids == reference
    announced = [tuple(e.token_ids[i: i + 16]) for e in events if isinstance(e, BlockStored) and e.medium == "DISK"
                 for i in range(0, len(e.token_ids), 16)]
    assert {tuple(prefix[i: i + 16]) for i in range(0, 384, 16)} <= set(announced)


def test_a_request_waiting_for_its_disk_blocks_does_not_stall_the_batch(llm_f32, tmp_path) -> None:
    """The read-ahead: a returning prefix on disk is read by a background thread while the
    request waits outside the queue (WAITING_FOR_REMOTE_KVS); the running stream keeps
    getting a token every step; then the request is admitted with every block from the
    bytes read, and answers as a cache-less engine does."""
    prefix, returning, first_turn, others = _prompts(llm_f32)
    reference = sibling(llm_f32, enable_prefix_caching=False).generate([returning], GREEDY)[0].outputs[0].token_ids
    tiered = _disk_engine(llm_f32, str(tmp_path))
    tiered.generate([first_turn, *others], GREEDY)  # the prefix goes past the host tier to disk
    engine = tiered.engine
    disk = engine.scheduler.kv.host_tier.disk
    assert len(disk) >= 24
    engine.add_request("stream", others[0][:40], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()  # its prompt
    engine.add_request("returning", returning, GREEDY)
    outputs = engine.step()
    assert engine.scheduler.requests["returning"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [o.request_id for o in outputs] == ["stream"]  # the stream's token: the step did not wait
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert_engine_idle(tiered)
    assert done["returning"].num_cached_tokens == 384 and disk.stats.read_ahead_blocks == 24
    assert done["returning"].outputs[0].token_ids == reference
    assert len(done["stream"].outputs[0].token_ids) == 40


def test_a_corrupt_or_truncated_file_is_recomputed_never_used(llm_f32, tmp_path) -> None:
    prefix, returning, first_turn, others = _prompts(llm_f32)
    reference = sibling(llm_f32, enable_prefix_caching=False).generate([returning], GREEDY)[0].outputs[0].token_ids
    tiered = _disk_engine(llm_f32, str(tmp_path))
    tiered.generate([first_turn], GREEDY)
    for other in others:
        tiered.generate([other], GREEDY)
    disk = tiered.engine.scheduler.kv.host_tier.disk
    from tokenmill.engine.block_manager import hash_block

    hashes: list[bytes] = []
    for i in range(24):
        hashes.append(hash_block(hashes[-1] if hashes else None, prefix[i * 16 : (i + 1) * 16]))
    assert all(os.path.exists(disk.path(h)) for h in hashes)
    with open(disk.path(hashes[4]), "r+b") as f:  # flip bytes in the fifth block's KV
        f.seek(-1000, os.SEEK_END)
        data = bytearray(f.read(16))
        f.seek(-1000, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in data))
    with open(disk.path(hashes[10]), "r+b") as f:  # and truncate the eleventh
        f.truncate(1000)
    restarted = _disk_engine(llm_f32, str(tmp_path))
    disk = restarted.engine.scheduler.kv.host_tier.disk
    out = restarted.generate([returning], GREEDY)[0]
    assert_engine_idle(restarted)
    assert out.num_cached_tokens == 4 * 16  # the blocks before the corrupt one; the rest recomputed
    assert disk.stats.corrupt_blocks == 1 and not os.path.exists(disk.path(hashes[4]))
    assert out.outputs[0].token_ids == reference


def test_an_unwritable_directory_does_not_break_serving(llm_f32, tmp_path, caplog) -> None:
    prefix, returning, first_turn, others = _prompts(llm_f32)
    reference = sibling(llm_f32, enable_prefix_caching=False).generate([returning], GREEDY)[0].outputs[0].token_ids
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        unwritable = _disk_engine(llm_f32, str(blocker / "kv"))
        # and a directory that disappears after start-up: the writes fail, warned once
        vanishing = _disk_engine(llm_f32, str(tmp_path / "gone"))
        assert vanishing.engine.scheduler.kv.host_tier.disk.enabled  # made at start-up
        import shutil

        shutil.rmtree(tmp_path / "gone")
        for llm in (unwritable, vanishing):
            llm.generate([first_turn], GREEDY)
            for other in others:
                llm.generate([other], GREEDY)
            out = llm.generate([returning], GREEDY)[0]
            assert_engine_idle(llm)
            assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference
    assert "disk KV tier is off" in caplog.text
    assert caplog.text.count("disk KV tier: cannot write") == 1


def test_the_disk_tier_needs_the_host_tier_and_a_positive_size() -> None:
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match="kv_offloading_disk_dir"):
        EngineConfig().replace(kv_offloading_disk_dir="/tmp/kv")
    with pytest.raises(ValueError, match="kv_offloading_disk_size"):
        EngineConfig().replace(kv_offloading_size=1.0, kv_offloading_disk_dir="/tmp/kv", kv_offloading_disk_size=0)
    config = EngineConfig().replace(kv_offloading_size=1.0, kv_offloading_disk_dir="/tmp/kv")
    assert config.cache.kv_offloading_disk_size == 10.0


def test_server_metrics_count_the_disk_tier(tmp_path) -> None:
    from tests.server_utils import ServerProcess
    from tests.test_kv_tiers import _metric

    # 34 pool blocks of 16 (f32 KV of the default model: 720 KiB a block), a 4-block host tier,
    # the disk below: a 24-block prefix pushed out by two other prompts comes back from disk.
    server = ServerProcess("--kv-cache-memory", "24MiB", "--kv-offloading-size", str(HOST_GIB),
                           "--kv-offloading-disk-dir", str(tmp_path)).start()
    try:
        def complete(prompt: list[int]) -> None:
            response = server.post("/v1/completions", json={"model": server.model, "prompt": prompt,
                                                            "max_tokens": 2, "temperature": 0})
            assert response.status_code == 200, response.text

        prefix = list(range(1000, 1384))  # 24 blocks
        complete(prefix + [7, 8, 9])
        complete(list(range(2000, 2400)))
        complete(list(range(3000, 3400)))
        complete(prefix + [5, 6])
        text = server.get("/metrics").text
        bytes_per_block = 16 * 46080  # 30 layers x 3 KV heads x 64 x 4 bytes x K and V, per token
        assert _metric(text, "tokenmill:kv_offload_disk_enabled") == 1
        assert _metric(text, "tokenmill:kv_offload_disk_prefix_cache_hits_total") == 384
        assert _metric(text, "tokenmill:external_prefix_cache_hits_total") == 384
        assert _metric(text, "tokenmill:kv_offload_total_bytes_total", transfer_type="DISK_to_GPU") == 24 * bytes_per_block
        assert _metric(text, "tokenmill:kv_offload_total_bytes_total", transfer_type="CPU_to_DISK") >= 24 * bytes_per_block
        files = [p for p in tmp_path.rglob("*.kv")]
        assert _metric(text, "tokenmill:kv_offload_disk_cache_bytes") == sum(p.stat().st_size for p in files) > 0
        assert 0 < _metric(text, "tokenmill:kv_offload_disk_cache_usage_perc") < 0.01  # of the 10 GiB default
        assert _metric(text, "tokenmill:kv_offload_disk_corrupt_blocks_total") == 0
    finally:
        assert server.stop() == 0, server.log_tail()
