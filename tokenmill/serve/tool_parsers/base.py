"""The parser interface and the streaming driver shared by every format."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """A model output format for tool calls."""

    def start(self, text: str) -> int | None:
        """Where the tool calls begin in `text` (None: not yet, as far as can be told)."""
        raise NotImplementedError

    def may_start_later(self, text: str) -> int:
        """How many trailing characters of `text` could begin a tool-call marker (held
        back from streamed content until the next delta tells)."""
        return 0

    def parse_calls(self, section: str, final: bool) -> tuple[list[ToolCall], bool]:
        """The complete calls at the start of `section` (the text from `start` on), and
        whether the section is well formed so far (False: give it back as content)."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Whole output -> (content or None, calls). Text that does not parse as calls
        stays content."""
        begin = self.start(text)
        if begin is None:
            return text, []
        calls, ok = self.parse_calls(text[begin:], final=True)
        if not ok or not calls:
            return text, []
        content = text[:begin].strip()
        return content or None, calls


def arguments_text(value: Any) -> str:
    """Arguments as JSON text (a model may write an object or an already-encoded string)."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except json.JSONDecodeError:
            return json.dumps(value)
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


class ToolCallStream:
    """Turns streamed text deltas into OpenAI chat deltas: `content` until a tool call
    starts, then `tool_calls` entries, one per call as it completes (its index, id, type,
    function name and arguments). A section that turns out not to be tool calls is
    released as content at the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_content = 0  # characters of `text` sent as content
        self.begin: int | None = None
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        self.text += delta
        out: list[dict[str, Any]] = []
        if self.begin is None:
            self.begin = self.parser.start(self.text)
            if self.begin is None:
                safe = len(self.text) if final else len(self.text) - self.parser.may_start_later(self.text)
                if safe > self.sent_content:
                    out.append({"content": self.text[self.sent_content:safe]})
                    self.sent_content = safe
                return out
            if self.begin > self.sent_content:  # content before the first call
                out.append({"content": self.text[self.sent_content:self.begin]})
                self.sent_content = self.begin
        calls, ok = self.parser.parse_calls(self.text[self.begin:], final)
        if not ok:
            if final and not self.calls:  # not tool calls after all
                out.append({"content": self.text[self.sent_content:]})
                self.sent_content = len(self.text)
            return out
        for index in range(len(self.calls), len(calls)):
            call = calls[index]
            self.calls.append(call)
            out.append({"tool_calls": [{"index": index, **call.to_openai()}]})
        return out
