"""KV blocks between a prefill instance (producer) and a decode instance (consumer) over ZMQ.

The producer binds a ROUTER socket at `kv_ip:kv_port` and serves, on its own thread:
- `hello` -> its engine id and KV layout facts (model, architecture, weight format, KV dtype
  and layout, block size, KV bytes per token): a consumer refuses a producer whose facts
  differ, naming each difference, before it reads a byte of KV;
- `pull {request_id, block_ids}` -> one frame per block, the pool's own bytes (every layer's
  K, V and an 8-bit cache's scales, `ModelRunner.kv_block_bytes`), then the hold is released
  (the scheduler frees the blocks at its next poll);
- `release {request_id}` -> the hold is released without a transfer (the consumer had every
  block in its own prefix cache, or gave up);
- on one host, when the producer's pool is in shared memory (`hello` describes it,
  shared_memory.py) and the consumer can map it: `pin {request_id, block_ids, seconds}` -> the
  hold is pinned for that long, the consumer copies the blocks from the producer's pool itself,
  then `unpin {request_id}` -> released; its answer says whether the hold was still pinned, and a
  consumer told otherwise (it took longer than the pin: the blocks may have been freed and reused
  under the copy) discards the copy and recomputes. No block's bytes cross the socket.
A hold nobody pulls is released after `abort_request_timeout` seconds (vLLM's
VLLM_NIXL_ABORT_REQUEST_TIMEOUT). A hold being read over TCP cannot time out under the reader.

The consumer pulls on one background thread (a DEALER socket per producer), so the transfer
overlaps the decode steps of other requests; given the runner's writer (`write_blocks`), that
thread also copies the pulled blocks into the request's pool blocks, off the engine thread; a pull that fails (producer gone, hold expired,
timeout, short reply, mismatched facts) is reported and the scheduler recomputes the prompt.
Frames are JSON headers and raw block bytes; ZMQ does the framing, connection and reconnection.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from tokenmill.config import EngineFacts, KVTransferConfig
from tokenmill.engine.kv_transfer import KVTransferParamsError, KVTransferStats, PullResult, RemotePrefill
from tokenmill.kv_transfer.shared_memory import PeerRegion, close_region, open_peer_region

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
FACT_KEYS = ("model_name", "architecture", "weight_format", "kv_cache_dtype", "kv_cache_format", "block_size",
             "kv_bytes_per_token")


def kv_layout_facts(facts: EngineFacts) -> dict[str, Any]:
    """What must be equal on both sides for a block's bytes to mean the same KV."""
    return {key: getattr(facts, key) for key in FACT_KEYS}


def mismatch(here: dict[str, Any], there: dict[str, Any]) -> list[str]:
    return [f"{key} {there.get(key)!r} there, {here.get(key)!r} here" for key in FACT_KEYS
            if here.get(key) != there.get(key)]


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    busy: bool = False  # being read over TCP (by the server thread)
    pinned_until: float | None = None  # a consumer copies it from shared memory until then

    def expired(self, now: float) -> bool:
        if self.pinned_until is not None:
            return self.pinned_until < now
        return not self.busy and self.deadline < now


# A consumer's copy from shared memory: (the producer's mapped region, its block ids, ours).
CopyShared = Callable[[PeerRegion, list[int], list[int]], None]


