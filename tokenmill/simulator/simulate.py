"""A serving run on virtual time: the real engine, a cost model for the model, a trace.

`simulate(trace, setup)` drives an `LLMEngine` (the same scheduler, KV block manager and
output processor that `tokenmill serve` runs, with the same settings) whose executor is a
`SimulatedExecutor` and whose clock is a `VirtualClock`. The loop mirrors the server's
engine thread: requests that have reached the engine are added between steps, and a step
runs while there is work; when there is none the clock jumps to the next arrival.

What the server adds around the engine is modelled by measured constants
(`ServerOverheads`, measured by `tokenmill simulate calibrate`, which runs `serve`):
- `request_s`: from the client's send to the engine holding the request (HTTP parsing,
  validation, tokenization, the hand-over to the engine thread);
- `step_s`: the server loop's own time per step beyond the engine's step (handing the
  outputs to the event loop);
- `chunk_s`: per token streamed in a step, the time the step loses to the work around
  it (the event loop encoding and writing the chunk, the client reading it, both taking
  the GIL or a core from the engine thread);
- `token_s`: from a step's end to the client holding its chunk (not measured: 0 unless given).
Detokenization is inside the engine step, so it is in the calibrated step cost.

The per-request records are `workloads.metrics.RequestRecord`s, and the result is computed
by `workloads.metrics.calculate_metrics`: the same keys and definitions as `tokenmill bench
serve`, plus the KV cache's usage over time and the preemptions.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from tokenmill.config import EngineConfig, EngineFacts
from tokenmill.engine.engine import LLMEngine, SLOUnattainableError, StepObserver, StepRecord
from tokenmill.outputs import RequestOutput
from tokenmill.planner.costmodel import KVTransferCost, StepFeatures, StepTimeModel
from tokenmill.sampling.params import SamplingParams
from tokenmill.simulator.disaggregation import PREFILL_PARAMS, Layout, Pull, SimulatedKVConnector
from tokenmill.simulator.executor import SimulatedExecutor, VirtualClock
from tokenmill.workloads.metrics import DEFAULT_PERCENTILES, RequestRecord, calculate_metrics
from tokenmill.workloads.trace import Trace

SCHEMA = "tokenmill.simulate/1"
TIMELINE_POINTS = 2000  # at most this many KV-usage samples in a result


@dataclass(frozen=True)
class ServerOverheads:
    request_s: float = 0.0
    step_s: float = 0.0
    token_s: float = 0.0
    chunk_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"server overhead {name} must be a finite number >= 0, got {value}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class SimulationSetup:
    """The engine settings (`serve`'s flags), what loading the model would find, the cost
    model of a step, and the server's overheads."""

    config: EngineConfig
    num_blocks: int
    max_model_len: int
    cost_model: StepTimeModel
    overheads: ServerOverheads = field(default_factory=ServerOverheads)
    model_name: str = "simulated"
    cost_model_source: str = ""  # where the cost model came from, for the result
    kv_bytes_per_token: int = 0  # what the KV cache's bytes are counted in (0: unknown)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {self.num_blocks}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")

    def facts(self) -> EngineFacts:
        return EngineFacts(
            model_name=self.model_name, model_path="", architecture="simulated", vocab_size=2**31 - 1,
            max_model_len=self.max_model_len, device="virtual", compute_dtype="none", weight_format="none",
            kv_cache_dtype="none", num_blocks=self.num_blocks, block_size=self.config.cache.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token, attention_backend="none", execution_plan="cost model",
        )


class SimulatedTokenizer:
    """One character per token, no EOS: what the output processor needs, at little cost."""

    eos_token_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("the simulator takes prompts as token ids")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)

    def token_to_text(self, token_id: int) -> str:
        return "x"


@dataclass
class _Timeline(StepObserver):
    """Every step's record, and the times each request's tokens were produced."""

    executor: SimulatedExecutor
    steps: list[StepRecord] = field(default_factory=list)
    token_times: dict[str, list[float]] = field(default_factory=dict)

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        self.steps.append(record)
        end = record.started + record.duration_s
        for request_id in self.executor.last.sampled_ids if self.executor.last else ():
            self.token_times.setdefault(request_id, []).append(end)


