"""tokenmill.simulator: hand-computed timelines, the simulator against the engine on a fake
runner, calibration on synthetic steps, trace replay, validation arithmetic, and the CLI.
Nothing here loads the model or starts a server (the end-to-end run is `slow`)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from tests.fakes import FakeRunner, FakeTokenizer, fake_facts
from tokenmill.cli import main
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine, StepObserver
from tokenmill.planner.costmodel import RooflineStepModel, StepCostModel, StepFeatures
from tokenmill.planner.roofline import Deployment, decode_step, prefill_step
from tokenmill.sampling.params import SamplingParams
from tokenmill.simulator.executor import StepMeter, VirtualClock
from tokenmill.simulator.simulate import ServerOverheads, SimulationSetup, result_dict, simulate
from tokenmill.workloads.datasets import DatasetConfig
from tokenmill.workloads.metrics import RequestRecord, calculate_metrics
from tokenmill.workloads.trace import Trace, TraceRequest, synthetic_trace, trace_from_result

# Step = 100 ms + 10 ms per prefill token + 20 ms per decode row (no context terms): every
# time below is a sum of these, worked out by hand.
SIMPLE = StepCostModel(0.1, 0.01, 0.02, 0.0)


def setup(model=SIMPLE, overheads=ServerOverheads(), num_blocks=64, max_model_len=64, **settings) -> SimulationSetup:
    config = EngineConfig.from_kwargs(**{"block_size": 4, **settings})
    return SimulationSetup(config, num_blocks, max_model_len, model, overheads, model_name="m", kv_bytes_per_token=8)


def trace(*requests: tuple[float, int, int]) -> Trace:
    """(send time, prompt length, output length) -> a trace of distinct prompts."""
    made = [TraceRequest(at, [10 + 7 * i + k for k in range(n_in)], n_out) for i, (at, n_in, n_out) in enumerate(requests)]
    return Trace(made, "hand-made", {"request_rate": 1.0})


def timeline(run) -> list[tuple[float, list[float], float, float]]:
    return [(r.ttft, r.itl, r.latency, r.start_time) for r in run.records]


# ----- hand-computed timelines -------------------------------------------------------------------------


def test_two_requests_join_at_step_boundaries():
    # A (4-token prompt, 3 outputs) at 0; B (2, 2) at 0.05, while A's prefill runs.
    # step 1 [0, 0.14]: A prefill 4          -> 0.1 + 4 x 0.01            = 0.14; A token 1
    # step 2 [0.14, 0.28]: A decode, B prefill 2 -> 0.1 + 0.02 + 2 x 0.01 = 0.14; A token 2, B token 1
    # step 3 [0.28, 0.42]: A and B decode    -> 0.1 + 2 x 0.02            = 0.14; both finish
    run = simulate(trace((0.0, 4, 3), (0.05, 2, 2)), setup())
    (a_ttft, a_itl, a_e2e, a_start), (b_ttft, b_itl, b_e2e, b_start) = timeline(run)
    assert (a_start, b_start) == (0.0, 0.05)
    assert a_ttft == pytest.approx(0.14) and a_itl == pytest.approx([0.14, 0.14]) and a_e2e == pytest.approx(0.42)
    assert b_ttft == pytest.approx(0.23) and b_itl == pytest.approx([0.14]) and b_e2e == pytest.approx(0.37)
    assert run.duration == pytest.approx(0.42)
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in run.steps] == [(4, 0), (2, 1), (0, 2)]
    assert [s.started for s in run.steps] == pytest.approx([0.0, 0.14, 0.28])
    assert [r.output_tokens for r in run.records] == [3, 2]


def test_server_overheads_shift_arrivals_steps_and_chunks():
    # request 10 ms, step 5 ms, chunk 2 ms. A reaches the engine at 0.01:
    # step 1 [0.01, 0.155] (0.14 + 0.005), A's chunk at 0.157; B reaches it at 0.06, joins step 2
    # [0.155, 0.30], step 3 [0.30, 0.445]; chunks 2 ms after each step's end.
    over = ServerOverheads(request_s=0.01, step_s=0.005, token_s=0.002)
    run = simulate(trace((0.0, 4, 3), (0.05, 2, 2)), setup(overheads=over))
    (a_ttft, a_itl, a_e2e, _), (b_ttft, b_itl, b_e2e, _) = timeline(run)
    assert a_ttft == pytest.approx(0.157) and a_itl == pytest.approx([0.145, 0.145]) and a_e2e == pytest.approx(0.447)
    assert b_ttft == pytest.approx(0.252) and b_itl == pytest.approx([0.145]) and b_e2e == pytest.approx(0.397)
    assert run.duration == pytest.approx(0.447)


def test_streamed_tokens_slow_the_step_they_come_from():
    # 3 ms per streamed token: step 1 streams A's first token (0.143), step 2 two (0.146), step 3 two.
    run = simulate(trace((0.0, 4, 3), (0.05, 2, 2)), setup(overheads=ServerOverheads(chunk_s=0.003)))
    assert [s.execute_s for s in run.steps] == pytest.approx([0.143, 0.146, 0.146])
    assert run.records[0].latency == pytest.approx(0.435) and run.records[1].ttft == pytest.approx(0.289 - 0.05)


def test_client_concurrency_cap_holds_requests_back():
    # With one request in flight, B is sent when A's last chunk arrives (0.42):
    # A alone: 0.14 + 0.12 + 0.12 = 0.38; B: prefill 2 at [0.38, 0.50], decode [0.50, 0.62].
    run = simulate(trace((0.0, 4, 3), (0.05, 2, 2)), setup(), max_concurrency=1)
    (a_ttft, a_itl, a_e2e, a_start), (b_ttft, b_itl, b_e2e, b_start) = timeline(run)
    assert a_itl == pytest.approx([0.12, 0.12]) and a_e2e == pytest.approx(0.38)
    assert b_start == pytest.approx(0.38) and run.records[1].client_queue_time == pytest.approx(0.33)
    assert b_ttft == pytest.approx(0.12) and b_itl == pytest.approx([0.12]) and b_e2e == pytest.approx(0.24)


def test_idle_engine_waits_for_the_next_arrival():
    # A finishes at 0.12 + 0.12 = 0.24 (prompt 2, 2 tokens); B arrives at 5.0 to an idle engine.
    run = simulate(trace((0.0, 2, 2), (5.0, 2, 1)), setup())
    assert run.records[1].ttft == pytest.approx(0.12)
    assert run.steps[-1].started == pytest.approx(5.0)
    assert run.duration == pytest.approx(5.12)


def test_chunked_prefill_counts_attention_pairs_per_chunk():
    # Budget 3: a 5-token prompt is computed as chunks 3 + 2. Pairs: 3 x 4 / 2 = 6, then
    # 2 x 3 + 2 x 3 / 2 = 9. With 1 us per pair: step 1 = 0.1 + 0.03 + 6e-6.
    model = StepCostModel(0.1, 0.01, 0.02, 0.0, 1e-6)
    run = simulate(trace((0.0, 5, 2)), setup(model, max_num_batched_tokens=3))
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in run.steps] == [(3, 0), (2, 0), (0, 1)]
    assert [s.execute_s for s in run.steps] == pytest.approx([0.13 + 6e-6, 0.12 + 9e-6, 0.12])
    assert run.records[0].ttft == pytest.approx(0.25 + 15e-6)


def test_step_meter_features():
    from tokenmill.engine.batch import NewRequestData, ScheduledRequest, SchedulerOutput

    def item(rid, start, n, new_prompt=None):
        new = NewRequestData(list(range(new_prompt)), SamplingParams()) if new_prompt else None
        return ScheduledRequest(rid, start, n, [], [], True, new)

    meter = StepMeter()
    first = meter.measure(SchedulerOutput([item("a", 0, 8, new_prompt=8), item("b", 0, 4, new_prompt=10)]))
    assert first == StepFeatures(12, 0, 0, 36 + 10)
    # a decodes at context 9; b's second chunk (start 4, 6 tokens) is prefill: 6 x 4 + 21 pairs.
    second = meter.measure(SchedulerOutput([item("a", 8, 1), item("b", 4, 6)]))
    assert second == StepFeatures(6, 1, 9, 45)
    # After a preemption b is sent again as new: its recomputation is prefill again.
    third = meter.measure(SchedulerOutput([item("b", 0, 12, new_prompt=10)], preempted_ids=["b"]))
    assert third == StepFeatures(12, 0, 0, 78)


def test_requests_that_can_never_fit_fail_like_a_400():
    run = simulate(trace((0.0, 4, 2), (0.0, 70, 2)), setup(max_model_len=64))
    assert run.records[0].success and not run.records[1].success
    assert run.records[1].error.startswith("HTTP 400: the prompt has 70 tokens")
    result = result_dict(trace((0.0, 4, 2), (0.0, 70, 2)), setup(), run)
    assert result["completed"] == 1 and result["failed"] == 1


# ----- the simulator schedules as the engine does -------------------------------------------------------


class TimedFakeRunner(FakeRunner):
    """The tests' fake model runner (it checks every KV read through the block tables),
    taking the cost model's time per step on a virtual clock."""

    def __init__(self, num_blocks, block_size, model, clock):
        super().__init__(num_blocks, block_size)
        self.model, self.clock, self.meter = model, clock, StepMeter()

    def execute(self, batch):
        self.clock.advance(self.model.predict(self.meter.measure(batch)) if batch.scheduled else 0.0)
        return super().execute(batch)


