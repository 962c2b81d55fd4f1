"""`tokenmill tune`: the scheduling settings that keep the most goodput for a trace (issue 29).

Given a trace (a `bench serve` result, or a dataset and a request rate) and SLOs, every
combination of a grid of settings (`--max-num-seqs`, `--max-num-batched-tokens`,
`--scheduling-policy`, SLO mode off or on at the SLOs) is run through the simulator on
virtual time, with this machine's calibrated step cost (or a device's roofline), and again
with every step 0.8x and 1.25x as long (`COST_SCALES`). The candidates are ranked by their
predicted goodput (the fraction of requests meeting every SLO) averaged over the three, then
by p99 TTFT. Why three: a shared machine's step cost moves 10-25% with its other jobs, a
calibration catches one moment of it, and near the machine's capacity such a shift moves a
setting's goodput by tens of points: ranked on one calibration, tune picked fcfs with 64
sequences (predicted 100%) for a load where it measured 0-9% (docs/scheduling.md). Optionally the best few are confirmed on the real server (a fresh
`tokenmill serve` per candidate, the same load sent by `bench serve`), and the winner is
written as a `serve --config` YAML.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.planner.costmodel import ScaledStepModel
from tokenmill.simulator.setup import with_settings
from tokenmill.simulator.simulate import SimulationSetup, simulate
from tokenmill.workloads.metrics import meets_slos
from tokenmill.workloads.trace import Trace

DEFAULT_SPACE: dict[str, list[Any]] = {
    "max_num_seqs": [8, 16, 32, 64],
    "max_num_batched_tokens": [256, 512, 1024, 2048],
    "scheduling_policy": ["fcfs"],
    "slo_mode": [False, True],
}
# SLO mode's flags are the goodput SLOs of the same names.
SLO_FLAGS = {"ttft": "slo_ttft_ms", "tpot": "slo_tpot_ms"}
# The step cost as calibrated, and a slower and a faster phase of the same machine.
COST_SCALES = (1.0, 0.8, 1.25)


@dataclass
class Candidate:
    settings: dict[str, Any]  # engine settings, as serve's flags (underscores)
    predicted_goodput: float  # fraction of the trace's requests meeting every SLO (mean over the cost scales)
    predicted_p99_ttft_ms: float
    predicted_throughput: float  # completed requests per second
    goodput_by_scale: dict[float, float] = field(default_factory=dict)  # cost scale -> predicted goodput
    measured_goodput: float | None = None
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def flags(self) -> list[str]:
        """serve's flags for these settings."""
        out = []
        for name, value in self.settings.items():
            flag = name.replace("_", "-")
            if isinstance(value, bool):
                out.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                out += [f"--{flag}", _flag_value(value)]
        return out


def search_space(overrides: Sequence[dict[str, Any]] | None, has_priorities: bool,
                 slo_modes: Sequence[bool] = (False, True)) -> list[dict[str, Any]]:
    """Every combination of the default axes, each replaced by what `overrides` (parsed
    `--grid` settings, one dict per combination) give for it. The priority policy joins
    the default axis only when the trace's requests have priorities (else it is fcfs)."""
    space = {name: list(values) for name, values in DEFAULT_SPACE.items()}
    space["slo_mode"] = list(slo_modes)
    if has_priorities:
        space["scheduling_policy"] = ["fcfs", "priority"]
    for name in {n for combo in overrides or [] for n in combo}:
        space[name] = sorted({combo[name] for combo in overrides if name in combo}, key=repr)
    names = list(space)
    return [dict(zip(names, combo)) for combo in itertools.product(*(space[n] for n in names))]


def engine_settings(point: dict[str, Any], goodput: dict[str, float]) -> dict[str, Any]:
    """A search point as engine settings: slo_mode on sets the SLO flags to the goodput
    SLOs (TTFT and TPOT; e2el has no flag)."""
    settings = {k: v for k, v in point.items() if k != "slo_mode"}
    if point.get("slo_mode"):
        settings.update({flag: goodput[name] for name, flag in SLO_FLAGS.items() if name in goodput})
    return settings


def evaluate(trace: Trace, setup: SimulationSetup, settings: dict[str, Any], goodput: dict[str, float],
             max_concurrency: int | None = None, cost_scales: Sequence[float] = (1.0,)) -> Candidate:
    """Simulated runs of `trace` under `setup` changed by `settings`, one per cost scale (the
    engine knows its step cost from the start, as a server that has been running); the
    goodput, p99 TTFT and throughput are their means."""
    runs = [_evaluate_once(trace, replace(setup, cost_model=ScaledStepModel(setup.cost_model, scale)) if scale != 1.0
                           else setup, settings, goodput, max_concurrency) for scale in cost_scales]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return Candidate(settings, mean([g for g, _, _ in runs]), mean([p for _, p, _ in runs]),
                     mean([t for _, _, t in runs]), dict(zip(cost_scales, (g for g, _, _ in runs))))


