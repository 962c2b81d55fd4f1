"""Tests of tokenmill.engine.scheduler with a fake model runner (no model, no torch).

The harness (tests/fakes.py) checks the scheduler's contract after every schedule() and
update_from_output(): token budget, max_num_seqs, running-before-waiting order, exact block
table sizes, preemption rules, and, through a fake paged KV memory, that every token a
request attends to is read back from the right block. `check_integrity()` runs after
every operation.
"""

from __future__ import annotations

import random

import pytest
from fakes import EOS, Harness, make_request, reference_outputs

from tokenmill.config import SchedulingConfig  # its default: off
from tokenmill.engine.kv_events import BlockRemoved, BlockStored, KVEventLog
from tokenmill.engine.request import RequestStatus
from tokenmill.engine.scheduler import PRIORITY_GUARD_SECONDS
from tokenmill.engine.step_cost import ForecastError, StepCostEstimator
from tokenmill.sampling.params import SamplingParams


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def trace(out) -> list[tuple[str, int, int, bool]]:
    return [(item.request_id, item.start_pos, item.num_tokens, item.sample) for item in out.scheduled]


# ----- basic flow --------------------------------------------------------------------


def test_single_request_prefill_then_decode_to_max_tokens() -> None:
    h = Harness()
    prompt = tokens(100, 6)
    a = h.add("a", prompt, max_tokens=5)
    out = h.step()
    assert trace(out) == [("a", 0, 6, True)]
    assert out.scheduled[0].block_ids == [0, 1]
    assert out.scheduled[0].token_ids == prompt
    for i in range(4):
        out = h.step()
        assert trace(out) == [("a", 6 + i, 1, True)]
        assert out.scheduled[0].token_ids == [a.output_token_ids[i]]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == reference_outputs(prompt, 5)
    assert a.num_tokens == 11
    # Freed at once (the harness checked), and reported once by the next schedule.
    assert h.kv.num_free_blocks == h.kv.num_blocks
    out = h.schedule()
    assert out.is_empty and out.finished_ids == ["a"]
    assert h.schedule().finished_ids == []
    h.assert_idle()


def test_scheduler_output_block_table_is_a_snapshot() -> None:
    h = Harness()
    h.add("a", tokens(0, 4), max_tokens=3)
    first = h.step()
    assert first.scheduled[0].block_ids == [0]
    second = h.step()
    assert second.scheduled[0].block_ids == [0, 1]
    assert first.scheduled[0].block_ids == [0]


def test_budget_and_sequence_cap_hold_every_step() -> None:
    h = Harness(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=16)
    rng = random.Random(1)
    prompts = {f"r{i}": tokens(50 * i, rng.randint(3, 30)) for i in range(10)}
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_tokens=rng.randint(1, 8))
    max_batched, max_seqs = 0, 0
    while h.sched.has_unfinished_requests():
        out = h.step()  # asserts budget <= 16 and <= 3 sequences
        max_batched = max(max_batched, out.num_batched_tokens)
        max_seqs = max(max_seqs, len(out.scheduled))
    assert max_batched == 16 and max_seqs == 3
    for rid, prompt in prompts.items():
        request = h.finished[rid]
        assert request.output_token_ids == reference_outputs(prompt, request.params.max_tokens)
    h.assert_idle()


def test_max_num_seqs_holds_back_admissions_until_a_request_finishes() -> None:
    h = Harness(num_blocks=32, max_num_seqs=2)
    h.add("a", tokens(0, 4), max_tokens=2)
    h.add("b", tokens(10, 4), max_tokens=4)
    h.add("c", tokens(20, 4), max_tokens=1)
    assert [i[0] for i in trace(h.step())] == ["a", "b"]
    assert [r.request_id for r in h.sched.waiting] == ["c"]
    assert [i[0] for i in trace(h.step())] == ["a", "b"]  # a finishes here
    assert trace(h.step()) == [("b", 5, 1, True), ("c", 0, 4, True)]
    h.run()
    h.assert_idle()


# ----- ordering and chunked prefill --------------------------------------------------


def test_decodes_go_before_new_prefills_and_share_the_step_with_a_chunk() -> None:
    h = Harness(num_blocks=20, max_num_batched_tokens=16)
    a = h.add("a", tokens(0, 5), max_tokens=10)
    assert trace(h.step()) == [("a", 0, 5, True)]
    b_prompt = tokens(200, 30)
    b = h.add("b", b_prompt, max_tokens=2)
    out = h.step()
    assert trace(out) == [("a", 5, 1, True), ("b", 0, 15, False)]
    assert out.scheduled[1].token_ids == b_prompt[:15]
    assert b.num_output_tokens == 0
    out = h.step()
    assert trace(out) == [("a", 6, 1, True), ("b", 15, 15, True)]
    assert out.scheduled[1].token_ids == b_prompt[15:]
    assert b.num_output_tokens == 1
    assert trace(h.step()) == [("a", 7, 1, True), ("b", 30, 1, True)]
    assert b.status == RequestStatus.FINISHED_LENGTH
    h.run()
    assert a.output_token_ids == reference_outputs(tokens(0, 5), 10)
    assert b.output_token_ids == reference_outputs(b_prompt, 2)
    h.assert_idle()


def test_long_prompt_is_chunked_and_samples_only_on_the_last_chunk() -> None:
    h = Harness(num_blocks=20, max_num_batched_tokens=16)
    prompt = tokens(0, 40)
    a = h.add("a", prompt, max_tokens=2)
    out = h.step()
    assert trace(out) == [("a", 0, 16, False)]
    assert out.scheduled[0].block_ids == [0, 1, 2, 3]
    assert a.num_output_tokens == 0 and a.num_computed_tokens == 16
    out = h.step()
    assert trace(out) == [("a", 16, 16, False)]
    assert out.scheduled[0].block_ids == list(range(8))
    out = h.step()
    assert trace(out) == [("a", 32, 8, True)]
    assert out.scheduled[0].block_ids == list(range(10))
    assert a.num_output_tokens == 1
    out = h.step()
    assert trace(out) == [("a", 40, 1, True)]
    assert out.scheduled[0].block_ids == list(range(11))
    assert a.output_token_ids == reference_outputs(prompt, 2)
    h.assert_idle()


def test_admission_chunk_takes_the_rest_of_the_budget_and_later_requests_wait() -> None:
    h = Harness(num_blocks=30, max_num_batched_tokens=10)
    h.add("a", tokens(0, 7), max_tokens=3)
    h.add("b", tokens(100, 20), max_tokens=1)
    h.add("c", tokens(200, 2), max_tokens=1)
    assert trace(h.step()) == [("a", 0, 7, True), ("b", 0, 3, False)]
    assert trace(h.step()) == [("a", 7, 1, True), ("b", 3, 9, False)]
    # b's prefill is not done: c still waits behind it (the budget is spent).
    assert trace(h.step()) == [("a", 8, 1, True), ("b", 12, 8, True), ("c", 0, 1, False)]
    assert trace(h.step()) == [("c", 1, 1, True)]
    h.run()
    h.assert_idle()


def test_running_decodes_can_use_the_whole_budget() -> None:
    h = Harness(num_blocks=30, max_num_batched_tokens=2)
    h.add("a", tokens(0, 2), max_tokens=4)
    h.add("b", tokens(10, 2), max_tokens=4)
    assert trace(h.step()) == [("a", 0, 2, True)]
    assert trace(h.step()) == [("a", 2, 1, True), ("b", 0, 1, False)]
    assert trace(h.step()) == [("a", 3, 1, True), ("b", 1, 1, True)]
    h.add("c", tokens(20, 2), max_tokens=1)
    assert trace(h.step()) == [("a", 4, 1, True), ("b", 2, 1, True)]  # nothing left for c
    h.run()
    assert h.finished["c"].output_token_ids == reference_outputs(tokens(20, 2), 1)
    h.assert_idle()


def test_prompt_logprob_targets_follow_the_chunks() -> None:
    h = Harness(num_blocks=20, max_num_batched_tokens=6)
    prompt = tokens(300, 14)
    h.add("a", prompt, max_tokens=2, prompt_logprobs=1)
    targets: list[int] = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        for item in out.scheduled:
            if item.prompt_logprobs_targets is not None:
                assert item.start_pos + len(item.prompt_logprobs_targets) <= len(prompt) - 1
                targets += item.prompt_logprobs_targets
    assert targets == prompt[1:]


# ----- stop conditions ---------------------------------------------------------------


def policy_eos_at(index: int):
    return lambda rid, i, ctx: EOS if i == index else None


def test_eos_stops_and_frees_at_once() -> None:
    h = Harness(policy=policy_eos_at(2))
    a = h.add("a", tokens(0, 6), max_tokens=10)
    other = h.add("b", tokens(50, 3), max_tokens=1, ignore_eos=True)  # decodes EOS too, ignored
    h.step()
    h.step()
    assert a.num_output_tokens == 2 and h.kv.get_block_ids("a") == [0, 1]
    out = h.step()
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids[-1] == EOS and a.num_output_tokens == 3
    assert a.stop_reason is None
    assert h.kv.num_free_blocks == h.kv.num_blocks
    assert other.status == RequestStatus.FINISHED_LENGTH
    assert "a" not in h.sched.requests
    assert out.finished_ids == []
    assert h.schedule().finished_ids == ["a"]
    h.assert_idle()