def engine_reference(requests: list[TraceRequest], config: EngineConfig, num_blocks: int, max_model_len: int,
                     model) -> tuple[list, dict[str, list[float]], dict[str, int]]:
    """The engine on the fake runner, requests added when the clock has passed their
    arrival: the step records, each request's token times, its output length."""
    clock = VirtualClock()
    runner = TimedFakeRunner(num_blocks, config.cache.block_size, model, clock)
    engine = LLMEngine(config, runner, FakeTokenizer(), fake_facts(num_blocks, config.cache.block_size,
                                                                   max_model_len), clock)
    records, times, lengths = [], {}, {}

    class Recorder(StepObserver):
        def on_step(self, record, outputs):
            records.append(record)
            for output in outputs:
                seen = times.setdefault(output.request_id, [])
                seen += [record.started + record.duration_s] * (len(output.outputs[0].token_ids) - len(seen))
                lengths[output.request_id] = len(output.outputs[0].token_ids)

    engine.add_observer(Recorder())
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]].arrival_s <= clock():
            i = pending.pop(0)
            engine.add_request(str(i), requests[i].prompt_token_ids,
                               SamplingParams(max_tokens=requests[i].output_len, ignore_eos=True))
        if engine.has_unfinished_requests():
            engine.step()
        else:
            clock.advance_to(requests[pending[0]].arrival_s)
    return records, times, lengths