def _evaluate_once(trace: Trace, setup: SimulationSetup, settings: dict[str, Any], goodput: dict[str, float],
                   max_concurrency: int | None) -> tuple[float, float, float]:
    """(goodput, p99 TTFT in ms, completed requests per second) of one simulated run."""
    run = simulate(trace, with_settings(setup, **settings), max_concurrency, warm_step_cost=True)
    good = sum(1 for r in run.records if r.success and meets_slos(r, goodput))
    ttfts = sorted(r.ttft for r in run.records if r.success)
    p99 = ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)] * 1e3 if ttfts else math.inf
    completed = sum(1 for r in run.records if r.success)
    return good / len(run.records), p99, completed / run.duration


def search(trace: Trace, setup: SimulationSetup, goodput: dict[str, float],
           overrides: Sequence[dict[str, Any]] | None = None, slo_modes: Sequence[bool] = (False, True),
           max_concurrency: int | None = None, log: Callable[[str], None] | None = None,
           cost_scales: Sequence[float] = COST_SCALES) -> list[Candidate]:
    """Every point of the search space simulated at every cost scale; best first (mean
    goodput, then mean p99 TTFT)."""
    if not goodput:
        raise ValueError("tune needs SLOs to count goodput: --goodput ttft:MS tpot:MS")
    has_priorities = any(r.priority != 0 for r in trace.requests)
    points = search_space(overrides, has_priorities, slo_modes)
    seen: dict[tuple, Candidate] = {}
    for index, point in enumerate(points):
        settings = engine_settings(point, goodput)
        key = tuple(sorted((k, repr(v)) for k, v in settings.items()))
        if key not in seen:
            seen[key] = evaluate(trace, setup, settings, goodput, max_concurrency, cost_scales)
            if log:
                c = seen[key]
                log(f"{index + 1}/{len(points)} {_describe(settings)}: goodput {c.predicted_goodput:.0%}")
    return rank(list(seen.values()))


def rank(candidates: list[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (-c.predicted_goodput, c.predicted_p99_ttft_ms, -c.predicted_throughput))


def confirm(candidates: Sequence[Candidate], base_flags: Sequence[str], serve_config,
            log: Callable[[str], None] | None = None) -> None:
    """Measure each candidate on a fresh real server (`tokenmill serve BASE_FLAGS FLAGS`)
    with `serve_config`'s load (bench serve); sets measured_goodput."""
    from tokenmill.workloads.load_client import run_benchmark
    from tokenmill.workloads.local_server import LocalServer

    for candidate in candidates:
        flags = [*base_flags, *candidate.flags]
        if log:
            log(f"confirming on a real server: tokenmill serve {' '.join(flags)}")
        started = time.monotonic()
        with LocalServer([*flags, "--disable-access-log"]) as server:
            serve_config.base_url = server.url
            result = run_benchmark(serve_config)
        good = result.get("request_goodput")
        candidate.measured_goodput = good * result["duration"] / len(result["ttfts"]) if good is not None else None
        candidate.measured = {k: result.get(k) for k in ("completed", "failed", "p99_ttft_ms", "mean_tpot_ms",
                                                          "request_throughput", "duration")}
        candidate.measured["wall_s"] = time.monotonic() - started


def config_yaml(candidate: Candidate, header: str = "") -> str:
    """The settings as a `serve --config` file (keys as the flags, with underscores)."""
    import yaml

    lines = [f"# {line}" for line in header.splitlines()] if header else []
    return "\n".join(lines) + ("\n" if lines else "") + yaml.safe_dump(dict(candidate.settings), sort_keys=False)


def format_candidates(candidates: Sequence[Candidate], top: int) -> str:
    rows = [f"{'rank':>4}  {'settings':<72} {'goodput':>8} {'p99 TTFT':>10} {'req/s':>7} {'measured':>9}"]
    for index, c in enumerate(candidates[:top]):
        measured = f"{c.measured_goodput:.0%}" if c.measured_goodput is not None else "-"
        rows.append(f"{index + 1:>4}  {_describe(c.settings):<72} {c.predicted_goodput:>8.0%} "
                    f"{c.predicted_p99_ttft_ms / 1e3:>9.2f}s {c.predicted_throughput:>7.2f} {measured:>9}")
    return "\n".join(rows)


def _describe(settings: dict[str, Any]) -> str:
    return " ".join(f"{k}={_flag_value(v)}" for k, v in settings.items())


def _flag_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).lower() if isinstance(value, bool) else str(value)
