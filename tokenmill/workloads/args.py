"""Command-line flags of a workload, shared by `tokenmill bench serve|sweep` and
`tokenmill simulate`: the dataset, one run's load or a sweep's loads, the report (SLOs,
percentiles, label), and the argparse types they use. Each front door adds its own flags
(the server to load, the engine to simulate) next to these. Only argparse is imported:
the workload's modules load when a command runs.
"""

from __future__ import annotations

import argparse
import math


def positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (or inf)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The dataset flags (shared with `tokenmill simulate`, which replays the same datasets)."""
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", default="random",
                      choices=["random", "shared-prefix", "jsonl", "grounded", "structured", "tool-calls"],
                      help="random token ids; random suffixes after shared prefixes; a JSONL file; "
                           "input-grounded tasks (repeat/correct/rewrite/summarize a given passage, ending at EOS); "
                           "JSON-schema answers over schemas of increasing size (structured); or a multi-turn "
                           "tool-calling agent trace (tool-calls, chat only)")
    data.add_argument("--dataset-path", default=None,
                      help='JSONL file, one {"prompt": TEXT or [IDS]} or {"messages": [...]} per line, '
                           'optionally with "output_len"')
    data.add_argument("--num-prompts", type=positive_int, default=100, help="requests per run (default 100)")
    data.add_argument("--input-len", type=positive_int, default=512,
                      help="prompt tokens (random), or suffix tokens after the prefix (shared-prefix); default 512")
    data.add_argument("--output-len", type=positive_int, default=128, help="tokens to generate (default 128)")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: exact)")
    data.add_argument("--prefix-len", type=int, default=0,
                      help="tokens of the shared prefix (random: default 0; shared-prefix: default 512)")
    data.add_argument("--num-prefixes", type=positive_int, default=1,
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
    load.add_argument("--request-rate", type=positive_rate, default=math.inf,
                      help="requests per second (default inf: all at once)")
    load.add_argument("--max-concurrency", type=positive_int, default=None,
                      help="at most this many requests in flight (default: no cap)")
    return load


def add_sweep_load_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """A sweep's loads: --request-rates or --concurrencies (shared with `tokenmill simulate sweep`)."""
    load = parser.add_argument_group("load")
    axis = load.add_mutually_exclusive_group(required=True)
    axis.add_argument("--request-rates", default=None, help="comma-separated rates, e.g. 0.5,1,2,4,inf")
    axis.add_argument("--concurrencies", default=None, help="comma-separated caps, e.g. 1,2,4,8")
    load.add_argument("--request-rate", type=positive_rate, default=math.inf,
                      help="with --concurrencies: the rate at every point (default inf)")
    load.add_argument("--max-concurrency", type=positive_int, default=None,
                      help="with --request-rates: the cap at every point (default: none)")
    return load


def dataset_from_args(args: argparse.Namespace):
    from tokenmill.workloads.datasets import DatasetConfig

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