@dataclass
class InstanceSummary:
    """One instance of a layout: its role and what it did."""

    role: str  # "both" (aggregated), "prefill" or "decode"
    num_steps: int
    busy_s: float  # virtual seconds spent in steps
    max_kv_usage: float
    num_preemptions: int

    def to_dict(self, duration: float) -> dict[str, Any]:
        return {**asdict(self), "busy_fraction": self.busy_s / duration if duration > 0 else 0.0}


@dataclass
class SimulationResult:
    records: list[RequestRecord]
    steps: list[StepRecord]  # every instance's, in order of their start
    duration: float
    wall_seconds: float  # how long the simulation itself took
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    layout: Layout = field(default_factory=Layout)
    instances: list[InstanceSummary] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)  # disaggregated: every KV pull
    transfer: KVTransferCost | None = None
    kv_block_bytes: int = 0


class _Instance:
    """One simulated server: an engine on its own clock, the requests on their way to it."""

    def __init__(self, setup: SimulationSetup, role: str, name: str, connectors: dict[str, SimulatedKVConnector],
                 transfer: KVTransferCost | None, warm_step_cost: bool) -> None:
        self.role = role
        self.clock = VirtualClock()
        block_bytes = setup.kv_bytes_per_token * setup.config.cache.block_size
        load_s = transfer.copy_in_seconds(block_bytes) if transfer is not None and role == "decode" else 0.0
        self.executor = SimulatedExecutor(setup.cost_model, self.clock, step_overhead_s=setup.overheads.step_s,
                                          chunk_overhead_s=setup.overheads.chunk_s, load_s_per_block=load_s)
        self.engine = LLMEngine(setup.config, self.executor, SimulatedTokenizer(), setup.facts(), self.clock)
        self.connector = None
        if role != "both":
            self.connector = SimulatedKVConnector(name, role, self.clock, transfer, block_bytes, connectors)
            self.engine.set_kv_connector(self.connector)
        if warm_step_cost:
            _warm(self.engine, setup)
        self.timeline = _Timeline(self.executor)
        self.engine.add_observer(self.timeline)
        self.inbox: list[tuple[float, int, int, dict | None]] = []  # (when it reaches the engine, seq, index, params)
        self.blocked = False  # it has requests but its last try scheduled nothing (KV pulls in flight, full cache)

    def send(self, moment: float, seq: int, index: int, params: dict | None = None) -> None:
        heapq.heappush(self.inbox, (moment, seq, index, params))
        self.blocked = False

    def next_time(self) -> float | None:
        """When it next has something to do: now while it can step, else the next arrival or
        KV event."""
        if self.engine.has_unfinished_requests() and not self.blocked:
            return self.clock.now
        times = [self.inbox[0][0]] if self.inbox else []
        event = self.connector.next_event() if self.connector is not None else None
        if event is not None and self.engine.has_unfinished_requests():
            times.append(max(event, self.clock.now))
        return min(times) if times else None

    def due(self) -> list[tuple[int, dict | None]]:
        ready = []
        while self.inbox and self.inbox[0][0] <= self.clock.now:
            _, _, index, params = heapq.heappop(self.inbox)
            ready.append((index, params))
        return ready

    def summary(self) -> InstanceSummary:
        steps = self.timeline.steps
        return InstanceSummary(self.role, len(steps), sum(s.duration_s for s in steps),
                               max((s.kv_usage for s in steps), default=0.0), self.engine.stats().num_preemptions)


