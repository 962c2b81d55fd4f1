"""Figures of `tokenmill bench serve` and `tokenmill bench sweep` (matplotlib, Agg).

Both read only the result dicts (as saved to JSON), so a figure can be redrawn from
saved results: `plot_run(json.load(open(FILE)), "run.png")`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tokenmill.workloads.metrics import RequestRecord, output_timeline, percentile_key


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def records_from_result(result: dict[str, Any]) -> list[RequestRecord]:
    """The per-request records a result's lists describe (success: no error)."""
    return [
        RequestRecord(prompt_len=n_in, success=not error, error=error, start_time=start, ttft=ttft,
                      itl=list(itl), latency=latency, output_tokens=n_out)
        for n_in, n_out, error, start, ttft, itl, latency in zip(
            result["input_lens"], result["output_lens"], result["errors"], result["start_times"],
            result["ttfts"], result["itls"], result["latencies"])
    ]


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    data = sorted(values_ms)
    if not data:
        return
    ys = [(i + 1) / len(data) for i in range(len(data))]
    ax.step(data, ys, where="post", label=label)


def run_title(result: dict[str, Any]) -> str:
    cap = result["max_concurrency"]
    label = f"{result['label']}: " if result.get("label") else ""
    return (f"{label}{result['model_id']} {result['endpoint']}: {result['num_prompts']} prompts, "
            f"rate {result['request_rate']}, concurrency {cap if cap is not None else 'unlimited'}; "
            f"{result['completed']} ok, {result['failed']} failed")


