"""How many compute threads to use, decided while running: all the cores the process may
use, minus those other work is keeping busy.

Why: OpenMP's workers spin at the end of each parallel region waiting for each other, and
a step has hundreds of regions. When another process (or the server's own HTTP thread)
takes a core, a worker that was descheduled holds up every region until the scheduler
gives its core back, and the spinning peers burn the time it needs: on a 2-core machine
one busy neighbour made the server 10-25x slower with 2 threads, while with 1 thread it
kept ~half its speed. A passive wait (OMP_WAIT_POLICY=PASSIVE) avoids the collapse but
cost 41% of uncontended batch-1 decode here (wake-ups on the critical path of every
region). So the threads stay spinning, and their number follows the machine: every half
second (between steps) the governor reads how busy the process's cores were from
/proc/stat, subtracts the process's own CPU time, and uses the cores left over.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5  # how often the load is read (between steps; reading costs ~50 us)
BUSY_THRESHOLD = 0.5  # a core counts as taken when others kept it this busy
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CPUSample:
    wall: float  # seconds
    busy: float  # seconds of non-idle time summed over the process's cores
    own: float  # seconds of CPU time of this process (all its threads)


def read_sample(cpus: frozenset[int]) -> CPUSample | None:
    """Busy time of `cpus` from /proc/stat and this process's CPU time; None off Linux."""
    try:
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) in cpus:
                    values = [int(v) for v in fields[:8]]
                    busy += sum(values) - values[3] - values[4]  # all but idle and iowait
        times = os.times()
        return CPUSample(time.monotonic(), busy / _TICKS, times.user + times.system)
    except (OSError, ValueError, IndexError):
        return None


def threads_for(previous: CPUSample, now: CPUSample, num_cores: int) -> int:
    """The cores not kept busy by others between two samples (at least one)."""
    wall = now.wall - previous.wall
    if wall <= 0:
        return num_cores
    others = max(0.0, (now.busy - previous.busy) - (now.own - previous.own)) / wall
    return max(1, min(num_cores, num_cores - int(others + (1 - BUSY_THRESHOLD))))


class ThreadGovernor:
    """Sets the compute threads to the free cores, re-read every INTERVAL_S. `set_threads`
    and `sample` are injected (tests); by default torch.set_num_threads and /proc."""

    def __init__(self, num_cores: int, set_threads: Callable[[int], None],
                 sample: Callable[[], CPUSample | None] | None = None, interval_s: float = INTERVAL_S) -> None:
        cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(num_cores))
        self.num_cores = num_cores
        self.set_threads = set_threads
        self.sample = sample or (lambda: read_sample(cpus))
        self.interval_s = interval_s
        self.threads = num_cores
        self._last = self.sample()
        set_threads(num_cores)

    def update(self) -> int:
        """Called between steps; returns the thread count in force."""
        if self._last is None:
            return self.threads  # no /proc: stay with all cores
        now = self.sample()
        if now is None or now.wall - self._last.wall < self.interval_s:
            return self.threads
        threads = threads_for(self._last, now, self.num_cores)
        self._last = now
        if threads != self.threads:
            logger.info("compute threads %d -> %d (other work keeps %d of %d cores busy)",
                        self.threads, threads, self.num_cores - threads, self.num_cores)
            self.threads = threads
            self.set_threads(threads)
        return self.threads
