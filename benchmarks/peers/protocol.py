"""The JSON-lines protocol between `benchmarks/compare.py` and its worker processes.

Each worker runs one system in its own Python environment (so it must not import
tokenmill: the peers' virtual environments do not have it). It is started once per
(system, prefix-caching setting), loads its model, and then:

1. writes one line `{"ready": true, "info": {...}}` to its stdout;
2. reads one JSON object per line from stdin, `{"workload": "W3", "requests": [[prompt_ids,
   max_tokens], ...], "options": {...}}`, runs that batch, and answers with one line
   `{"record": {...}}` (the fields of `tokenmill.bench.offline.RunRecord`) or
   `{"error": "..."}`;
3. exits at the end of its stdin.

Everything else (library logs, progress) goes to stderr: the real stdout is kept for the
protocol and file descriptor 1 is pointed at stderr before any library is imported, since
some (vLLM) log to stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

# A request: (prompt token ids, number of tokens to generate).
Request = tuple[list[int], int]
Runner = Callable[[str, list[Request], dict[str, Any]], dict[str, Any]]


def claim_stdout() -> TextIO:
    """The protocol channel (the original stdout); fd 1 and `sys.stdout` now go to stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def log(name: str, message: str) -> None:
    print(f"[{name}] {message}", file=sys.stderr, flush=True)


def send(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def serve(channel: TextIO, name: str, info: dict[str, Any], run: Runner) -> int:
    """Announce readiness, then run every request batch read from stdin."""
    send(channel, {"ready": True, "info": info})
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        requests = [(list(p), int(n)) for p, n in message["requests"]]
        try:
            record = run(message.get("workload", ""), requests, message.get("options") or {})
        except Exception as exc:  # report, keep serving: the coordinator decides what to do
            traceback.print_exc()
            send(channel, {"error": f"{type(exc).__name__}: {exc}"})
            continue
        send(channel, {"record": record})
    log(name, "stdin closed, exiting")
    return 0


def record(
    wall_s: float,
    ttft_s: list[float],
    e2e_s: list[float],
    requests: list[Request],
    outputs: list[list[int]],
    cached_tokens: list[int],
    cpu_s: float,
    load: float,
    generated_tokens: int | None = None,
) -> dict[str, Any]:
    """A RunRecord as a dict, checking that every request got exactly its tokens."""
    for (_, n), out in zip(requests, outputs):
        if len(out) != n:
            raise RuntimeError(f"generated {len(out)} tokens where {n} were asked for")
    return {
        "wall_s": wall_s,
        "ttft_s": ttft_s,
        "e2e_s": e2e_s,
        "prompt_tokens": [len(p) for p, _ in requests],
        "output_tokens": [len(o) for o in outputs],
        "cached_tokens": cached_tokens,
        "output_token_ids": outputs,
        "generated_tokens": generated_tokens,
        "cpu_s": cpu_s,
        "loadavg_1m": load,
    }


class Clock:
    """Wall, monotonic and process-CPU time of one batch, from its submission."""

    def __init__(self) -> None:
        self.load = os.getloadavg()[0]
        self.cpu0, self.wall0, self.t0 = time.process_time(), time.perf_counter(), time.monotonic()

    def now(self) -> float:
        """Seconds since submission."""
        return time.monotonic() - self.t0

    def wall(self) -> float:
        return time.perf_counter() - self.wall0

    def cpu(self) -> float:
        return time.process_time() - self.cpu0