def test_ignore_eos_keeps_going_to_max_tokens() -> None:
    h = Harness(policy=lambda rid, i, ctx: EOS)
    a = h.add("a", tokens(0, 3), max_tokens=4, ignore_eos=True)
    h.run()
    assert a.output_token_ids == [EOS] * 4
    assert a.status == RequestStatus.FINISHED_LENGTH
    h.assert_idle()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_token_ids_stop_with_a_stop_reason(ignore_eos: bool) -> None:
    h = Harness(policy=lambda rid, i, ctx: 777 if i == 1 else None)
    a = h.add("a", tokens(0, 3), max_tokens=10, stop_token_ids=[777, 778], ignore_eos=ignore_eos)
    h.run()
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.stop_reason == 777
    assert a.num_output_tokens == 2 and a.output_token_ids[-1] == 777
    h.assert_idle()


def test_max_model_len_caps_the_output() -> None:
    h = Harness(max_model_len=16)
    prompt = tokens(0, 10)
    a = h.add("a", prompt, max_tokens=100)
    assert a.max_tokens == 6
    while h.sched.has_unfinished_requests():
        out = h.step()
        assert all(item.context_len <= 15 for item in out.scheduled)
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.num_tokens == 16
    assert a.output_token_ids == reference_outputs(prompt, 6)
    h.assert_idle()


def test_max_tokens_none_runs_to_max_model_len() -> None:
    h = Harness(max_model_len=12)
    a = h.add("a", tokens(0, 5), max_tokens=None)
    h.run()
    assert a.num_tokens == 12 and a.status == RequestStatus.FINISHED_LENGTH
    h.assert_idle()


def test_min_tokens_suppresses_eos_and_stop_ids_through_banned_ids() -> None:
    h = Harness(policy=lambda rid, i, ctx: EOS)
    a = h.add("a", tokens(0, 3), max_tokens=10, min_tokens=3, stop_token_ids=[9])
    banned = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        banned += [item.banned_token_ids for item in out.scheduled if item.sample]
    assert banned == [[EOS, 9], [EOS, 9], [EOS, 9], []]
    assert a.num_output_tokens == 4
    assert EOS not in a.output_token_ids[:3] and a.output_token_ids[3] == EOS
    assert a.status == RequestStatus.FINISHED_STOPPED
    h.assert_idle()


def test_min_tokens_with_ignore_eos_bans_only_stop_ids() -> None:
    h = Harness(policy=lambda rid, i, ctx: 9)
    a = h.add("a", tokens(0, 3), max_tokens=10, min_tokens=2, stop_token_ids=[9], ignore_eos=True)
    banned = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        banned += [item.banned_token_ids for item in out.scheduled if item.sample]
    assert banned == [[9], [9], []]
    assert a.output_token_ids[2] == 9 and a.stop_reason == 9
    h.assert_idle()


def test_min_tokens_beyond_max_model_len_still_stops_at_the_cap() -> None:
    h = Harness(num_blocks=20, max_model_len=64, policy=lambda rid, i, ctx: EOS)
    a = h.add("a", tokens(0, 60), max_tokens=10, min_tokens=10)
    h.run()
    assert a.num_tokens == 64 and a.status == RequestStatus.FINISHED_LENGTH
    assert EOS not in a.output_token_ids
    h.assert_idle()


# ----- aborts ------------------------------------------------------------------------


def test_abort_running_and_waiting_requests_frees_at_once() -> None:
    h = Harness(num_blocks=10, max_num_seqs=2)
    a = h.add("a", tokens(0, 9), max_tokens=10)  # 3 blocks
    b = h.add("b", tokens(50, 5), max_tokens=10)  # 2 blocks
    c = h.add("c", tokens(90, 5), max_tokens=3)
    h.step()
    assert h.kv.num_free_blocks == 5
    h.abort("a")  # running
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert h.kv.num_free_blocks == 8
    assert [r.request_id for r in h.sched.running] == ["b"]
    h.abort("c")  # waiting
    assert c.status == RequestStatus.FINISHED_ABORTED and not h.sched.waiting
    h.abort("a", "c", "nope")  # finished or unknown ids are ignored
    out = h.step()
    assert out.finished_ids == ["a", "c"]
    assert trace(out) == [("b", 5, 1, True)]
    h.run()
    assert b.output_token_ids == reference_outputs(tokens(50, 5), 10)
    h.assert_idle()


def test_abort_between_schedule_and_update_is_ignored_by_update() -> None:
    h = Harness()
    a = h.add("a", tokens(0, 5), max_tokens=5)
    b = h.add("b", tokens(40, 5), max_tokens=2)
    out = h.schedule()
    runner_output = h.runner.execute(out)
    h.abort("a")
    updated = h.sched.update_from_output(out, runner_output)
    h.kv.check_integrity()
    assert [r.request_id for r in updated] == ["b"]
    assert a.num_output_tokens == 0 and a.status == RequestStatus.FINISHED_ABORTED
    h.run()
    assert b.status == RequestStatus.FINISHED_LENGTH
    h.assert_idle()


# ----- admission checks --------------------------------------------------------------


def test_request_that_can_never_fit_is_rejected_leaving_nothing_allocated() -> None:
    h = Harness(num_blocks=4, block_size=4)  # 16 token slots
    running = h.add("ok", tokens(0, 5), max_tokens=2)
    h.step()
    before = (h.kv.num_free_blocks, dict(h.kv.req_blocks), len(h.sched.waiting), set(h.sched.requests))
    with pytest.raises(ValueError, match=r"max_tokens \(10\).*can never fit in the KV cache \(16 tokens\)"):
        h.add("big", tokens(100, 10), max_tokens=10)
    with pytest.raises(ValueError, match="16 tokens"):
        h.add("unbounded", tokens(100, 10), max_tokens=None)  # room left in max_model_len: 54
    assert (h.kv.num_free_blocks, dict(h.kv.req_blocks), len(h.sched.waiting), set(h.sched.requests)) == before
    assert "big" not in h.kv.req_hashes
    h.kv.check_integrity()
    h.add("fits", tokens(100, 8), max_tokens=8)  # 16 tokens at most
    h.run()
    assert running.status == RequestStatus.FINISHED_LENGTH
    assert h.finished["fits"].output_token_ids == reference_outputs(tokens(100, 8), 8)
    h.assert_idle()


@pytest.mark.parametrize("max_tokens", [9, None])
def test_request_needing_exactly_the_whole_kv_cache_is_admitted(max_tokens: int | None) -> None:
    """prompt 8 + max_tokens 9 = 17 tokens, but the last sampled token is never fed to
    the model, so only 16 KV slots are ever needed: it fits a 16-slot cache exactly and
    must not be rejected as one that "can never fit". (max_tokens None: capped by
    max_model_len 17 to the same 9.)"""
    h = Harness(num_blocks=4, block_size=4, max_model_len=17)
    prompt = tokens(0, 8)
    a = h.add("a", prompt, max_tokens=max_tokens, ignore_eos=True)
    assert a.max_tokens == 9
    while h.sched.has_unfinished_requests():
        out = h.step()
        assert not out.preempted_ids
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == reference_outputs(prompt, 9)
    h.assert_idle()
    # One more output token needs a 17th slot: that can never fit.
    wider = Harness(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"can never fit in the KV cache \(16 tokens\)"):
        wider.add("b", prompt, max_tokens=10)
    wider.assert_idle()


