"""Prometheus metrics named as vLLM's, with a `tokenmill:` prefix.

Gauges and engine counters are read from the engine's latest stats snapshot
when /metrics is scraped (a collector), so they can never drift from what the
engine counted. Per-request histograms and the success counter are observed by
the engine thread as requests progress and finish; speculative decoding's counters
(vLLM's `spec_decode_*`) from each step's record. Each server owns a private
CollectorRegistry, so two servers in one process (tests) do not collide.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.config import EngineFacts
from tokenmill.engine.engine import EngineStats, SpecDecodeStats, StepObserver, StepRecord
from tokenmill.outputs import RequestOutput

PREFIX = "tokenmill:"

# vLLM's buckets, so dashboards built for vLLM read these unchanged.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class ServerMetrics(StepObserver):
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: Callable[[], str],
                 facts: Callable[[], EngineFacts | None] | None = None,
                 pending_outputs: Callable[[], int] | None = None) -> None:
        # A callable: with no --served-model-name the name is known only once loaded.
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, model_name, facts or (lambda: None)))
        self.registry.register(_ServerCollector(pending_outputs or (lambda: 0)))
        # process_resident_memory_bytes, process_open_fds, ...: what the default registry
        # of vLLM's server exposes; the reliability suite watches them for leaks.
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]
        self.request_success = Counter(
            PREFIX + "request_success", "Count of finished requests, by finish reason.",
            labels + ["finished_reason"], registry=self.registry,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token in seconds.",
            labels, buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between successive output steps of a request in seconds.",
            labels, buckets=_ITL_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            labels, buckets=_REQUEST_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests whose prefill completed (as clients' "
            "usage.prompt_tokens counts them: once per prompt, prefix-cache hits included).",
            labels, registry=self.registry,
        )
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Number of prefill tokens processed, per finished request.",
            labels, buckets=_TOKEN_BUCKETS, registry=self.registry,
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens", "Number of generation tokens processed, per finished request.",
            labels, buckets=_TOKEN_BUCKETS, registry=self.registry,
        )
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests answered, by method, route and status code.",
            ["method", "handler", "status"], registry=self.registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Time a request waited before it was first scheduled, in seconds.",
            labels, buckets=_REQUEST_BUCKETS, registry=self.registry,
        )
        self.spec_drafts = Counter(
            PREFIX + "spec_decode_num_drafts", "Number of spec decoding drafts (one request's proposals in a step).",
            labels, registry=self.registry,
        )
        self.spec_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Number of draft tokens.", labels, registry=self.registry,
        )
        self.spec_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels, registry=self.registry,
        )
        self.spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            labels + ["position"], registry=self.registry,
        )
        # Requests that produced an output, with their last token's time: engine thread only.
        self._last_token_time: dict[str, float | None] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_http(self, method: str, handler: str, status: int) -> None:
        self.http_requests.labels(method, handler, str(status)).inc()

    # ----- StepObserver (engine thread) ---------------------------------------------------

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        if record.spec_decode is not None:
            self._observe_spec_decode(record.spec_decode)
        for output in outputs:
            self._observe_step(output)
            if output.finished:
                self._observe_finished(output)

    def on_aborted(self, output: RequestOutput) -> None:
        self._observe_finished(output)

    # ----- internals -----------------------------------------------------------------------

    def _observe_spec_decode(self, spec: SpecDecodeStats) -> None:
        name = self.model_name()
        self.spec_drafts.labels(name).inc(spec.num_drafts)
        self.spec_draft_tokens.labels(name).inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.labels(name).inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            self.spec_accepted_per_pos.labels(name, str(position)).inc(count)

    def _observe_step(self, output: RequestOutput) -> None:
        first_output = output.request_id not in self._last_token_time
        if first_output:  # the prefill is done: count the prompt once
            self.prompt_tokens.labels(self.model_name()).inc(len(output.prompt_token_ids))
            self._last_token_time[output.request_id] = None
        metrics = output.metrics
        if metrics is None or metrics.last_token_time is None:
            return
        previous = self._last_token_time.get(output.request_id)
        if previous is not None and metrics.last_token_time > previous:
            self.itl.labels(self.model_name()).observe(metrics.last_token_time - previous)
        self._last_token_time[output.request_id] = metrics.last_token_time

    def _observe_finished(self, output: RequestOutput) -> None:
        started = output.request_id in self._last_token_time
        self._last_token_time.pop(output.request_id, None)
        name = self.model_name()
        for completion in output.outputs or [None]:
            # One count per choice: a request with n=2 ends two sequences, each its own reason.
            reason = completion.finish_reason if completion is not None else None
            self.request_success.labels(name, reason or "abort").inc()
        if started:
            self.request_prompt_tokens.labels(name).observe(len(output.prompt_token_ids))
        self.request_generation_tokens.labels(name).observe(sum(len(c.token_ids) for c in output.outputs))
        metrics = output.metrics
        if metrics is None:
            return
        if metrics.first_token_time is not None:
            self.ttft.labels(name).observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.labels(name).observe(metrics.finished_time - metrics.arrival_time)


class _EngineStatsCollector(Collector):
    """Gauges and counters that mirror EngineStats at scrape time."""

    _GAUGES = [
        ("num_requests_running", "num_running", "Number of requests running on the engine."),
        ("num_requests_waiting", "num_waiting", "Number of requests waiting to be scheduled."),
        ("kv_cache_usage_perc", "kv_usage", "Fraction of KV cache blocks in use (1 = full)."),
    ]
    _COUNTERS = [
        ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
        ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache."),
        ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
        ("prompt_tokens_computed", "num_prompt_tokens",
         "Prompt tokens computed (prefill work: prefix-cache hits excluded, recomputation after preemption included)."),
        ("generation_tokens", "num_generation_tokens", "Tokens generated."),
        ("num_interrupted_steps", "num_interrupted_steps",
         "Steps cut short by a better-priority arrival (--priority-interrupt); their work is computed again."),
    ]

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: Callable[[], str],
                 facts: Callable[[], EngineFacts | None]) -> None:
        self._stats = stats
        self._model_name = model_name
        self._facts = facts

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        name = self._model_name()
        for metric, field, doc in self._GAUGES:
            family = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric([name], float(getattr(stats, field)) if stats else 0.0)
            yield family
        for metric, field, doc in self._COUNTERS:
            family = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            family.add_metric([name], float(getattr(stats, field)) if stats else 0.0)
            yield family
        if stats is not None and stats.kv_offload_blocks:
            yield from host_tier_metrics(stats, name)
        if stats is not None and stats.kv_transfer_role:
            yield from kv_transfer_metrics(stats, name)
        facts = self._facts()
        if facts is not None:
            yield cache_config_info(facts)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _ServerCollector(Collector):
    """The HTTP side's own gauges, read at scrape time (on the event loop's thread)."""

    def __init__(self, pending_outputs: Callable[[], int]) -> None:
        self._pending_outputs = pending_outputs

    def collect(self) -> Iterator[Metric]:
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # no running loop (a scrape from a test's thread)
            tasks = 0
        family = GaugeMetricFamily(PREFIX + "server_asyncio_tasks", "asyncio tasks alive in the server's event loop.")
        family.add_metric([], float(tasks))
        yield family
        family = GaugeMetricFamily(PREFIX + "server_threads", "Python threads alive in the server process.")
        family.add_metric([], float(threading.active_count()))
        yield family
        family = GaugeMetricFamily(PREFIX + "server_pending_outputs",
                                   "Engine outputs of running requests not yet taken by their handlers "
                                   "(at most one per request: a slow client's outputs are merged).")
        family.add_metric([], float(self._pending_outputs()))
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())


_KV_TRANSFER_METRICS = [
    (GaugeMetricFamily, "kv_transfer_held_blocks", "Prefill instance: KV blocks held for decode instances to pull."),
    (GaugeMetricFamily, "kv_transfer_held_requests",
     "Prefill instance: requests whose KV is held for a decode instance."),
    (CounterMetricFamily, "kv_transfer_sent_blocks", "Prefill instance: KV blocks served to decode instances."),
    (CounterMetricFamily, "kv_transfer_expired_requests",
     "Prefill instance: holds freed unpulled after abort_request_timeout."),
    (CounterMetricFamily, "kv_transfer_pulled_blocks", "Decode instance: KV blocks pulled from prefill instances."),
    (GaugeMetricFamily, "kv_transfer_pulling_requests",
     "Decode instance: requests waiting for their KV (pulls in flight)."),
    (CounterMetricFamily, "kv_transfer_failed_pulls",
     "Decode instance: pulls that failed (the prompt was recomputed)."),
    (CounterMetricFamily, "kv_transfer_shared_memory_blocks",
     "Decode instance: of the pulled blocks, those copied from a prefill instance's shared memory (same host)."),
]


def kv_transfer_metrics(stats: EngineStats, name: str) -> Iterator[Metric]:
    """Prefill-decode disaggregation's counters (--kv-transfer-config; docs/disaggregation.md)."""
    for kind, metric, doc in _KV_TRANSFER_METRICS:
        family = kind(PREFIX + metric, doc, labels=["model_name", "kv_role"])
        family.add_metric([name, stats.kv_transfer_role], float(getattr(stats, metric)))
        yield family


