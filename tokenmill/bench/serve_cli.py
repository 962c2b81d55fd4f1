"""`tokenmill bench serve` and `tokenmill bench sweep`: the command-line flags.

`register(bench_subparsers)` adds both sub-commands to the sub-parsers of
`tokenmill bench`; `python -m tokenmill.bench.serve_cli serve|sweep ...` runs them
on their own. Only argparse is imported here: httpx, numpy and matplotlib load when
a command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

SERVE_HELP = "load-test a running OpenAI-compatible server (TTFT, TPOT, ITL, E2E latency, throughput, goodput)"
SWEEP_HELP = "`bench serve` over a series of request rates or concurrencies, with a throughput/latency plot"


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (or inf)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


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


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The dataset flags (shared with `tokenmill simulate`, which replays the same datasets)."""
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "jsonl", "grounded"],
                      help="random token ids; random suffixes after shared prefixes; a JSONL file; or "
                           "input-grounded tasks (repeat/correct/rewrite/summarize a given passage, ending at EOS)")
    data.add_argument("--dataset-path", default=None,
                      help='JSONL file, one {"prompt": TEXT or [IDS]} or {"messages": [...]} per line, '
                           'optionally with "output_len"')
    data.add_argument("--num-prompts", type=_positive_int, default=100, help="requests per run (default 100)")
    data.add_argument("--input-len", type=_positive_int, default=512,
                      help="prompt tokens (random), or suffix tokens after the prefix (shared-prefix); default 512")
    data.add_argument("--output-len", type=_positive_int, default=128, help="tokens to generate (default 128)")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: exact)")
    data.add_argument("--prefix-len", type=int, default=0,
                      help="tokens of the shared prefix (random: default 0; shared-prefix: default 512)")
    data.add_argument("--num-prefixes", type=_positive_int, default=1,
                      help="shared-prefix: distinct prefixes, assigned round-robin (default 1)")
    data.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times (default 0)")
    data.add_argument("--tokenizer", default=None,
                      help="GGUF file or Hugging Face directory (or 'default': tokenmill's default model) whose "
                           "vocabulary random prompts use (default: the server's /tokenize, else ids 1000-4999)")


def add_report_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """SLOs, percentiles and a label (shared with `tokenmill simulate`); the group, for more flags."""
    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:1000 tpot:100 e2el:5000 (milliseconds)")
    report.add_argument("--metric-percentiles", default="90,99", help="percentiles to report (default 90,99)")
    report.add_argument("--label", default=None, help="free-form label stored in the result")
    return report


def add_load_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """One run's load: --request-rate and --max-concurrency (shared with `tokenmill simulate`)."""
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf,
                      help="requests per second (default inf: all at once)")
    load.add_argument("--max-concurrency", type=_positive_int, default=None,
                      help="at most this many requests in flight (default: no cap)")
    return load


def add_sweep_load_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """A sweep's loads: --request-rates or --concurrencies (shared with `tokenmill simulate sweep`)."""
    load = parser.add_argument_group("load")
    axis = load.add_mutually_exclusive_group(required=True)
    axis.add_argument("--request-rates", default=None, help="comma-separated rates, e.g. 0.5,1,2,4,inf")
    axis.add_argument("--concurrencies", default=None, help="comma-separated caps, e.g. 1,2,4,8")
    load.add_argument("--request-rate", type=_rate, default=math.inf,
                      help="with --concurrencies: the rate at every point (default inf)")
    load.add_argument("--max-concurrency", type=_positive_int, default=None,
                      help="with --request-rates: the cap at every point (default: none)")
    return load


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


def dataset_from_args(args: argparse.Namespace):
    from tokenmill.bench.datasets import DatasetConfig

    return DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
        path=args.dataset_path, seed=args.seed,
    )


def percentiles_from_args(args: argparse.Namespace) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles: {args.metric_percentiles!r} is not a list of numbers") from None


def config_from_args(args: argparse.Namespace):
    from tokenmill.bench.metrics import parse_goodput
    from tokenmill.bench.serve import ServeConfig

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
    from tokenmill.bench.serve import format_table, run_benchmark, save_result

    config = config_from_args(args)
    result = run_benchmark(config)
    print(format_table(result), flush=True)
    if args.save_result:
        save_result(result, args.save_result)
        print(f"result: {args.save_result}")
    if args.plot:
        from tokenmill.bench.plots import plot_run

        plot_run(result, args.plot)
        print(f"figure: {args.plot}")
    return 0 if result["completed"] else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    from tokenmill.bench.sweep import format_sweep_table, parse_concurrencies, parse_rates, run_sweep, sweep_points

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