def simulate(trace: Trace, setup: SimulationSetup, max_concurrency: int | None = None,
             warm_step_cost: bool = False, max_steps: int | None = None, layout: Layout | None = None,
             transfer: KVTransferCost | None = None) -> SimulationResult:
    """Run `trace` through the engine on virtual time; at most `max_concurrency` requests in
    flight at the client (the rest wait for a slot, as `bench serve --max-concurrency`).
    `warm_step_cost`: the engine starts knowing what a step costs (as a server that has
    been running; SLO mode and early rejection then act from the first step), else it
    learns from its first steps as a freshly started one. `max_steps`: ValueError past
    that many engine steps (a what-if on a server's CPU is bounded). `layout`: several
    instances (aggregated replicas, or xPyD disaggregated with `transfer` pricing the KV
    pulls; simulator/disaggregation.py), each an engine with the same settings and cost
    model, on one virtual time; default one instance."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    layout = layout or Layout()
    if layout.disaggregated:
        if transfer is None:
            raise ValueError("a disaggregated layout needs a KV transfer cost")
        if not setup.kv_bytes_per_token:
            raise ValueError("a disaggregated layout needs the KV bytes per token (this setup does not know them)")
    wall_start = time.perf_counter()
    connectors: dict[str, SimulatedKVConnector] = {}
    instances = [_Instance(setup, role, f"{role}-{k}", connectors, transfer, warm_step_cost)
                 for k, role in enumerate(layout.roles())]
    first = [i for i in instances if i.role in ("both", "prefill")]  # where the client's requests go
    answering = [i for i in instances if i.role in ("both", "decode")]  # whose tokens the client gets
    client = _Client(trace, setup.overheads, max_concurrency)
    sequence = itertools.count()
    turn = {"first": 0, "decode": 0}  # round-robin
    overheads = setup.overheads

    def route(pool: list[_Instance], key: str) -> _Instance:
        instance = pool[turn[key] % len(pool)]
        turn[key] += 1
        return instance

    while True:
        upcoming = client.next_arrival()
        ready = [(t, k) for k, instance in enumerate(instances) if (t := instance.next_time()) is not None]
        moment, k = min(ready) if ready else (None, -1)
        if upcoming is not None and (moment is None or upcoming <= moment):
            for index, _ in client.due(upcoming):  # the router sends it on
                route(first, "first").send(upcoming, next(sequence), index,
                                           dict(PREFILL_PARAMS) if layout.disaggregated else None)
            continue
        if moment is None:
            if any(i.engine.has_unfinished_requests() for i in instances):
                raise RuntimeError("the engine holds requests it cannot schedule and nothing else arrives")
            break
        instance = instances[k]
        engine, clock = instance.engine, instance.clock
        clock.advance_to(moment)
        for index, params in instance.due():
            request = trace.requests[index]
            max_tokens = 1 if instance.role == "prefill" else request.output_len
            try:
                engine.add_request(str(index), request.prompt_token_ids,
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                   arrival_time=clock.now, final_only=True, priority=request.priority,
                                   kv_transfer_params=params)
            except ValueError as error:  # the server answers 400 before streaming anything
                client.fail(index, f"HTTP 400: {error}", clock.now + overheads.token_s)
            except SLOUnattainableError as error:  # --slo-reject: the server answers 429
                client.fail(index, f"HTTP 429: {error}", clock.now + overheads.token_s)
        instance.blocked = False
        if engine.has_unfinished_requests():
            steps = engine.num_steps
            for output in engine.step():
                if not output.finished:
                    continue
                if instance.role == "prefill":  # its answer goes back through the router to a decode instance
                    route(answering, "decode").send(clock.now + overheads.token_s + overheads.request_s,
                                                    next(sequence), int(output.request_id), output.kv_transfer_params)
                else:
                    client.finish(int(output.request_id), clock.now + overheads.token_s)
            instance.blocked = engine.num_steps == steps
            if max_steps is not None and sum(i.engine.num_steps for i in instances) > max_steps:
                raise ValueError(f"the load needs more than {max_steps:,} engine steps to simulate: ask for fewer "
                                 "prompts or output tokens, or more sequences per step")

    token_times: dict[str, list[float]] = {}
    for instance in answering:
        token_times.update(instance.timeline.token_times)
    records = client.records(token_times, overheads.token_s)
    stats = [i.engine.stats() for i in instances]
    ends = [r.start_time + r.latency for r in records]
    steps = sorted((s for i in instances for s in i.timeline.steps), key=lambda s: s.started)
    return SimulationResult(
        records=records, steps=steps, duration=max([*ends, *(i.clock.now for i in instances), 1e-9]),
        wall_seconds=time.perf_counter() - wall_start, num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats), layout=layout,
        instances=[i.summary() for i in instances],
        pulls=[p for i in instances if i.connector is not None for p in i.connector.pulls],
        transfer=transfer if layout.disaggregated else None,
        kv_block_bytes=setup.kv_bytes_per_token * setup.config.cache.block_size,
    )


WARM_CONTEXT = 256  # tokens each decode row attends to in the warm-up samples


def _warm(engine: LLMEngine, setup: SimulationSetup) -> None:
    """Feed the engine's step cost estimator the cost model's steps over a grid of shapes
    (what a running server has timed by now), plus the server's per-step overhead."""
    budget = setup.config.scheduler.max_num_batched_tokens
    rows = setup.config.scheduler.max_num_seqs
    for prefill in sorted({0, min(16, budget), min(128, budget), budget}):
        for decode in sorted({0, 1, min(4, rows), rows}):
            if prefill + decode == 0:
                continue
            step = StepFeatures(prefill, decode, decode * WARM_CONTEXT)
            engine.step_cost.observe(prefill, decode, setup.cost_model.predict(step) + setup.overheads.step_s)


