"""KV events (docs/kv-tiers.md): the block manager's event log on tiny sizes, then the
wire — a subscriber built from vLLM's example subscriber (its msgspec structs, its ZMQ
SUB and replay REQ sockets) decoding what a real engine and a real server publish."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any, Optional, Union

import httpx

import msgspec
import pytest
import zmq
from fakes import make_request

from tests.conftest import assert_engine_idle, sibling
from tests.server_utils import ServerProcess, free_port, vllm_router
from tokenmill import SamplingParams
from tokenmill.config import KVEventsConfig, parse_kv_events_config
from tokenmill.engine import kv_events as ev
from tokenmill.engine.block_manager import KVBlockManager, hash_block
from tokenmill.engine.kv_tiers import DiskTier, HostTier, encode_block_file, encode_block_record, kv_fingerprint
from tokenmill.kv_events.publisher import ZmqEventPublisher, external_hash

BS = 4


# ----- vLLM's example subscriber's types (examples/online_serving/kv_events_subscriber.py) -----


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045 (as the example spells it)
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045
    medium: Optional[str]  # noqa: UP045


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]  # noqa: UP045


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]  # noqa: UP007


# ----- vLLM's current structs (vllm/distributed/kv_events.py): events as tagged maps ---------


class CurrentKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class CurrentBlockStored(CurrentKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class CurrentBlockRemoved(CurrentKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class CurrentAllBlocksCleared(CurrentKVCacheEvent, tag="AllBlocksCleared"):
    pass


class CurrentKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[CurrentBlockStored, CurrentBlockRemoved, CurrentAllBlocksCleared]]  # noqa: UP007
    data_parallel_rank: int | None = None


class Subscriber:
    """The example subscriber's sockets: SUB on the topic, REQ for replays."""

    def __init__(self, port: int, replay_port: int, topic: str, batch_type: type = KVEventBatch) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay = self.ctx.socket(zmq.REQ)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.decoder = msgspec.msgpack.Decoder(type=batch_type)

    def receive(self, until, timeout: float = 60.0) -> list[tuple[int, KVEventBatch]]:
        """Batches until `until(events so far)` holds."""
        got: list[tuple[int, KVEventBatch]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until([e for _, b in got for e in b.events]):
            if self.sub.poll(100):
                _, seq, payload = self.sub.recv_multipart()
                got.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        return got

    def replay_from(self, seq: int) -> list[tuple[int, KVEventBatch]]:
        self.replay.send(seq.to_bytes(8, "big"))
        got = []
        while self.replay.poll(5000):
            seq_bytes, payload = self.replay.recv_multipart()
            if not payload:
                break
            got.append((int.from_bytes(seq_bytes, "big"), self.decoder.decode(payload)))
        return got

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def settle_subscription() -> None:
    time.sleep(0.5)  # a SUB socket misses what is sent before its subscription arrives (ZMQ's slow joiner)


def chain(token_ids: list[int], size: int = BS) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(token_ids) // size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * size : (i + 1) * size]))
    return hashes


# ----- the event log ----------------------------------------------------------------------


def run_once(kv: KVBlockManager, request) -> None:
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    kv.take_transfers()  # the step's end (unpins what it loaded)
    kv.free(request)
    kv.check_integrity()


def test_event_log_follows_blocks_through_pool_and_host_tier() -> None:
    kv = KVBlockManager(4, BS, host_tier=HostTier(2, bytes_per_block=100))
    kv.events = ev.KVEventLog(BS)
    a, b = list(range(100, 109)), list(range(200, 213))
    run_once(kv, make_request("a", a))
    assert kv.take_events() == [ev.BlockStored(chain(a), None, a[:8], BS, ev.MEDIUM_POOL)]
    run_once(kv, make_request("b", b))  # evicts a's two blocks (its end first) into the host tier
    a0, a1 = chain(a)
    assert kv.take_events() == [
        ev.BlockRemoved([a1], "GPU"), ev.BlockStored([a1], a0, a[4:8], BS, "CPU"),
        ev.BlockRemoved([a0], "GPU"), ev.BlockStored([a0], None, a[:4], BS, "CPU"),
        ev.BlockStored(chain(b), None, b[:12], BS, "GPU"),
    ]
    run_once(kv, make_request("a2", a))  # promoted back: stored in the pool again; b's blocks make room
    # (the host tier refuses them: both its slots are being loaded in this step)
    assert kv.take_events() == [ev.BlockRemoved([chain(b)[2]], "GPU"), ev.BlockRemoved([chain(b)[1]], "GPU"),
                                ev.BlockStored([a0, a1], None, a[:8], BS, "GPU")]
    c = list(range(300, 313))
    run_once(kv, make_request("c", c))  # evicts b0, a1 (already in the host tier: no copy), a0
    b0 = chain(b)[0]
    assert kv.take_events() == [
        ev.BlockRemoved([a0], "CPU"), ev.BlockRemoved([b0], "GPU"), ev.BlockStored([b0], None, b[:4], BS, "CPU"),
        ev.BlockRemoved([a1], "GPU"),
        ev.BlockRemoved([b0], "CPU"), ev.BlockRemoved([a0], "GPU"), ev.BlockStored([a0], None, a[:4], BS, "CPU"),
        ev.BlockStored(chain(c), None, c[:12], BS, "GPU"),
    ]
    assert set(kv.events.meta) == {a0, a1, *chain(c)}  # what some tier still holds
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [ev.AllBlocksCleared()]
    assert kv.events.meta == {}


def test_disk_tier_blocks_are_announced_on_the_disk_medium(tmp_path) -> None:
    fingerprint = kv_fingerprint("events test")
    file_bytes = DiskTier(str(tmp_path / "probe"), fingerprint, 100, 10**6).file_bytes
    file_bytes += len(encode_block_record(ev.BlockMeta(bytes(32), list(range(BS)))))  # a block's record
    disk = DiskTier(str(tmp_path), fingerprint, 100, 2 * file_bytes)  # two files
    kv = KVBlockManager(3, BS, host_tier=HostTier(1, bytes_per_block=100, disk=disk))
    kv.events = ev.KVEventLog(BS)
    a, b, c = list(range(100, 109)), list(range(200, 209)), list(range(300, 309))
    (a0, a1), (b0, b1), (c0, c1) = chain(a), chain(b), chain(c)

    def disk_events() -> list:
        return [e for e in kv.take_events() if getattr(e, "medium", None) == ev.MEDIUM_DISK]

    run_once(kv, make_request("a", a))
    assert disk_events() == []
    run_once(kv, make_request("b", b))  # a's blocks leave the pool; the one-slot host tier drops a1 to disk
    assert disk_events() == [ev.BlockStored([a1], a0, a[4:8], BS, "DISK")]
    run_once(kv, make_request("c", c))  # a0 and b1 go to disk; the two-file cap deletes a1
    assert disk_events() == [ev.BlockStored([a0], None, a[:4], BS, "DISK"),
                             ev.BlockStored([b1], b0, b[4:8], BS, "DISK"), ev.BlockRemoved([a1], "DISK")]
    assert set(kv.events.meta) == {a0, b0, b1, c0, c1}  # what the pool, the host tier or the disk holds
    # A file the runner's writer reports not written (a slow disk's backlog, a full disk) is
    # forgotten, and said so; one not written yet is never read.
    request = make_request("a again", a)
    assert kv.get_computed_blocks(request)[1] == 0 and disk_events() == []
    disk.writes_done([], [a0])
    assert disk_events() == [ev.BlockRemoved([a0], "DISK")] and a0 not in kv.events.meta
    assert kv.reset_prefix_cache()
    assert kv.take_events()[-1] == ev.AllBlocksCleared() and len(disk) == 0


def run_and_write(kv: KVBlockManager, request) -> None:
    """run_once, writing the step's spilled blocks' files as the runner does (with a
    stand-in KV payload)."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    transfers = kv.take_transfers()
    for _, _, path, block_hash, record in transfers.spill if transfers else []:
        with open(path, "wb") as f:
            f.write(encode_block_file(transfers.disk_header, block_hash, bytes(100), record))
    kv.free(request)


def test_a_restarted_engine_announces_the_disk_files_it_finds(tmp_path) -> None:
    fingerprint = kv_fingerprint("restart test")
    kv = KVBlockManager(3, BS, host_tier=HostTier(1, bytes_per_block=100,
                                                  disk=DiskTier(str(tmp_path), fingerprint, 100, 10**6)))
    kv.events = ev.KVEventLog(BS)
    a, b, c = list(range(100, 109)), list(range(200, 209)), list(range(300, 309))
    for name, tokens in (("a", a), ("b", b), ("c", c)):
        run_and_write(kv, make_request(name, tokens))
    (a0, a1), (b0, b1) = chain(a), chain(b)
    on_disk = {e.block_hashes[0]: e for e in kv.take_events() if isinstance(e, ev.BlockStored) and e.medium == "DISK"}
    assert set(on_disk) == {a0, a1, b1}
    # Restarted: a new block manager over the same directory says what it found, once, as
    # the first run said it (parent, tokens), so a router can route to this replica's files.
    again = KVBlockManager(3, BS, host_tier=HostTier(1, bytes_per_block=100,
                                                     disk=DiskTier(str(tmp_path), fingerprint, 100, 10**6)))
    again.events = ev.KVEventLog(BS)
    found = [e for e in again.take_events() if isinstance(e, ev.BlockStored)]
    assert sorted(found, key=lambda e: e.block_hashes[0]) == sorted(
        [ev.BlockStored([a1], a0, a[4:8], BS, "DISK"), ev.BlockStored([a0], None, a[:4], BS, "DISK"),
         ev.BlockStored([b1], b0, b[4:8], BS, "DISK")], key=lambda e: e.block_hashes[0])
    assert again.take_events() == []
    # ... and removes them from its events when they go (here: a reset).
    assert again.reset_prefix_cache() and again.take_events() == [ev.AllBlocksCleared()]
    # Files written without events carry no record: found, served, but not announced.
    quiet = KVBlockManager(3, BS, host_tier=HostTier(1, bytes_per_block=100,
                                                     disk=DiskTier(str(tmp_path / "quiet"), fingerprint, 100, 10**6)))
    for name, tokens in (("a", a), ("b", b)):
        run_and_write(quiet, make_request(name, tokens))
    later = KVBlockManager(3, BS, host_tier=HostTier(1, bytes_per_block=100,
                                                     disk=DiskTier(str(tmp_path / "quiet"), fingerprint, 100, 10**6)))
    later.events = ev.KVEventLog(BS)
    assert len(later.host_tier.disk) == 1 and later.take_events() == []


def test_without_events_the_disk_tier_keeps_no_event_lists(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), kv_fingerprint("no events"), 100, 10**6)
    kv = KVBlockManager(3, BS, host_tier=HostTier(1, bytes_per_block=100, disk=disk))
    for i in range(20):
        run_once(kv, make_request(f"r{i}", list(range(100 * i, 100 * i + 9))))
    assert len(disk) > 10 and disk.added == [] and disk.removed == []


def test_kv_events_config_is_vllms() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert config.publisher == "zmq" and config.publishes and config.replay_endpoint is None
    assert not parse_kv_events_config({"enable_kv_cache_events": False}).publishes
    assert json.loads(str(config))["topic"] == "kv"
    with pytest.raises(ValueError, match="unsupported key"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "port": 1}')
    with pytest.raises(ValueError, match="publisher"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "kafka"}')


# ----- on the wire ------------------------------------------------------------------------


def test_example_subscriber_decodes_a_real_engines_events(llm_f32) -> None:
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{replay_port}", topic="kv-events", event_layout="array")
    llm = sibling(llm_f32, enable_prefix_caching=True, kv_events_config=config)
    publisher = ZmqEventPublisher(config)
    llm.engine.kv_event_sink = publisher.publish_events
    subscriber = Subscriber(port, replay_port, "kv-events")
    try:
        settle_subscription()
        prompt = llm.tokenizer.encode("The lighthouse keepers of the northern coast kept careful records. " * 6)
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        full = len(prompt) // 16
        expected = [external_hash(h) for h in chain(prompt, 16)]

        def stored(events) -> list[int]:
            return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]

        got = subscriber.receive(lambda events: len(stored(events)) >= full)
        events = [e for _, batch in got for e in batch.events]
        assert stored(events)[:full] == expected
        first = next(e for e in events if isinstance(e, BlockStored))
        assert first.parent_block_hash is None and first.block_size == 16 and first.medium == "GPU"
        assert first.token_ids == prompt[: 16 * len(first.block_hashes)]
        # A subscriber that missed batches asks for them again by sequence number.
        replayed = subscriber.replay_from(got[0][0])
        assert [seq for seq, _ in replayed][: len(got)] == [seq for seq, _ in got]
        assert replayed[0][1].events == got[0][1].events
    finally:
        subscriber.close()
        publisher.shutdown()
    assert_engine_idle(llm)


def test_server_publishes_kv_events_for_a_request() -> None:
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{free_port()}", "topic": "kv-events"}
    server = ServerProcess("--kv-events-config", json.dumps(config), "--kv-offloading-size", "0.05")
    server.start()
    subscriber = Subscriber(port, free_port(), "kv-events", CurrentKVEventBatch)  # the default layout: vLLM's current
    try:
        settle_subscription()
        prompt = list(range(1000, 1040))  # 40 token ids: two full blocks
        response = server.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200, response.text
        got = subscriber.receive(lambda events: any(isinstance(e, CurrentBlockStored) for e in events))
        stored = [e for _, batch in got for e in batch.events if isinstance(e, CurrentBlockStored)]
        assert stored, server.log_tail()
        assert stored[0].block_hashes[:2] == [external_hash(h) for h in chain(prompt, 16)]
        assert stored[0].token_ids[:32] == prompt[:32] and stored[0].medium == "GPU"
        assert stored[0].group_idx == 0 and stored[0].kv_cache_spec_kind == "full_attention"
    finally:
        subscriber.close()
        assert server.stop() == 0, server.log_tail()


# ----- vllm-router's kv_aware policy ------------------------------------------------------------



def counter(server: ServerProcess, name: str) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith(name))


@pytest.mark.slow  # two servers and a router: ~1-2 min on 2 shared cores
def test_vllm_router_kv_aware_routes_on_tokenmill_kv_events() -> None:
    ports = [free_port() for _ in range(2)]
    replicas = []
    router = None
    try:
        for port in ports:
            events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
            replicas.append(ServerProcess("--kv-events-config", json.dumps(events), "--kv-cache-memory", "64MiB")
                            .start())
        router_port = free_port()
        log = open(replicas[0].log.name + ".router", "w")
        command = vllm_router("--host", "127.0.0.1", "--port", str(router_port), "--policy", "kv_aware",
                   "--worker-urls", *(r.url for r in replicas), "--kv-event-block-size", "16",
                   "--kv-event-model", replicas[0].model, "--log-level", "debug")
        for replica, port in zip(replicas, ports):
            command += ["--kv-event-source", f"{replica.url}=tcp://127.0.0.1:{port}"]
        router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        model = replicas[0].model
        # Token ids (no tokenizer between router and replica). Each replica computes one
        # session's context on its own: only the replicas' KV events tell the router where.
        contexts = [[(s * 37 + i) % 5000 + 300 for i in range(64)] for s in range(2)]
        for replica, context in zip(replicas, contexts):
            response = replica.post("/v1/completions", json={"model": model, "prompt": context + [401],
                                                             "max_tokens": 2})
            assert response.status_code == 200, response.text
        time.sleep(2.0)  # the events reach the router's subscribers
        before = [counter(r, "tokenmill:request_success_total") for r in replicas]
        hits_before = [counter(r, "tokenmill:prefix_cache_hits_total") for r in replicas]
        for turn in range(2):
            for session in (1, 0):  # the second context first: no default order helps
                body = {"model": model, "prompt": contexts[session] + [402 + turn], "max_tokens": 2}
                response = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
        served = [counter(r, "tokenmill:request_success_total") - b for r, b in zip(replicas, before)]
        hits = [counter(r, "tokenmill:prefix_cache_hits_total") - h for r, h in zip(replicas, hits_before)]
        assert served == [2, 2], (served, open(log.name).read()[-3000:])  # each session went to its context
        assert hits == [2 * 64, 2 * 64]  # and found its 4 blocks cached there, twice
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for replica in replicas:
            replica.stop()
