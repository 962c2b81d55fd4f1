"""Serving under CPU contention: `tokenmill serve` with 0, 1 and 2 other busy processes.

For each server setting (thread policy flags) a server is started, and for each number of
competitors that many `while True: pass` processes run beside it while C clients loop
short chat requests (closed loop) for D seconds; the table gives requests per second and
p50/p99 latency. Settings and competitor counts are measured in alternation, round by
round, so a drift of the machine's other load hits them alike. Not part of CI.

    .venv/bin/python benchmarks/contention.py --duration 30 --rounds 2 --output contention.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokenmill.hardware import cpu_info
from tokenmill.workloads.local_server import LocalServer

PROMPTS = ["Write one sentence about the sea.", "Name three colours.", "What is 2 + 2?",
           "Say hello in French.", "Give me a word that rhymes with cat.", "What day comes after Monday?"]


MODEL_NAME = "tokenmill-contention"


def start_server(flags: list[str]) -> LocalServer:
    return LocalServer(["--disable-access-log", "--log-level", "warning", "--served-model-name", MODEL_NAME,
                        *flags]).start()


def start_competitors(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


async def load(base_url: str, clients: int, duration: float, max_tokens: int) -> dict:
    url = f"{base_url}/v1/chat/completions"
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + duration

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal errors
        k = i
        while time.monotonic() < stop_at:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
                    "max_tokens": max_tokens, "temperature": 0}
            k += clients
            t0 = time.monotonic()
            try:
                response = await http.post(url, json=body, timeout=600)
                if response.status_code == 200:
                    latencies.append(time.monotonic() - t0)
                else:
                    errors += 1
                    if errors == 1:
                        print(f"first error: HTTP {response.status_code} {response.text[:300]}", file=sys.stderr)
            except httpx.HTTPError:
                errors += 1

    started = time.monotonic()
    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))
    elapsed = time.monotonic() - started
    latencies.sort()
    pick = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]) if latencies else (lambda q: None)
    return {"requests": len(latencies), "errors": errors, "seconds": elapsed,
            "req_s": len(latencies) / elapsed, "p50_s": pick(0.5), "p99_s": pick(0.99)}


def parse_settings(text: str) -> dict[str, list[str]]:
    settings = {}
    for item in text.split(";"):
        name, _, flags = item.partition(":")
        settings[name.strip()] = flags.split()
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="default:;threads-2:--num-threads 2;threads-1:--num-threads 1",
                        help="'name:serve flags;...' (default: the adaptive default, 2 fixed threads, 1 thread)")
    parser.add_argument("--competitors", default="0,1,2")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    settings = parse_settings(args.settings)
    competitors = [int(c) for c in args.competitors.split(",")]
    results: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in competitors} for name in settings}
    servers = {}
    try:
        for name, flags in settings.items():
            servers[name] = start_server(flags)
            asyncio.run(load(servers[name].url, args.clients, args.warmup, args.max_tokens))
        for round_index in range(args.rounds):
            for count in competitors:
                for name, server in servers.items():
                    busy = start_competitors(count)
                    try:
                        result = asyncio.run(load(server.url, args.clients, args.duration, args.max_tokens))
                    finally:
                        for p in busy:
                            p.kill()
                    result["loadavg_1m"] = os.getloadavg()[0]
                    results[name][count].append(result)
                    print(f"round {round_index + 1}, {count} busy, {name}: {result['req_s']:.2f} req/s, "
                          f"p50 {result['p50_s'] or 0:.2f} s, p99 {result['p99_s'] or 0:.2f} s, "
                          f"{result['errors']} errors", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print(table(results, args))
    if args.output:
        Path(args.output).write_text(json.dumps({"cpu": cpu_info().describe(), "settings": settings,
                                                 "args": vars(args), "results": results}, indent=1))
    return 0


def table(results: dict[str, dict[int, list[dict]]], args: argparse.Namespace) -> str:
    lines = [f"{cpu_info().describe()}; {args.clients} clients, chat max_tokens {args.max_tokens}, "
             f"{args.duration:.0f} s per cell, median of {args.rounds} round(s)", "",
             "| setting | busy processes | req/s | p50 s | p99 s | vs uncontended req/s |", "|---|---:|---:|---:|---:|---:|"]
    for name, by_count in results.items():
        base = statistics.median(r["req_s"] for r in by_count.get(0, [])) if by_count.get(0) else None
        for count, runs in by_count.items():
            req_s = statistics.median(r["req_s"] for r in runs)
            p50 = statistics.median(r["p50_s"] or 0 for r in runs)
            p99 = statistics.median(r["p99_s"] or 0 for r in runs)
            ratio = f"{req_s / base:.2f}" if base else "-"
            lines.append(f"| {name} | {count} | {req_s:.2f} | {p50:.2f} | {p99:.2f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
