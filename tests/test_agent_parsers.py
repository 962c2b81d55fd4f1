"""Tool-call and reasoning parsers on recorded model outputs, whole and streamed in
every split (a streamed reply must add up to the whole one)."""

from __future__ import annotations

import json

import pytest

from tokenmill.serve.reasoning import ReasoningStream, get_reasoning_parser
from tokenmill.serve.tool_parsers import ToolCallStream, get_tool_parser
from tokenmill.serve.tools import ConstrainedCallStream, ToolPlan

# Recorded from Qwen2.5-7B-Instruct and Hermes-3 (hermes), Llama-3.1-8B-Instruct (llama3_json).
HERMES_ONE = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
              '</tool_call>')
HERMES_TWO = ('I will check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>')
HERMES_NONE = "The weather in Paris is usually mild in spring; bring a light jacket."
HERMES_BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
LLAMA3_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA3_TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
              '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}')
LLAMA3_NONE = "Paris is the capital of France."
R1 = "Okay, the user asks 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**."
QWEN3 = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?"
QWEN3_NO_THINK = "Hello! How can I help?"


def _splits(text: str):
    """The text cut into pieces of several sizes (1 char, 3, 7, whole)."""
    for size in (1, 3, 7, len(text)):
        yield [text[i:i + size] for i in range(0, len(text), size)]


def _stream(stream, pieces):
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += stream.feed(piece, final=i == len(pieces) - 1)
    return deltas


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", HERMES_ONE, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", HERMES_TWO, "I will check both cities.", [("get_weather", {"city": "Paris"}),
                                                         ("get_weather", {"city": "Tokyo"})]),
    ("hermes", HERMES_NONE, HERMES_NONE, []),
    ("hermes", HERMES_BROKEN, HERMES_BROKEN, []),
    ("llama3_json", LLAMA3_ONE, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("llama3_json", LLAMA3_TWO, None, [("get_weather", {"city": "Paris"}),
                                       ("get_time", {"timezone": "Europe/Paris"})]),
    ("llama3_json", LLAMA3_NONE, LLAMA3_NONE, []),
])
def test_tool_parsers_whole_and_streamed(parser, text, content, calls) -> None:
    got_content, got_calls = get_tool_parser(parser).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for pieces in _splits(text):
        deltas = _stream(ToolCallStream(get_tool_parser(parser)), pieces)
        streamed_content = "".join(d.get("content", "") for d in deltas)
        streamed_calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in streamed_calls] == [(i, n, a) for i, (n, a) in enumerate(calls)]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in streamed_calls)
        assert streamed_content.strip() == (content or "").strip()


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("deepseek_r1", R1, "Okay, the user asks 2+2.\nThat is 4.\n", "The answer is **4**."),
    ("deepseek_r1", "<think>short</think>done", "short", "done"),
    ("qwen3", QWEN3, "\nThe user greets me. I should greet back.\n", "Hello! How can I help?"),
    ("qwen3", QWEN3_NO_THINK, None, QWEN3_NO_THINK),
    ("deepseek_r1", "still thinking about it", "still thinking about it", None),
])
def test_reasoning_parsers_whole_and_streamed(parser, text, reasoning, content) -> None:
    assert get_reasoning_parser(parser).extract(text) == (reasoning, content)
    for pieces in _splits(text):
        deltas = _stream(ReasoningStream(get_reasoning_parser(parser)), pieces)
        assert "".join(p for kind, p in deltas if kind == "reasoning_content") == (reasoning or "")
        assert "".join(p for kind, p in deltas if kind == "content") == (content or "")


def test_named_and_required_streams_send_openai_deltas() -> None:
    named = ConstrainedCallStream(ToolPlan("named", function="get_weather"))
    deltas = _stream(named, ['{"ci', 'ty": "Pa', 'ris"}'])
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"].startswith("call_")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])
    required = ConstrainedCallStream(ToolPlan("required"))
    text = '[{"name": "a", "parameters": {"x": "}"}}, {"name": "b", "parameters": {}}]'
    deltas = _stream(required, [text[i:i + 5] for i in range(0, len(text), 5)])
    assert [(d["tool_calls"][0]["index"], d["tool_calls"][0]["function"]["name"],
             json.loads(d["tool_calls"][0]["function"]["arguments"])) for d in deltas] == [(0, "a", {"x": "}"}),
                                                                                           (1, "b", {})]


def test_auto_tool_choice_needs_the_server_flags() -> None:
    from tokenmill.serve.errors import APIError
    from tokenmill.serve.tools import AgentSettings, ToolDef, plan_tools

    tools = [ToolDef.model_validate({"type": "function", "function": {"name": "f"}})]
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(tools, "auto", None, AgentSettings())
    assert plan_tools(tools, None, None, AgentSettings(True, "hermes")).mode == "auto"
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        AgentSettings(enable_auto_tool_choice=True)


def test_shipped_tool_template_renders_tools_calls_and_results() -> None:
    from tokenmill.model.loader import default_model_path
    from tokenmill.serve.tools import shipped_tool_template, template_handles_tools
    from tokenmill.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path())
    assert not template_handles_tools(tokenizer.chat_template)  # why the shipped one is needed
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=shipped_tool_template())
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
