"""The dashboard's view of the engine: snapshots built on the engine thread, published
to the event loop.

`DashboardObserver` is a `StepObserver`. After a step it appends the step's composition
to a ring buffer (always: a few integers), and builds a full snapshot (the KV block
map, the running and waiting requests, counters) only when it is due: at most
`max_rate_hz` times a second while a page is subscribed, and always when the step
leaves the engine idle (or an abort does), so the last snapshot of a burst is the
engine's resting state. A snapshot is built on the engine thread, the only place the
scheduler and the block manager are consistent, and then only handed over: JSON
encoding and sending happen on the event loop. With no page open the engine pays for
the ring buffer and one snapshot per idle transition, nothing else.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.block_manager import NULL_BLOCK, HybridKVBlockManager, KVBlockManager
from tokenmill.engine.engine import LLMEngine, StepObserver, StepRecord
from tokenmill.engine.request import Request
from tokenmill.outputs import RequestOutput

# One character per KV block in the snapshot's block map.
FREE = "F"  # free, holds nothing reusable
CACHED_FREE = "C"  # free, but still holds a prefix-cache entry (revived on a hit, evicted LRU)
USED = "U"  # held by one request, no cache entry (a partly filled or duplicate block)
USED_CACHED = "H"  # held by one request and in the prefix cache (a full block)
SHARED = "S"  # held by more than one request: a shared prefix
RESERVED = "N"  # never handed out (a sliding-window pool's NULL_BLOCK)

MAX_LISTED_REQUESTS = 200  # per list; the counts stay exact beyond it
HASH_HEX_CHARS = 12


@dataclass
class StepRow:
    """One step's composition, as the page draws it."""

    index: int
    started: float  # engine clock (time.monotonic in a server)
    duration_ms: float
    prefill_tokens: int
    decode_tokens: int
    generated: int
    spec_accepted: int
    spec_rejected: int
    running: int
    waiting: int
    preempted: int

    def as_list(self) -> list[float | int]:
        return [self.index, round(self.started, 4), round(self.duration_ms, 2), self.prefill_tokens,
                self.decode_tokens, self.generated, self.spec_accepted, self.spec_rejected, self.running,
                self.waiting, self.preempted]


STEP_FIELDS = ["index", "started", "duration_ms", "prefill_tokens", "decode_tokens", "generated",
               "spec_accepted", "spec_rejected", "running", "waiting", "preempted"]


class DashboardObserver(StepObserver):
    def __init__(self, engine: Callable[[], LLMEngine | None], max_rate_hz: float = 4.0,
                 num_steps: int = 120, num_finished: int = 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._clock = clock
        self.num_builds = 0  # snapshots built on the engine thread (tests check the rate limit)
        self._interval = 1.0 / max_rate_hz
        self._steps: deque[StepRow] = deque(maxlen=num_steps)
        self._finished: deque[dict[str, Any]] = deque(maxlen=num_finished)
        self._seq = itertools.count(1)
        self._last_build = float("-inf")
        self._lock = threading.Lock()  # guards the subscriber set and the loop between threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self.latest: dict[str, Any] | None = None  # replaced whole, never mutated: safe to read anywhere

    # ----- StepObserver (engine thread) ---------------------------------------------------

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        spec = record.spec_decode
        accepted = spec.num_accepted_tokens if spec else 0
        self._steps.append(StepRow(
            record.index, record.started, record.duration_s * 1e3, record.num_prefill_tokens,
            record.num_decode_tokens, record.num_generated, accepted,
            (spec.num_draft_tokens - accepted) if spec else 0, record.num_running, record.num_waiting,
            len(record.preempted_ids)))
        for output in outputs:
            if output.finished:
                self._finished.appendleft(_finished_row(output))
        idle = record.num_running == 0 and record.num_waiting == 0
        self._maybe_build(force=idle)

    def on_aborted(self, output: RequestOutput) -> None:
        self._finished.appendleft(_finished_row(output))
        engine = self._engine()
        self._maybe_build(force=engine is not None and not engine.has_unfinished_requests())

    # ----- subscribers (event loop) --------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        """A queue that receives each new snapshot (only the newest is kept if the page
        falls behind)."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1)
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        with self._lock:
            self._subscribers.discard(queue)

    def current(self) -> dict[str, Any] | None:
        """The newest snapshot. Before the engine thread has built one (no idle moment and
        no page since the start), one is built here, off the engine thread: good enough
        for a first frame, replaced by the engine thread's next one (the caller has
        subscribed first), and never kept. None if the engine changed it mid-read."""
        if self.latest is not None:
            return self.latest
        engine = self._engine()
        if engine is None:
            return None
        try:
            return self._build(engine)
        except RuntimeError:  # a dict or deque changed size while read
            return None

    # ----- internals -----------------------------------------------------------------------

    def _maybe_build(self, force: bool) -> None:
        now = self._clock()
        with self._lock:
            watched = bool(self._subscribers)
        if not force and not (watched and now - self._last_build >= self._interval):
            return
        engine = self._engine()
        if engine is None:
            return
        self._last_build = now
        self.num_builds += 1
        snapshot = self._build(engine)
        self.latest = snapshot
        if watched:
            with self._lock:
                loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._publish, snapshot)
                except RuntimeError:  # the loop closed meanwhile (shutdown)
                    pass

    def _publish(self, snapshot: dict[str, Any]) -> None:  # event loop
        with self._lock:
            subscribers = list(self._subscribers)
        for queue in subscribers:
            if queue.full():  # a slow page: drop its unsent snapshot, the new one supersedes it
                queue.get_nowait()
            queue.put_nowait(snapshot)

    def _build(self, engine: LLMEngine) -> dict[str, Any]:
        scheduler = engine.scheduler
        waiting = list(scheduler.waiting)
        running = list(scheduler.running)
        return {
            "seq": next(self._seq),
            "now": self._clock(),
            "model": engine.model_name,
            **kv_maps(scheduler.kv),
            "requests": {
                "num_running": len(running),
                "num_waiting": len(waiting),
                "num_preempted": sum(1 for r in waiting if r.num_preemptions),
                "running": [_request_row(r, scheduler.kv, "running") for r in running[:MAX_LISTED_REQUESTS]],
                "waiting": [_request_row(r, scheduler.kv, "preempted" if r.num_preemptions else "waiting")
                            for r in waiting[:MAX_LISTED_REQUESTS]],
            },
            "finished": list(self._finished),
            "step_fields": STEP_FIELDS,
            "steps": [row.as_list() for row in self._steps],
            "counters": {
                "num_steps": engine.num_steps,
                "prompt_tokens_computed": engine.num_prompt_tokens,
                "generation_tokens": engine.num_generation_tokens,
                "num_preemptions": scheduler.num_preemptions,
                "spec_draft_tokens": engine.spec_decode_stats.num_draft_tokens,
                "spec_accepted_tokens": engine.spec_decode_stats.num_accepted_tokens,
            },
        }


