"""`PoolingParams`: what a pooling request (an embedding) asks for, as vLLM's.

Torch-free plain data, carried by the request from admission to the runner's pooler,
beside the `SamplingParams` a generating request carries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first N of the pooled vector (a Matryoshka model's; the
    server refuses it for other models), normalized after the cut. `normalize`: None
    follows the engine's pooler config. `truncate_prompt_tokens`: embed only the last k
    tokens of the prompt (left truncation; -1: the last max_model_len), as vLLM's."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < -1 or k == 0):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
