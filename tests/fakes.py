"""Model-free stand-ins for driving the scheduler and the KV block manager in tests.

`FakeRunner` plays the model runner on a *fake paged KV memory*: every scheduled token
is written into its slot through the request's block table, every position the step
attends to is read back through the block table and checked against the request's own
tokens, and the sampled token is a deterministic function of what was read. A prefix
cache hit on the wrong block, a block freed while still in use, or a block table that
is too short therefore fails loudly, and outputs stay identical whatever the batching,
chunking, preemption or caching (`reference_outputs` computes them directly).

`Harness` wires a scheduler, a block manager and a fake runner together, and checks the
scheduler's contract after every `schedule()` and every `update_from_output()`.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.engine.batch import RequestTable, RunnerOutput, ScheduledRequest, SchedulerOutput, StepRequest
from tokenmill.engine.block_manager import KVBlockManager
from tokenmill.engine.input_processor import AdmissionLimits, InputProcessor
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.engine.step_cost import StepCostEstimator
from tokenmill.sampling.params import SamplingParams

VOCAB_SIZE = 1000
EOS = 2
NUM_SPECIAL = 3  # ids 0..2 are never produced by the default fake model


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_model_len: int = 64,
    cache_salt: str | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    **params: object,
) -> Request:
    """A request as the engine builds it (EOS id, max_model_len cap); SLO targets in
    seconds, as the scheduler aims at them."""
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(**params),
        eos_token_ids=(EOS,),
        max_total_tokens=max_model_len,
        cache_salt=cache_salt,
        priority=priority,
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
    )
    if arrival_time is not None:
        request.arrival_time = arrival_time
    return request


def next_token(context: Sequence[int]) -> int:
    """The fake model: a deterministic, position-sensitive function of the whole context,
    never a special id."""
    acc = 1469598103934665603
    for position, token in enumerate(context):
        acc = ((acc ^ (token * 31 + position)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return NUM_SPECIAL + acc % (VOCAB_SIZE - NUM_SPECIAL)


def reference_outputs(prompt: Sequence[int], num_outputs: int) -> list[int]:
    """What the fake model generates for `prompt`, computed without any scheduler."""
    context = list(prompt)
    for _ in range(num_outputs):
        context.append(next_token(context))
    return context[len(prompt):]


# A policy may replace the fake model's choice: (request_id, output index, context) -> token
# id, or None to keep the model's choice. Banned ids are never sampled (as a real sampler).
Policy = Callable[[str, int, list[int]], "int | None"]


@dataclass
class ScheduledView(ScheduledRequest):
    """A scheduled request plus what the runner side rebuilds of it from the step's
    diffs, copied at that step: tests read both, and the runner takes it as the plain
    ScheduledRequest it is."""

    token_ids: list[int] = field(default_factory=list)  # the tokens computed now
    block_ids: list[int] = field(default_factory=list)  # the whole block table
    params: SamplingParams | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, view: StepRequest) -> ScheduledView:
        plain = {f.name: getattr(view.item, f.name) for f in dataclasses.fields(ScheduledRequest)}
        return cls(**plain, token_ids=list(view.token_ids), block_ids=list(view.block_ids), params=view.params,
                   prompt_token_ids=list(view.prompt_token_ids), output_token_ids=list(view.output_token_ids))


def with_views(out: SchedulerOutput, table: RequestTable) -> SchedulerOutput:
    """`out` with every scheduled request as a ScheduledView (table: the runner side's
    state before this step; it is not changed)."""
    views = RequestTable()
    views.states = {rid: copy.deepcopy(state) for rid, state in table.states.items()}
    return dataclasses.replace(out, scheduled=[ScheduledView.of(v) for v in views.apply(out)])


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, policy: Policy | None = None) -> None:
        self.block_size = block_size
        self.memory: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.policy = policy
        self.num_executes = 0
        self.requests = RequestTable()  # the runner side's view, rebuilt from the step diffs

    def _slot(self, block_ids: list[int], position: int) -> tuple[int, int]:
        return block_ids[position // self.block_size], position % self.block_size

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        self.num_executes += 1
        items = self.requests.apply(batch)
        # Write the KV of every scheduled token first (as each layer does before attention).
        for item in items:
            assert item.num_tokens >= 1, f"{item.request_id}: empty chunk scheduled"
            assert len(item.block_ids) * self.block_size >= item.context_len, (
                f"{item.request_id}: block table {item.block_ids} too short for {item.context_len} tokens"
            )
            for offset, token in enumerate(item.token_ids):
                block, slot = self._slot(item.block_ids, item.start_pos + offset)
                self.memory[block][slot] = (item.start_pos + offset, token)
        # Then read the whole context back through the block table, and sample from it.
        sampled: dict[str, list[int]] = {}
        for item in items:
            known = item.start_pos + item.item.num_new_tokens
            tokens = [*item.prompt_token_ids, *item.output_token_ids][:known] + item.spec_token_ids
            read = [self.memory[b][s] for b, s in (self._slot(item.block_ids, p) for p in range(item.context_len))]
            expected = list(enumerate(tokens))
            assert read == expected, (
                f"{item.request_id}: KV read through block table {item.block_ids} is wrong: "
                f"first bad position {next(p for p in range(item.context_len) if read[p] != expected[p])}"
            )
            if item.sample:
                sampled[item.request_id] = self._verify(item, tokens[:known])
        return RunnerOutput(sampled_token_ids=sampled)

    def execute_interrupted(self, batch: SchedulerOutput) -> None:
        """A step cut short part-way through its forward (--priority-interrupt): the table
        takes the step in, and every slot the step was to write holds garbage (some layers
        wrote it, others not); nothing is sampled."""
        self.num_executes += 1
        for item in self.requests.apply(batch):
            for offset in range(item.num_tokens):
                block, slot = self._slot(item.block_ids, item.start_pos + offset)
                self.memory[block][slot] = ("garbage", item.start_pos + offset)

    def _verify(self, item: StepRequest, context: list[int]) -> list[int]:
        """The model's token after `context`; with proposals, greedy verification: each
        proposal the model agrees with is accepted, then the model's own next token."""
        emitted: list[int] = []
        for proposal in [*item.spec_token_ids, None]:
            token = self._next(item, context + emitted)
            emitted.append(token)
            if token != proposal:
                break
        return emitted

    def _next(self, item: StepRequest, context: list[int]) -> int:
        token = next_token(context)
        if self.policy is not None:
            output_index = len(context) - len(item.prompt_token_ids)
            wanted = self.policy(item.request_id, output_index, context)
            if wanted is not None and wanted not in item.banned_token_ids:
                token = wanted
        assert token not in item.banned_token_ids
        return token