class ZmqKVConnector:
    def __init__(self, config: KVTransferConfig, facts: dict[str, Any], bytes_per_block: int,
                 read_blocks: Callable[[list[int]], list[bytes]] | None,
                 clock: Callable[[], float] = time.monotonic,
                 write_blocks: Callable[[list[int], list[bytes]], None] | None = None,
                 shared_pool: dict[str, Any] | None = None, copy_shared: CopyShared | None = None) -> None:
        self.config = config
        self.is_producer = config.is_producer
        self.is_consumer = config.is_consumer
        # A consumer given the runner's writer copies pulled blocks into the pool on its puller
        # thread, overlapping the engine's steps; else the bytes go to the scheduler.
        self._write_blocks = write_blocks if config.is_consumer else None
        self.writes_in_place = self._write_blocks is not None
        # Shared memory on one host: the producer's pool's description (hello's answer), and
        # the consumer's copier; a consumer copies in place only when it also writes in place.
        self.shared_pool = shared_pool if config.is_producer else None
        self._copy_shared = copy_shared if self.writes_in_place and config.shared_memory else None
        self._peer_regions: dict[tuple[str, int], PeerRegion | None] = {}  # None: pull over TCP
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.facts = facts
        self.bytes_per_block = bytes_per_block
        self.clock = clock
        self._read_blocks = read_blocks
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._released: list[str] = []
        self._pulled: list[PullResult] = []
        self._pull_done = threading.Event()
        self._stats = KVTransferStats()
        self._verified: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._threads: list[threading.Thread] = []
        if self.is_producer:
            if read_blocks is None:
                raise ValueError("a KV producer needs a reader of its KV blocks")
            self._server = self._ctx.socket(zmq.ROUTER)
            self._server.setsockopt(zmq.LINGER, 0)
            try:
                self._server.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
            except zmq.ZMQError as e:
                self._ctx.destroy(linger=0)
                raise ValueError(f"kv_transfer_config: cannot listen on {config.kv_ip}:{config.kv_port} ({e}); "
                                 "give each producer its own kv_port") from None
            self._threads.append(threading.Thread(target=self._serve, name="kv-transfer-server", daemon=True))
        if self.is_consumer:
            self._jobs: queue.Queue[tuple[str, RemotePrefill, list[int]] | None] = queue.Queue()
            self._threads.append(threading.Thread(target=self._pull_loop, name="kv-transfer-puller", daemon=True))
        for thread in self._threads:
            thread.start()

    @property
    def advertised_host(self) -> str:
        return "127.0.0.1" if self.config.kv_ip in ("0.0.0.0", "*") else self.config.kv_ip

    # ----- the scheduler's calls (engine thread) --------------------------------------------

    def hold(self, key: str, block_ids: list[int]) -> dict[str, Any]:
        with self._lock:
            self._holds[key] = _Hold(list(block_ids), self.clock() + self.config.abort_request_timeout)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": list(block_ids), "remote_host": self.advertised_host,
                "remote_port": self.config.kv_port, "remote_request_id": key, "tp_size": 1}

    def released(self) -> list[str]:
        now = self.clock()
        with self._lock:
            for key, hold in list(self._holds.items()):
                if hold.expired(now):
                    del self._holds[key]
                    self._released.append(key)
                    self._stats.expired_requests += 1
                    if hold.pinned_until is not None:
                        logger.warning("kv transfer: the decode instance copying %s did not finish within its pin; "
                                       "its %d blocks are freed", key, len(hold.block_ids))
                    else:
                        logger.warning("kv transfer: %s was not pulled within %g s; its %d blocks are freed", key,
                                       self.config.abort_request_timeout, len(hold.block_ids))
            released, self._released = self._released, []
        return released

    def start_pull(self, request_id: str, remote: RemotePrefill, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        self._jobs.put((request_id, remote, list(remote_block_ids), list(local_block_ids)))

    def take_pulled(self) -> list[PullResult]:
        with self._lock:
            pulled, self._pulled = self._pulled, []
        return pulled

    def wait(self, timeout: float) -> None:
        if self._pull_done.wait(timeout):
            self._pull_done.clear()

    def stats(self) -> KVTransferStats:
        with self._lock:
            s = self._stats
            return KVTransferStats(held_blocks=sum(len(h.block_ids) for h in self._holds.values()),
                                   held_requests=len(self._holds), sent_blocks=s.sent_blocks,
                                   expired_requests=s.expired_requests, pulled_blocks=s.pulled_blocks,
                                   failed_pulls=s.failed_pulls, shared_memory_blocks=s.shared_memory_blocks)

    # ----- the consumer's handshake (a server handler's thread) -----------------------------

    def check_peer(self, remote: RemotePrefill) -> None:
        """Ask a producer for its facts (once per producer) and raise KVTransferParamsError
        naming every difference (the producer is told to free the request's blocks); a
        producer that does not answer is left to the pull (which fails, and the prompt is
        recomputed)."""
        host, port = remote.host, remote.port
        if (host, port) in self._verified:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send_multipart([b"hello", b"{}"])
            if not sock.poll(int(min(HANDSHAKE_TIMEOUT_S, self.config.pull_timeout) * 1000)):
                return
            try:
                self._check_facts(host, port, json.loads(sock.recv_multipart()[0]))
            except KVTransferParamsError:
                sock.send_multipart([b"release", json.dumps({"request_id": remote.request_id}).encode()])
                sock.poll(1000)
                raise
        finally:
            sock.close()

    def _check_facts(self, host: str, port: int, there: dict[str, Any]) -> None:
        differences = mismatch(self.facts, there.get("facts", {}))
        if differences:
            raise KVTransferParamsError(
                f"kv_transfer_params: the prefill instance at {host}:{port} (engine {there.get('engine_id')}) does not "
                f"hold the same KV layout as this decode instance: {'; '.join(differences)}. Run both with the same "
                "model, weight format, --kv-cache-dtype and --block-size")
        self._verified.add((host, port))

    # ----- the producer's server thread -----------------------------------------------------

    def _serve(self) -> None:
        sock = self._server
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart()
            if len(frames) < 3:
                continue
            ident, kind, body = frames[0], frames[1], frames[2]
            try:
                reply = self._answer(kind, json.loads(body))
            except Exception as e:  # noqa: BLE001 - a bad message must not stop the server
                logger.exception("kv transfer server: %s", kind)
                reply = [json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode()]
            sock.send_multipart([ident, *reply], copy=True)
        sock.close()

    def _answer(self, kind: bytes, body: dict[str, Any]) -> list[bytes]:
        if kind == b"hello":
            return [json.dumps({"ok": True, "engine_id": self.engine_id, "facts": self.facts,
                                "shared_memory": self.shared_pool}).encode()]
        key = str(body.get("request_id"))
        if kind == b"release":
            with self._lock:
                hold = self._holds.get(key)
                if hold is not None and not hold.busy and hold.pinned_until is None:
                    del self._holds[key]
                    self._released.append(key)
            return [json.dumps({"ok": True, "request_id": key}).encode()]
        if kind == b"unpin":
            with self._lock:
                hold = self._holds.get(key)
                if hold is None or hold.pinned_until is None:
                    return [json.dumps({"ok": False, "request_id": key, "error": (
                        f"the hold of {key} ended before the copy did (pinned too briefly): its blocks may have "
                        "been reused")}).encode()]
                del self._holds[key]
                self._released.append(key)
                self._stats.sent_blocks += len(hold.block_ids)
            return [json.dumps({"ok": True, "request_id": key}).encode()]
        if kind not in (b"pull", b"pin"):
            return [json.dumps({"ok": False, "error": f"unknown message {kind!r}"}).encode()]
        block_ids = [int(b) for b in body.get("block_ids", [])]
        with self._lock:
            hold = self._holds.get(key)
            if hold is None or hold.busy or hold.pinned_until is not None:
                return [json.dumps({"ok": False, "request_id": key, "error": (
                    f"no KV held for {key} (never, already pulled, or freed after the "
                    f"{self.config.abort_request_timeout:g} s timeout)")}).encode()]
            if not set(block_ids) <= set(hold.block_ids):
                return [json.dumps({"ok": False, "request_id": key,
                                    "error": f"blocks {block_ids} are not those held for {key}"}).encode()]
            if kind == b"pin":
                if self.shared_pool is None:
                    return [json.dumps({"ok": False, "request_id": key, "error": "no shared KV pool here"}).encode()]
                hold.block_ids = block_ids  # what the copy reads; the others are freed with them
                hold.pinned_until = self.clock() + float(body.get("seconds", self.config.pull_timeout))
                return [json.dumps({"ok": True, "request_id": key, "token": self.shared_pool["token"]}).encode()]
            hold.busy = True
        try:
            payloads = self._read_blocks(block_ids)
        finally:
            with self._lock:
                self._holds.pop(key, None)
                self._released.append(key)
        with self._lock:
            self._stats.sent_blocks += len(block_ids)
        return [json.dumps({"ok": True, "request_id": key, "num_blocks": len(payloads)}).encode(), *payloads]

    # ----- the consumer's pull thread -------------------------------------------------------

    def _pull_loop(self) -> None:
        sockets: dict[tuple[str, int], zmq.Socket] = {}
        while True:
            job = self._jobs.get()
            if job is None:
                break
            request_id, remote, block_ids, local_block_ids = job
            peer = (remote.host, remote.port)
            started = time.monotonic()
            shared = False
            try:
                sock = self._socket(sockets, peer)
                region = self._peer_region(sock, peer)
                if region is not None and block_ids:
                    self._copy_pinned(sock, region, remote, block_ids, local_block_ids)
                    shared, count = True, len(block_ids)
                    result = PullResult(request_id, [], written=True)
                    logger.info("kv transfer: %s copied %d blocks (%.1f MB) from %s:%d's shared memory in %.1f ms",
                                request_id, count, count * self.bytes_per_block / 1e6, *peer,
                                1e3 * (time.monotonic() - started))
                else:
                    payloads = self._pull(sock, remote, block_ids)
                    pulled, count = time.monotonic(), len(payloads)
                    result = PullResult(request_id, payloads)
                    if self._write_blocks is not None:  # into the pool here, while the engine's steps go on
                        self._write_blocks(local_block_ids[:len(payloads)], payloads)
                        result = PullResult(request_id, [], written=True)
                    logger.info("kv transfer: %s pulled %d blocks (%.1f MB) from %s:%d in %.1f ms%s", request_id,
                                count, sum(map(len, payloads)) / 1e6, *peer, 1e3 * (pulled - started),
                                f", copied in in {1e3 * (time.monotonic() - pulled):.1f} ms" if result.written else "")
            except Exception as e:  # noqa: BLE001 - reported; the scheduler recomputes
                sock = sockets.pop(peer, None)  # a late reply must not answer the next pull
                if sock is not None:
                    sock.close()
                close_region(self._peer_regions.pop(peer, None))  # asked again (hello) at the next pull
                result = PullResult(request_id, None, f"{remote.host}:{remote.port}: {e}")
            with self._lock:
                if result.payloads is None:
                    self._stats.failed_pulls += 1
                else:
                    self._stats.pulled_blocks += count
                    self._stats.shared_memory_blocks += count if shared else 0
                self._pulled.append(result)
            self._pull_done.set()
        for sock in sockets.values():
            sock.close()
        for region in self._peer_regions.values():
            close_region(region)

    def _request(self, sock: zmq.Socket, frames: list[bytes], timeout: float) -> list[bytes]:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer within {timeout:g} s")
        return sock.recv_multipart()

    def _socket(self, sockets: dict[tuple[str, int], zmq.Socket], peer: tuple[str, int]) -> zmq.Socket:
        sock = sockets.get(peer)
        if sock is None:
            sock = sockets[peer] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{peer[0]}:{peer[1]}")
        return sock

    def _peer_region(self, sock: zmq.Socket, peer: tuple[str, int]) -> PeerRegion | None:
        """The producer's shared memory if this process can map it (asked once per producer,
        with the facts check); None: pull over TCP."""
        if peer in self._peer_regions and peer in self._verified:
            return self._peer_regions[peer]
        hello = json.loads(self._request(sock, [b"hello", b"{}"], self.config.pull_timeout)[0])
        self._check_facts(*peer, hello)
        region, why = None, "shared memory is off here"
        if self._copy_shared is not None:
            region, why = open_peer_region(hello.get("shared_memory"))
        if region is None:
            logger.info("kv transfer: pulling from %s:%d over TCP (%s)", *peer, why)
        else:
            logger.info("kv transfer: copying from %s:%d's shared memory in place", *peer)
        self._peer_regions[peer] = region
        return region

    def _copy_pinned(self, sock: zmq.Socket, region: PeerRegion, remote: RemotePrefill, block_ids: list[int],
                     local_block_ids: list[int]) -> None:
        """Pin the blocks, copy them from the producer's pool, unpin: the unpin's answer says
        whether they stayed held throughout (else the copy may be of reused blocks: raise)."""
        timeout = self.config.pull_timeout
        message = {"request_id": remote.request_id, "block_ids": block_ids, "seconds": timeout}
        pinned = self._answer_ok(self._request(sock, [b"pin", json.dumps(message).encode()], timeout), remote)
        unpin = [b"unpin", json.dumps({"request_id": remote.request_id}).encode()]
        if pinned.get("token") != region.token:  # the producer restarted on the same port since we mapped it
            self._request(sock, unpin, timeout)
            raise RuntimeError("the prefill instance's shared memory changed (a restart?); mapping it again")
        self._copy_shared(region, block_ids, local_block_ids[:len(block_ids)])
        self._answer_ok(self._request(sock, unpin, timeout), remote)

    @staticmethod
    def _answer_ok(frames: list[bytes], remote: RemotePrefill) -> dict[str, Any]:
        header = json.loads(frames[0])
        if header.get("request_id") != remote.request_id:
            raise RuntimeError(f"answer for {header.get('request_id')!r}, asked for {remote.request_id!r}")
        if not header.get("ok"):
            raise RuntimeError(header.get("error", "refused"))
        return header

    def _pull(self, sock: zmq.Socket, remote: RemotePrefill, block_ids: list[int]) -> list[bytes]:
        timeout = self.config.pull_timeout
        message = json.dumps({"request_id": remote.request_id, "block_ids": block_ids}).encode()
        if not block_ids:  # every block was in this instance's prefix cache: let the producer free its own
            self._request(sock, [b"release", message], timeout)
            return []
        frames = self._request(sock, [b"pull", message], timeout)
        self._answer_ok(frames, remote)
        payloads = frames[1:]
        if len(payloads) != len(block_ids) or any(len(p) != self.bytes_per_block for p in payloads):
            raise RuntimeError(f"{len(payloads)} blocks of {[len(p) for p in payloads][:3]} bytes, expected "
                               f"{len(block_ids)} of {self.bytes_per_block}")
        return [bytes(p) for p in payloads]

    # ----- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self.is_consumer:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=2)
        self._ctx.destroy(linger=0)
