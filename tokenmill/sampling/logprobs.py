"""Logprobs of one position as the sampler computes them (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """The logprob of one chosen token (sampled, or the actual next prompt token)
    and the top-N alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id in the distribution
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
