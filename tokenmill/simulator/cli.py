"""`tokenmill simulate [calibrate|sweep|validate]`: the serving simulator's command line.

Only argparse is imported here; the simulator loads when a command runs (torch only for
`calibrate`, which runs the real model, and to find the default model's path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tokenmill.workloads.args import (
    add_dataset_args,
    add_load_args,
    add_report_args,
    add_sweep_load_args,
    positive_int,
)

DESCRIPTION = """\
Simulate `tokenmill serve` under a load: the engine's own scheduler and KV block manager
(the same code and settings as `serve`: --max-num-seqs, --max-num-batched-tokens,
--block-size, --kv-cache-memory, --enable-prefix-caching, --max-model-len) run on virtual
time, and each step takes the time a cost model predicts. The cost model is this
machine's calibration (`tokenmill simulate calibrate`, stored per model, dtype and
threads) or, with --target-device, the roofline of a catalog device. The report has the keys and
definitions of `tokenmill bench serve` (TTFT, TPOT, ITL, E2E latency, throughput,
goodput), plus the KV cache's usage over time and the preemptions.

Sub-commands: calibrate (profile the real runner here: ~3-10 minutes), sweep (request
rates, concurrencies or a grid of engine settings), validate (predicted against a real
`bench sweep`).
"""

EPILOG = """\
examples:
  tokenmill simulate calibrate --dtype float32 --num-threads 1     # once per model, dtype and threads
  tokenmill simulate --dtype float32 --num-threads 1 --request-rate 2 --num-prompts 1000 \\
      --input-len 128 --output-len 32 --goodput ttft:2000 tpot:200 --plot run.png
  tokenmill simulate --dtype float32 --num-threads 1 --trace results/rate-1.json   # replay a bench serve run
  tokenmill simulate sweep --dtype float32 --num-threads 1 --request-rates 0.25,0.5,1,2,inf \\
      --input-len 128 --output-len 32 --num-prompts 500 --output-dir sim/
  tokenmill simulate sweep --dtype float32 --num-threads 1 --request-rates 0.5,1,2 \\
      --grid max_num_seqs=8,32 --grid max_num_batched_tokens=256,2048 --output-dir grid/
  tokenmill simulate --model llama-3.1-8b --target-device h100-sxm --request-rate 20 --input-len 1024 --output-len 256
  tokenmill simulate --num-threads 1 --max-model-len 8192 --request-rate 0.1 --input-len 2048 --output-len 64 \\
      --pd 1P1D --goodput ttft:10000 tpot:50      # 1 prefill + 1 decode instance beside 2 replicas
  tokenmill simulate validate --dtype float32 --num-threads 1 --max-model-len 1024 \\
      --request-rates 0.25,0.5,1,2,inf --num-prompts 32 --input-len 128 --output-len 32 --output-dir val/
"""

CALIBRATE_HELP = "profile the real runner on this machine and fit the step cost model (stored per model, dtype, threads)"
SWEEP_HELP = "simulated runs over request rates, concurrencies, or a grid of engine settings, with bench sweep's plots"
VALIDATE_HELP = "run bench sweep against a real tokenmill serve and the simulator on the same requests; compare"


def register(sub) -> None:
    parser = sub.add_parser("simulate", help="simulate serving on virtual time: the real scheduler, a cost model",
                            description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    parser.set_defaults(func=cmd_simulate)
    commands = parser.add_subparsers(dest="simulate_command", metavar="{calibrate,sweep,validate}")

    calibrate = commands.add_parser("calibrate", help=CALIBRATE_HELP, description=CALIBRATE_HELP + ".",
                                    epilog=CALIBRATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_calibrate_args(calibrate)
    calibrate.set_defaults(func=cmd_calibrate)

    sweep = commands.add_parser("sweep", help=SWEEP_HELP, description=SWEEP_HELP + ".", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(sweep)
    sweep.set_defaults(func=cmd_sweep)

    validate = commands.add_parser("validate", help=VALIDATE_HELP, description=VALIDATE_HELP + ".",
                                   epilog=VALIDATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_validate_args(validate)
    validate.set_defaults(func=cmd_validate)

    tune = sub.add_parser("tune", help=TUNE_HELP, description=TUNE_DESCRIPTION, epilog=TUNE_EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tune_args(tune)
    tune.set_defaults(func=cmd_tune)


TUNE_HELP = "search scheduling settings for the most goodput on a trace, with the simulator"
TUNE_DESCRIPTION = """Search --max-num-seqs, --max-num-batched-tokens, --scheduling-policy and SLO mode for the
most goodput (requests meeting every --goodput SLO) on a load: a `bench serve` result
(--trace) or a dataset at a request rate. Every combination is simulated on virtual time with
this machine's calibration (`tokenmill simulate calibrate`) or a device's roofline; the best
are printed with their predicted goodput, optionally confirmed on the real server
(--confirm K: a fresh `tokenmill serve` per candidate, the load sent by bench serve), and
the winner written as a `serve --config` YAML (--apply FILE).
"""
TUNE_EPILOG = """examples:
  tokenmill tune --dtype float32 --num-threads 1 --goodput ttft:1000 tpot:100 \
      --request-rate 1.5 --num-prompts 300 --input-len 128 --output-len 64 --apply tuned.yaml
  tokenmill tune --dtype float32 --num-threads 1 --goodput ttft:1000 tpot:100 --trace results/rate-2.json \
      --grid max_num_seqs=4,8,16 --confirm 2
  tokenmill serve --config tuned.yaml