def plot_run(result: dict[str, Any], path: str) -> None:
    """TTFT CDF, ITL (and TPOT) CDF, and output throughput / requests in flight over time;
    with a simulator's result also the KV cache's usage over time."""
    plt = _pyplot()
    records = records_from_result(result)
    ok = [r for r in records if r.success]
    kv = result.get("kv_usage_timeline")
    fig, axes = plt.subplots(1, 4 if kv else 3, figsize=(21 if kv else 16, 4.6))
    ax_ttft, ax_itl, ax_time = axes[:3]

    _cdf(ax_ttft, [r.ttft * 1000 for r in ok], "TTFT")
    ax_ttft.set_xlabel("time to first token (ms)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.set_title(f"TTFT CDF (median {result['median_ttft_ms']:.0f} ms)")

    _cdf(ax_itl, [gap * 1000 for r in ok for gap in r.itl], "ITL (every gap)")
    _cdf(ax_itl, [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1],
         "TPOT (per request)")
    ax_itl.set_xlabel("milliseconds")
    ax_itl.set_ylabel("fraction")
    ax_itl.set_title(f"ITL / TPOT CDF (median ITL {result['median_itl_ms']:.0f} ms)")
    if ok:
        ax_itl.legend(loc="lower right")

    starts, tokens_per_s, in_flight = output_timeline(records)
    # Repeat the last bin's value at its end, so that `step` draws the last bin too.
    edges = [*starts, starts[-1] + (starts[1] - starts[0] if len(starts) > 1 else 1.0)]
    tokens_per_s, in_flight = [*tokens_per_s, tokens_per_s[-1]], [*in_flight, in_flight[-1]]
    ax_time.step(edges, tokens_per_s, where="post", color="tab:blue", label="output tok/s")
    ax_time.set_xlabel("seconds since the start of the run")
    ax_time.set_ylabel("output tokens/s (1 s bins)", color="tab:blue")
    ax_time.set_title(f"Throughput over time (mean {result['output_throughput']:.0f} tok/s)")
    twin = ax_time.twinx()
    twin.step(edges, in_flight, where="post", color="tab:orange", label="requests in flight")
    twin.set_ylabel("requests in flight (mean over the bin)", color="tab:orange")
    twin.set_ylim(bottom=0)
    ax_time.set_ylim(bottom=0)
    if kv:
        _plot_kv_usage(axes[3], result)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(run_title(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_kv_usage(ax, result: dict[str, Any]) -> None:
    """KV cache usage and running / waiting requests after each step (a simulator's result)."""
    kv = result["kv_usage_timeline"]
    ax.plot(kv["times"], [u * 100 for u in kv["kv_usage"]], color="tab:green", label="KV cache used (%)")
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds since the start of the run")
    ax.set_ylabel("KV cache used (%)", color="tab:green")
    ax.set_title(f"KV cache ({result.get('num_preemptions', 0)} preemptions)")
    twin = ax.twinx()
    twin.plot(kv["times"], kv["num_running"], color="tab:blue", lw=0.8, label="running")
    twin.plot(kv["times"], kv["num_waiting"], color="tab:red", lw=0.8, label="waiting")
    twin.set_ylabel("requests")
    twin.set_ylim(bottom=0)
    twin.legend(loc="upper right", fontsize=8)


def _x_positions(values: Sequence[float]) -> tuple[list[float], list[str]]:
    """Offered-load axis positions: inf goes one doubling past the largest finite value."""
    finite = [v for v in values if not math.isinf(v)]
    top = max(finite) if finite else 1.0
    xs = [top * 2 if math.isinf(v) else v for v in values]
    labels = ["inf" if math.isinf(v) else f"{v:g}" for v in values]
    return xs, labels


def plot_sweep(results: Sequence[dict[str, Any]], path: str, axis: str) -> None:
    """Throughput, goodput and p99 latencies against offered load (`axis`: "request_rate"
    or "max_concurrency"). The knee of the throughput / goodput curve is the capacity."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    values = [math.inf if r[axis] in ("inf", None) else float(r[axis]) for r in results]
    xs, labels = _x_positions(values)
    fig, (ax_req, ax_tok, ax_lat) = plt.subplots(1, 3, figsize=(16, 4.8))
    x_label = "offered load: request rate (req/s)" if axis == "request_rate" else "offered load: max concurrency"

    ax_req.plot(xs, [r["request_throughput"] for r in results], "o-", label="achieved requests/s")
    if any(r["request_goodput"] is not None for r in results):
        slos = ", ".join(f"{k}<={v:g}ms" for k, v in (results[0]["goodput_slos_ms"] or {}).items())
        ax_req.plot(xs, [r["request_goodput"] or 0.0 for r in results], "s-", label=f"goodput ({slos})")
    if axis == "request_rate":
        finite = [(x, v) for x, v in zip(xs, values) if not math.isinf(v)]
        if finite:
            ax_req.plot([x for x, _ in finite], [v for _, v in finite], ":", color="gray", label="offered")
    ax_req.set_ylabel("requests/s")
    ax_req.set_title("Request throughput and goodput")
    ax_req.legend(fontsize=8)

    ax_tok.plot(xs, [r["output_throughput"] for r in results], "o-", label="output tok/s")
    ax_tok.plot(xs, [r["total_token_throughput"] for r in results], "s--", label="total (in + out) tok/s")
    ax_tok.set_ylabel("tokens/s")
    ax_tok.set_title("Token throughput")
    ax_tok.legend(fontsize=8)

    tail = percentile_key(max(results[0]["percentiles"]))  # p99 by default
    for name, style in (("ttft", "o-"), ("tpot", "s-"), ("itl", "^-"), ("e2el", "d-")):
        ax_lat.plot(xs, [max(r[f"{tail}_{name}_ms"], 1e-3) for r in results], style, label=f"{tail} {name.upper()}")
    ax_lat.set_yscale("log")
    ax_lat.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_lat.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax_lat.yaxis.set_minor_formatter(NullFormatter())
    ax_lat.set_ylabel("milliseconds (log)")
    ax_lat.set_title(f"{tail} latencies")
    ax_lat.legend(fontsize=8)

    for ax in (ax_req, ax_tok, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.minorticks_off()
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    first = results[0]
    label = f"{first['label']}: " if first.get("label") else ""
    fig.suptitle(f"{label}{first['model_id']} {first['endpoint']}: {first['num_prompts']} prompts per point, "
                 f"input {first['input_len']}, output {first['output_len']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
