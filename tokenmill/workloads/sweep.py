"""`tokenmill bench sweep`: `bench serve` at a series of offered loads.

The load is either a list of request rates (`--request-rates 0.5,1,2,4,inf`) or a
list of concurrency caps (`--concurrencies 1,2,4,8`). Every point sends its own
fresh random prompts (the seed is offset per point), so no point is served from
the prefix cache an earlier point filled. Each point's full result goes to
`OUTPUT_DIR/rate-R.json` or `OUTPUT_DIR/concurrency-C.json`; `OUTPUT_DIR/sweep.json`
lists the points' headline figures, and the figure (`OUTPUT_DIR/sweep.png` unless
`--plot` says otherwise) shows throughput, goodput and p99 latencies against the
offered load: achieved throughput follows the offered load until the server
saturates, and the knee of that curve (of goodput, with SLOs) is its capacity.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from tokenmill.workloads.load_client import ServeConfig, format_table, open_session, run_point, save_result

SUMMARY_KEYS = (
    "request_rate", "max_concurrency", "num_prompts", "completed", "failed", "duration",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "max_concurrent_requests",
    "failed_reasons", "load_average",
)


@dataclass(frozen=True)
class SweepPoint:
    request_rate: float
    max_concurrency: int | None

    def file_name(self, axis: str) -> str:
        if axis == "max_concurrency":
            return f"concurrency-{self.max_concurrency}.json"
        return f"rate-{'inf' if math.isinf(self.request_rate) else format(self.request_rate, 'g')}.json"


def parse_rates(text: str) -> list[float]:
    """"0.5,1,2,inf" -> [0.5, 1.0, 2.0, inf]; every rate > 0."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rates: {part!r} is not a number (or inf)") from None
        if not rate > 0:
            raise ValueError(f"--request-rates: every rate must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rates is empty")
    return rates


def parse_concurrencies(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) <= 0:
            raise ValueError(f"--concurrencies: {part!r} is not a positive integer")
        values.append(int(part))
    return values


def sweep_points(request_rates: list[float] | None, concurrencies: list[int] | None,
                 base: ServeConfig) -> tuple[str, list[SweepPoint]]:
    """(axis, points): rates at the config's concurrency cap, or caps at its rate."""
    if (request_rates is None) == (concurrencies is None):
        raise ValueError("give exactly one of --request-rates and --concurrencies")
    if request_rates is not None:
        return "request_rate", [SweepPoint(rate, base.max_concurrency) for rate in request_rates]
    return "max_concurrency", [SweepPoint(base.request_rate, cap) for cap in concurrencies or []]


def summary_row(result: dict[str, Any]) -> dict[str, Any]:
    return {key: result.get(key) for key in SUMMARY_KEYS}


def format_sweep_table(results: list[dict[str, Any]], axis: str) -> str:
    head = ("load", "ok", "fail", "req/s", "goodput", "out tok/s", "TTFT med", "TTFT p99",
            "TPOT med", "TPOT p99", "ITL p99", "E2EL p99")
    rows = []
    for r in results:
        load = r[axis] if r[axis] is not None else "-"
        goodput = "-" if r["request_goodput"] is None else f"{r['request_goodput']:.2f}"
        rows.append((
            str(load), str(r["completed"]), str(r["failed"]), f"{r['request_throughput']:.2f}", goodput,
            f"{r['output_throughput']:.1f}", f"{r['median_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}",
            f"{r['median_tpot_ms']:.1f}", f"{r['p99_tpot_ms']:.1f}", f"{r['p99_itl_ms']:.1f}",
            f"{r['p99_e2el_ms']:.0f}",
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    title = "request rate" if axis == "request_rate" else "max concurrency"
    lines = [f"Sweep over {title} (latencies in ms)",
             "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


async def _sweep(config: ServeConfig, axis: str, points: list[SweepPoint], output_dir: str,
                 plot_runs: bool, echo: bool) -> list[dict[str, Any]]:
    from tokenmill.workloads.plots import plot_run

    results = []
    async with AsyncExitStack() as stack:
        session = await open_session(config, stack)
        for index, point in enumerate(points):
            result = await run_point(session, point.request_rate, point.max_concurrency, seed_offset=index)
            path = os.path.join(output_dir, point.file_name(axis))
            save_result(result, path)
            if plot_runs:
                plot_run(result, path.removesuffix(".json") + ".png")
            if echo:
                print(format_table(result), flush=True)
            results.append(result)
    return results


def run_sweep(config: ServeConfig, axis: str, points: list[SweepPoint], output_dir: str,
              plot_path: str | None = None, plot_runs: bool = False, echo: bool = True) -> list[dict[str, Any]]:
    """Run every point, write its JSON, the summary and the figure; the results."""
    if not points:
        raise ValueError("the sweep has no points")
    os.makedirs(output_dir, exist_ok=True)
    results = asyncio.run(_sweep(config, axis, points, output_dir, plot_runs, echo))
    with open(os.path.join(output_dir, "sweep.json"), "w", encoding="utf-8") as file:
        json.dump({"axis": axis, "points": [summary_row(r) for r in results]}, file, indent=1)
        file.write("\n")
    from tokenmill.workloads.plots import plot_sweep

    plot_sweep(results, plot_path or os.path.join(output_dir, "sweep.png"), axis)
    return results
