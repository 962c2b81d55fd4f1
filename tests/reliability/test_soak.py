"""A soak: Poisson arrivals at 70% of the rate the server sustains (measured first,
closed-loop, with the same mix, then followed as the shared box's speed changes): streamed and plain completions and chats, n=2, streams
the client cuts early, and invalid bodies. Checked: no error for a valid request,
resident memory growth under 50 MB after the warm-up, file descriptors and threads back
where they were when idle, time to first token of the last window within 1.25x the
first window's (p99 in the long run, p90 in the short one: see check_soak); and the
server's /metrics counters equal what the clients counted (requests by finish reason,
prompt and generation tokens, aborts, 400s and 429s).

CI runs 75 seconds (test_soak_75_seconds: every check but the TTFT trend, which needs
minutes of samples); `-m slow` runs 3 and 30 minutes with it."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import RESULTS, process_stats

COMPLETION_PROMPTS = [
    "The history of the printing press begins",
    "A recipe for bread: first,",
    "Ten facts about owls. 1.",
    "Dear diary, today I",
    "The main causes of the French Revolution were",
    "In a distant galaxy, a small robot",
]
CHATS = [
    [{"role": "user", "content": "Give me three names for a cat."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a prime number?"}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
]
INVALID = [
    b'{"prompt": "a", "temperature": -1}',
    b'{"prompt": "a", "max_tokens": "ten"}',
    b'{"messages": []}',
    b'{"prompt": ',
    b'{"prompt": "a\\ud800"}',
    b'{"prompt": "a", "n": 0}',
]
KINDS = {"stream": 0.30, "chat": 0.20, "stream_chat": 0.10, "n2": 0.10, "abort": 0.15, "invalid": 0.15}


@dataclass
class Ledger:
    """What the clients saw, to compare with /metrics."""

    finish: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0  # of completed requests
    aborted: int = 0
    aborted_tokens_seen: int = 0
    status: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # valid requests that failed
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (sent at, seconds)

    def finished(self, reason: str) -> None:
        self.finish[reason] = self.finish.get(reason, 0) + 1


class Workload:
    def __init__(self, server, ledger: Ledger, rng: random.Random, prompt_tokens: dict[str, int]) -> None:
        self.server = server
        self.ledger = ledger
        self.rng = rng
        self.prompt_tokens = prompt_tokens

    async def run(self, client: httpx.AsyncClient, kind: str) -> None:
        sent = time.monotonic()
        try:
            await getattr(self, "_" + kind)(client, sent)
        except Exception as error:  # noqa: BLE001 - every failure is counted
            if kind != "invalid":
                self.ledger.errors.append(f"{kind}: {type(error).__name__}: {error}")

    async def _stream(self, client: httpx.AsyncClient, sent: float, chat: bool = False) -> None:
        if chat:
            messages = self.rng.choice(CHATS)
            path, body = "/v1/chat/completions", {"messages": messages}
        else:
            prompt = self.rng.choice(COMPLETION_PROMPTS)
            path, body = "/v1/completions", {"prompt": prompt}
        body.update(max_tokens=self.rng.randint(8, 24), stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", self.server.url + path, json=body) as response:
            self._status(response.status_code)
            if response.status_code != 200:
                self.ledger.errors.append(f"stream: {response.status_code} {(await response.aread())[:200]!r}")
                return
            first = None
            usage = None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None:
                    first = time.monotonic() - sent
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason"):
                        self.ledger.finished(choice["finish_reason"])
                usage = chunk.get("usage") or usage
        self.ledger.ttft.append((sent, first))
        self._usage(usage)

    async def _stream_chat(self, client: httpx.AsyncClient, sent: float) -> None:
        await self._stream(client, sent, chat=True)

    async def _chat(self, client: httpx.AsyncClient, sent: float) -> None:
        body = {"messages": self.rng.choice(CHATS), "max_tokens": self.rng.randint(8, 24)}
        response = await client.post(self.server.url + "/v1/chat/completions", json=body)
        self._complete(response)

    async def _n2(self, client: httpx.AsyncClient, sent: float) -> None:
        body = {"prompt": self.rng.choice(COMPLETION_PROMPTS), "n": 2, "max_tokens": 12, "seed": self.rng.randint(0, 99)}
        response = await client.post(self.server.url + "/v1/completions", json=body)
        self._complete(response)

    async def _abort(self, client: httpx.AsyncClient, sent: float) -> None:
        prompt = self.rng.choice(COMPLETION_PROMPTS)
        body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", self.server.url + "/v1/completions", json=body) as response:
            self._status(response.status_code)
            if response.status_code != 200:
                self.ledger.errors.append(f"abort: {response.status_code}")
                return
            events = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 1:
                        self.ledger.ttft.append((sent, time.monotonic() - sent))
                    if events == 2:
                        break  # leaving the block closes the connection
        self.ledger.aborted += 1
        self.ledger.aborted_tokens_seen += 2
        self.ledger.prompt_tokens += self.prompt_tokens[prompt]

    async def _invalid(self, client: httpx.AsyncClient, sent: float) -> None:
        path = self.rng.choice(["/v1/completions", "/v1/chat/completions"])
        response = await client.post(self.server.url + path, content=self.rng.choice(INVALID),
                                     headers={"content-type": "application/json"})
        self._status(response.status_code)
        if response.status_code != 400 or set(response.json()) != {"error"}:
            self.ledger.errors.append(f"invalid body answered {response.status_code}")

    def _complete(self, response: httpx.Response) -> None:
        self._status(response.status_code)
        if response.status_code != 200:
            self.ledger.errors.append(f"{response.status_code}: {response.text[:200]}")
            return
        body = response.json()
        for choice in body["choices"]:
            self.ledger.finished(choice["finish_reason"])
        self._usage(body["usage"])

    def _usage(self, usage: dict | None) -> None:
        assert usage is not None, "a completed request reports its usage"
        self.ledger.prompt_tokens += usage["prompt_tokens"]
        self.ledger.generation_tokens += usage["completion_tokens"]

    def _status(self, status: int) -> None:
        self.ledger.status[status] = self.ledger.status.get(status, 0) + 1


def itl_totals(server) -> tuple[float, float]:
    """(sum, count) of the server's inter-token latency histogram."""
    metrics = server.metrics()
    return (metrics.get("tokenmill:inter_token_latency_seconds_sum", 0.0),
            metrics.get("tokenmill:inter_token_latency_seconds_count", 0.0))


