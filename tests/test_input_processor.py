"""The one admission path (tokenmill/engine/input_processor.py): each refusal with its
message and the request field it names, what an admitted request becomes, and that `LLM`
and the OpenAI server refuse with the same sentence (both run this code)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.fakes import EOS, VOCAB_SIZE, FakeTokenizer, make_engine
from tests.server_utils import BASE_ARGS, ServerProcess, assert_error
from tokenmill.engine.input_processor import AdmissionError, AdmissionLimits, InputProcessor
from tokenmill.sampling.params import SamplingParams


class ChatTokenizer(FakeTokenizer):
    """A fake with a chat template: one line per message, or a template's ValueError."""

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    check_text=None, **kwargs: Any) -> tuple[str, list[int]]:
        if any("role" not in m for m in messages):
            raise ValueError("each message needs a 'role'")
        text = "".join(f"{m['role']}:{m['content']};" for m in messages) + ("assistant:" if add_generation_prompt else "")
        if check_text is not None:
            check_text(text)
        return text, self.encode(text, add_special_tokens=False)


def processor(max_model_len: int = 32, num_blocks: int = 10, block_size: int = 4) -> InputProcessor:
    return InputProcessor(ChatTokenizer(), AdmissionLimits(max_model_len, VOCAB_SIZE, num_blocks, block_size))


def refusal(call, *args, **kwargs) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        call(*args, **kwargs)
    return info.value


# ----- each refusal: message and param -----------------------------------------------------


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(prompt) -> None:
    error = refusal(processor().process, "r", prompt, arrival_time=0.0)
    assert str(error) == "the prompt is empty: it must contain at least one token"
    assert error.param == "prompt"


@pytest.mark.parametrize("bad", [VOCAB_SIZE, -1, 10**9, "7", True])
def test_prompt_token_id_out_of_the_vocabulary(bad) -> None:
    error = refusal(processor().process, "r", [5, bad], arrival_time=0.0)
    assert str(error) == f"prompt token id {bad!r} is out of the vocabulary (size {VOCAB_SIZE})"
    assert error.param == "prompt"


@pytest.mark.parametrize("length", [32, 40])
def test_prompt_that_leaves_no_room_for_a_completion(length) -> None:
    error = refusal(processor(max_model_len=32).process, "r", list(range(10, 10 + length)), arrival_time=0.0)
    assert str(error) == (f"the prompt has {length} tokens, but max_model_len is 32 (this model's maximum context "
                          "length), which leaves no room for a completion; shorten the prompt")
    assert error.param == "prompt"
    # The server names its own field for a chat prompt.
    assert refusal(processor().check, length, SamplingParams(), prompt_param="messages").param == "messages"


def test_prompt_plus_max_tokens_over_the_context_is_refused_only_when_strict() -> None:
    p = processor(max_model_len=32, num_blocks=100)
    params = SamplingParams(max_tokens=20)
    error = refusal(p.check, 20, params, strict_max_tokens=True)
    assert str(error) == ("this model's maximum context length is 32 tokens, but 40 were requested (20 in the "
                          "prompt, 20 for the completion); shorten the prompt or lower max_tokens")
    assert error.param == "max_tokens"
    p.check(20, params)  # LLM's rule: capped to the 12 tokens the context leaves
    assert p.output_room(20, 20) == 12 and p.output_room(20, None) == 12 and p.output_room(20, 5) == 5
    (sample,) = p.process("r", list(range(10, 30)), params, arrival_time=0.0).samples
    assert sample.max_tokens == p.output_room(20, 20)  # the request's own rule agrees


def test_request_that_can_never_fit_the_kv_cache() -> None:
    p = processor(max_model_len=64, num_blocks=4, block_size=4)  # 16 slots
    error = refusal(p.check, 8, SamplingParams(max_tokens=10))
    assert str(error) == ("prompt (8 tokens) + max_tokens (10) needs 17 KV slots, which can never fit in the KV "
                          "cache (16 tokens); lower max_tokens or raise kv_cache_memory")
    assert error.param == "max_tokens"
    assert "max_tokens (56)" in str(refusal(p.check, 8, SamplingParams(max_tokens=None)))  # all the context leaves
    p.check(8, SamplingParams(max_tokens=9))  # the last token needs no slot: 16 exactly


@pytest.mark.parametrize("field, params", [
    ("stop_token_ids", SamplingParams(stop_token_ids=[3, VOCAB_SIZE])),
    ("logit_bias", SamplingParams(logit_bias={VOCAB_SIZE + 5: 1.0})),
])
def test_sampling_token_ids_out_of_the_vocabulary(field, params) -> None:
    error = refusal(processor().check, 3, params)
    assert "is out of the vocabulary (size 1000)" in str(error) and error.param == field


def test_text_longer_than_the_context_can_hold_is_refused_before_tokenizing() -> None:
    class Counting(ChatTokenizer):
        calls = 0

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            Counting.calls += 1
            return super().encode(text, add_special_tokens)

    p = InputProcessor(Counting(), AdmissionLimits(32, VOCAB_SIZE, 10, 4))
    error = refusal(p.tokenize, "x" * 33)
    assert str(error) == ("the prompt has 33 characters, more than this model's context can hold (at most 32 "
                          "characters); shorten it")
    assert error.param == "prompt" and Counting.calls == 0
    long_chat = [{"role": "user", "content": "x" * 40}]
    assert refusal(p.render_chat, long_chat).param == "messages"


