"""The engine's per-position logprobs in OpenAI's two shapes.

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.outputs import Logprob, PositionLogprobs

# JSON has no -inf; vLLM sends this instead for impossible tokens.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    """The top `num_top` entries, by rank."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num_top]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


@dataclass
class CompletionLogprobs:
    """Accumulates OpenAI completions logprobs; `text_offset` continues across calls
    (so a stream's chunks carry offsets into the whole choice text)."""

    num_top: int
    next_offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None],
            token_text: Any) -> None:
        """`positions[i]` holds token_ids[i]'s logprobs; None for a prompt's first token,
        which nothing predicts (its text comes from `token_text(id)`)."""
        for token_id, position in zip(token_ids, positions):
            if position is None or token_id not in position:
                text = token_text(token_id)
                self._append(text, None, None)
                continue
            chosen = position[token_id]
            text = chosen.decoded_token if chosen.decoded_token is not None else token_text(token_id)
            top = {(lp.decoded_token or ""): _finite(lp.logprob) for _, lp in _top(position, self.num_top)}
            top.setdefault(text, _finite(chosen.logprob))  # the chosen token is always listed
            self._append(text, _finite(chosen.logprob), top)

    def _append(self, text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.next_offset)
        self.next_offset += len(text)

    def take(self) -> dict[str, Any]:
        """The entries added since the last take(), in OpenAI's shape."""
        body = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top: int,
                  token_text: Any) -> dict[str, Any]:
    return {"content": [_chat_entry(tid, pos, num_top, token_text) for tid, pos in zip(token_ids, positions)]}


def _chat_entry(token_id: int, position: PositionLogprobs, num_top: int, token_text: Any) -> dict[str, Any]:
    chosen = position.get(token_id)
    text = chosen.decoded_token if chosen and chosen.decoded_token is not None else token_text(token_id)
    return {
        **_chat_token(text, chosen.logprob if chosen else _MIN_LOGPROB),
        "top_logprobs": [
            _chat_token(lp.decoded_token if lp.decoded_token is not None else token_text(tid), lp.logprob)
            for tid, lp in _top(position, num_top)
        ],
    }


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