def kv_maps(kv: KVBlockManager | HybridKVBlockManager) -> dict[str, Any]:
    """`kv`: the block map of the (full-attention) pool, with the manager's usage (what
    /metrics exports: with a hybrid cache, the fuller of its two pools); with a hybrid
    cache also `kv_sliding`, the sliding-window layers' pool."""
    if isinstance(kv, HybridKVBlockManager):
        return {"kv": {**block_map(kv.full), "usage": kv.usage}, "kv_sliding": block_map(kv.sliding)}
    return {"kv": block_map(kv)}


def block_map(pool: KVBlockManager) -> dict[str, Any]:
    """Counts from `KVBlockManager.snapshot()` plus one state character per block, the
    short hash of every cached block and the block table of every request."""
    counts = pool.snapshot()
    states = []
    hashes: dict[int, str] = {}
    num_shared = 0
    for block in pool.blocks:
        if block.block_hash is not None:
            hashes[block.block_id] = block.block_hash[: HASH_HEX_CHARS // 2].hex()
        if block.ref_count == 0:
            if block.block_id not in pool.free_queue:
                states.append(RESERVED)
            else:
                states.append(FREE if block.block_hash is None else CACHED_FREE)
        elif block.ref_count > 1:
            states.append(SHARED)
            num_shared += 1
        else:
            states.append(USED if block.block_hash is None else USED_CACHED)
    # A sliding pool's tables hold NULL_BLOCK where blocks were let go: not a holder.
    skip = NULL_BLOCK if pool.reserves_null else None
    return {
        "num_blocks": counts.num_blocks,
        "block_size": counts.block_size,
        "num_used": pool.num_usable_blocks - counts.num_free,
        "num_free": counts.num_free,
        "num_reserved": counts.num_blocks - pool.num_usable_blocks,
        "num_cached_free": counts.num_cached_free,
        "num_cached": counts.num_cached,
        "num_shared": num_shared,
        "usage": pool.usage,
        "prefix_cache_queries": counts.prefix_cache_queries,
        "prefix_cache_hits": counts.prefix_cache_hits,
        "states": "".join(states),
        "hashes": hashes,
        "owners": {rid: [b for b in blocks if b != skip] for rid, blocks in pool.req_blocks.items()},
    }


def _request_row(request: Request, kv: KVBlockManager, state: str) -> dict[str, Any]:
    return {
        "id": request.request_id,
        "state": state,
        "prompt_tokens": request.num_prompt_tokens,
        "computed_tokens": request.num_computed_tokens,
        "output_tokens": request.num_output_tokens,
        "max_tokens": request.max_tokens,
        "cached_tokens": request.num_cached_tokens,
        "preemptions": request.num_preemptions,
        "priority": request.priority,  # under --scheduling-policy priority: lower first
        "blocks": len(kv.get_block_ids(request.request_id)),
    }


def _finished_row(output: RequestOutput) -> dict[str, Any]:
    metrics = output.metrics
    ttft = e2e = None
    if metrics is not None:
        if metrics.first_token_time is not None:
            ttft = metrics.first_token_time - metrics.arrival_time
        if metrics.finished_time is not None:
            e2e = metrics.finished_time - metrics.arrival_time
    reasons = sorted({c.finish_reason or "abort" for c in output.outputs}) or ["abort"]
    return {
        "id": output.request_id,
        "finish_reason": ",".join(reasons),
        "prompt_tokens": len(output.prompt_token_ids),
        "output_tokens": sum(len(c.token_ids) for c in output.outputs),
        "cached_tokens": output.num_cached_tokens,
        "ttft_s": ttft,
        "e2e_s": e2e,
    }
