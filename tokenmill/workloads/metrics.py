"""Serving-benchmark metrics, computed as `vllm bench serve` computes them.

Pure functions over per-request records (no I/O), so that the arithmetic can be
tested on synthetic timestamps:

- TTFT: from sending the request to the first chunk that carries generated content.
- ITL: the gaps between consecutive content chunks of one request (all requests'
  gaps pooled together for the statistics).
- E2EL: from sending the request to its last content chunk.
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one
  output token (those with one are left out of the TPOT statistics, and count as
  TPOT 0 against a TPOT SLO, as in vLLM).
- Goodput: completed requests per second that meet every given SLO (`<=`).
- Statistics: mean, median, population std (numpy's default, ddof=0) and
  percentiles with linear interpolation (numpy's default); an empty list counts
  as [0], as vLLM does, so a run whose requests all failed still reports.

Times are kept in seconds per request and reported in milliseconds (`*_ms`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The request-level metrics an SLO may name (vLLM's --goodput names).
SLO_METRICS = ("ttft", "tpot", "e2el")
# Metrics whose distribution is summarised (mean/median/std/percentiles).
DISTRIBUTION_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw of one request. Times in seconds; `start_time` is relative
    to the start of the benchmark, the others to `start_time`."""

    prompt_len: int = 0  # as the server counted it (usage.prompt_tokens) when it said so
    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    generated_text: str = ""
    client_queue_time: float = 0.0  # waiting for a --max-concurrency slot, before start_time


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        name = name.strip().lower()
        if not sep:
            raise ValueError(f"goodput SLO {pair!r} is not NAME:MILLISECONDS (e.g. ttft:500)")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {pair!r}: the metric must be one of {', '.join(SLO_METRICS)}")
        try:
            milliseconds = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {pair!r}: {value!r} is not a number of milliseconds") from None
        if not milliseconds >= 0 or math.isinf(milliseconds):
            raise ValueError(f"goodput SLO {pair!r}: the value must be a finite number >= 0")
        slos[name] = milliseconds
    return slos


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> list[float]:
    """Send times (seconds from the start) of `num_requests` requests, as vLLM draws them.

    rate inf: all at time 0. Otherwise the gaps are gamma-distributed with shape
    `burstiness` and mean 1/rate (burstiness 1 is a Poisson process, < 1 burstier,
    inf evenly spaced); the cumulative times are then rescaled so that the last one
    falls at exactly num_requests / rate, which keeps the offered load exact across
    seeds. The first request also waits its own gap, as in vLLM.
    """
    if num_requests <= 0:
        return []
    if not request_rate > 0:
        raise ValueError(f"the request rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"the burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = rng if rng is not None else np.random.default_rng(0)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (num_requests / request_rate) / times[-1]
    return [float(t) for t in times]


def tpot_of(record: RequestRecord) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1), or None for a request with <= 1 token."""
    if record.output_tokens > 1:
        return (record.latency - record.ttft) / (record.output_tokens - 1)
    return None


def _stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    data = np.asarray(values if len(values) else [0.0], dtype=float)
    stats = {
        "mean": float(np.mean(data)),
        "median": float(np.median(data)),
        "std": float(np.std(data)),
    }
    for p in percentiles:
        stats[percentile_key(p)] = float(np.percentile(data, p))
    return stats


def percentile_key(p: float) -> str:
    """90 -> "p90", 99.9 -> "p99.9" (vLLM's spelling of its result keys)."""
    return f"p{int(p)}" if float(p) == int(p) else f"p{p}"


def calculate_metrics(records: Sequence[RequestRecord], duration: float,
                      goodput: dict[str, float] | None = None,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The result keys of vLLM's result file for one run (aggregates, per-request lists).

    `goodput` maps SLO names (ttft, tpot, e2el) to milliseconds; without it
    request_goodput is None, as in vLLM.
    """
    if duration <= 0:
        raise ValueError(f"the duration must be > 0, got {duration}")
    ok = [r for r in records if r.success]
    output_lens = [r.output_tokens if r.success else 0 for r in records]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots = [t for r in ok if (t := tpot_of(r)) is not None]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)

    good = None
    if goodput:
        good = sum(1 for r in ok if meets_slos(r, goodput))

    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if good is not None else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    peak_tokens, peak_concurrency = peaks(records)
    result["max_output_tokens_per_s"] = peak_tokens
    result["max_concurrent_requests"] = peak_concurrency
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        stats = _stats(values, percentiles)
        result[f"mean_{name}_ms"] = stats["mean"] * 1000
        result[f"median_{name}_ms"] = stats["median"] * 1000
        result[f"std_{name}_ms"] = stats["std"] * 1000
        for p in percentiles:
            key = percentile_key(p)
            result[f"{key}_{name}_ms"] = stats[key] * 1000
    result.update({
        "input_lens": [r.prompt_len for r in records],
        "output_lens": output_lens,
        "ttfts": [r.ttft for r in records],
        "itls": [list(r.itl) for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.client_queue_time for r in records],
        "errors": [r.error for r in records],
        "failed_reasons": failure_reasons(records),
    })
    return result


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (inclusive), TPOT 0 for <= 1 token."""
    values = {"ttft": record.ttft, "tpot": tpot_of(record) or 0.0, "e2el": record.latency}
    return all(values[name] <= limit / 1000 for name, limit in slos_ms.items())


def failure_reasons(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests counted by reason (the reason's first line), most frequent first."""
    counts = Counter((r.error or "unknown error").splitlines()[0][:200] for r in records if not r.success)
    return dict(counts.most_common())


def token_times(record: RequestRecord) -> list[float]:
    """Arrival times (from the benchmark start) of a completed request's content chunks."""
    if not record.success:
        return []
    times = [record.start_time + record.ttft]
    for gap in record.itl:
        times.append(times[-1] + gap)
    return times


def output_timeline(records: Sequence[RequestRecord],
                    bucket: float = 1.0) -> tuple[list[float], list[float], list[float]]:
    """(bin start times, output tokens/s, mean requests in flight) in `bucket`-second bins.

    A request's output tokens are spread over its content chunks (a server may send
    several tokens in one chunk), so the bins add up to the run's output tokens.
    In flight: every request, failed ones included, from its send to its end (its
    last chunk, or its failure), averaged over the bin.
    """
    ok = [r for r in records if r.success]
    ends = [r.start_time + r.latency for r in records] or [0.0]
    span = max(ends)
    count = max(1, int(math.ceil(span / bucket)))
    tokens = np.zeros(count)
    busy = np.zeros(count)
    for r in ok:
        times = token_times(r)
        per_chunk = r.output_tokens / len(times) if times else 0.0
        for t in times:
            tokens[min(count - 1, int(t / bucket))] += per_chunk
    for r in records:
        begin, end = r.start_time, r.start_time + r.latency
        for i in range(int(begin / bucket), min(count, int(math.ceil(end / bucket)))):
            busy[i] += max(0.0, min(end, (i + 1) * bucket) - max(begin, i * bucket))
    starts = [i * bucket for i in range(count)]
    return starts, [float(t / bucket) for t in tokens], [float(b / bucket) for b in busy]


def peaks(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """(most output tokens in any one-second bin, most requests in flight at once),
    vLLM's max_output_tokens_per_s and max_concurrent_requests, over completed requests."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0, 0
    origin = min(r.start_time for r in ok)
    shifted = [RequestRecord(success=True, start_time=r.start_time - origin, ttft=r.ttft, itl=r.itl,
                             latency=r.latency, output_tokens=len(r.itl) + 1) for r in ok]
    _, tokens, _ = output_timeline(shifted)
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    current = peak = 0
    for _, delta in events:  # a departure sorts before an arrival at the same instant
        current += delta
        peak = max(peak, current)
    return max(tokens), peak
