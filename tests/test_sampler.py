"""Tests of the batched sampler: filtering, penalties, seeding and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p_min_p,
    compute_token_logprobs,
    make_generator,
)


def make_row(
    params: SamplingParams | None = None,
    *,
    seed: int | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    banned: list[int] | None = None,
) -> SamplingRow:
    params = params or SamplingParams()
    generator = make_generator(seed, "cpu") if seed is not None else None
    return SamplingRow(params, generator, prompt or [], output or [], banned or [])


def logits_for_probs(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(rows, 1)


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


# --- greedy ---


def test_greedy_is_argmax():
    logits = random_logits(8, 50)
    out = Sampler(seed=0)(logits, [make_row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_with_logprobs_takes_the_general_path_and_still_argmaxes():
    logits = random_logits(4, 50)
    rows = [make_row(SamplingParams(temperature=0.0, logprobs=2)) for _ in range(4)]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert all(lp is not None and lp.rank == 1 for lp in out.logprobs)


def test_temperature_towards_zero_matches_greedy():
    logits = random_logits(16, 40)
    expected = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=0)
    for temperature in (0.0, 1e-6, 1e-3):
        rows = [make_row(SamplingParams(temperature=temperature)) for _ in range(16)]
        assert sampler(logits, rows).token_ids == expected


def test_caller_logits_are_not_modified():
    logits = random_logits(3, 20)
    before = logits.clone()
    rows = [
        make_row(SamplingParams(temperature=0.7, top_k=5, logit_bias={1: 3.0}), output=[2, 2]),
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.3), prompt=[4]),
        make_row(SamplingParams(top_p=0.5, min_p=0.1), banned=[0]),
    ]
    Sampler(seed=0)(logits, rows)
    assert torch.equal(logits, before)


# --- filtering ---


def test_top_k_1_always_picks_argmax():
    logits = random_logits(500, 30)
    rows = [make_row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(500)]
    assert Sampler(seed=1)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_picks_argmax():
    logits = random_logits(500, 30)
    rows = [make_row(SamplingParams(temperature=1.5, top_p=1e-6)) for _ in range(500)]
    assert Sampler(seed=2)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_never_samples_below_the_threshold():
    # min_p 0.2 × max 0.4 = 0.08: tokens 3 and 4 (0.06, 0.04) are out.
    n = 3000
    logits = logits_for_probs([0.4, 0.3, 0.2, 0.06, 0.04], rows=n)
    rows = [make_row(SamplingParams(min_p=0.2)) for _ in range(n)]
    tokens = Sampler(seed=3)(logits, rows).token_ids
    assert set(tokens) == {0, 1, 2}


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(top_p=0.45), [0]),
        (SamplingParams(top_p=0.6), [0, 1]),
        (SamplingParams(top_p=0.75), [0, 1]),
        (SamplingParams(top_p=0.85), [0, 1, 2]),
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_k=-1, top_p=1.0), [0, 1, 2]),
        (SamplingParams(min_p=0.5), [0, 1]),
        # min-p and top-k come first (vLLM v1): top-p then sees [0.625, 0.375].
        (SamplingParams(min_p=0.5, top_p=0.6), [0]),
        (SamplingParams(top_k=2, top_p=0.6), [0]),
        (SamplingParams(top_k=2, top_p=0.7), [0, 1]),
    ],
)
def test_filter_masks(params: SamplingParams, kept: list[int]):
    logits = logits_for_probs([0.5, 0.3, 0.2])
    filtered = apply_top_k_top_p_min_p(logits.clone(), [make_row(params)])
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == kept


def test_empirical_distribution_matches_softmax():
    n = 4000
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    logits = probs.log().repeat(n, 1) + 1.7  # a shift must not matter
    rows = [make_row() for _ in range(n)]
    tokens = torch.tensor(Sampler(seed=4)(logits, rows).token_ids)
    observed = torch.bincount(tokens, minlength=5).float()
    expected = probs * n
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 18.5  # the 99.9% point of chi-square with 4 degrees of freedom


def test_temperature_flattens_the_distribution():
    n = 4000
    logits = logits_for_probs([0.9, 0.1], rows=n)
    hot = Sampler(seed=5)(logits, [make_row(SamplingParams(temperature=100.0)) for _ in range(n)])
    share_of_second = sum(hot.token_ids) / n
    assert 0.45 < share_of_second < 0.55


# --- seeds ---


def _run_steps(make_rows, steps: int = 20, vocab: int = 64) -> list[list[int]]:
    """Sample `steps` times; `make_rows(step)` gives the rows, logits depend on the step only."""
    sampler = Sampler(seed=123)
    history = []
    for step in range(steps):
        rows = make_rows(step)
        logits = random_logits(1, vocab, seed=1000 + step).repeat(len(rows), 1)
        history.append(sampler(logits, rows).token_ids)
    return history


def test_seeded_row_is_the_same_alone_and_in_a_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    alone_row = make_row(params, seed=42)
    alone = _run_steps(lambda step: [alone_row])

    batched_row = make_row(params, seed=42)
    other_seeded = make_row(SamplingParams(top_k=5, seed=7), seed=7)

    def batch(step: int) -> list[SamplingRow]:
        # The neighbours change with the step: more or fewer unseeded rows, a greedy one.
        neighbours = [make_row(SamplingParams(temperature=0.8, top_p=0.9)) for _ in range(step % 3)]
        return [*neighbours, batched_row, other_seeded, make_row(SamplingParams(temperature=0.0))]

    batched = _run_steps(batch)
    seeded_in_batch = [tokens[step % 3] for step, tokens in enumerate(batched)]
    assert [tokens[0] for tokens in alone] == seeded_in_batch
    assert len(set(seeded_in_batch)) > 5  # really random, not stuck on one token


def test_different_seeds_differ():
    rows = [make_row(SamplingParams(seed=1), seed=1), make_row(SamplingParams(seed=2), seed=2)]
    history = _run_steps(lambda step: rows)
    assert [t[0] for t in history] != [t[1] for t in history]


def test_shared_generator_seed_is_reproducible():
    logits = random_logits(32, 40)
    first = Sampler(seed=9)(logits, [make_row() for _ in range(32)]).token_ids
    second = Sampler(seed=9)(logits, [make_row() for _ in range(32)]).token_ids
    assert first == second


# --- penalties, bias, banned ids ---


def test_penalties_follow_the_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.5, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [
        make_row(params, prompt=[0], output=[1, 2, 2]),
        make_row(prompt=[0], output=[1, 2, 2]),  # no penalty: untouched
    ]
    apply_penalties(logits, rows)
    # Repetition: seen tokens 0 (prompt), 1 and 2 (output): 2/2, -1*2, 0.5/2; 3 unseen.
    # Frequency: token 1 once (-0.5), token 2 twice (-1.0). Presence: -0.25 each.
    expected = torch.tensor([1.0, -2.0 - 0.5 - 0.25, 0.25 - 1.0 - 0.25, 1.0])
    torch.testing.assert_close(logits[0], expected)
    torch.testing.assert_close(logits[1], torch.tensor([2.0, -1.0, 0.5, 1.0]))


def test_repetition_penalty_alone_uses_prompt_and_output():
    logits = torch.tensor([[3.0, -2.0, 4.0, -1.0]])
    params = SamplingParams(repetition_penalty=0.5)
    apply_penalties(logits, [make_row(params, prompt=[0], output=[1])])
    torch.testing.assert_close(logits[0], torch.tensor([6.0, -1.0, 4.0, -1.0]))


def test_frequency_and_presence_ignore_the_prompt():
    logits = torch.zeros(1, 3)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=-1.0)
    apply_penalties(logits, [make_row(params, prompt=[0, 0], output=[2, 2, 2])])
    torch.testing.assert_close(logits[0], torch.tensor([0.0, 0.0, -3.0 + 1.0]))


def test_penalty_discourages_repeating_under_greedy():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert Sampler()(logits, [make_row(params, output=[0])]).token_ids == [1]


def test_logit_bias_forces_a_token():
    n = 200
    logits = random_logits(n, 30)
    temperatures = (0.0, 1.0) * (n // 2)
    rows = [make_row(SamplingParams(temperature=t, logit_bias={7: 100.0})) for t in temperatures]
    assert Sampler(seed=6)(logits, rows).token_ids == [7] * n


def test_banned_ids_are_never_sampled():
    n = 2000
    logits = logits_for_probs([0.7, 0.2, 0.05, 0.05], rows=n)
    temperatures = (0.0, 1.0, 2.0, 5.0) * (n // 4)
    rows = [make_row(SamplingParams(temperature=t), banned=[0, 2]) for t in temperatures]
    tokens = Sampler(seed=7)(logits, rows).token_ids
    assert set(tokens) == {1, 3}
    assert tokens[0] == 1  # greedy row: the best of what is left


def test_banned_ids_win_over_logit_bias():
    logits = torch.zeros(1, 4)
    params = SamplingParams(temperature=0.0, logit_bias={2: 100.0})
    assert Sampler()(logits, [make_row(params, banned=[2])]).token_ids != [2]


# --- logprobs ---


def test_logprobs_are_raw_log_softmax_with_rank_and_sorted_top():
    logits = random_logits(3, 25)
    rows = [
        make_row(SamplingParams(temperature=0.7, top_k=4, logprobs=5)),
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3), output=[1]),
        make_row(SamplingParams(temperature=1.0, logprobs=0)),
    ]
    out = Sampler(seed=8)(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry is not None and entry.token_id == token
        assert math.isclose(entry.logprob, reference[i, token].item(), rel_tol=1e-5, abs_tol=1e-6)
        assert entry.rank == int((reference[i] > reference[i, token]).sum()) + 1
        wanted = rows[i].params.logprobs
        assert len(entry.top_ids) == len(entry.top_logprobs) == wanted
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
        top_values, top_ids = reference[i].topk(wanted)
        assert entry.top_ids == top_ids.tolist()
        torch.testing.assert_close(torch.tensor(entry.top_logprobs), top_values)


def test_logprobs_only_for_rows_that_ask():
    logits = random_logits(3, 10)
    rows = [
        make_row(),
        make_row(SamplingParams(logprobs=1)),
        make_row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler(seed=0)(logits, rows)
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert out.logprobs[1] is not None


def test_compute_token_logprobs_ranks_and_top():
    logprobs = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]]), dim=-1)
    entries = compute_token_logprobs(logprobs, torch.tensor([2, 3]), num_top=2)
    assert [e.rank for e in entries] == [2, 2]
    assert entries[0].top_ids == [1, 2] and entries[1].top_ids == [2, 3]
    assert entries[0].logprob == pytest.approx(logprobs[0, 2].item())
    assert compute_token_logprobs(logprobs, torch.tensor([0, 0]), num_top=0)[0].top_ids == []


# --- mixed batches ---


def test_mixed_greedy_and_random_batch():
    n = 400
    logits = random_logits(n, 30)
    greedy, top_3 = SamplingParams(temperature=0.0), SamplingParams(top_k=3)
    rows = [make_row(greedy if i % 2 == 0 else top_3) for i in range(n)]
    tokens = torch.tensor(Sampler(seed=10)(logits, rows).token_ids)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(tokens[0::2], argmax[0::2])
    top3 = logits[1::2].topk(3, dim=-1).indices
    assert bool((top3 == tokens[1::2].unsqueeze(1)).any(dim=1).all())
    assert not torch.equal(tokens[1::2], argmax[1::2])  # random rows do not all argmax


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [make_row()])
