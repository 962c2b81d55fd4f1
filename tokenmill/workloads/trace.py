"""What a simulation replays: requests with a send time, prompt token ids and an output length.

Three sources, the same as `tokenmill bench serve` has:

- a synthetic workload (`synthetic_trace`): the bench's random or shared-prefix dataset
  (`workloads.datasets.random_token_prompts`) at gamma/Poisson arrivals
  (`workloads.metrics.arrival_times`), drawn from the same seeds the bench draws from, so a
  simulated point and a measured one see the same arrival times and lengths;
- a recorded `bench serve` result (`trace_from_result`): its per-request send times,
  prompt lengths (the server's count) and output lengths, replayed as they were; prompts
  get the dataset's shared prefixes back (round-robin, as the bench assigns them) so that
  the prefix cache sees what the server saw;
- a JSONL dataset (`trace_from_jsonl`), prompts as token ids or text (tokenized with the
  model's tokenizer), at arrivals drawn for a rate.

The token ids of random prompts only matter through the prefix cache (which blocks are
equal), so they are drawn from a fixed range rather than the server's vocabulary.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.workloads.datasets import FALLBACK_ID_RANGE, DatasetConfig, load_jsonl, random_token_prompts
from tokenmill.workloads.metrics import arrival_times

RANDOM_POOL = list(range(*FALLBACK_ID_RANGE))


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # when the client sends it, seconds from the start of the run
    prompt_token_ids: list[int]
    output_len: int
    priority: int = 0  # under --scheduling-policy priority (lower first)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Trace:
    requests: list[TraceRequest]
    description: str
    # What a result header reports of the workload (bench serve's keys).
    settings: dict[str, Any]

    def __len__(self) -> int:
        return len(self.requests)


def synthetic_trace(dataset: DatasetConfig, request_rate: float, burstiness: float = 1.0,
                    seed_offset: int = 0) -> Trace:
    """`dataset.num_prompts` requests of the random or shared-prefix dataset, drawn as
    `bench serve` draws the point `seed_offset` of a sweep."""
    dataset.check()
    if dataset.name == "jsonl":
        raise ValueError("a jsonl dataset is read with trace_from_jsonl")
    seed = dataset.seed + seed_offset
    prompts = random_token_prompts(dataset, RANDOM_POOL, dataset.num_prompts, np.random.default_rng(seed))
    arrivals = arrival_times(len(prompts), request_rate, burstiness, np.random.default_rng(seed))
    requests = [TraceRequest(at, ids, n_out) for at, (ids, n_out) in zip(arrivals, prompts)]
    return Trace(requests, f"{dataset.name} dataset, {_rate_text(request_rate)} req/s",
                 _settings(dataset, request_rate, burstiness))


def trace_from_jsonl(dataset: DatasetConfig, request_rate: float, burstiness: float,
                     encode: Callable[[str], list[int]]) -> Trace:
    """A JSONL dataset (`{"prompt": TEXT or [IDS], "output_len": N}` per line) at arrivals
    drawn for `request_rate`; text prompts go through `encode` (the model's tokenizer)."""
    dataset.check()
    samples = load_jsonl(dataset.path or "", dataset.num_prompts, dataset.output_len, chat=False)
    arrivals = arrival_times(len(samples), request_rate, burstiness, np.random.default_rng(dataset.seed))
    requests = []
    for at, sample in zip(arrivals, samples):
        ids = list(sample.prompt) if isinstance(sample.prompt, list) else encode(sample.prompt or "")
        if not ids:
            raise ValueError(f"{dataset.path}: a prompt has no tokens")
        requests.append(TraceRequest(at, ids, sample.output_len))
    return Trace(requests, f"{dataset.path}, {_rate_text(request_rate)} req/s",
                 _settings(dataset, request_rate, burstiness))


def trace_from_result(result: dict[str, Any], seed: int = 0) -> Trace:
    """Replay a `bench serve` result: each request at its recorded send time (`start_times`
    plus `queue_times`, the wait for a --max-concurrency slot, which the simulation applies
    again), with its recorded prompt and output lengths. A failed request is replayed with
    the output length it asked for when the result says it (`output_len` of a random
    dataset), else left out."""
    keys = ("start_times", "input_lens", "output_lens", "errors")
    missing = [key for key in keys if key not in result]
    if missing:
        raise ValueError(f"not a bench serve result: no {', '.join(missing)}")
    prefix_len = result.get("prefix_len") or 0
    num_prefixes = result.get("num_prefixes") or 1
    rng = np.random.default_rng(seed)
    pool = np.asarray(RANDOM_POOL)
    prefixes = [rng.choice(pool, size=prefix_len).tolist() for _ in range(num_prefixes)]
    queue_times = result.get("queue_times") or [0.0] * len(result["start_times"])
    requests = []
    for i, (start, queued, n_in, n_out, error) in enumerate(
            zip(result["start_times"], queue_times, result["input_lens"], result["output_lens"], result["errors"])):
        if error:
            n_out = result.get("output_len") if result.get("dataset_name") in ("random", "shared-prefix") else None
            if not n_out:
                continue
        prefix = prefixes[i % num_prefixes] if n_in > prefix_len else []
        suffix = rng.choice(pool, size=n_in - len(prefix)).tolist()
        requests.append(TraceRequest(float(start) - float(queued), prefix + suffix, int(n_out)))
    if not requests:
        raise ValueError("the result has no request to replay")
    requests.sort(key=lambda r: r.arrival_s)
    settings = {key: result.get(key) for key in SETTING_KEYS}
    return Trace(requests, f"replay of a bench serve run ({result.get('date', 'undated')})", settings)


def load_result(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read a bench serve result: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a bench serve result (expected a JSON object)")
    return data


SETTING_KEYS = ("dataset_name", "dataset_path", "input_len", "output_len", "range_ratio", "prefix_len",
                "num_prefixes", "seed", "request_rate", "burstiness")


def _settings(dataset: DatasetConfig, request_rate: float, burstiness: float) -> dict[str, Any]:
    is_jsonl = dataset.name == "jsonl"
    return {
        "dataset_name": dataset.name, "dataset_path": dataset.path,
        "input_len": None if is_jsonl else dataset.input_len, "output_len": dataset.output_len,
        "range_ratio": dataset.range_ratio, "prefix_len": None if is_jsonl else dataset.effective_prefix_len,
        "num_prefixes": dataset.num_prefixes if dataset.name == "shared-prefix" else None, "seed": dataset.seed,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate, "burstiness": burstiness,
    }


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def offered_rate(requests: Sequence[TraceRequest]) -> float:
    """Requests per second over the span of the send times (inf when all at once)."""
    span = max(r.arrival_s for r in requests) if requests else 0.0
    return len(requests) / span if span > 0 else math.inf
