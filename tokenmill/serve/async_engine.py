"""Runs an LLMEngine in its own thread and connects it to asyncio request handlers.

The engine thread loops: apply the queued commands (add, abort), run one
`engine.step()` while there is work, hand the step's outputs to the event loop,
and sleep on a condition variable when there is none. Handlers never touch the
engine: they queue commands and await results, so HTTP handling does not wait
for a step to end, and a step does not wait for HTTP.

Why a thread and not a process. The step's heavy work is in torch kernels,
which release the GIL, so the event loop runs while the engine computes; what
holds the GIL is the runner's glue, the scheduler and the detokenizer (outside
the runner: 0.4% of a 32-sequence decode step on CPU) and, on the other side,
JSON encoding of events. A process
would free those from sharing one GIL, but every step's outputs (cumulative
token ids, text and logprobs for every running request) would then be pickled
across a pipe, the model and tokenizer would live in another address space
(the HTTP side needs the tokenizer for admission checks, /tokenize and chat
templates), and a crash or a SIGTERM would need two processes coordinated.
Measured on the 2-core CPU box (SmolLM2-135M, float32, one torch thread, with
other jobs loading the machine, so the numbers are noisy): 32 streams of 32
tokens took 14-22 s through the server against 16-21 s for the bare engine
loop, i.e. the thread, the event loop and SSE cost nothing measurable; while
those streams decoded, /health answered in 6-9 ms median (25 ms p99) against
5 ms idle, so a step never blocks the event loop. Polling /health at ~60
requests/s during the run slowed the streams by up to ~50%: that is the CPU
the HTTP work takes on a box with no spare core, which a separate process
would spend as well, plus pickling every step's outputs.
(vLLM moved its engine core to a process to overlap CPU-heavy scheduling with
GPU work at hundreds of requests; that is the point to revisit this.)

Outputs are cumulative (all token ids, text and logprobs so far), so a consumer
that falls behind only needs the newest output of each request: a group's channel
holds one pending output per request, and a new one replaces the one not yet
taken. What a client that stops reading costs is therefore one output per request,
whatever the step count (an unbounded queue of cumulative copies grew as
n x max_tokens^2: +339 MB for one n=16, 1,500-token, logprobs=5 stream, issue 31);
the HTTP side's send timeout then aborts the request (serving.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenmill.engine.engine import EngineStats, LLMEngine, StepObserver
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_CHECK_S = 1.0  # how often an idle engine thread asks its executor whether its ranks are alive


class EngineUnavailableError(RuntimeError):
    """The engine is loading, shutting down, or dead: retry elsewhere or later (503)."""


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests (429)."""


class QueueTimeoutError(EngineUnavailableError):
    """The request waited in the queue longer than --max-queue-wait-s (503)."""


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0
    slo: tuple[float | None, float | None] = (None, None)  # (TTFT, TPOT) targets in ms
    pooling_params: PoolingParams | None = None  # an embedding (the pooling runner's)
    kv_transfer_params: dict | None = None  # prefill-decode disaggregation (vLLM's field)


@dataclass
class _Add:
    requests: list[NewRequest]
    done: concurrent.futures.Future[None]


@dataclass
class _Reset:
    done: concurrent.futures.Future[bool]  # whether the prefix cache was reset


@dataclass
class _Abort:
    request_ids: list[str]
    notify: bool = False  # hand the final outputs to their streams (a drain); else nobody listens


class _Channel:
    """Where the event loop puts a group's outputs: at most one pending output per
    request of the group (the newest; outputs are cumulative). The engine's table
    holds this, not the OutputStream, so a stream its handler dropped can be
    garbage-collected. Event loop thread only."""

    def __init__(self) -> None:
        self.pending: dict[int, RequestOutput] = {}  # index in the group -> newest output
        self.error: BaseException | None = None
        self._news = asyncio.Event()

    def put(self, index: int, output: RequestOutput) -> None:
        self.pending[index] = output  # replaces an older output nobody took
        self._news.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._news.set()

    async def take(self) -> dict[int, RequestOutput]:
        """Wait for news; the newest output of each request that progressed (or raise
        the group's error)."""
        await self._news.wait()
        self._news.clear()
        if self.error is not None:
            raise self.error
        taken, self.pending = self.pending, {}
        return taken