class Harness:
    """A scheduler over a fresh block manager and a fake runner, with contract checks."""

    def __init__(
        self,
        num_blocks: int = 10,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        max_model_len: int = 64,
        enable_caching: bool = True,
        policy: Policy | None = None,
        proposer: Callable[[Request], list[int]] | None = None,
        scheduling_policy: str = "fcfs",
        priority_aging: float | None = None,
        slo_ttft: float | None = None,
        slo_tpot: float | None = None,
        step_cost: StepCostEstimator | None = None,
        clock: Callable[[], float] = time.monotonic,
        priority_step_fraction: float = 0.0,
    ) -> None:
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, scheduling_policy,
                                      priority_aging, slo_ttft, slo_tpot, priority_step_fraction)
        self.kv = KVBlockManager(num_blocks, block_size, enable_caching)
        self.sched = Scheduler(self.config, self.kv, clock, step_cost)
        # Admission as the engine runs it (the scheduler itself checks nothing).
        self.processor = InputProcessor(FakeTokenizer(), AdmissionLimits(max_model_len, VOCAB_SIZE, num_blocks,
                                                                         block_size), self.config.by_priority)
        self.runner = FakeRunner(num_blocks, block_size, policy)
        self.proposer = proposer  # sets each running request's proposals after every step
        self.finished: dict[str, Request] = {}
        self.num_steps = 0
        self.num_accepted = 0  # proposals accepted, over all steps
        # The furthest position a running request's KV ever reached since its admission:
        # the slots of rejected proposals stay allocated (the request grows into them).
        self.high_water: dict[str, int] = {}

    def add(self, request_id: str, prompt: Sequence[int], cache_salt: str | None = None, priority: int = 0,
            arrival_time: float | None = None, slo_ttft: float | None = None, slo_tpot: float | None = None,
            **params: object) -> Request:
        request = make_request(request_id, prompt, self.config.max_model_len, cache_salt, priority, arrival_time,
                               slo_ttft, slo_tpot, **params)
        self.processor.check(request.num_prompt_tokens, request.params)
        self.processor.check_priority(priority)
        self.sched.add_request(request)
        self.kv.check_integrity()
        return request

    def abort(self, *request_ids: str) -> None:
        live = {rid: self.sched.requests[rid] for rid in request_ids if rid in self.sched.requests}
        self.sched.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        self.kv.check_integrity()
        for rid, request in live.items():
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert self.kv.get_block_ids(rid) == [], f"aborted {rid} still holds blocks"
            self.finished[rid] = request
        self.check_queues()

    def schedule(self) -> SchedulerOutput:
        """One `schedule()` with every contract check; no model run."""
        running_before = [r.request_id for r in self.sched.running]
        waiting_before = [r.request_id for r in self.sched.waiting]
        computed_before = {rid: r.num_computed_tokens for rid, r in self.sched.requests.items()}
        proposed = {rid: list(r.spec_token_ids) for rid, r in self.sched.requests.items()}
        out = with_views(self.sched.schedule(), self.runner.requests)
        self.kv.check_integrity()
        cfg, kv = self.config, self.kv

        ids = [item.request_id for item in out.scheduled]
        assert len(set(ids)) == len(ids), f"a request scheduled twice: {ids}"
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
        assert len(out.scheduled) <= cfg.max_num_seqs, "max_num_seqs exceeded (scheduled)"
        assert len(self.sched.running) <= cfg.max_num_seqs, "max_num_seqs exceeded (running)"
        running_after = [r.request_id for r in self.sched.running]
        old = [rid for rid in ids if rid in running_before]
        new = [rid for rid in ids if rid not in running_before]
        assert old == [rid for rid in running_before if rid in old], "running requests keep their order"
        # (SLO mode moves requests that missed their TTFT target back first)
        if cfg.slo_ttft is None and all(self.sched.requests[rid].slo_ttft is None for rid in waiting_before):
            assert new == waiting_before[: len(new)], f"admissions must come from the head of waiting: {new}"
        assert set(new) <= set(waiting_before)
        assert set(out.preempted_ids) <= set(running_before)
        assert not set(out.preempted_ids) & set(ids), "a preempted request was scheduled"
        # Victims are the tail of running (the newest under fcfs, the worst-ranked under priority).
        assert out.preempted_ids == running_before[::-1][: len(out.preempted_ids)]
        assert set(running_after) == set(running_before) - set(out.preempted_ids) | set(new)
        if cfg.by_priority:
            self._check_rank_order(out, ids)
        else:
            assert running_after == [rid for rid in running_before if rid in running_after] + new, (
                "running must keep admission order, newly admitted at the end")
            # Running requests first (in order), then admissions from the head of waiting (in order).
            assert ids == old + new, f"decodes/continuations must come before admissions: {ids}"
            if out.preempted_ids:
                assert not new, f"admitted {new} in a step that preempted {out.preempted_ids}"
                head = [r.request_id for r in list(self.sched.waiting)[: len(out.preempted_ids)]]
                assert head == out.preempted_ids[::-1], "preempted requests go back to the head of waiting"
        for rid in out.preempted_ids:
            self.high_water.pop(rid, None)
            request = self.sched.requests[rid]
            assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
            assert kv.get_block_ids(rid) == []

        # What the runner side rebuilds from the step's diffs is the request as it stands.
        for item in out.scheduled:
            request = self.sched.requests[item.request_id]
            assert request.status == RequestStatus.RUNNING
            assert item.num_tokens >= 1
            known_end = item.start_pos + item.num_new_tokens
            assert item.token_ids == request.all_token_ids[item.start_pos : known_end] + item.spec_token_ids
            assert request.num_computed_tokens == item.context_len
            assert known_end <= request.num_tokens
            assert item.sample == (known_end == request.num_tokens)
            if item.spec_token_ids:  # a prefix of the proposals, verified after the last known token
                assert item.spec_token_ids == proposed[item.request_id][: len(item.spec_token_ids)]
                assert item.num_new_tokens == 1 and item.sample
                assert request.num_prompt_tokens + request.max_tokens - 1 >= item.context_len
            assert not request.spec_token_ids, "proposals must be consumed by the step"
            if item.request_id in running_before:
                assert item.start_pos == computed_before[item.request_id], "a running request skipped tokens"
            else:  # admission: only whole cached blocks may be skipped
                assert item.start_pos % kv.block_size == 0
                assert item.start_pos < request.num_tokens, "a cache hit covered the last token"
            assert item.block_ids == kv.get_block_ids(item.request_id)
            reach = self.high_water[item.request_id] = max(item.context_len, self.high_water.get(item.request_id, 0))
            assert len(item.block_ids) == kv.blocks_needed(reach), (
                f"{item.request_id}: {len(item.block_ids)} blocks for {reach} tokens"
            )
        self.check_queues()
        return out

    def _check_rank_order(self, out: SchedulerOutput, ids: list[str]) -> None:
        """The priority policy: both queues in rank order, the step in rank order, and no
        victim ranks better than anything scheduled in its step."""
        sched = self.sched
        for name, queue in (("running", sched.running), ("waiting", sched.waiting)):
            ranks = [sched.rank(r) for r in queue]
            assert ranks == sorted(ranks), f"{name} is out of rank order: {[r.request_id for r in queue]}"
        ranks = [sched.rank(sched.requests[rid]) for rid in ids]
        assert ranks == sorted(ranks), f"the step is out of rank order: {ids}"
        if ranks and out.preempted_ids:
            worst_scheduled = max(ranks)
            assert all(sched.rank(sched.requests[rid]) >= worst_scheduled for rid in out.preempted_ids), (
                f"preempted {out.preempted_ids} for worse-ranked {ids}")

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        runner_output = self.runner.execute(out)
        before = {item.request_id: self.sched.requests[item.request_id].num_output_tokens
                  for item in out.scheduled if item.request_id in self.sched.requests}
        live = dict(self.sched.requests)
        updated = self.sched.update_from_output(out, runner_output)
        self.kv.check_integrity()
        sampled = [item.request_id for item in out.scheduled if item.sample]
        assert [r.request_id for r in updated] == [rid for rid in sampled if rid in before]
        spec = {item.request_id: len(item.spec_token_ids) for item in out.scheduled}
        for request in updated:
            gained = request.num_output_tokens - before[request.request_id]
            assert gained == request.num_new_output_tokens and 1 <= gained <= spec[request.request_id] + 1
            self.num_accepted += gained - 1
            if not request.is_finished:  # every accepted token's KV is computed; the last one's comes next
                assert request.num_computed_tokens == request.num_tokens - 1
            if request.is_finished:
                assert request.request_id not in self.sched.requests
                assert self.kv.get_block_ids(request.request_id) == [], "finished request still holds blocks"
                self.finished[request.request_id] = request
        for rid, request in live.items():
            if rid not in sampled:
                assert rid in self.sched.requests, f"{rid} finished without sampling"
        self.check_queues()
        self.num_steps += 1
        if self.proposer is not None:
            for request in self.sched.running:
                request.spec_token_ids = self.proposer(request)
        return out

    def check_queues(self) -> None:
        sched, kv = self.sched, self.kv
        assert set(sched.requests) == {r.request_id for r in [*sched.running, *sched.waiting]}
        assert len(sched.requests) == len(sched.running) + len(sched.waiting)
        for request in sched.running:
            assert request.status == RequestStatus.RUNNING
            reach = max(request.num_computed_tokens, self.high_water.get(request.request_id, 0))
            assert len(kv.get_block_ids(request.request_id)) == kv.blocks_needed(reach)
        for request in sched.waiting:
            assert request.status == RequestStatus.WAITING
            assert request.num_computed_tokens == 0
            assert kv.get_block_ids(request.request_id) == []
        assert set(kv.req_blocks) <= {r.request_id for r in sched.running}

    def interrupted_step(self) -> SchedulerOutput:
        """A step scheduled, cut short in the runner, and put back by the scheduler."""
        out = self.schedule()
        self.runner.execute_interrupted(out)
        self.sched.put_back(out)
        self.kv.check_integrity()
        self.check_queues()
        for item in out.scheduled:
            request = self.sched.requests.get(item.request_id)
            if item.new is None:
                assert request.num_computed_tokens == item.start_pos, "a put-back request kept the step's tokens"
            else:  # admitted in the cut step: back in the queue, holding nothing
                assert request.status == RequestStatus.WAITING and not self.kv.get_block_ids(item.request_id)
                self.high_water.pop(item.request_id, None)
        return out

    def run(self, max_steps: int = 10_000) -> int:
        """Step until no request is left; returns the number of steps."""
        steps = 0
        while self.sched.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps <= max_steps, "the scheduler made no progress"
        return steps

    def assert_idle(self) -> None:
        """Nothing left anywhere, no leak: every block free, no per-request state."""
        kv = self.kv
        kv.check_integrity()
        assert not self.sched.has_unfinished_requests()
        assert not self.sched.running and not self.sched.waiting
        assert kv.num_free_blocks == kv.num_blocks
        assert all(block.ref_count == 0 for block in kv.blocks)
        assert not kv.req_blocks and not kv.req_hashes and not kv.req_num_hashed_blocks


