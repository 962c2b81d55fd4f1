"""Hermes / Qwen2.5 format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json
import re

from tokenmill.serve.tool_parsers.base import ToolCall, ToolParser, arguments_text

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    def start(self, text: str) -> int | None:
        index = text.find(START)
        return None if index < 0 else index

    def may_start_later(self, text: str) -> int:
        for size in range(min(len(START) - 1, len(text)), 0, -1):
            if START.startswith(text[-size:]):
                return size
        return 0

    def parse_calls(self, section: str, final: bool) -> tuple[list[ToolCall], bool]:
        calls = []
        position = 0
        for match in _BLOCK.finditer(section):
            if section[position:match.start()].strip():
                return calls, False  # text between calls: not a clean tool-call section
            call = _call(match.group(1))
            if call is None:
                return calls, False
            calls.append(call)
            position = match.end()
        rest = section[position:].strip()
        if final and rest:
            # An unclosed last call (max_tokens, or a model that omits the closing tag).
            body = rest[len(START):] if rest.startswith(START) else None
            call = _call(body.strip()) if body is not None else None
            if call is None:
                return calls, False
            calls.append(call)
        elif rest and not START.startswith(rest[: len(START)]):
            return calls, False
        return calls, True


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ToolCall(value["name"], arguments_text(value.get("arguments", value.get("parameters", {}))))
