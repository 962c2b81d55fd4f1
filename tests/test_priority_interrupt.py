"""--priority-interrupt on the default model: a step cut between two decoder layers (half
of its KV written, half not) is put back and computed again, and changes no output.

The cut is made as a better-ranked arrival makes it: `offer_interrupt` while the step's
forward runs (here from a hook before decoder layer 12, on the engine's own thread, so
which steps are cut is exact), then the model stops at the next layer."""

from __future__ import annotations

import pytest

from tests.conftest import assert_engine_idle, sibling
from tokenmill.sampling.params import SamplingParams
from tokenmill.spec_decode.ngram import NgramProposer

PROMPTS = [
    "The lighthouse keeper wrote in his log that night:",
    "The lighthouse keeper wrote in his log that morning, before the storm,",  # shares a prefix
    "List three uses of a paper clip:",
]


def run(llm, cut_steps: set[int]) -> tuple[list[list[int]], int]:
    """Greedy outputs of PROMPTS (chunked: 16 tokens a step), cutting the forwards numbered
    in `cut_steps`; returns them and the engine's count of interrupted steps."""
    engine = llm.engine
    layer = engine.executor.model.layers[12]
    forwards = [0]

    def arrive() -> None:
        if forwards[0] in cut_steps:
            assert engine.offer_interrupt(-1, 0.0), "the step was not armed"
            engine.offers_taken_in()  # (no such request follows: the steps after this one run uncut)
        forwards[0] += 1

    fused_decode = layer.fused_decode  # a decode step of the native fused layer does not call the module

    def fused_then_arrive(*args):
        arrive()
        return fused_decode(*args)

    hook = layer.register_forward_pre_hook(lambda module, args: arrive())
    layer.fused_decode = fused_then_arrive
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                               priority=[1, 1, 1])
    finally:
        hook.remove()
        del layer.fused_decode
    assert forwards[0] > max(cut_steps, default=0), "fewer forwards than the steps to cut"
    stats = engine.stats()
    assert stats.prefix_cache_queries == sum(len(o.prompt_token_ids) for o in outputs)  # a cut admission is not counted twice
    return [o.outputs[0].token_ids for o in outputs], stats.num_interrupted_steps


@pytest.mark.parametrize("cut_steps", [{0}, {1, 2, 5, 9, 10}])
def test_a_cut_step_is_computed_again_and_changes_no_output(llm_f32, cut_steps: set[int]) -> None:
    # One priority level: the step bound has no better level to make room for, so both runs
    # chunk the prompts alike (16 tokens a step) whatever step costs they learn.
    settings = dict(scheduling_policy="priority", priority_step_fraction=0.25, max_num_batched_tokens=16,
                    enable_prefix_caching=True)
    expected, none = run(sibling(llm_f32, **settings), set())
    assert none == 0
    cut = sibling(llm_f32, priority_interrupt=True, **settings)
    outputs, interrupted = run(cut, cut_steps)
    assert interrupted == len(cut_steps)
    assert outputs == expected
    assert_engine_idle(cut)


def test_interrupts_refuse_what_they_cannot_put_back(llm_f32) -> None:
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        sibling(llm_f32, priority_interrupt=True)
    with pytest.raises(ValueError, match="priority-step-fraction"):
        sibling(llm_f32, scheduling_policy="priority", priority_interrupt=True)
    with pytest.raises(ValueError, match="speculative decoding"):
        llm_f32.engine.sibling(proposer=NgramProposer(2, 1, 3), scheduling_policy="priority",
                               priority_interrupt=True, priority_step_fraction=0.25,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 2})
