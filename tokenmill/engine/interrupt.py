"""Cutting a step short for a better-ranked arrival (`--priority-interrupt`).

Under the priority policy a request that arrives while a step runs waits for that step
to end, however worse-ranked everything in it is: on the 2-core box that wait is most of
the high-priority tail left after the step bound (docs/scheduling.md). With interrupts
on, the engine arms a `StepInterrupt` with the best rank of a step it may cut; the thread
that queues a request offers the request's rank; the model looks at `requested` between
decoder layers and raises `StepInterrupted` when something better came. Nothing the step
computed is kept: the scheduler puts the step back (`Scheduler.put_back`) and the next
step, which schedules the newcomer first, computes the same tokens again.

Torch-free and thread-safe: `offer` runs on the server's event loop while the engine
thread runs the forward; the model only reads a bool. The server offers under the lock of
its command queue and tells `taken_in` under the same lock when the engine drains it, so
no arrival slips between taking in the queue and arming the step.
"""

from __future__ import annotations

import threading

Rank = tuple[float, float]  # Scheduler.rank: smaller goes first


class StepInterrupted(Exception):
    """The forward stopped between layers: a better-ranked request arrived during the step."""


class StepInterrupt:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: Rank | None = None  # the best rank in the step that runs, while it may be cut
        # The best rank offered by requests queued but not yet taken in by the engine: one
        # queued after the engine took in its requests but before it armed the step it was
        # scheduling (which cannot hold it) must still cut that step.
        self._offered: Rank | None = None
        self.requested = False  # read by the forward between layers

    def arm(self, best_rank: Rank) -> None:
        """A step whose best-ranked request ranks `best_rank` starts, and may be cut."""
        with self._lock:
            self._armed = best_rank
            self.requested = self._offered is not None and self._offered < best_rank

    def disarm(self) -> None:
        with self._lock:
            self._armed = None
            self.requested = False

    def offer(self, rank: Rank) -> bool:
        """A request of `rank` was queued: cut the running step if it ranks strictly better
        than everything in it. Returns whether it asked for the cut now."""
        with self._lock:
            self._offered = rank if self._offered is None else min(self._offered, rank)
            if self._armed is None or not rank < self._armed:
                return False
            self.requested = True
            return True

    def taken_in(self) -> None:
        """The engine took in every request offered so far (the next step can schedule them)."""
        with self._lock:
            self._offered = None
