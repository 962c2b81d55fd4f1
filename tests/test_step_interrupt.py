"""The step interrupt's flag (engine/interrupt.py), torch-free: which arrivals cut a step."""

from __future__ import annotations

from tokenmill.engine.interrupt import StepInterrupt


def test_only_a_strictly_better_rank_cuts_an_armed_step() -> None:
    interrupt = StepInterrupt()
    assert not interrupt.offer((0, 1.0)) and not interrupt.requested  # no step runs
    interrupt.taken_in()
    interrupt.arm((1, 5.0))
    assert not interrupt.offer((1, 6.0)) and not interrupt.offer((2, 0.0))  # equal or worse priority
    assert not interrupt.requested
    assert interrupt.offer((1, 4.0)) and interrupt.requested  # same priority, earlier arrival (aging ranks)
    interrupt.disarm()
    assert not interrupt.requested


def test_an_offer_between_taking_in_the_queue_and_arming_the_step_still_cuts_it() -> None:
    """The engine took in its queue, then a better request was queued, then the step the
    engine scheduled without it is armed: the step is cut at once. Once the engine takes in
    that request, later steps are not."""
    interrupt = StepInterrupt()
    interrupt.taken_in()
    assert not interrupt.offer((0, 2.0))
    interrupt.arm((1, 1.0))
    assert interrupt.requested
    interrupt.disarm()
    interrupt.taken_in()
    interrupt.arm((1, 1.0))
    assert not interrupt.requested
