"""Structured output in the engine (offline API) on the default model: every constrained
output parses and validates, through batching, sampling, speculative decoding and
preemption; bad constraints fail before anything is queued. The schema, regex, choice
and grammar cases run through both backends (`backend_llm`: the default, auto, which
compiles them with llguidance, and xgrammar)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.conftest import assert_engine_idle, sibling
from tests.structured_schemas import SCHEMAS
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.structured_output import StructuredOutputError, compiler_for

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def xgrammar_llm() -> LLM:
    """The default model with `--structured-outputs-backend xgrammar`."""
    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory="256MiB", seed=0, enable_prefix_caching=False,
               structured_outputs_backend="xgrammar")


@pytest.fixture(params=["auto", "xgrammar"])
def backend_llm(request) -> LLM:
    """The default model with each structured-outputs backend: the default (auto:
    llguidance for everything these tests send) and xgrammar."""
    llm = request.getfixturevalue("llm_f32" if request.param == "auto" else "xgrammar_llm")
    assert llm.engine.config.model.structured_outputs_backend == request.param
    return llm


def _compiler(llm: LLM):
    return compiler_for(llm.tokenizer, llm.engine.facts.vocab_size, llm.engine.config.model.structured_outputs_backend)


def _prompt(llm: LLM, text: str) -> list[int]:
    return llm.encode_chat([{"role": "user", "content": text}])


def _schema_prompts(llm: LLM, names: list[str]) -> list[list[int]]:
    return [_prompt(llm, f"Reply with JSON matching this schema: {json.dumps(SCHEMAS[n])}") for n in names]


def _json_params(name: str, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 256)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]), **kwargs)


def _assert_valid(name: str, output) -> None:
    completion = output.outputs[0]
    assert completion.finish_reason == "stop", (name, completion.text)
    jsonschema.validate(json.loads(completion.text), SCHEMAS[name], format_checker=FORMATS)


def test_at_least_30_schemas_all_validate(backend_llm) -> None:
    names = list(SCHEMAS)
    assert len(names) >= 30
    outputs = backend_llm.generate(_schema_prompts(backend_llm, names), [_json_params(n) for n in names])
    for name, output in zip(names, outputs):
        _assert_valid(name, output)
    assert_engine_idle(backend_llm)


def test_sampled_outputs_validate_too(backend_llm) -> None:
    names = ["flat_person", "order", "array_of_objects", "anyof_objects", "date_format", "ref_defs"]
    params = [_json_params(n, temperature=1.0, seed=7 + i) for i, n in enumerate(names)]
    for name, output in zip(names, backend_llm.generate(_schema_prompts(backend_llm, names), params)):
        _assert_valid(name, output)


def test_regex_choice_grammar_and_json_object(backend_llm) -> None:
    prompt = _prompt(backend_llm, "Give me a product code, then say if you like it.")
    constraints = [
        StructuredOutputsParams(regex=r"[A-Z]{3}-\d{4}"),
        StructuredOutputsParams(choice=["yes", "no", "it depends"]),
        StructuredOutputsParams(grammar='root ::= "Hello, " name "!"\nname ::= "Alice" | "Bob"'),
    ]
    outputs = backend_llm.generate([prompt] * 3, [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=c)
                                              for c in constraints])
    texts = [o.outputs[0].text for o in outputs]
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", texts[0]), texts[0]
    assert texts[1] in ("yes", "no", "it depends")
    assert texts[2] in ("Hello, Alice!", "Hello, Bob!")
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_json_object_without_free_whitespace(backend_llm) -> None:
    prompt = _prompt(backend_llm, 'Return a JSON object whose key "ok" is true.')
    constraint = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    output = backend_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=200,
                                                     structured_outputs=constraint))[0].outputs[0]
    assert output.finish_reason == "stop" and isinstance(json.loads(output.text), dict)
    assert "\n" not in output.text and "  " not in output.text, output.text  # one-line separators only


def test_unconstrained_output_differs_so_the_mask_is_doing_the_work(backend_llm) -> None:
    prompt = _prompt(backend_llm, "Say yes or no.")
    free = backend_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    forced = backend_llm.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["zebra"])))[0]
    assert free != "zebra" and forced.outputs[0].text == "zebra"


def test_speculative_decoding_keeps_outputs_valid_and_greedy_identical(backend_llm) -> None:
    names = ["order", "array_of_objects", "nested_address", "ref_defs", "matrix", "weather_tool_args"]
    prompts = _schema_prompts(backend_llm, names)
    params = [_json_params(n) for n in names]
    reference = backend_llm.generate(prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    speculative = LLM.from_engine(backend_llm.engine.sibling(proposer=NgramProposer(3, 1, 3), speculative_config=spec))
    outputs = speculative.generate(prompts, params)
    for name, output, ref in zip(names, outputs, reference):
        _assert_valid(name, output)
        assert output.outputs[0].token_ids == ref.outputs[0].token_ids, name
    stats = speculative.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # proposals were verified
    assert_engine_idle(speculative)


def test_preempted_sequences_rebuild_their_matcher(backend_llm) -> None:
    names = ["order", "array_of_objects", "nested_address", "ref_defs", "matrix", "weather_tool_args",
             "flat_person", "uuid_format"]
    prompts = _schema_prompts(backend_llm, names)
    params = [_json_params(n, max_tokens=120) for n in names]
    alone = [backend_llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    # 40 blocks of 16 tokens cannot hold 8 requests of ~250-350 tokens at once.
    tight = sibling(backend_llm, num_blocks=40)
    together = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    for name, output, ref in zip(names, together, alone):
        _assert_valid(name, output)
        assert output.outputs[0].token_ids == ref, name
    assert_engine_idle(tight)


@pytest.mark.parametrize("constraint, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "invalid JSON schema"),
    (dict(json='{"type": "object",'), "not JSON"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "invalid JSON schema"),
    (dict(regex="(ab"), "invalid regex"),
    (dict(grammar='root ::= "a" | undefined_rule'), "invalid grammar"),
])
def test_bad_constraints_fail_before_queueing(backend_llm, constraint, message) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(StructuredOutputError, match=message):
        backend_llm.generate("hi", params)
    assert_engine_idle(backend_llm)


def test_a_schema_naming_an_unknown_metaschema_fetches_nothing() -> None:
    """Schemas are checked against their metaschema (jsonschema-rs, then jsonschema for the
    message); a `$schema` that is not a shipped draft must not make the server fetch it."""
    import socket

    from tokenmill.structured_output.compiler import _check_json_schema

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/schema"
        _check_json_schema({"$schema": url, "type": "object"})
        with pytest.raises(StructuredOutputError, match="at type: 'objekt' is not valid"):
            _check_json_schema({"$schema": url, "type": "objekt"})
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    with pytest.raises(StructuredOutputError, match="at properties/a/minLength"):
        _check_json_schema({"type": "object", "properties": {"a": {"minLength": "five"}}})


def test_params_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "integer"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])


def test_compiled_once_per_constraint(backend_llm) -> None:
    compiler = _compiler(backend_llm)
    schema = {"type": "object", "properties": {"only_here": {"type": "integer"}}, "required": ["only_here"]}
    before = compiler.num_compiled
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
    first = backend_llm.generate(["a", "b"], params)
    again = backend_llm.generate("c", params)
    assert compiler.num_compiled == before + 1
    for output in [*first, *again]:
        assert isinstance(json.loads(output.outputs[0].text)["only_here"], int)


PARITY_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "tags": {"type": "array", "items": {"type": "integer"}}},
                 "required": ["name"]}
# (constraint, text, accepted whole and ended by EOS)
PARITY_CASES = [
    (dict(json=PARITY_SCHEMA, disable_any_whitespace=True), '{"name": "Al", "tags": [1, 2]}', True),
    (dict(json=PARITY_SCHEMA, disable_any_whitespace=True), '{\n"name": "Al"}', False),  # compact: no newline
    (dict(json=PARITY_SCHEMA), '{\n  "name": "Al",\n  "tags": []\n}', True),
    (dict(json=PARITY_SCHEMA), '{"name": "Al", "x": 1}', False),  # a property the schema does not name
    (dict(json=PARITY_SCHEMA), '{"name": "Alexander the Great"}', False),  # past maxLength
    (dict(json=PARITY_SCHEMA), '{"name":' + " " * 9 + '"Al"}', False),  # more than 8 whitespace characters
    (dict(json=PARITY_SCHEMA), '{"tags": [1]}', False),  # required name missing
    (dict(json_object=True), '{"any": {"thing": [1, "x", null]}}', True),
    (dict(json_object=True), '[1, 2]', False),
    (dict(regex=r"[A-Z]{3}-\d{4}"), "ABC-1234", True),
    (dict(regex=r"[A-Z]{3}-\d{4}"), "ABC-12345", False),
    (dict(choice=["yes", "no", "it depends"]), "it depends", True),
    (dict(choice=["yes", "no", "it depends"]), "it", False),
    (dict(grammar='root ::= "Hello, " name "!"\nname ::= "Alice" | "Bob"'), "Hello, Bob!", True),
    (dict(grammar='root ::= "Hello, " name "!"\nname ::= "Alice" | "Bob"'), "Hello, Carol!", False),
]


@pytest.mark.parametrize("constraint, text, accepted", PARITY_CASES)
def test_both_backends_accept_the_same_language(llm_f32, constraint, text, accepted) -> None:
    """Token by token, then EOS: xgrammar and llguidance agree on what each constraint
    allows (the same whitespace bound, strictness and separators)."""
    tokenizer = llm_f32.tokenizer
    token_ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0]]
    for backend in ("xgrammar", "guidance"):
        grammar = compiler_for(tokenizer, llm_f32.engine.facts.vocab_size, backend).compile(
            StructuredOutputsParams(**constraint))
        assert grammar.backend == backend
        matcher = grammar.matcher()
        taken = all(matcher.accept_token(t) for t in token_ids)
        assert (taken and matcher.is_terminated()) == accepted, (backend, text)
        if taken:  # rolled back to the start, the same text is accepted again
            matcher.rollback(len(token_ids))
            assert not matcher.is_terminated() and all(matcher.accept_token(t) for t in token_ids)


def test_rollback_over_eos_on_both_backends(llm_f32) -> None:
    """Speculative proposals may end with EOS and be rolled back: the matcher must return
    to where it was, whether the grammar could have gone on ("ab+") or not ("ab")."""
    tokenizer = llm_f32.tokenizer
    eos = tokenizer.eos_token_ids[0]
    b = tokenizer.encode("b", add_special_tokens=False)
    for backend in ("xgrammar", "guidance"):
        compiler = compiler_for(tokenizer, llm_f32.engine.facts.vocab_size, backend)
        for regex, text, then in (("ab+", "abb", b), ("ab", "ab", [eos])):
            matcher = compiler.compile(StructuredOutputsParams(regex=regex)).matcher()
            assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
            assert matcher.accept_token(eos) and matcher.is_terminated()
            matcher.rollback(1)
            assert not matcher.is_terminated() and all(matcher.accept_token(t) for t in then), (backend, regex)


def test_auto_is_llguidance_then_xgrammar_for_what_llguidance_refuses(llm_f32) -> None:
    """The default, auto: llguidance first (it compiles a new schema in milliseconds); a
    constraint it refuses (here a structural tag in xgrammar's own `format` form) is
    compiled by xgrammar; one both refuse is an error with llguidance's message."""
    assert llm_f32.engine.config.model.structured_outputs_backend == "auto"
    compiler = compiler_for(llm_f32.tokenizer, llm_f32.engine.facts.vocab_size, "auto")
    assert compiler.compile(StructuredOutputsParams(json=PARITY_SCHEMA)).backend == "guidance"
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
        {"begin": "<function=get_weather>", "end": "</function>", "content": {
            "type": "json_schema", "json_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}}
    with pytest.raises(StructuredOutputError, match="structural tag"):
        compiler_for(llm_f32.tokenizer, llm_f32.engine.facts.vocab_size, "guidance").compile(
            StructuredOutputsParams(structural_tag=json.dumps(tag)))
    grammar = compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    assert grammar.backend == "xgrammar"
    matcher = grammar.matcher()
    text = 'Let me look. <function=get_weather>{"city": "Paris"}</function>'
    assert all(matcher.accept_token(t) for t in llm_f32.tokenizer.encode(text, add_special_tokens=False))
    with pytest.raises(StructuredOutputError, match="invalid regex: .*regex parse error"):
        compiler.compile(StructuredOutputsParams(regex="(ab"))


def test_auto_falls_back_to_xgrammar_for_a_tokenizer_llguidance_cannot_read(tmp_path) -> None:
    """A tokenizer.json without a decoder (the tiny test checkpoints' word-level one):
    llguidance refuses it at start-up, so auto serves with xgrammar alone (an engine on such
    a checkpoint starts), and asking for guidance by name fails with llguidance's reason."""
    from tests.tiny_checkpoint import _write_tokenizer
    from tokenmill.structured_output.compiler import GrammarCompiler
    from tokenmill.tokenizer import Tokenizer

    _write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="decoder"):
        GrammarCompiler(tokenizer, 512, "guidance")
    grammar = GrammarCompiler(tokenizer, 512, "auto").compile(StructuredOutputsParams(choice=["w1", "w2"]))
    assert grammar.backend == "xgrammar"


def test_compile_with_timeout_refuses_a_slow_constraint(llm_f32) -> None:
    compiler = compiler_for(llm_f32.tokenizer, llm_f32.engine.facts.vocab_size)
    # Never cached before; a compilation takes ~1-2 ms even where it is lazy (llguidance),
    # so a timeout of 0 s refuses it before the compiler's thread can finish (1 ms raced it:
    # on an idle machine the compile sometimes won).
    slow = StructuredOutputsParams(regex="(a|b|c|d){1,3000}(e|f){1,3000}x")
    with pytest.raises(StructuredOutputError, match="to compile"):
        compiler.compile_with_timeout(slow, timeout=0)


# ----- grammar after the reasoning (a reasoning parser is on) -----------------------------

ANSWER = {"type": "object", "properties": {"parity": {"enum": ["odd", "even"]}}, "required": ["parity"],
          "additionalProperties": False}


def _few_shot_thinking(llm: LLM) -> list[int]:
    """A conversation after which the default model writes `<think>Is 9 even?</think>`
    and an answer (greedy), as its earlier turns did."""
    turns = [("Is 7 even?", "<think>Is 7 even?</think>no"), ("Is 8 even?", "<think>Is 8 even?</think>yes")]
    messages = [m for question, answer in turns
                for m in ({"role": "user", "content": question}, {"role": "assistant", "content": answer})]
    return llm.encode_chat([*messages, {"role": "user", "content": "Is 9 even?"}])


def _after_reasoning(start: str | None = None, **kwargs) -> SamplingParams:
    constraint = StructuredOutputsParams(json=ANSWER, disable_any_whitespace=True, reasoning_end="</think>",
                                         reasoning_start=start)
    return SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint, **kwargs)


def test_grammar_applies_after_the_reasoning(backend_llm) -> None:
    prompt = _few_shot_thinking(backend_llm)
    free = backend_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60))[0].outputs[0].text
    assert free.startswith("<think>Is 9 even?</think>") and not free.endswith("}")  # the model's own habit
    text = backend_llm.generate([prompt], _after_reasoning())[0].outputs[0]
    reasoning, answer = text.text.split("</think>", 1)
    # The reasoning is the model's, unconstrained (the grammar forbids "<" first); the
    # answer after it is the grammar's.
    assert reasoning == "<think>Is 9 even?", text.text
    assert json.loads(answer) in ({"parity": "odd"}, {"parity": "even"}) and text.finish_reason == "stop"
    # Without the marker the grammar starts at once: no reasoning is possible.
    at_once = backend_llm.generate([prompt], _json_like_answer())[0].outputs[0].text
    assert "think" not in at_once and json.loads(at_once)["parity"] in ("odd", "even")
    assert_engine_idle(backend_llm)


