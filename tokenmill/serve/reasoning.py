"""Reasoning parsers: `<think>...</think>` split from the answer into `reasoning_content`.

- `deepseek_r1`: the chat template usually opens `<think>` itself, so the output may start
  inside it: everything before `</think>` is reasoning (all of it while `</think>` has not
  come), the rest is the answer;
- `qwen3`: reasoning only when the output opens with `<think>`; otherwise all of it is
  the answer (thinking switched off).

Streamed and whole outputs split the same way: the stream holds back a trailing partial
tag until the next delta tells what it is, so the deltas add up to the whole split.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass
class ReasoningParser:
    name: str
    implicit_start: bool  # deepseek_r1: the output may begin inside <think>

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            body = stripped[len(START):]
        elif self.implicit_start:
            body = text
        else:
            return "", text
        if END in body:
            reasoning, content = body.split(END, 1)
            return reasoning, content.lstrip("\n")
        return body, ""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self.split(text)
        return reasoning or None, content or None


PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
           "qwen3": ReasoningParser("qwen3", implicit_start=False)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(PARSERS)}") from None


class ReasoningStream:
    """Text deltas -> ("reasoning_content" | "content", text) pieces."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, str]]:
        self.text += delta
        visible = self.text if final else self.text[: len(self.text) - _partial_tag(self.text)]
        reasoning, content = self.parser.split(visible)
        out = []
        if len(reasoning) > self.sent_reasoning:
            out.append(("reasoning_content", reasoning[self.sent_reasoning:]))
            self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            out.append(("content", content[self.sent_content:]))
            self.sent_content = len(content)
        return out


def _partial_tag(text: str) -> int:
    """Trailing characters that could be the start of a tag (or the newlines a tag's end
    may swallow)."""
    for tag in (END, START):
        for size in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-size:]):
                return size
    return len(text) - len(text.rstrip("\n"))
