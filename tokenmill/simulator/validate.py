"""`tokenmill simulate validate`: the simulator's predictions against a measured sweep.

It starts `tokenmill serve` with the engine settings given (a subprocess on a free
loopback port), runs `bench sweep` over the request rates, stops the server, and replays
every measured point's requests (their send times, prompt and output lengths, from the
result file) through the simulator with the calibrated cost model. `--repeats` does it
again (a shared machine's runs scatter), and `--calibrate` calibrates around every point
of the sweep (`measure_calibrated`): on a machine whose load changes, the step costs
change with it, and a calibration only describes the minutes around it. Per rate it prints the median over the repeats
of the measured and the predicted median TTFT, median TPOT, output throughput and p90
TTFT, with the relative error; and the saturation rate (the most requests per second any
point achieved), against the targets of issue 16 (15%, 15%, 15%, 25%; 10%).
`--measured DIR` compares against a sweep measured before instead (a `bench sweep`
output directory, or this command's `measured/`).
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.simulator.simulate import SimulationSetup
from tokenmill.simulator.sweep import Report, run_point
from tokenmill.workloads.load_client import save_result
from tokenmill.workloads.trace import load_result, trace_from_result

Log = Callable[[str], None]

# (result key, what the table calls it, the target for |predicted - measured| / measured)
COMPARED = (
    ("median_ttft_ms", "median TTFT ms", 0.15),
    ("median_tpot_ms", "median TPOT ms", 0.15),
    ("output_throughput", "output tok/s", 0.15),
    ("p90_ttft_ms", "p90 TTFT ms", 0.25),
)
SATURATION_TARGET = 0.10


def rate_key(result: dict[str, Any]) -> float:
    rate = result["request_rate"]
    return math.inf if rate in ("inf", None) else float(rate)


# ----- measuring ---------------------------------------------------------------------------------------


def measure(engine_flags: list[str], serve_config, rates: Sequence[float], directory: str,
            log: Log | None = None) -> list[dict[str, Any]]:
    """`bench sweep` over `rates` against a fresh `tokenmill serve ENGINE_FLAGS`; its files
    go to `directory`."""
    from tokenmill.workloads.local_server import LocalServer
    from tokenmill.workloads.sweep import SweepPoint, run_sweep

    points = [SweepPoint(rate, serve_config.max_concurrency) for rate in rates]
    if log:
        log(f"measuring: tokenmill serve {' '.join(engine_flags)}; bench sweep -> {directory}")
    with LocalServer([*engine_flags, "--disable-access-log"]) as server:
        serve_config.base_url = server.url
        return run_sweep(serve_config, "request_rate", points, directory, echo=False)


def measure_calibrated(config, serve_config, rates: Sequence[float], directory: str,
                       log: Log | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """The sweep with a calibration around every point, for a machine whose load drifts:
    the engine is loaded in this process and the server started once; then calibration 0,
    point 1, calibration 1, point 2, ... (the quick profile, ~9,000 tokens, while the
    server idles; each point while this process's engine idles). Point k is predicted from
    calibrations k - 1 and k together. The server's overheads are measured side by side
    first. Returns the results (bench sweep's files in `directory`) and each point's profile."""
    import asyncio
    from contextlib import AsyncExitStack

    from tokenmill.config import engine_args
    from tokenmill.simulator.profile import QUICK_WORKLOADS, Calibrator, measure_server_overheads
    from tokenmill.workloads.load_client import open_session, run_point as run_measured_point
    from tokenmill.workloads.local_server import LocalServer
    from tokenmill.workloads.plots import plot_sweep
    from tokenmill.workloads.sweep import SweepPoint, summary_row

    async def one_point(rate: float, index: int) -> dict[str, Any]:
        async with AsyncExitStack() as stack:
            session = await open_session(serve_config, stack)
            return await run_measured_point(session, rate, serve_config.max_concurrency, seed_offset=index)

    os.makedirs(directory, exist_ok=True)
    calibrator = Calibrator(config)
    results, profiles = [], []
    with LocalServer([*engine_args(config), "--disable-access-log"]) as server:
        serve_config.base_url = server.url
        overheads, detail = measure_server_overheads(config, calibrator.engine, log=log, url=server.url)
        samples = [calibrator.profile(QUICK_WORKLOADS, log=log)]
        for index, rate in enumerate(rates):
            if log:
                log(f"measuring rate {rate:g} -> {directory}")
            result = asyncio.run(one_point(rate, index))
            save_result(result, os.path.join(directory, SweepPoint(rate, None).file_name("request_rate")))
            samples.append(calibrator.profile(QUICK_WORKLOADS, log=log))
            profile = calibrator.make_profile(samples[-2] + samples[-1])
            profile.overheads, profile.overheads_detail = overheads, detail
            results.append(result)
            profiles.append(profile)
    with open(os.path.join(directory, "sweep.json"), "w", encoding="utf-8") as file:
        json.dump({"axis": "request_rate", "points": [summary_row(r) for r in results]}, file, indent=1)
    plot_sweep(results, os.path.join(directory, "sweep.png"), "request_rate")
    return results, profiles


def load_measured(directory: str) -> list[list[dict[str, Any]]]:
    """The results of a measured sweep directory (`rate-*.json`), or of each of its `run-*/`."""
    runs = sorted(glob.glob(os.path.join(directory, "run-*"))) or [directory]
    loaded = []
    for run in runs:
        files = glob.glob(os.path.join(run, "rate-*.json"))
        if files:
            loaded.append(sorted((load_result(f) for f in files), key=rate_key))
    if not loaded:
        raise ValueError(f"{directory}: no measured sweep (rate-*.json) found")
    return loaded


# ----- predicting and comparing ----------------------------------------------------------------------------


def predict(measured: list[dict[str, Any]], setups: Sequence[SimulationSetup], report: Report,
            directory: str | None = None) -> list[dict[str, Any]]:
    """Replay every measured point of a sweep through the simulator, point k with
    `setups[k]` (files to `directory`)."""
    predicted = []
    for result, setup in zip(measured, setups, strict=True):
        simulated = run_point(trace_from_result(result), setup, result.get("max_concurrency"), report)
        if directory:
            rate = result["request_rate"]
            name = f"rate-{rate if rate == 'inf' else format(float(rate), 'g')}.json"
            save_result(simulated, os.path.join(directory, name))
        predicted.append(simulated)
    return predicted


@dataclass
class Row:
    rate: float
    measured: dict[str, list[float]]  # over the repeats
    predicted: dict[str, list[float]]
    load_average: list[float]

    def value(self, key: str, side: str) -> float:
        return statistics.median(getattr(self, side)[key])

    def error(self, key: str) -> float:
        measured = self.value(key, "measured")
        return (self.value(key, "predicted") - measured) / measured if measured else math.nan


def compare(measured: list[list[dict[str, Any]]], predicted: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per rate, each compared metric over the repeats; the saturation rates; the verdicts."""
    by_rate: dict[float, Row] = {}
    for m_run, p_run in zip(measured, predicted):
        for m, p in zip(m_run, p_run):
            row = by_rate.setdefault(rate_key(m), Row(rate_key(m), {}, {}, []))
            for key, _, _ in COMPARED:
                row.measured.setdefault(key, []).append(float(m[key]))
                row.predicted.setdefault(key, []).append(float(p[key]))
            row.measured.setdefault("request_throughput", []).append(float(m["request_throughput"]))
            row.predicted.setdefault("request_throughput", []).append(float(p["request_throughput"]))
            if m.get("load_average"):
                row.load_average.append(float(m["load_average"][0]))
    rows = [by_rate[rate] for rate in sorted(by_rate)]
    saturation = {
        side: statistics.median(max(float(r["request_throughput"]) for r in run) for run in runs)
        for side, runs in (("measured", measured), ("predicted", predicted))
    }
    saturation["error"] = (saturation["predicted"] - saturation["measured"]) / saturation["measured"]
    saturation["target"] = SATURATION_TARGET
    points = []
    for row in rows:
        point: dict[str, Any] = {"request_rate": "inf" if math.isinf(row.rate) else row.rate,
                                 "load_average": row.load_average}
        for key, _, target in COMPARED:
            point[key] = {"measured": row.value(key, "measured"), "predicted": row.value(key, "predicted"),
                          "error": row.error(key), "target": target,
                          "measured_runs": row.measured[key], "predicted_runs": row.predicted[key]}
        points.append(point)
    met = {key: all(abs(p[key]["error"]) <= target for p in points) for key, _, target in COMPARED}
    met["saturation_rate"] = abs(saturation["error"]) <= SATURATION_TARGET
    return {"points": points, "saturation_rate": saturation, "targets_met": met, "repeats": len(measured)}


def format_validation(report: dict[str, Any]) -> str:
    head = ["rate"] + [f"{label} (meas/pred/err)" for _, label, _ in COMPARED] + ["load"]
    lines = [f"Predicted vs measured, median over {report['repeats']} measured sweep(s); error = predicted / measured - 1"]
    rows = []
    for point in report["points"]:
        cells = [str(point["request_rate"])]
        for key, _, target in COMPARED:
            entry = point[key]
            flag = "" if abs(entry["error"]) <= target else " *"
            cells.append(f"{_num(entry['measured'])} / {_num(entry['predicted'])} / {entry['error']:+.0%}{flag}")
        loads = point["load_average"]
        cells.append(f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-")
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    sat = report["saturation_rate"]
    lines.append(f"saturation rate (most req/s achieved): measured {sat['measured']:.3f}, predicted "
                 f"{sat['predicted']:.3f} ({sat['error']:+.0%}; target ±{SATURATION_TARGET:.0%})")
    targets = ", ".join(f"{key} ±{target:.0%}" for key, _, target in COMPARED)
    met = report["targets_met"]
    missed = [key for key, ok in met.items() if not ok]
    lines.append(f"targets ({targets}): " + ("all met" if not missed else f"missed: {', '.join(missed)} (* above)"))
    return "\n".join(lines)


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def plot_validation(report: dict[str, Any], path: str, title: str = "") -> None:
    """One panel per compared metric: measured (each repeat, and the median) and predicted
    against the offered request rate."""
    from tokenmill.workloads.plots import _pyplot, _x_positions

    plt = _pyplot()
    points = report["points"]
    rates = [math.inf if p["request_rate"] == "inf" else float(p["request_rate"]) for p in points]
    xs, labels = _x_positions(rates)
    fig, axes = plt.subplots(1, len(COMPARED), figsize=(5 * len(COMPARED), 4.4))
    for ax, (key, label, target) in zip(axes, COMPARED):
        measured = [p[key]["measured"] for p in points]
        predicted = [p[key]["predicted"] for p in points]
        for x, p in zip(xs, points):
            ax.scatter([x] * len(p[key]["measured_runs"]), p[key]["measured_runs"], color="tab:blue", alpha=0.35, s=14)
        ax.plot(xs, measured, "o-", color="tab:blue", label="measured (median; dots: runs)")
        ax.plot(xs, predicted, "s--", color="tab:orange", label="simulated")
        ax.fill_between(xs, [m * (1 - target) for m in measured], [m * (1 + target) for m in measured],
                        color="tab:blue", alpha=0.08, label=f"±{target:.0%} of measured")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.minorticks_off()
        ax.set_xlabel("offered load: request rate (req/s)")
        ax.set_title(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    sat = report["saturation_rate"]
    fig.suptitle(f"{title}{' — ' if title else ''}saturation: measured {sat['measured']:.2f} req/s, "
                 f"simulated {sat['predicted']:.2f} req/s ({sat['error']:+.0%})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_report(report: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(report, file, indent=1)
        file.write("\n")
