"""What the engine returns to users, shaped as vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# One dict per generated (or prompt) position: token id -> Logprob. The sampled
# (or actual prompt) token is always present, plus the top-N alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    # A pooling request's vector (the pooling runner: an embedding); its `outputs` hold
    # one empty completion that finished with "stop".
    pooled: list[float] | None = None
    # Prefill-decode disaggregation: a prefill instance's kv_transfer_params for the decode
    # instance (vLLM's NIXL connector's keys), once the request finished.
    kv_transfer_params: dict | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, as vLLM's: `output.outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @classmethod
    def from_base(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        if output.pooled is None:
            raise ValueError(f"request {output.request_id} has no pooled output (was it run by the pooling runner?)")
        return cls(output.request_id, EmbeddingOutput(output.pooled), output.prompt_token_ids, output.finished,
                   output.num_cached_tokens)