def test_a_chat_template_error_is_a_refusal_of_messages() -> None:
    error = refusal(processor().render_chat, [{"content": "hi"}])
    assert str(error) == "each message needs a 'role'" and error.param == "messages"


def test_priority_other_than_zero_needs_the_priority_policy() -> None:
    error = refusal(processor().process, "r", [5], arrival_time=0.0, priority=3)
    assert str(error) == ("priority must be 0 unless priority scheduling is enabled (got 3; start the engine with "
                          "--scheduling-policy priority)")
    assert error.param == "priority"
    assert refusal(processor().check_priority, True).param == "priority"  # not an integer
    ranked = InputProcessor(ChatTokenizer(), AdmissionLimits(32, VOCAB_SIZE, 10, 4), priority_scheduling=True)
    assert [s.priority for s in ranked.process("r", [5], SamplingParams(n=2), arrival_time=0.0,
                                               priority=-2).samples] == [-2, -2]


# ----- what an admitted request becomes ----------------------------------------------------


def test_process_makes_one_request_per_sample() -> None:
    p = processor(max_model_len=32)
    processed = p.process("r", "hello", SamplingParams(n=3, seed=7, max_tokens=4), arrival_time=5.0,
                          cache_salt="s")
    assert processed.prompt_text == "hello" and processed.prompt_token_ids == ChatTokenizer().encode("hello")
    assert [s.request_id for s in processed.samples] == ["r#0", "r#1", "r#2"]
    assert [s.params.seed for s in processed.samples] == [7, 8, 9]
    for sample in processed.samples:
        assert sample.params.n == 1 and sample.eos_token_ids == (EOS,) and sample.max_total_tokens == 32
        assert sample.arrival_time == 5.0 and sample.cache_salt == "s"
        assert sample.prompt_token_ids == processed.prompt_token_ids
    one = p.process("q", [5, 6], arrival_time=0.0)  # default params: vLLM's offline max_tokens 16
    assert [s.request_id for s in one.samples] == ["q"] and one.prompt_text is None
    assert one.samples[0].params.max_tokens == 16


def test_render_chat_writes_the_template_then_tokenizes_without_adding_special_tokens() -> None:
    p = processor()
    ids = p.render_chat([{"role": "user", "content": "hi"}])
    assert ids == ChatTokenizer().encode("user:hi;assistant:", add_special_tokens=False)


def test_the_engine_admits_through_its_processor_and_leaves_nothing_on_refusal() -> None:
    engine = make_engine(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(AdmissionError, match="can never fit"):
        engine.add_request("r", list(range(10, 20)), SamplingParams(n=2, max_tokens=20))
    assert not engine.scheduler.requests and not engine.output_processor.user_requests
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2))
    assert list(engine.scheduler.requests) == ["ok"]
    smaller = engine.sibling(num_blocks=1)  # its own KV capacity, its own processor
    assert smaller.input_processor.limits.num_blocks == 1
    with pytest.raises(AdmissionError, match=r"KV cache \(4 tokens\)"):
        smaller.add_request("s", [5, 6, 7], SamplingParams(max_tokens=3))


# ----- LLM and the server refuse with the same sentence ------------------------------------

# The same engine settings on both sides: a small KV cache (16 MiB of float32 KV: a few
# hundred tokens) so that a request can fit the context but never the cache.
SHARED = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory": "16MiB", "num_threads": 1}


@pytest.fixture(scope="module")
def both():
    from tokenmill.llm import LLM

    llm = LLM(**SHARED)
    server = ServerProcess(base_args=["16MiB" if arg == "256MiB" else arg for arg in BASE_ARGS]).start()
    try:
        yield llm, server
    finally:
        server.stop()


SAME_REFUSALS = [
    # (case, LLM prompt, sampling params, server body, the param the server names)
    ("empty prompt", "", {}, {"prompt": ""}, "prompt"),
    ("empty token list", [], {}, {"prompt": []}, "prompt"),
    ("token id out of the vocabulary", [1, 49152], {}, {"prompt": [1, 49152]}, "prompt"),
    ("prompt longer than the context", "hi " * 1100, {}, {"prompt": "hi " * 1100}, "prompt"),
    ("stop token id out of the vocabulary", "hello", {"stop_token_ids": [10**6]},
     {"prompt": "hello", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("never fits the KV cache", "hello", {"max_tokens": 1000}, {"prompt": "hello", "max_tokens": 1000}, "max_tokens"),
]


@pytest.mark.parametrize(("prompt", "params", "body", "param"), [c[1:] for c in SAME_REFUSALS],
                         ids=[c[0] for c in SAME_REFUSALS])
def test_llm_and_the_server_refuse_with_the_same_message(both, prompt, params, body, param) -> None:
    llm, server = both
    with pytest.raises(ValueError) as info:
        llm.generate([prompt], SamplingParams(**params))
    error = assert_error(server.post("/v1/completions", json={**body, "model": server.model}), 400, param)
    assert error["message"] == str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_the_server_still_answers_after_the_refusals(both) -> None:
    _, server = both
    response = server.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "model": server.model})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 2
    assert httpx.get(server.url + "/health").status_code == 200