def step_view(record) -> tuple:
    return (round(record.started, 9), round(record.execute_s, 9), record.num_prefill_tokens,
            record.num_decode_tokens, record.num_scheduled, record.num_generated, record.preempted_ids,
            record.finished_ids, record.num_running, record.num_waiting, record.kv_usage)


@pytest.mark.parametrize("caching", [True, False])
def test_simulation_and_engine_agree_on_the_schedule(caching):
    # A small KV cache (24 blocks of 4) under shared prefixes, chunked prefill (budget 24) and
    # staggered arrivals: preemptions, prefix hits and chunks all happen.
    model = StepCostModel(0.05, 0.002, 0.01, 1e-4, 1e-6)
    dataset = DatasetConfig(name="shared-prefix", num_prompts=24, input_len=10, output_len=12, range_ratio=0.5,
                            prefix_len=8, num_prefixes=3, seed=3)
    made = synthetic_trace(dataset, request_rate=6.0)
    # The fake runner's vocabulary is 1000 ids: map the prompts into it, keeping equal tokens equal.
    requests = [TraceRequest(r.arrival_s, [3 + t % 997 for t in r.prompt_token_ids], r.output_len)
                for r in made.requests]
    config = EngineConfig.from_kwargs(block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                                      enable_prefix_caching=caching)
    sim = simulate(Trace(requests, "t", {}), SimulationSetup(config, 24, 64, model))
    records, times, lengths = engine_reference(requests, config, 24, 64, model)

    assert sum(len(s.preempted_ids) for s in records) > 0, "the workload must preempt"
    assert [step_view(s) for s in sim.steps] == [step_view(s) for s in records]
    for i, record in enumerate(sim.records):
        assert record.output_tokens == lengths[str(i)] == requests[i].output_len
        ends = [record.start_time + record.ttft + sum(record.itl[:k]) for k in range(len(record.itl) + 1)]
        assert ends == pytest.approx(times[str(i)])


# ----- traces ------------------------------------------------------------------------------------------


def test_synthetic_trace_draws_what_bench_serve_draws():
    import numpy as np

    from tokenmill.workloads.datasets import random_token_prompts
    from tokenmill.workloads.metrics import arrival_times

    dataset = DatasetConfig(num_prompts=50, input_len=100, output_len=20, range_ratio=0.3, seed=7)
    made = synthetic_trace(dataset, 2.0, burstiness=0.5, seed_offset=3)
    assert [r.arrival_s for r in made.requests] == arrival_times(50, 2.0, 0.5, np.random.default_rng(10))
    expected = random_token_prompts(dataset, list(range(1000, 5000)), 50, np.random.default_rng(10))
    assert [(r.prompt_token_ids, r.output_len) for r in made.requests] == expected
    assert made.settings["request_rate"] == 2.0 and made.settings["input_len"] == 100


def test_replaying_a_bench_serve_result():
    records = [RequestRecord(prompt_len=20, success=True, start_time=0.5 * i, ttft=0.1, itl=[0.05] * 4,
                             latency=0.3, output_tokens=5, client_queue_time=0.1 * (i == 2)) for i in range(3)]
    records.append(RequestRecord(error="HTTP 500: boom", start_time=2.0))
    result = {**calculate_metrics(records, 2.5), "dataset_name": "shared-prefix", "prefix_len": 8, "num_prefixes": 2,
              "output_len": 5, "request_rate": 2.0, "date": "x"}
    replay = trace_from_result(result)
    assert [r.arrival_s for r in replay.requests] == pytest.approx([0.0, 0.5, 0.9, 2.0])
    assert [r.prompt_len for r in replay.requests[:3]] == [20, 20, 20]
    assert [r.output_len for r in replay.requests] == [5, 5, 5, 5]  # the failed one asked for output_len
    prompts = [r.prompt_token_ids for r in replay.requests]
    assert prompts[0][:8] == prompts[2][:8] != prompts[1][:8]  # prefixes round-robin, as the bench assigns them
    with pytest.raises(ValueError, match="not a bench serve result"):
        trace_from_result({"start_times": []})


# ----- cost models -------------------------------------------------------------------------------------


