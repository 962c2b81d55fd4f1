"""Llama 3.x JSON format: the reply is `{"name": ..., "parameters": {...}}`, several
separated by `;`, optionally after `<|python_tag|>`."""

from __future__ import annotations

import json

from tokenmill.serve.tool_parsers.base import ToolCall, ToolParser, arguments_text

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def may_start_later(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or PYTHON_TAG.startswith(stripped) else 0

    def parse_calls(self, section: str, final: bool) -> tuple[list[ToolCall], bool]:
        text = section.strip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].lstrip()
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(text):
            try:
                value, end = decoder.raw_decode(text, position)
            except json.JSONDecodeError:
                return calls, not final  # incomplete so far; at the end, not calls
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return calls, False
            calls.append(ToolCall(value["name"], arguments_text(value.get("parameters", value.get("arguments")))))
            position = end
            while position < len(text) and text[position] in " \t\r\n;":
                position += 1
        return calls, True
