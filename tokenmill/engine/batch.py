"""The plain data exchanged once per step between the scheduler and the model runner.

The scheduler says, per request, which tokens to compute now and where their KV goes;
the runner answers with the sampled token ids (and logprobs when asked). No tensors
cross this boundary, so the scheduler can also drive a simulator with a cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling.params import SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens whose KV is computed in this step
    start_pos: int  # position of token_ids[0] (= tokens already computed)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # the chunk reaches the last known token, so sample the next one
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int] = field(default_factory=list)  # EOS/stop ids until min_tokens
    prompt_logprobs_targets: list[int] | None = None  # next-token targets when prompt logprobs wanted

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens whose KV the request holds after this step."""
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # runner may drop per-request state

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """The logprob of one chosen token (sampled, or the actual next prompt token)
    and the top-N alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id in the distribution
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens first_position, first_position + 1, ... computed in
    one step (the logits at position p score prompt token p + 1)."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