def test_roofline_step_model_is_the_planners_decode_and_prefill_steps():
    from tokenmill.planner import catalog, presets
    from tokenmill.planner.roofline import KV_CACHE_DTYPES, param_counts, weight_bytes, weight_format

    shape = presets.PRESETS["llama-3.1-8b"]
    params = param_counts(shape)
    fmt = weight_format("bfloat16")
    dep = Deployment(shape, params, weight_bytes(params, fmt), KV_CACHE_DTYPES["bfloat16"],
                     catalog.device("h100-sxm"), "bfloat16")
    model = RooflineStepModel(dep, overhead_s=0.001)
    for batch, context in ((1, 100), (16, 2048), (256, 4096)):
        step = StepFeatures(0, batch, batch * context)
        assert model.predict(step) == pytest.approx(decode_step(dep, batch, context).seconds + 0.001, rel=1e-12)
    prompt = 1024
    step = StepFeatures(prompt, 0, 0, prompt * (prompt + 1) // 2)
    assert model.predict(step) == pytest.approx(prefill_step(dep, 1, prompt).seconds + 0.001, rel=1e-12)


def test_calibration_profile_recovers_a_known_step_model():
    """The profile's workloads, run through the engine on a fake runner whose steps take a
    known model's time, give samples from which the fit recovers every coefficient."""
    from tokenmill.simulator.profile import DEFAULT_WORKLOADS, MeteredExecutor, fit_profile_samples, run_profile

    truth = StepCostModel(0.03, 0.002, 0.004, 2e-6, 3e-8)
    clock = VirtualClock()
    runner = TimedFakeRunner(4000, 16, truth, clock)
    executor = MeteredExecutor(runner)
    config = EngineConfig.from_kwargs(block_size=16)
    engine = LLMEngine(config, executor, FakeTokenizer(), fake_facts(4000, 16, 2048), clock)
    samples = run_profile(engine, executor, DEFAULT_WORKLOADS, repeats=1)
    fit, info = fit_profile_samples(samples)
    for name, value in truth.to_dict().items():
        assert getattr(fit.model, name) == pytest.approx(value, rel=1e-6), name
    # The decode curve holds the linear model's pure decode steps at each batch size profiled.
    assert fit.model.decode_rows == (1, 2, 4, 8, 9, 16, 24, 32, 64)
    assert fit.model.decode_seconds == pytest.approx([truth.intercept_s + truth.per_decode_token_s * b
                                                      for b in fit.model.decode_rows], rel=1e-6)
    assert info["median_relative_error"] < 1e-9
    assert info["four_term_median_relative_error"] > 0  # without the prefill term the fit misses
    features = [s for s, _ in samples]
    assert max(s.decode_tokens for s in features) == 64 and max(s.prefill_tokens for s in features) >= 512
    assert any(s.prefill_tokens and s.decode_tokens for s in features)  # mixed steps
    # Suffixes over the cached prefix: each prompt token attends to the 384 prefix tokens.
    assert any(s.prefill_tokens and s.prefill_attention >= 384 * s.prefill_tokens for s in features)


class NoisyTimedFakeRunner(TimedFakeRunner):
    """Steps take the cost model's time times a seeded log-normal noise, as a shared machine's do."""

    def __init__(self, num_blocks, block_size, model, clock, rng, sigma):
        super().__init__(num_blocks, block_size, model, clock)
        self.rng, self.sigma = rng, sigma

    def execute(self, batch):
        seconds = self.model.predict(self.meter.measure(batch)) if batch.scheduled else 0.0
        self.clock.advance(seconds * self.rng.lognormvariate(0.0, self.sigma))
        return FakeRunner.execute(self, batch)


def test_cached_prefix_steps_pin_the_prefill_attention_term_under_noise():
    """With 8% noise on every step, the profile without suffixes over a cached prefix cannot
    tell prefill tokens from prefill attention pairs apart (both grow along one curve): on
    some seeds the pair term fits to zero and a 128-token suffix over a cached 512-token
    prefix is mispriced by more than 10%. With them, every seed prices it within 10%."""
    from tokenmill.simulator.profile import CACHED_PREFIX, DEFAULT_WORKLOADS, MeteredExecutor, fit_profile_samples, run_profile

    truth = StepCostModel(0.013, 0.0005, 0.0004, 1.4e-6, 2.7e-7)  # about the default model on the 2-core box
    suffix = StepFeatures(128, 0, 0, 128 * 512 + 128 * 129 // 2)

    def worst_suffix_error(workloads) -> float:
        errors = []
        for seed in range(8):
            clock = VirtualClock()
            executor = MeteredExecutor(NoisyTimedFakeRunner(4000, 16, truth, clock, random.Random(seed), 0.08))
            engine = LLMEngine(EngineConfig.from_kwargs(block_size=16), executor, FakeTokenizer(),
                               fake_facts(4000, 16, 2048), clock)
            fit, _ = fit_profile_samples(run_profile(engine, executor, workloads, repeats=1, seed=seed))
            errors.append(abs(fit.model.predict(suffix) / truth.predict(suffix) - 1))
        return max(errors)

    assert worst_suffix_error(tuple(w for w in DEFAULT_WORKLOADS if w not in CACHED_PREFIX)) > 0.10
    assert worst_suffix_error(DEFAULT_WORKLOADS) < 0.10


def test_calibration_adds_the_long_prompts_that_max_model_len_takes():
    """Prompts of 1,024-4,096 tokens alone join the default profile where max_model_len takes
    them (the prefill attention term is fitted over the range it predicts), and run through
    the engine as chunks of the scheduler's budget."""
    from tokenmill.simulator.profile import DEFAULT_WORKLOADS, MeteredExecutor, run_profile, with_long_prompts

    assert with_long_prompts(DEFAULT_WORKLOADS, 1024) == DEFAULT_WORKLOADS
    assert with_long_prompts(DEFAULT_WORKLOADS, 3000)[-1].prompt_lens == (1024, 2048)
    workloads = with_long_prompts(DEFAULT_WORKLOADS, 8192)
    assert workloads[:-1] == DEFAULT_WORKLOADS and workloads[-1].prompt_lens == (1024, 2048, 4096)
    truth = StepCostModel(0.03, 0.002, 0.004, 2e-6, 3e-8)
    clock = VirtualClock()
    runner = TimedFakeRunner(4000, 16, truth, clock)
    executor = MeteredExecutor(runner)
    engine = LLMEngine(EngineConfig.from_kwargs(block_size=16, max_model_len=8192), executor, FakeTokenizer(),
                       fake_facts(4000, 16, 8192), clock)
    samples = run_profile(engine, executor, workloads[-1:], repeats=1)
    # 4,096 tokens in two chunks of 2,048: the second attends over the first.
    pairs = max(s.prefill_attention for s, _ in samples)
    assert pairs == 2048 * 2048 + 2048 * 2049 // 2


def test_server_overheads_from_side_by_side_runs():
    from tokenmill.simulator.profile import overheads_from_pairs

    def served(ttft: float, gap: float, streams: int) -> dict:
        return {"ttfts": [ttft] * streams, "itls": [[gap] * 15 for _ in range(streams)]}

    # In process: a 0.30 s prefill and 0.10 s decode steps alone, 0.20 s with 16 rows. Served:
    # 4 ms more per step, 2 ms more per streamed token, 26 ms more per request.
    pairs = {
        1: [(0.30, 0.10, served(0.30 + 0.004 + 0.026, 0.104 + 0.002, 1))] * 3,
        16: [(1.5, 0.20, served(2.0, 0.20 + 0.004 + 16 * 0.002, 16))] * 3,
    }
    over, detail = overheads_from_pairs(pairs)
    assert over.step_s == pytest.approx(0.006) and over.request_s == pytest.approx(0.024)
    assert over.chunk_s == pytest.approx((0.036 - 0.006) / 16) and over.token_s == 0
    assert detail["rounds"] == 3 and detail["streams"] == [1, 16]
    # A server faster than the engine was (the load fell meanwhile) adds nothing, never less.
    faster, _ = overheads_from_pairs({1: [(0.3, 0.1, served(0.2, 0.09, 1))], 16: [(1, 0.2, served(1, 0.1, 16))]})
    assert faster == ServerOverheads()


def synthetic_profile(**changes):
    from tokenmill.simulator.profile import Profile, machine_name

    fields = dict(
        machine=machine_name(), model_name="tiny", model_path="/models/tiny.gguf", requested_dtype="float32",
        compute_dtype="float32", weight_format="float32", kv_cache_dtype="float32", num_threads=1,
        kv_bytes_per_token=1024, model_max_len=512, default_kv_cache_memory=2**22,
        cost_model=StepCostModel(0.02, 0.001, 0.002, 1e-6, 1e-8),
        fit={"samples": 9, "median_relative_error": 0.05, "max_relative_error": 0.2,
             "four_term_median_relative_error": 0.06, "four_term_max_relative_error": 0.3},
        overheads=ServerOverheads(0.003, 0.001, 0.0), created="2026-01-01T00:00:00",
    )
    fields.update(changes)
    return Profile(**fields)


def test_profiles_are_stored_and_found_per_model_dtype_and_threads(tmp_path, monkeypatch):
    from tokenmill.simulator.profile import find_profile, load_profile, save_profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = save_profile(synthetic_profile())
    assert path.parent == tmp_path / "tokenmill" / "simulator"
    assert load_profile(path).to_dict() == synthetic_profile().to_dict()
    assert find_profile("/models/tiny.gguf", "float32", 1) == path
    assert find_profile("/models/tiny.gguf", "bfloat16", 1) is None
    assert find_profile("/models/tiny.gguf", "float32", 2) is None
    newer = save_profile(synthetic_profile(requested_dtype="auto", created="2026-02-01T00:00:00"))
    assert find_profile("/models/tiny.gguf", "float32", 1) == newer  # auto resolved to float32, and newer
    (tmp_path / "tokenmill" / "simulator" / "junk.json").write_text("{}")
    assert find_profile("/models/tiny.gguf", "auto", 1) == newer
    with pytest.raises(ValueError, match="not a tokenmill simulator profile"):
        load_profile(tmp_path / "tokenmill" / "simulator" / "junk.json")


def test_setup_from_a_profile_counts_blocks_as_the_builder():
    from tokenmill.simulator.setup import setup_from_profile, with_settings

    profile = synthetic_profile()
    config = EngineConfig.from_kwargs(kv_cache_memory="1MiB", block_size=16)
    made = setup_from_profile(config, profile)
    assert made.num_blocks == 2**20 // (1024 * 16) and made.max_model_len == 512
    assert made.overheads == profile.overheads
    assert setup_from_profile(EngineConfig(), profile).num_blocks == 2**22 // (1024 * 16)  # the default memory
    assert with_settings(made, block_size=32).num_blocks == 32
    assert with_settings(made, kv_cache_memory="2MiB", max_num_seqs=4).num_blocks == 128
    with pytest.raises(ValueError, match="holds no block"):
        setup_from_profile(EngineConfig.from_kwargs(kv_cache_memory=1000), profile)


# ----- validation arithmetic -----------------------------------------------------------------------------


def test_validation_compares_medians_over_repeats_and_the_saturation_rate():
    from tokenmill.simulator.validate import compare, format_validation

    def point(rate, ttft, tpot, out, p90, rps):
        return {"request_rate": rate, "median_ttft_ms": ttft, "median_tpot_ms": tpot, "output_throughput": out,
                "p90_ttft_ms": p90, "request_throughput": rps, "load_average": [2.0, 2, 2]}

    measured = [[point(0.5, 100, 50, 10, 150, 0.5), point("inf", 1000, 80, 20, 1500, 1.0)],
                [point(0.5, 120, 54, 10, 170, 0.5), point("inf", 1200, 90, 22, 1700, 1.2)],
                [point(0.5, 110, 52, 10, 160, 0.5), point("inf", 1100, 85, 21, 1600, 1.1)]]
    predicted = [[point(0.5, 121, 52, 10, 160, 0.5), point("inf", 1000, 85, 21, 2100, 1.0)]] * 3
    report = compare(measured, predicted)
    low, top = report["points"]
    assert low["median_ttft_ms"]["measured"] == 110 and low["median_ttft_ms"]["error"] == pytest.approx(0.1)
    assert top["p90_ttft_ms"]["error"] == pytest.approx(2100 / 1600 - 1)
    assert report["saturation_rate"]["measured"] == pytest.approx(1.1)
    assert report["saturation_rate"]["error"] == pytest.approx(1.0 / 1.1 - 1)
    assert report["targets_met"] == {"median_ttft_ms": True, "median_tpot_ms": True, "output_throughput": True,
                                     "p90_ttft_ms": False, "saturation_rate": True}
    text = format_validation(report)
    assert "missed: p90_ttft_ms" in text and "+31% *" in text


# ----- the command line ----------------------------------------------------------------------------------


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["simulate", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def profile_file(tmp_path) -> str:
    from tokenmill.simulator.profile import save_profile

    return str(save_profile(synthetic_profile(), tmp_path / "profile.json"))


def test_cli_help_has_examples(capsys):
    for args in ([], ["calibrate"], ["sweep"], ["validate"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["simulate", *args, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "examples:" in out and "tokenmill simulate" in out, args
        assert "--max-num-seqs" in out and "--kv-cache-memory" in out  # serve's engine flags
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "examples:" in capsys.readouterr().out


def test_cli_json_run_with_a_profile(capsys, tmp_path, profile_file):
    saved = tmp_path / "run.json"
    code, out, _ = run_cli(capsys, "--profile", profile_file, "--request-rate", "4", "--num-prompts", "40",
                           "--input-len", "32", "--output-len", "8", "--goodput", "ttft:500", "--json",
                           "--save-result", str(saved), "--plot", str(tmp_path / "run.png"))
    assert code == 0
    result = json.loads(out)
    assert result == json.loads(saved.read_text())
    assert result["completed"] == 40 and result["total_output_tokens"] == 320 and result["request_rate"] == 4.0
    assert result["backend"] == "simulator" and result["request_goodput"] is not None
    for key in ("median_ttft_ms", "p99_tpot_ms", "mean_itl_ms", "p90_e2el_ms", "ttfts", "itls", "start_times",
                "num_preemptions", "max_kv_usage", "kv_usage_timeline"):
        assert key in result, key
    assert result["server_overheads"]["request_s"] == 0.003
    assert (tmp_path / "run.png").stat().st_size > 10_000


def test_cli_text_run_on_a_catalog_device(capsys):
    code, out, _ = run_cli(capsys, "--model", "llama-3.1-8b", "--device", "h100-sxm", "--request-rate", "inf",
                           "--num-prompts", "64", "--input-len", "512", "--output-len", "64")
    assert code == 0
    assert "Serving Benchmark Result" in out and "Successful requests:" in out and "roofline of Llama-3.1-8B" in out
    assert "Preemptions:" in out


def test_cli_replays_a_recorded_result(capsys, tmp_path, profile_file):
    run = tmp_path / "measured.json"
    code, _, _ = run_cli(capsys, "--profile", profile_file, "--request-rate", "2", "--num-prompts", "10",
                         "--input-len", "16", "--output-len", "4", "--save-result", str(run), "--json")
    code, out, _ = run_cli(capsys, "--profile", profile_file, "--trace", str(run), "--json")
    assert code == 0
    again, first = json.loads(out), json.loads(run.read_text())
    assert again["ttfts"] == pytest.approx(first["ttfts"]) and again["itls"] == first["itls"]


def test_cli_sweep_over_rates_and_a_grid(capsys, tmp_path, profile_file):
    out_dir = tmp_path / "grid"
    code, out, _ = run_cli(capsys, "sweep", "--profile", profile_file, "--request-rates", "1,4,inf",
                           "--num-prompts", "30", "--input-len", "32", "--output-len", "8",
                           "--grid", "max_num_seqs=2,8", "--kv-cache-memory", "256KiB", "--output-dir", str(out_dir))
    assert code == 0
    assert "[max_num_seqs=2]" in out and "[max_num_seqs=8]" in out and "Sweep over request rate" in out
    for label in ("max_num_seqs=2", "max_num_seqs=8"):
        folder = out_dir / label
        assert {p.name for p in folder.iterdir()} == {"rate-1.json", "rate-4.json", "rate-inf.json", "sweep.json",
                                                     "sweep.png"}
        summary = json.loads((folder / "sweep.json").read_text())
        assert [p["request_rate"] for p in summary["points"]] == [1.0, 4.0, "inf"]
        assert summary["engine_grid"] == {"max_num_seqs": int(label[-1])}
    two = json.loads((out_dir / "max_num_seqs=2" / "rate-inf.json").read_text())
    eight = json.loads((out_dir / "max_num_seqs=8" / "rate-inf.json").read_text())
    assert two["max_concurrent_requests"] == eight["max_concurrent_requests"] == 30  # client side: all sent
    assert two["median_ttft_ms"] > eight["median_ttft_ms"]  # 2 sequences at a time queue the rest


def test_cli_validate_against_a_measured_directory(capsys, tmp_path, profile_file):
    # "Measured" points made by the simulator with the same profile: the replay must predict them exactly.
    measured = tmp_path / "measured"
    for rate in ("0.5", "2"):
        run_cli(capsys, "--profile", profile_file, "--request-rate", rate, "--num-prompts", "12", "--input-len", "24",
                "--output-len", "6", "--save-result", str(measured / f"rate-{rate}.json"), "--json")
    code, out, _ = run_cli(capsys, "validate", "--profile", profile_file, "--request-rates", "0.5,2",
                           "--measured", str(measured), "--output-dir", str(tmp_path / "val"))
    assert code == 0, out
    assert "targets" in out and "all met" in out
    report = json.loads((tmp_path / "val" / "validation.json").read_text())
    assert [p["request_rate"] for p in report["points"]] == [0.5, 2.0]
    assert all(abs(p["median_ttft_ms"]["error"]) < 1e-9 for p in report["points"])
    assert (tmp_path / "val" / "validation.png").exists()
    assert (tmp_path / "val" / "predicted" / "run-1" / "rate-2.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--profile", "/nonexistent.json"], "cannot read a simulator profile"),
    (["--model", "/models/none.gguf", "--dtype", "float32", "--num-threads", "3"], "no calibration of none.gguf"),
    (["--device", "h100-sxm"], "--target-device needs a MODEL"),  # the old spelling still works
        (["--target-device", "h100-sxm"], "--target-device needs a MODEL"),
    (["--device", "no-such-device", "--model", "llama-3.1-8b"], "no-such-device"),
    (["--weights", "int8"], "--weights describes a --target-device"),
    (["sweep", "--request-rates", "1", "--grid", "max_num_seqs", "--output-dir", "x"], "is not NAME=V1,V2"),
    (["sweep", "--request-rates", "1", "--grid", "warp_speed=1", "--output-dir", "x"], "not an engine setting"),
    (["--metric-percentiles", "0"], "must lie in (0, 100]"),
])
def test_cli_errors(capsys, tmp_path, profile_file, args, message):
    extra = ["--profile", profile_file] if "--profile" not in args and "--model" not in args else []
    if args[0] == "sweep":
        args = [*args, *extra]
    else:
        args = [*extra, *args] if "--device" not in args and "--target-device" not in args else args
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and message in err, (code, err)


def test_cli_trace_file_must_be_a_result(capsys, tmp_path, profile_file):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1, 2]))
    code, _, err = run_cli(capsys, "--profile", profile_file, "--trace", str(bad))
    assert code == 2 and "not a bench serve result" in err


