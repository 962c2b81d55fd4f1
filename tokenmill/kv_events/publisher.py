"""vLLM's KV-event schema and ZMQ transport (`vllm/distributed/kv_events.py`).

The wire: each engine step with events is one `KVEventBatch` `[ts, events,
data_parallel_rank]`, each event a tagged map (`{"type": "BlockStored", ...}`: vLLM's
current layout, what vllm-router decodes) or, with `"event_layout": "array"`, a tagged
array (`["BlockStored", ...]`: the older layout vLLM's example subscriber decodes),
MessagePack-encoded by msgspec, sent as
three frames: topic, an 8-byte big-endian sequence number, the payload. A ROUTER socket on
`replay_endpoint` answers a sequence number with every kept batch from it on, then
`(-1, b"")`. Block hashes go out in vLLM's integer form: the low 64 bits of the block's
SHA-256 digest, unsigned.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from types import SimpleNamespace
from typing import Any

import msgspec
import zmq

from tokenmill.config import KVEventsConfig
from tokenmill.engine import kv_events as ev

logger = logging.getLogger(__name__)

ExternalBlockHash = int


def event_structs(array_like: bool) -> SimpleNamespace:
    """vLLM's event structs in one of its two layouts: tagged maps (`{"type": "BlockStored",
    ...}`, vLLM's current one, which vllm-router's kv_aware policy decodes) or tagged arrays
    (`["BlockStored", ...]`, the older one, which vLLM's example subscriber decodes). The batch
    is an array either way."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        """Base class of the KV-cache events (tagged with the class name)."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    # Made with real types (this module's annotations are strings, and these classes are
    # local): a subscriber decodes with it.
    KVEventBatch = msgspec.defstruct("KVEventBatch", [("events", list[BlockStored | BlockRemoved | AllBlocksCleared])],
                                     bases=(EventBatch,), array_like=True, omit_defaults=True, gc=False)

    return SimpleNamespace(KVEventBatch=KVEventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                           AllBlocksCleared=AllBlocksCleared)


LAYOUTS = {"map": event_structs(array_like=False), "array": event_structs(array_like=True)}


def external_hash(block_hash: bytes) -> ExternalBlockHash:
    """vLLM's integer form of a block hash: the digest's low 64 bits, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


def to_wire(event: ev.KVEvent, layout: str = "map") -> Any:
    structs = LAYOUTS[layout]
    if isinstance(event, ev.BlockStored):
        extra = None
        if event.extra_key is not None:  # the first block's cache salt, as vLLM's extra keys carry it
            extra = [(event.extra_key,)] + [None] * (len(event.block_hashes) - 1)
        parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash)
        return structs.BlockStored([external_hash(h) for h in event.block_hashes], parent, list(event.token_ids),
                                   event.block_size, None, event.medium, None, extra, group_idx=0,
                                   kv_cache_spec_kind="full_attention")
    if isinstance(event, ev.BlockRemoved):
        return structs.BlockRemoved([external_hash(h) for h in event.block_hashes], event.medium, group_idx=0)
    return structs.AllBlocksCleared()


class ZmqEventPublisher:
    """PUB socket plus an optional ROUTER for replays, driven by one thread (ZMQ sockets
    are not thread-safe); `publish` only queues."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._seq = count()
        self.num_published = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-publisher")
        self._thread.start()
        logger.info("publishing KV events on %s (topic %r%s)", endpoint, config.topic,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish_events(self, events: list[ev.KVEvent]) -> None:
        """The engine's sink: one batch per step."""
        structs = LAYOUTS[self.config.event_layout]
        batch = structs.KVEventBatch(ts=time.time(), events=[to_wire(e, self.config.event_layout) for e in events],
                                     data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV event queue full (%d batches): a batch of %d events dropped",
                           self.config.max_queue_size, len(events))

    def shutdown(self, timeout: float = 1.0) -> None:
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV event replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("invalid KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """The configured publisher, or None (events off, or the null publisher)."""
    if config is None or not config.publishes:
        return None
    return ZmqEventPublisher(config, data_parallel_rank)
