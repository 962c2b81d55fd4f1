"""Server RSS under prefix-cache churn (issue 31, item 3): 4 clients, back to back, each
sending one of N distinct ~40-word prefixes (cycled, each twice in a row) + a short question, `max_tokens` 8,
against a real `tokenmill serve` with the reliability suite's settings (float32, a 64 MiB
KV cache, one torch thread), so that the prefix cache is always full and evicting.
Samples the server's RSS (the whole process tree) every few seconds and prints the idle
RSS (after one warm-up request), the peak, the growth and the slope over the last half.

    PYTHONPATH=. python benchmarks/prefix_churn.py --minutes 6
    PYTHONPATH=. python benchmarks/prefix_churn.py --minutes 6 --env MALLOC_ARENA_MAX=2
    PYTHONPATH=. python benchmarks/prefix_churn.py --minutes 6 --serve-arg=--no-prefix-caching
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time

import httpx

from tests.reliability.support import RELIABILITY_ARGS, descendants, process_stats
from tokenmill.workloads.local_server import LocalServer

WORDS = ("river stone garden lamp paper window silver orange quiet market winter engine forest "
         "copper mirror harbor violet thunder candle meadow castle pepper rocket velvet ladder "
         "island marble whisper bottle canyon feather glacier lantern puzzle saddle tunnel "
         "walnut anchor basket cobalt desert falcon hammer jungle kettle lemon magnet nickel "
         "oyster pillow quartz ribbon spider tomato umbrella vessel wagon yellow zebra").split()
QUESTIONS = ["What is this about?", "Summarize it in a word.", "Which word comes first?", "Is it a list?"]


def prefix(i: int) -> str:
    """Prefix i: 32 to 48 words, a third of them numbers, so that prompt lengths (and the
    row counts of the steps that prefill them) vary as real prompts' do."""
    rng = random.Random(i)
    return " ".join(str(rng.randrange(10 ** rng.randint(1, 5))) if rng.random() < 0.33 else rng.choice(WORDS)
                    for _ in range(rng.randint(32, 48)))


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and every process below it."""
    total = 0
    for p in {pid} | descendants(pid):
        try:
            total += process_stats(p)["rss"]
        except (OSError, KeyError):
            pass
    return total


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    if len(samples) < 2:
        return float("nan")
    ts = [t / 60 for t, _ in samples]
    ys = [y for _, y in samples]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    spread = sum((t - mt) ** 2 for t in ts) or 1.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / spread


async def churn(url: str, seconds: float, prefixes: int, clients: int, max_tokens: int,
                pid: int, interval: float) -> dict:
    samples: list[tuple[float, float]] = []
    counter = 0
    errors: list[str] = []
    done = 0
    started = time.monotonic()
    end = started + seconds

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal counter, done
        while time.monotonic() < end:
            i = counter
            counter += 1
            # Each prefix twice in a row (two questions): the second request finds the
            # first's blocks in the prefix cache, or part of them, while the 1,000
            # prefixes cycle through a cache that holds a few dozen.
            body = {"prompt": prefix((i // 2) % prefixes) + "\n" + QUESTIONS[i % len(QUESTIONS)] + "\n",
                    "max_tokens": max_tokens, "temperature": 0}
            try:
                response = await http.post(url + "/v1/completions", json=body)
                if response.status_code != 200:
                    errors.append(f"{response.status_code}: {response.text[:200]}")
            except httpx.HTTPError as error:
                errors.append(repr(error))
            done += 1

    async def sampler() -> None:
        while time.monotonic() < end:
            samples.append((time.monotonic() - started, tree_rss(pid) / 2**20))
            await asyncio.sleep(interval)

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(sampler(), *(client(c, http) for c in range(clients)))
    samples.append((time.monotonic() - started, tree_rss(pid) / 2**20))
    return {"samples": samples, "requests": done, "errors": errors}


def summarize(idle_mb: float, samples: list[tuple[float, float]]) -> dict:
    seconds = samples[-1][0]
    last_half = [(t, y) for t, y in samples if t >= seconds / 2]
    peak = max(y for _, y in samples)
    return {"idle_rss_mb": round(idle_mb, 1), "peak_rss_mb": round(peak, 1),
            "peak_growth_mb": round(peak - idle_mb, 1), "end_rss_mb": round(samples[-1][1], 1),
            "slope_last_half_mb_per_min": round(slope_mb_per_min(last_half), 2),
            "slope_all_mb_per_min": round(slope_mb_per_min(samples), 2)}


def measure(minutes: float, env: dict[str, str], serve_args: list[str], prefixes: int = 1000, clients: int = 4,
            max_tokens: int = 8, interval: float = 5.0) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        server = LocalServer([*RELIABILITY_ARGS, *serve_args]).start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
        time.sleep(2)
        idle = tree_rss(server.proc.pid) / 2**20
        run = asyncio.run(churn(server.url, minutes * 60, prefixes, clients, max_tokens, server.proc.pid, interval))
        return {"env": env, "serve_args": serve_args, "minutes": minutes, "requests": run["requests"],
                "errors": len(run["errors"]), "first_errors": run["errors"][:3],
                **summarize(idle, run["samples"]),
                "series": [(round(t), round(y, 1)) for t, y in run["samples"]]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--prefixes", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VAL",
                        help="set in the server's environment (repeatable)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `tokenmill serve` argument")
    parser.add_argument("--series", action="store_true", help="print the (seconds, MB) series too")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    result = measure(args.minutes, env, args.serve_arg, args.prefixes, args.clients, args.max_tokens, args.interval)
    if not args.series:
        result.pop("series")
    result["cpu"] = platform.processor() or platform.machine()
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