"""


CALIBRATE_EPILOG = """\
examples:
  tokenmill simulate calibrate --dtype float32 --num-threads 1
  tokenmill simulate calibrate --dtype float32 --num-threads 1 --repeats 3 --no-server
  tokenmill simulate calibrate --model ~/models/qwen2.5-0.5b.gguf --output qwen.json

The profile goes to ~/.cache/tokenmill/simulator/ (one file per machine, model, --dtype
and --num-threads), where `tokenmill simulate` finds it. Calibrate on a quiet machine:
every other process's load ends up in the coefficients.
"""

VALIDATE_EPILOG = """\
examples:
  tokenmill simulate validate --dtype float32 --num-threads 1 --max-model-len 1024 \\
      --request-rates 0.25,0.5,1,2,inf --num-prompts 32 --input-len 128 --output-len 32 \\
      --num-warmups 1 --repeats 2 --calibrate --output-dir val/
  tokenmill simulate validate --dtype float32 --num-threads 1 --max-model-len 1024 \\
      --measured val/measured --output-dir val/          # predict again, measure nothing

Writes OUTPUT_DIR/measured/run-K/ (bench sweep's files), OUTPUT_DIR/predicted/run-K/,
OUTPUT_DIR/validation.json and OUTPUT_DIR/validation.png (and with --calibrate each point's
calibration, OUTPUT_DIR/profiles/run-K/rate-R.json). On a shared machine use --calibrate:
a calibration made at another load predicts another machine.
"""


# ----- flags -------------------------------------------------------------------------------------------


def add_engine_group(parser: argparse.ArgumentParser, runs_model: bool = False) -> None:
    """serve's engine flags (--kv-cache-dtype, -tp and -pp size the roofline's KV cache and
    split too), but the sampler's --seed (here --seed draws the dataset) and, unless the
    command runs the model, the engine's --device: on virtual time nothing runs on one, and
    --device stays the old spelling of --target-device."""
    from tokenmill.config import add_engine_args

    add_engine_args(parser, skip=("seed",) if runs_model else ("seed", "device"))


def add_model_source_args(parser: argparse.ArgumentParser) -> None:
    """Where a step's cost comes from: this machine's calibration, or a device's roofline."""
    from tokenmill.planner.cli import add_target_args

    source = parser.add_argument_group("cost model (--model: with --target-device also a `tokenmill plan` preset)")
    source.add_argument("--profile", default=None, metavar="FILE",
                        help="a calibration file (default: the stored one for --model, --dtype, --num-threads)")
    add_target_args(source)
    over = parser.add_argument_group("server overheads (default: the calibration's measured ones; 0 with "
                                     "--target-device)")
    over.add_argument("--request-overhead-ms", type=float, default=None,
                      help="from a request's send to the engine holding it (HTTP, validation, tokenization)")
    over.add_argument("--step-overhead-ms", type=float, default=None,
                      help="the server loop's own time per engine step (outputs to the event loop, SSE work)")
    over.add_argument("--chunk-overhead-ms", type=float, default=None,
                      help="per token a step streams, the time the step loses to the event loop's and the client's "
                           "work on it")
    over.add_argument("--token-overhead-ms", type=float, default=None,
                      help="from a step's end to the client holding its chunk")