def test_simulator_modules_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; import tokenmill.simulator.simulate, tokenmill.simulator.sweep, tokenmill.simulator.setup, "
            "tokenmill.workloads.trace, tokenmill.simulator.validate, tokenmill.simulator.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.slow
def test_calibrate_and_validate_end_to_end(tmp_path):
    """The real model: a short calibration with the server's overheads, then a two-point
    validation sweep against a real server (several minutes)."""
    from tokenmill.simulator import profile as profiles

    config = EngineConfig.from_kwargs(dtype="float32", num_threads=1, max_model_len=512, kv_cache_memory="64MiB")
    made = profiles.calibrate(config, workloads=profiles.DEFAULT_WORKLOADS[:4], repeats=1, server=True)
    assert made.fit["samples"] > 20 and made.overheads is not None
    path = profiles.save_profile(made, tmp_path / "p.json")
    code = main(["simulate", "validate", "--profile", str(path), "--dtype", "float32", "--num-threads", "1",
                 "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--request-rates", "1,inf",
                 "--num-prompts", "6", "--input-len", "32", "--output-len", "4", "--output-dir", str(tmp_path / "v")])
    assert code == 0
    report = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert len(report["points"]) == 2 and math.isfinite(report["saturation_rate"]["error"])


# ----- scheduling policies on virtual time -------------------------------------------------------------


