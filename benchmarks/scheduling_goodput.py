"""Goodput of the scheduling policies on the simulator (issue 29): fcfs against SLO mode
over request rates, and under the priority policy the TTFT of a high-priority tenth of the
requests. Virtual time, a hand-written cost model like the default model's on the 2-core
CPU box (docs/planning.md: 53 ms + 1.55 ms per prefill token; pure decode 46 / 63 / 130 /
222 ms at 1 / 8 / 32 / 64 rows); nothing is measured on a real server. Writes a figure and
prints the table of docs/scheduling.md. Not part of CI (about a minute a workload).

Workloads (issue 29's three): chat (128-token prompts, 64 outputs), long-prompt (512-token
prompts, 64 outputs), shared-prefix (a 512-token prefix, one of 4, then 128 tokens of
question; 64 outputs; the prefix cache serves the prefix after its first use).

    .venv/bin/python benchmarks/scheduling_goodput.py --output docs/images/scheduling-goodput.png
    .venv/bin/python benchmarks/scheduling_goodput.py --workload long-prompt \
        --output docs/images/scheduling-goodput-long-prompt.png
    .venv/bin/python benchmarks/scheduling_goodput.py --workload shared-prefix \
        --output docs/images/scheduling-goodput-shared-prefix.png
"""

from __future__ import annotations

import argparse

from tokenmill.config import EngineConfig
from tokenmill.planner.costmodel import StepCostModel
from tokenmill.simulator.simulate import SimulationSetup, simulate
from tokenmill.workloads.datasets import DatasetConfig
from tokenmill.workloads.metrics import tpot_of
from tokenmill.workloads.trace import Trace, TraceRequest, synthetic_trace

CPU_LIKE = StepCostModel(0.053, 0.00155, 0.0028, 0.0, decode_rows=(1, 8, 32, 64),
                         decode_seconds=(0.046, 0.063, 0.130, 0.222))
TTFT_S, TPOT_S = 1.0, 0.1
POLICIES = {"fcfs": {}, "SLO mode": {"slo_ttft_ms": TTFT_S * 1e3, "slo_tpot_ms": TPOT_S * 1e3},
            "priority (1 in 10 high)": {"scheduling_policy": "priority"}}


def run(trace: Trace, **settings):
    setup = SimulationSetup(EngineConfig.from_kwargs(**settings), 4096, 4096, CPU_LIKE, model_name="cpu-like")
    return simulate(trace, setup).records


# name -> (dataset settings, default rates)
WORKLOADS = {
    "chat": ({"name": "random", "input_len": 128, "output_len": 64}, "0.5,1,1.5,2,3"),
    "long-prompt": ({"name": "random", "input_len": 512, "output_len": 64}, "0.25,0.5,0.75,1"),
    "shared-prefix": ({"name": "shared-prefix", "input_len": 128, "output_len": 64, "prefix_len": 512,
                       "num_prefixes": 4}, "0.5,1,1.5,2,3"),
}


def point(rate: float, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    settings = dict(WORKLOADS[args.workload][0])
    settings.update({k: v for k, v in (("input_len", args.input_len), ("output_len", args.output_len))
                     if v is not None})
    dataset = DatasetConfig(num_prompts=args.num_prompts, seed=0, **settings)
    base = synthetic_trace(dataset, rate)
    row = {}
    for name, settings in POLICIES.items():
        trace = base
        if settings.get("scheduling_policy") == "priority":
            trace = Trace([TraceRequest(r.arrival_s, r.prompt_token_ids, r.output_len, 0 if i % 10 == 0 else 1)
                           for i, r in enumerate(base.requests)], base.description, base.settings)
        records = run(trace, **settings)
        good = [r.ttft <= TTFT_S and tpot_of(r) <= TPOT_S for r in records]
        high = [r.ttft for i, r in enumerate(records) if i % 10 == 0]
        row[name] = {"goodput": sum(good) / len(good), "ttft_ok": sum(r.ttft <= TTFT_S for r in records) / len(good),
                     "tpot_ok": sum(tpot_of(r) <= TPOT_S for r in records) / len(good),
                     "p99_ttft_tenth": sorted(high)[int(0.99 * (len(high) - 1))]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="chat")
    parser.add_argument("--rates", default=None, help="comma-separated request rates (default: the workload's)")
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--input-len", type=int, default=None, help="default: the workload's")
    parser.add_argument("--output-len", type=int, default=None, help="default: the workload's")
    parser.add_argument("--output", default=None, metavar="FILE.png")
    args = parser.parse_args()
    rates = [float(r) for r in (args.rates or WORKLOADS[args.workload][1]).split(",")]
    rows = [point(rate, args) for rate in rates]
    print("| rate | " + " | ".join(f"{name} goodput (TTFT ok, TPOT ok)" for name in POLICIES) +
          " | p99 TTFT of every tenth request: fcfs / priority |")
    print("| --- " * (len(POLICIES) + 2) + "|")
    for rate, row in zip(rates, rows):
        cells = [f"{v['goodput']:.0%} ({v['ttft_ok']:.0%}, {v['tpot_ok']:.0%})" for v in row.values()]
        tenth = f"{row['fcfs']['p99_ttft_tenth']:.2f} s / {row['priority (1 in 10 high)']['p99_ttft_tenth']:.2f} s"
        print(f"| {rate:g}/s | " + " | ".join(cells) + f" | {tenth} |")
    if args.output:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        colors = dict(zip(POLICIES, ("tab:blue", "tab:orange", "tab:green")))
        for name, style in zip(POLICIES, ("-", "-", "--")):
            left.plot(rates, [100 * row[name]["goodput"] for row in rows], style, marker="o", label=name,
                      color=colors[name])
        left.set(xlabel="request rate (req/s)", ylabel="goodput (% of requests)", ylim=(0, 105),
                 title=f"goodput: TTFT <= {TTFT_S:g} s, TPOT <= {TPOT_S * 1e3:g} ms")
        left.legend()
        for name in ("fcfs", "priority (1 in 10 high)"):
            right.plot(rates, [row[name]["p99_ttft_tenth"] for row in rows], marker="o", label=name,
                       color=colors[name])
        right.set(xlabel="request rate (req/s)", ylabel="seconds", yscale="log",
                  title="p99 TTFT of the high-priority tenth")
        right.legend()
        shape = {**WORKLOADS[args.workload][0], **{k: v for k, v in (("input_len", args.input_len),
                                                                   ("output_len", args.output_len)) if v is not None}}
        prefix = f"{shape['prefix_len']}-token shared prefix + " if "prefix_len" in shape else ""
        fig.suptitle(f"simulator, CPU-like cost model, {args.workload}: {prefix}{shape['input_len']}-token prompts, "
                     f"{shape['output_len']} outputs")
        fig.tight_layout()
        fig.savefig(args.output, dpi=110)
        print(f"figure: {args.output}")


if __name__ == "__main__":
    main()