def add_inputs(parser: argparse.ArgumentParser, sweep: bool) -> None:
    """The cost model, the dataset, the load and the report: what a run and a sweep share."""
    add_model_source_args(parser)
    add_dataset_args(parser)
    load = add_sweep_load_args(parser) if sweep else add_load_args(parser)
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, inf = even")
    if sweep:
        load.add_argument("--grid", action="append", default=None, metavar="SETTING=V1,V2",
                          help="an engine setting to vary (repeatable; every combination is run), e.g. "
                               "max_num_seqs=8,16,32")
    else:
        load.add_argument("--trace", default=None, metavar="RESULT.json",
                          help="replay a `bench serve` result: its send times, prompt and output lengths")
    add_report_args(parser)


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    """Several instances: aggregated replicas, or prefill-decode disaggregation (xPyD)."""
    group = parser.add_argument_group(
        "instances (several engines on one virtual time; requests round-robin, as vllm-router's round_robin)")
    group.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                       help="aggregated replicas, each prefilling and decoding (serve's --data-parallel-size)")
    group.add_argument("--pd", default=None, metavar="xPyD",
                       help="prefill-decode disaggregation, e.g. 1P1D or 2P1D: x prefill and y decode instances, "
                            "the KV pulled over --kv-transfer-bandwidth (docs/disaggregation.md); the report puts it "
                            "beside x + y aggregated replicas on the same load")
    group.add_argument("--kv-transfer-bandwidth", type=float, default=None, metavar="GB/s",
                       help="the link a decode instance pulls KV over, one pull at a time (default: this machine's "
                            "transfer as measured, 1.5 GB/s from shared memory (0.48 GB/s over TCP); a catalog device: "
                            "50 GB/s, a 400 Gb/s NIC)")
    group.add_argument("--kv-transfer-latency-ms", type=float, default=0.0,
                       help="added to every pull (the round trip, the producer reading its blocks); default 0")
    group.add_argument("--kv-copy-in-bandwidth", type=float, default=0.0, metavar="GB/s",
                       help="the decode instance copying pulled KV into its pool on its engine thread, before the "
                            "step that schedules the request (default 0: not counted; tokenmill's consumer copies on its puller "
                            "thread)")


