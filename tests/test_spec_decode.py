"""Speculative decoding: n-gram and draft-model proposers, verification in the real
runner, the engine's seam, metrics and start-up errors.

Tiny random Llama models built in memory (a target and a draft made from it with noise
added, so the draft is often but not always right) run through the real runner, the real
attention backend and execution plan, and the real engine. The exactness tests compare
greedy outputs with speculation on and off token for token; the losslessness tests compare
the distribution of sampled continuations with the target's exact one (chi-square over
>= 10,000 samples, fixed seeds), and show that a wrong acceptance rule fails the same test.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
import torch
from fakes import FakeTokenizer, fake_facts

from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache
from tokenmill.builder import build_proposer
from tokenmill.runner.worker import LoadedDraft, build_draft_runner, select_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import Request
from tokenmill.kernels import cpu_kernels_available
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import LoadedModel
from tokenmill.model_arch import ModelArchConfig
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.plan import apply_plan, cpu_native_plan, reference_plan
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.rejection import RejectionSampler, accept_greedy
from tokenmill.spec_decode.ngram import NgramProposer, ngram_lookup

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "in-memory", "num_speculative_tokens": 3}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: two OpenMP threads on a busy 2-core machine only wait for each other
    (a tiny decode layer took 30 ms instead of 0.1 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----- tiny models and engines ----------------------------------------------------------------


def tiny_arch(vocab_size: int) -> ModelArchConfig:
    return ModelArchConfig("llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def tiny_pair(vocab_size: int, noise: float, seed: int = 0, scale: float = 1.0) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A random target, and a draft: the target with Gaussian noise of `noise` x each
    weight's std added (a smaller `noise`, a more often right draft). `scale` multiplies
    the LM head: larger, more peaked distributions."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(tiny_arch(vocab_size)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(scale)
        for name, p in target.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.std())
    return target, draft


def _native() -> bool:
    if not cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")
    return True


def planned(model: LlamaForCausalLM, native: bool = True):
    """The model set up as the builder sets up a float32 CPU model (idempotent)."""
    plan = cpu_native_plan(torch.float32, onednn=False) if native and _native() else reference_plan(torch.float32)
    return apply_plan(model, plan)


def tiny_engine(target: LlamaForCausalLM, draft: LlamaForCausalLM | None = None, speculative: dict | None = None,
                num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128, native: bool = True,
                **settings: object) -> LLMEngine:
    """An engine over the real runner, backend and plan for a tiny model, as the builder
    wires one (the proposer comes from the builder's own `build_proposer`)."""
    backend = select_attention_backend("cpu_native" if native else "torch_sdpa", torch.device("cpu"),
                                       native and _native())
    plan = planned(target, native)
    arch = target.cfg
    spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size, torch.float32)
    runner = ModelRunner(target, PagedKVCache(spec, num_blocks, torch.device("cpu")), backend, plan,
                         torch.device("cpu"), seed=0)
    config = EngineConfig.from_kwargs(block_size=block_size, speculative_config=speculative, **settings)
    proposer = None
    if speculative is not None:
        loaded_draft = None
        if draft is not None:
            darch = draft.cfg
            loaded = LoadedModel(draft, darch, None, "draft", darch.max_position_embeddings)
            kv_spec = KVCacheSpec(darch.num_layers, darch.num_kv_heads, darch.head_dim, block_size, torch.float32)
            from tokenmill.runner.worker import DtypePlan

            loaded_draft = LoadedDraft(loaded, DtypePlan("float32", "float32"), kv_spec, planned(draft, native))
        draft_runner = build_draft_runner(config, runner, loaded_draft) if loaded_draft is not None else None
        proposer = build_proposer(config, runner, draft_runner)
    facts = dataclasses.replace(fake_facts(num_blocks, block_size, max_model_len), vocab_size=arch.vocab_size)
    return LLMEngine(config, runner, FakeTokenizer(), facts, proposer=proposer)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        abort_after: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Generate to the end; returns each request's output token ids by request id."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    outputs: dict[str, object] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort_request(rid)
    return outputs