def host_tier_metrics(stats: EngineStats, name: str) -> Iterator[Metric]:
    """The host KV tier (--kv-offloading-size) under vLLM's names: its external prefix
    cache counters, its offloading connector's bytes per direction, occupancy, evictions."""
    counters = [
        ("external_prefix_cache_queries", stats.external_prefix_cache_queries,
         "Prompt tokens looked up in the external (host-tier) prefix cache, past the pool's hit."),
        ("external_prefix_cache_hits", stats.external_prefix_cache_hits,
         "Prompt tokens served from the external (host-tier) prefix cache."),
        ("kv_offload_stores_skipped", stats.kv_offload_stores_skipped,
         "Evicted blocks the host tier could not take (every slot being loaded in that step)."),
        ("kv_offload_block_eviction", stats.kv_offload_evicted_blocks,
         "Blocks dropped from the host tier to make room (least recently used first)."),
    ]
    for metric, value, doc in counters:
        family = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
        family.add_metric([name], float(value))
        yield family
    family = CounterMetricFamily(PREFIX + "kv_offload_total_bytes", "KV bytes copied between the pool and the "
                                 "host tier, by direction (GPU = the pool, as vLLM names it).",
                                 labels=["model_name", "transfer_type"])
    family.add_metric([name, "GPU_to_CPU"], float(stats.kv_offload_stored_blocks * stats.kv_offload_bytes_per_block))
    family.add_metric([name, "CPU_to_GPU"], float(stats.kv_offload_loaded_blocks * stats.kv_offload_bytes_per_block))
    if stats.kv_disk_bytes_per_block:  # the disk tier: files written from the host tier, read into the pool
        family.add_metric([name, "CPU_to_DISK"], float(stats.kv_disk_stored_blocks * stats.kv_offload_bytes_per_block))
        family.add_metric([name, "DISK_to_GPU"], float(stats.kv_disk_loaded_blocks * stats.kv_offload_bytes_per_block))
    yield family
    family = GaugeMetricFamily(PREFIX + "kv_offload_cpu_cache_usage_perc",
                               "Fraction of the host tier's blocks holding KV (1 = full).", labels=["model_name"])
    family.add_metric([name], stats.kv_offload_used_blocks / stats.kv_offload_blocks)
    yield family
    family = GaugeMetricFamily(PREFIX + "kv_offload_cpu_cache_bytes",
                               "Bytes of KV the host tier holds.", labels=["model_name"])
    family.add_metric([name], float(stats.kv_offload_used_blocks * stats.kv_offload_bytes_per_block))
    yield family
    if stats.kv_disk_bytes_per_block:
        yield from disk_tier_metrics(stats, name)