def add_run_args(parser: argparse.ArgumentParser) -> None:
    add_inputs(parser, sweep=False)
    add_layout_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the result as JSON (bench serve's keys)")
    out.add_argument("--save-result", default=None, metavar="FILE", help="write the result as JSON")
    out.add_argument("--plot", default=None, metavar="FILE.png",
                     help="TTFT and ITL CDFs, throughput and KV cache usage over time")
    add_engine_group(parser)


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    add_inputs(parser, sweep=True)
    add_layout_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", required=True, help="one JSON per point, sweep.json and sweep.png (per setting)")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="the sweep figure (default OUTPUT_DIR/sweep.png)")
    out.add_argument("--plot-runs", action="store_true", help="also draw each point's run figure")
    out.add_argument("--json", action="store_true", help="print the sweep's summary rows as JSON")
    add_engine_group(parser)


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    add_inputs(parser, sweep=False)
    group = parser.add_argument_group("search")
    group.add_argument("--grid", action="append", default=None, metavar="SETTING=V1,V2",
                       help="replace an axis of the search (repeatable), e.g. max_num_seqs=4,8,16 or "
                            "scheduling_policy=fcfs,priority; default: max_num_seqs 8,16,32,64 x "
                            "max_num_batched_tokens 256,512,1024,2048 (x fcfs,priority when the trace has priorities)")
    group.add_argument("--slo-mode", choices=("both", "off", "on"), default="both",
                       help="try SLO mode (--slo-ttft-ms/--slo-tpot-ms at the goodput SLOs) off, on, or both")
    group.add_argument("--top", type=positive_int, default=5, help="candidates to print (default 5)")
    group.add_argument("--confirm", type=int, default=0, metavar="K",
                       help="measure the best K on the real server (a fresh `tokenmill serve` each; minutes)")
    group.add_argument("--apply", default=None, metavar="FILE.yaml",
                       help="write the best settings as a `tokenmill serve --config` file")
    group.add_argument("--json", action="store_true", help="print the ranked candidates as JSON")
    add_engine_group(parser)


def add_calibrate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("calibration")
    group.add_argument("--repeats", type=positive_int, default=2,
                       help="times the profile's workloads run (default 2: noise averages out)")
    group.add_argument("--server", action=argparse.BooleanOptionalAction, default=True,
                       help="also start `tokenmill serve` and time lone requests, to measure the server's "
                            "overheads (default on)")
    group.add_argument("--output", default=None, metavar="FILE",
                       help="write the profile here (default: ~/.cache/tokenmill/simulator/)")
    group.add_argument("--json", action="store_true", help="print the profile as JSON")
    add_engine_group(parser, runs_model=True)


def add_validate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("validation")
    group.add_argument("--profile", default=None, metavar="FILE",
                       help="a calibration file (default: the stored one for --model, --dtype, --num-threads)")
    group.add_argument("--request-rates", required=True, help="comma-separated rates, e.g. 0.25,0.5,1,2,inf")
    group.add_argument("--max-concurrency", type=positive_int, default=None, help="client cap at every point")
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the inter-arrival times")
    group.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests before each point (default 1)")
    group.add_argument("--repeats", type=positive_int, default=1, help="measured sweeps to run (default 1)")
    group.add_argument("--calibrate", action="store_true",
                       help="calibrate around every measured point (a quick profile before and after it, the "
                            "server's overheads once) and predict each point from its own: on a shared machine the "
                            "step costs move with the load")
    group.add_argument("--measured", default=None, metavar="DIR",
                       help="compare against this measured sweep instead of running one")
    group.add_argument("--output-dir", required=True, help="measured/, predicted/, validation.json, validation.png")
    group.add_argument("--json", action="store_true", help="print the comparison as JSON")
    add_dataset_args(parser)
    add_report_args(parser)
    add_engine_group(parser, runs_model=True)


# ----- commands ----------------------------------------------------------------------------------------


def _engine_config(args: argparse.Namespace):
    from tokenmill.config import config_from_args

    return config_from_args(args)


def _overheads(args: argparse.Namespace, base):
    from tokenmill.simulator.simulate import ServerOverheads

    given = {"request_s": args.request_overhead_ms, "step_s": args.step_overhead_ms,
             "chunk_s": args.chunk_overhead_ms, "token_s": args.token_overhead_ms}
    base = base or ServerOverheads()
    return ServerOverheads(**{k: (v / 1e3 if v is not None else getattr(base, k)) for k, v in given.items()})


def build_setup(args: argparse.Namespace):
    """The SimulationSetup the flags describe."""
    from tokenmill.simulator import setup as simsetup

    config = _engine_config(args)
    if args.target_device.strip().lower() == "this":
        for flag, value, default in (("--weights", args.weights, None), ("--kv-cache-dtype", args.kv_cache_dtype, "auto"),
                                     ("--tensor-parallel-size", args.tensor_parallel_size, 1),
                                     ("--pipeline-parallel-size", args.pipeline_parallel_size, 1),
                                     ("--gpu-memory-utilization", args.gpu_memory_utilization, None)):
            if value != default:
                raise ValueError(f"{flag} describes a --target-device for the roofline; this machine's calibration "
                                 "has the weights and threads it was run with")
        profile, path = simsetup.resolve_profile(config, args.profile)
        return simsetup.setup_from_profile(config, profile, str(path), _overheads(args, profile.overheads))
    from tokenmill.planner.cli import resolve_device
    from tokenmill.planner.roofline import Parallelism

    if config.model.model is None:
        raise ValueError("--target-device needs a MODEL: a `tokenmill plan` preset, a GGUF file or a config.json")
    return simsetup.setup_from_roofline(
        config, config.model.model, resolve_device(args.target_device), weights=args.weights,
        kv_cache_dtype=args.kv_cache_dtype, parallel=Parallelism(args.tensor_parallel_size,
                                                                 args.pipeline_parallel_size),
        memory_utilization=args.gpu_memory_utilization, overheads=_overheads(args, None),
    )


def _report(args: argparse.Namespace, extra_percentile: float | None = None):
    from tokenmill.simulator.sweep import Report
    from tokenmill.workloads.args import percentiles_from_args
    from tokenmill.workloads.metrics import parse_goodput

    percentiles = percentiles_from_args(args)
    if not percentiles or any(not 0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must lie in (0, 100], got {args.metric_percentiles!r}")
    if extra_percentile is not None:
        percentiles = tuple(sorted({*percentiles, extra_percentile}))
    return Report(parse_goodput(args.goodput) or None, percentiles, args.label)


def _trace(args: argparse.Namespace, setup):
    from tokenmill.workloads.args import dataset_from_args
    from tokenmill.workloads.trace import load_result, synthetic_trace, trace_from_jsonl, trace_from_result

    if args.trace:
        return trace_from_result(load_result(args.trace), seed=args.seed)
    dataset = dataset_from_args(args)
    if dataset.name == "jsonl":
        return trace_from_jsonl(dataset, args.request_rate, args.burstiness, _encoder(args, setup))
    return synthetic_trace(dataset, args.request_rate, args.burstiness)


def _encoder(args: argparse.Namespace, setup):
    """Text prompts of a JSONL dataset: the model's tokenizer (or --tokenizer)."""
    def encode(text: str) -> list[int]:
        from tokenmill.workloads.datasets import LocalTokenSource

        if not hasattr(encode, "tokenizer"):
            spec = args.tokenizer or args.model or "default"
            encode.tokenizer = LocalTokenSource(spec).tokenizer
        return encode.tokenizer.encode(text)

    return encode


def transfer_cost(args: argparse.Namespace):
    """The KV transfer's cost from the flags (simulate --pd)."""
    from tokenmill.planner.costmodel import (
        DEVICE_KV_TRANSFER_BANDWIDTH,
        MEASURED_KV_TRANSFER_BANDWIDTH,
        KVTransferCost,
    )

    if args.kv_transfer_bandwidth is not None:
        bandwidth = args.kv_transfer_bandwidth * 1e9
    elif args.target_device.strip().lower() == "this":
        bandwidth = MEASURED_KV_TRANSFER_BANDWIDTH
    else:
        bandwidth = DEVICE_KV_TRANSFER_BANDWIDTH
    return KVTransferCost(bandwidth, args.kv_transfer_latency_ms / 1e3, args.kv_copy_in_bandwidth * 1e9)


def cmd_simulate(args: argparse.Namespace) -> int:
    from tokenmill.simulator.disaggregation import Layout
    from tokenmill.simulator.sweep import run_point
    from tokenmill.workloads.load_client import format_table, save_result

    setup = build_setup(args)
    trace = _trace(args, setup)
    if args.pd:
        return _compare_layouts(args, setup, trace)
    report = _report(args)
    result = run_point(trace, setup, args.max_concurrency, report, Layout(replicas=args.data_parallel_size))
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
        print(format_extras(result))
    if args.save_result:
        save_result(result, args.save_result)
        print(f"result: {args.save_result}", file=sys.stderr)
    if args.plot:
        from tokenmill.workloads.plots import plot_run

        plot_run(result, args.plot)
        print(f"figure: {args.plot}", file=sys.stderr)
    return 0 if result["completed"] else 1


def _compare_layouts(args: argparse.Namespace, setup, trace) -> int:
    """--pd xPyD: the disaggregated layout and as many aggregated replicas, on the same trace."""
    from tokenmill.simulator.sweep import run_point
    from tokenmill.workloads.load_client import save_result

    layouts, transfer = _layouts(args)
    report = _report(args, extra_percentile=99.0)
    results = {name: run_point(trace, setup, args.max_concurrency, report, which, transfer)
               for name, which in zip(("aggregated", "disaggregated"), layouts)}
    if args.json:
        print(json.dumps(results))
    else:
        print(format_comparison(results, report.percentiles))
        print(f"cost model: {setup.cost_model_source}")
    if args.save_result:
        save_result(results, args.save_result)
        print(f"result: {args.save_result}", file=sys.stderr)
    if args.plot:
        from tokenmill.workloads.plots import plot_run

        stem, dot, ext = args.plot.rpartition(".")
        for name, result in results.items():
            path = f"{stem}-{result['layout']}.{ext}" if dot else f"{args.plot}-{result['layout']}"
            plot_run(result, path)
            print(f"figure: {path}", file=sys.stderr)
    return 0 if all(r["completed"] for r in results.values()) else 1


def format_comparison(results: dict[str, dict[str, Any]], percentiles) -> str:
    """Aggregated beside disaggregated: bench serve's latencies, throughput and goodput,
    the instances' busy time and the KV pulls."""
    runs = list(results.values())
    lines = ["{:=^76}".format(" Aggregated vs disaggregated, same load ")]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:<40}" + "".join(f"{v:>18}" for v in values))

    def number(value: Any, fmt: str = ",.1f") -> str:
        return "-" if value is None else format(value, fmt)

    row("", [r["layout"] for r in runs])
    row("Successful requests:", [number(r["completed"], ",") for r in runs])
    row("Duration (s):", [number(r["duration"], ",.2f") for r in runs])
    row("Output token throughput (tok/s):", [number(r["output_throughput"], ",.2f") for r in runs])
    if runs[0].get("request_goodput") is not None:
        row("Request goodput (req/s):", [number(r["request_goodput"], ",.2f") for r in runs])
    for metric, label in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT")):
        row(f"Median {label} (ms):", [number(r[f"median_{metric}_ms"]) for r in runs])
        for p in percentiles:
            key = f"p{p:g}_{metric}_ms"
            if p != 50 and key in runs[0]:
                row(f"P{p:g} {label} (ms):", [number(r[key]) for r in runs])
    row("Instances busy (%):", [", ".join(f"{i['busy_fraction'] * 100:.0f}" for i in r["instances"]) for r in runs])
    row("Preemptions:", [number(r["num_preemptions"], ",") for r in runs])
    pull = next(r["kv_transfer"] for r in runs if "kv_transfer" in r)
    lines.append(f"KV pulls: {pull['num_pulls']:,}, median {pull['median_pull_bytes'] / 1e6:,.1f} MB in "
                 f"{pull['median_pull_ms']:,.1f} ms (p99 {pull['p99_pull_ms']:,.1f} ms, queueing included); link "
                 f"{pull['cost']['bandwidth_bytes_per_s'] / 1e9:g} GB/s + {pull['cost']['latency_s'] * 1e3:g} ms per "
                 f"pull, copy-in " + (f"{pull['cost']['copy_in_bandwidth_bytes_per_s'] / 1e9:g} GB/s"
                                     if pull['cost']['copy_in_bandwidth_bytes_per_s'] else "not counted"))
    lines.append("=" * 76)
    return "\n".join(lines)


def format_extras(result: dict[str, Any]) -> str:
    """What the simulator adds to bench serve's table."""
    lines = ["{:-^60}".format(" Simulation ")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<44} {value:>15}")

    row("Engine steps:", f"{result['num_steps']:,}")
    row("Preemptions:", f"{result['num_preemptions']:,}")
    row("Peak / mean KV cache usage (%):", f"{result['max_kv_usage']:.1%} / {result['mean_kv_usage']:.1%}")
    row("Prefix cache hit rate (%):", f"{result['prefix_cache_hit_rate']:.1%}")
    row("Simulated in (s):", f"{result['simulation_wall_s']:.2f}")
    if "instances" in result:
        row(f"Instances ({result['layout']}), busy (%):",
            ", ".join(f"{i['busy_fraction'] * 100:.0f}" for i in result["instances"]))
    lines.append(f"cost model: {result['cost_model']['source']}")
    over = result["server_overheads"]
    lines.append(f"server overheads: {over['request_s'] * 1e3:.1f} ms per request, {over['step_s'] * 1e3:.1f} ms per "
                 f"step + {over.get('chunk_s', 0) * 1e3:.1f} ms per streamed token, {over['token_s'] * 1e3:.1f} ms "
                 "chunk delivery")
    lines.append("=" * 60)
    return "\n".join(lines)


def cmd_sweep(args: argparse.Namespace) -> int:
    from tokenmill.simulator.sweep import parse_grid, run_sweep
    from tokenmill.workloads.args import dataset_from_args
    from tokenmill.workloads.load_client import ServeConfig
    from tokenmill.workloads.sweep import format_sweep_table, parse_concurrencies, parse_rates, sweep_points

    setup = build_setup(args)
    dataset = dataset_from_args(args)
    if dataset.name == "jsonl":
        raise ValueError("simulate sweep draws random or shared-prefix datasets; replay a JSONL with `simulate`")
    report = _report(args, extra_percentile=99.0)  # the sweep table reports p99
    rates = parse_rates(args.request_rates) if args.request_rates is not None else None
    caps = parse_concurrencies(args.concurrencies) if args.concurrencies is not None else None
    base = ServeConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency)
    axis, points = sweep_points(rates, caps, base)
    grid = parse_grid(args.grid)
    everything = run_sweep(setup, dataset, axis, points, args.burstiness, report, args.output_dir, grid,
                           args.plot, args.plot_runs, *_layouts(args))
    if args.json:
        from tokenmill.workloads.sweep import summary_row

        print(json.dumps({label: [summary_row(r) for r in results] for label, results in everything.items()}))
        return 0
    for label, results in everything.items():
        if len(everything) > 1:
            print(f"\n[{label}]")
        print(format_sweep_table(results, axis))
        print("preemptions: " + ", ".join(str(r["num_preemptions"]) for r in results)
              + "; peak KV usage: " + ", ".join(f"{r['max_kv_usage']:.0%}" for r in results))
    print(f"cost model: {setup.cost_model_source}")
    print(f"results: {args.output_dir}/", file=sys.stderr)
    return 0


