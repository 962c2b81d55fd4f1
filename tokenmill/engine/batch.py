"""The plain data exchanged once per step between the scheduler and the model runner.

The scheduler says, per request, which tokens to compute now and where their KV goes;
the runner answers with the tokens it sampled (several per request when it verified
proposed tokens) and logprobs when asked. No tensors cross this boundary, so the
scheduler can also drive a simulator with a cost model, and the step can be sent to
worker processes cheaply: a request's prompt and parameters travel once, when it is
first scheduled (`NewRequestData`), and afterwards only what changed — the tokens it
gained and the blocks added to its table. The runner side rebuilds each request's
whole view with a `RequestTable`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.logprobs import TokenLogprobs
from tokenmill.sampling.params import SamplingParams

__all__ = ["NewRequestData", "ScheduledRequest", "KVTransfers", "SchedulerOutput", "TokenLogprobs", "PromptLogprobsChunk",
           "RunnerOutput", "RequestState", "StepRequest", "RequestTable"]


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled, and again after a preemption."""

    prompt_token_ids: list[int]
    params: SamplingParams
    pooling_params: PoolingParams | None = None  # a pooling request: pool, never sample


@dataclass
class ScheduledRequest:
    request_id: str
    start_pos: int  # tokens already computed (the position of the first token computed now)
    num_new_tokens: int  # known tokens whose KV is computed now: positions start_pos ...
    appended_token_ids: list[int]  # tokens it gained since last sent (when new: those after the prompt)
    new_block_ids: list[int]  # blocks added to its table since last sent (the whole table when new)
    sample: bool  # the chunk reaches the last known token, so sample what follows it
    new: NewRequestData | None = None
    # Proposed tokens (speculative decoding) computed after the known ones and verified in
    # this step; their KV slots are allocated, and rolled back for the rejected ones.
    spec_token_ids: list[int] = field(default_factory=list)
    banned_token_ids: list[int] = field(default_factory=list)  # EOS/stop ids until min_tokens
    prompt_logprobs_targets: list[int] | None = None  # next-token targets when prompt logprobs wanted
    # A hybrid KV cache (sliding-window layers): the blocks added to the request's table in
    # the sliding pool, position-aligned with new_block_ids (NULL_BLOCK before the window).
    new_sliding_block_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step (known and proposed): what the token budget counts."""
        return self.num_new_tokens + len(self.spec_token_ids)

    @property
    def context_len(self) -> int:
        """Tokens whose KV the request holds after this step (proposed ones included)."""
        return self.start_pos + self.num_tokens


@dataclass
class KVTransfers:
    """The copies between the KV pool and the host tier a step needs before its forward
    (the scheduler side of a KV connector decided them; the runner side copies). Every
    `store` runs before every `load`: a pool block evicted in this step is saved before a
    load (or the step's own KV) overwrites it, and a block loaded in this step is read
    only by this step's forward, after the loads."""

    num_host_blocks: int  # the host tier's capacity in blocks (the runner sizes its buffer by it)
    store: list[tuple[int, int]] = field(default_factory=list)  # (pool block, host slot): demotions
    load: list[tuple[int, int]] = field(default_factory=list)  # (host slot, pool block): promotions
    # The disk tier: blocks the host tier dropped, to write first (before any store reuses
    # the slot or a load the pool block) to these files, from their host slot, or from their
    # pool block when their KV never reached the host tier (stored and dropped in one step),
    # headed by `disk_header` (the tier's fingerprint) and the block's record; and verified
    # KV bytes read from disk to copy into pool blocks (after the loads).
    spill: list[tuple[int | None, int | None, str, bytes, bytes]] = field(default_factory=list)  # (slot, block, path, hash, record)
    disk_load: list[tuple[bytes, int]] = field(default_factory=list)  # (KV bytes, pool block)
    disk_header: bytes = b""
    # Prefill-decode disaggregation: KV bytes a consumer pulled from a producer, to copy into
    # the request's pool blocks (after the tiers' loads), in the pool's own layout.
    remote_load: list[tuple[bytes, int]] = field(default_factory=list)  # (KV bytes, pool block)

    def __bool__(self) -> bool:
        return bool(self.store or self.load or self.spill or self.disk_load or self.remote_load)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)  # the runner drops their state
    finished_ids: list[str] = field(default_factory=list)  # the runner drops their state
    kv_transfers: KVTransfers | None = None  # host-tier copies to make before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens first_position, first_position + 1, ... computed in
    one step (the logits at position p score prompt token p + 1)."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass
