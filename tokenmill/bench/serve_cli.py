"""`tokenmill bench serve` and `tokenmill bench sweep`: the command-line flags.

`register(bench_subparsers)` adds both sub-commands to the sub-parsers of
`tokenmill bench`; `python -m tokenmill.bench.serve_cli serve|sweep ...` runs them
on their own. The workload's own flags (dataset, load, report) are in `workloads.args`,
shared with `tokenmill simulate`. Only argparse is imported here: httpx, numpy and
matplotlib load when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tokenmill.workloads.args import (
    add_dataset_args,
    add_load_args,
    add_report_args,
    add_sweep_load_args,
    dataset_from_args,
    percentiles_from_args,
)

SERVE_HELP = "load-test a running OpenAI-compatible server (TTFT, TPOT, ITL, E2E latency, throughput, goodput)"
SWEEP_HELP = "`bench serve` over a series of request rates or concurrencies, with a throughput/latency plot"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags of both commands: the server, the dataset, the request shape, SLOs."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's base URL, without /v1 (default http://127.0.0.1:8000)")
    server.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    server.add_argument("--model", default=None, help="model name to request (default: the first id of /v1/models)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    server.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take (default 3600)")

    add_dataset_args(parser)

    request = parser.add_argument_group("requests")
    request.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                         help="send ignore_eos (default: on for random and shared-prefix, off for jsonl)")
    request.add_argument("--temperature", type=float, default=None, help="default: the server's")
    request.add_argument("--extra-body", type=json.loads, default=None,
                         help="JSON object merged into every request body")
    request.add_argument("--burstiness", type=float, default=1.0,
                         help="gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, inf = even")
    request.add_argument("--num-warmups", type=int, default=0,
                         help="requests sent (with fresh prompts) and not measured before the run (default 0)")

    report = add_report_args(parser)
    report.add_argument("--save-detailed", action="store_true", help="also save every generated text")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    add_load_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--save-result", default=None, metavar="FILE", help="write the result as JSON")
    out.add_argument("--plot", default=None, metavar="FILE.png",
                     help="figure of TTFT and ITL CDFs and throughput over time")


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    add_sweep_load_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", required=True, help="directory for one JSON per point, sweep.json and sweep.png")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="the sweep figure (default OUTPUT_DIR/sweep.png)")
    out.add_argument("--plot-runs", action="store_true", help="also draw each point's run figure next to its JSON")


def register(bench_subparsers) -> None:
    """Add `serve` and `sweep` to the sub-parsers of `tokenmill bench`."""
    serve = bench_subparsers.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    sweep = bench_subparsers.add_parser("sweep", help=SWEEP_HELP, description=SWEEP_HELP)
    add_sweep_args(sweep)
    sweep.set_defaults(func=cmd_sweep)


def config_from_args(args: argparse.Namespace):
    from tokenmill.workloads.load_client import ServeConfig
    from tokenmill.workloads.metrics import parse_goodput

    percentiles = percentiles_from_args(args)
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    dataset = dataset_from_args(args)
    config = ServeConfig(
        base_url=args.base_url.rstrip("/"), endpoint=args.endpoint, model=args.model, dataset=dataset,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        goodput=parse_goodput(args.goodput), percentiles=percentiles, ignore_eos=args.ignore_eos,
        temperature=args.temperature, extra_body=args.extra_body, api_key=args.api_key,
        tokenizer=args.tokenizer, num_warmups=args.num_warmups, timeout=args.timeout,
        disable_tqdm=args.disable_tqdm, label=args.label, save_detailed=args.save_detailed,
    )
    config.check()
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.workloads.load_client import format_table, run_benchmark, save_result

    config = config_from_args(args)
    result = run_benchmark(config)
    print(format_table(result), flush=True)
    if args.save_result:
        save_result(result, args.save_result)
        print(f"result: {args.save_result}")
    if args.plot:
        from tokenmill.workloads.plots import plot_run

        plot_run(result, args.plot)
        print(f"figure: {args.plot}")
    return 0 if result["completed"] else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    from tokenmill.workloads.sweep import format_sweep_table, parse_concurrencies, parse_rates, run_sweep, sweep_points

    config = config_from_args(args)
    config.percentiles = tuple(sorted({*config.percentiles, 99.0}))  # the sweep reports p99
    rates = parse_rates(args.request_rates) if args.request_rates is not None else None
    caps = parse_concurrencies(args.concurrencies) if args.concurrencies is not None else None
    axis, points = sweep_points(rates, caps, config)
    results = run_sweep(config, axis, points, args.output_dir, args.plot, args.plot_runs)
    print(format_sweep_table(results, axis))
    print(f"results: {args.output_dir}/ (one JSON per point, sweep.json); "
          f"figure: {args.plot or os.path.join(args.output_dir, 'sweep.png')}")
    return 0 if all(r["completed"] for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill bench", description=__doc__.splitlines()[0])
    kinds = parser.add_subparsers(dest="bench_command", required=True)
    register(kinds)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