class _Client:
    """The load generator's side: send times (capped concurrency), and the records."""

    def __init__(self, trace: Trace, overheads: ServerOverheads, cap: int | None) -> None:
        self.trace = trace
        self.overheads = overheads
        self.cap = cap
        self.waiting = deque(sorted(range(len(trace.requests)), key=lambda i: trace.requests[i].arrival_s))
        self.in_flight = 0
        self.sent_at: dict[int, float] = {}
        self.errors: dict[int, tuple[str, float]] = {}
        self.to_engine: list[tuple[float, int]] = []  # (when it reaches the engine, index), a heap
        self._send_ready(free_since=0.0)

    def _send_ready(self, free_since: float) -> None:
        """Send waiting requests while a slot is free (a request waits for its arrival)."""
        while self.waiting and (self.cap is None or self.in_flight < self.cap):
            index = self.waiting.popleft()
            sent = max(self.trace.requests[index].arrival_s, free_since)
            self.sent_at[index] = sent
            self.in_flight += 1
            heapq.heappush(self.to_engine, (sent + self.overheads.request_s, index))

    def due(self, now: float) -> list[tuple[int, Any]]:
        ready = []
        while self.to_engine and self.to_engine[0][0] <= now:
            _, index = heapq.heappop(self.to_engine)
            ready.append((index, self.trace.requests[index]))
        return ready

    def next_arrival(self) -> float | None:
        return self.to_engine[0][0] if self.to_engine else None

    def finish(self, index: int, at_client: float) -> None:
        self.in_flight -= 1
        self._send_ready(free_since=at_client)

    def fail(self, index: int, error: str, at_client: float) -> None:
        self.errors[index] = (error, at_client)
        self.finish(index, at_client)

    def records(self, token_times: dict[str, list[float]], token_s: float) -> list[RequestRecord]:
        records = []
        for index, request in enumerate(self.trace.requests):
            sent = self.sent_at[index]
            record = RequestRecord(prompt_len=request.prompt_len, start_time=sent,
                                   client_queue_time=sent - request.arrival_s)
            if index in self.errors:
                record.error, failed_at = self.errors[index]
                record.prompt_len = 0  # the server's usage never came
                records.append(record)
                continue
            times = [t + token_s for t in token_times[str(index)]]
            record.success = True
            record.ttft = times[0] - sent
            record.itl = [b - a for a, b in zip(times, times[1:])]
            record.latency = times[-1] - sent
            record.output_tokens = len(times)
            records.append(record)
        return records


# ----- the result, as bench serve writes it ---------------------------------------------------