class RunnerOutput:
    # Per sampled request, the tokens that follow its known ones, in order: one, or with
    # speculation the accepted proposals and then the token sampled after them.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # aligned with sampled_token_ids
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Per request that had proposals verified: how many were proposed (the rest is derived).
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Per pooling request whose last prompt chunk ran: its pooled vector (an embedding).
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # The disk KV tier's files (block hashes) the runner's writer finished since the last
    # output, and those it did not write (dropped behind a slow disk, or a failed write).
    kv_disk_written: list[bytes] = field(default_factory=list)
    kv_disk_failed: list[bytes] = field(default_factory=list)


# ----- the runner's side ------------------------------------------------------------------


@dataclass
class RequestState:
    """What the runner side knows of a request, rebuilt from the step messages."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int]  # prompt + generated tokens, as far as the scheduler has sent them
    block_ids: list[int]
    # Its table in a hybrid cache's sliding pool. Entries the scheduler has since let go of
    # keep their old ids here: the sliding layers never read them (their window is past).
    sliding_block_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]


@dataclass
class StepRequest:
    """One scheduled request of this step with everything the runner needs to compute it."""

    state: RequestState
    item: ScheduledRequest

    @property
    def request_id(self) -> str:
        return self.item.request_id

    @property
    def start_pos(self) -> int:
        return self.item.start_pos

    @property
    def token_ids(self) -> list[int]:
        """The tokens computed now: the known ones, then any proposed ones."""
        item = self.item
        return self.state.token_ids[item.start_pos : item.start_pos + item.num_new_tokens] + item.spec_token_ids

    @property
    def num_tokens(self) -> int:
        return self.item.num_tokens

    @property
    def context_len(self) -> int:
        return self.item.context_len

    @property
    def block_ids(self) -> list[int]:
        return self.state.block_ids

    @property
    def sliding_block_ids(self) -> list[int]:
        return self.state.sliding_block_ids

    @property
    def sample(self) -> bool:
        return self.item.sample

    @property
    def spec_token_ids(self) -> list[int]:
        return self.item.spec_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    @property
    def pooling_params(self) -> PoolingParams | None:
        return self.state.pooling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.state.output_token_ids

    @property
    def banned_token_ids(self) -> list[int]:
        return self.item.banned_token_ids

    @property
    def prompt_logprobs_targets(self) -> list[int] | None:
        return self.item.prompt_logprobs_targets


class RequestTable:
    """The runner side's copy of every scheduled request, kept current by the diffs in
    each SchedulerOutput. Torch-free: the model runner, worker processes and test fakes
    share it."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def apply(self, batch: SchedulerOutput) -> list[StepRequest]:
        """Take in one step's message; returns the step's requests in batch order."""
        for request_id in (*batch.finished_ids, *batch.preempted_ids):
            self.states.pop(request_id, None)
        return [StepRequest(self._update(item), item) for item in batch.scheduled]

    def _update(self, item: ScheduledRequest) -> RequestState:
        if item.new is not None:
            prompt = item.new.prompt_token_ids
            state = RequestState(item.request_id, prompt, item.new.params, list(prompt), [],
                                 pooling_params=item.new.pooling_params)
            self.states[item.request_id] = state
        else:
            state = self.states.get(item.request_id)
            if state is None:
                raise RuntimeError(f"request {item.request_id!r} was scheduled before it was sent as new")
        state.token_ids.extend(item.appended_token_ids)
        state.block_ids.extend(item.new_block_ids)
        state.sliding_block_ids.extend(item.new_sliding_block_ids)
        return state
