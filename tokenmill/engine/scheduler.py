"""Iteration-level scheduling under a token budget, as vLLM v1 does it.

Every request has `num_computed_tokens` that catches up with its token count.
Each step: running requests first (in admission order, so decodes go before the
newest request's remaining prefill), then waiting ones, all within
`max_num_batched_tokens` and `max_num_seqs`. A prompt that does not fit the
remaining budget is chunked. When the KV memory runs out, the most recently
admitted running request is preempted (its blocks freed, recomputed later), and
no new request is admitted in that step. Knows no tensors.

A step may also verify tokens proposed for a request (speculative decoding): they
count in the token budget and get KV slots like known tokens; afterwards the
accepted ones and the token sampled after them are appended (up to the first stop),
and `num_computed_tokens` is rolled back past the rejected ones. The clock is
injected, so the same scheduler runs on virtual time in a simulator.

Under the priority policy (vLLM's `--scheduling-policy priority`) requests are ranked
by `(priority, arrival_time)`, lower first, or with `priority_aging` by `arrival_time +
priority x priority_aging` (waiting earns rank, which bounds starvation). Running and
waiting requests are both kept in rank order and one step visits them merged in that
order: a running request gets its next tokens, a waiting one is admitted. Whoever needs
a sequence slot or KV memory preempts the worst-ranked running request, if that one
ranks strictly worse (docs/scheduling.md). A better-ranked arrival waits for the step in
flight, so with `priority_step_fraction` a worse-priority prefill chunk is cut, while a
better priority is waiting or arrived lately, to keep the step within that fraction of the
better priority's unloaded TTFT (at least one KV block), and a step that prefills a better
priority takes no worse-priority prefill. With the engine's --priority-interrupt the step in
flight is cut short instead, and `put_back` returns its requests to where they were.

SLO mode (`slo_ttft` / `slo_tpot`, or a request's own targets, docs/scheduling.md): with
a TPOT target, while streams are decoding each step's prefill tokens are capped so the
step's predicted time (a `StepCostEstimator` the engine feeds with its own step times)
stays within the target, and a request is admitted only if one more decoding stream keeps
a decode step within it (under priority, only the streams ranked no worse count). Under
fcfs, with a TTFT target, waiting requests that can no longer meet it go behind those
that can. `predict_ttft` estimates a new request's TTFT (early rejection).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.batch import KVTransfers, NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.engine.block_manager import HybridKVBlockManager, KVBlockManager
from tokenmill.engine.kv_tiers import DiskTier
from tokenmill.engine.kv_transfer import KVConnector, RemotePrefill, wants_remote_decode
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.step_cost import ForecastError, StepCostEstimator

logger = logging.getLogger(__name__)

# The priority step bound (`priority_step_fraction`): a priority level counts as "likely to
# arrive" for this long after its last arrival (or twice its median gap between arrivals,
# when that is longer), and its unloaded TTFT is predicted from its last few prompts.
PRIORITY_GUARD_SECONDS = 30.0
PRIORITY_GUARD_HISTORY = 16
# The disk tier's read-ahead looks at this many requests at the head of the queue each step
# (the ones admitted next; a bounded cost per step however long the queue).
READ_AHEAD_WINDOW = 4

@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"  # or "priority"
    priority_aging: float | None = None  # seconds of waiting worth one priority level
    slo_ttft: float | None = None  # seconds: SLO mode's time-to-first-token target
    slo_tpot: float | None = None  # seconds: SLO mode's time-per-output-token target
    # Under priority: while a better priority is waiting or arrived lately, a worse-priority
    # prefill step is kept within this fraction of that priority's unloaded TTFT (0: off).
    priority_step_fraction: float = 0.0

    @property
    def by_priority(self) -> bool:
        return self.policy == "priority"


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # The host KV tier (all 0 without one): vLLM's external prefix cache counters (tokens),
    # its copies and its occupancy (blocks).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_blocks: int = 0  # capacity
    kv_offload_used_blocks: int = 0
    kv_offload_bytes_per_block: int = 0
    kv_offload_stored_blocks: int = 0  # pool -> host
    kv_offload_loaded_blocks: int = 0  # host -> pool
    kv_offload_evicted_blocks: int = 0
    kv_offload_stores_skipped: int = 0
    # The disk tier below it (all 0 without one; capacity 0 also when it was turned off).
    kv_disk_enabled: int = 0
    kv_disk_max_bytes: int = 0  # capacity: --kv-offloading-disk-size (0: no disk tier, or off)
    kv_disk_used_blocks: int = 0
    kv_disk_used_bytes: int = 0  # the files' sizes: header, block record, KV
    kv_disk_bytes_per_block: int = 0  # a file without its record: header and KV
    kv_disk_stored_blocks: int = 0  # files written (host tier -> disk)
    kv_disk_loaded_blocks: int = 0  # disk -> pool
    kv_disk_evicted_blocks: int = 0
    kv_disk_corrupt_blocks: int = 0
    kv_disk_read_ahead_blocks: int = 0  # files read in the background before admission
    kv_disk_reading_requests: int = 0  # requests waiting for their files now
    kv_disk_hit_tokens: int = 0
    # Prefill-decode disaggregation (0 without a connector): a producer's held blocks and
    # requests, blocks it served and holds that timed out; a consumer's pulled blocks, the
    # requests waiting for their KV, and pulls that failed.
    kv_transfer_role: str = ""  # "" without a connector, else kv_producer | kv_consumer | kv_both
    kv_transfer_held_blocks: int = 0
    kv_transfer_held_requests: int = 0
    kv_transfer_sent_blocks: int = 0
    kv_transfer_expired_requests: int = 0
    kv_transfer_pulled_blocks: int = 0
    kv_transfer_pulling_requests: int = 0
    kv_transfer_failed_pulls: int = 0
    kv_transfer_shared_memory_blocks: int = 0  # of the pulled blocks, copied from a producer's shared memory


# SLO mode learns how far its TTFT forecasts run over from those of at least this share
# of the target.
FORECAST_MIN_SHARE = 0.25


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVBlockManager | HybridKVBlockManager,
                 clock: Callable[[], float] = time.monotonic, step_cost: StepCostEstimator | None = None) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.step_cost = step_cost  # SLO mode's predictions (None: no limits from it)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_since_last_step: list[str] = []
        # What the runner side has been sent of each running request: (tokens, blocks).
        self._sent: dict[str, tuple[int, int]] = {}
        # Prefill-decode disaggregation (engine/kv_transfer.py): the transport, the requests
        # whose prompt KV is being pulled, and the pulled bytes for this step's runner.
        self.connector: KVConnector | None = None
        self.pulling: dict[str, Request] = {}
        # Requests aborted while a connector that writes in place pulled into their blocks:
        # freed when the pull is reported, never under the writer.
        self._aborted_pulls: dict[str, Request] = {}
        self._remote_loads: list[tuple[bytes, int]] = []
        self._hold_ids = itertools.count()
        # The disk KV tier's read-ahead: requests near the head of the queue whose prefix
        # continues in disk files wait outside the queues while a background thread reads
        # them (vLLM's WAITING_FOR_REMOTE_KVS), so no step waits on the disk; each with the
        # blocks being read.
        self.reading: dict[str, tuple[Request, list[bytes]]] = {}
        # Under priority with a step bound: each priority level's latest arrivals, as
        # (arrival time, prompt tokens to compute).
        self._arrivals: dict[int, deque[tuple[float, int]]] = {}
        # SLO mode: how far its TTFT forecasts run over on this machine (engine/step_cost.py).
        self.ttft_forecast_error = ForecastError()

    # ----- admission -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request the input processor admitted (it checked that the request
        can run to completion within max_model_len and the KV cache)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if self.config.by_priority and self.config.priority_step_fraction > 0:
            recent = self._arrivals.setdefault(request.priority, deque(maxlen=PRIORITY_GUARD_HISTORY))
            recent.append((request.arrival_time, self._prompt_cost_tokens(request)))
        self._enqueue(request)

    def rank(self, request: Request) -> tuple[float, float]:
        """The priority policy's order, smaller first: (priority, arrival), or with aging
        the arrival time pushed back by priority x aging seconds. Both terms are fixed at
        arrival, so the queues' order never changes while requests wait."""
        return self.rank_of(request.priority, request.arrival_time)

    def rank_of(self, priority: int, arrival_time: float) -> tuple[float, float]:
        """`rank` of a request with this priority and arrival time (one not queued yet)."""
        aging = self.config.priority_aging
        if aging is None:
            return (priority, arrival_time)
        return (arrival_time + priority * aging, arrival_time)

    # ----- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.connector is not None:
            self.poll_connector()
            self._start_pulls()
        self._read_ahead()
        if self.config.by_priority:
            scheduled, preempted = self._schedule_by_rank()
        else:
            scheduled, preempted = self._schedule_fcfs()
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        transfers = self.kv.take_transfers()
        if self._remote_loads:
            transfers = transfers if transfers is not None else KVTransfers(num_host_blocks=0)
            transfers.remote_load, self._remote_loads = self._remote_loads, []
        return SchedulerOutput(scheduled=scheduled, preempted_ids=preempted, finished_ids=finished,
                               kv_transfers=transfers)

    # ----- prefill-decode disaggregation ---------------------------------------------

    def poll_connector(self) -> bool:
        """Free the holds the connector released (pulled or timed out), and take the pulls
        that finished: their requests run from the next schedule on (their bytes are copied
        in before that step's forward). True when anything changed."""
        connector = self.connector
        if connector is None:
            return False
        released = connector.released()
        for key in released:
            self.kv.free_id(key)
        pulled = connector.take_pulled()
        for result in pulled:
            request = self.pulling.pop(result.request_id, None)
            if request is None:  # aborted while its pull ran: the connector is done with its blocks now
                aborted = self._aborted_pulls.pop(result.request_id, None)
                if aborted is not None:
                    self.kv.free(aborted)
                continue
            if result.payloads is None:
                self._pull_failed(request, result.error or "the pull failed")
                continue
            num_load = request.num_prompt_tokens - 1
            if not result.written:
                blocks = self.kv.get_block_ids(request.request_id)
                first = self.kv.blocks_needed(num_load) - len(result.payloads)
                self._remote_loads.extend(zip(result.payloads, blocks[first:]))
            request.num_computed_tokens = num_load
            self.kv.mark_computed(request, num_load)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            if self.config.by_priority:  # running is kept in rank order
                bisect.insort_right(self.running, request, key=self.rank)
            else:
                self.running.append(request)
        return bool(released or pulled)

    def _pull_failed(self, request: Request, error: str) -> None:
        """kv_load_failure_policy "recompute" (vLLM's default): the prompt is computed here."""
        logger.warning("%s: KV pull failed (%s); recomputing its prompt", request.request_id, error)
        self.kv.free(request)
        request.kv_transfer_params = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._enqueue(request, front=True)

    def _start_pulls(self) -> None:
        """Waiting requests whose prompt KV a producer holds: allocate blocks for all but the
        last prompt token (its logits are needed: it is computed here, as vLLM's consumer
        does), taking local prefix-cache hits first, and pull the rest. They wait outside
        the queues meanwhile."""
        if not self.connector.is_consumer:
            return
        remote_prefills = [r for r in self.waiting if (r.kv_transfer_params or {}).get("do_remote_prefill")]
        for request in remote_prefills:
            remote = RemotePrefill.from_params(request.kv_transfer_params)
            num_load = request.num_prompt_tokens - 1
            if num_load < 1 or request.num_preemptions or request.params.prompt_logprobs is not None:
                request.kv_transfer_params = None  # nothing to pull: an ordinary request
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_hit_tokens = min(num_hit_tokens, num_load)
            needed = self.kv.blocks_needed(num_load)
            if len(remote.block_ids) < needed:
                logger.warning("%s: the producer holds %d blocks, %d needed; recomputing its prompt",
                               request.request_id, len(remote.block_ids), needed)
                request.kv_transfer_params = None
                continue
            if not self.kv.allocate_slots(request, num_load - num_hit_tokens, hits, written_now=False):
                break  # no room now: it waits, in order
            self.waiting.remove(request)
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_hit_tokens
            request.num_cached_tokens = num_hit_tokens
            self.pulling[request.request_id] = request
            first = num_hit_tokens // self.kv.block_size
            local = self.kv.get_block_ids(request.request_id)[first:needed]
            self.connector.start_pull(request.request_id, remote, list(remote.block_ids[first:needed]), local)

    # ----- the disk tier's read-ahead -------------------------------------------------

    def _read_ahead(self) -> None:
        """Requests whose files are read go back to the queue, in front (fcfs) or at their
        rank; then the first few waiting requests whose prefix continues on disk start
        their reads and wait outside the queue. Their admission then takes the bytes read
        (get_computed_blocks, unchanged): the engine thread reads no file for them."""
        disk = getattr(getattr(self.kv, "host_tier", None), "disk", None)
        if disk is None:
            return
        for request_id, (request, hashes) in list(self.reading.items()):
            if disk.reads_done(hashes):
                del self.reading[request_id]
                request.status = RequestStatus.WAITING
                self._enqueue(request, front=True)
        for request in list(itertools.islice(self.waiting, READ_AHEAD_WINDOW)):
            hashes = self.kv.disk_blocks_to_read(request)
            if hashes:
                disk.start_reads(hashes)
                self.waiting.remove(request)
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.reading[request.request_id] = (request, hashes)

    def wait_for_kv(self, timeout: float) -> None:
        """Nothing to schedule but KV in flight (a disaggregated pull, a disk read-ahead):
        wait for some instead of spinning."""
        if self.pulling and self.connector is not None:
            self.connector.wait(timeout)
        elif self.reading:
            self.kv.host_tier.disk.wait_for_reads(timeout)

    def _schedule_fcfs(self) -> tuple[list[ScheduledRequest], list[str]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        # SLO mode's limit on this step's prefill tokens (None: none)
        prefill_left = self._prefill_cap(*self._allowances())
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_known = request.num_tokens - request.num_computed_tokens
            num_new = min(num_known + len(self._proposals(request)), budget)
            if prefill_left is not None and num_known > 1:  # a prefill chunk (or a recomputation)
                if prefill_left == 0:
                    i += 1
                    continue
                num_new = min(num_new, prefill_left)
                prefill_left -= num_new
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # the request preempted itself: it was the last running one
            scheduled.append(self._schedule(request, num_new))
            budget -= num_new
            i += 1

        late = self._late_to_the_back() if self._any_ttft_target() else set()
        # A step that had to preempt is short of memory: admitting would only thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if prefill_left == 0 or not self._slo_may_admit(request, self.running):
                break
            if request.request_id in late and self.running:
                break  # SLO mode: what missed its TTFT target runs only when nothing else does
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if prefill_left is not None:
                num_new = min(num_new, prefill_left)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            if prefill_left is not None:
                prefill_left -= num_new
            self.waiting.popleft()
            self._admit(request, num_hit_tokens)
            scheduled.append(self._schedule(request, num_new))
            budget -= num_new
        return scheduled, preempted

    # ----- SLO mode ------------------------------------------------------------------

    def _ttft(self, request: Request) -> float | None:
        """The request's TTFT aim: its own target, else the engine's (None: none)."""
        return request.slo_ttft if request.slo_ttft is not None else self.config.slo_ttft

    def _tpot(self, request: Request) -> float | None:
        return request.slo_tpot if request.slo_tpot is not None else self.config.slo_tpot

    def _any_ttft_target(self) -> bool:
        return self.config.slo_ttft is not None or any(r.slo_ttft is not None for r in self.waiting)

    def _decode_rows(self) -> int:
        return sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)

    def _prefill_left(self, request: Request) -> int:
        """The tokens `request` still has to compute before it samples: what is not
        computed, less what the prefix cache holds for one not yet admitted."""
        left = request.num_tokens - request.num_computed_tokens
        if request.status != RequestStatus.WAITING:
            return left
        # Queued: its block hashes are kept (freed with it); else a prediction for one not added.
        return left - self._cached(request)

    def _prompt_cost_tokens(self, request: Request) -> int:
        """The prompt tokens `request` computes (or computed) once: its prompt less its
        prefix-cache hit."""
        if request.first_scheduled_time is not None:
            return request.num_prompt_tokens - request.num_cached_tokens
        return request.num_prompt_tokens - min(self._cached(request), request.num_prompt_tokens)

    def _cached(self, request: Request) -> int:
        if request.request_id in self.requests:
            return self.kv.get_computed_blocks(request)[1]
        return self.kv.peek_cached_tokens(request)

    def _allowances(self) -> tuple[int, list[tuple[Request, float]]]:
        """(decode rows, [(stream, the longest step it allows)]) over the decoding streams
        with a TPOT target; no allowances while the step cost is unknown."""
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        targeted = [(r, t) for r in decoding if (t := self._tpot(r)) is not None]
        cost = self.step_cost
        if cost is None or not targeted or cost.coefficients is None:
            return len(decoding), []
        now = self.clock()
        decode_step = cost.predict(0, len(decoding) + 1)
        return len(decoding), [(r, self._step_allowance(r, now, t, decode_step)) for r, t in targeted]

    def _prefill_cap(self, rows: int, allowances: list[tuple[Request, float]]) -> int | None:
        """The prefill tokens a step may take so that every stream in `allowances` keeps
        its mean time per output token (what TPOT measures) within its target, counting
        the time it has saved so far and will save on its remaining decode steps (each
        predicted at the decode step of the running streams plus one) when those are
        shorter than the target. 0 when there is nothing to spend: prompts in progress
        wait for decode steps to save some. None: no limit (no stream to protect, or no
        cost known yet)."""
        if not allowances or self.step_cost is None:
            return None
        return self.step_cost.max_prefill_tokens(rows, min(a for _, a in allowances))

    @staticmethod
    def _step_allowance(request: Request, now: float, tpot: float, decode_step: float) -> float:
        """The longest step that keeps `request`'s mean time per output token within
        `tpot`: its N - 1 intervals (N: the tokens it will have at max_tokens) take the
        time since its first token, this step, and `decode_step` for each of the rest."""
        if request.first_token_time is None:
            return tpot
        total = request.max_tokens
        remaining = total - request.num_output_tokens
        return tpot * (total - 1) - (now - request.first_token_time) - max(remaining - 1, 0) * decode_step

    def _slo_may_admit(self, request: Request, streams: list[Request]) -> bool:
        """One more stream (`request`) keeps a step of `streams` and it within the TPOT
        targets of all of them that have one: a decode step of all of them plus the
        prefill they need per step to be replaced, each stream's prompt cost spread over
        its output tokens. Without that share the streams fill the target with decode
        alone, no step has time left for a prompt, and new requests miss their TTFT
        while the machine serves fewer than it could. (A request of one output token never
        decodes: its prompt is a one-off the prefill cap spaces out.) Always true when
        nothing has a target or the cost is not known yet."""
        cost = self.step_cost
        targets = [t for r in (*streams, request) if (t := self._tpot(r)) is not None]
        coefficients = cost.coefficients if cost is not None else None
        if coefficients is None or not targets or not streams:
            return True
        per_prefill_token = coefficients[1]
        share = sum(per_prefill_token * self._prompt_cost_tokens(r) / r.max_tokens
                    for r in (*streams, request) if r.max_tokens > 1)
        return cost.predict(0, len(streams) + 1) + share <= min(targets)

    def _late_to_the_back(self) -> set[str]:
        """Requests still waiting for their first token that have missed their TTFT
        target, or are predicted to miss it behind the on-time requests queued ahead of
        them, go behind the others (in arrival order): they are lost to goodput, the
        others not yet. Under overload a queue served in arrival order makes every request
        wait about as long, so all of them end just past the target; giving up on the
        requests the queue ahead already dooms keeps the ones behind in time. Returns
        their ids."""
        now = self.clock()
        first_token_in = self._first_token_predictor(self.running, in_flight=False)
        rows = self._decode_rows()
        budget = self.config.max_num_batched_tokens
        on_time_tokens = on_time_count = 0  # the prompts of the on-time requests ahead
        stretch = self.ttft_forecast_error.factor(now)

        def late(request: Request) -> bool:
            ttft = self._ttft(request)
            if ttft is None or request.num_output_tokens > 0:
                return False
            waited = now - request.arrival_time
            if first_token_in is not None:
                forecast = first_token_in(on_time_tokens + self._prefill_left(request), on_time_count)
                is_late = waited + forecast * stretch > ttft
                if not request.ttft_judged:  # learn from the first forecast of each request
                    request.ttft_judged = True
                    # (a short one only measures the step in flight, not a queue's wait)
                    learn = not is_late and forecast >= FORECAST_MIN_SHARE * ttft
                    request.ttft_forecast = (now, forecast) if learn else None
                elif is_late and request.ttft_forecast is not None:
                    # Forecast on time, now late: its wait had it stayed is the best guess
                    # (leaving it out would learn only from the forecasts that held).
                    judged_at, first = request.ttft_forecast
                    self.ttft_forecast_error.observe(first, now - judged_at + forecast, now)
                    request.ttft_forecast = None
                return is_late
            step = self.step_cost.predict(min(self._prefill_left(request), budget), rows) if self.step_cost else None
            return waited + (step or 0.0) > ttft

        missed = []
        for request in self.waiting:
            if late(request):
                missed.append(request)
            elif (left := self._prefill_left(request)) > 1:
                on_time_tokens, on_time_count = on_time_tokens + left, on_time_count + 1
            else:
                on_time_count += 1
        if missed:
            ids = {r.request_id for r in missed}
            self.waiting = deque([r for r in self.waiting if r.request_id not in ids] + missed)
        return {r.request_id for r in missed}

    def predict_ttft(self, request: Request) -> float | None:
        """Roughly the seconds until `request` (not added yet) would get its first token:
        the prompt tokens queued ahead of it and its own, computed at the rate the learned
        step cost and the decoding streams' TPOT targets allow, after the wait for a
        sequence slot when none is free. Under priority only requests ranked no worse
        than it are ahead (the others give way or are preempted). None while the step
        cost is not known (early rejection then admits)."""

        def ahead_of_it(queue: list[Request] | deque[Request]) -> list[Request]:
            if not self.config.by_priority:
                return list(queue)
            return [r for r in queue if self.rank(r) <= self.rank(request)]

        running, waiting = ahead_of_it(self.running), ahead_of_it(self.waiting)
        first_token_in = self._first_token_predictor(running, in_flight=True)
        if first_token_in is None:
            return None
        left = [self._prefill_left(r) for r in (*running, *waiting)]
        tokens = sum(n for n in left if n > 1) + self._prefill_left(request)
        return first_token_in(tokens, len(waiting))

    def _first_token_predictor(self, running: list[Request], in_flight: bool) -> Callable[[int, int], float] | None:
        """f(prompt tokens to compute, requests queued ahead) -> seconds until the last of
        those tokens is computed beside `running` (the prompts left of running requests
        count among the tokens): steps at the learned cost, each taking what the decoding
        streams' TPOT targets leave for prefill, after the wait for a sequence slot when
        none is free; `in_flight`: plus the step running now. None while the step cost is
        not known."""
        cost = self.step_cost
        if cost is None or cost.coefficients is None:
            return None
        b0, b1, b2 = cost.coefficients
        rows = self._decode_rows()
        overhead = b0 + b2 * rows  # what a step costs beside its prefill tokens
        budget = self.config.max_num_batched_tokens
        tpots = [t for r in running if (t := self._tpot(r)) is not None]
        slots = self.config.max_num_seqs
        per_step = budget
        if tpots and rows:  # prefill gets what a step of at most the tightest target leaves
            tpot = min(tpots)
            per_step = min(budget, int((tpot - overhead) / b1) if b1 > 0 else budget)
            slots = min(slots, max(int((tpot - b0) / b2) if b2 > 0 else slots, 1))
        decode_step = cost.predict(0, max(rows, 1))
        remaining = sorted(r.max_tokens - r.num_output_tokens for r in running)
        # The step running now runs to its end (a cut is for better-ranked arrivals, not
        # for this forecast): as long as the last one, say.
        current = ((cost.last_seconds or overhead) if running else 0.0) if in_flight else 0.0

        def first_token_in(tokens: int, queued_ahead: int) -> float:
            # A sequence slot: the streams that must end first, at the decode step they run at.
            need = len(running) + queued_ahead + 1 - slots
            wait = remaining[min(need, len(remaining)) - 1] * decode_step if need > 0 and remaining else 0.0
            step_tokens = per_step
            if step_tokens < 1:  # the decode step alone uses the targets up: prompts wait for streams to end
                wait = max(wait, (remaining[0] if remaining else 1) * decode_step)
                step_tokens = budget
            steps = -(-tokens // step_tokens)
            return current + wait + steps * overhead + b1 * tokens

        return first_token_in

    def _schedule_by_rank(self) -> tuple[list[ScheduledRequest], list[str]]:
        """One pass over the running and the waiting queue (each in rank order) merged:
        the better-ranked of the two heads goes next. Everyone behind the cursor ranks no
        better than the request in hand, so the victims (the tail of `running`) were not
        scheduled in this step, and a victim is never re-admitted in the step that
        preempted it (everything waiting behind it ranks worse still).

        SLO mode: a prefill chunk (of a running or an admitted request) is capped so the
        step keeps the TPOT targets of the decoding streams ranked no worse than it; the
        worse-ranked streams' targets give way."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        rows, allowances = self._allowances()
        guards = self._priority_guards()
        prefill = 0  # prefill tokens scheduled so far in this step
        prefill_priority: int | None = None  # the best priority among them
        # The step bound: the best priority whose first token this step samples (its TTFT
        # is this step: worse priorities add nothing to it, not even decodes)
        first_token_priority: int | None = None
        bound = bool(guards)
        i = 0  # running[:i] were visited; running[i:] rank no better than anything admitted now
        admitting = True
        while budget > 0:
            request = self.running[i] if i < len(self.running) else None
            head = self.waiting[0] if admitting and self.waiting else None
            if head is not None and head.request_id in preempted:
                admitting, head = False, None
            if request is None and head is None:
                break
            if request is not None and (head is None or self.rank(request) <= self.rank(head)):
                num_known = request.num_tokens - request.num_computed_tokens
                num_new = min(num_known + len(self._proposals(request)), budget)
                if bound and first_token_priority is not None and first_token_priority < request.priority:
                    i += 1  # the step bound: a better priority's first token is in this step
                    continue
                if num_known > 1:  # a prefill chunk (or a recomputation)
                    cap = _least(self._rank_cap(request, rows, allowances, prefill),
                                 self._guard_cap(request, rows, guards, prefill, prefill_priority))
                    if cap == 0:
                        i += 1  # waits for decode steps to save time, or for a step without better work
                        continue
                    num_new = min(num_new, cap if cap is not None else num_new)
                    prefill += num_new
                    prefill_priority = _least(prefill_priority, request.priority)
                if self._allocate_or_preempt(request, num_new, preempted):
                    scheduled.append(self._schedule(request, num_new))
                    if scheduled[-1].sample and request.num_output_tokens == 0:
                        first_token_priority = _least(first_token_priority, request.priority)
                    budget -= num_new
                    i += 1
                continue  # (a request that preempted itself was the tail: running[i:] is empty)
            cap = _least(self._rank_cap(head, rows, allowances, prefill),
                         self._guard_cap(head, rows, guards, prefill, prefill_priority))
            better = [r for r in self.running if self.rank(r) < self.rank(head)]
            num_new = None
            if cap != 0 and self._slo_may_admit(head, better):
                num_new = self._admit_by_rank(head, i, min(budget, cap if cap is not None else budget), preempted)
            if num_new is None:
                admitting = False  # strict order: nothing worse-ranked jumps the head
                continue
            prefill += num_new
            prefill_priority = _least(prefill_priority, head.priority)
            scheduled.append(self._schedule(head, num_new))
            if scheduled[-1].sample and head.num_output_tokens == 0:
                first_token_priority = _least(first_token_priority, head.priority)
            budget -= num_new
            i += 1
        return scheduled, preempted

    def _rank_cap(self, request: Request, rows: int, allowances: list[tuple[Request, float]],
                  prefill: int) -> int | None:
        """What is left for `request`'s prefill of this step's cap, counting only the
        allowances of streams ranked no worse than it (None: no limit)."""
        rank = self.rank(request)
        cap = self._prefill_cap(rows, [(r, a) for r, a in allowances if r is not request and self.rank(r) <= rank])
        return None if cap is None else max(cap - prefill, 0)

    def _priority_guards(self) -> list[tuple[int, float]]:
        """The priority step bound's levels for this step: [(priority, the longest step a
        worse priority's prefill may make)], for every priority level that has requests
        waiting or arrived within its guard window (PRIORITY_GUARD_SECONDS, or twice its
        median gap between arrivals when longer): `priority_step_fraction` x its unloaded
        TTFT, a step of its median recent prompt alone at the learned step cost. Empty when
        off or while the step cost is not known."""
        fraction = self.config.priority_step_fraction
        cost = self.step_cost
        if fraction <= 0 or not self._arrivals or cost is None or cost.coefficients is None:
            return []
        now = self.clock()
        waiting = {r.priority for r in self.waiting}
        guards = []
        for priority, recent in self._arrivals.items():
            times = [t for t, _ in recent]
            gaps = sorted(b - a for a, b in zip(times, times[1:]))
            window = max(PRIORITY_GUARD_SECONDS, 2 * gaps[len(gaps) // 2] if gaps else 0.0)
            if priority in waiting or now - times[-1] <= window:
                tokens = sorted(n for _, n in recent)[len(recent) // 2]
                guards.append((priority, fraction * cost.predict(tokens, 0)))
        return guards

    def _guard_cap(self, request: Request, rows: int, guards: list[tuple[int, float]], prefill: int,
                   prefill_priority: int | None) -> int | None:
        """The priority step bound's limit on `request`'s prefill chunk (None: none). A step
        cannot be interrupted, so a better-priority request that arrives while it runs
        waits for it: while better priorities are likely, the step is kept within the
        least of their limits (`_priority_guards`), but takes at least one KV block of
        prefill (the worse priority progresses). A step that already prefills a better
        priority adds none: its TTFT is this step."""
        limits = [limit for priority, limit in guards if priority < request.priority]
        if not limits:
            return None
        if prefill_priority is not None and prefill_priority < request.priority:
            return 0
        tokens = self.step_cost.max_prefill_tokens(rows, min(limits))
        if tokens is None:
            return None
        return max(tokens - prefill, 0) if prefill else max(tokens, self.kv.block_size)

    def _admit_by_rank(self, request: Request, index: int, budget: int, preempted: list[str]) -> int | None:
        """Admit the head of waiting at running[index], preempting worse-ranked running
        requests (from the tail) for a sequence slot or KV memory, but only when enough
        of them are worse-ranked to make room. The tokens scheduled, or None (nothing
        changed but what had to be preempted)."""
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit_tokens, budget)
        rank = self.rank(request)
        worse = [r for r in self.running[index:] if self.rank(r) > rank]
        room_seqs = self.config.max_num_seqs - (len(self.running) - len(worse))
        room_blocks = self.kv.num_free_blocks + sum(len(self.kv.get_block_ids(r.request_id)) for r in worse)
        # Blocks the hit brings from the pool (a host-tier hit needs new ones; a hybrid
        # cache's hits are a pair of tables)
        hit_blocks = len(hits) if isinstance(hits, list) else num_hit_tokens // self.kv.block_size
        if room_seqs < 1 or self.kv.blocks_needed(num_hit_tokens + num_new) - hit_blocks > room_blocks:
            return None  # preempting every worse-ranked request would not make room
        while len(self.running) >= self.config.max_num_seqs or not self.kv.allocate_slots(request, num_new, hits):
            if len(self.running) <= index or self.rank(self.running[-1]) <= rank:
                return None
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
        self.waiting.remove(request)
        self._admit(request, num_hit_tokens, index)
        return num_new

    def update_from_output(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Append the sampled tokens, each checked against the token-level stop conditions
        (a stop ends the run there: later tokens are dropped), and roll back the KV of
        rejected proposals. Returns the requests that got new tokens this step (finished
        ones included); `request.num_new_output_tokens` says how many."""
        updated: list[Request] = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or not item.sample:
                continue
            if request.pooling_params is not None:  # prefilled: its vector ends it, and frees its KV
                request.pooled_output = runner_output.pooled[item.request_id]
                request.num_new_output_tokens = 0
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                updated.append(request)
                continue
            tokens = runner_output.sampled_token_ids[item.request_id]
            # Accepted proposals already have their KV; the last token's is computed next step.
            rejected = len(item.spec_token_ids) - (len(tokens) - 1)
            if rejected < 0:
                raise RuntimeError(f"{item.request_id}: {len(tokens)} tokens for {len(item.spec_token_ids)} proposals")
            # Their slots stay allocated (the request grows into them) and are overwritten.
            request.num_computed_tokens -= rejected
            request.num_new_output_tokens = 0
            if request.first_token_time is None:
                request.first_token_time = self.clock()
                if request.ttft_forecast is not None:
                    judged_at, forecast = request.ttft_forecast
                    self.ttft_forecast_error.observe(forecast, request.first_token_time - judged_at,
                                                     request.first_token_time)
            for token_id in tokens:
                request.append_output_token(token_id)
                request.num_new_output_tokens += 1
                status = request.check_stop_token()
                if status is not None:
                    self._finish(request, status)
                    break
            updated.append(request)
        return updated

    def put_back(self, output: SchedulerOutput) -> None:
        """The step `output` was cut short before anything it computed counted
        (engine/interrupt.py): its requests are as they were before it was scheduled, so
        the next step computes the same tokens again. Blocks it offered to the prefix
        cache leave it (their KV is not all written). The requests it admitted go back to
        the queue at their rank, their blocks freed: a prefix hit one took may be a block
        this very step was to write. Requests it preempted stay preempted."""
        items = [(request, item) for item in output.scheduled
                 if (request := self.requests.get(item.request_id)) is not None
                 and request.status == RequestStatus.RUNNING]
        for request, item in items:
            self.kv.unhash_from(request, item.start_pos)
            request.num_computed_tokens = item.start_pos
        for request, item in items:
            if item.new is None:
                continue
            self.running.remove(request)
            self.kv.uncount_admission(request, item.start_pos)  # counted again when it is admitted again
            self.kv.free(request)
            self._sent.pop(request.request_id, None)
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            if request.num_preemptions == 0:
                request.first_scheduled_time = None  # it is first scheduled when it runs
            self._enqueue(request, front=True)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Stop requests from outside the step (abort, stop string). Unknown or
        already finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    # ----- queries -------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.num_preemptions,
            **self._host_tier_stats(),
            **self._kv_transfer_stats(),
        )

    def _kv_transfer_stats(self) -> dict[str, int]:
        if self.connector is None:
            return {}
        c = self.connector.stats()
        role = ("kv_both" if self.connector.is_consumer else "kv_producer") if self.connector.is_producer \
            else "kv_consumer"
        return dict(kv_transfer_role=role, kv_transfer_held_blocks=c.held_blocks,
                    kv_transfer_held_requests=c.held_requests,
                    kv_transfer_sent_blocks=c.sent_blocks, kv_transfer_expired_requests=c.expired_requests,
                    kv_transfer_pulled_blocks=c.pulled_blocks, kv_transfer_pulling_requests=len(self.pulling),
                    kv_transfer_failed_pulls=c.failed_pulls, kv_transfer_shared_memory_blocks=c.shared_memory_blocks)

    def _host_tier_stats(self) -> dict[str, int]:
        host = getattr(self.kv, "host_tier", None)
        if host is None:
            return {}
        return dict(
            external_prefix_cache_queries=self.kv.stats.external_queries,
            external_prefix_cache_hits=self.kv.stats.external_hits,
            kv_offload_blocks=host.num_blocks, kv_offload_used_blocks=len(host),
            kv_offload_bytes_per_block=host.bytes_per_block, kv_offload_stored_blocks=host.stats.stored_blocks,
            kv_offload_loaded_blocks=host.stats.loaded_blocks, kv_offload_evicted_blocks=host.stats.evicted_blocks,
            kv_offload_stores_skipped=host.stats.rejected_blocks,
            **self._disk_tier_stats(host.disk), kv_disk_reading_requests=len(self.reading),
        )

    @staticmethod
    def _disk_tier_stats(disk: DiskTier | None) -> dict[str, int]:
        if disk is None:
            return {}
        return dict(
            kv_disk_enabled=int(disk.enabled), kv_disk_max_bytes=disk.max_bytes if disk.enabled else 0,
            kv_disk_used_blocks=len(disk), kv_disk_used_bytes=disk.nbytes_used, kv_disk_bytes_per_block=disk.file_bytes,
            kv_disk_stored_blocks=disk.stats.stored_blocks, kv_disk_loaded_blocks=disk.stats.loaded_blocks,
            kv_disk_evicted_blocks=disk.stats.evicted_blocks, kv_disk_corrupt_blocks=disk.stats.corrupt_blocks,
            kv_disk_hit_tokens=disk.stats.hit_tokens, kv_disk_read_ahead_blocks=disk.stats.read_ahead_blocks,
        )

    # ----- internals -----------------------------------------------------------------

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        """Allocate for `request`, preempting from the tail of running as needed (the
        newest requests under fcfs, the worst-ranked under priority). False when
        `request` itself had to be preempted."""
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, num_hit_tokens: int, index: int | None = None) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        self.running.insert(len(self.running) if index is None else index, request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into waiting: at its rank under priority; else at the back, or at the front
        (a preempted request goes first again)."""
        if self.config.by_priority:
            bisect.insort_right(self.waiting, request, key=self.rank)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        """Free everything and requeue at the head; the tokens generated so far are
        kept and recomputed (from whatever prefix is still cached) on re-admission."""
        self.kv.free(request)
        self._sent.pop(request.request_id, None)
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    @staticmethod
    def _proposals(request: Request) -> list[int]:
        """The request's proposed tokens that may be verified now: only once its known
        tokens are all computed but the last, not while min_tokens still bans EOS/stop ids
        (the ban changes with every accepted token), and no more than could ever become
        output (its final token needs no KV slot), which keeps it within max_model_len and
        within the KV slots admission counted on."""
        if not request.spec_token_ids or request.num_tokens - request.num_computed_tokens != 1:
            return []
        if request.num_output_tokens < request.params.min_tokens:
            return []
        room = request.num_prompt_tokens + request.max_tokens - 1 - request.num_tokens
        return request.spec_token_ids[: max(room, 0)]

    def _schedule(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        num_known = min(num_new, request.num_tokens - start)
        spec = self._proposals(request)[: num_new - num_known]
        request.spec_token_ids = []  # consumed: verified in this step, or dropped
        end = start + num_known
        request.num_computed_tokens = end + len(spec)
        rid = request.request_id
        block_ids = self.kv.get_block_ids(rid)
        sent = self._sent.get(rid)
        new = None
        if sent is None:  # first time, or again after a preemption: the whole request
            new = NewRequestData(request.prompt_token_ids, request.params, request.pooling_params)
            sent = (request.num_prompt_tokens, 0)
        self._sent[rid] = (request.num_tokens, len(block_ids))
        sliding = self.kv.get_sliding_block_ids(rid)[sent[1]:] if isinstance(self.kv, HybridKVBlockManager) else []
        return ScheduledRequest(
            request_id=rid,
            start_pos=start,
            num_new_tokens=num_known,
            appended_token_ids=request.all_token_ids[sent[0]:],
            new_block_ids=block_ids[sent[1]:],
            sample=end == request.num_tokens,
            new=new,
            spec_token_ids=spec,
            banned_token_ids=request.banned_token_ids(),
            prompt_logprobs_targets=self._prompt_logprob_targets(request, start, end),
            new_sliding_block_ids=sliding,
        )

    @staticmethod
    def _prompt_logprob_targets(request: Request, start: int, end: int) -> list[int] | None:
        """Position p predicts prompt token p + 1; only prompt positions count."""
        if request.params.prompt_logprobs is None or start >= request.num_prompt_tokens - 1:
            return None
        return request.prompt_token_ids[start + 1 : min(end, request.num_prompt_tokens - 1) + 1]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            pulled_here = self.pulling.pop(request.request_id, None) is not None
            self.reading.pop(request.request_id, None)  # (a disk read-ahead: nothing allocated yet)
            if pulled_here and self.connector is not None and self.connector.writes_in_place:
                self._aborted_pulls[request.request_id] = request
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        connector = self.connector
        if (connector is not None and connector.is_producer and status == RequestStatus.FINISHED_LENGTH
                and wants_remote_decode(request.kv_transfer_params) and self.kv.get_block_ids(request.request_id)):
            # A disaggregated prefill: its blocks stay until a consumer pulls them (or a timeout).
            key = f"{request.request_id}-kv{next(self._hold_ids)}"
            request.kv_transfer_params_out = connector.hold(key, self.kv.hold(request, key))
        elif request.request_id not in self._aborted_pulls:
            self.kv.free(request)
        self._sent.pop(request.request_id, None)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)


def _least(a: int | None, b: int | None) -> int | None:
    """The smaller of two limits, None meaning no limit."""
    return b if a is None else a if b is None else min(a, b)
