"""What a request's output must match: vLLM's `StructuredOutputsParams`.

Plain data (no torch, no grammar library): it travels in `SamplingParams` from the API
to the model runner, where `tokenmill.structured_output` compiles it into a grammar and
masks the logits with it. Exactly one constraint is set per request.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's names):

    - `json`: a JSON schema (a dict or its JSON text): the output is a JSON value that
      validates against it;
    - `regex`: the output matches this regular expression;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: an EBNF / GBNF grammar (rule `root` is the start);
    - `json_object`: any JSON object;
    - `structural_tag`: an xgrammar structural tag (JSON text).

    `disable_any_whitespace` makes JSON output compact (no whitespace between tokens);
    by default up to a few spaces or newlines may go between JSON tokens.

    `reasoning_end` (not a request field: the server sets it when a reasoning parser is
    on, as vLLM's engine does): the constraint applies only after this marker (`</think>`)
    has been generated, or when the prompt already ends with it; the reasoning before it
    is unconstrained. With `reasoning_start` (`<think>`) as well, there is reasoning only
    if the output opens with it (Qwen3's parser); otherwise the first token is the
    grammar's.

    The server's `structured_outputs` request object is built from these fields
    (serve/structured.py): a field added here is a request field too, unless its
    metadata says `internal`.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    reasoning_end: str | None = field(default=None, metadata={"internal": True})
    reasoning_start: str | None = field(default=None, metadata={"internal": True})

    def __post_init__(self) -> None:
        if self.json_object is False:  # clients send `false` for "not this kind"
            object.__setattr__(self, "json_object", None)
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(CONSTRAINT_KINDS)}; got {', '.join(kinds) or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        for name in ("reasoning_end", "reasoning_start"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise ValueError("structured_outputs.reasoning_start needs reasoning_end")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true or false")

    def kinds(self) -> list[str]:
        return [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, canonical text, compact JSON)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            text = _json.dumps(value)  # property order kept: the grammar emits properties in it
        elif kind == "choice":
            text = _json.dumps(value)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, self.disable_any_whitespace
