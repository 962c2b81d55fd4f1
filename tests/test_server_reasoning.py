"""Structured output after the reasoning, through `tokenmill serve --reasoning-parser
deepseek_r1` with the official openai client: the reasoning is free, the answer after
`</think>` is the schema's (as vLLM does), whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from tests.server_utils import ServerProcess

PARITY = {"type": "object", "properties": {"parity": {"enum": ["odd", "even"]}}, "required": ["parity"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "parity", "schema": PARITY, "strict": True}}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--reasoning-parser", "deepseek_r1").start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _thinking_conversation(question: str) -> list[dict]:
    """Earlier turns that answered with <think>...</think>: the default model (greedy)
    thinks the same way before its next answer."""
    turns = [("Is 7 even?", "<think>Is 7 even?</think>no"), ("Is 8 even?", "<think>Is 8 even?</think>yes")]
    messages = [m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    return [*messages, {"role": "user", "content": question}]


def test_schema_applies_after_the_reasoning(server, client) -> None:
    kwargs = dict(model=server.model, messages=_thinking_conversation("Is 9 even?"), temperature=0, max_tokens=60)
    free = client.chat.completions.create(**kwargs).choices[0].message
    # Unconstrained, the model thinks, then answers in words (not JSON).
    assert free.model_extra["reasoning_content"] == "Is 9 even?" and not free.content.startswith("{")
    choice = client.chat.completions.create(response_format=FORMAT, **kwargs).choices[0]
    # The reasoning is the model's own (the schema would have forbidden its first "<");
    # the answer after </think> is the schema's.
    assert choice.message.model_extra["reasoning_content"] == "Is 9 even?"
    jsonschema.validate(json.loads(choice.message.content), PARITY)
    assert choice.finish_reason == "stop"
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, response_format=FORMAT, **kwargs):
        for streamed in chunk.choices:
            pieces["content"] += streamed.delta.content or ""
            pieces["reasoning_content"] += (streamed.delta.model_extra or {}).get("reasoning_content") or ""
    assert pieces == {"reasoning_content": "Is 9 even?", "content": choice.message.content}


def test_other_constraint_fields_wait_for_the_reasoning_too(server, client) -> None:
    kwargs = dict(model=server.model, messages=_thinking_conversation("Is 11 even?"), temperature=0, max_tokens=60)
    for extra, answers in (({"guided_choice": ["odd", "even"]}, {"odd", "even"}),
                           ({"structured_outputs": {"regex": "(odd|even)!"}}, {"odd!", "even!"})):
        message = client.chat.completions.create(extra_body=extra, **kwargs).choices[0].message
        assert message.model_extra["reasoning_content"] == "Is 11 even?", message
        assert message.content in answers
    # The Responses API's text.format takes the same path.
    response = client.responses.create(model=server.model, input=_thinking_conversation("Is 13 even?"),
                                       temperature=0, max_output_tokens=60,
                                       text={"format": {"type": "json_schema", "name": "parity", "schema": PARITY}})
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], response.output
    jsonschema.validate(json.loads(response.output_text), PARITY)