class FakeTokenizer:
    """Just what the engine and the detokenizer use: one letter per token id, special
    ids (below NUM_SPECIAL) skipped."""

    eos_token_ids = [EOS]
    max_token_chars = 1  # one character per token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [NUM_SPECIAL + ord(c) % 26 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if t < NUM_SPECIAL and skip_special_tokens else chr(97 + t % 26) for t in ids)

    def token_to_text(self, token_id: int) -> str:
        return chr(97 + token_id % 26)


def make_engine(num_blocks: int = 12, block_size: int = 4, max_model_len: int = 64, policy: Policy | None = None, **config: object):
    """An LLMEngine over a FakeRunner and a FakeTokenizer (imports stay torch-free)."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine

    runner = FakeRunner(num_blocks, block_size, policy)
    config = EngineConfig.from_kwargs(block_size=block_size, **config)
    return LLMEngine(config, runner, FakeTokenizer(), fake_facts(num_blocks, block_size, max_model_len))


def fake_facts(num_blocks: int, block_size: int, max_model_len: int):
    """What a builder would have found for the fake model."""
    from tokenmill.config import EngineFacts

    return EngineFacts(
        model_name="fake", model_path="", architecture="fake", vocab_size=VOCAB_SIZE, max_model_len=max_model_len,
        device="cpu", compute_dtype="float32", weight_format="none", kv_cache_dtype="none", num_blocks=num_blocks,
        block_size=block_size, kv_bytes_per_token=0, attention_backend="fake", execution_plan="fake",
    )