class OutputStream:
    """The outputs of a group of engine requests (one per prompt of an HTTP request).

    Iterating yields batches of (index in the group, newest output), ending once every
    request in the group has finished. A stream dropped before that aborts the rest of
    its requests, so no exit path of a handler can leave work running for nobody.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.channel = _Channel()
        self._unfinished = set(range(len(request_ids)))
        # Not a method of self: the finalizer must not keep the stream alive.
        self._finalizer = weakref.finalize(self, engine.abort, list(request_ids))
        self._finalizer.atexit = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def get(self) -> list[tuple[int, RequestOutput]]:
        """Wait for news; return the newest output of each request that progressed."""
        try:
            newest = await self.channel.take()
        except BaseException:
            self.abort()
            raise
        for index, output in newest.items():
            if output.finished:
                self._unfinished.discard(index)
        if self.finished:
            self._finalizer.detach()
        return list(newest.items())

    def __aiter__(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        while not self.finished:
            yield await self.get()

    def abort(self) -> None:
        """Abort the requests that have not finished (idempotent)."""
        if self._finalizer.alive:
            self._finalizer()


class AsyncEngine:
    """Owns the engine thread. Methods are called from the event loop thread unless
    they say otherwise."""

    def __init__(
        self,
        build_engine: Callable[[], LLMEngine],
        *,
        max_queued_requests: int | None = None,
        max_queue_wait: float | None = None,
        stall_timeout: float = 60.0,
        observers: list[StepObserver] = (),
        on_fatal: Callable[[BaseException], None] | None = None,
        before_step: Callable[[], None] | None = None,
    ) -> None:
        """`before_step` runs on the engine thread before every step (fault injection)."""
        self._build_engine = build_engine
        self._max_queued = max_queued_requests
        self._max_queue_wait = max_queue_wait
        self._stall_timeout = stall_timeout
        self._before_step = before_step
        self._observers = list(observers)  # attached to the engine once it is built
        self._on_fatal = on_fatal
        self.engine: LLMEngine | None = None
        self.state = EngineState.LOADING
        self.stats: EngineStats | None = None  # refreshed by the engine thread each iteration
        self.loaded = threading.Event()

        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Reset] = []
        self._stop_requested = False
        self._busy = False  # the thread has work (or is loading); read by health()
        self._heartbeat = time.monotonic()  # last time the thread showed progress
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, tuple[_Channel, int]] = {}  # event loop thread only

    # ----- lifecycle -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the thread; it loads the model first (health says 'loading' meanwhile)."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests (503), let the admitted ones finish within `timeout`, then
        abort what is left: each gets its final output, finish_reason "abort". Returns
        False when the engine could not do that (dead or stuck): then the waiters were
        failed from here, with EngineUnavailableError."""
        if self.state in (EngineState.READY, EngineState.LOADING):
            self.state = EngineState.STOPPING
        deadline = time.monotonic() + timeout
        while self._has_work() and time.monotonic() < deadline and self._thread_alive():
            await asyncio.sleep(0.05)
        if not self._streams:
            return self.state != EngineState.DEAD
        logger.warning("drain timeout (%.0f s) reached: aborting %d unfinished requests", timeout, len(self._streams))
        self._submit(_Abort(list(self._streams), notify=True))
        grace = time.monotonic() + 2.0  # one step, unless the engine is stuck
        while self._streams and time.monotonic() < grace and self._thread_alive():
            await asyncio.sleep(0.02)
        if not self._streams:
            return self.state != EngineState.DEAD
        logger.error("the engine did not abort its requests: failing %d of them from the server", len(self._streams))
        self._fail_streams(list(self._streams), EngineUnavailableError("the server is shutting down"))
        return False

    async def shutdown(self, timeout: float) -> None:
        """Drain within `timeout` (see drain), then stop the engine thread."""
        await self.drain(timeout)
        deadline = time.monotonic() + 1.0
        with self._cond:
            self._stop_requested = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, max(1.0, deadline - time.monotonic()))
        if self.state != EngineState.DEAD:
            self.state = EngineState.STOPPED

    def health(self) -> tuple[bool, str]:
        """(healthy, reason). Healthy means: loaded, thread alive, and either idle or
        completing steps (no step has been stuck for more than the stall timeout)."""
        if self.state == EngineState.LOADING:
            return False, "the model is loading"
        if self.state == EngineState.DEAD or not self._thread_alive():
            return False, "the engine loop has died"
        if self.state in (EngineState.STOPPING, EngineState.STOPPED):
            return False, "the server is shutting down"
        stalled_for = time.monotonic() - self._heartbeat
        if self._busy and stalled_for > self._stall_timeout:
            return False, f"the engine has work but completed no step in {stalled_for:.0f} s"
        return True, "ok"

    @property
    def num_active_streams(self) -> int:
        """Engine requests whose handlers still wait for outputs."""
        return len(self._streams)

    @property
    def num_pending_outputs(self) -> int:
        """Outputs of running requests made by the engine and not yet taken by their
        handlers: at most one per request, however far behind a client is."""
        channels = {id(channel): channel for channel, _ in self._streams.values()}
        return sum(len(channel.pending) for channel in channels.values())

    # ----- requests --------------------------------------------------------------------

    async def add_requests(self, requests: list[NewRequest]) -> OutputStream:
        """Queue requests as one group: all are admitted or none (the first error is
        raised: ValueError for bad input, QueueFullError, EngineUnavailableError)."""
        self._check_available()
        stream = OutputStream(self, [r.request_id for r in requests])
        for index, request in enumerate(requests):
            self._streams[request.request_id] = (stream.channel, index)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Add(requests, done))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            # Rejected (nothing was queued) or the handler was cancelled (abort what was).
            for request in requests:
                self._streams.pop(request.request_id, None)
            stream.abort()
            raise
        return stream

    async def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache (pool and host tier) on the engine thread; False while
        requests hold KV blocks."""
        self._check_available()
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._submit(_Reset(done))
        return await asyncio.wrap_future(done)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; safe from any thread (an OutputStream finalizer may call it)."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        self._submit(_Abort(list(request_ids)))

    # ----- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        self._busy = True
        try:
            self.engine = self._build_engine()
        except BaseException as exc:  # noqa: BLE001 - reported, and the server exits
            logger.exception("failed to load the engine")
            self._die(exc)
            return
        for observer in self._observers:
            self.engine.add_observer(observer)
        self.stats = self.engine.stats()
        if self.state == EngineState.LOADING:
            self.state = EngineState.READY
        self.loaded.set()
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    break
                self._apply(commands)
                self._expire_queued()
                if self.engine.has_unfinished_requests():
                    self._step()
                self.stats = self.engine.stats()
                self._heartbeat = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
            logger.exception("the engine loop failed")
            self._die(exc)
            return
        self._abort_everything()

    def _wait_for_work(self) -> list[_Add | _Abort | _Reset] | None:
        """Block while idle; return the queued commands, or None when told to stop."""
        assert self.engine is not None
        with self._cond:
            while not self._commands and not self.engine.has_unfinished_requests() and not self._stop_requested:
                self._busy = False
                self._cond.wait(IDLE_CHECK_S)
                self._check_executor()
                if self.engine.poll_kv_transfers():  # disaggregation: holds pulled or timed out are freed
                    self.stats = self.engine.stats()
            self._heartbeat = time.monotonic()  # waking from idle is not a stall
            self._busy = True
            if self._stop_requested:
                return None
            commands, self._commands = self._commands, []
            self.engine.offers_taken_in()  # (under the queue's lock: see engine/interrupt.py)
        return commands

    def _check_executor(self) -> None:
        """An executor of other processes (tensor/pipeline-parallel ranks) raises here when
        one is gone: checked while idle too, so /health fails and the server exits as when a
        rank dies under load, instead of answering 200 until the next request."""
        check_health = getattr(getattr(self.engine, "executor", None), "check_health", None)
        if check_health is not None:
            check_health()

    def _apply(self, commands: list[_Add | _Abort | _Reset]) -> None:
        for command in commands:
            if isinstance(command, _Reset):
                if command.done.set_running_or_notify_cancel():
                    command.done.set_result(self.engine.reset_prefix_cache())
                continue
            if isinstance(command, _Abort):
                outputs = self._abort_in_thread(command.request_ids)
                if command.notify and outputs:
                    self._call_in_loop(self._dispatch, outputs)
            else:
                self._add_in_thread(command)

    def _expire_queued(self) -> None:
        """Abort the requests that waited longer than --max-queue-wait-s without being
        scheduled; their handlers answer 503."""
        if self._max_queue_wait is None:
            return
        assert self.engine is not None
        expired = self.engine.requests_queued_since(time.monotonic() - self._max_queue_wait)
        if expired:
            self._abort_in_thread(expired)
            error = QueueTimeoutError(
                f"the request waited more than {self._max_queue_wait:g} s in the queue; the server is "
                "overloaded, retry later")
            self._call_in_loop(self._fail_streams, expired, error)

    def _add_in_thread(self, command: _Add) -> None:
        assert self.engine is not None
        added: list[str] = []
        try:
            if command.done.cancelled():
                return
            self._check_queue_room(command.requests)
            for request in command.requests:
                self.engine.add_request(
                    request.request_id, request.prompt_token_ids, request.params,
                    arrival_time=request.arrival_time, priority=request.priority,
                    slo_ttft_ms=request.slo[0], slo_tpot_ms=request.slo[1], pooling_params=request.pooling_params,
                    kv_transfer_params=request.kv_transfer_params,
                )
                added.append(request.request_id)
        except Exception as exc:  # noqa: BLE001 - goes back to the handler
            for request_id in added:  # all or nothing; no step ran in between
                self.engine.abort_request(request_id)
            _set_future(command.done, exc)
            return
        if not _set_future(command.done, None):
            self._abort_in_thread(added)  # the handler gave up while we were adding

    def _likely_queued(self, requests: list[NewRequest]) -> bool:
        """Whether the engine thread will find room for these in the waiting queue, by the
        last stats it published (read on the event loop): one refused with a 429 must not
        cut the step in flight."""
        if self._max_queued is None or self.stats is None:
            return True
        return self.stats.num_waiting + sum(r.params.n for r in requests) <= self._max_queued

    def _check_queue_room(self, requests: list[NewRequest]) -> None:
        if self._max_queued is None:
            return
        assert self.engine is not None
        waiting = self.engine.stats().num_waiting
        incoming = sum(r.params.n for r in requests)
        if incoming > self._max_queued:  # a 429 would say "retry later" to one that never fits
            raise ValueError(
                f"the request asks for {incoming} sequences, more than the server's waiting queue can hold "
                f"(--max-queued-requests {self._max_queued}); it can never be admitted: lower n or send fewer prompts")
        if waiting + incoming > self._max_queued:
            raise QueueFullError(
                f"the server is busy: {waiting} requests are waiting (limit {self._max_queued}); retry later"
            )

    def _abort_in_thread(self, request_ids: list[str]) -> list[RequestOutput]:
        assert self.engine is not None
        outputs = []
        for request_id in request_ids:
            output = self.engine.abort_request(request_id)  # the engine tells its observers
            if output is not None:
                outputs.append(output)
        return outputs

    def _step(self) -> None:
        assert self.engine is not None
        if self._before_step is not None:
            self._before_step()
        outputs = self.engine.step()
        if outputs:
            self._call_in_loop(self._dispatch, outputs)

    def _abort_everything(self) -> None:
        """At stop: whatever is still running is aborted and its waiters told."""
        assert self.engine is not None
        outputs = []
        for request_id in list(self._streams):
            output = self.engine.abort_request(request_id)
            if output is not None:
                outputs.append(output)
        if outputs:
            self._call_in_loop(self._dispatch, outputs)
        self.stats = self.engine.stats()

    def _die(self, error: BaseException) -> None:
        self.state = EngineState.DEAD
        self.loaded.set()
        self._call_in_loop(self._fail_all, error)
        if self._on_fatal is not None:
            self._on_fatal(error)

    # ----- event loop side ---------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            entry = self._streams.get(output.request_id)
            if entry is None:
                continue  # aborted by its handler meanwhile
            channel, index = entry
            channel.put(index, output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_streams(self, request_ids: list[str], error: BaseException) -> None:
        """Fail the groups of these requests (each group once); their handlers answer."""
        channels = {}
        for request_id in request_ids:
            entry = self._streams.pop(request_id, None)
            if entry is not None:
                channels[id(entry[0])] = entry[0]
        for channel in channels.values():
            channel.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        # The exception's text stays in the log: it may name files and internals.
        failure = EngineUnavailableError(
            f"the engine failed ({type(error).__name__}); see the server log. No request can be served")
        self._fail_streams(list(self._streams), failure)
        with self._cond:
            commands, self._commands = self._commands, []
        for command in commands:
            if isinstance(command, (_Add, _Reset)):
                _set_future(command.done, failure)

    # ----- helpers -----------------------------------------------------------------------

    def check_available(self) -> None:
        """Raise EngineUnavailableError unless new requests are accepted now."""
        self._check_available()

    def _check_available(self) -> None:
        if self.state == EngineState.LOADING:
            raise EngineUnavailableError("the model is still loading; retry shortly")
        if self.state == EngineState.STOPPING:
            raise EngineUnavailableError("the server is shutting down; no new requests are accepted")
        if self.state != EngineState.READY or not self._thread_alive():
            raise EngineUnavailableError(f"the engine is {self.state.value}; no new requests are accepted")
        healthy, reason = self.health()
        if not healthy:
            raise EngineUnavailableError(f"the server is unhealthy ({reason}); retry elsewhere or later")

    def _submit(self, command: _Add | _Abort | _Reset) -> None:
        with self._cond:
            if self.state == EngineState.DEAD:
                if isinstance(command, (_Add, _Reset)):
                    _set_future(command.done, EngineUnavailableError("the engine has died"))
                return
            self._commands.append(command)
            if isinstance(command, _Add) and self.engine is not None and self._likely_queued(command.requests):
                for request in command.requests:  # --priority-interrupt: a worse-ranked step in flight is cut
                    self.engine.offer_interrupt(request.priority, request.arrival_time)
            self._cond.notify()

    def _has_work(self) -> bool:
        with self._cond:
            queued = bool(self._commands)
        return queued or bool(self._streams) or (self.stats is not None and
                                                 (self.stats.num_running + self.stats.num_waiting) > 0)

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _call_in_loop(self, callback: Callable, *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed between the check and the call
            pass


def _set_future(future: concurrent.futures.Future[None], result: BaseException | None) -> bool:
    """Resolve a future unless its waiter cancelled it; False when it had."""
    if not future.set_running_or_notify_cancel():
        return False
    if result is None:
        future.set_result(None)
    else:
        future.set_exception(result)
    return True
