"""The other end of `publisher.py`: a router's subscription to replicas' KV events.

One thread polls a SUB socket per replica and hands each decoded `KVEventBatch` to a
callback with the replica's index. A gap in the sequence numbers (a replica restarted, or
the PUB socket dropped batches at its high-water mark) is counted and logged: the index
built from the events is a routing hint, never a correctness matter (a replica recomputes
what it does not hold), so a router goes on with what it has.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from tokenmill.kv_events.publisher import LAYOUTS

logger = logging.getLogger(__name__)

POLL_MS = 100


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's per-rank endpoint of a data-parallel replica: a TCP port plus the rank, an
    ipc/inproc path with `_dp<rank>` appended."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def connect_address(endpoint: str) -> str:
    """Where a subscriber on this host connects for a publisher bound at `endpoint`."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("*", "0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        return f"tcp://{host}:{port}"
    return endpoint


class KVEventSubscriber:
    """SUB sockets on `endpoints` (one per replica), a thread decoding their batches."""

    def __init__(self, endpoints: list[str], on_batch: Callable[[int, Any], None], topic: str = "",
                 layout: str = "map") -> None:
        self.on_batch = on_batch
        self.decoder = msgspec.msgpack.Decoder(type=LAYOUTS[layout].KVEventBatch)
        self.context = zmq.Context()
        self.sockets = []
        for endpoint in endpoints:
            socket = self.context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(connect_address(endpoint))
            socket.setsockopt_string(zmq.SUBSCRIBE, topic)
            self.sockets.append(socket)
        self.last_seq: list[int | None] = [None] * len(endpoints)
        self.batches = 0
        self.gaps = 0
        self.undecodable = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-event-subscriber", daemon=True)

    def start(self) -> KVEventSubscriber:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.context.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        for socket in self.sockets:
            poller.register(socket, zmq.POLLIN)
        index_of = {socket: i for i, socket in enumerate(self.sockets)}
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(POLL_MS))
            except zmq.ZMQError:  # closed under us
                return
            for socket in ready:
                self._receive(index_of[socket], socket)

    def _receive(self, replica: int, socket: zmq.Socket) -> None:
        frames = socket.recv_multipart()
        if len(frames) != 3:
            self.undecodable += 1
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        last = self.last_seq[replica]
        if last is not None and seq != last + 1:
            self.gaps += 1
            logger.warning("KV events of replica %d: sequence %d after %d (batches lost or the replica restarted)",
                           replica, seq, last)
        self.last_seq[replica] = seq
        try:
            batch = self.decoder.decode(payload)
        except msgspec.DecodeError:
            self.undecodable += 1
            return
        self.batches += 1
        self.on_batch(replica, batch)
