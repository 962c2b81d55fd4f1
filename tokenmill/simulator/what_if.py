"""What if the server ran other settings, or another load? (`POST /v1/plan`, issue 29)

The server's engine settings and KV cache, a step cost model (the server's online refit,
serve/recalibration.py), a proposed change of scheduling settings and a load: the
simulator runs the load on virtual time and the answer is the predicted TTFT, TPOT and
goodput, in `bench serve`'s keys. vLLM has no such endpoint; the request and answer are
tokenmill's own (docs/scheduling.md).

Request body (JSON), every key optional:

    {"settings": {"max_num_seqs": 32, "max_num_batched_tokens": 512,
                  "scheduling_policy": "fcfs", "slo_ttft_ms": 1000, "slo_tpot_ms": 100},
     "load": {"request_rate": 2.0, "num_prompts": 200, "input_len": 128, "output_len": 64,
              "burstiness": 1.0, "seed": 0},
     "goodput": {"ttft": 1000, "tpot": 100}}
"""

from __future__ import annotations

import math
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.planner.costmodel import StepCostModel, StepTimeModel
from tokenmill.simulator.simulate import SimulationSetup, simulate
from tokenmill.workloads.datasets import DatasetConfig
from tokenmill.workloads.metrics import SLO_METRICS, calculate_metrics, meets_slos
from tokenmill.workloads.trace import synthetic_trace

# The settings a what-if may change: scheduling, not what loading the model decides.
SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy", "priority_aging", "slo_ttft_ms",
            "slo_tpot_ms", "slo_reject", "enable_prefix_caching")
LOAD_DEFAULTS = {"request_rate": 1.0, "num_prompts": 200, "input_len": 128, "output_len": 64, "burstiness": 1.0,
                 "seed": 0}
# A what-if runs on the server's CPU: bounded. The tokens of the load are made (prompt ids)
# and timed (outputs), and each simulated engine step costs ~0.1 ms here: before the
# bounds, a 60-byte body (`input_len` 5,000,000, 4 prompts) took 0.9 GB and 8 s, 2,000 such
# prompts would take the server's memory, and 2,000 prompts of 500 output tokens at
# `max_num_seqs` 1 took 126 s of CPU.
MAX_PROMPTS = 2000
MAX_LOAD_TOKENS = 2_000_000  # num_prompts x (input_len + output_len)
MAX_STEPS = 20_000  # simulated engine steps (~2 s)
# A burstiness of 5e-324 made the arrival gaps' gamma scale infinite and the simulation
# never end (a request held a server thread for good); a rate of 1e-300 asks for 1e300 s.
RATE_RANGES = {"request_rate": (0.001, math.inf), "burstiness": (0.001, 1000.0)}
PREDICTED = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
             "request_throughput", "output_throughput")


