"""AsyncEngine (the engine thread behind the server) against a fake engine: fast,
no model. The HTTP tests in test_server*.py run it with the real one."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from tokenmill.engine.engine import EngineStats, StepObserver
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling.params import SamplingParams
from tokenmill.serve.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    NewRequest,
    QueueFullError,
    QueueTimeoutError,
)


class FakeEngine:
    """One token per step per running request; at most `max_running` run, the rest wait."""

    model_name = "fake"
    max_model_len = 64
    vocab_size = 100

    def __init__(self, step_delay: float = 0.0, max_running: int = 8, fail_on_step: int | None = None) -> None:
        self.step_delay = step_delay
        self.max_running = max_running
        self.fail_on_step = fail_on_step
        self.requests: dict[str, tuple[SamplingParams, list[int]]] = {}
        self.arrivals: dict[str, float] = {}
        self.scheduled: set[str] = set()
        self.hang = threading.Event()  # set: every step blocks until it is cleared
        self.steps = 0
        self.thread_ids: set[int] = set()
        self.observers: list[StepObserver] = []
        self.offers: list[tuple[int, float]] = []  # --priority-interrupt's offers, as the server made them

    def add_observer(self, observer: StepObserver) -> None:
        self.observers.append(observer)

    def add_request(self, request_id, prompt, params, *, arrival_time=None, **_):
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if any(t >= self.vocab_size for t in prompt):
            raise ValueError("prompt token id out of the vocabulary")
        self.requests[request_id] = (params, [])
        self.arrivals[request_id] = arrival_time or time.monotonic()

    def requests_queued_since(self, arrived_before):
        return [rid for rid in self.requests if rid not in self.scheduled and self.arrivals[rid] < arrived_before]

    def abort_request(self, request_id):
        entry = self.requests.pop(request_id, None)
        output = None if entry is None else self._output(request_id, entry[1], "abort")
        for observer in self.observers if output is not None else ():
            observer.on_aborted(output)
        return output

    def has_unfinished_requests(self):
        return bool(self.requests)

    def poll_kv_transfers(self):  # no disaggregation here: nothing held, nothing pulled
        return False

    def offer_interrupt(self, priority, arrival_time):  # recorded; no step is cut here
        self.offers.append((priority, arrival_time))
        return False

    def offers_taken_in(self):
        pass

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("boom")
        time.sleep(self.step_delay)
        while self.hang.is_set():
            time.sleep(0.01)
        outputs = []
        for request_id in list(self.requests)[: self.max_running]:
            self.scheduled.add(request_id)
            params, tokens = self.requests[request_id]
            tokens.append(len(tokens) + 1)
            done = len(tokens) >= params.max_tokens
            if done:
                del self.requests[request_id]
            outputs.append(self._output(request_id, tokens, "length" if done else None))
        return outputs

    def stats(self):
        running = min(len(self.requests), self.max_running)
        return EngineStats(num_running=running, num_waiting=len(self.requests) - running, kv_usage=0.0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                           num_generation_tokens=0, num_steps=self.steps)

    @staticmethod
    def _output(request_id, tokens, finish):
        comp = CompletionOutput(0, "x" * len(tokens), list(tokens), finish_reason=finish)
        return RequestOutput(request_id, None, [1], [comp], finished=finish is not None,
                             metrics=RequestMetrics(arrival_time=time.monotonic()))


class RecordingObserver(StepObserver):
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def on_aborted(self, output: RequestOutput) -> None:
        self.aborted.append(output.request_id)


def params(max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


async def started(fake: FakeEngine, **kwargs) -> AsyncEngine:
    engine = AsyncEngine(lambda: fake, **kwargs)
    engine.start(asyncio.get_running_loop())
    await asyncio.to_thread(engine.loaded.wait, 5)
    return engine


async def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_outputs_reach_the_stream_from_the_engine_thread():
    async def scenario():
        fake = FakeEngine()
        engine = await started(fake)
        stream = await engine.add_requests([NewRequest("a", [1, 2], params(4))])
        seen = []
        async for batch in stream:
            seen.extend(out for _, out in batch)
        assert seen[-1].finished and seen[-1].outputs[0].token_ids == [1, 2, 3, 4]
        assert threading.get_ident() not in fake.thread_ids  # the engine never ran on the loop
        await engine.shutdown(5)

    asyncio.run(scenario())


def test_a_consumer_that_stops_taking_outputs_holds_one_pending_output_per_request():
    """Issue 31: a stalled stream reader used to queue every step's cumulative output
    (O(n x max_tokens^2) memory); the channel keeps only the newest per request."""
    async def scenario():
        fake = FakeEngine()
        engine = await started(fake)
        stream = await engine.add_requests([NewRequest("a", [1], params(200)), NewRequest("b", [1], params(200))])
        await wait_for(lambda: fake.steps >= 50)  # 50 steps' outputs made, none taken
        await asyncio.sleep(0.05)  # let the loop run the dispatches of those steps
        assert engine.num_pending_outputs <= 2
        assert len(stream.channel.pending) <= 2
        finals = {}
        async for batch in stream:  # the reader comes back: it gets the newest, then the rest
            finals.update(batch)
        assert [finals[i].outputs[0].token_ids[-1] for i in (0, 1)] == [200, 200]
        assert engine.num_pending_outputs == 0
        await engine.shutdown(5)

    asyncio.run(scenario())


def test_a_request_larger_than_the_whole_queue_is_a_value_error_not_queue_full():
    """Issue 31: n alone over --max-queued-requests got 429 "retry later" forever."""
    async def scenario():
        engine = await started(FakeEngine(), max_queued_requests=4)
        with pytest.raises(ValueError, match="can never be admitted"):
            await engine.add_requests([NewRequest("a", [1], SamplingParams(n=5, max_tokens=2))])
        stream = await engine.add_requests([NewRequest("b", [1], SamplingParams(n=4, max_tokens=2))])
        async for _ in stream:
            pass
        await engine.shutdown(5)

    asyncio.run(scenario())


def test_a_bad_request_is_refused_and_nothing_of_its_group_stays_queued():
    async def scenario():
        fake = FakeEngine()
        engine = await started(fake)
        with pytest.raises(ValueError, match="empty"):
            await engine.add_requests([NewRequest("ok", [1], params()), NewRequest("bad", [], params())])
        assert fake.requests == {}  # the good one was taken back
        await engine.shutdown(5)

    asyncio.run(scenario())


def test_abort_and_a_dropped_stream_both_stop_the_request():
    async def scenario():
        fake = FakeEngine(step_delay=0.01)
        observer = RecordingObserver()
        engine = await started(fake, observers=[observer])
        stream = await engine.add_requests([NewRequest("a", [1], params(1000))])
        await stream.get()
        stream.abort()
        await wait_for(lambda: "a" not in fake.requests)

        dropped = await engine.add_requests([NewRequest("b", [1], params(1000))])
        await dropped.get()
        del dropped
        gc.collect()
        await wait_for(lambda: "b" not in fake.requests)
        assert observer.aborted == ["a", "b"]
        await engine.shutdown(5)

    asyncio.run(scenario())


def test_a_full_waiting_queue_refuses_new_requests():
    async def scenario():
        fake = FakeEngine(step_delay=0.01, max_running=1)
        engine = await started(fake, max_queued_requests=1)
        streams = [await engine.add_requests([NewRequest("run", [1], params(1000))])]
        await wait_for(lambda: engine.stats is not None and engine.stats.num_running == 1)
        streams.append(await engine.add_requests([NewRequest("wait", [1], params(1000))]))
        await wait_for(lambda: engine.stats.num_waiting == 1)
        with pytest.raises(QueueFullError):
            await engine.add_requests([NewRequest("refused", [1], params(1000))])
        assert len(fake.offers) == 2, "a request refused for a full queue offered to cut the step in flight"
        for stream in streams:
            stream.abort()
        await wait_for(lambda: not fake.requests)
        await engine.shutdown(5)

    asyncio.run(scenario())


def test_health_follows_loading_stalls_and_death():
    async def scenario():
        release = threading.Event()

        def slow_build():
            release.wait(5)
            return FakeEngine(step_delay=0.5)

        engine = AsyncEngine(slow_build, stall_timeout=0.2)
        engine.start(asyncio.get_running_loop())
        assert engine.health() == (False, "the model is loading")
        with pytest.raises(EngineUnavailableError):
            await engine.add_requests([NewRequest("early", [1], params())])
        release.set()
        await asyncio.to_thread(engine.loaded.wait, 5)
        assert engine.health() == (True, "ok")
        stream = await engine.add_requests([NewRequest("slow", [1], params(2))])
        await asyncio.sleep(0.35)  # inside a 0.5 s step, past the 0.2 s stall limit
        ok, reason = engine.health()
        assert not ok and "no step" in reason
        async for _ in stream:
            pass
        await wait_for(lambda: engine.health()[0])  # idle again: healthy
        await engine.shutdown(5)
        assert not engine.health()[0]

    asyncio.run(scenario())


def test_an_engine_failure_fails_waiters_and_health():
    async def scenario():
        fake = FakeEngine(fail_on_step=2)
        engine = await started(fake)
        stream = await engine.add_requests([NewRequest("a", [1], params(10))])
        with pytest.raises(EngineUnavailableError, match=r"the engine failed \(RuntimeError\)"):
            async for _ in stream:
                pass
        await wait_for(lambda: not engine.health()[0])
        assert "died" in engine.health()[1]
        with pytest.raises(EngineUnavailableError):
            await engine.add_requests([NewRequest("b", [1], params())])

    asyncio.run(scenario())


def test_shutdown_lets_running_requests_finish():
    async def scenario():
        fake = FakeEngine(step_delay=0.02)
        engine = await started(fake)
        stream = await engine.add_requests([NewRequest("a", [1], params(10))])
        collected = asyncio.ensure_future(_last(stream))
        await engine.shutdown(5)
        last = await collected
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert len(last.outputs[0].token_ids) == 10

    asyncio.run(scenario())


async def _last(stream):
    last = None
    async for batch in stream:
        last = batch[-1][1]
    return last


def test_a_request_that_waits_too_long_is_failed_with_queue_timeout():
    async def scenario():
        fake = FakeEngine(step_delay=0.01, max_running=1)
        observer = RecordingObserver()
        engine = await started(fake, max_queue_wait=0.2, observers=[observer])
        running = await engine.add_requests([NewRequest("run", [1], params(1000))])
        waiting = await engine.add_requests([NewRequest("wait", [1], params(5))])
        with pytest.raises(QueueTimeoutError, match="waited more than 0.2 s"):
            await waiting.get()
        assert "wait" not in fake.requests and observer.aborted == ["wait"]
        assert (await running.get())[0][1].finished is False  # the running one goes on
        running.abort()
        await engine.shutdown(5)

    asyncio.run(scenario())


def test_drain_finishes_short_requests_and_aborts_long_ones_with_their_outputs():
    async def scenario():
        fake = FakeEngine(step_delay=0.01)
        engine = await started(fake)
        short = asyncio.ensure_future(_last(await engine.add_requests([NewRequest("short", [1], params(5))])))
        long = asyncio.ensure_future(_last(await engine.add_requests([NewRequest("long", [1], params(10**6))])))
        assert await engine.drain(0.5)
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            await engine.add_requests([NewRequest("late", [1], params())])
        assert (await short).outputs[0].finish_reason == "length"
        last = await long
        assert last.finished and last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids
        await engine.shutdown(1)

    asyncio.run(scenario())


def test_drain_of_a_stuck_engine_fails_the_waiters_from_the_loop():
    async def scenario():
        fake = FakeEngine(step_delay=0.01)
        engine = await started(fake, stall_timeout=0.2)
        stream = await engine.add_requests([NewRequest("a", [1], params(10**6))])
        await stream.get()
        fake.hang.set()
        await asyncio.sleep(0.4)
        assert not engine.health()[0]
        with pytest.raises(EngineUnavailableError, match="unhealthy"):
            await engine.add_requests([NewRequest("b", [1], params())])
        started_at = time.monotonic()
        assert await engine.drain(0.3) is False
        assert time.monotonic() - started_at < 5
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            async for _ in stream:
                pass
        fake.hang.clear()
        await engine.shutdown(1)

    asyncio.run(scenario())
