"""The simulator's executor: the step contract's other side, with a cost model for a model.

`StepMeter` turns a `SchedulerOutput` into the cost model's `StepFeatures` (prefill
tokens, decode rows, the contexts they attend to, prefill attention pairs). The same
meter measures the real runner's steps in `tokenmill simulate calibrate` and prices the
simulated ones, so calibration and simulation count a step alike.

`SimulatedExecutor` answers `execute(SchedulerOutput)` as a model runner would, without a
model: every request that samples gets one token (never EOS: requests end by their
`max_tokens`, so output lengths are exact), and the virtual clock moves forward by the
cost model's time for the step. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.batch import RunnerOutput, SchedulerOutput
from tokenmill.planner.costmodel import StepFeatures, StepTimeModel


class VirtualClock:
    """Seconds of simulated time; the engine, its scheduler and output processor read it."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back ({seconds} s)")
        self.now += seconds

    def advance_to(self, moment: float) -> None:
        self.now = max(self.now, moment)


class StepMeter:
    """Features of each step, from the step messages alone (as the runner side sees them):
    a chunk of several tokens that starts inside its prompt is prefill (a recomputation after
    a preemption included, as `LLMEngine` counts it), the rest are decode rows. A one-token
    chunk counts as a decode row even inside its prompt (a disaggregated decode instance
    computing the last prompt token of a pulled prompt): a plan without `prompts_as_chunks`
    lays it out as one and a step of such rows runs the fused decode layer; with it the token
    attends through the prefill kernel op by op, at about a decode row's cost."""

    def __init__(self) -> None:
        self.prompt_lens: dict[str, int] = {}

    def measure(self, batch: SchedulerOutput) -> StepFeatures:
        for request_id in (*batch.finished_ids, *batch.preempted_ids):
            self.prompt_lens.pop(request_id, None)
        prefill = decode = context = pairs = 0
        for item in batch.scheduled:
            if item.new is not None:
                self.prompt_lens[item.request_id] = len(item.new.prompt_token_ids)
            n = item.num_tokens
            if item.start_pos < self.prompt_lens[item.request_id] and n > 1:
                prefill += n
                pairs += n * item.start_pos + n * (n + 1) // 2
            else:
                decode += n
                context += item.context_len
        return StepFeatures(prefill, decode, context, pairs)


@dataclass
class SimulatedStep:
    """What the simulated executor did in one step."""

    features: StepFeatures
    seconds: float
    sampled_ids: list[str] = field(default_factory=list)


class SimulatedExecutor:
    """`execute` prices the step with `cost_model`, advances `clock` by it (plus the
    server's `step_overhead_s` per step, `chunk_overhead_s` per token it streams and, on a
    disaggregated decode instance, `load_s_per_block` per pulled block copied into the pool
    before the forward) and samples `token_id` for every request that samples. `last` is
    the step just executed."""

    def __init__(self, cost_model: StepTimeModel, clock: VirtualClock, token_id: int = 0,
                 step_overhead_s: float = 0.0, chunk_overhead_s: float = 0.0, load_s_per_block: float = 0.0) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.token_id = token_id
        self.step_overhead_s = step_overhead_s
        self.chunk_overhead_s = chunk_overhead_s
        self.load_s_per_block = load_s_per_block
        self.meter = StepMeter()
        self.last: SimulatedStep | None = None

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        features = self.meter.measure(batch)
        sampled = [item.request_id for item in batch.scheduled if item.sample]
        seconds = 0.0
        if batch.scheduled:
            seconds = (self.cost_model.predict(features) + self.step_overhead_s
                       + self.chunk_overhead_s * len(sampled))
        if batch.kv_transfers is not None and batch.kv_transfers.remote_load:
            seconds += self.load_s_per_block * len(batch.kv_transfers.remote_load)
        self.clock.advance(seconds)
        self.last = SimulatedStep(features, seconds, sampled)
        return RunnerOutput(sampled_token_ids={request_id: [self.token_id] for request_id in sampled})
