"""Agent workloads for `tokenmill bench serve`: structured output and tool calling.

- `structured`: chat (or completion) requests whose answer must match a JSON schema
  (`response_format` json_schema, strict), over a ladder of schemas of increasing size,
  from one integer field to a 16-field record with nested objects, arrays, enums and
  length-bounded strings. Requests cycle through the ladder, each schema under its own
  name so a run measures compiled (cached) grammars after the first round; the answers
  end when the grammar does.
- `tool-calls`: a multi-turn agent trace replayed turn by turn: a user asks, the model
  must call a tool (`tool_choice` required or named), the tool's result comes back
  (`role: tool`) and the model answers, then a follow-up question needs another call.
  The conversations are fixed text, so a given tokenizer sees fixed token ids.

Both carry their request fields in `SampleRequest.extra` (merged into the request body).
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

# ----- structured output -------------------------------------------------------------------

_NAME = {"type": "string", "minLength": 1, "maxLength": 16}


def schema_ladder() -> list[tuple[str, dict[str, Any]]]:
    """(name, JSON schema) from small to large."""
    address = {"type": "object", "properties": {"street": _NAME, "city": _NAME, "zip": {"type": "string",
                                                                                       "pattern": "^[0-9]{5}$"}},
               "required": ["street", "city", "zip"], "additionalProperties": False}
    person = {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                                      "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    ladder: list[tuple[str, dict[str, Any]]] = [
        ("one_integer", {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"],
                         "additionalProperties": False}),
        ("person", person),
        ("person_with_address", {"type": "object", "properties": {**person["properties"], "address": address},
                                 "required": ["name", "age", "address"], "additionalProperties": False}),
        ("order", {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {"sku": _NAME, "quantity": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9}},
                "required": ["sku", "quantity"], "additionalProperties": False}},
            "express": {"type": "boolean"}},
            "required": ["id", "status", "items", "express"], "additionalProperties": False}),
    ]
    record = {f"field_{i}": ({"type": "integer", "minimum": 0, "maximum": 999} if i % 3 == 0 else
                             {"enum": ["low", "medium", "high"]} if i % 3 == 1 else {"type": "boolean"})
              for i in range(12)}
    record.update({"owner": person, "address": address, "tags": {"type": "array", "items": _NAME, "maxItems": 3},
                   "note": {"anyOf": [_NAME, {"type": "null"}]}})
    ladder.append(("record_16_fields", {"type": "object", "properties": record, "required": list(record),
                                        "additionalProperties": False}))
    return ladder


def structured_messages(name: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Make up a plausible example {name.replace('_', ' ')} and reply with "
                                        f"JSON only, matching this schema: {json.dumps(schema)}"}]


def structured_requests(count: int, rng: random.Random) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(messages, extra request fields) for `count` requests, cycling the ladder from a
    random starting rung."""
    ladder = schema_ladder()
    first = rng.randrange(len(ladder))
    out = []
    for i in range(count):
        name, schema = ladder[(first + i) % len(ladder)]
        extra = {"response_format": {"type": "json_schema",
                                     "json_schema": {"name": name, "schema": schema, "strict": True}}}
        out.append((structured_messages(name, schema), extra))
    return out


# ----- tool calling ----------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current local time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                       "required": ["timezone"], "additionalProperties": False}}},
]

_CITIES = [("Paris", "Europe/Paris", 18), ("Tokyo", "Asia/Tokyo", 24), ("Lima", "America/Lima", 16),
           ("Oslo", "Europe/Oslo", 4), ("Nairobi", "Africa/Nairobi", 22), ("Denver", "America/Denver", 9)]


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def agent_trace(city: str, timezone: str, temperature: int) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """One conversation as its four turns: (messages so far, extra request fields)."""
    system = {"role": "system", "content": "You are a travel assistant. Use the tools to answer."}
    ask = {"role": "user", "content": f"What is the weather in {city} right now?"}
    weather = {"role": "assistant", "content": None,
               "tool_calls": [_call("call_w1", "get_weather", {"city": city, "unit": "celsius"})]}
    weather_result = {"role": "tool", "tool_call_id": "call_w1",
                      "content": json.dumps({"city": city, "temperature": temperature, "sky": "clear"})}
    answer = {"role": "assistant", "content": f"It is {temperature} degrees and clear in {city}."}
    follow_up = {"role": "user", "content": f"And what time is it there? {city} is in {timezone}."}
    time_call = {"role": "assistant", "content": None,
                 "tool_calls": [_call("call_t1", "get_time", {"timezone": timezone})]}
    time_result = {"role": "tool", "tool_call_id": "call_t1", "content": json.dumps({"time": "14:05"})}
    tools = {"tools": TOOLS}
    return [
        ([system, ask], {**tools, "tool_choice": "required"}),
        ([system, ask, weather, weather_result], {**tools, "tool_choice": "none"}),
        ([system, ask, weather, weather_result, answer, follow_up],
         {**tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
        ([system, ask, weather, weather_result, answer, follow_up, time_call, time_result],
         {**tools, "tool_choice": "auto"}),
    ]


def tool_call_requests(count: int, rng: random.Random) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """`count` turns of agent traces, whole conversations in order (turn 1 to 4 of one
    city, then the next), from a random first city."""
    first = rng.randrange(len(_CITIES))
    turns: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    k = 0
    while len(turns) < count:
        turns.extend(agent_trace(*_CITIES[(first + k) % len(_CITIES)]))
        k += 1
    return [copy.deepcopy(turn) for turn in turns[:count]]