def _json_like_answer() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=60,
                          structured_outputs=StructuredOutputsParams(json=ANSWER, disable_any_whitespace=True))


def test_grammar_after_reasoning_with_proposals_and_preemption(backend_llm) -> None:
    """Ngram proposals copy `<think>...</think>` from the earlier turns, so a step's
    proposals cross the marker; a preempted request replays its reasoning."""
    prompt = _few_shot_thinking(backend_llm)
    reference = backend_llm.generate([prompt], _after_reasoning())[0].outputs[0].token_ids
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    speculative = LLM.from_engine(backend_llm.engine.sibling(proposer=NgramProposer(4, 1, 3), speculative_config=spec))
    assert speculative.generate([prompt], _after_reasoning())[0].outputs[0].token_ids == reference
    assert speculative.engine.stats().spec_decode.num_accepted_tokens > 0
    assert_engine_idle(speculative)
    # Room for both prompts but not for both outputs: one is preempted mid-answer.
    prompt_blocks, whole_blocks = -(-len(prompt) // 16), -(-(len(prompt) + len(reference)) // 16)
    assert whole_blocks > prompt_blocks
    tight = sibling(backend_llm, num_blocks=prompt_blocks + whole_blocks)
    together = tight.generate([prompt] * 2, _after_reasoning())
    assert tight.engine.stats().num_preemptions > 0, (len(prompt), len(reference))
    assert all(o.outputs[0].token_ids == reference for o in together)
    assert_engine_idle(tight)


def test_qwen3_style_without_a_think_token_is_constrained_from_the_first_token(backend_llm) -> None:
    """With reasoning_start, an output that does not open with a `<think>` token is all
    answer: the default model spells <think> in three tokens, so even the few-shot
    conversation that makes it think gets the grammar from its first token."""
    for prompt in (_prompt(backend_llm, "Is 9 even? Answer in JSON."), _few_shot_thinking(backend_llm)):
        output = backend_llm.generate([prompt], _after_reasoning("<think>"))[0].outputs[0]
        assert json.loads(output.text)["parity"] in ("odd", "even") and output.finish_reason == "stop"


def test_reasoning_phases_on_token_bytes() -> None:
    """The phase machine the matcher follows: the marker found across token boundaries,
    the text after it in the same token, and Qwen3's optional opening."""
    from tokenmill.structured_output.manager import _Phase

    def run(phase: _Phase, pieces: list[bytes]) -> list[bool]:
        to_grammar = []
        for piece in pieces:
            phase, taken = phase.after(piece)
            to_grammar.append(taken)
        return to_grammar

    deepseek = _Phase(marker=b"</think>")
    assert run(deepseek, [b"Is 9", b" even?</", b"think", b">", b"{", b"}"]) == [False] * 4 + [True] * 2
    assert run(deepseek, [b"</think>\n\n", b"{"]) == [False, True]
    assert run(deepseek, [b"<", b"/thin", b"k", b"!>", b"{"]) == [False] * 5  # no marker yet
    qwen3 = _Phase(may_open=True, start=b"<think>", marker=b"</think>")
    assert run(qwen3, [b"{", b"}"]) == [True, True]  # no <think> token first: all answer
    assert run(qwen3, [b"<think>", b"hm", b"</think>", b"{"]) == [False, False, False, True]
    assert run(qwen3, [b"<think>hm</think>", b"{"]) == [False, True]
    assert run(qwen3, [b"<", b"think"]) == [True, True]  # "<" is not the <think> token: grammar's


def test_a_prompt_that_ends_the_reasoning_starts_constrained(backend_llm) -> None:
    """Thinking switched off by the template (the prompt ends with </think>)."""
    prompt = _few_shot_thinking(backend_llm) + backend_llm.tokenizer.encode("<think>Is 9 even?</think>",
                                                                      add_special_tokens=False)
    output = backend_llm.generate([prompt], _after_reasoning())[0].outputs[0]
    assert json.loads(output.text)["parity"] in ("odd", "even") and output.finish_reason == "stop"
