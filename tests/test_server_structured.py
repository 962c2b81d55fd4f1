"""Structured output through `tokenmill serve` with the official openai client:
response_format (json_schema, json_object), the pydantic `parse` helper, vLLM's
structured_outputs and guided_* fields, streaming, and bad constraints as 400s."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.structured_schemas import SCHEMAS

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: float = Field(ge=0, le=50)
    climate: Literal["hot", "mild", "cold"]


def _ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(server, client) -> None:
    completion = client.beta.chat.completions.parse(
        model=server.model, messages=_ask("Describe Paris as JSON."), response_format=City, temperature=0,
        max_tokens=200)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City), message.content
    assert message.parsed.climate in ("hot", "mild", "cold")


@pytest.mark.parametrize("name", ["order", "array_of_objects", "anyof_objects", "date_format", "ref_defs",
                                  "enum_in_object"])
def test_json_schema_response_format_streamed_and_not(server, client, name) -> None:
    schema = SCHEMAS[name]
    kwargs = dict(model=server.model, messages=_ask(f"Reply with JSON matching: {json.dumps(schema)}"),
                  temperature=0, max_tokens=256,
                  response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                           "strict": True}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), schema, format_checker=FORMATS)
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.message.content and finish == "stop"


def test_every_schema_validates_streamed(server, client) -> None:
    """The whole suite (>= 30 schemas) through the server, streamed, sent together so the
    engine batches them: every answer parses and validates."""
    from concurrent.futures import ThreadPoolExecutor

    def streamed(name: str) -> tuple[str, str, str | None]:
        schema = SCHEMAS[name]
        pieces, finish = [], None
        for chunk in client.chat.completions.create(
                model=server.model, messages=_ask(f"Reply with JSON matching: {json.dumps(schema)}"), temperature=0,
                max_tokens=256, stream=True,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}}):
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return name, "".join(pieces), finish

    assert len(SCHEMAS) >= 30
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(streamed, SCHEMAS))
    for name, text, finish in results:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=FORMATS)


def test_json_object_and_vllm_fields(server, client) -> None:
    prompt = _ask("Give a product code and a yes/no answer.")
    as_object = client.chat.completions.create(model=server.model, messages=_ask('Return {"ok": true} as JSON.'),
                                               temperature=0, max_tokens=100,
                                               response_format={"type": "json_object"})
    assert isinstance(json.loads(as_object.choices[0].message.content), dict)
    cases = [
        ({"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}}, lambda t: len(t) == 6 and t[2] == "-"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"json": SCHEMAS["flat_person"], "disable_any_whitespace": True,
                                 "json_object": False}},
         lambda t: t == json.dumps(json.loads(t))),  # xgrammar's (and vLLM's) fixed ", " and ": " only
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_regex": r"\d{4}"}, lambda t: len(t) == 4 and t.isdigit()),
        ({"guided_json": SCHEMAS["flat_person"]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["flat_person"])
         is None),
        ({"guided_grammar": 'root ::= "up" | "down"'}, lambda t: t in ("up", "down")),
    ]
    for extra, check in cases:
        text = client.chat.completions.create(model=server.model, messages=prompt, temperature=0, max_tokens=100,
                                              extra_body=extra).choices[0].message.content
        assert check(text), (extra, text)
    # /v1/completions takes the same fields.
    completion = client.completions.create(model=server.model, prompt="The answer is", max_tokens=10,
                                           temperature=0, extra_body={"guided_choice": ["alpha", "beta"]})
    assert completion.choices[0].text in ("alpha", "beta")


def test_structured_outputs_request_object_is_built_from_the_dataclass() -> None:
    """A field added to StructuredOutputsParams is a request field with no other edit."""
    import dataclasses

    from tokenmill.sampling.structured_outputs import StructuredOutputsParams
    from tokenmill.serve.structured import StructuredOutputsField, _request_model_of

    names = {f.alias or name for name, f in StructuredOutputsField.model_fields.items()}
    assert names == {f.name for f in dataclasses.fields(StructuredOutputsParams) if not f.metadata.get("internal")}
    assert "reasoning_end" not in names  # set by the server, never by a client

    @dataclasses.dataclass(frozen=True)
    class WithPattern(StructuredOutputsParams):
        whitespace_pattern: str | None = None

    model = _request_model_of(WithPattern)
    body = model.model_validate({"json": {"type": "object"}, "whitespace_pattern": " ?", "unknown": 1})
    values = body.model_dump(by_alias=True, exclude_unset=True)
    assert values == {"json": {"type": "object"}, "whitespace_pattern": " ?"}
    assert WithPattern(**values).kind == "json"


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "invalid JSON schema"),
    ({"guided_regex": "(unclosed"}, "invalid regex"),
    ({"guided_grammar": "root ::= missing"}, "invalid grammar"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "at most one output constraint"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "exactly one of json, regex"),
    ({"structured_outputs": {"regex": 5}}, "valid string"),
    ({"structured_outputs": {"json": {"type": "objekt"}}}, "invalid JSON schema"),
    # 0.0 is not a boolean: was accepted (schemathesis through the DP router, a schema-violating body)
    ({"response_format": {"type": "text", "json_schema": {"strict": 0.0}}}, "valid boolean"),
])
def test_bad_constraints_are_400s_naming_the_field(server, client, extra, message) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=server.model, messages=_ask("hi"), max_tokens=5, extra_body=extra)
    assert message in raised.value.message
    assert raised.value.body["param"] in ("response_format", "guided_regex", "guided_grammar", "guided_choice",
                                          "structured_outputs", "structured_outputs.regex",
                                          "response_format.json_schema.strict")
    # The server is unharmed and nothing leaked.
    ok = client.chat.completions.create(model=server.model, messages=_ask("hi"), max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    metrics = server.wait_idle()
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0
