"""/v1/responses through `tokenmill serve` with the official openai client: plain text,
instructions and input items, streamed events, previous_response_id, text.format json
schema, function tools, retrieve / delete, and unknown ids as 404s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"], "additionalProperties": False}}


def test_plain_response_retrieve_and_delete(server, client) -> None:
    response = client.responses.create(model=server.model, input="Say hello.", instructions="Be brief.",
                                       max_output_tokens=16, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    again = client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_streamed_events_add_up_to_the_response(server, client) -> None:
    kwargs = dict(model=server.model, input=[{"role": "user", "content": "Name three colors."}],
                  max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kwargs)
    kinds, text, completed = [], "", None
    for event in client.responses.create(stream=True, **kwargs):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kind in kinds, kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert text == whole.output_text == completed.output_text


def test_previous_response_id_continues_the_conversation(server, client) -> None:
    first = client.responses.create(model=server.model, input="My name is Ada. Remember it.",
                                    max_output_tokens=10, temperature=0)
    second = client.responses.create(model=server.model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
    assert second.previous_response_id == first.id
    # The earlier turn (question and answer) is in the second prompt.
    alone = client.responses.create(model=server.model, input="What is my name?", max_output_tokens=1,
                                    temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=server.model, input="hi", previous_response_id="resp_unknown",
                                max_output_tokens=4)
    unstored = client.responses.create(model=server.model, input="hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema(server, client) -> None:
    for stream in (False, True):
        kwargs = dict(model=server.model, input="Describe a person as JSON.", max_output_tokens=100, temperature=0,
                      text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
        if stream:
            events = list(client.responses.create(stream=True, **kwargs))
            text = events[-1].response.output_text
        else:
            text = client.responses.create(**kwargs).output_text
        jsonschema.validate(json.loads(text), PERSON)


def test_function_tools_and_their_output_items(server, client) -> None:
    response = client.responses.create(model=server.model, input="Weather in Paris?", tools=[WEATHER_TOOL],
                                       tool_choice="required", parallel_tool_calls=False, max_output_tokens=100,
                                       temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_TOOL["parameters"])
    # The tool's result goes back as a function_call_output item.
    follow = client.responses.create(
        model=server.model, previous_response_id=response.id, max_output_tokens=20, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}])
    assert follow.output_text
    streamed = list(client.responses.create(stream=True, model=server.model, input="Weather in Rome?",
                                            tools=[WEATHER_TOOL], tool_choice={"type": "function",
                                                                               "name": "get_weather"},
                                            max_output_tokens=100, temperature=0))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"][0]
    jsonschema.validate(json.loads(done.arguments), WEATHER_TOOL["parameters"])


def test_bad_requests(server, client) -> None:
    # validated strictly, as the other bodies (`store: 0.0` was taken for false; the long fuzz)
    for field, value in (("store", 0.0), ("stream", 1), ("max_output_tokens", 2.0), ("temperature", "0")):
        response = server.post("/v1/responses", json={"input": "hi", field: value})
        assert response.status_code == 400 and field in response.text, response.text
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=server.model, input="hi", background=True)
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.responses.create(model=server.model, input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "objekt"}}})
