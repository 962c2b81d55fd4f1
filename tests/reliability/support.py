"""Helpers of the reliability suite: its server's settings, process probes, and the
figures every test records (RESULTS, printed at the end of the session and written to
$TOKENMILL_RELIABILITY_RESULTS when set; docs/reliability.md's table comes from it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.server_utils import ServerProcess

RELIABILITY_ARGS = [
    "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "64MiB", "--num-threads", "1",
    "--max-num-seqs", "8", "--max-queued-requests", "32", "--max-request-body-bytes", "65536",
    "--disable-access-log",
]
RESULTS: dict[str, object] = {}


def long_run(config: pytest.Config) -> bool:
    """True under `-m slow`: the long versions of the tests run."""
    return "slow" in (config.getoption("-m") or "") and "not slow" not in (config.getoption("-m") or "")


def start_server(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A server of the suite's own, for tests that break or stop it."""
    return ServerProcess(*args, base_args=RELIABILITY_ARGS, env=env).start()


# ----- the server process, seen from /proc -----------------------------------------------------


def process_stats(pid: int) -> dict[str, int]:
    """Resident memory (bytes), open file descriptors and threads of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss": int(fields["VmRSS"].split()[0]) * 1024,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
    }


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, theirs, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, p in parents.items() if p == parent]
        found.update(children)
        frontier.extend(children)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(condition, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