def test_priority_policy_keeps_high_priority_ttft_low_under_overload():
    """3 requests/s of 16-token prompts at 8 sequences x 64 tokens per step queue up for
    seconds; every tenth request has priority 0, the rest 1. Under fcfs the high-priority
    ones queue with the rest; under priority without the step bound (vLLM's) they wait for
    the step in flight and their own (fuller than when alone: the rest of the budget goes
    to others), and low-priority requests all complete in the same total time. With the
    step bound (--priority-step-fraction 0.25) the steps stay short while priority 0 is about, and the
    low-priority work pays: on this cost model (100 ms a step, 10 ms a prefill token) a step
    of one 4-token block is already 0.54x a 16-token prompt's unloaded TTFT."""
    rng = __import__("random").Random(0)
    arrivals, t = [], 0.0
    for i in range(120):
        t += rng.expovariate(3.0)
        arrivals.append(TraceRequest(t, [rng.randrange(10, 1000) for _ in range(16)], 8, 0 if i % 10 == 0 else 1))
    high = [i for i, r in enumerate(arrivals) if r.priority == 0]

    def ttfts(requests, policy, fraction=0.0):
        extra = {"priority_step_fraction": fraction} if policy == "priority" else {}
        run = simulate(Trace(requests, "mixed", {}), setup(num_blocks=512, max_model_len=256, max_num_seqs=8,
                                                            max_num_batched_tokens=64, scheduling_policy=policy,
                                                            **extra))
        assert all(r.success for r in run.records)
        return [r.ttft for r in run.records], run

    as_fcfs = [TraceRequest(r.arrival_s, r.prompt_token_ids, r.output_len) for r in arrivals]  # fcfs: priority 0 only
    fcfs, fcfs_run = ttfts(as_fcfs, "fcfs")
    prio, prio_run = ttfts(arrivals, "priority")
    alone, _ = ttfts([arrivals[i] for i in high], "priority")
    fcfs_high, prio_high = max(fcfs[i] for i in high), max(prio[i] for i in high)
    assert max(alone) == pytest.approx(0.1 + 16 * 0.01)  # one prefill step, nothing else running
    print(f"max TTFT of high-priority requests: fcfs {fcfs_high:.2f} s, priority {prio_high:.2f} s, "
          f"alone {max(alone):.2f} s")
    assert fcfs_high > 4.0  # queued behind the low-priority backlog
    assert prio_high < 1.0 < 4 * max(alone)  # the step in flight + its own (a full 64-token step: 0.82 s)
    assert prio_run.duration == pytest.approx(fcfs_run.duration, rel=0.05)
    assert max(prio[i] for i in range(len(arrivals)) if i not in high) >= max(fcfs)  # low ones pay for it
    bound, bound_run = ttfts(arrivals, "priority", 0.25)
    bound_high = sorted(bound[i] for i in high)
    print(f"with the step bound: high-priority TTFT max {bound_high[-1]:.2f} s, median "
          f"{bound_high[len(high) // 2]:.2f} s; all done at {bound_run.duration:.1f} s "
          f"(without: {prio_run.duration:.1f} s)")
    assert bound_high[-1] < prio_high
    assert bound_run.duration > prio_run.duration


