"""Incremental detokenization of one sample's output, with stop-string matching.

Torch-free, like the rest of the engine package.

Decoding follows vLLM's prefix/read offsets: each step decodes only a small window of
recent token ids, twice -- once without the new tokens (`prefix_offset:read_offset`) and once
with them (`prefix_offset:`) -- and the new text is the difference. Decoding a window rather
than a single token keeps what a token means in context: sentencepiece's "▁" turns into a
leading space only when something precedes it, which is why the window starts inside the
prompt for the first output tokens. A window whose text ends in U+FFFD ends mid-character;
its tokens are held (the offsets do not move) until a later token completes the character.
"""

from __future__ import annotations

from tokenmill.engine.stop_strings import StopStringMatcher
from tokenmill.sampling.params import SamplingParams
from tokenmill.tokenizer import Tokenizer

# How many prompt tokens give the first output tokens their context (as vLLM).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text, and watches for stop strings.

    `append()` consumes new token ids and reports a matched stop string; `output_text()`
    gives the text that is safe to show so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._include_stop = params.include_stop_str_in_output
        self._stops = StopStringMatcher(params.stop_strings) if params.stop_strings else None

        # Only the prompt's tail is kept: that is all the decoding window ever reaches back to.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._token_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

        self._text = ""
        self._stop_string: str | None = None
        self.num_tokens = 0  # output tokens taken in; at a stop string, those up to the one completing it

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_string

    def append(self, token_ids: list[int]) -> str | None:
        """Consume newly generated token ids; returns the stop string they completed, if any.

        On a match the text is cut at the stop string (kept when `include_stop_str_in_output`)
        and every later append is ignored.
        """
        if self._stop_string is not None:
            return None
        # One token at a time, so that a batch ending mid-character still releases the text
        # before that character.
        for token_id in token_ids:
            self._token_ids.append(token_id)
            self.num_tokens += 1
            new_text = self._decode_new_text()
            if new_text and (stop := self._add_text(new_text)) is not None:
                return stop
        return None

    def output_text(self, finished: bool) -> str:
        """The text safe to show now.

        While unfinished, a suffix that could be the start of a stop string is held back (so
        a stream never shows part of a stop string that later matches), as are tokens that end
        mid-character. Once finished, the whole text: held tokens are flushed, an incomplete
        character coming out as U+FFFD, just as `Tokenizer.decode` writes it.
        """
        if self._stop_string is not None:
            return self._text
        if finished:
            self._flush()
            return self._text
        return self._text[: len(self._text) - self._partial_stop_length()]

    # ----- internals ---------------------------------------------------------------------

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self) -> str:
        """Text the tokens after `read_offset` add, or "" while they end mid-character."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return full_text[len(prefix_text):]

    def _flush(self) -> None:
        """Take in held tokens as they decode now, incomplete characters included."""
        if self._read_offset == len(self._token_ids):
            return
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        if len(full_text) > len(prefix_text):
            self._add_text(full_text[len(prefix_text):])

    def _add_text(self, new_text: str) -> str | None:
        """Append text; on a stop string ending in it (the earliest-starting one when
        several do), cut the text there and return the stop string."""
        self._text += new_text
        if self._stops is None:
            return None
        match = self._stops.feed(new_text)
        if match is None:
            return None
        self._text = self._text[: match.start + len(match.stop) if self._include_stop else match.start]
        self._stop_string = match.stop
        return match.stop

    def _partial_stop_length(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return 0 if self._stops is None else self._stops.held_length
