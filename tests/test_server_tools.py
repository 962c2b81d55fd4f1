"""Tool calling and reasoning through `tokenmill serve` with the official openai client:
the tool-calling loop (required and named choices, constrained so every call is valid
JSON for its function), streamed tool-call deltas, auto choice with the hermes parser,
tool results rendered back into the prompt, reasoning_content, and bad tool requests."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.server_utils import ServerProcess

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                            "--reasoning-parser", "qwen3").start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _question() -> list[dict]:
    return [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calling_loop(server, client, choice) -> None:
    messages = _question()
    first = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=200)
    message = first.choices[0].message
    assert message.tool_calls, message
    for call in message.tool_calls:
        _check_call(call)
    assert first.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    if choice != "required":
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    # The client sends the assistant's calls and the tool's result back.
    messages.append(message)
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"temperature": 21, "sky": "sunny"})})
    final = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=40)
    answer = final.choices[0].message
    assert answer.tool_calls is None and isinstance(answer.content, str) and answer.content
    # The call and its result were rendered into the prompt (20+ tokens more than the question).
    alone = client.chat.completions.create(model=server.model, messages=_question(), tools=TOOLS, tool_choice="none",
                                           max_tokens=1)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_required_and_named_calls_are_valid_for_every_object_schema(server, client) -> None:
    """The suite's object schemas (19) as function parameters, each as a `required` and a
    named call, sent together: 100% of the calls parse and validate (the issue's target),
    and a named call names its function."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.structured_schemas import SCHEMAS as SUITE

    # email_format is left out: an email has no length bound, and under the `required`
    # wrapper the default model's address runs on to max_tokens (cut, so not a call: the
    # limit docs/agent-apis.md names; the offline suite covers the schema itself).
    objects = {f"fn_{name}": schema for name, schema in SUITE.items()
               if schema.get("type") == "object" and name != "email_format"}
    assert len(objects) >= 19

    def call(job: tuple[str, bool]) -> tuple[str, bool, list, str]:
        name, named = job
        tool = {"type": "function", "function": {"name": name, "parameters": objects[name]}}
        choice = {"type": "function", "function": {"name": name}} if named else "required"
        response = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": f"Call {name} with arguments matching "
                                                                        f"{json.dumps(objects[name])}."}],
            tools=[tool], tool_choice=choice, parallel_tool_calls=False, temperature=0, max_tokens=400)
        return name, named, response.choices[0].message.tool_calls or [], response.choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, [(name, named) for name in objects for named in (False, True)]))
    cut = [(name, named) for name, named, calls, finish in results
           if finish != ("stop" if named else "tool_calls") or len(calls) != 1]
    assert not cut, cut
    for name, named, calls, finish in results:
        assert calls[0].function.name == name
        jsonschema.validate(json.loads(calls[0].function.arguments), objects[name],
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_parallel_tool_calls_false_makes_one_call(server, client) -> None:
    response = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Weather and time in Paris and Tokyo?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200)
    calls = response.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_call(calls[0])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas(server, client, choice) -> None:
    kwargs = dict(model=server.model, messages=_question(), tools=TOOLS, tool_choice=choice, temperature=0,
                  max_tokens=200)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice_delta in chunk.choices:
            finish = choice_delta.finish_reason or finish
            assert not choice_delta.delta.content
            for delta in choice_delta.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert entry["id"] is None  # the id and name come once, first
                    entry["id"], entry["name"] = delta.id, delta.function.name
                entry["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason
    assert sorted(calls) == list(range(len(whole.message.tool_calls)))
    for index, call in enumerate(whole.message.tool_calls):
        assert calls[index]["name"] == call.function.name
        assert json.loads(calls[index]["arguments"]) == json.loads(call.function.arguments)
        assert calls[index]["id"].startswith("call_")


def test_auto_choice_parses_hermes_calls(server, client) -> None:
    # The 135M model rarely decides to call a tool by itself: a grammar makes it write one
    # in the Hermes format, and the auto path must find it (streamed and not).
    grammar = ('root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" '
               'city "\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>"\ncity ::= [A-Z] [a-z]{2,8}')
    kwargs = dict(model=server.model, messages=_question(), tools=TOOLS, temperature=0, max_tokens=80,
                  extra_body={"guided_grammar": grammar})
    response = client.chat.completions.create(**kwargs)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content is None and [c.function.name for c in message.tool_calls] == ["get_weather"]
    _check_call(message.tool_calls[0])
    streamed = [d for chunk in client.chat.completions.create(stream=True, **kwargs)
                for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert len(streamed) == 1 and json.loads(streamed[0].function.arguments) == json.loads(
        message.tool_calls[0].function.arguments)
    # Without a call in the text, auto answers with content.
    plain = client.chat.completions.create(model=server.model, messages=_question(), tools=TOOLS,
                                           tool_choice="auto", temperature=0, max_tokens=20)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_reasoning_content_split(server, client) -> None:
    grammar = 'root ::= "<think>" [a-z ]{5,40} "</think>" "Answer: " [0-9]{1,3}'
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "What is 2+2?"}], temperature=0,
                  max_tokens=60, extra_body={"guided_grammar": grammar})
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and message.content.startswith("Answer: ")
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            pieces["content"] += choice.delta.content or ""
            pieces["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert pieces == {"reasoning_content": reasoning, "content": message.content}


@pytest.mark.parametrize("kwargs, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "absent"}}}, "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": WEATHER}}],
      "tool_choice": "required"}, "not a valid name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "invalid JSON schema"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tool_requests_are_400s(server, client, kwargs, message) -> None:
    kwargs = {"tools": TOOLS, **kwargs}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=server.model, messages=_question(), max_tokens=5, **kwargs)
    assert message in raised.value.message
    assert server.wait_idle()["tokenmill:kv_cache_usage_perc"] == 0
