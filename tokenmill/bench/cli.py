"""`tokenmill bench <kind>`: benchmarks.

Each kind registers itself in `BENCHMARKS` with a function that adds its flags to
its own sub-parser and sets `func`. Heavy imports (torch, transformers) stay inside
the commands, so `tokenmill --help` remains fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

def _register_offline(parser: argparse.ArgumentParser) -> None:
    from tokenmill.bench import offline
    from tokenmill.config import add_engine_args

    offline.add_offline_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=_run_offline)


def _run_offline(args: argparse.Namespace) -> int:
    from tokenmill.bench.offline import cmd_offline

    return cmd_offline(args)


def _register_kernels(parser: argparse.ArgumentParser) -> None:
    from tokenmill.bench.kernels import add_kernels_args

    add_kernels_args(parser)
    parser.set_defaults(func=_run_kernels)


def _run_kernels(args: argparse.Namespace) -> int:
    from tokenmill.bench.kernels import cmd_kernels

    return cmd_kernels(args)


# name -> (help, registration) of the benchmarks that run in-process.
BENCHMARKS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "offline": (
        "throughput and latency of fixed workloads (W1-W6) through the offline API, "
        "optionally against Hugging Face transformers",
        _register_offline,
    ),
    "kernels": (
        "the CPU matmul kernels measured on this machine for a model's shapes, and the engine's choice",
        _register_kernels,
    ),
}


def register(sub) -> None:
    """Add `bench` to the top-level sub-parsers, with one sub-command per benchmark."""
    bench = sub.add_parser("bench", help="benchmarks", description=__doc__.splitlines()[0])
    names = [*BENCHMARKS, "serve", "sweep"]
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(names) + "}")
    for name, (help_text, add) in BENCHMARKS.items():
        parser = kinds.add_parser(name, help=help_text, description=help_text)
        add(parser)
    # The serving load client (`serve`, `sweep`) talks HTTP to any server: no engine flags.
    from tokenmill.bench import serve_cli

    serve_cli.register(kinds)