def mean_itl(samples: list[tuple[float, dict]], start: float, end: float) -> float:
    """The server's mean inter-token latency between two times of the soak (from the
    /metrics histogram's sum and count, sampled every 5 s)."""
    inside = [s["itl"] for t, s in samples if start <= t <= end]
    if len(inside) < 2 or inside[-1][1] == inside[0][1]:
        return float("nan")
    return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])


def percentile(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]


def run_soak(server, total_seconds: float, calibration_seconds: float, warmup_seconds: float) -> dict:
    rng = random.Random(18)
    prompt_tokens = {p: len(server.post("/tokenize", json={"prompt": p}).json()["tokens"]) for p in COMPLETION_PROMPTS}
    pid = server.proc.pid
    ledger = Ledger()
    workload = Workload(server, ledger, rng, prompt_tokens)
    server.wait_idle()
    before = server.metrics()

    async def main() -> dict:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=20)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            # 1. What the server sustains: 8 clients back to back, with the soak's own mix.
            done = 0
            calibration_end = time.monotonic() + calibration_seconds

            async def closed_loop() -> None:
                nonlocal done
                while time.monotonic() < calibration_end:
                    await workload.run(client, rng.choices(list(KINDS), list(KINDS.values()))[0])
                    done += 1

            started = time.monotonic()
            itl_before = await asyncio.to_thread(itl_totals, server)
            await asyncio.gather(*(closed_loop() for _ in range(8)))
            capacity = done / (time.monotonic() - started)
            itl_after = await asyncio.to_thread(itl_totals, server)
            calibration_itl = (itl_after[0] - itl_before[0]) / max(1.0, itl_after[1] - itl_before[1])
            base_rate = rate = 0.7 * capacity
            await asyncio.to_thread(server.wait_idle)
            idle_baseline = process_stats(pid)

            # 2. Poisson arrivals at 70% of it. The box is shared: when other jobs take the
            # cores, every step slows and the rate the server sustains drops with it, so
            # the offered rate follows the server's speed (its inter-token latency over
            # the last 15 s against the calibration's), keeping the load near 70%.
            samples: list[tuple[float, dict[str, int]]] = []
            tasks: set[asyncio.Task] = set()
            soak_start = time.monotonic()
            soak_end = soak_start + total_seconds - calibration_seconds
            next_sample = soak_start
            kinds, weights = list(KINDS), list(KINDS.values())
            arrivals = 0
            while time.monotonic() < soak_end:
                now = time.monotonic()
                if now >= next_sample:
                    step = await asyncio.to_thread(itl_totals, server)
                    samples.append((now - soak_start, {**process_stats(pid), "itl": step, "rate": rate}))
                    next_sample = now + 5
                    if len(samples) >= 4:
                        recent = samples[-4][1]["itl"]
                        if step[1] > recent[1]:
                            speed = calibration_itl / ((step[0] - recent[0]) / (step[1] - recent[1]))
                            # Never above the calibrated 70%: at 70% load batches are
                            # smaller than under the 8 calibration clients, so the ITL is
                            # lower anyway; following it up drove the rate to ~97% of
                            # capacity (8.35 of 8.48 req/s) and grew a queue by itself.
                            rate = base_rate * min(1.0, max(0.3, speed))
                task = asyncio.ensure_future(workload.run(client, rng.choices(kinds, weights)[0]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                arrivals += 1
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
            return {"capacity": capacity, "rate": rate, "samples": samples, "idle_baseline": idle_baseline,
                    "arrivals": arrivals, "soak_seconds": time.monotonic() - soak_start}

    run = asyncio.run(main())
    after = server.wait_idle(timeout=10)
    idle_end = process_stats(pid)
    return {**run, "ledger": ledger, "before": before, "after": after, "idle_end": idle_end,
            "warmup_seconds": warmup_seconds}


def check_soak(result: dict, ttft_trend: bool = True) -> dict:
    """The soak's figures, then the assertions on them (so a failure shows them all).
    `ttft_trend=False`: the TTFT windows are reported, not compared (too few samples)."""
    ledger: Ledger = result["ledger"]
    warm = [(t, s) for t, s in result["samples"] if t >= result["warmup_seconds"]]
    rss = [s["rss"] / 2**20 for _, s in warm]
    growth = sorted(rss[-3:])[1] - sorted(rss[:3])[1] if len(rss) >= 3 else float("nan")
    minutes = [t / 60 for t, _ in warm]
    mean_t, mean_r = sum(minutes) / max(1, len(minutes)), sum(rss) / max(1, len(rss))
    spread = sum((t - mean_t) ** 2 for t in minutes) or 1.0
    slope = sum((t - mean_t) * (r - mean_r) for t, r in zip(minutes, rss)) / spread
    base, end = result["idle_baseline"], result["idle_end"]

    # TTFT: the first and last third of the time after the warm-up. A quantile is only as
    # steady as the samples beyond it: a p99 over 200 TTFTs is the second-slowest one, and
    # one stall of the shared box moves it by half (a CI run saw 12.0 -> 16.7 ITLs with no
    # trend in the p90). So a window is compared at p99 only with >= 1,000 samples (10
    # beyond it: the 30-minute run), else at p90 (the 3-minute run has ~200: 20 beyond).
    # The box is shared: another job taking the cores for a minute slows every step, and
    # TTFT with it, whatever the server does. So the check compares TTFT in units of the
    # server's own mean inter-token latency in that window (from /metrics): what grows
    # then is queueing, which a server that degrades with time makes grow. The raw
    # seconds are reported beside it.
    soak_start = min(sent for sent, _ in ledger.ttft)
    span = max(sent for sent, _ in ledger.ttft) - soak_start
    third = (span - result["warmup_seconds"]) / 3
    timed = [(sent - soak_start, ttft) for sent, ttft in ledger.ttft]
    windows = ((result["warmup_seconds"], result["warmup_seconds"] + third), (span - third, span + 1))
    first, last = ([ttft for t, ttft in timed if start <= t < end] for start, end in windows)
    quantile = 0.99 if min(len(first), len(last)) >= 1000 else 0.90
    first_q, last_q = percentile(first, quantile), percentile(last, quantile)
    first_itl, last_itl = (mean_itl(result["samples"], start, end) for start, end in windows)

    before, after = result["before"], result["after"]

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    def http(status: int) -> float:
        return sum(after.get(k, 0) - before.get(k, 0) for k in after
                   if k.startswith("tokenmill:http_requests_total{") and f'status="{status}"' in k)

    server_counts = {
        "stop": delta('tokenmill:request_success_total{finished_reason="stop"}'),
        "length": delta('tokenmill:request_success_total{finished_reason="length"}'),
        "abort": delta('tokenmill:request_success_total{finished_reason="abort"}'),
        "prompt_tokens": delta("tokenmill:prompt_tokens_total"),
        "400": http(400), "429": http(429),
    }
    client_counts = {
        "stop": ledger.finish.get("stop", 0), "length": ledger.finish.get("length", 0), "abort": ledger.aborted,
        "prompt_tokens": ledger.prompt_tokens, "400": ledger.status.get(400, 0), "429": ledger.status.get(429, 0),
    }
    generated = delta("tokenmill:generation_tokens_total")
    seen = ledger.generation_tokens + ledger.aborted_tokens_seen
    figures = {
        "sustained_rate_rps": round(result["capacity"], 2), "offered_rate_rps": round(0.7 * result["capacity"], 2),
        "offered_rate_range_rps": [round(min(s["rate"] for _, s in result["samples"]), 2),
                                   round(max(s["rate"] for _, s in result["samples"]), 2)],
        "arrivals": result["arrivals"], "minutes": round(result["soak_seconds"] / 60, 1),
        "valid_request_errors": len(ledger.errors), "statuses": ledger.status, "finish_reasons": ledger.finish,
        "aborted": ledger.aborted, "rss_growth_mb": round(growth, 1), "rss_slope_mb_per_min": round(slope, 2),
        "fds_idle": [base["fds"], end["fds"]], "threads_idle": [base["threads"], end["threads"]],
        f"ttft_p{round(quantile * 100)}_first_last_window_s": [round(first_q, 3), round(last_q, 3)],
        "ttft_p99_first_last_window_s": [round(percentile(first, 0.99), 3), round(percentile(last, 0.99), 3)],
        "ttft_samples": [len(first), len(last)],
        "mean_itl_first_last_window_s": [round(first_itl, 4), round(last_itl, 4)],
        f"ttft_p{round(quantile * 100)}_in_itls_first_last": [round(first_q / first_itl, 1), round(last_q / last_itl, 1)],
        "server_counts": server_counts, "client_counts": client_counts,
        "generation_tokens_server_minus_client_seen": generated - seen,
    }
    print("soak figures:", json.dumps(figures))
    series_path = os.environ.get("TOKENMILL_SOAK_SERIES")
    if series_path:  # for plots and for looking at trends: (seconds, TTFT) and (seconds, process stats)
        Path(series_path).write_text(json.dumps({"ttft": timed, "samples": result["samples"]}))
    assert not ledger.errors, (ledger.errors[:5], figures)
    assert len(warm) >= 4 and growth < 50, figures
    assert end["fds"] <= base["fds"] + 2 and end["threads"] <= base["threads"] + 2, figures
    assert not ttft_trend or last_q / last_itl <= 1.25 * first_q / first_itl, figures
    assert server_counts == client_counts, figures
    # Aborted streams: the server may have generated a few tokens the client never read.
    assert seen <= generated <= seen + ledger.aborted * 200, figures
    return figures


def test_soak_75_seconds(rserver):
    """The CI share: a minute of the soak's mix at 70% load (errors, metrics against the
    clients' counts, memory, descriptors and threads), without the TTFT trend (~25 TTFTs a
    window)."""
    result = run_soak(rserver, total_seconds=75, calibration_seconds=15, warmup_seconds=15)
    RESULTS["soak_ci"] = check_soak(result, ttft_trend=False)


@pytest.mark.slow
def test_soak_3_minutes(rserver):
    result = run_soak(rserver, total_seconds=180, calibration_seconds=20, warmup_seconds=30)
    RESULTS["soak_3min"] = check_soak(result)


@pytest.mark.slow
def test_soak_30_minutes(rserver):
    result = run_soak(rserver, total_seconds=1800, calibration_seconds=40, warmup_seconds=180)
    RESULTS["soak_30min"] = check_soak(result)
