"""Reports of the offline benchmark: the machine it ran on, speedup columns, and the
tables as text and Markdown. `python -m tokenmill.workloads.report results.json [--markdown]`
prints the tables of a saved report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any

from tokenmill.hardware import cpu_info
from tokenmill.workloads.offline import METRICS, NOT_SPEEDUPS, WORKLOAD_METRICS, speedup

# Which pairs get a speedup column: (name, numerator system, denominator system).
COMPARISONS = {
    "W4": (("prefix_on_vs_off", "tokenmill_prefix_on", "tokenmill_prefix_off"),
           ("tokenmill_vs_hf", "tokenmill_prefix_on", "hf")),
}
DEFAULT_COMPARISONS = (("tokenmill_vs_hf", "tokenmill", "hf"), ("spec_on_vs_off", "tokenmill", "tokenmill_spec_off"))

LABELS = {
    "tokenmill": "tokenmill",
    "tokenmill_prefix_on": "tokenmill (prefix cache on)",
    "tokenmill_prefix_off": "tokenmill (prefix cache off)",
    "hf": "transformers",
    "tokenmill_spec_off": "tokenmill (speculation off)",
}


def add_speedups(workload: str, result: dict[str, Any]) -> None:
    """`speedup`: ratio of the two systems' medians. `paired_speedup`: the median of the
    per-run ratios; both systems ran the same requests back to back in each run, so a
    background load that drifts between runs hits both alike and cancels out."""
    systems = result["systems"]
    result["speedup"], result["paired_speedup"] = {}, {}
    for key, a, b in COMPARISONS.get(workload, DEFAULT_COMPARISONS):
        if a not in systems or b not in systems:
            continue
        metrics = [m for m in WORKLOAD_METRICS[workload] if m not in NOT_SPEEDUPS]
        result["speedup"][key] = {m: speedup(m, systems[a]["median"][m], systems[b]["median"][m]) for m in metrics}
        paired = {}
        for m in metrics:
            ratios = [speedup(m, x[m], y[m]) for x, y in zip(systems[a]["runs"], systems[b]["runs"])]
            ratios = [r for r in ratios if r is not None]
            paired[m] = statistics.median(ratios) if ratios else None
        result["paired_speedup"][key] = paired


# ----- machine ---------------------------------------------------------------------------


def machine_info(dtype: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": _cpu_capability(torch),
        # Without it (no AVX512-BF16/AMX), CPU bfloat16 matmuls take a slow fallback path.
        "mkldnn_bf16": _mkldnn_bf16(torch),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dtype": dtype,
        "tokenmill_commit": _git_commit(),
        "tokenmill_dirty": _git_dirty(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def _cpu_capability(torch: Any) -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def _mkldnn_bf16(torch: Any) -> bool | None:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def _cpu_model() -> str:
    return cpu_info().model_name


def _cpu_flags() -> list[str]:
    """The SIMD extensions that decide CPU matmul speed (bf16 needs avx512_bf16/amx to be native)."""
    return cpu_info().simd_flags


def _git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (others' work in progress was measured too)."""
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        result = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=5)
        return bool(result.stdout.strip()) if result.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        result = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5)
        return result.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ----- tables ----------------------------------------------------------------------------


def _dtype_text(machine: dict[str, Any]) -> str:
    weights = machine.get("weight_dtype", machine["dtype"])
    return machine["dtype"] if weights == machine["dtype"] else f"{weights} weights, {machine['dtype']} compute"


def format_table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"tokenmill bench offline: {m['cpu_model']}, {m['cores']} cores, torch {m['torch']} "
        f"({m['torch_threads']} threads), {_dtype_text(m)}; median of {report['settings']['runs']} runs",
    ]
    if m.get("speculative"):
        lines.append(f"speculative decoding: {m['speculative']}")
    for workload, result in report["workloads"].items():
        systems = list(result["systems"])
        comparisons = list(result["speedup"])
        header = ["metric", *(LABELS.get(s, s) for s in systems), *(f"x {c}" for c in comparisons)]
        rows = []
        for metric in result["metrics"]:
            row = [METRICS[metric][0]]
            row += [fmt(result["systems"][s]["median"][metric]) for s in systems]
            row += [fmt_ratio(result["speedup"][c].get(metric), _paired(result, c, metric)) for c in comparisons]
            rows.append(row)
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines.append("")
        lines.append(f"{workload}: {result['description']}")
        for r in [header, *rows]:
            cells = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(r)]
            lines.append("  " + "  ".join(cells))
        for key, against in (("greedy_agreement", "transformers"), ("spec_greedy_agreement", "speculation off")):
            agreement = result.get(key)
            if agreement:
                lines.append(
                    f"  greedy outputs vs {against}: {agreement['identical_requests']}/{agreement['num_requests']} "
                    f"identical, mean common prefix {agreement['mean_common_prefix_tokens']:.1f} of "
                    f"{agreement['mean_output_tokens']:.1f} tokens"
                )
    if any(result["speedup"] for result in report["workloads"].values()):
        lines.append("")
        lines.append("x columns: speedup, > 1 means the first system is faster (higher rate or lower time): "
                     "ratio of the medians (median of the per-run ratios).")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    """The same tables as `format_table`, as Markdown (for docs/benchmarks.md)."""
    lines = []
    for workload, result in report["workloads"].items():
        systems = list(result["systems"])
        comparisons = list(result["speedup"])
        header = ["metric", *(LABELS.get(s, s) for s in systems),
                  *(f"{_comparison_label(c)} (paired)" for c in comparisons)]
        lines += [f"**{workload}**: {result['description']}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        for metric in result["metrics"]:
            row = [METRICS[metric][0]]
            row += [fmt(result["systems"][s]["median"][metric]) for s in systems]
            row += [fmt_ratio(result["speedup"][c].get(metric), _paired(result, c, metric)) for c in comparisons]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the tables of a saved report: `python -m tokenmill.workloads.report results.json [--markdown]`."""
    parser = argparse.ArgumentParser(prog="python -m tokenmill.workloads.report", description=main.__doc__)
    parser.add_argument("report")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    for workload, result in report["workloads"].items():
        add_speedups(workload, result)  # reports written before paired speedups existed
    print(format_markdown(report) if args.markdown else format_table(report))
    return 0


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value != value:  # nan
        return "nan"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _paired(result: dict[str, Any], comparison: str, metric: str) -> float | None:
    return result.get("paired_speedup", {}).get(comparison, {}).get(metric)


def _comparison_label(key: str) -> str:
    return {"tokenmill_vs_hf": "speedup vs transformers", "prefix_on_vs_off": "speedup prefix on vs off",
            "spec_on_vs_off": "speedup speculation on vs off"}.get(key, key)


def fmt_ratio(value: float | None, paired: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if paired is None else f"{value:.2f}x ({paired:.2f}x)"


if __name__ == "__main__":
    sys.exit(main())
