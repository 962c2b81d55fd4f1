"""`tokenmill bench serve`: load-test an OpenAI-compatible server (tokenmill, vLLM,
llama.cpp's server) and report what `vllm bench serve` reports.

Every request streams (`stream: true`, `stream_options.include_usage`), so the
client sees each chunk arrive; the random datasets send `ignore_eos` so every
request generates exactly the tokens asked for; the output length of a request
is the usage chunk's `completion_tokens` (the number of content chunks when a
server sends no usage). Requests start at times drawn from a gamma process
(`--request-rate`, `--burstiness`; rate inf sends them all at once), optionally
capped at `--max-concurrency` in flight, each over its own HTTP/1.1 connection.

When the server exports speculative decoding's counters (tokenmill's or vLLM's
`spec_decode_*` on /metrics), they are read before and after the measured requests and
the result reports the acceptance rate, the mean acceptance length and the acceptance
per position over the run, as `vllm bench serve` does.

A request fails (and is counted, with its reason, while the run goes on) on an
HTTP status >= 400, an error event in the stream, a dropped connection, a
timeout, or a stream that ends before `data: [DONE]` or a finish reason.
The metrics are computed in `tokenmill.workloads.metrics`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import platform
import re
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np

from tokenmill.workloads.datasets import (
    NEEDS_TOKEN_SOURCE,
    DatasetConfig,
    IdRangeSource,
    LocalTokenSource,
    SampleRequest,
    ServerTokenSource,
    TokenSource,
    build_requests,
)
from tokenmill.workloads.metrics import (
    DEFAULT_PERCENTILES,
    DISTRIBUTION_METRICS,
    RequestRecord,
    arrival_times,
    calculate_metrics,
    percentile_key,
)

logger = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}
SCHEMA = "tokenmill.bench.serve/1"


@dataclass
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first id of /v1/models
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # SLO name -> milliseconds
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    ignore_eos: bool | None = None  # None: on for the random datasets, off for jsonl
    temperature: float | None = None  # None: the server's default
    extra_body: dict[str, Any] | None = None
    api_key: str | None = None
    tokenizer: str | None = None
    num_warmups: int = 0
    timeout: float = 3600.0  # seconds one request may take (connect: 60 s)
    disable_tqdm: bool = False
    label: str | None = None
    save_detailed: bool = False  # keep generated texts in the result

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def use_ignore_eos(self) -> bool:
        return self.ignore_eos if self.ignore_eos is not None else self.dataset.name in NEEDS_TOKEN_SOURCE

    def check(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"--max-concurrency must be > 0, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not self.percentiles or any(not 0 < p <= 100 for p in self.percentiles):
            raise ValueError(f"--metric-percentiles must lie in (0, 100], got {self.percentiles}")
        self.dataset.check()


# ----- one request -----------------------------------------------------------------------


def request_payload(config: ServeConfig, model: str, request: SampleRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if config.chat:
        payload["messages"] = request.messages
        # vLLM and tokenmill read max_completion_tokens, older servers max_tokens.
        payload["max_completion_tokens"] = request.output_len
        payload["max_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.output_len
    if config.use_ignore_eos:
        payload["ignore_eos"] = True
    if config.temperature is not None:
        payload["temperature"] = config.temperature
    payload.update(request.extra or {})
    payload.update(config.extra_body or {})
    return payload


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped (or FastAPI, or plain-text) error body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(error.get(key), str):
                    return error[key][:300]
        elif isinstance(error, str):
            return error[:300]
    return text[:300]


def _is_content_chunk(choice: dict[str, Any], chat: bool) -> bool:
    """Whether a streamed choice carries generated tokens. A chat stream's opening
    chunk (the role, no content) does not: TTFT counts from the first token."""
    if not chat:
        return True  # every completion chunk with a choice, as vLLM counts them
    delta = choice.get("delta") or {}
    has_text = bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    or delta.get("tool_calls"))
    # tokenmill sends {"content": ""} for a token whose text is not complete yet.
    return has_text or ("content" in delta and "role" not in delta)


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str],
                       chat: bool, prompt_len: int | None, keep_text: bool = False) -> RequestRecord:
    """Stream one request and time its chunks. start_time is time.perf_counter()."""
    record = RequestRecord(prompt_len=prompt_len or 0)
    start = time.perf_counter()
    record.start_time = start
    last = start
    first = done = finished = False
    chunks = 0
    usage_tokens: int | None = None
    texts: list[str] = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = await response.aread()
                record.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return record
            event = ""
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line:
                    event = ""
                    continue
                if line.startswith(":"):
                    continue  # an SSE comment (keep-alive ping)
                field_name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field_name == "event":
                    event = value.strip()
                    continue
                if field_name == "error":  # llama.cpp's server: `error: {...}`
                    record.error = f"stream error: {_error_message(value.encode())}"
                    return record
                if field_name != "data":
                    continue
                if value.strip() == "[DONE]":
                    done = True
                    continue
                try:
                    data = json.loads(value)
                except ValueError:
                    record.error = f"invalid JSON in the stream: {value[:200]!r}"
                    return record
                if not isinstance(data, dict):
                    continue
                if event == "error" or data.get("error") or data.get("object") == "error":
                    record.error = f"stream error: {_error_message(value.encode())}"
                    return record
                choices = data.get("choices")
                if choices:
                    choice = choices[0]
                    if choice.get("finish_reason"):
                        finished = True
                    if _is_content_chunk(choice, chat):
                        if not first:
                            first = True
                            record.ttft = now - start
                        else:
                            record.itl.append(now - last)
                        last = now
                        chunks += 1
                        if keep_text:
                            delta = (choice.get("delta") or {}) if chat else choice
                            texts.append(delta.get("content") or delta.get("text") or "")
                usage = data.get("usage")
                if usage:
                    if usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        record.prompt_len = int(usage["prompt_tokens"])
    except httpx.TimeoutException as error:
        record.error = f"timeout: {type(error).__name__} after {time.perf_counter() - start:.1f} s"
        return record
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as error:
        record.error = f"connection dropped: {type(error).__name__}: {error}"
        return record
    except httpx.ConnectError as error:
        record.error = f"connection failed: {error}"
        return record
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
        return record
    if not first:
        record.error = "no content chunk in the stream (TTFT undefined)"
        return record
    if not (done or finished):
        record.error = "the stream ended before data: [DONE] or a finish reason"
        return record
    record.success = True
    record.latency = last - start
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    record.generated_text = "".join(texts)
    return record


# ----- a run -----------------------------------------------------------------------------


@dataclass
class Session:
    """What a run (or a sweep of runs) shares: the client, the model, the token source."""

    config: ServeConfig
    client: httpx.AsyncClient
    headers: dict[str, str]
    model: str
    source: TokenSource | None


async def open_session(config: ServeConfig, stack: AsyncExitStack) -> Session:
    config.check()
    # HTTP/1.1 (no HTTP/2 multiplexing): one connection per request in flight.
    client = await stack.enter_async_context(httpx.AsyncClient(
        http1=True, http2=False,
        timeout=httpx.Timeout(config.timeout, connect=60.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
    ))
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    model = config.model or await first_model(client, config.base_url, headers)
    source = await token_source(config, client, model, headers) if config.dataset.name in NEEDS_TOKEN_SOURCE else None
    return Session(config, client, headers, model, source)


async def first_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = await client.get(url, headers=headers)
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach {url}: {error}") from None
    if response.status_code != 200:
        raise ValueError(f"{url} answered HTTP {response.status_code}: {_error_message(response.content)}")
    data = response.json().get("data") or []
    if not data:
        raise ValueError(f"{url} lists no model; pass --model")
    return data[0]["id"]


async def token_source(config: ServeConfig, client: httpx.AsyncClient, model: str,
                       headers: dict[str, str]) -> TokenSource:
    if config.tokenizer:
        return LocalTokenSource(config.tokenizer)
    source = ServerTokenSource(client, config.base_url.rstrip("/"), model, headers)
    try:
        await source.load()
        return source
    except (ValueError, KeyError, httpx.HTTPError) as error:
        logger.warning("no usable /tokenize on the server (%s); prompts use token ids %s", error,
                       IdRangeSource().description)
        return IdRangeSource()


async def _send_all(session: Session, requests: Sequence[SampleRequest], arrivals: Sequence[float],
                    max_concurrency: int | None, progress: Any | None) -> tuple[list[RequestRecord], float]:
    """Send each request at its arrival time (at most max_concurrency in flight);
    returns the records (start times relative to the run's start) and the duration."""
    config = session.config
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(request: SampleRequest) -> RequestRecord:
        arrived = time.perf_counter()
        payload = request_payload(config, session.model, request)
        if semaphore is None:
            record = await send_request(session.client, config.api_url, payload, session.headers, config.chat,
                                        request.prompt_len, config.save_detailed)
        else:
            async with semaphore:
                record = await send_request(session.client, config.api_url, payload, session.headers,
                                            config.chat, request.prompt_len, config.save_detailed)
        record.client_queue_time = record.start_time - arrived
        if progress is not None:
            progress.update(1)
        return record

    start = time.perf_counter()
    tasks = []
    for request, at in zip(requests, arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    for record in records:
        record.start_time -= start
    return records, duration


async def run_point(session: Session, request_rate: float | None = None, max_concurrency: int | None = -1,
                    seed_offset: int = 0) -> dict[str, Any]:
    """One measured run: warm-ups (not measured), then --num-prompts requests.
    request_rate / max_concurrency override the config's (-1: keep the config's cap)."""
    config = session.config
    rate = config.request_rate if request_rate is None else request_rate
    cap = config.max_concurrency if max_concurrency == -1 else max_concurrency
    dataset = config.dataset
    requests = await build_requests(dataset, session.source, config.chat, seed_offset=seed_offset)
    if config.num_warmups:
        if dataset.name == "jsonl":
            warmups = [requests[i % len(requests)] for i in range(config.num_warmups)]
        else:  # fresh prompts, so that no measured prompt is in the prefix cache
            warmups = await build_requests(dataset, session.source, config.chat, count=config.num_warmups,
                                           seed_offset=seed_offset + 1_000_003)
        warm, _ = await _send_all(session, warmups, [0.0] * len(warmups), cap, None)
        bad = [r.error for r in warm if not r.success]
        if bad:
            logger.warning("%d of %d warm-up requests failed: %s", len(bad), len(warm), bad[0])
    arrivals = arrival_times(len(requests), rate, config.burstiness,
                             np.random.default_rng(dataset.seed + seed_offset))
    progress = None
    if not config.disable_tqdm:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(requests), desc=f"rate {_rate_text(rate)}, concurrency {cap or 'unlimited'}",
                        unit="req", leave=False)
    spec_before = await spec_decode_counters(session)
    try:
        records, duration = await _send_all(session, requests, arrivals, cap, progress)
    finally:
        if progress is not None:
            progress.close()
    spec_after = await spec_decode_counters(session)
    result = result_header(config, session, rate, cap, len(requests))
    result.update(calculate_metrics(records, duration, config.goodput or None, config.percentiles))
    result.update(spec_decode_metrics(spec_before, spec_after))
    if config.save_detailed:
        result["generated_texts"] = [r.generated_text for r in records]
    return result


# ----- speculative decoding, from the server's counters -------------------------------------

_SPEC_LINE = re.compile(r"^(?:tokenmill|vllm):spec_decode_num_(drafts|draft_tokens|accepted_tokens|"
                        r"accepted_tokens_per_pos)(?:_total)?(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)


def parse_spec_decode(text: str) -> SpecCounters | None:
    """Speculative decoding's counters in a Prometheus exposition, summed over label sets
    (models); None when the server exports none."""
    counters, found = SpecCounters(), False
    for line in text.splitlines():
        match = _SPEC_LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        found = True
        if name == "accepted_tokens_per_pos":
            position = _POSITION.search(labels)
            if position is not None:
                key = int(position.group(1))
                counters.per_position[key] = counters.per_position.get(key, 0.0) + value
        else:
            setattr(counters, name, getattr(counters, name) + value)
    return counters if found else None


async def spec_decode_counters(session: Session) -> SpecCounters | None:
    try:
        response = await session.client.get(session.config.base_url.rstrip("/") + "/metrics",
                                            headers=session.headers)
    except httpx.HTTPError:
        return None
    return parse_spec_decode(response.text) if response.status_code == 200 else None


def spec_decode_metrics(before: SpecCounters | None, after: SpecCounters | None) -> dict[str, Any]:
    """vLLM's result keys for the run's drafts; empty when the server has no counters
    after the run. None before it counts as zero: a labelled counter shows no sample
    until its first increment."""
    if after is None:
        return {}
    before = before or SpecCounters()
    drafts = after.drafts - before.drafts
    draft_tokens = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    positions = sorted(after.per_position)
    per_position = [after.per_position[p] - before.per_position.get(p, 0.0) for p in positions]
    return {
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_acceptance_rate": 100 * accepted / draft_tokens if draft_tokens else None,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else None,
        "spec_decode_per_position_acceptance_rates": [a / drafts if drafts else None for a in per_position],
    }


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def result_header(config: ServeConfig, session: Session, rate: float, cap: int | None,
                  num_prompts: int) -> dict[str, Any]:
    """The configuration fields of the result file, named as vLLM names them first."""
    dataset = config.dataset
    backend = ENDPOINTS[config.endpoint]
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": config.label,
        "model_id": session.model,
        "tokenizer_id": config.tokenizer,
        "num_prompts": num_prompts,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": config.burstiness,
        "max_concurrency": cap,
        # tokenmill's own fields
        "schema": SCHEMA,
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "dataset_name": dataset.name,
        "dataset_path": dataset.path,
        "input_len": dataset.input_len if dataset.name != "jsonl" else None,
        "output_len": dataset.output_len,
        "range_ratio": dataset.range_ratio,
        "prefix_len": dataset.effective_prefix_len if dataset.name != "jsonl" else None,
        "num_prefixes": dataset.num_prefixes if dataset.name == "shared-prefix" else None,
        "seed": dataset.seed,
        "ignore_eos": config.use_ignore_eos,
        "temperature": config.temperature,
        "num_warmups": config.num_warmups,
        "goodput_slos_ms": dict(config.goodput) or None,
        "percentiles": list(config.percentiles),
        "token_source": session.source.description if session.source else None,
        "client_host": platform.node(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


async def _benchmark(config: ServeConfig) -> dict[str, Any]:
    async with AsyncExitStack() as stack:
        session = await open_session(config, stack)
        return await run_point(session)


def run_benchmark(config: ServeConfig) -> dict[str, Any]:
    """Run `tokenmill bench serve` with `config`; the result dict (vLLM's keys)."""
    return asyncio.run(_benchmark(config))


# ----- reporting -------------------------------------------------------------------------


def format_table(result: dict[str, Any]) -> str:
    """The end-of-run report, laid out as `vllm bench serve` prints it."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        text = "-" if value is None else format(value, fmt)
        lines.append(f"{label:<44} {text:>15}")

    row("Model:", result["model_id"])
    row("Endpoint:", result["endpoint"])
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result["max_concurrency"] is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Request rate configured (RPS):", result["request_rate"] if result["request_rate"] == "inf"
        else f"{result['request_rate']:.2f}")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
        row("  SLOs:", " ".join(f"{k}<={v:g}ms" for k, v in result["goodput_slos_ms"].items()))
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    headers = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
               "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in DISTRIBUTION_METRICS:
        lines.append("{:-^60}".format(f" {headers[name]} "))
        upper = name.upper()
        row(f"Mean {upper} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {upper} (ms):", result[f"median_{name}_ms"], ".2f")
        row(f"Std {upper} (ms):", result[f"std_{name}_ms"], ".2f")
        for p in result["percentiles"]:
            key = percentile_key(p)
            row(f"{key.upper()} {upper} (ms):", result[f"{key}_{name}_ms"], ".2f")
    if result.get("spec_decode_num_drafts"):
        lines.append("{:-^60}".format(" Speculative Decoding "))
        row("Acceptance rate (%):", result["spec_decode_acceptance_rate"], ".2f")
        row("Acceptance length:", result["spec_decode_acceptance_length"], ".2f")
        row("Drafts:", result["spec_decode_num_drafts"])
        row("Draft tokens:", result["spec_decode_draft_tokens"])
        row("Accepted tokens:", result["spec_decode_accepted_tokens"])
        lines.append("Per-position acceptance (%): " + ", ".join(
            f"{100 * r:.1f}" for r in result["spec_decode_per_position_acceptance_rates"]))
    if result["failed_reasons"]:
        lines.append("{:-^60}".format(" Failed requests by reason "))
        for reason, count in result["failed_reasons"].items():
            lines.append(f"{count:>5} x {reason}")
    lines.append("=" * 60)
    return "\n".join(lines)


def save_result(result: dict[str, Any], path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(result, file)
        file.write("\n")