def assert_no_kv_held(engine: LLMEngine) -> None:
    kv = engine.scheduler.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks
    proposer = engine.proposer
    if proposer is not None and hasattr(proposer, "kv"):
        proposer.kv.check_integrity()
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks, "the draft's KV blocks leaked"
        assert not proposer.kv.req_blocks and not proposer.sequences and not proposer.distributions


# ----- n-gram lookup ---------------------------------------------------------------------------


def brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: the longest suffix with length in [min_n, max_n] that
    occurs earlier (ending before the last token), its latest such occurrence, then what
    followed it."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_lookup_matches_its_definition() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randint(0, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        got = ngram_lookup(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)
        assert got == brute_force_lookup(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_ngram_lookup_examples() -> None:
    def lookup(tokens, lo=2, hi=4, k=3):
        return ngram_lookup(np.asarray(tokens), lo, hi, k)

    assert lookup([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 7, 8, 2, 3, 4]) == [7, 8, 2]  # latest of the longest (3)
    assert lookup([5, 6, 7, 5, 6]) == [7, 5, 6]
    assert lookup([1, 2, 3]) == []  # nothing re-occurs
    assert lookup([1, 2, 9, 2], lo=2) == []  # a 1-token match is below prompt_lookup_min
    assert lookup([1, 2, 9, 2], lo=1) == [9, 2]


def test_ngram_proposer_stays_within_the_room_left() -> None:
    proposer = NgramProposer(4, 1, 2)
    request = Request("a", [5, 6, 7, 5, 6, 7, 5], SamplingParams(max_tokens=3), max_total_tokens=64)
    request.append_output_token(6)  # one output, two more allowed: at most one proposal
    proposer.propose([request])
    assert request.spec_token_ids == [7]
    request.append_output_token(7)
    proposer.propose([request])
    assert request.spec_token_ids == []


def test_accept_greedy() -> None:
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_greedy([], [3]) == [3]


# ----- greedy: token for token what decoding without speculation gives -------------------------

VOCAB = 64


@pytest.fixture(scope="module")
def pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """Peaked distributions (no near-ties for greedy), and a draft right most of the time."""
    return tiny_pair(VOCAB, noise=0.3, scale=6.0)


def greedy_workload(seed: int = 0, count: int = 10) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts with repeats (for n-gram matches) and a shared prefix (for prefix caching);
    greedy parameters that touch every stop and logit rule."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(9)]
    prompts, params = [], []
    for i in range(count):
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))]
        prompt = (shared if i % 2 else []) + body + body[: rng.randint(1, len(body))]
        prompts.append(prompt)
        extra = [dict(), dict(logprobs=2), dict(stop_token_ids=[rng.randrange(3, VOCAB)]), dict(min_tokens=6),
                 dict(repetition_penalty=1.3, frequency_penalty=0.5), dict(ignore_eos=True),
                 dict(logit_bias={rng.randrange(3, VOCAB): 3.0})][i % 7]
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 40), **extra))
    return prompts, params


def outputs_of(results: dict) -> dict[str, tuple]:
    return {rid: (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].text)
            for rid, out in results.items()}


