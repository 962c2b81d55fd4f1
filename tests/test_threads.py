"""The compute-thread governor (runner/threads.py): threads follow the cores other work leaves free."""

from __future__ import annotations

from tokenmill.runner.threads import CPUSample, ThreadGovernor, read_sample, threads_for


def test_threads_are_the_cores_others_leave_free() -> None:
    start = CPUSample(wall=0.0, busy=0.0, own=0.0)
    # Alone: both cores busy with our own work only.
    assert threads_for(start, CPUSample(1.0, busy=2.0, own=2.0), num_cores=2) == 2
    # One busy neighbour: the cores were busy for 2 s, we got 1.1 of them.
    assert threads_for(start, CPUSample(1.0, busy=2.0, own=1.1), num_cores=2) == 1
    # Idle neighbours do not count; a light one (under half a core) does not take a core.
    assert threads_for(start, CPUSample(1.0, busy=0.3, own=0.1), num_cores=2) == 2
    assert threads_for(start, CPUSample(1.0, busy=2.0, own=1.6), num_cores=2) == 2
    # Never fewer than one thread, never more than the cores.
    assert threads_for(start, CPUSample(1.0, busy=8.0, own=0.5), num_cores=8) == 1
    assert threads_for(start, CPUSample(1.0, busy=3.0, own=0.0), num_cores=8) == 5
    assert threads_for(start, CPUSample(0.0, busy=3.0, own=0.0), num_cores=4) == 4  # no time passed


def test_the_governor_changes_threads_only_when_the_load_changes_and_not_too_often() -> None:
    samples = iter([
        CPUSample(0.0, 0.0, 0.0),
        CPUSample(0.2, 0.4, 0.4),  # too soon: not read
        CPUSample(1.0, 2.0, 1.0),  # a neighbour took a core
        CPUSample(2.0, 4.0, 2.0),  # still there: no change
        CPUSample(3.0, 6.0, 4.0),  # gone
    ])
    calls: list[int] = []
    governor = ThreadGovernor(2, calls.append, sample=lambda: next(samples), interval_s=0.5)
    assert calls == [2]
    assert [governor.update() for _ in range(4)] == [2, 1, 1, 2]
    assert calls == [2, 1, 2]


def test_without_proc_the_governor_keeps_all_cores() -> None:
    calls: list[int] = []
    governor = ThreadGovernor(4, calls.append, sample=lambda: None)
    assert governor.update() == 4 and calls == [4]


def test_reading_this_machine() -> None:
    sample = read_sample(frozenset({0}))
    assert sample is not None and sample.busy > 0 and sample.own > 0