def disk_tier_metrics(stats: EngineStats, name: str) -> Iterator[Metric]:
    """The disk KV tier (--kv-offloading-disk-dir), named like the host tier's: whether it is
    on (an unwritable or vanished directory turns it off), occupancy, hits, evictions by its
    size cap and files refused as truncated, corrupt or foreign."""
    gauges = [
        ("kv_offload_disk_enabled", stats.kv_disk_enabled,
         "1 while the disk tier serves; 0 after it was turned off (see the log for why)."),
        ("kv_offload_disk_reading_requests", stats.kv_disk_reading_requests,
         "Requests waiting outside the queue while their prefix's disk files are read in the background."),
        ("kv_offload_disk_cache_usage_perc", stats.kv_disk_used_bytes / max(stats.kv_disk_max_bytes, 1),
         "Fraction of --kv-offloading-disk-size the disk tier's files use (1 = full)."),
        ("kv_offload_disk_cache_bytes", stats.kv_disk_used_bytes,
         "Bytes of KV files the disk tier holds."),
    ]
    for metric, value, doc in gauges:
        family = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
        family.add_metric([name], float(value))
        yield family
    counters = [
        ("kv_offload_disk_prefix_cache_hits", stats.kv_disk_hit_tokens,
         "Prompt tokens served from the disk tier (part of external_prefix_cache_hits)."),
        ("kv_offload_disk_block_eviction", stats.kv_disk_evicted_blocks,
         "KV files deleted by the disk tier's size cap (least recently used first)."),
        ("kv_offload_disk_corrupt_blocks", stats.kv_disk_corrupt_blocks,
         "KV files found truncated, corrupt or foreign: deleted, their tokens recomputed."),
        ("kv_offload_disk_read_ahead_blocks", stats.kv_disk_read_ahead_blocks,
         "KV files read in the background before their request was admitted (no step waited on them)."),
    ]
    for metric, value, doc in counters:
        family = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
        family.add_metric([name], float(value))
        yield family


def cache_config_info(facts: EngineFacts) -> GaugeMetricFamily:
    """vLLM's `cache_config_info`: the KV cache's configuration as labels of a gauge set to 1
    (num_gpu_blocks is vLLM's name for the engine's KV blocks, on any device), with the
    capacity the KV dtype gives."""
    labels = {
        "block_size": str(facts.block_size),
        "cache_dtype": facts.kv_cache_dtype,
        "num_gpu_blocks": str(facts.num_blocks),
        "kv_bytes_per_token": str(facts.kv_bytes_per_token),
        "kv_capacity_tokens": str(facts.kv_capacity_tokens),
    }
    family = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache configuration.",
                               labels=list(labels))
    family.add_metric(list(labels.values()), 1.0)
    return family