def test_empty_prompt_and_prompt_at_max_model_len_are_rejected() -> None:
    h = Harness(num_blocks=40, max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        h.add("empty", [], max_tokens=1)
    with pytest.raises(ValueError, match="max_model_len is 32"):
        h.add("at", tokens(0, 32), max_tokens=1)
    with pytest.raises(ValueError, match="max_model_len is 32"):
        h.add("over", tokens(0, 40), max_tokens=1)
    assert not h.sched.requests and not h.sched.waiting
    a = h.add("longest", tokens(0, 31), max_tokens=5)
    with pytest.raises(ValueError, match="already in use"):
        h.add("longest", tokens(0, 3))
    h.run()
    assert a.output_token_ids == reference_outputs(tokens(0, 31), 1)
    h.assert_idle()


# ----- preemption --------------------------------------------------------------------


def test_preemption_of_the_newest_request_when_kv_runs_out() -> None:
    h = Harness(num_blocks=6, block_size=4, enable_caching=False)
    prompts = {rid: tokens(100 * i, 7) for i, rid in enumerate("ABC")}
    reqs = {rid: h.add(rid, p, max_tokens=8, ignore_eos=True) for rid, p in prompts.items()}
    assert trace(h.step()) == [("A", 0, 7, True), ("B", 0, 7, True), ("C", 0, 7, True)]
    assert [h.kv.get_block_ids(r) for r in "ABC"] == [[0, 1], [2, 3], [4, 5]]
    assert trace(h.step()) == [("A", 7, 1, True), ("B", 7, 1, True), ("C", 7, 1, True)]
    # Each needs a third block now; none is free: C (the newest) is preempted.
    out = h.step()
    assert out.preempted_ids == ["C"]
    assert trace(out) == [("A", 8, 1, True), ("B", 8, 1, True)]
    assert h.kv.get_block_ids("A") == [0, 1, 4] and h.kv.get_block_ids("B") == [2, 3, 5]
    c = reqs["C"]
    assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and c.num_output_tokens == 2  # generated tokens are kept
    assert [r.request_id for r in h.sched.waiting] == ["C"]
    assert h.sched.num_preemptions == 1
    stats = h.sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (2, 1, 1)
    assert stats.kv_usage == 1.0
    preempted = ["C"]
    while h.sched.has_unfinished_requests():
        preempted += h.step().preempted_ids
    assert h.sched.num_preemptions == len(preempted)
    for rid, request in reqs.items():
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == reference_outputs(prompts[rid], 8), rid
    h.assert_idle()


def test_no_admission_in_a_step_that_preempted() -> None:
    """Step 6 preempts V to give A a block; V's first chunk (4 tokens, one block) would
    fit in what is left, but nothing is admitted in a step that had to preempt."""
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=5, enable_caching=False)
    a = h.add("A", tokens(0, 4), max_tokens=8)
    v = h.add("V", tokens(500, 16), max_tokens=3)
    assert trace(h.step()) == [("A", 0, 4, True), ("V", 0, 1, False)]
    assert trace(h.step()) == [("A", 4, 1, True), ("V", 1, 4, False)]
    assert trace(h.step()) == [("A", 5, 1, True), ("V", 5, 4, False)]
    assert trace(h.step()) == [("A", 6, 1, True), ("V", 9, 4, False)]
    assert h.kv.num_free_blocks == 0
    assert trace(h.step()) == [("A", 7, 1, True), ("V", 13, 3, True)]
    assert h.kv.get_block_ids("V") == [1, 3, 4, 5]
    out = h.step()
    assert out.preempted_ids == ["V"]
    assert trace(out) == [("A", 8, 1, True)]
    assert h.kv.get_block_ids("A") == [0, 2, 1]
    assert v.num_output_tokens == 1 and v.num_computed_tokens == 0
    left = h.config.max_num_batched_tokens - out.num_batched_tokens
    assert h.kv.num_free_blocks >= h.kv.blocks_needed(min(v.num_tokens, left))  # it would have fit
    assert trace(h.step()) == [("A", 9, 1, True), ("V", 0, 4, False)]
    assert h.kv.get_block_ids("V") == [3]
    h.run()
    assert a.output_token_ids == reference_outputs(tokens(0, 4), 8)
    assert v.output_token_ids == reference_outputs(tokens(500, 16), 3)
    assert h.sched.num_preemptions == 1
    h.assert_idle()


def test_the_newest_request_preempts_itself_when_it_cannot_grow() -> None:
    h = Harness(num_blocks=5, block_size=4, enable_caching=False)
    a = h.add("A", tokens(0, 8), max_tokens=4)
    b = h.add("B", tokens(100, 7), max_tokens=6)
    assert trace(h.step()) == [("A", 0, 8, True), ("B", 0, 7, True)]
    assert trace(h.step()) == [("A", 8, 1, True), ("B", 7, 1, True)]
    assert h.kv.get_block_ids("A") == [0, 1, 4] and h.kv.num_free_blocks == 0
    out = h.step()  # B needs a third block; it is the newest running request itself
    assert out.preempted_ids == ["B"]
    assert trace(out) == [("A", 9, 1, True)]
    assert b.num_output_tokens == 2 and b.num_preemptions == 1
    assert list(h.kv.free_queue) == [2, 3]
    assert trace(h.step()) == [("A", 10, 1, True)]  # B needs 3 blocks, 2 are free
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert trace(h.step()) == [("B", 0, 9, True)]
    h.run()
    assert a.output_token_ids == reference_outputs(tokens(0, 8), 4)
    assert b.output_token_ids == reference_outputs(tokens(100, 7), 6)
    assert h.sched.num_preemptions == 1
    h.assert_idle()


def test_a_chunked_prefill_preempted_again_and_again_still_completes() -> None:
    """B's first chunk is admitted whenever two blocks are free, and preempted as soon as
    A needs another block; it completes once A is done."""
    h = Harness(num_blocks=5, block_size=4, max_num_batched_tokens=8, enable_caching=False)
    a = h.add("A", tokens(0, 8), max_tokens=9)
    b = h.add("B", tokens(100, 12), max_tokens=2)
    steps = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        steps.append((trace(out), out.preempted_ids))
    assert steps[:6] == [
        ([("A", 0, 8, True)], []),
        ([("A", 8, 1, True), ("B", 0, 7, False)], []),
        ([("A", 9, 1, True)], ["B"]),
        ([("A", 10, 1, True), ("B", 0, 7, False)], []),
        ([("A", 11, 1, True)], ["B"]),
        ([("A", 12, 1, True)], []),
    ]
    assert steps[-3:] == [
        ([("B", 0, 8, False)], []),
        ([("B", 8, 4, True)], []),
        ([("B", 12, 1, True)], []),
    ]
    assert b.num_preemptions == 2 and h.sched.num_preemptions == 2
    assert a.output_token_ids == reference_outputs(tokens(0, 8), 9)
    assert b.output_token_ids == reference_outputs(tokens(100, 12), 2)
    h.assert_idle()


def test_preempted_request_recomputes_from_its_own_cached_prefix() -> None:
    h = Harness(num_blocks=6, block_size=4, enable_caching=True)
    a = h.add("A", tokens(0, 7), max_tokens=6)
    c = h.add("C", tokens(100, 12), max_tokens=4)
    assert trace(h.step()) == [("A", 0, 7, True), ("C", 0, 12, True)]
    assert h.kv.get_block_ids("C") == [2, 3, 4]
    assert trace(h.step()) == [("A", 7, 1, True), ("C", 12, 1, True)]
    assert h.kv.get_block_ids("C") == [2, 3, 4, 5]
    out = h.step()
    assert out.preempted_ids == ["C"] and trace(out) == [("A", 8, 1, True)]
    # C's partial block went to the head and was taken by A; its three full blocks stay
    # cached at the tail, newest first.
    assert h.kv.get_block_ids("A") == [0, 1, 5]
    assert list(h.kv.free_queue) == [4, 3, 2]
    for _ in range(3):  # A decodes to its end; C (4 blocks, 3 of them hits) does not fit
        assert [i[0] for i in trace(h.step())] == ["A"]
    assert a.status == RequestStatus.FINISHED_LENGTH
    out = h.step()
    assert trace(out) == [("C", 12, 2, True)]
    assert out.scheduled[0].block_ids == [2, 3, 4, 5]
    assert h.kv.stats.hits == 12
    assert c.num_cached_tokens == 0  # set at the first admission only
    h.run()
    assert a.output_token_ids == reference_outputs(tokens(0, 7), 6)
    assert c.output_token_ids == reference_outputs(tokens(100, 12), 4)
    h.assert_idle()


# ----- prefix caching through the scheduler ------------------------------------------


@pytest.mark.parametrize("same_step", [False, True])
def test_second_request_schedules_only_its_uncached_tokens(same_step: bool) -> None:
    h = Harness(num_blocks=20)
    shared = tokens(1000, 16)
    a = h.add("a", [*shared, 1, 2, 3, 4], max_tokens=3)
    if not same_step:
        h.run()
    b_prompt = [*shared, 7, 8, 9, 10, 11]
    b = h.add("b", b_prompt, max_tokens=3)
    out = h.step()
    item = next(i for i in out.scheduled if i.request_id == "b")
    assert (item.start_pos, item.num_tokens, item.token_ids) == (16, 5, b_prompt[16:])
    assert b.num_cached_tokens == 16
    if same_step:  # a's blocks were hashed when allocated, earlier in this very step
        assert [i.request_id for i in out.scheduled] == ["a", "b"]
        assert item.block_ids[:4] == h.kv.get_block_ids("a")[:4]
    assert (h.kv.stats.queries, h.kv.stats.hits) == (20 + 21, 16)
    assert (h.sched.stats().prefix_cache_queries, h.sched.stats().prefix_cache_hits) == (41, 16)
    h.run()
    assert a.output_token_ids == reference_outputs([*shared, 1, 2, 3, 4], 3)
    assert b.output_token_ids == reference_outputs(b_prompt, 3)
    h.assert_idle()


def test_identical_prompt_recomputes_at_least_the_last_token() -> None:
    h = Harness(num_blocks=20)
    prompt = tokens(0, 16)
    h.add("a", prompt, max_tokens=1)
    h.run()
    h.add("b", prompt, max_tokens=1)
    assert trace(h.step()) == [("b", 12, 4, True)]
    h.assert_idle()


def test_without_prefix_caching_every_token_is_computed() -> None:
    h = Harness(num_blocks=20, enable_caching=False)
    shared = tokens(1000, 16)
    h.add("a", [*shared, 1], max_tokens=2)
    h.run()
    h.add("b", [*shared, 2], max_tokens=2)
    assert trace(h.step()) == [("b", 0, 17, True)]
    assert h.kv.stats.hits == 0
    h.run()
    h.assert_idle()


def test_cache_salt_separates_requests_in_the_scheduler() -> None:
    h = Harness(num_blocks=20)
    prompt = tokens(0, 13)
    h.add("a", prompt, cache_salt="x", max_tokens=1)
    h.run()
    h.add("b", prompt, cache_salt="y", max_tokens=1)
    assert trace(h.step()) == [("b", 0, 13, True)]
    h.add("c", prompt, cache_salt="x", max_tokens=1)
    assert trace(h.step()) == [("c", 12, 1, True)]
    h.assert_idle()


# ----- randomized soak ---------------------------------------------------------------