# A step cost like the default model's on this machine (docs/planning.md: 53 ms + 1.55 ms per
# prefill token; pure decode 46 / 63 / 130 / 222 ms at 1 / 8 / 32 / 64 rows).
CPU_LIKE = StepCostModel(0.053, 0.00155, 0.0028, 0.0, decode_rows=(1, 8, 32, 64),
                         decode_seconds=(0.046, 0.063, 0.130, 0.222))


@pytest.mark.parametrize("rate", [1.0, 2.0])
def test_slo_mode_keeps_more_goodput_than_fcfs(rate):
    """200 requests (128-token prompts, 64 outputs), goodput = TTFT <= 1 s and TPOT <= 100 ms.
    fcfs lets TPOT run over (64 sequences, whole prompts in one step); SLO mode keeps every
    stream's TPOT, and what misses its TTFT waits until nothing else runs."""
    from tokenmill.workloads.metrics import tpot_of

    dataset = DatasetConfig(name="random", num_prompts=200, input_len=128, output_len=64, seed=0)

    def shares(**settings):
        sim = SimulationSetup(EngineConfig.from_kwargs(**settings), 4096, 4096, CPU_LIKE, model_name="m")
        records = simulate(synthetic_trace(dataset, rate), sim).records
        assert all(r.success for r in records)
        ttft_ok = [r.ttft <= 1.0 for r in records]
        tpot_ok = [tpot_of(r) <= 0.1 for r in records]
        good = sum(a and b for a, b in zip(ttft_ok, tpot_ok)) / len(records)
        return good, sum(ttft_ok) / len(records), sum(tpot_ok) / len(records)

    fcfs, slo = shares(), shares(slo_ttft_ms=1000, slo_tpot_ms=100)
    print(f"rate {rate}: goodput fcfs {fcfs[0]:.0%} (TTFT ok {fcfs[1]:.0%}, TPOT ok {fcfs[2]:.0%}), "
          f"SLO mode {slo[0]:.0%} (TTFT ok {slo[1]:.0%}, TPOT ok {slo[2]:.0%})")
    assert slo[2] == 1.0  # every stream keeps its TPOT
    assert slo[0] > fcfs[0]
    if rate == 2.0:
        assert fcfs[0] < 0.2 and slo[0] > 0.4  # fcfs has collapsed; SLO mode keeps what it can


def test_simulate_flags_that_mean_engine_settings_are_the_engines() -> None:
    """--kv-cache-dtype, -tp and -pp are serve's flags (one declaration, config.py), read by
    the engine config and the roofline alike; --device is the old spelling of --target-device."""
    from tokenmill.cli import build_parser
    from tokenmill.config import config_from_args

    args = build_parser().parse_args(["simulate", "--device", "h100-sxm", "-tp", "2", "--kv-cache-dtype", "fp8"])
    config = config_from_args(args)
    assert args.target_device == "h100-sxm" and config.parallel.tensor_parallel_size == 2
    assert config.cache.kv_cache_dtype == "fp8" and args.gpu_memory_utilization is None
    calibrate = build_parser().parse_args(["simulate", "calibrate", "--device", "cpu"])
    assert calibrate.device == "cpu"  # the engine's device where the model runs
