"""Tool-call parsers: a model's raw text -> (content, tool calls), whole or streamed.

One parser per output format, chosen with `--tool-call-parser` (vLLM's names):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes,
  Qwen2.5, and tokenmill's shipped ChatML tool template);
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` (several joined
  by `;`), optionally after `<|python_tag|>`.
"""

from tokenmill.serve.tool_parsers.base import ToolCall, ToolCallStream, ToolParser
from tokenmill.serve.tool_parsers.hermes import HermesToolParser
from tokenmill.serve.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "get_tool_parser"]