def _layouts(args: argparse.Namespace) -> tuple[list, Any]:
    """The layouts a sweep runs (--pd: x + y replicas and xPyD; -dp N: N replicas) and the
    KV transfer's cost."""
    from tokenmill.simulator.disaggregation import Layout

    if args.pd:
        if args.data_parallel_size != 1:
            raise ValueError("--pd compares xPyD with x + y aggregated replicas; leave --data-parallel-size out")
        layout = Layout.parse(args.pd)
        return [layout.aggregated_peer(), layout], transfer_cost(args)
    return [Layout(replicas=args.data_parallel_size) if args.data_parallel_size > 1 else None], None


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tokenmill.simulator.profile import calibrate, save_profile

    config = _engine_config(args)
    _quiet_http_logs()

    def log(message: str) -> None:
        print(f"[calibrate] {message}", file=sys.stderr, flush=True)

    profile = calibrate(config, repeats=args.repeats, server=args.server, log=log)
    path = save_profile(profile, args.output)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
    else:
        print(format_profile(profile))
    print(f"profile: {path}", file=sys.stderr)
    return 0


def format_profile(profile) -> str:
    model, fit = profile.cost_model, profile.fit
    lines = [
        f"{profile.model_name} on {profile.machine}: {profile.weight_format} weights, {profile.compute_dtype} compute, "
        f"{profile.kv_cache_dtype} KV cache, {profile.num_threads} threads",
        f"  step with prefill = {model.intercept_s * 1e3:.2f} ms + {model.per_prefill_token_s * 1e3:.4f} ms x prefill tokens "
        f"+ {model.per_decode_token_s * 1e3:.4f} ms x decode rows",
        f"      + {model.per_context_token_s * 1e6:.4f} us x decode context tokens "
        f"+ {model.per_prefill_pair_s * 1e9:.4f} ns x prefill attention pairs",
        *([f"  pure decode steps (ms at rows, + the context term): " + ", ".join(
            f"{b}: {t * 1e3:.1f}" for b, t in zip(model.decode_rows, model.decode_seconds))] if model.decode_rows else []),
        f"  fit over {fit['samples']} steps: median error {fit['median_relative_error']:.1%}, max "
        f"{fit['max_relative_error']:.0%} (BLIS's 4 linear terms alone: median {fit['four_term_median_relative_error']:.1%}, "
        f"max {fit['four_term_max_relative_error']:.0%})",
    ]
    if profile.overheads is not None:
        over = profile.overheads
        lines.append(f"  server overheads (measured): {over.request_s * 1e3:.1f} ms per request, "
                     f"{over.step_s * 1e3:.1f} ms per step + {over.chunk_s * 1e3:.1f} ms per streamed token")
    else:
        lines.append("  server overheads: not measured (--no-server); the simulation adds none")
    load = profile.load_average
    lines.append(f"  profiled in {profile.profile_seconds:.0f} s; load average at the end "
                 f"{', '.join(f'{x:.2f}' for x in load) if load else '-'} (on {os.cpu_count()} CPUs)")
    return "\n".join(lines)


