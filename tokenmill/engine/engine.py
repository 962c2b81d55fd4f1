"""The step loop: schedule, run the model, update requests, build outputs.

Torch-free: the executor arrives as an object with `execute(SchedulerOutput) ->
RunnerOutput`, built (with the tokenizer and the facts found at load) by
`tokenmill.builder.build_engine`. Every step is reported to the engine's observers as
a `StepRecord` (what ran, what was preempted and finished, how long each phase took):
metrics, the bench and a simulator read the same event stream. The clock is injected.

With speculative decoding a proposer (built by the builder, see `tokenmill.spec_decode`)
is called after each step with the running requests the next step may verify proposals
for, and told which requests are gone (finished, aborted, preempted).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.config import EngineConfig, EngineFacts
from tokenmill.engine.batch import RunnerOutput, SchedulerOutput
from tokenmill.engine.block_manager import HybridKVBlockManager, KVBlockManager
from tokenmill.engine.input_processor import AdmissionLimits, InputProcessor, ProcessedRequest
from tokenmill.engine.interrupt import StepInterrupt, StepInterrupted
from tokenmill.engine.kv_events import KVEvent, KVEventLog
from tokenmill.engine.kv_transfer import KVConnector, KVTransferParamsError, RemotePrefill, wants_remote_decode
from tokenmill.engine.kv_tiers import DiskTier, HostTier, kv_fingerprint
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import SLO_HEADROOM, Request, RequestStatus, slo_aim
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from tokenmill.engine.step_cost import StepCostEstimator
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.params import SamplingParams
from tokenmill.tokenizer import Tokenizer

class SLOUnattainableError(RuntimeError):
    """Early rejection (--slo-reject): the request's TTFT target cannot be met at the
    current load, as predicted from the learned step cost (a server answers 429)."""

    def __init__(self, message: str, predicted_ttft: float, retry_after: float) -> None:
        super().__init__(message)
        self.predicted_ttft = predicted_ttft
        self.retry_after = retry_after  # seconds after which the queue ahead is predicted gone


class Executor(Protocol):
    def execute(self, batch: SchedulerOutput) -> RunnerOutput: ...


class Proposer(Protocol):
    """Speculative decoding's proposer (implementations: `tokenmill.spec_decode`).

    After every step it gets the running requests the next step may verify proposals for
    (their known tokens all computed but the last, min_tokens no longer banning EOS) and
    sets each one's `spec_token_ids` (up to num_speculative_tokens; none is a valid
    answer). The scheduler counts them in the token budget and caps them so no request
    passes max_tokens or max_model_len. `release` names requests that finished, were
    aborted or preempted: the proposer frees what it holds for them (a draft's KV)."""

    num_speculative_tokens: int

    def propose(self, requests: Sequence[Request]) -> None: ...

    def release(self, request_ids: Iterable[str]) -> None: ...  # unknown ids are ignored


@dataclass
class SpecDecodeStats:
    """Proposals verified in one step, or summed over steps: vLLM's spec-decode counters.
    A draft is one request's proposals in one step; position i counts the drafts whose
    (i+1)-th proposal was accepted. Counted as verified, before any stop cuts a run."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @classmethod
    def of_step(cls, output: RunnerOutput) -> SpecDecodeStats:
        stats = cls()
        for request_id, num_draft in output.num_draft_tokens.items():
            accepted = len(output.sampled_token_ids[request_id]) - 1
            stats.add_draft(num_draft, accepted)
        return stats

    def add_draft(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position += [0] * (num_draft - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def add(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        extra = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(extra, 0)
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (vLLM's draft acceptance rate)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step emits per request on average: 1 + accepted per draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class EngineStats(SchedulerStats):
    num_prompt_tokens: int = 0  # computed prompt tokens (prefill work), cumulative
    num_generation_tokens: int = 0  # sampled tokens, cumulative
    num_steps: int = 0
    num_interrupted_steps: int = 0  # cut short by a better-priority arrival (--priority-interrupt)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # cumulative


@dataclass
class StepRecord:
    """One engine step, as observers see it. Times are from the engine's clock."""

    index: int
    started: float
    schedule_s: float  # scheduling (admission, allocation, preemption)
    execute_s: float  # the executor: tensors, forward, sampling
    process_s: float  # appending tokens, stop checks, detokenization, outputs
    num_prefill_tokens: int  # tokens of chunks that start inside the prompt
    num_decode_tokens: int
    num_scheduled: int
    num_generated: int  # tokens appended to requests
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # requests that ended in this step
    num_running: int = 0  # after the step
    num_waiting: int = 0
    kv_usage: float = 0.0
    spec_decode: SpecDecodeStats | None = None  # proposals verified in this step, if any
    propose_s: float = 0.0  # the proposer, after the step (a draft model's forward passes)
    # The step cost model's other features (planner/costmodel.py): the tokens the decode
    # rows attend to, and the (query, key) pairs of the prefill chunks.
    num_decode_context_tokens: int = 0
    num_prefill_attention_pairs: int = 0

    @property
    def duration_s(self) -> float:
        return self.schedule_s + self.execute_s + self.process_s + self.propose_s


class StepObserver:
    """Hooks the engine calls on its own thread (metrics, a dashboard, a recorder). The
    default does nothing; override what you need."""

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None: ...

    def on_aborted(self, output: RequestOutput) -> None: ...


def make_block_manager(facts: EngineFacts, enable_caching: bool, offloading_gib: float | None = None,
                       disk_dir: str | None = None, disk_gib: float = 10.0) -> KVBlockManager | HybridKVBlockManager:
    """One pool, or (sliding-window layers in a hybrid cache) a pool per layer kind. MEAN
    and CLS pooling compute every prompt position: no prefix hits for them. With
    `offloading_gib`, a host tier of that size behind the pool (docs/kv-tiers.md)."""
    enable_caching = enable_caching and (facts.pooling is None or facts.pooling.uses_prefix_cache)
    if facts.num_sliding_blocks:
        # (no plan leaves generated blocks out with sliding windows: their prompts attend as rows of
        # the paged kernel, as decodes do, or through SDPA; never as chunks of the prefill kernel)
        assert facts.cache_generated_kv, "the hybrid KV cache keeps generated blocks"
        if offloading_gib:
            raise ValueError("kv_offloading_size: the host KV tier does not take a hybrid KV cache (sliding-window "
                             "layers) yet; add --disable-hybrid-kv-cache-manager")
        return HybridKVBlockManager(facts.num_blocks, facts.num_sliding_blocks, facts.block_size,
                                    facts.sliding_window, enable_caching)
    host = None
    if offloading_gib and enable_caching:
        # A block as the tiers keep it: the pool's bytes, or (--kv-offloading-cache-dtype) 8-bit.
        bytes_per_block = (facts.kv_offload_bytes_per_token or facts.kv_bytes_per_token) * facts.block_size
        host = HostTier(int(offloading_gib * 2**30) // bytes_per_block, bytes_per_block)
        if disk_dir is not None:
            fingerprint = kv_fingerprint(facts.model_path, facts.weight_format, facts.architecture, facts.kv_cache_dtype,
                                         facts.kv_cache_format, facts.compute_dtype, facts.block_size,
                                         facts.kv_bytes_per_token, *_offload_format(facts),
                                         *(() if facts.cache_generated_kv else ("prompt blocks only",)))
            host.disk = DiskTier(disk_dir, fingerprint, bytes_per_block, int(disk_gib * 2**30))
    return KVBlockManager(facts.num_blocks, facts.block_size, enable_caching, host, facts.cache_generated_kv)


def _offload_format(facts: EngineFacts) -> tuple:
    """What a compressed host tier adds to the disk tier's fingerprint (nothing without one,
    so the files of earlier versions keep their directory)."""
    return (facts.kv_offload_cache_dtype, facts.kv_offload_bytes_per_token) if facts.kv_offload_bytes_per_token else ()


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer: Tokenizer,
        facts: EngineFacts,
        clock: Callable[[], float] = time.monotonic,
        proposer: Proposer | None = None,
    ) -> None:
        if (proposer is None) != (config.speculative.speculative_config is None):
            raise ValueError("a proposer goes with a speculative_config, and only with one")
        self.config = config
        self.executor = executor
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.facts = facts
        self.clock = clock
        kv = make_block_manager(facts, config.cache.enable_prefix_caching, config.cache.kv_offloading_size,
                                config.cache.kv_offloading_disk_dir, config.cache.kv_offloading_disk_size)
        events = config.cache.kv_events_config
        if events is not None and events.enable_kv_cache_events:
            kv.events = KVEventLog(facts.block_size)
        # Where each step's KV events go (the builder attaches a publisher); None: dropped.
        self.kv_event_sink: Callable[[list[KVEvent]], None] | None = None
        self.kv_event_publisher: object | None = None  # what owns the sink (its sockets and thread)
        sched = config.scheduler
        # SLO mode aims a little under the targets: its step costs are predictions.
        limits = SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens, facts.max_model_len,
                                 sched.scheduling_policy, sched.priority_aging, slo_aim(sched.slo_ttft_ms),
                                 slo_aim(sched.slo_tpot_ms), sched.priority_step_fraction)
        # SLO mode (the engine's targets or a request's own) predicts steps from the
        # engine's own: every step's time is fed back, whether or not targets are set yet.
        self.step_cost = StepCostEstimator()
        self.scheduler = Scheduler(limits, kv, clock, self.step_cost)
        self.input_processor = InputProcessor(
            tokenizer, AdmissionLimits(facts.max_model_len, facts.vocab_size, facts.num_blocks, facts.block_size,
                                       facts.runner, facts.pooling),
            priority_scheduling=limits.by_priority)
        self.output_processor = OutputProcessor(tokenizer, clock)
        self.observers: list[StepObserver] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.num_interrupted_steps = 0
        self.spec_decode_stats = SpecDecodeStats()
        self._ids = itertools.count()
        # --priority-interrupt: the flag a better-ranked arrival raises and the forward reads.
        self.interrupt: StepInterrupt | None = StepInterrupt() if sched.priority_interrupt else None
        if self.interrupt is not None:
            self._check_interruptible()
        # Preemptions made by cut steps, reported with the next step that runs to its end.
        self._unreported_preemptions: list[str] = []

    @property
    def model_name(self) -> str:
        return self.facts.model_name

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    def add_observer(self, observer: StepObserver) -> None:
        self.observers.append(observer)

    def sibling(self, num_blocks: int | None = None, proposer: Proposer | None = None,
                **settings: object) -> LLMEngine:
        """Another engine on this one's executor (model and KV memory) with some settings
        changed (scheduling, prefix caching, speculation: a changed speculative_config
        needs its `proposer`). Engines sharing an executor must be used one at a time, and
        each must finish its requests before the other steps."""
        facts = self.facts if num_blocks is None else dataclasses.replace(self.facts, num_blocks=num_blocks)
        config = self.config.replace(**settings)
        if config.cache.kv_offloading_cache_dtype != self.config.cache.kv_offloading_cache_dtype:
            raise ValueError("kv_offloading_cache_dtype is the runner's host-tier format: a sibling engine keeps "
                             "its parent's; build a new engine to change it")
        if proposer is None and config.speculative == self.config.speculative:
            proposer = self.proposer
        elif proposer is None and config.speculative.speculative_config is not None:
            raise ValueError("a sibling engine with another speculative_config needs its proposer (proposer=...)")
        return LLMEngine(config, self.executor, self.tokenizer, facts, self.clock, proposer)

    def _check_interruptible(self) -> None:
        """--priority-interrupt puts an interrupted step back; what it cannot put back yet is
        refused here, with the flag to drop."""
        if not self.scheduler.config.by_priority:
            raise ValueError("priority_interrupt: it cuts steps for better-priority arrivals; it needs "
                             "--scheduling-policy priority")
        if not hasattr(self.executor, "interrupt"):
            raise ValueError("priority_interrupt: interrupting a step is built for the model in this process only, "
                             "not for tensor/pipeline-parallel workers or the simulator; drop --priority-interrupt")
        if self.proposer is not None:
            raise ValueError("priority_interrupt does not take speculative decoding yet (a cut step's proposals "
                             "are not put back); drop --speculative-config or --priority-interrupt")
        if not isinstance(self.scheduler.kv, KVBlockManager) or self.scheduler.kv.host_tier is not None:
            raise ValueError("priority_interrupt does not take a hybrid KV cache or a host KV tier yet (a cut step's "
                             "block copies are not put back); drop --priority-interrupt, or add "
                             "--disable-hybrid-kv-cache-manager / drop --kv-offloading-size")

    def offer_interrupt(self, priority: int, arrival_time: float) -> bool:
        """A request of this priority was queued from another thread (the server's event
        loop): with --priority-interrupt, cut the running step if everything in it ranks
        worse. Thread-safe; returns whether it asked for the cut."""
        interrupt = self.interrupt
        return interrupt is not None and interrupt.offer(self.scheduler.rank_of(priority, arrival_time))

    def offers_taken_in(self) -> None:
        """The requests offered so far are queued in this engine (the server drained its
        commands): their offers no longer cut the steps the engine schedules."""
        if self.interrupt is not None:
            self.interrupt.taken_in()

    # ----- requests ------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        final_only: bool = False,
        cache_salt: str | None = None,
        priority: int = 0,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
        pooling_params: PoolingParams | None = None,
        kv_transfer_params: dict | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (an AdmissionError naming the
        problem and the limit) before anything is allocated. `priority` (lower first) needs
        --scheduling-policy priority unless it is 0, as in vLLM. `slo_ttft_ms` /
        `slo_tpot_ms`: this request's latency targets (SLO mode; default: the engine's);
        with --slo-reject, SLOUnattainableError when its TTFT target is predicted missed.
        `pooling_params`: a pooling request (the pooling runner's: an embedding) instead of
        a generating one. `kv_transfer_params`: vLLM's, for prefill-decode disaggregation
        (engine/kv_transfer.py; needs a kv_transfer_config)."""
        request = self.input_processor.process(request_id, prompt, params, arrival_time=arrival_time or self.clock(),
                                               cache_salt=cache_salt, priority=priority, slo_ttft_ms=slo_ttft_ms,
                                               slo_tpot_ms=slo_tpot_ms, pooling_params=pooling_params)
        if kv_transfer_params:
            self.check_kv_transfer_params(kv_transfer_params, len(request.samples))
            for sample in request.samples:
                sample.kv_transfer_params = dict(kv_transfer_params)
        self.add_processed(request, final_only)

    # ----- prefill-decode disaggregation ---------------------------------------------

    @property
    def kv_connector(self) -> KVConnector | None:
        return self.scheduler.connector

    def set_kv_connector(self, connector: KVConnector) -> None:
        """The builder's transport for --kv-transfer-config (tokenmill.kv_transfer)."""
        if isinstance(self.scheduler.kv, HybridKVBlockManager):
            raise ValueError("kv_transfer_config: disaggregation does not take a hybrid KV cache (sliding-window "
                             "layers) yet; add --disable-hybrid-kv-cache-manager")
        if self.interrupt is not None:
            raise ValueError("kv_transfer_config: disaggregation does not take --priority-interrupt yet (a cut "
                             "step's pulls are not put back); drop one of them")
        self.scheduler.connector = connector

    def check_kv_transfer_params(self, params: dict, num_samples: int = 1) -> RemotePrefill | None:
        """Refuse kv_transfer_params this engine cannot honour (KVTransferParamsError, a 400);
        returns the remote prefill they name, if any."""
        if not isinstance(params, dict):
            raise KVTransferParamsError("kv_transfer_params must be a JSON object")
        connector = self.scheduler.connector
        remote = RemotePrefill.from_params(params)
        decode = wants_remote_decode(params)
        if (remote is not None or decode) and num_samples != 1:
            raise KVTransferParamsError("kv_transfer_params: disaggregated requests take n = 1")
        if decode and (connector is None or not connector.is_producer):
            raise KVTransferParamsError("kv_transfer_params: do_remote_decode needs a prefill instance (this server "
                                        "has no --kv-transfer-config with kv_role kv_producer or kv_both)")
        if remote is not None and (connector is None or not connector.is_consumer):
            raise KVTransferParamsError("kv_transfer_params: do_remote_prefill needs a decode instance (this server "
                                        "has no --kv-transfer-config with kv_role kv_consumer or kv_both)")
        return remote

    def poll_kv_transfers(self) -> bool:
        """Free the blocks of holds pulled or timed out, and take finished pulls, between
        steps (an idle server calls it): True when anything changed."""
        return self.scheduler.poll_connector()

    def add_processed(self, request: ProcessedRequest, final_only: bool = False) -> None:
        """Queue a request the input processor made (`LLM` checks a whole batch first)."""
        for rid in [request.request_id, *(s.request_id for s in request.samples)]:
            if rid in self.output_processor.user_requests or rid in self.scheduler.requests:
                raise ValueError(f"request id {rid!r} is already in use")
        if self.config.scheduler.slo_reject and request.samples:
            self._check_attainable(request.samples[0])
        for sample in request.samples:
            self.scheduler.add_request(sample)
        self.output_processor.add(request.request_id, request.prompt_text, request.samples, final_only)

    def _check_attainable(self, request: Request) -> None:
        """Early rejection: raise SLOUnattainableError when the request has a TTFT target
        (its own or the engine's) and the scheduler predicts it missed at the current
        load. Admitted when nothing can be predicted yet."""
        target = request.slo_ttft if request.slo_ttft is not None else self.scheduler.config.slo_ttft
        if target is None:
            return
        predicted = self.scheduler.predict_ttft(request)
        if predicted is not None and predicted > target:
            goal = target / SLO_HEADROOM
            raise SLOUnattainableError(
                f"the server is too loaded to meet this request's time-to-first-token target of {goal * 1e3:.0f} ms "
                f"(predicted {predicted * 1e3:.0f} ms); retry later, or send it without a target",
                predicted, max(predicted - target, 0.0))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once; returns its final output."""
        sample_ids = self.output_processor.sample_ids(request_id)
        self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        if self.proposer is not None:
            self.proposer.release(sample_ids)
        output = self.output_processor.finish_externally(request_id, "abort")
        if output is not None:
            for observer in self.observers:
                observer.on_aborted(output)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, in the pool and the host tier (vLLM's
        `reset_prefix_cache`); False, changing nothing, while requests hold KV blocks."""
        reset = self.scheduler.kv.reset_prefix_cache()
        self._publish_kv_events()  # AllBlocksCleared now, not at the next step
        return reset

    def requests_queued_since(self, arrived_before: float) -> list[str]:
        """Ids of the requests that arrived before `arrived_before` (time.monotonic) and
        have never been scheduled (a server's queue-wait limit aborts them)."""
        owners = {
            self.output_processor.sample_owner[r.request_id][0].request_id
            for r in self.scheduler.waiting
            if r.first_scheduled_time is None and r.arrival_time < arrived_before
            and r.request_id in self.output_processor.sample_owner
        }
        return sorted(owners)

    # ----- the step ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = self.clock()
        batch = self.scheduler.schedule()
        self._publish_kv_events()
        if batch.is_empty and not batch.finished_ids and not batch.kv_transfers:
            if self.scheduler.pulling or self.scheduler.reading:  # only KV in flight: wait, do not spin
                self.scheduler.wait_for_kv(0.005)
            return []
        scheduled = self.clock()
        num_prefill, context, pairs = self._step_shape(batch)
        armed = self._arm_interrupt(batch)
        try:
            runner_output = self.executor.execute(batch)
        except StepInterrupted:
            self.scheduler.put_back(batch)
            self.num_interrupted_steps += 1
            self._unreported_preemptions += batch.preempted_ids
            self._publish_kv_events()
            return []
        finally:
            if armed:
                self.interrupt.disarm()
        executed = self.clock()
        updated = self.scheduler.update_from_output(batch, runner_output)
        outputs, stopped = self.output_processor.process(updated, runner_output)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        num_generated = sum(r.num_new_output_tokens for r in updated)
        self.num_steps += 1
        self.num_generation_tokens += num_generated
        self.num_prompt_tokens += num_prefill
        spec = SpecDecodeStats.of_step(runner_output) if runner_output.num_draft_tokens else None
        if spec is not None:
            self.spec_decode_stats.add(spec)
        processed = self.clock()
        if self.step_cost is not None:
            self.step_cost.observe(num_prefill, batch.num_batched_tokens - num_prefill, processed - started)
        self._propose(batch)
        self._report(batch, started, scheduled, executed, processed, (num_prefill, context, pairs), num_generated,
                     updated, outputs, spec)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            **dataclasses.asdict(self.scheduler.stats()),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps,
            num_interrupted_steps=self.num_interrupted_steps,
            spec_decode=dataclasses.replace(self.spec_decode_stats,
                                            accepted_per_position=list(self.spec_decode_stats.accepted_per_position)),
        )

    # ----- internals -----------------------------------------------------------------

    def _publish_kv_events(self) -> None:
        events = self.scheduler.kv.take_events()
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(events)

    def _arm_interrupt(self, batch: SchedulerOutput) -> bool:
        """With --priority-interrupt, let a better-ranked arrival cut this step, unless it
        holds what a cut could not put back: host-tier copies, proposals, grammar state,
        a pooling request's chunks."""
        if self.interrupt is None or batch.kv_transfers or not batch.scheduled:
            return False
        ranks = []
        for item in batch.scheduled:
            request = self.scheduler.requests.get(item.request_id)
            if (request is None or item.spec_token_ids or request.pooling_params is not None
                    or request.params.structured_outputs is not None):
                return False
            ranks.append(self.scheduler.rank(request))
        self.executor.interrupt = self.interrupt  # (a sibling engine on the same runner may have set its own)
        self.interrupt.arm(min(ranks))
        return True

    def _step_shape(self, batch: SchedulerOutput) -> tuple[int, int, int]:
        """(prefill tokens, decode context tokens, prefill attention pairs): chunks that
        start inside their prompt are prefill work (a recomputation too), the rest decode
        rows, as the simulator's StepMeter counts them."""
        requests = self.scheduler.requests
        prefill = context = pairs = 0
        for item in batch.scheduled:
            request = requests.get(item.request_id)
            if request is None:
                continue
            n = item.num_tokens
            if item.start_pos < request.num_prompt_tokens:
                prefill += n
                pairs += n * item.start_pos + n * (n + 1) // 2
            else:
                context += item.context_len
        return prefill, context, pairs

    def _propose(self, batch: SchedulerOutput) -> None:
        """Let the proposer forget the requests that left, then propose for the running
        ones the next step may verify (unless the batch is large enough that speculation
        no longer pays: disable_by_batch_size)."""
        proposer = self.proposer
        if proposer is None:
            return
        requests = self.scheduler.requests
        gone = [*batch.preempted_ids, *(r.request_id for r in batch.scheduled if r.request_id not in requests)]
        if gone:
            proposer.release(gone)
        running = self.scheduler.running
        limit = self.config.speculative.speculative_config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            for request in running:  # nothing left over from an earlier step either
                request.spec_token_ids = []
            return
        ready = [r for r in running
                 if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens >= r.params.min_tokens]
        if ready:
            proposer.propose(ready)

    def _report(self, batch: SchedulerOutput, started: float, scheduled: float, executed: float, processed: float,
                shape: tuple[int, int, int], num_generated: int, updated: list[Request],
                outputs: list[RequestOutput], spec: SpecDecodeStats | None) -> None:
        cut_preemptions, self._unreported_preemptions = self._unreported_preemptions, []
        if not self.observers:
            return
        stats = self.scheduler.stats()
        num_prefill, context, pairs = shape
        record = StepRecord(
            index=self.num_steps - 1, started=started, schedule_s=scheduled - started, execute_s=executed - scheduled,
            process_s=processed - executed, propose_s=self.clock() - processed, spec_decode=spec,
            num_prefill_tokens=num_prefill,
            num_decode_tokens=batch.num_batched_tokens - num_prefill, num_scheduled=len(batch.scheduled),
            num_generated=num_generated, preempted_ids=[*cut_preemptions, *batch.preempted_ids],
            finished_ids=[r.request_id for r in updated if r.is_finished],
            num_running=stats.num_running, num_waiting=stats.num_waiting, kv_usage=stats.kv_usage,
            num_decode_context_tokens=context, num_prefill_attention_pairs=pairs,
        )
        for observer in self.observers:
            observer.on_step(record, outputs)
