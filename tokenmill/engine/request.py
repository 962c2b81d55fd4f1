"""A request's state as the scheduler sees it: token ids and how many are computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.params import SamplingParams

# SLO mode aims a little under the targets given: its step costs are predictions.
SLO_HEADROOM = 0.95


def slo_aim(ms: float | None) -> float | None:
    """The seconds SLO mode aims at for a target of `ms` milliseconds (None: no target)."""
    return None if ms is None else SLO_HEADROOM * ms / 1e3


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # a consumer pulls its prompt's KV (disaggregation)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class Request:
    """One sequence to generate. `num_computed_tokens` catches up with `num_tokens`
    step by step (prefill chunks, then one token per decode step)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0  # max_model_len: the sequence never grows past it
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    cache_salt: str | None = None  # isolates this request's prefix cache entries
    priority: int = 0  # under the priority policy: lower first (vLLM's meaning)
    # This request's latency targets in seconds, as SLO mode aims at them (the engine's
    # headroom applied); None: the engine's --slo-ttft-ms / --slo-tpot-ms, if any.
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None  # the scheduler's clock when its first output token was appended
    # SLO mode: (when, seconds to its first token) as forecast when it was first judged on
    # time; None once it was judged late (its wait is not a forecast's to learn from).
    ttft_forecast: tuple[float, float] | None = None
    ttft_judged: bool = False
    num_new_output_tokens: int = 0  # output tokens appended by the latest step
    # Tokens a proposer guessed to follow (speculative decoding); the next step verifies
    # them. Never part of the request's tokens until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # A pooling request (an embedding): prefilled once, never sampled; it finishes with
    # the pooled vector the runner returns for its last prompt chunk.
    pooling_params: PoolingParams | None = None
    pooled_output: list[float] | None = None
    # Prefill-decode disaggregation (engine/kv_transfer.py): the request's kv_transfer_params
    # (vLLM's), and those its response carries (a producer's, for the consumer).
    kv_transfer_params: dict | None = None
    kv_transfer_params_out: dict | None = None
    # Prompt logprobs need every prompt position computed, so such a request skips the
    # prefix cache (vLLM's rule). The perplexity eval's --cached-prefix mode sets this to
    # read it anyway: cached positions then get no logprobs (None), the rest are scored.
    prompt_logprobs_from_cache: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        return self.params.prompt_logprobs is None or self.prompt_logprobs_from_cache

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: max_tokens, capped by the room left in max_model_len."""
        room = self.max_total_tokens - self.num_prompt_tokens
        if self.params.max_tokens is None:
            return room
        return min(self.params.max_tokens, room)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (a stop string ended the
        text inside a run of several new tokens)."""
        dropped = self.num_output_tokens - num_output_tokens
        if dropped > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - dropped:]
            self.num_new_output_tokens = max(0, self.num_new_output_tokens - dropped)

    def check_stop_token(self) -> RequestStatus | None:
        """Stop conditions that need only token ids (stop strings are the detokenizer's)."""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def banned_token_ids(self) -> list[int]:
        """EOS and stop ids may not be sampled before min_tokens outputs."""
        if self.num_output_tokens >= self.params.min_tokens:
            return []
        eos = [] if self.params.ignore_eos else list(self.eos_token_ids)
        return eos + list(self.params.stop_token_ids)