def result_dict(trace: Trace, setup: SimulationSetup, run: SimulationResult, *, max_concurrency: int | None = None,
                goodput: dict[str, float] | None = None, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                label: str | None = None) -> dict[str, Any]:
    """bench serve's result keys (the header it writes, then `calculate_metrics`), and the
    simulation's own: steps, preemptions, KV usage over time, the cost model used."""
    settings = trace.settings
    rate = settings.get("request_rate")
    config = setup.config
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "simulator",
        "backend": "simulator",
        "label": label,
        "model_id": setup.model_name,
        "tokenizer_id": None,
        "num_prompts": len(trace),
        "request_rate": rate if rate is not None else "replay",
        "burstiness": settings.get("burstiness"),
        "max_concurrency": max_concurrency,
        "schema": SCHEMA,
        "endpoint": "/v1/completions",
        **{key: settings.get(key) for key in ("dataset_name", "dataset_path", "input_len", "output_len",
                                              "range_ratio", "prefix_len", "num_prefixes", "seed")},
        "ignore_eos": True,
        "goodput_slos_ms": dict(goodput) if goodput else None,
        "percentiles": list(percentiles),
        "trace": trace.description,
    }
    result.update(calculate_metrics(run.records, run.duration, goodput or None, percentiles))
    steps = run.steps
    result.update({
        "num_steps": len(steps),
        "num_preemptions": run.num_preemptions,
        "preempted_requests": len({rid for s in steps for rid in s.preempted_ids}),
        "prefix_cache_hit_rate": run.prefix_cache_hits / run.prefix_cache_queries if run.prefix_cache_queries else 0.0,
        "max_kv_usage": max((s.kv_usage for s in steps), default=0.0),
        "mean_kv_usage": _time_weighted_mean(steps),
        "kv_usage_timeline": kv_timeline(steps),
        "simulation_wall_s": run.wall_seconds,
        "engine_settings": {
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "scheduling_policy": config.scheduler.scheduling_policy,
            "slo_ttft_ms": config.scheduler.slo_ttft_ms, "slo_tpot_ms": config.scheduler.slo_tpot_ms,
            "block_size": config.cache.block_size, "num_blocks": setup.num_blocks,
            "kv_bytes_per_token": setup.kv_bytes_per_token,
            "enable_prefix_caching": config.cache.enable_prefix_caching, "max_model_len": setup.max_model_len,
        },
        "cost_model": {"source": setup.cost_model_source, **_model_dict(setup.cost_model)},
        "server_overheads": setup.overheads.to_dict(),
    })
    if run.layout.num_instances > 1 or run.layout.disaggregated:
        result["layout"] = run.layout.name
        result["instances"] = [i.to_dict(run.duration) for i in run.instances]
    if run.layout.disaggregated:
        result["kv_transfer"] = transfer_summary(run)
    return result


def transfer_summary(run: SimulationResult) -> dict[str, Any]:
    """The KV pulls of a disaggregated run: how many, their blocks and bytes, how long they
    took (from the decode instance asking to the bytes there, queueing behind other pulls
    included), and the cost model."""
    pulls = run.pulls
    seconds = sorted(p.done - p.started for p in pulls)
    sizes = sorted(p.nbytes for p in pulls)

    def pick(values: list, q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    return {
        "num_pulls": len(pulls),
        "pulled_blocks": sum(p.blocks for p in pulls),
        "pulled_bytes": sum(sizes),
        "kv_block_bytes": run.kv_block_bytes,
        "median_pull_bytes": pick(sizes, 0.5),
        "median_pull_ms": pick(seconds, 0.5) * 1e3,
        "p99_pull_ms": pick(seconds, 0.99) * 1e3,
        "cost": run.transfer.to_dict() if run.transfer is not None else None,
    }


def kv_timeline(steps: Sequence[StepRecord], points: int = TIMELINE_POINTS) -> dict[str, list[float]]:
    """KV usage, running and waiting requests after each step (at the step's end); longer
    runs are folded into `points` groups of consecutive steps, keeping each group's peak."""
    group = max(1, math.ceil(len(steps) / points))
    times, usage, running, waiting = [], [], [], []
    for start in range(0, len(steps), group):
        chunk = steps[start:start + group]
        times.append(chunk[-1].started + chunk[-1].duration_s)
        usage.append(max(s.kv_usage for s in chunk))
        running.append(max(s.num_running for s in chunk))
        waiting.append(max(s.num_waiting for s in chunk))
    return {"times": times, "kv_usage": usage, "num_running": running, "num_waiting": waiting}


def _time_weighted_mean(steps: Sequence[StepRecord]) -> float:
    busy = sum(s.duration_s for s in steps)
    return sum(s.kv_usage * s.duration_s for s in steps) / busy if busy > 0 else 0.0


def _model_dict(model: StepTimeModel) -> dict[str, Any]:
    to_dict = getattr(model, "to_dict", None)
    return {"kind": type(model).__name__, **(to_dict() if to_dict else {})}
