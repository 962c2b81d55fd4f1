"""Sampling parameters of one request, named and defaulted as vLLM's are."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """What to sample and when to stop. `validate()` names the first bad field.

    Disabled values follow vLLM: `top_k` 0 or -1, `top_p` 1.0, `min_p` 0.0,
    penalties 0.0 (presence, frequency) and 1.0 (repetition).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

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
        _check(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64),
            f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}",
        )

    def validate_token_ids(self, vocab_size: int) -> None:
        """Checks that need the model's vocabulary size."""
        for token_id in [*self.stop_token_ids, *(self.logit_bias or {})]:
            _check(token_id < vocab_size,
                   f"token id {token_id} is out of the vocabulary (size {vocab_size})")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