def cmd_validate(args: argparse.Namespace) -> int:
    from tokenmill.config import engine_args
    from tokenmill.simulator import setup as simsetup
    from tokenmill.simulator import validate
    from tokenmill.simulator.profile import save_profile
    from tokenmill.workloads.args import dataset_from_args
    from tokenmill.workloads.load_client import ServeConfig
    from tokenmill.workloads.sweep import parse_rates

    config = _engine_config(args)
    report_settings = _report(args, extra_percentile=90.0)
    rates = parse_rates(args.request_rates)
    os.makedirs(args.output_dir, exist_ok=True)
    _quiet_http_logs()

    def log(message: str) -> None:
        print(f"[validate] {message}", file=sys.stderr, flush=True)

    if args.measured:
        if args.calibrate:
            raise ValueError("--calibrate calibrates around the points it measures; with --measured nothing is measured")
        measured = validate.load_measured(args.measured)
        profile, path = simsetup.resolve_profile(config, args.profile)
        setups = [[simsetup.setup_from_profile(config, profile, str(path))] * len(run) for run in measured]
    else:
        serve_config = ServeConfig(dataset=dataset_from_args(args), burstiness=args.burstiness,
                                   max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
                                   goodput=report_settings.goodput or {}, percentiles=report_settings.percentiles,
                                   tokenizer=args.tokenizer, label=args.label, disable_tqdm=True)
        serve_config.check()
        measured, setups = [], []
        for repeat in range(args.repeats):
            directory = os.path.join(args.output_dir, "measured", f"run-{repeat + 1}")
            if args.calibrate:
                results, profiles = validate.measure_calibrated(config, serve_config, rates, directory, log)
                for point, profile in zip(results, profiles):
                    save_profile(profile, os.path.join(args.output_dir, "profiles", f"run-{repeat + 1}",
                                                       f"rate-{point['request_rate']}.json"))
                measured.append(results)
                setups.append([simsetup.setup_from_profile(config, p, f"calibrated around rate {r['request_rate']}")
                               for r, p in zip(results, profiles)])
                continue
            profile, path = simsetup.resolve_profile(config, args.profile)
            measured.append(validate.measure(engine_args(config), serve_config, rates, directory, log))
            setups.append([simsetup.setup_from_profile(config, profile, str(path))] * len(rates))
    predicted = [validate.predict(run, run_setups, report_settings,
                                  os.path.join(args.output_dir, "predicted", f"run-{k + 1}"))
                 for k, (run, run_setups) in enumerate(zip(measured, setups))]
    report = validate.compare(measured, predicted)
    report["cost_models"] = [[setup.cost_model_source for setup in run] for run in setups]
    report["server_overheads"] = [[setup.overheads.to_dict() for setup in run] for run in setups]
    report["engine_flags"] = engine_args(config)
    validate.save_report(report, os.path.join(args.output_dir, "validation.json"))
    figure = os.path.join(args.output_dir, "validation.png")
    validate.plot_validation(report, figure, title=setups[0][0].model_name)
    print(json.dumps(report, indent=1) if args.json else validate.format_validation(report))
    print(f"results: {args.output_dir}/ (validation.json, validation.png)", file=sys.stderr)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from tokenmill.simulator import tune
    from tokenmill.simulator.sweep import parse_grid

    if args.confirm < 0:
        raise ValueError(f"--confirm must be >= 0, got {args.confirm}")
    setup = build_setup(args)
    trace = _trace(args, setup)
    report = _report(args)
    if not report.goodput:
        raise ValueError("tune needs SLOs: --goodput ttft:MS tpot:MS (the goodput it maximizes)")
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.slo_mode]
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[tune] {message}", file=sys.stderr, flush=True)

    candidates = tune.search(trace, setup, report.goodput, parse_grid(args.grid) if args.grid else None, modes,
                             args.max_concurrency, log=None if args.json else log)
    searched_s = time.monotonic() - started
    # The settings given (or the defaults), for comparison.
    current = tune.evaluate(trace, setup, {}, report.goodput, args.max_concurrency, tune.COST_SCALES)
    if args.confirm:
        _quiet_http_logs()
        from tokenmill.config import engine_args

        base_flags = [f for f in engine_args(setup.config)]
        tune.confirm(candidates[:args.confirm], _strip_tuned(base_flags), _confirm_load(args, trace, report),
                     log=None if args.json else log)
        measured = [c for c in candidates[:args.confirm] if c.measured_goodput is not None]
        if measured:  # the measured best among the confirmed, the rest keep their predicted order
            best = max(measured, key=lambda c: c.measured_goodput)
            candidates.remove(best)
            candidates.insert(0, best)
    best = candidates[0]
    slos = " ".join(f"{k}:{v:g}" for k, v in report.goodput.items())
    if args.apply:
        header = (f"tokenmill tune: goodput ({slos}) predicted {best.predicted_goodput:.0%}"
                  + (f", measured {best.measured_goodput:.0%}" if best.measured_goodput is not None else "")
                  + f" on {trace.description}; cost model: {setup.cost_model_source}")
        with open(args.apply, "w", encoding="utf-8") as file:
            file.write(tune.config_yaml(best, header))
    if args.json:
        print(json.dumps({"candidates": [vars(c) | {"flags": c.flags} for c in candidates],
                          "current": vars(current), "search_seconds": searched_s,
                          "cost_model": setup.cost_model_source}))
        return 0
    print(f"{len(candidates)} configurations simulated in {searched_s:.1f} s on {trace.description}; "
          f"goodput = requests meeting {slos}")
    print(tune.format_candidates(candidates, args.top))
    print(f"the settings given: goodput {current.predicted_goodput:.0%} predicted")
    measured = f", {best.measured_goodput:.0%} measured" if best.measured_goodput is not None else ""
    print(f"recommended: tokenmill serve {' '.join(best.flags)}   "
          f"(goodput {best.predicted_goodput:.0%} predicted{measured})")
    print(f"cost model: {setup.cost_model_source}")
    if args.apply:
        print(f"config: {args.apply} (tokenmill serve --config {args.apply})", file=sys.stderr)
    return 0


