"""Online recalibration (serve/recalibration.py) and the what-if planner
(simulator/what_if.py): the step cost model refit from a server's recent steps, and the
predictions of a proposed configuration made with it."""

from __future__ import annotations

import math
import statistics

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import StepRecord
from tokenmill.planner.costmodel import StepCostModel, StepFeatures
from tokenmill.serve.recalibration import MIN_STEPS, OnlineCalibration, scale_model
from tokenmill.simulator.what_if import what_if

LINEAR = StepCostModel(0.05, 0.002, 0.004, 1e-5)


def record(prefill: int, decode: int, context: int, seconds: float) -> StepRecord:
    return StepRecord(index=0, started=0.0, schedule_s=0.0, execute_s=seconds, process_s=0.0,
                      num_prefill_tokens=prefill, num_decode_tokens=decode, num_scheduled=1, num_generated=1,
                      num_decode_context_tokens=context)


def shapes(count: int) -> list[tuple[int, int, int]]:
    """Varied steps: prefill chunks with and without decode rows, decode batches of several
    sizes and contexts."""
    out = []
    for i in range(count):
        prefill = (0, 0, 16, 64, 128)[i % 5]
        decode = (1, 4, 0, 8, 2)[(i // 5) % 5] if prefill == 0 or i % 2 else 0
        decode = decode or (1 if prefill == 0 else 0)
        out.append((prefill, decode, decode * (20 + 7 * i)))
    return out


def feed(calibration: OnlineCalibration, model: StepCostModel, count: int, factor: float = 1.0) -> None:
    for p, d, c in shapes(count):
        calibration.on_step(record(p, d, c, factor * model.predict(StepFeatures(p, d, c))), [])


def test_refit_recovers_the_machine_the_steps_came_from() -> None:
    # A calibration of another shape (more per step, less per token): no scale fixes it.
    calibration = OnlineCalibration(base=StepCostModel(0.2, 0.0005, 0.001, 0.0))
    feed(calibration, LINEAR, 100)
    online = calibration.model()
    assert online.source == "refit" and online.steps == 100
    assert online.median_relative_error < 1e-6
    model = online.model
    assert (model.intercept_s, model.per_prefill_token_s, model.per_decode_token_s, model.per_context_token_s) == \
        pytest.approx((0.05, 0.002, 0.004, 1e-5), rel=1e-4)


def test_traffic_that_cannot_identify_a_refit_scales_the_calibration() -> None:
    """Only single-row decode steps: no prefill to fit, so the calibration is scaled by
    measured / predicted (the machine runs 1.7x slower than when it was calibrated)."""
    calibration = OnlineCalibration(base=LINEAR)
    for i in range(64):
        calibration.on_step(record(0, 1, 30 + i, 1.7 * LINEAR.predict(StepFeatures(0, 1, 30 + i))), [])
    online = calibration.model()
    assert online.source == "scaled calibration" and online.scale == pytest.approx(1.7)
    assert online.model.predict(StepFeatures(100, 4, 400)) == pytest.approx(1.7 * LINEAR.predict(
        StepFeatures(100, 4, 400)))


def test_too_few_steps_keep_the_calibration_or_nothing() -> None:
    calibration = OnlineCalibration(base=LINEAR)
    feed(calibration, LINEAR, MIN_STEPS - 1, factor=2.0)
    assert calibration.model().source == "calibration" and calibration.model().model is LINEAR
    empty = OnlineCalibration()
    feed(empty, LINEAR, MIN_STEPS - 1)
    assert empty.model().model is None and empty.model().source == "none"
    empty.on_step(record(0, 0, 0, 0.1), [])  # a step that computed nothing is not a sample
    assert len(empty.samples()) == MIN_STEPS - 1


def test_the_window_forgets_old_load() -> None:
    """The machine was 2x slower, then back to normal: once the window holds only the new
    steps, the refit is the new machine."""
    calibration = OnlineCalibration(window=64)
    feed(calibration, LINEAR, 64, factor=2.0)
    assert calibration.model().model.intercept_s == pytest.approx(0.1, rel=1e-3)
    feed(calibration, LINEAR, 64)
    assert calibration.model().model.intercept_s == pytest.approx(0.05, rel=1e-3)


def test_refit_on_real_steps_moves_toward_the_measured_cost(tmp_path) -> None:
    """A real engine (a tiny random Llama, float32) with a calibration 50x too slow: after
    some varied traffic, the online model predicts the next real steps within a factor of
    2 (median), where the calibration was off by more than 10x."""
    from tests.tiny_checkpoint import write_tiny_llama
    from tokenmill.llm import LLM
    from tokenmill.sampling.params import SamplingParams

    path = write_tiny_llama(tmp_path / "tiny")
    llm = LLM(model=str(path), dtype="float32", num_threads=1, max_num_batched_tokens=48, max_num_seqs=8,
              kv_cache_memory=16 * 2**20)
    measured = OnlineCalibration()
    llm.engine.add_observer(measured)
    fast = measured.samples()
    assert not fast
    rough = StepCostModel(0.002, 1e-5, 1e-4, 0.0)  # a guess, then made 50x too slow
    calibration = OnlineCalibration(base=scale_model(rough, 50.0))
    llm.engine.add_observer(calibration)

    def traffic(seed: int) -> None:
        words = [f"w{i}" for i in range(40)]
        prompts = [" ".join(words[(seed + i) % 7: (seed + i) % 7 + 3 + 9 * (i % 4)]) for i in range(12)]
        params = [SamplingParams(max_tokens=4 + 5 * (i % 3), ignore_eos=True) for i in range(12)]
        for start in (0, 4, 6):
            llm.generate(prompts[start:start + 6], params[start:start + 6])

    traffic(0)
    online = calibration.model()
    assert online.steps >= MIN_STEPS and online.source in ("refit", "scaled calibration")
    seen = len(measured.samples())
    traffic(3)  # steps the model has not seen
    fresh = measured.samples()[seen:]
    assert len(fresh) >= 10

    def median_ratio(model: StepCostModel) -> float:
        return statistics.median(model.predict(f) / seconds for f, seconds in fresh)

    assert median_ratio(calibration.base) > 10
    assert 0.5 < median_ratio(online.model) < 2.0, online.to_dict()


# ----- what-if ------------------------------------------------------------------------------


def plan(body: dict, **settings) -> dict:
    config = EngineConfig.from_kwargs(max_num_seqs=16, max_num_batched_tokens=512, **settings)
    return what_if(config, num_blocks=4096, max_model_len=4096, cost_model=LINEAR, body=body)


def test_what_if_predicts_more_latency_under_more_load() -> None:
    load = {"num_prompts": 60, "input_len": 64, "output_len": 16}
    light = plan({"load": {**load, "request_rate": 0.5}, "goodput": {"ttft": 1000, "tpot": 100}})
    heavy = plan({"load": {**load, "request_rate": 50}, "goodput": {"ttft": 1000, "tpot": 100}})
    assert light["object"] == "plan" and light["predicted"]["completed"] == 60
    # Alone, a request's first step is a 64-token prefill: 0.05 + 0.128 s.
    assert light["predicted"]["median_ttft_ms"] == pytest.approx(178, rel=0.1)
    assert heavy["predicted"]["p99_ttft_ms"] > 5 * light["predicted"]["p99_ttft_ms"]
    assert light["predicted"]["goodput_fraction"] == 1.0 > heavy["predicted"]["goodput_fraction"]
    # The settings proposed change the prediction; the answer names them.
    small = plan({"settings": {"max_num_seqs": 1}, "load": {**load, "request_rate": 2}})
    assert small["settings"]["max_num_seqs"] == 1
    assert small["predicted"]["p99_ttft_ms"] > plan({"load": {**load, "request_rate": 2}})["predicted"]["p99_ttft_ms"]
    inf = plan({"load": {**load, "request_rate": math.inf}})
    assert inf["load"]["request_rate"] == "inf"
    # Early rejection in the simulation: refused requests are failures (the server's 429s),
    # once the engine has timed enough steps to predict.
    long_load = {**load, "num_prompts": 300, "request_rate": 20}
    rejecting = plan({"settings": {"slo_ttft_ms": 1000, "slo_reject": True}, "load": long_load,
                      "goodput": {"ttft": 1000}})
    queueing = plan({"load": long_load, "goodput": {"ttft": 1000}})
    assert rejecting["predicted"]["failed"] > 0 and queueing["predicted"]["failed"] == 0
    assert rejecting["predicted"]["goodput_fraction"] > queueing["predicted"]["goodput_fraction"]


@pytest.mark.parametrize(("body", "message"), [
    ({"settings": {"model": "x"}}, "model cannot be changed by a what-if"),
    ({"settings": {"max_num_seqs": 0}}, "max_num_seqs must be at least 1"),
    ({"settings": {"max_num_seqs": "many"}}, "settings:"),
    ({"load": {"num_prompts": 10**6}}, "load.num_prompts must be at most"),
    ({"load": {"request_rate": -1}}, "load.request_rate must be a number from 0.001"),
    ({"load": {"burstiness": 5e-324}}, "load.burstiness must be a number from 0.001 to 1000"),  # never ended
    ({"load": {"request_rate": 1e-300}}, "load.request_rate must be a number from 0.001"),
    ({"load": {"qps": 1}}, "load: unknown key"),
    ({"goodput": {"latency": 5}}, "goodput: 'latency' is not one of"),
    ({"extra": 1}, "unknown key"),
    ([1, 2], "must be a JSON object"),
    # bounded work: a 60-byte body took 0.9 GB (prompt ids made) or 126 s of CPU (steps)
    ({"load": {"input_len": 5_000_000, "num_prompts": 4}}, "must be at most 2,000,000 tokens"),
    ({"load": {"input_len": 1, "output_len": 1000, "num_prompts": 2000}}, "must be at most 2,000,000 tokens"),
    ({"settings": {"max_num_seqs": 1}, "load": {"input_len": 1, "output_len": 300, "num_prompts": 100,
                                                "request_rate": math.inf}}, "more than 20,000 engine steps"),
    # a section that is not an object was taken for {} when falsy
    ({"settings": []}, "settings must be an object"),
    ({"load": 0}, "load must be an object"),
    ({"goodput": ""}, "goodput must be an object"),
])
def test_what_if_refuses_a_bad_body_with_a_message(body, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan(body)