@pytest.mark.parametrize("enable_caching", [True, False])
@pytest.mark.parametrize(
    "num_blocks,max_num_seqs,budget,seed",
    [(24, 8, 24, 0), (16, 4, 8, 1), (40, 16, 64, 2)],
)
def test_random_workload_runs_to_completion_without_leaks(
    enable_caching: bool, num_blocks: int, max_num_seqs: int, budget: int, seed: int
) -> None:
    """200 requests arriving over time, random prompt and output lengths, shared
    prefixes, random aborts, a KV cache small enough to force preemptions. Every
    request gets exactly max_tokens outputs (ignore_eos), identical to what the fake
    model produces unbatched, and in the end every block is free."""
    rng = random.Random(seed)
    h = Harness(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=64,
        enable_caching=enable_caching,
    )
    specs = random_specs(rng, 200, max_len=40, kv_tokens=num_blocks * 4)
    aborted: set[str] = set()
    preemptions = 0
    pending = list(specs)
    while pending or h.sched.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                rid, prompt, max_tokens = pending.pop(0)
                h.add(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
        if h.sched.requests and rng.random() < 0.04:
            rid = rng.choice(sorted(h.sched.requests))
            h.abort(rid)
            aborted.add(rid)
        preemptions += len(h.step().preempted_ids)
        assert h.num_steps < 20_000
    assert set(h.finished) == {rid for rid, _, _ in specs}
    for rid, prompt, max_tokens in specs:
        request = h.finished[rid]
        expected = reference_outputs(prompt, max_tokens)
        if rid in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.status == RequestStatus.FINISHED_LENGTH, rid
            assert request.output_token_ids == expected, rid
    assert aborted
    assert h.sched.num_preemptions == preemptions
    if num_blocks <= 24:
        assert preemptions > 0
    if enable_caching:
        assert h.kv.stats.hits > 0
    else:
        assert h.kv.stats.hits == 0
    h.assert_idle()
    assert h.kv.num_free_blocks == h.kv.num_blocks


def random_specs(rng: random.Random, n: int, max_len: int, kv_tokens: int) -> list[tuple[str, list[int], int]]:
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    specs = []
    for i in range(n):
        length = rng.randint(1, max_len)
        if rng.random() < 0.6:
            prefix = rng.choice(prefixes)[:length]
            prompt = prefix + [rng.randrange(3, 1000) for _ in range(length - len(prefix))]
        else:
            prompt = [rng.randrange(3, 1000) for _ in range(length)]
        specs.append((f"r{i}", prompt, rng.randint(1, min(20, kv_tokens - length))))
    return specs


@pytest.mark.parametrize("enable_caching", [True, False])
def test_random_workload_with_stops_salts_and_prompt_logprobs(enable_caching: bool) -> None:
    """EOS at a random output index (held off by min_tokens), stop token ids, cache
    salts and prompt-logprob requests (which never hit), under preemption."""
    rng = random.Random(7)
    eos_from: dict[str, int] = {}
    h = Harness(
        num_blocks=20,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        enable_caching=enable_caching,
        policy=lambda rid, i, ctx: EOS if i >= eos_from[rid] else None,
    )
    specs = random_specs(rng, 150, max_len=36, kv_tokens=80)
    expected: dict[str, tuple[list[int], RequestStatus]] = {}
    for rid, prompt, max_tokens in specs:
        eos_from[rid] = rng.randint(0, 25)
        min_tokens = rng.choice([0, 0, rng.randint(0, max_tokens)])
        kwargs: dict = {"max_tokens": max_tokens, "min_tokens": min_tokens}
        if rng.random() < 0.3:
            kwargs["cache_salt"] = rng.choice(["s1", "s2"])
        if rng.random() < 0.15:
            kwargs["prompt_logprobs"] = 0
        h.add(rid, prompt, **kwargs)
        stop_at = max(eos_from[rid], min_tokens)
        if stop_at < max_tokens:
            expected[rid] = (reference_outputs(prompt, stop_at) + [EOS], RequestStatus.FINISHED_STOPPED)
        else:
            expected[rid] = (reference_outputs(prompt, max_tokens), RequestStatus.FINISHED_LENGTH)
    preempted = 0
    logprob_admissions = 0
    while h.sched.has_unfinished_requests():
        running_before = {r.request_id for r in h.sched.running}
        out = h.step()
        preempted += len(out.preempted_ids)
        for item in out.scheduled:
            if item.params.prompt_logprobs is not None and item.request_id not in running_before:
                assert item.start_pos == 0, "a prompt-logprobs request must compute its whole prompt"
                logprob_admissions += 1
        assert h.num_steps < 20_000
    assert logprob_admissions > 0
    for rid, (outputs, status) in expected.items():
        request = h.finished[rid]
        assert (request.output_token_ids, request.status) == (outputs, status), rid
    assert preempted > 0
    assert (h.kv.stats.hits > 0) == enable_caching
    h.assert_idle()


# ----- multi-token steps: proposed tokens verified in a step --------------------------------


def oracle(k: int, wrong_after: int | None = None, rng: random.Random | None = None):
    """A proposer that guesses the fake model's next k tokens; with `wrong_after`, only the
    first `wrong_after` guesses are right (the rest a token the model never emits); with
    `rng`, a random number of them."""

    def propose(request) -> list[int]:
        right = reference_outputs(request.all_token_ids, k)
        n_right = wrong_after if rng is None else rng.randint(0, k)
        n_right = k if n_right is None else n_right
        return right[:n_right] + [1] * (k - n_right)  # id 1 is special: never the model's choice

    return propose


def test_right_proposals_are_accepted_and_save_steps() -> None:
    plain, spec = Harness(num_blocks=20), Harness(num_blocks=20, proposer=oracle(4))
    prompt = tokens(100, 6)
    for h in (plain, spec):
        h.add("a", prompt, max_tokens=21)
        h.run()
        assert h.finished["a"].output_token_ids == reference_outputs(prompt, 21)
        h.assert_idle()
    # Prefill gives 1 token; each later step accepts 4 proposals and adds one: 1 + 4 * 5.
    assert (plain.num_steps, spec.num_steps) == (21, 5)
    assert spec.num_accepted == 16


def test_wrong_proposals_are_rolled_back_and_change_nothing() -> None:
    plain, spec = Harness(num_blocks=20), Harness(num_blocks=20, proposer=oracle(3, wrong_after=1))
    prompt = tokens(100, 6)
    for h in (plain, spec):
        h.add("a", prompt, max_tokens=12)
        h.run()
        assert h.finished["a"].output_token_ids == reference_outputs(prompt, 12)
        h.assert_idle()
    # Prefill: 1 token; then one right guess and the model's token a step (5 x 2); the last
    # step has no room for a proposal (max_tokens): 1 + 10 + 1 tokens in 7 steps.
    assert (plain.num_steps, spec.num_steps, spec.num_accepted) == (12, 7, 5)
    never = Harness(num_blocks=20, proposer=oracle(3, wrong_after=0))
    never.add("a", prompt, max_tokens=12)
    assert never.run() == plain.num_steps and never.num_accepted == 0
    assert never.finished["a"].output_token_ids == reference_outputs(prompt, 12)


def test_proposals_count_in_the_budget_and_stop_at_max_tokens() -> None:
    h = Harness(num_blocks=20, max_num_batched_tokens=8, proposer=oracle(6))
    h.add("a", tokens(100, 8), max_tokens=5)
    out = h.step()  # the prefill alone fills the budget
    assert trace(out) == [("a", 0, 8, True)]
    out = h.step()
    # 1 known token + proposals, capped so that no more than max_tokens can come out.
    assert [len(item.spec_token_ids) for item in out.scheduled] == [3]
    assert h.finished["a"].output_token_ids == reference_outputs(tokens(100, 8), 5)
    h.assert_idle()


def test_a_stop_token_inside_an_accepted_run_ends_it_there() -> None:
    prompt = tokens(100, 6)
    # The model emits EOS as its 4th token; the proposals guess past it.
    eos_at_3 = lambda rid, i, ctx: EOS if i == 3 else None  # noqa: E731
    h = Harness(num_blocks=20, policy=eos_at_3, proposer=lambda r: reference_outputs(r.all_token_ids, 6))
    h.add("a", prompt, max_tokens=30)
    h.run()
    expected = reference_outputs(prompt, 3) + [EOS]
    assert h.finished["a"].output_token_ids == expected
    assert h.finished["a"].status == RequestStatus.FINISHED_STOPPED
    h.assert_idle()


def test_no_proposals_are_verified_while_min_tokens_bans_eos() -> None:
    h = Harness(num_blocks=20, proposer=oracle(4))
    h.add("a", tokens(100, 6), max_tokens=12, min_tokens=5)
    spec_lens = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        spec_lens += [len(item.spec_token_ids) for item in out.scheduled]
    assert spec_lens[:5] == [0] * 5 and max(spec_lens) > 0
    assert h.finished["a"].output_token_ids == reference_outputs(tokens(100, 6), 12)


@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
def test_random_workload_with_proposals_preemption_and_stops(enable_caching: bool) -> None:
    """Proposals right and wrong at random, KV pressure that preempts, shared prefixes,
    EOS inside accepted runs: every output is exactly the model's, nothing leaks."""
    rng = random.Random(11)
    eos_from = {}

    def policy(rid: str, i: int, ctx: list[int]) -> int | None:
        return EOS if i >= eos_from[rid] else None

    h = Harness(num_blocks=14, block_size=4, max_num_seqs=5, max_num_batched_tokens=24, enable_caching=enable_caching,
                policy=policy, proposer=oracle(4, rng=random.Random(12)))
    shared = tokens(300, 9)
    expected = {}
    for i in range(30):
        rid = f"r{i}"
        prompt = (shared if rng.random() < 0.5 else []) + tokens(rng.randrange(400, 900), rng.randint(2, 10))
        max_tokens = rng.randint(1, 14)
        eos_from[rid] = rng.randint(0, 16)
        h.add(rid, prompt, max_tokens=max_tokens)
        stop_at = eos_from[rid]
        expected[rid] = (reference_outputs(prompt, stop_at) + [EOS]) if stop_at < max_tokens else \
            reference_outputs(prompt, max_tokens)
        if rng.random() < 0.4:
            h.step()
    h.run()
    for rid, outputs in expected.items():
        assert h.finished[rid].output_token_ids == outputs, rid
    assert h.num_accepted > 0 and h.sched.num_preemptions > 0
    h.assert_idle()


# ----- the priority policy -------------------------------------------------------------------


def priority_harness(**kwargs) -> Harness:
    return Harness(scheduling_policy="priority", **kwargs)


def test_priority_admits_by_priority_then_arrival() -> None:
    h = priority_harness(num_blocks=32, max_num_seqs=1)
    for rid, priority, arrival in [("a", 1, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", -1, 4.0),
                                   ("f", 0, 1.0)]:
        h.add(rid, tokens(10 * ord(rid), 3), priority=priority, arrival_time=arrival, max_tokens=1)
    # f ties b on priority and arrival: the one queued first goes first.
    assert [r.request_id for r in h.sched.waiting] == ["e", "b", "f", "d", "a", "c"]
    order = [trace(h.step())[0][0] for _ in range(6)]
    assert order == ["e", "b", "f", "d", "a", "c"]
    assert list(h.finished) == order
    h.assert_idle()


def test_fcfs_ignores_priority_and_refuses_one_other_than_zero() -> None:
    h = Harness(num_blocks=32, max_num_seqs=1)
    h.add("a", tokens(0, 3), priority=0, max_tokens=1)
    with pytest.raises(ValueError, match=r"priority must be 0 unless priority scheduling is enabled \(got 3"):
        h.add("b", tokens(10, 3), priority=3, max_tokens=1)
    assert list(h.sched.requests) == ["a"]
    with pytest.raises(ValueError, match="priority must be an integer, got 1.5"):
        priority_harness().add("c", tokens(0, 3), priority=1.5, max_tokens=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("priorities,victim", [({"A": 2, "B": 0, "C": 1}, "A"), ({"A": 1, "B": 0, "C": 1}, "C")],
                         ids=["lowest-priority", "latest-arrival-on-a-tie"])
def test_priority_preempts_the_worst_ranked_running_request(priorities: dict[str, int], victim: str) -> None:
    """Under fcfs C (the newest) would go; under priority the highest value goes, the
    latest arrival among equals."""
    h = priority_harness(num_blocks=6, block_size=4, enable_caching=False)
    prompts = {rid: tokens(100 * i, 7) for i, rid in enumerate("ABC")}
    for i, rid in enumerate("ABC"):
        h.add(rid, prompts[rid], priority=priorities[rid], arrival_time=float(i), max_tokens=8, ignore_eos=True)
    order = sorted("ABC", key=lambda rid: (priorities[rid], "ABC".index(rid)))
    assert [item[0] for item in trace(h.step())] == order
    assert [r.request_id for r in h.sched.running] == order
    h.step()
    out = h.step()  # each needs a third block; none is free
    assert out.preempted_ids == [victim]
    assert [item[0] for item in trace(out)] == [rid for rid in order if rid != victim]
    assert h.sched.requests[victim].num_output_tokens == 2
    h.run()
    for rid, prompt in prompts.items():
        assert h.finished[rid].output_token_ids == reference_outputs(prompt, 8)
    assert list(h.finished)[-1] == victim
    h.assert_idle()


def test_a_better_ranked_arrival_takes_a_sequence_slot_from_the_worst_running_request() -> None:
    h = priority_harness(num_blocks=32, max_num_seqs=2)
    h.add("L1", tokens(0, 4), priority=1, arrival_time=0.0, max_tokens=6)
    h.add("L2", tokens(100, 4), priority=1, arrival_time=1.0, max_tokens=6)
    assert trace(h.step()) == [("L1", 0, 4, True), ("L2", 0, 4, True)]
    h.add("H", tokens(200, 5), priority=0, arrival_time=2.0, max_tokens=2)
    out = h.step()
    assert out.preempted_ids == ["L2"]
    assert trace(out) == [("H", 0, 5, True), ("L1", 4, 1, True)]
    # An arrival that ranks no better than every running request waits.
    h.add("L3", tokens(300, 4), priority=1, arrival_time=3.0, max_tokens=1)
    out = h.step()
    assert not out.preempted_ids and trace(out) == [("H", 5, 1, True), ("L1", 5, 1, True)]
    assert h.finished["H"].output_token_ids == reference_outputs(tokens(200, 5), 2)
    assert [r.request_id for r in h.sched.waiting] == ["L2", "L3"]
    assert trace(h.step()) == [("L1", 6, 1, True), ("L2", 4, 1, True)]  # its prompt's block is cached
    h.run()
    assert list(h.finished) == ["H", "L1", "L3", "L2"]  # L3 needs one step, L2 four more
    h.assert_idle()


def test_a_better_ranked_arrival_takes_kv_memory_only_when_that_makes_room() -> None:
    h = priority_harness(num_blocks=6, block_size=4, enable_caching=False)
    h.add("M", tokens(0, 11), priority=1, arrival_time=0.0, max_tokens=4)
    h.add("L", tokens(100, 5), priority=2, arrival_time=1.0, max_tokens=4)
    assert trace(h.step()) == [("M", 0, 11, True), ("L", 0, 5, True)]
    assert h.kv.num_free_blocks == 1  # M holds 3 blocks, L 2
    # H1 ranks between M and L and needs 4 blocks: the free one and L's 2 are not enough,
    # and M ranks better, so nothing is preempted (and L, behind H1, still runs).
    h.add("H1", tokens(200, 13), priority=1, arrival_time=0.5, max_tokens=1)
    out = h.step()
    assert not out.preempted_ids and trace(out) == [("M", 11, 1, True), ("L", 5, 1, True)]
    h.abort("H1")
    # H2 needs 2 blocks: preempting L (worse-ranked) makes room.
    h.add("H2", tokens(300, 8), priority=0, arrival_time=2.0, max_tokens=1)
    out = h.step()
    assert out.preempted_ids == ["L"]
    assert trace(out) == [("H2", 0, 8, True), ("M", 12, 1, True)]
    h.run()
    assert h.finished["L"].output_token_ids == reference_outputs(tokens(100, 5), 4)
    assert h.finished["M"].output_token_ids == reference_outputs(tokens(0, 11), 4)
    h.assert_idle()


def stream_with_one_low_priority_request(aging: float | None, num_high: int = 30) -> list[str]:
    """L (priority 1) arrives at t=0; then one H (priority 0, two steps of work) arrives
    at every step t = 1, 2, ...: twice the work one sequence slot can serve. The finish order."""
    h = priority_harness(num_blocks=64, max_num_seqs=1, priority_aging=aging)
    h.add("L", tokens(0, 4), priority=1, arrival_time=0.0, max_tokens=3)
    for t in range(1, num_high + 1):
        h.step()
        h.add(f"H{t}", tokens(100 * t, 4), priority=0, arrival_time=float(t), max_tokens=2)
    h.run()
    h.assert_idle()
    return list(h.finished)


def test_strict_priority_starves_while_better_work_keeps_coming() -> None:
    order = stream_with_one_low_priority_request(aging=None)
    assert order == [f"H{t}" for t in range(1, 31)] + ["L"]


@pytest.mark.parametrize("aging", [5.0, 10.0])
def test_aging_bounds_what_overtakes_a_waiting_request(aging: float) -> None:
    """With aging A a priority-1 request ranks as a priority-0 one that arrived A seconds
    later: exactly the H that arrived before t = A overtake it (H at t = A ties and the
    earlier arrival goes first); it is admitted at t = 0, preempted by H1, and finishes
    once H1..H(A-1) are done, whatever keeps arriving."""
    order = stream_with_one_low_priority_request(aging=aging)
    overtakers = int(aging) - 1
    assert order == [f"H{t}" for t in range(1, overtakers + 1)] + ["L"] + \
        [f"H{t}" for t in range(overtakers + 1, 31)]


@pytest.mark.parametrize("aging", [None, 3.0], ids=["strict", "aging"])
@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
def test_random_workload_under_priority_runs_to_completion_without_leaks(
    aging: float | None, enable_caching: bool
) -> None:
    """Random priorities and arrivals, shared prefixes, aborts, proposals and KV pressure:
    the harness checks rank order, victims and every KV read after each step; outputs are
    the model's and nothing leaks."""
    rng = random.Random(21)
    h = priority_harness(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
                         enable_caching=enable_caching, priority_aging=aging,
                         proposer=oracle(3, rng=random.Random(22)))
    specs = random_specs(rng, 120, max_len=30, kv_tokens=16 * 4)
    aborted: set[str] = set()
    pending = list(specs)
    while pending or h.sched.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                rid, prompt, max_tokens = pending.pop(0)
                h.add(rid, prompt, priority=rng.randint(-1, 3), arrival_time=float(h.num_steps),
                      max_tokens=max_tokens, ignore_eos=True)
        if h.sched.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(h.sched.requests))
            h.abort(rid)
            aborted.add(rid)
        h.step()
        assert h.num_steps < 20_000
    for rid, prompt, max_tokens in specs:
        expected = reference_outputs(prompt, max_tokens)
        outputs = h.finished[rid].output_token_ids
        assert outputs == (expected[: len(outputs)] if rid in aborted else expected), rid
    assert h.sched.num_preemptions > 0 and h.num_accepted > 0
    h.assert_idle()


# ----- SLO mode (fcfs with TTFT / TPOT targets) ----------------------------------------------


def linear_cost(b0: float = 0.1, b1: float = 0.01, b2: float = 0.02) -> StepCostEstimator:
    """An estimator that has seen steps of exactly b0 + b1 x prefill + b2 x decode seconds."""
    cost = StepCostEstimator(min_samples=4)
    for p, d in [(0, 1), (0, 4), (32, 2), (64, 0), (16, 8)]:
        cost.observe(p, d, b0 + b1 * p + b2 * d)
    return cost


def test_step_cost_estimator_learns_forgets_and_stays_non_negative() -> None:
    cost = StepCostEstimator(window=8, min_samples=4)
    assert cost.predict(10, 2) is None and cost.max_prefill_tokens(2, 1.0) is None
    for d in (1, 2, 3, 4):
        cost.observe(0, d, 0.1 + 0.02 * d)
    assert cost.coefficients is None  # no step with prefill tokens yet: their cost is unknown
    cost = linear_cost()
    assert cost.coefficients == pytest.approx((0.1, 0.01, 0.02))
    assert cost.predict(10, 2) == pytest.approx(0.24)
    assert cost.max_prefill_tokens(2, 0.3) == 16  # (0.3 - 0.1 - 2 x 0.02) / 0.01
    assert cost.max_prefill_tokens(20, 0.3) == 0
    # a TPOT target of 1e308 ms (a valid float the API accepts) overflows the quotient: no
    # limit, not an OverflowError that killed the engine (found by test_fuzz.py)
    assert cost.max_prefill_tokens(2, 1e307) is None and cost.max_prefill_tokens(2, float("inf")) is None
    assert cost.max_prefill_tokens(2, float("-inf")) == 0
    window = StepCostEstimator(window=6, min_samples=4)
    for p, d in [(0, 1), (0, 4), (32, 2), (64, 0), (16, 8), (8, 3)] * 2:
        window.observe(p, d, 2 * (0.1 + 0.01 * p + 0.02 * d))  # the machine got twice as slow: only that is left
    assert window.coefficients == pytest.approx((0.2, 0.02, 0.04))
    cheaper = StepCostEstimator(min_samples=4)
    for p, d in [(0, 1), (0, 8), (32, 1), (32, 8), (64, 4)]:
        cheaper.observe(p, d, 0.1 + 0.01 * p - 0.001 * d)  # more rows, less time: clamped to no cost
    b0, b1, b2 = cheaper.coefficients
    assert b2 == 0 and b0 > 0 and b1 > 0
    same_rows = StepCostEstimator(min_samples=4)  # one prefill step, then decodes of 8 rows only
    same_rows.observe(100, 0, 0.5)
    for _ in range(10):
        same_rows.observe(0, 8, 0.1)
    assert same_rows.coefficients == pytest.approx((0.1, 0.004, 0.0))  # rows cannot be told from b0


def test_slo_tpot_caps_prefill_by_what_the_decoding_stream_can_spend() -> None:
    """Step = 0.1 + 0.01 x prefill + 0.02 x decode s; TPOT target 0.3 s. A (3 tokens) got
    its first token at t = 0: its 2 intervals may take 0.6 s, its last decode step
    (2 rows) 0.14 s, so this step may take 0.46 s: 34 prefill tokens beside A's decode."""
    now = [0.0]
    h = Harness(num_blocks=32, max_num_batched_tokens=64, slo_tpot=0.3, step_cost=linear_cost(),
                clock=lambda: now[0])
    h.add("A", tokens(0, 4), max_tokens=3)
    assert trace(h.step()) == [("A", 0, 4, True)]  # nothing decodes yet: no cap
    h.add("B", tokens(100, 50), max_tokens=1)
    assert trace(h.step()) == [("A", 4, 1, True), ("B", 0, 34, False)]
    now[0] = 0.5  # A spent 0.5 s of its 0.6: its last step may take 0.1 s, less than its decode alone
    assert trace(h.step()) == [("A", 5, 1, True)]
    assert trace(h.step()) == [("B", 34, 16, True)]  # A is done: nothing to protect
    h.assert_idle()


def test_slo_admission_keeps_time_for_the_prompts_that_replace_the_streams() -> None:
    """0.1 + 0.02 x rows <= 0.2 would carry 5 decoding streams; with each stream's
    20-token prompt (0.2 s) spread over its 10 outputs, 0.02 s a step each, only 2 fit:
    0.1 + 0.04 + 0.04 = 0.18, a third would make 0.22."""
    h = Harness(num_blocks=64, max_num_batched_tokens=64, slo_tpot=0.2, step_cost=linear_cost(),
                clock=lambda: 0.0, max_model_len=64)
    for rid in "abcde":
        h.add(rid, tokens(10 * ord(rid), 20), max_tokens=10)
    assert [i[0] for i in trace(h.step())] == ["a", "b"]
    assert [r.request_id for r in h.sched.waiting] == ["c", "d", "e"]
    h.run()
    assert list(h.finished) == list("abcde")
    h.assert_idle()


def test_slo_tpot_admits_only_streams_a_decode_step_can_carry() -> None:
    """0.1 + 0.02 x rows (+ each stream's prompt spread over its outputs, 0.01 x 2 / 40)
    <= 0.15: two decoding streams, not three, though max_num_seqs is 8."""
    h = Harness(num_blocks=32, slo_tpot=0.15, step_cost=linear_cost(), clock=lambda: 0.0)
    for rid in "abcd":
        h.add(rid, tokens(10 * ord(rid), 2), max_tokens=40)
    assert [i[0] for i in trace(h.step())] == ["a", "b"]
    assert [i[0] for i in trace(h.step())] == ["a", "b"]
    assert [r.request_id for r in h.sched.waiting] == ["c", "d"]
    h.run()
    assert list(h.finished) == ["a", "b", "c", "d"]
    h.assert_idle()


def test_slo_ttft_serves_requests_still_on_time_before_those_that_missed() -> None:
    now = [0.0]
    h = Harness(num_blocks=32, max_num_seqs=2, slo_ttft=1.0, clock=lambda: now[0])
    h.add("late", tokens(0, 3), arrival_time=0.0, max_tokens=2)
    h.add("on-time", tokens(100, 3), arrival_time=0.8, max_tokens=2)
    h.add("later", tokens(200, 3), arrival_time=0.9, max_tokens=4)
    now[0] = 1.5  # "late" has waited 1.5 s: its target is lost, the others' not yet
    assert [i[0] for i in trace(h.step())] == ["on-time", "later"]
    assert [r.request_id for r in h.sched.waiting] == ["late"]
    h.step()  # on-time finishes
    assert trace(h.step()) == [("later", 4, 1, True)]  # a slot is free, but what missed waits while others run
    h.add("fresh", tokens(300, 3), arrival_time=1.5, max_tokens=2)
    assert trace(h.step()) == [("later", 5, 1, True), ("fresh", 0, 3, True)]  # on time: admitted
    h.step()
    assert trace(h.step()) == [("late", 0, 3, True)]  # nothing else runs: now it may
    h.run()
    assert list(h.finished) == ["on-time", "later", "fresh", "late"]
    h.assert_idle()


def test_slo_ttft_sends_back_what_the_on_time_queue_ahead_dooms() -> None:
    """Step = 0.1 + 0.01 x prefill s, 32 tokens a step, four 20-token prompts at t = 0
    with a 1 s target: behind the first three (60 tokens), the fourth's first token is
    predicted at 3 steps + 80 tokens = 1.1 s, a miss, though alone it would take 0.3 s.
    It goes behind a fifth whose own target (2 s) it can still meet there; in arrival
    order both would end late. Under overload this keeps the queue's tail on time."""
    h = Harness(num_blocks=64, max_num_batched_tokens=32, slo_ttft=1.0, step_cost=linear_cost(),
                clock=lambda: 0.0)
    for i in range(4):
        h.add(f"q{i}", tokens(100 * i, 20), arrival_time=0.0, max_tokens=2)
    h.add("patient", tokens(500, 20), arrival_time=0.0, max_tokens=2, slo_ttft=2.0)
    assert [(r, n) for r, _, n, _ in trace(h.step())] == [("q0", 20), ("q1", 12)]
    assert [r.request_id for r in h.sched.waiting] == ["q2", "patient", "q3"]
    h.run()
    assert set(h.finished) == {"q0", "q1", "q2", "q3", "patient"}
    h.assert_idle()


def test_slo_learns_how_far_its_ttft_forecasts_run_over_and_stretches_them() -> None:
    """Each request's first forecast (made when it is first judged on time) is compared
    with the wait it had: forecasts of 0.3 s and 0.6 s (a 20-token prompt, then one behind
    it, at 0.1 + 0.01 x prefill s a step of 32 tokens) that took 0.6 s and 1.2 s teach a
    ratio of 2. Once the machine has shown forecasts running 1.5x over, the queue of
    test_slo_ttft_sends_back_what_the_on_time_queue_ahead_dooms loses q2 as well (its 0.8 s
    forecast is 1.2 s stretched): on a shared machine a request forecast on time by a
    small margin ended just past its target. 30 s later the stretch is forgotten."""
    now = [0.0]
    h = Harness(num_blocks=64, max_num_batched_tokens=32, slo_ttft=1.0, step_cost=linear_cost(),
                clock=lambda: now[0])
    h.add("a", tokens(0, 20), arrival_time=0.0, max_tokens=2)
    h.add("b", tokens(100, 20), arrival_time=0.0, max_tokens=2)
    for clock_at_first_token in (0.6, 1.2):
        out = h.schedule()
        now[0] = clock_at_first_token
        h.sched.update_from_output(out, h.runner.execute(out))
    assert [round(r, 6) for r in h.sched.ttft_forecast_error.ratios] == [2.0, 2.0]
    assert h.sched.ttft_forecast_error.factor(now[0]) == 1.0  # not before 16 of them

    h = Harness(num_blocks=64, max_num_batched_tokens=32, slo_ttft=1.0, step_cost=linear_cost(),
                clock=lambda: 0.0)
    for _ in range(16):
        h.sched.ttft_forecast_error.observe(1.0, 1.5, 0.0)
    assert h.sched.ttft_forecast_error.factor(0.0) == 1.5
    for i in range(4):
        h.add(f"q{i}", tokens(100 * i, 20), arrival_time=0.0, max_tokens=2)
    h.add("patient", tokens(500, 20), arrival_time=0.0, max_tokens=2, slo_ttft=2.0)
    assert [(r, n) for r, _, n, _ in trace(h.step())] == [("q0", 20), ("q1", 12)]
    assert [r.request_id for r in h.sched.waiting] == ["patient", "q2", "q3"]
    h.run()
    assert set(h.finished) == {"q0", "q1", "q2", "q3", "patient"}
    h.assert_idle()
    assert h.sched.ttft_forecast_error.factor(31.0) == 1.0


def test_forecast_error_takes_the_recent_median_within_bounds() -> None:
    """The median ratio of the recent forecasts, bounded; old ones are forgotten (a
    stretch that sends every request back gets no new samples: it must not last)."""
    error = ForecastError(window=20, quantile=0.5, min_samples=4, max_age=30.0, bounds=(0.5, 2.0))
    for actual in (1.0, 1.1, 1.2):
        error.observe(1.0, actual, 0.0)
    assert error.factor(0.0) == 1.0
    error.observe(1.0, 3.0, 0.0)
    assert error.factor(0.0) == 1.2
    for actual in (2.5, 3.0, 3.0):
        error.observe(1.0, actual, 0.0)
    assert error.factor(0.0) == 2.0  # the median, 2.5, bounded
    for _ in range(20):
        error.observe(2.0, 0.2, 10.0)  # forecasts far too long: the window forgets the old ones
    assert error.factor(10.0) == 0.5
    error.observe(0.0, 1.0, 10.0)  # no forecast: nothing learned
    assert len(error.ratios) == 20
    assert error.factor(41.0) == 1.0 and error.ratios == []


# ----- per-request SLO targets and early rejection -------------------------------------


@pytest.mark.parametrize("target", [0.3, None])
def test_a_streams_own_tpot_target_caps_prefill_without_an_engine_target(target: float | None) -> None:
    """As test_slo_tpot_caps_prefill_by_what_the_decoding_stream_can_spend, with A's target
    its own (the engine has none): 34 prefill tokens beside A's decode. A stream without a
    target protects nothing: B's prompt is computed whole."""
    h = Harness(num_blocks=32, max_num_batched_tokens=64, step_cost=linear_cost(), clock=lambda: 0.0)
    h.add("A", tokens(0, 4), max_tokens=3, slo_tpot=target)
    h.step()
    h.add("B", tokens(100, 50), max_tokens=1)
    assert trace(h.step()) == [("A", 4, 1, True), ("B", 0, 34 if target else 50, target is None)]
    h.run()
    h.assert_idle()


def test_a_requests_own_ttft_target_sends_it_back_once_missed_and_no_target_never_is() -> None:
    now = [0.0]
    h = Harness(num_blocks=32, max_num_seqs=2, clock=lambda: now[0])
    h.add("patient", tokens(0, 3), arrival_time=0.0, max_tokens=2)  # no target: never late
    h.add("late", tokens(100, 3), arrival_time=0.1, max_tokens=2, slo_ttft=1.0)
    h.add("on-time", tokens(200, 3), arrival_time=0.9, max_tokens=2, slo_ttft=1.0)
    now[0] = 1.5
    assert [i[0] for i in trace(h.step())] == ["patient", "on-time"]
    assert [r.request_id for r in h.sched.waiting] == ["late"]
    h.run()
    assert list(h.finished) == ["patient", "on-time", "late"]
    h.assert_idle()


def test_priority_protects_the_tpot_of_better_ranked_streams_only() -> None:
    """Under priority a prompt's prefill is capped by the TPOT targets of decoding
    streams ranked no worse than it: a better-ranked prompt runs whole beside a
    worse-ranked stream with a target, a worse-ranked one is cut to what the better-ranked
    stream can spend (34 tokens, as in the fcfs case)."""
    for stream_priority, prompt_priority, chunk in ((1, 0, 50), (0, 1, 34)):
        h = Harness(num_blocks=32, max_num_batched_tokens=64, scheduling_policy="priority",
                    step_cost=linear_cost(), clock=lambda: 0.0)
        h.add("stream", tokens(0, 4), max_tokens=3, priority=stream_priority, slo_tpot=0.3)
        h.step()
        h.add("prompt", tokens(100, 50), max_tokens=1, priority=prompt_priority)
        step = sorted(trace(h.step()))
        assert step == [("prompt", 0, chunk, chunk == 50), ("stream", 4, 1, True)]
        h.run()
        h.assert_idle()


def test_priority_admission_counts_only_better_ranked_streams_against_a_tpot_target() -> None:
    """0.1 + 0.02 x rows (+ 0.01 x 2 / 20 a stream) <= 0.15 allows 2 streams. Two priority-1
    streams with targets run; a priority-0 request with a target is still admitted (the
    worse-ranked rows do not count against it), a third priority-1 one is not."""
    h = Harness(num_blocks=32, scheduling_policy="priority", step_cost=linear_cost(), clock=lambda: 0.0)
    for rid in "ab":
        h.add(rid, tokens(10 * ord(rid), 2), max_tokens=20, priority=1, slo_tpot=0.15)
    h.step()
    h.add("c", tokens(300, 2), max_tokens=20, priority=1, slo_tpot=0.15)
    h.add("vip", tokens(400, 2), max_tokens=20, priority=0, slo_tpot=0.15)
    assert [i[0] for i in trace(h.step())] == ["vip", "a", "b"]
    assert [r.request_id for r in h.sched.waiting] == ["c"]
    h.run()
    h.assert_idle()


@pytest.mark.parametrize("fraction", [SchedulingConfig().priority_step_fraction, 0.5])
def test_priority_step_bound_keeps_a_better_prioritys_wait_within_a_fraction_of_its_ttft(fraction: float) -> None:
    """Step = 0.02 + 0.01 x prefill + 0.02 x decode s, 64 tokens a step. A 20-token
    priority-0 prompt alone takes 0.22 s (its unloaded TTFT). A 200-token priority-1 prompt
    is chunked beside a priority-1 stream D; a priority-0 arrival must wait for the step in
    flight (steps are not interrupted), then shares its own step with the rest. Without
    the bound (fraction 0, vLLM's behaviour): a 63-token chunk and D's decode (0.67 s),
    then its own step with D and a 43-token chunk (0.67 s): 6x its unloaded TTFT. With
    fraction 0.5, while priority 0 arrived lately the step stays within 0.11 s (a 7-token
    chunk beside D's decode), and the arrival's step is its prompt alone (D's decode waits
    one step): 0.11 + 0.22 s, 1.5x. Once priority 0 has not arrived for the guard window,
    full chunks again."""
    now = [0.0]
    cost = linear_cost(b0=0.02)
    h = Harness(num_blocks=128, max_num_batched_tokens=64, max_model_len=256, scheduling_policy="priority",
                step_cost=cost, clock=lambda: now[0], priority_step_fraction=fraction)
    unloaded = cost.predict(20, 0)
    assert unloaded == pytest.approx(0.22)
    h.add("H1", tokens(1000, 20), priority=0, arrival_time=0.0, max_tokens=1)
    assert trace(h.step()) == [("H1", 0, 20, True)]
    h.add("D", tokens(3000, 4), priority=1, arrival_time=0.5, max_tokens=40, ignore_eos=True)
    h.step()
    h.add("L", tokens(0, 200), priority=1, arrival_time=1.0, max_tokens=1)
    now[0] = 1.0
    in_flight = h.step()  # a priority-1 chunk is running when H2 arrives
    assert [(r, n) for r, _, n, _ in trace(in_flight)] == [("D", 1), ("L", 7 if fraction else 63)]
    h.add("H2", tokens(2000, 20), priority=0, arrival_time=1.05, max_tokens=1)
    now[0] = 1.1
    out = h.step()
    assert trace(out)[0] == ("H2", 0, 20, True)  # the very next step, first
    rest = [(r, n) for r, _, n, _ in trace(out)[1:]]
    assert rest == ([] if fraction else [("D", 1), ("L", 43)])
    step = [cost.predict(sum(n for r, n in s if r != "D"), sum(r == "D" for r, n in s))
            for s in ([(r, n) for r, _, n, _ in trace(in_flight)], [("H2", 20), *rest])]
    wait = sum(step)  # the step in flight, at worst, and its own
    if fraction:
        assert wait <= 1.5 * unloaded + 1e-9
        assert [r for r, *_ in trace(h.step())] == ["D", "L"]  # they go on in the next step
    else:
        assert wait > 5 * unloaded
    if fraction:  # no priority 0 for the guard window: the priority-1 chunks take the whole budget again
        now[0] = 1.05 + PRIORITY_GUARD_SECONDS + 1
        assert [(r, n) for r, _, n, _ in trace(h.step())] == [("D", 1), ("L", 63)]
    h.run()
    assert set(h.finished) == {"H1", "H2", "L", "D"}
    h.assert_idle()


def test_predict_ttft_counts_the_prompts_queued_ahead() -> None:
    """Step = 0.1 + 0.01 x prefill + 0.02 x decode s, 32 tokens a step. Alone, a 20-token
    prompt is one step: 0.3 s. Behind three 20-token prompts, 80 tokens in 3 steps:
    0.3 + 0.8 = 1.1 s. Under priority only the prompts ranked no worse count."""
    h = Harness(num_blocks=64, step_cost=linear_cost(), clock=lambda: 0.0)
    probe = make_request("probe", tokens(500, 20), 64)
    assert h.sched.predict_ttft(probe) == pytest.approx(0.3)
    for i in range(3):
        h.add(f"q{i}", tokens(100 * i, 20), max_tokens=2)
    assert h.sched.predict_ttft(probe) == pytest.approx(1.1)
    assert Harness().sched.predict_ttft(probe) is None  # no step cost known: nothing predicted
    p = Harness(num_blocks=64, scheduling_policy="priority", step_cost=linear_cost(), clock=lambda: 0.0)
    for i in range(3):
        p.add(f"q{i}", tokens(100 * i, 20), max_tokens=2, priority=1)
    assert p.sched.predict_ttft(make_request("vip", tokens(500, 20), 64, priority=0)) == pytest.approx(0.3)
    assert p.sched.predict_ttft(make_request("low", tokens(500, 20), 64, priority=1)) == pytest.approx(1.1)


def test_engine_rejects_early_only_what_asked_and_cannot_meet_its_ttft() -> None:
    """--slo-reject: a request whose TTFT target is predicted missed raises
    SLOUnattainableError and leaves nothing behind; one without a target, or with one it
    can meet, is queued; without --slo-reject nothing is refused."""
    from fakes import make_engine

    from tokenmill.engine.engine import SLOUnattainableError

    for reject in (True, False):
        engine = make_engine(num_blocks=64, max_num_batched_tokens=32, slo_reject=reject)
        engine.step_cost = engine.scheduler.step_cost = linear_cost()
        for i in range(3):
            engine.add_request(f"q{i}", tokens(100 * i + 10, 20), SamplingParams(max_tokens=2))
        if reject:
            with pytest.raises(SLOUnattainableError, match="time-to-first-token target of 500 ms") as info:
                engine.add_request("tight", tokens(600, 20), SamplingParams(max_tokens=2), slo_ttft_ms=500)
            assert info.value.predicted_ttft == pytest.approx(1.1) and info.value.retry_after > 0.5
            assert "tight" not in engine.scheduler.requests and "tight" not in engine.output_processor.user_requests
        else:
            engine.add_request("tight", tokens(600, 20), SamplingParams(max_tokens=2), slo_ttft_ms=500)
        engine.add_request("loose", tokens(700, 20), SamplingParams(max_tokens=2), slo_ttft_ms=5000)
        engine.add_request("none", tokens(800, 20), SamplingParams(max_tokens=2))
        assert len(engine.scheduler.requests) == (5 if reject else 6)
        with pytest.raises(ValueError, match="slo_tpot_ms must be a positive number of milliseconds"):
            engine.add_request("bad", tokens(900, 4), slo_tpot_ms=-1)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_slo_predictions_count_only_what_the_prefix_cache_does_not_hold() -> None:
    """A 44-token prompt whose first 40 tokens are cached computes 4: one step of 0.14 s,
    not 0.54. With a 0.6 s TTFT target at t = 0.2 it is on time (a fresh 44-token prompt is
    not, and goes behind it); its predicted TTFT is 0.14 s; peeking at the cache keeps
    nothing for a request that was never added."""
    now = [0.0]
    h = Harness(num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, step_cost=linear_cost(),
                clock=lambda: now[0])
    prefix = tokens(500, 40)
    h.add("warm", prefix + [7, 7, 7, 7], max_tokens=2)
    h.run()
    probe = make_request("probe", prefix + tokens(900, 4), 64)
    assert h.sched.predict_ttft(probe) == pytest.approx(0.14)
    assert "probe" not in h.kv.req_hashes
    h.add("fresh", tokens(100, 44), arrival_time=0.0, max_tokens=2, slo_ttft=0.6)
    h.add("cached", prefix + tokens(900, 4), arrival_time=0.0, max_tokens=2, slo_ttft=0.6)
    now[0] = 0.2
    assert trace(h.step()) == [("cached", 40, 4, True)]
    assert [r.request_id for r in h.sched.waiting] == ["fresh"]
    h.run()
    h.assert_idle()


# ----- an interrupted step (--priority-interrupt) ---------------------------------------------


def test_an_interrupted_step_leaves_no_half_written_block_in_the_prefix_cache() -> None:
    """A and B share four blocks of prompt. A's first chunk computes three of them. In the
    next step A's second chunk is scheduled (its full blocks are offered to the prefix cache
    at allocation, as vLLM's) and B is admitted behind it with all four shared blocks as
    hits, the fourth being one this step writes. The step is cut part-way (the fake runner
    leaves garbage in every slot it was to write) and put back: A computes from 12 again, B
    is back in the queue holding nothing, and only the three computed blocks stay cached.
    A is then aborted, so nothing rewrites its blocks: B and a later C with the same prefix
    must compute the fourth block themselves (the fake runner checks every KV read), and
    give what the fake model gives without a scheduler."""
    h = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=12, max_model_len=64,
                scheduling_policy="priority")
    h.kv.events = KVEventLog(4)
    shared = tokens(0, 16)
    h.add("A", shared + tokens(100, 6), priority=1, max_tokens=3)
    assert trace(h.step()) == [("A", 0, 12, False)]
    h.add("B", shared + tokens(200, 5), priority=1, max_tokens=3)
    h.kv.take_events()
    cut = h.interrupted_step()
    assert [(r, start, n) for r, start, n, _ in trace(cut)] == [("A", 12, 10), ("B", 16, 2)]  # B hit block 3
    assert sorted(h.kv.cached_blocks.values()) == h.kv.get_block_ids("A")[:3], (
        "a block the cut step was to write is still offered to other requests")
    stored, removed = h.kv.take_events()  # a KV-aware router hears of both
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert removed.block_hashes == stored.block_hashes and len(stored.block_hashes) == 2  # A's blocks 3 and 4
    assert [r.request_id for r in h.sched.running] == ["A"] and [r.request_id for r in h.sched.waiting] == ["B"]
    h.abort("A")
    h.add("C", shared + tokens(300, 3), priority=1, max_tokens=2)
    h.run()
    assert h.finished["B"].output_token_ids == reference_outputs(shared + tokens(200, 5), 3)
    assert h.finished["C"].output_token_ids == reference_outputs(shared + tokens(300, 3), 2)
    h.assert_idle()


@pytest.mark.parametrize("cut_at", [0, 1, 3, 6])
def test_an_interrupted_step_is_computed_again_and_changes_no_output(cut_at: int) -> None:
    """Three priority-1 requests (chunked prompts, then decodes) with one step cut and put
    back at step `cut_at`: the step after it schedules the same tokens again, and every
    output is the fake model's own, as without the cut."""
    h = Harness(num_blocks=40, block_size=4, max_num_batched_tokens=16, max_model_len=64,
                scheduling_policy="priority")
    prompts = {"P": tokens(0, 20), "Q": tokens(0, 8) + tokens(50, 9), "R": tokens(70, 5)}
    for rid, prompt in prompts.items():
        h.add(rid, prompt, priority=1, max_tokens=4, ignore_eos=True)
    for _ in range(cut_at):
        h.step()
    cut = h.interrupted_step()
    again = h.step()  # the same requests from the same positions (the ones admitted in it, admitted again)
    assert [(r, start) for r, start, _, _ in trace(again)][: len(cut.scheduled)] == \
        [(r, start) for r, start, _, _ in trace(cut)]
    h.run()
    for rid, prompt in prompts.items():
        assert h.finished[rid].output_token_ids == reference_outputs(prompt, 4), rid
    h.assert_idle()