def _strip_tuned(flags: list[str]) -> list[str]:
    """The base flags without those the tuner sets (its candidates give them)."""
    tuned = {"--max-num-seqs", "--max-num-batched-tokens", "--scheduling-policy", "--slo-ttft-ms", "--slo-tpot-ms"}
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        if flag in tuned:
            skip = True
            continue
        out.append(flag)
    return out


# Requests sent to each confirming server before the measured load (as benchmarks/
# scheduling_goodput_serve.py's sweep sends them): the tuned server runs warm, and SLO mode
# predicts nothing until it has timed 8 steps. Without them, of six settings confirmed on
# 2026-12-06 the first of each run measured 13 and 21 points below the sweep's run of it.
CONFIRM_WARMUPS = 8


def _confirm_load(args: argparse.Namespace, trace, report):
    """bench serve's config sending the load the trace describes (the dataset and rate it
    was drawn with, or those recorded in a bench serve result), after CONFIRM_WARMUPS
    requests of the same shape that are not measured."""
    import math

    from tokenmill.workloads.args import dataset_from_args
    from tokenmill.workloads.datasets import DatasetConfig
    from tokenmill.workloads.load_client import ServeConfig

    if args.trace:
        s = trace.settings
        if s.get("dataset_name") not in ("random", "shared-prefix"):
            raise ValueError("--confirm replays random or shared-prefix loads; this result's dataset is "
                             f"{s.get('dataset_name')!r}")
        dataset = DatasetConfig(name=s["dataset_name"], num_prompts=len(trace), input_len=s["input_len"],
                                output_len=s["output_len"], range_ratio=s.get("range_ratio") or 0.0,
                                prefix_len=s.get("prefix_len") or 0, num_prefixes=s.get("num_prefixes") or 1,
                                seed=s.get("seed") or 0)
        rate = s.get("request_rate")
        rate = math.inf if rate in (None, "inf") else float(rate)
        burstiness = s.get("burstiness") or 1.0
    else:
        dataset, rate, burstiness = dataset_from_args(args), args.request_rate, args.burstiness
    config = ServeConfig(dataset=dataset, request_rate=rate, burstiness=burstiness,
                         max_concurrency=args.max_concurrency, goodput=dict(report.goodput),
                         num_warmups=CONFIRM_WARMUPS, disable_tqdm=True)
    config.check()
    return config


def _quiet_http_logs() -> None:
    """httpx logs every request at INFO: a sweep would drown the progress lines."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