def what_if(config: EngineConfig, num_blocks: int, max_model_len: int, cost_model: StepTimeModel,
            body: dict[str, Any], cost_source: str = "") -> dict[str, Any]:
    """Simulate `body`'s load under `config` changed by `body`'s settings; ValueError
    (with a message naming the key) for a bad body."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with optional keys settings, load, goodput")
    unknown = set(body) - {"settings", "load", "goodput"}
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}; expected settings, load, goodput")
    # null is "not given"; anything else must be an object (`[]` and `0` were taken for {})
    settings = _settings({} if body.get("settings") is None else body["settings"])
    load = _load({} if body.get("load") is None else body["load"])
    goodput = _goodput({} if body.get("goodput") is None else body["goodput"])
    try:
        proposed = config.replace(**settings)
    except TypeError as error:  # a value of the wrong type met a comparison
        raise ValueError(f"settings: {error}") from None
    setup = SimulationSetup(proposed, num_blocks, max_model_len, cost_model, model_name="what-if",
                            cost_model_source=cost_source)
    dataset = DatasetConfig(name="random", num_prompts=load["num_prompts"], input_len=load["input_len"],
                            output_len=load["output_len"], seed=load["seed"])
    trace = synthetic_trace(dataset, load["request_rate"], load["burstiness"])
    try:  # a running server knows its step cost
        run = simulate(trace, setup, warm_step_cost=True, max_steps=MAX_STEPS)
    except RuntimeError as error:  # the proposed settings cannot schedule the load
        raise ValueError(f"settings: {error}") from None
    metrics = calculate_metrics(run.records, run.duration, goodput or None)
    predicted = {key: metrics[key] for key in PREDICTED}
    predicted["completed"] = metrics["completed"]
    predicted["failed"] = metrics["failed"]
    if goodput:
        good = sum(1 for r in run.records if r.success and meets_slos(r, goodput))
        predicted["goodput_fraction"] = good / len(run.records)
        predicted["request_goodput"] = metrics["request_goodput"]
    sections = (proposed.scheduler, proposed.cache)
    return {
        "object": "plan",
        "settings": {name: next(getattr(s, name) for s in sections if hasattr(s, name)) for name in SETTINGS},
        "load": {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in load.items()},
        "goodput_slos_ms": goodput or None,
        "predicted": predicted,
        "simulated_seconds": run.duration,
        "simulation_wall_s": run.wall_seconds,
    }


def _settings(settings: Any) -> dict[str, Any]:
    if not isinstance(settings, dict):
        raise ValueError("settings must be an object of engine settings")
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(f"settings: {', '.join(sorted(unknown))} cannot be changed by a what-if; "
                         f"it may change {', '.join(SETTINGS)}")
    return settings


def _load(load: Any) -> dict[str, Any]:
    if not isinstance(load, dict):
        raise ValueError("load must be an object")
    unknown = set(load) - set(LOAD_DEFAULTS)
    if unknown:
        raise ValueError(f"load: unknown key(s) {', '.join(sorted(unknown))}; expected {', '.join(LOAD_DEFAULTS)}")
    values = {**LOAD_DEFAULTS, **load}
    for name in ("num_prompts", "input_len", "output_len", "seed"):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
            raise ValueError(f"load.{name} must be a {'non-negative' if name == 'seed' else 'positive'} integer, "
                             f"got {value!r}")
    if values["num_prompts"] > MAX_PROMPTS:
        raise ValueError(f"load.num_prompts must be at most {MAX_PROMPTS}, got {values['num_prompts']}")
    tokens = values["num_prompts"] * (values["input_len"] + values["output_len"])
    if tokens > MAX_LOAD_TOKENS:
        raise ValueError(f"load: num_prompts x (input_len + output_len) must be at most {MAX_LOAD_TOKENS:,} "
                         f"tokens, got {tokens:,}")
    for name, (low, high) in RATE_RANGES.items():
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"load.{name} must be a number from {low} to {high} (request_rate may be inf), "
                             f"got {value!r}")
    return values


def _goodput(goodput: Any) -> dict[str, float]:
    if not isinstance(goodput, dict):
        raise ValueError("goodput must be an object of SLOs in milliseconds, e.g. {\"ttft\": 1000, \"tpot\": 100}")
    for name, value in goodput.items():
        if name not in SLO_METRICS:
            raise ValueError(f"goodput: {name!r} is not one of {', '.join(SLO_METRICS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"goodput.{name} must be a finite number of milliseconds >= 0, got {value!r}")
    return {name: float(value) for name, value in goodput.items()}


# The body in the server's OpenAPI schema: its keys and what _load and _goodput check (the
# settings' values are checked by the engine config).
BODY_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "settings": {"type": ["object", "null"], "additionalProperties": False,
                     "properties": {name: {} for name in SETTINGS}},
        "load": {"type": ["object", "null"], "additionalProperties": False, "properties": {
            **{name: {"type": "number", "minimum": low, **({} if math.isinf(high) else {"maximum": high})}
               for name, (low, high) in RATE_RANGES.items()},
            "num_prompts": {"type": "integer", "minimum": 1, "maximum": MAX_PROMPTS},
            "input_len": {"type": "integer", "minimum": 1}, "output_len": {"type": "integer", "minimum": 1},
            "seed": {"type": "integer", "minimum": 0}}},
        "goodput": {"type": ["object", "null"], "additionalProperties": False,
                    "properties": {name: {"type": "number", "minimum": 0} for name in SLO_METRICS}},
    },
}


class SimulatorPlanner:
    """The server's what-if planner (serve/recalibration.py's Planner)."""

    body_schema = BODY_SCHEMA

    def base_model(self, config: EngineConfig) -> tuple[StepCostModel | None, str]:
        from tokenmill.simulator.setup import resolve_profile

        try:
            profile, path = resolve_profile(config)
        except (FileNotFoundError, ValueError):
            return None, ""
        return profile.cost_model, f"calibration {path}"

    def what_if(self, config: EngineConfig, num_blocks: int, max_model_len: int, cost_model: StepCostModel,
                body: dict[str, Any], cost_source: str = "") -> dict[str, Any]:
        return what_if(config, num_blocks, max_model_len, cost_model, body, cost_source)
