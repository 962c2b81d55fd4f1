"""Sampling parameters of one request, named and defaulted as vLLM's are.

This is the one declaration of a request's parameters and their defaults (OpenAI's
and vLLM's: temperature 1.0, top_p 1.0, max_tokens 16 as vLLM's offline API and
OpenAI's completions). The server's request fields map onto these fields (a field
the client leaves out takes the default declared here) and the CLI's sampling flags
are generated from them, help text included (`sampling_fields()`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling.structured_outputs import StructuredOutputsParams


def _param(default: Any, help: str, flag: str | None = None) -> Any:
    """A field with its help text (and a CLI flag spelling where the generated one would
    clash with an engine flag)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class SamplingParams:
    """What to sample and when to stop. `validate()` names the first bad field.

    Disabled values follow vLLM: `top_k` 0 or -1, `top_p` 1.0, `min_p` 0.0,
    penalties 0.0 (presence, frequency) and 1.0 (repetition).
    """

    n: int = _param(1, "samples to generate for the prompt")
    temperature: float = _param(1.0, "softmax temperature; 0 samples greedily")
    top_p: float = _param(1.0, "nucleus sampling: keep the smallest set of tokens whose probability reaches "
                               "top_p (1 = off)")
    top_k: int = _param(0, "keep the k most likely tokens (0 or -1 = off)")
    min_p: float = _param(0.0, "drop tokens less likely than min_p times the most likely one (0 = off)")
    presence_penalty: float = _param(0.0, "subtracted from the logits of tokens already generated, in [-2, 2]")
    frequency_penalty: float = _param(0.0, "subtracted per occurrence of a generated token, in [-2, 2]")
    repetition_penalty: float = _param(1.0, "divides the positive logits (multiplies the negative) of tokens "
                                            "in the prompt or output (1 = off)")
    # --seed is the engine's (the shared generator's); this one is the request's.
    seed: int | None = _param(None, "seed of this request's sampling (default: the engine's shared generator)",
                              flag="--sampling-seed")
    stop: list[str] | str | None = _param(None, "stop string; the output ends before it")
    stop_token_ids: list[int] | None = _param(None, "token id that ends the output (kept in it)")
    ignore_eos: bool = _param(False, "keep generating past the end-of-sequence token")
    max_tokens: int | None = _param(16, "most tokens to generate (None: up to the end of the context)")
    min_tokens: int = _param(0, "tokens to generate before EOS or a stop token id may end the output")
    logprobs: int | None = _param(None, "log probabilities of the top N tokens at each output position")
    prompt_logprobs: int | None = _param(None, "log probabilities of the top N tokens at each prompt position")
    logit_bias: dict[int, float] | None = _param(None, "token id -> bias added to its logit, in [-100, 100]")
    skip_special_tokens: bool = _param(True, "leave special tokens out of the output text")
    include_stop_str_in_output: bool = _param(False, "keep the stop string that ended the output in its text")
    # The output must match a JSON schema, regex, choice or grammar (vLLM's field). Not a
    # plain value: the server reads it from its own fields (serve/structured.py) and the
    # CLI has none, so sampling_fields() leaves it out.
    structured_outputs: StructuredOutputsParams | None = field(
        default=None, metadata={"help": "constraint on the output", "flag": None, "generated": False})

    # Derived in __post_init__: the stop strings as a list, never None.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the allowed range."""
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be >= 0, got {self.min_tokens}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= 20),
                   f"{name} must be between 0 and 20, got {value}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings),
               "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(isinstance(token_id, int) and token_id >= 0,
                   f"logit_bias keys must be token ids (non-negative integers), got {token_id!r}")
            _check(-100.0 <= bias <= 100.0, f"logit_bias values must be in [-100, 100], got {bias}")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a StructuredOutputsParams")
        _check(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64),
            f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}",
        )


def sampling_fields() -> Iterator[dataclasses.Field]:
    """The declared fields of SamplingParams (each with `metadata["help"]`)."""
    return (f for f in dataclasses.fields(SamplingParams) if f.init and f.metadata.get("generated", True))


def default(name: str) -> Any:
    """The declared default of one field, e.g. default("max_tokens") == 16."""
    return SamplingParams.__dataclass_fields__[name].default


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
