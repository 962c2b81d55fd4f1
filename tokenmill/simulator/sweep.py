"""`tokenmill simulate sweep`: simulated runs over request rates or concurrency caps, and
optionally over a grid of engine settings; the files and figures of `bench sweep`.

Each point draws its trace as `bench sweep` draws that point's prompts and arrivals (the
seed offset by the point's index), so a simulated sweep and a measured one with the same
flags replay the same requests. Per engine setting of the grid, the results go to
`OUTPUT_DIR/rate-R.json` (or `concurrency-C.json`), `sweep.json` and `sweep.png` (in a
sub-directory named after the setting when there is a grid).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.config import engine_settings
from tokenmill.planner.costmodel import KVTransferCost
from tokenmill.simulator.disaggregation import Layout
from tokenmill.simulator.setup import with_settings
from tokenmill.simulator.simulate import SimulationSetup, result_dict, simulate
from tokenmill.workloads.datasets import DatasetConfig
from tokenmill.workloads.load_client import save_result
from tokenmill.workloads.metrics import DEFAULT_PERCENTILES
from tokenmill.workloads.sweep import SweepPoint, summary_row
from tokenmill.workloads.trace import Trace, synthetic_trace

# Summary keys the simulator adds to bench sweep's.
EXTRA_SUMMARY_KEYS = ("num_preemptions", "max_kv_usage", "mean_kv_usage", "p90_ttft_ms", "simulation_wall_s")


@dataclass(frozen=True)
class Report:
    goodput: dict[str, float] | None = None
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    label: str | None = None


def run_point(trace: Trace, setup: SimulationSetup, max_concurrency: int | None, report: Report,
              layout: Layout | None = None, transfer: KVTransferCost | None = None) -> dict[str, Any]:
    run = simulate(trace, setup, max_concurrency, layout=layout, transfer=transfer)
    return result_dict(trace, setup, run, max_concurrency=max_concurrency, goodput=report.goodput,
                       percentiles=report.percentiles, label=report.label)


def parse_grid(specs: Sequence[str] | None) -> list[dict[str, Any]]:
    """["max_num_seqs=8,16", "max_num_batched_tokens=512,2048"] -> every combination, as
    engine settings (names as `serve`'s flags, dashes or underscores)."""
    if not specs:
        return [{}]
    known = {s.name: s for s in engine_settings()}
    axes: list[tuple[str, list[Any]]] = []
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not values.strip():
            raise ValueError(f"--grid {spec!r} is not NAME=V1,V2,... (e.g. max_num_seqs=8,16,32)")
        if name not in known:
            raise ValueError(f"--grid {spec!r}: {name!r} is not an engine setting; known: {', '.join(sorted(known))}")
        setting = known[name]
        parsed = [_grid_value(setting, v.strip(), spec) for v in values.split(",") if v.strip()]
        axes.append((name, parsed))
    names = [name for name, _ in axes]
    return [dict(zip(names, combo)) for combo in itertools.product(*(values for _, values in axes))]


def _grid_value(setting, text: str, spec: str) -> Any:
    if setting.is_bool:
        if text.lower() not in ("true", "false", "on", "off", "1", "0", "yes", "no"):
            raise ValueError(f"--grid {spec!r}: {text!r} is not a boolean")
        return text.lower() in ("true", "on", "1", "yes")
    if setting.name == "kv_cache_memory":
        return text  # parsed by the config ('2GiB')
    try:
        return setting.value_type(text)
    except ValueError:
        raise ValueError(f"--grid {spec!r}: {text!r} is not a {setting.value_type.__name__}") from None


def grid_label(settings: dict[str, Any]) -> str:
    return ",".join(f"{name}={value}" for name, value in settings.items()) or "base"


def run_sweep(setup: SimulationSetup, dataset: DatasetConfig, axis: str, points: Sequence[SweepPoint],
              burstiness: float, report: Report, output_dir: str, grid: Sequence[dict[str, Any]] = ({},),
              plot_path: str | None = None, plot_runs: bool = False, layouts: Sequence[Layout | None] = (None,),
              transfer: KVTransferCost | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every point for every layout (several instances: simulator/disaggregation.py) and grid
    setting: {label: results}. Files as `bench sweep`, in a directory per label when there
    are several."""
    from tokenmill.workloads.plots import plot_run, plot_sweep

    if not points:
        raise ValueError("the sweep has no points")
    traces = [synthetic_trace(dataset, point.request_rate, burstiness, seed_offset=index)
              for index, point in enumerate(points)]
    everything: dict[str, list[dict[str, Any]]] = {}
    combinations = [(layout, settings) for layout in layouts for settings in grid]
    for layout, settings in combinations:
        label = grid_label(settings)
        if layout is not None:
            label = layout.name.replace(" ", "-") + ("" if label == "base" else f",{label}")
        point_setup = with_settings(setup, **settings) if settings else setup
        directory = os.path.join(output_dir, label) if len(combinations) > 1 else output_dir
        os.makedirs(directory, exist_ok=True)
        results = []
        for trace, point in zip(traces, points):
            result = run_point(trace, point_setup, point.max_concurrency,
                               Report(report.goodput, report.percentiles, report.label or label), layout, transfer)
            result["engine_grid"] = settings
            path = os.path.join(directory, point.file_name(axis))
            save_result(result, path)
            if plot_runs:
                plot_run(result, path.removesuffix(".json") + ".png")
            results.append(result)
        with open(os.path.join(directory, "sweep.json"), "w", encoding="utf-8") as file:
            rows = [{**summary_row(r), **{k: r.get(k) for k in EXTRA_SUMMARY_KEYS}} for r in results]
            json.dump({"axis": axis, "engine_grid": settings, "points": rows}, file, indent=1)
            file.write("\n")
        figure = plot_path if plot_path and len(combinations) == 1 else os.path.join(directory, "sweep.png")
        plot_sweep(results, figure, axis)
        everything[label] = results
    return everything