def logprobs_of(results: dict) -> dict[str, list[list[tuple[int, int, float]]]]:
    """Per position: (token id, rank, logprob) of the emitted token and the top ones."""
    return {rid: [[(t, lp.rank, lp.logprob) for t, lp in position.items()] for position in out.outputs[0].logprobs]
            for rid, out in results.items() if out.outputs[0].logprobs is not None}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_greedy_output_is_identical_with_speculation(pair, method: str, caching: bool) -> None:
    target, draft = pair
    prompts, params = greedy_workload()
    settings = dict(enable_prefix_caching=caching, max_num_seqs=6, max_num_batched_tokens=48)
    plain = tiny_engine(target, **settings)
    expected = run(plain, prompts, params)
    spec_config = NGRAM if method == "ngram" else DRAFT
    spec = tiny_engine(target, draft if method == "draft_model" else None, spec_config, **settings)
    got = run(spec, prompts, params)
    assert outputs_of(got) == outputs_of(expected)
    got_logprobs, expected_logprobs = logprobs_of(got), logprobs_of(expected)
    assert set(got_logprobs) == set(expected_logprobs) and got_logprobs
    for rid, positions in got_logprobs.items():
        reference = expected_logprobs[rid]
        assert [[(t, r) for t, r, _ in p] for p in positions] == [[(t, r) for t, r, _ in p] for p in reference]
        flat = [lp for p in positions for _, _, lp in p]
        assert flat == pytest.approx([lp for p in reference for _, _, lp in p], abs=1e-4)
    stats = spec.stats().spec_decode
    # Both paths ran: proposals accepted and rejected, and steps were saved.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec.num_steps < plain.num_steps
    assert_no_kv_held(spec)

    # Stop strings that end the text inside a run of accepted proposals: two letters from
    # the middle of each answer (FakeTokenizer: one letter per token).
    texts = [expected[str(i)].outputs[0].text for i in range(len(prompts))]
    stopped = [dataclasses.replace(p, stop=[t[len(t) // 2 : len(t) // 2 + 2]], logprobs=1)
               for p, t in zip(params, texts) if len(t) >= 6]
    prompts = [p for p, t in zip(prompts, texts) if len(t) >= 6]
    expected = run(tiny_engine(target, **settings), prompts, stopped)
    got = run(tiny_engine(target, draft if method == "draft_model" else None, spec_config, **settings), prompts,
              stopped)
    assert outputs_of(got) == outputs_of(expected)
    assert [len(p) for p in logprobs_of(got).values()] == [len(o.outputs[0].token_ids) for o in got.values()]
    assert sum(o.outputs[0].finish_reason == "stop" and isinstance(o.outputs[0].stop_reason, str)
               for o in got.values()) >= len(prompts) // 2


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_is_identical_under_preemption_and_draft_kv_is_released(pair, method: str) -> None:
    target, draft = pair
    prompts, params = greedy_workload(seed=1, count=8)
    params = [dataclasses.replace(p, max_tokens=40, ignore_eos=True, stop_token_ids=[], min_tokens=0)
              for p in params]
    settings = dict(num_blocks=24, max_num_seqs=8, max_num_batched_tokens=64)
    expected = run(tiny_engine(target, **settings), prompts, params)
    spec = tiny_engine(target, draft if method == "draft_model" else None,
                       NGRAM if method == "ngram" else DRAFT, **settings)
    live_drafts: list[tuple[set, set]] = []

    class Watch:
        def on_step(self, record, outputs):
            if hasattr(spec.proposer, "sequences"):
                running = {r.request_id for r in spec.scheduler.running}
                live_drafts.append((set(spec.proposer.sequences), running))

        def on_aborted(self, output):
            pass

    spec.add_observer(Watch())
    got = run(spec, prompts, params)
    assert outputs_of(got) == outputs_of(expected)
    assert spec.scheduler.num_preemptions > 0 and spec.stats().spec_decode.num_accepted_tokens > 0
    for drafted, running in live_drafts:  # a preempted or finished request holds no draft KV
        assert drafted <= running
    assert_no_kv_held(spec)


def test_abort_frees_the_draft_kv_at_once(pair) -> None:
    target, draft = pair
    spec = tiny_engine(target, draft, DRAFT)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for rid, prompt in (("a", [5, 6, 7, 8]), ("b", [9, 10, 11, 12, 13])):
        spec.add_request(rid, prompt, params)
    for _ in range(3):
        spec.step()
    proposer = spec.proposer
    assert set(proposer.sequences) == {"a", "b"} and proposer.kv.get_block_ids("a")
    spec.abort_request("a")
    assert "a" not in proposer.sequences and not proposer.kv.get_block_ids("a")
    assert proposer.kv.get_block_ids("b")
    while spec.has_unfinished_requests():
        spec.step()
    assert_no_kv_held(spec)


def test_disable_by_batch_size_turns_speculation_off_per_step(pair) -> None:
    target, _ = pair
    prompts, _ = greedy_workload(seed=2, count=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 12, 24, 40)]
    spec = tiny_engine(target, None, {**NGRAM, "disable_by_batch_size": 3})
    drafted_with = []

    class Watch:
        def on_step(self, record, outputs):
            if record.spec_decode is not None:
                drafted_with.append(record.num_scheduled)

        def on_aborted(self, output):
            pass

    spec.add_observer(Watch())
    got = run(spec, prompts, params)
    assert outputs_of(got) == outputs_of(run(tiny_engine(target), prompts, params))
    # Four requests run together until two finish: no proposals while 3 or more run.
    assert drafted_with and max(drafted_with) <= 2


# ----- sampling: lossless --------------------------------------------------------------------

SMALL_VOCAB = 4
PROMPT = [1, 3, 0, 1, 3]  # "1 3" re-occurs: the n-gram proposer has something to copy
CONTINUATION = 4
NUM_SAMPLES = 10_000
SAMPLED = {
    "plain": SamplingParams(temperature=1.0),
    "filtered": SamplingParams(temperature=0.8, top_k=3, top_p=0.9, frequency_penalty=0.4, presence_penalty=0.3),
}


@pytest.fixture(scope="module")
def small_pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A target with neither flat nor peaked distributions over 4 tokens, and a draft far
    enough from it that rejections and residual draws are frequent."""
    return tiny_pair(SMALL_VOCAB, noise=1.0, seed=3, scale=2.5)


def reference_probs(logits: torch.Tensor, output: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's next-token distribution, written out plainly (vLLM's order: penalties
    on the raw logits, temperature, top-k, then top-p over what is left)."""
    logits = logits.double().clone()
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    logits /= params.temperature
    if params.top_k > 0:
        logits[logits < logits.topk(params.top_k).values[-1]] = -math.inf
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        probs[order[mass_before >= params.top_p]] = 0.0
        probs /= probs.sum()
    return probs


def exact_distribution(model: LlamaForCausalLM, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Probability of every continuation, from dense forward passes of the target."""
    exact = {}
    with torch.inference_mode():
        for continuation in itertools.product(range(SMALL_VOCAB), repeat=CONTINUATION):
            ids = torch.tensor(PROMPT + list(continuation))
            logits = model.compute_logits(model(ids, torch.arange(len(ids))))
            p = 1.0
            for t, token in enumerate(continuation):
                p *= float(reference_probs(logits[len(PROMPT) - 1 + t], list(continuation[:t]), params)[token])
            exact[continuation] = p
    return exact


def chi_square_p_value(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit of the observed continuations to the exact distribution; outcomes
    expected fewer than 5 times are pooled into one bin."""
    total = sum(counts.values())
    assert set(counts) <= {c for c, p in exact.items() if p > 0}, "a continuation the target never produces"
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for outcome, p in exact.items():
        if p * total >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(p * total)
        else:
            pooled_o += counts.get(outcome, 0)
            pooled_e += p * total
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def sample_continuations(engine: LLMEngine, params: SamplingParams) -> dict[tuple[int, ...], int]:
    params = dataclasses.replace(params, n=NUM_SAMPLES, max_tokens=CONTINUATION, ignore_eos=True)
    engine.add_request("samples", PROMPT, params, final_only=True)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    counts: dict[tuple[int, ...], int] = {}
    for completion in final.outputs:
        key = tuple(completion.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def sampling_engine(pair, method: str | None) -> LLMEngine:
    target, draft = pair
    speculative = {"ngram": {**NGRAM, "num_speculative_tokens": 3}, "draft_model": DRAFT, None: None}[method]
    return tiny_engine(target, draft if method == "draft_model" else None, speculative, num_blocks=1600,
                       max_num_seqs=256, max_num_batched_tokens=1024, max_model_len=16)


@pytest.mark.parametrize("params", SAMPLED)
@pytest.mark.parametrize("method", [None, "ngram", "draft_model"], ids=["off", "ngram", "draft"])
def test_sampled_continuations_follow_the_target_distribution(small_pair, method: str | None, params: str) -> None:
    engine = sampling_engine(small_pair, method)
    counts = sample_continuations(engine, SAMPLED[params])
    p_value = chi_square_p_value(counts, exact_distribution(small_pair[0], SAMPLED[params]))
    # Under the null hypothesis this fails once in 10,000 seeds; the wrong rules below give
    # p < 1e-60 with the same seeds and sample counts.
    assert p_value > 1e-4, f"the sampled continuations do not follow the target's distribution (p = {p_value:.2g})"
    if method is not None:
        stats = engine.stats().spec_decode
        # Proposals were verified, and both accepted and rejected: every path of the rule ran.
        assert stats.num_drafts > NUM_SAMPLES // 2
        assert 0.1 < stats.acceptance_rate < 0.9, stats
    assert_no_kv_held(engine)


# A rule that ignores q (accept with probability p(x)): right for point masses (n-gram),
# wrong for a draft model. A residual that keeps the rejected token: wrong for n-gram.
WRONG_RULES = {
    "draft_model": ("accepts", staticmethod(lambda target_prob, draft_prob, uniform: uniform < target_prob)),
    "ngram": ("residual", staticmethod(lambda target, draft_probs, j, proposal: target)),
}


@pytest.mark.parametrize("method", ["ngram", "draft_model"], ids=["ngram", "draft"])
def test_a_wrong_acceptance_rule_fails_the_same_test(small_pair, method: str, monkeypatch) -> None:
    name, wrong = WRONG_RULES[method]
    monkeypatch.setattr(RejectionSampler, name, wrong)
    counts = sample_continuations(sampling_engine(small_pair, method), SAMPLED["plain"])
    p_value = chi_square_p_value(counts, exact_distribution(small_pair[0], SAMPLED["plain"]))
    assert p_value < 1e-12, f"the test cannot tell a wrong rule ({name}) from the right one (p = {p_value:.2g})"


def test_short_chunks_attend_the_same_either_way(pair) -> None:
    """Verification chunks as one-token rows (the default) or as chunks: same outputs."""
    target, draft = pair
    prompts, params = greedy_workload(seed=4, count=6)
    outputs = []
    for as_decodes in (True, False):
        engine = tiny_engine(target, draft, DRAFT)
        engine.executor.short_chunks_as_decodes = as_decodes
        engine.proposer.runner.short_chunks_as_decodes = as_decodes
        outputs.append(outputs_of(run(engine, prompts, params)))
    assert outputs[0] == outputs[1]
    assert outputs[0] == outputs_of(run(tiny_engine(target), prompts, params))


def test_seeded_sampling_with_speculation_does_not_depend_on_the_batch(pair) -> None:
    target, draft = pair
    prompt = [7, 8, 9, 7, 8]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=30, ignore_eos=True)
    alone = run(tiny_engine(target, draft, DRAFT), [prompt], params)["0"].outputs[0].token_ids
    others = [[5, 6, 5, 6], [11, 12, 13]]
    batched = run(tiny_engine(target, draft, DRAFT), [*others, prompt],
                  [SamplingParams(temperature=1.0, max_tokens=25), SamplingParams(temperature=0.0, max_tokens=20),
                   params])["2"].outputs[0].token_ids
    assert alone == batched and len(alone) == 30


# ----- start-up errors --------------------------------------------------------------------------


def write_tiny_hf_dir(directory, vocab_size: int = VOCAB, seed: int = 0, max_positions: int = 256,
                      token_prefix: str = "t"):
    """A Hugging Face checkpoint directory of a tiny random Llama, with a word-level
    tokenizer whose tokens are `token_prefix` + index."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, eos_token_id=1)
    HFLlama(config).save_pretrained(directory, safe_serialization=True)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"{token_prefix}{i}": i for i in range(2, vocab_size)}}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    return str(directory)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-models")
    specs = {"target": {}, "draft": dict(seed=1), "other_vocab": dict(vocab_size=96),
             "other_tokens": dict(token_prefix="w"), "short": dict(max_positions=64)}
    dirs = {}
    for name, kwargs in specs.items():
        (root / name).mkdir()
        dirs[name] = write_tiny_hf_dir(root / name, **kwargs)
    return dirs


TINY_LLM = dict(dtype="float32", max_model_len=128, kv_cache_memory="4MiB", num_threads=1, block_size=4)


def test_llm_with_a_draft_model_from_disk(hf_dirs) -> None:
    """The whole builder path: a draft directory, checked, loaded, planned, with its own
    KV cache sized beside the target's; greedy output as without it."""
    from tokenmill.llm import LLM

    llm = LLM(hf_dirs["target"], speculative_config={"model": hf_dirs["draft"], "num_speculative_tokens": 2},
              **TINY_LLM)
    facts = llm.engine.facts
    assert facts.speculative.startswith("draft_model, 2 tokens, draft ") and llm.engine.proposer.kv.num_blocks > 0
    plain = LLM(hf_dirs["target"], **TINY_LLM)
    # Target and draft share the KV memory: the target holds fewer blocks than alone.
    assert facts.num_blocks < plain.engine.facts.num_blocks
    prompts = [[5, 6, 7, 5, 6], [9, 10, 11, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert llm.engine.stats().spec_decode.num_drafts > 0
    assert_no_kv_held(llm.engine)


@pytest.mark.parametrize(("draft", "message"), [
    ("other_vocab", "vocabulary has 96 tokens, the target's 64"),
    ("other_tokens", "tokenizer differs from the target's"),
    ("short", "context is 64 tokens, less than max_model_len 128"),
])
def test_an_unfit_draft_is_refused_before_anything_is_allocated(hf_dirs, draft: str, message: str,
                                                                monkeypatch) -> None:
    import tokenmill.runner.worker as worker
    from tokenmill.llm import LLM

    allocated = []
    monkeypatch.setattr(worker, "PagedKVCache", lambda *a, **k: allocated.append(a))
    with pytest.raises(ValueError, match=message):
        LLM(hf_dirs["target"], speculative_config={"model": hf_dirs[draft], "num_speculative_tokens": 2},
            **TINY_LLM)
    assert allocated == []


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, r"unknown key\(s\) \['lookahead'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ('{"method": "ngram", ', "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_speculative_configs_are_refused_before_loading(config, message: str, monkeypatch) -> None:
    import tokenmill.runner.worker as worker
    from tokenmill.llm import LLM

    monkeypatch.setattr(worker, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match=message):
        LLM(speculative_config=config)


def test_a_missing_draft_model_is_a_clear_error(hf_dirs, tmp_path) -> None:
    from tokenmill.llm import LLM

    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(hf_dirs["target"], speculative_config={"model": str(tmp_path / "nope"), "num_speculative_tokens": 2},
            **TINY_LLM)


def test_vllm_defaults_for_prompt_lookup() -> None:
    def lookup(**keys):
        spec = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 2, **keys})
        spec = spec.speculative.speculative_config
        return spec.prompt_lookup_min, spec.prompt_lookup_max

    assert lookup() == (5, 5)
    assert lookup(prompt_lookup_max=4) == (4, 4)
    assert lookup(prompt_lookup_min=2) == (2, 2)
    assert lookup(prompt_lookup_min=2, prompt_lookup_max=4) == (2, 4)


def test_serve_flag_and_yaml_key(tmp_path) -> None:
    import argparse

    from tokenmill.config import config_from_args
    from tokenmill.serve import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    settings = serve_cli.resolve_settings(parser.parse_args(["serve", "--speculative-config", flag]))
    spec = config_from_args(settings).speculative.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 4, 2, 4)
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("speculative-config:\n  method: draft_model\n  model: /m.gguf\n  num_speculative_tokens: 3\n")
    settings = serve_cli.resolve_settings(parser.parse_args(["serve", "--config", str(yaml)]))
    spec = config_from_args(settings).speculative.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/m.gguf", 3)


# ----- metrics ----------------------------------------------------------------------------------


def test_prometheus_counters_follow_the_step_records(pair) -> None:
    from tokenmill.serve.metrics import ServerMetrics

    target, draft = pair
    engine = tiny_engine(target, draft, DRAFT)
    metrics = ServerMetrics(engine.stats, lambda: "tiny")
    engine.add_observer(metrics)
    prompts, params = greedy_workload(seed=5, count=4)
    run(engine, prompts, params)
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    text = metrics.render().decode()

    def value(name: str, extra: str = "") -> float:
        line = next(li for li in text.splitlines() if li.startswith(f'tokenmill:{name}{{model_name="tiny"{extra}}}'))
        return float(line.rsplit(" ", 1)[1])

    assert value("spec_decode_num_drafts_total") == stats.num_drafts
    assert value("spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value("spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    per_position = [value("spec_decode_num_accepted_tokens_per_pos_total", f',position="{i}"')
                    for i in range(len(stats.accepted_per_position))]
    assert per_position == stats.accepted_per_position and sum(per_position) == stats.num_accepted_tokens
    assert per_position == sorted(per_position, reverse=True)  # position i+1 is accepted only after i
    assert 0 < stats.acceptance_rate < 1 and stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / \
        stats.num_drafts


# ----- the default model, float32 ---------------------------------------------------------------

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
           "polished the great lens, and wrote the weather in a leather logbook. Ships passing the rocky "
           "point saw the beam sweep across the water every twelve seconds.")
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the following text in the past perfect tense:\n\n{PASSAGE}",
    "Add type hints to this Python function and return the whole function:\n\n"
    "def scale(values, factor):\n    result = []\n    for value in values:\n        result.append(value * factor)\n"
    "    return result\n",
]


def _grounded_prompts(llm) -> list[list[int]]:
    return [llm.encode_chat([{"role": "user", "content": text}]) for text in GROUNDED]


def test_default_model_greedy_is_identical_with_ngram(llm_f32) -> None:
    from tokenmill.llm import LLM

    prompts = _grounded_prompts(llm_f32)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    expected = [o.outputs[0].token_ids for o in llm_f32.generate(prompts, params)]
    spec = LLM.from_engine(llm_f32.engine.sibling(speculative_config=NGRAM, proposer=NgramProposer(3, 1, 3)))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == expected
    stats = spec.engine.stats().spec_decode
    assert stats.acceptance_rate > 0.3 and spec.engine.num_steps < llm_f32.engine.num_steps
    assert_no_kv_held(spec.engine)


def test_default_model_greedy_is_identical_with_its_bf16_weights_as_draft(llm_f32) -> None:
    """The GGUF's own weights stored in bfloat16 drafting for the same model in float32."""
    from tokenmill.llm import LLM
    from tokenmill.model.loader import default_model_path

    draft = {"method": "draft_model", "model": default_model_path(), "dtype": "bfloat16", "num_speculative_tokens": 3}
    spec = LLM(dtype="float32", max_model_len=1024, kv_cache_memory="128MiB", seed=0, num_threads=1,
               speculative_config=draft)
    prompts = _grounded_prompts(llm_f32)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    expected = [o.outputs[0].token_ids for o in llm_f32.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == expected
    assert spec.engine.stats().spec_decode.acceptance_rate > 0.8
    assert_no_kv_held(spec.engine)
