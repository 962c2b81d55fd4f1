"""Does watching the live dashboard slow the server? W3-like throughput, side by side.

One `tokenmill serve`; each round runs the same batch of requests (all submitted at once,
random token-id prompts of U[min, max] tokens, outputs of U[min, max] tokens with
ignore_eos; a fixed seed, so every run is the same work) under each condition in turn:

    closed   nobody watches /dashboard
    sse      a client reads /dashboard/events throughout (the server-side cost only)
    browser  headless Chromium shows the page (adds the browser's own CPU, on the same box)

and the table gives the median wall time and output tokens per second of each condition
over the rounds, and its ratio to `closed`. Conditions alternate round by round so that a
drift of the machine's other load hits them alike. Not part of CI.

    .venv/bin/python benchmarks/dashboard_overhead.py --rounds 3 --output dashboard_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import threading
import time

import httpx

from tokenmill.hardware import cpu_info
from tokenmill.workloads.local_server import LocalServer

CONDITIONS = ("closed", "sse", "browser")


def make_requests(args: argparse.Namespace, vocab: int = 32000) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))],
             rng.randint(args.output_min, args.output_max)) for _ in range(args.num_requests)]


async def run_batch(url: str, model: str, requests: list[tuple[list[int], int]]) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(prompt: list[int], max_tokens: int) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0}
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(p, n) for p, n in requests))
        return time.perf_counter() - started, sum(tokens)


class SSEReader:
    """Reads /dashboard/events in a thread until stopped; counts the snapshots."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.snapshots = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> SSEReader:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _read(self) -> None:
        with httpx.stream("GET", self.url + "/dashboard/events", timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith("event: snapshot"):
                    self.snapshots += 1
                if self._stop.is_set():
                    return


class Browser:
    """Headless Debian Chromium with the page open."""

    def __init__(self, url: str) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium")
        for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1500,1250"):
            options.add_argument(argument)
        self.driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
        self.url = url

    def __enter__(self) -> Browser:
        self.driver.get(self.url + "/dashboard")
        deadline = time.monotonic() + 30
        while self.seq() == 0:  # connected and painted its first snapshot
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard page did not connect")
            time.sleep(0.1)
        return self

    def __exit__(self, *_: object) -> None:
        self.driver.get("about:blank")  # closes the event stream

    def seq(self) -> int:
        return int(self.driver.execute_script("return document.getElementById('snapshot-seq').dataset.value") or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--output-min", type=int, default=32)
    parser.add_argument("--output-max", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("server_args", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = parser.parse_args()
    conditions = args.conditions.split(",")
    requests = make_requests(args)
    server = LocalServer(["--disable-access-log", "--log-level", "warning", *args.server_args]).start()
    browser = Browser(server.url) if "browser" in conditions else None
    results: dict[str, list[dict[str, float]]] = {c: [] for c in conditions}
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run_batch(server.url, model, requests[:4]))  # warm-up
        for round_index in range(args.rounds):
            order = conditions[round_index % len(conditions):] + conditions[:round_index % len(conditions)]
            for condition in order:
                watched = (SSEReader(server.url) if condition == "sse" else browser if condition == "browser"
                           else None)
                if watched is None:
                    seconds, tokens = asyncio.run(run_batch(server.url, model, requests))
                    updates = 0
                else:
                    with watched:
                        before = browser.seq() if condition == "browser" else 0
                        seconds, tokens = asyncio.run(run_batch(server.url, model, requests))
                        updates = (browser.seq() - before) if condition == "browser" else watched.snapshots
                load = os.getloadavg()[0]  # the machine's other work: the noise in these figures
                results[condition].append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                                           "updates": updates, "loadavg_1m": load})
                print(f"round {round_index + 1} {condition:8s} {seconds:7.1f} s {tokens / seconds:7.1f} tok/s "
                      f"{updates} dashboard updates, load average {load:.1f}", flush=True)
    finally:
        if browser is not None:
            browser.driver.quit()
        server.stop()
    base = statistics.median(r["tokens_per_s"] for r in results[conditions[0]])
    print(f"\n{args.num_requests} requests at once, prompts U[{args.prompt_min}, {args.prompt_max}], outputs "
          f"U[{args.output_min}, {args.output_max}]; median of {args.rounds} rounds; {cpu_info().model_name}")
    print("| condition | median s | median output tok/s | vs closed |\n|---|---|---|---|")
    for condition, runs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        print(f"| {condition} | {statistics.median(r['seconds'] for r in runs):.1f} | {tps:.1f} | {tps / base:.3f} |")
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"args": vars(args), "results": results}, file, indent=2)


if __name__ == "__main__":
    main()
