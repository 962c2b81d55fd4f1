"""The default model (SmolLM2-135M-Instruct GGUF) end to end, in float32."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import assert_engine_idle, sibling
from tokenmill import SamplingParams
from tokenmill.model.loader import default_model_path

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
    "wine. Before that, books in Europe were copied by hand, usually by monks, and a single Bible could "
    "take years to finish. The new machine made books cheaper and faster to produce, and within fifty "
    "years presses were working in more than two hundred cities. Ideas spread more quickly than ever "
    "before: scientists shared their results, reformers printed pamphlets, and ordinary people began "
    "to read in their own languages rather than in Latin. Historians often say that the press helped "
    "to bring about the Renaissance, the Reformation and the scientific revolution, because it let "
    "knowledge be copied exactly and sent far away."
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_teacher_forced_predictions_agree_with_transformers(llm_f32) -> None:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    ids = llm_f32.tokenizer.encode(TEXT)
    assert len(ids) >= 150
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0].argmax(-1)
    # Our prompt logprobs score token p + 1 from position p: rank 1 means argmax agreed.
    out = llm_f32.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    ours = [max(d, key=lambda t: d[t].logprob) for d in out.prompt_logprobs[1:]]
    agree = sum(int(a == b) for a, b in zip(ours, expected[:-1].tolist()))
    assert agree / len(ours) >= 0.99, f"{agree}/{len(ours)} positions agree"


def _prompts(llm, n: int) -> list[list[int]]:
    ids = llm.tokenizer.encode(TEXT)
    return [ids[i * 7 % 50 : i * 7 % 50 + 5 + (i * 37) % 150] for i in range(n)]


def test_batch_equals_solo_greedy(llm_f32) -> None:
    """Also exercises prefix caching: the solo runs hit blocks cached by the batch."""
    llm = sibling(llm_f32, enable_prefix_caching=True)
    prompts = _prompts(llm, 16)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(16)]
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate([prompt], p)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == p.max_tokens
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_engine_idle(llm)


def test_chunked_prefill_equals_one_shot(llm_f32) -> None:
    prompts = _prompts(llm_f32, 4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    one_shot = llm_f32.generate(prompts, params)
    chunked_llm = sibling(llm_f32, max_num_batched_tokens=16, enable_prefix_caching=False)
    chunked = chunked_llm.generate(prompts, params)
    for a, b in zip(one_shot, chunked):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert abs(pa[t].logprob - pb[t].logprob) < 1e-4
    assert_engine_idle(chunked_llm)


def test_prefix_cache_hit_computes_only_new_tokens(llm_f32) -> None:
    ids = llm_f32.tokenizer.encode(TEXT * 5)
    prefix, suffix_a, suffix_b = ids[:512], ids[512:540], ids[540:560]
    assert len(suffix_b) == 20
    cached = sibling(llm_f32, enable_prefix_caching=True)
    uncached = sibling(llm_f32, enable_prefix_caching=False)
    first = cached.generate([prefix + suffix_a], GREEDY)[0]
    assert first.num_cached_tokens == 0
    before = cached.engine.stats().num_prompt_tokens
    second = cached.generate([prefix + suffix_b], GREEDY)[0]
    computed = cached.engine.stats().num_prompt_tokens - before
    assert second.num_cached_tokens == 512
    assert computed == len(suffix_b)
    reference = uncached.generate([prefix + suffix_b], GREEDY)[0]
    assert second.outputs[0].token_ids == reference.outputs[0].token_ids
    assert_engine_idle(cached)


def test_preemption_under_kv_pressure_keeps_outputs_exact(llm_f32) -> None:
    prompts = _prompts(llm_f32, 8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [llm_f32.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    # 24 blocks of 16 tokens cannot hold 8 requests of up to ~200 tokens at once.
    tight = sibling(llm_f32, num_blocks=24)
    together = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert tight.engine.stats().num_preemptions > 0
    assert_engine_idle(tight)


def test_seeded_sampling_is_batch_invariant(llm_f32) -> None:
    prompts = _prompts(llm_f32, 6)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm_f32.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    mixed = llm_f32.generate(prompts, [seeded] + [others] * 5)[0].outputs[0].token_ids
    assert alone == mixed


def test_n_samples_and_logprobs(llm_f32) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, logprobs=3, ignore_eos=True)
    (out,) = llm_f32.generate(["Once upon a time"], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.token_ids) == 10 and len(c.logprobs) == 10
        for token_id, position in zip(c.token_ids, c.logprobs):
            assert token_id in position and len(position) in (3, 4)
            assert all(lp.logprob <= 0 for lp in position.values())
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_strings_and_stop_tokens(llm_f32) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    free = llm_f32.generate(["Count: 1, 2, 3,"], greedy)[0].outputs[0]
    stop_at = free.text[5:8]
    stopped = llm_f32.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_at]))
    out = stopped[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.text == free.text[: free.text.index(stop_at)]
    token = free.token_ids[3]
    by_token = llm_f32.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[token]))
    assert by_token[0].outputs[0].token_ids == free.token_ids[: free.token_ids.index(token) + 1]
    assert by_token[0].outputs[0].stop_reason == token


def test_eos_and_min_tokens(llm_f32) -> None:
    chat = llm_f32.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0.0, max_tokens=200))
    out = chat[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm_f32.tokenizer.eos_token_ids
    longer = llm_f32.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=200, min_tokens=len(out.token_ids) + 5),
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(out.token_ids) + 5


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("x " * 3000, SamplingParams(), "max_model_len is 2048"),
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 2, 10**6], SamplingParams(), "out of the vocabulary"),
    ],
)
def test_bad_input_fails_early_and_leaves_nothing(llm_f32, prompt, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm_f32.generate(["a valid prompt", prompt], params)
    assert_engine_idle(llm_f32)


def test_vllm_prompt_dicts_give_the_same_tokens_as_plain_prompts(llm_f32) -> None:
    params = SamplingParams(temperature=0, max_tokens=6)
    text = "The capital of France is"
    ids = llm_f32.tokenizer.encode(text)
    plain = [o.outputs[0].token_ids for o in llm_f32.generate([text, ids], params)]
    wrapped = [o.outputs[0].token_ids for o in llm_f32.generate([{"prompt": text}, {"prompt_token_ids": ids}], params)]
    assert wrapped == plain and plain[0] == plain[1]
    one = llm_f32.generate({"prompt_token_ids": ids}, params)  # a single dict, as vLLM takes it
    assert [o.outputs[0].token_ids for o in one] == plain[:1]


@pytest.mark.parametrize("prompt", [{"prompt_token_ids": [1], "prompt": "a"}, {"text": "a"}, {"prompt": [1, 2]}])
def test_a_malformed_prompt_dict_is_named(llm_f32, prompt) -> None:
    with pytest.raises(ValueError, match="a prompt dict holds exactly one of 'prompt'"):
        llm_f32.generate(["a valid prompt", prompt], SamplingParams())
    assert_engine_idle(llm_f32)


def test_request_that_can_never_fit_the_kv_cache_is_rejected(llm_f32) -> None:
    small = sibling(llm_f32, num_blocks=4)  # 64 token slots
    with pytest.raises(ValueError, match=r"can never fit in the KV cache \(64 tokens\)"):
        small.generate(["hello"], SamplingParams(max_tokens=100))
    assert_engine_idle(small)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling_params(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path_is_named(tmp_path) -> None:
    from tokenmill import LLM

    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(tmp_path))


def test_seed_out_of_generator_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(seed=2**64)
