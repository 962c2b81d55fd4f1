"""Side-by-side figures for docs/reliability.md: what a hostile request costs the others.

For each checkout given (e.g. the commit before issue 18's work, and this one), start
`tokenmill serve` from it and measure, in one run:
  1. big prompts: a 20 MB completion body and a 4 MB /tokenize body; time until the
     answer, and /health latency (median, max) while it is being handled;
  2. stop strings: a plain 64-token request alone, beside the same kind of request
     (the batch of two, as a control), and beside a request with 10,000 stop strings
     (all greedy, ignore_eos): the plain request's time, and the other's own.

    python benchmarks/serve_hardening.py /path/to/old/checkout /path/to/new/checkout

Each server runs with --num-threads 1, float32, in the checkout's own directory, with
the flags the new server needs to accept 10,000 stop strings and a 20 MB body (an old
server ignores flags it does not have: they are only passed when `serve --help` has them).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time

import httpx

sys.path.insert(0, ".")
from tests.server_utils import ServerProcess  # noqa: E402


def start(checkout: str) -> ServerProcess:
    help_text = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--help"], cwd=checkout,
                               env={"PYTHONPATH": checkout}, capture_output=True, text=True).stdout
    args = ["--max-model-len", "2048"]
    if "--max-stop-sequences" in help_text:
        args += ["--max-stop-sequences", "10000", "--max-request-body-bytes", str(32 * 2**20)]
    server = ServerProcess(*args)
    server_utils = sys.modules["tests.server_utils"]
    old_repo = server_utils.REPO
    server_utils.REPO = checkout  # the subprocess runs from the checkout
    import os
    os.environ["PYTHONPATH"] = checkout
    try:
        return server.start()
    finally:
        server_utils.REPO = old_repo


def health_during(server: ServerProcess, action) -> dict:
    latencies: list[float] = []
    result: dict = {}

    def run() -> None:
        started = time.monotonic()
        result["status"] = action()
        result["seconds"] = round(time.monotonic() - started, 2)

    worker = threading.Thread(target=run)
    with httpx.Client(timeout=120) as client:
        worker.start()
        while worker.is_alive():
            sent = time.monotonic()
            client.get(server.url + "/health")
            latencies.append(time.monotonic() - sent)
            time.sleep(0.02)
    worker.join()
    return {**result, "health_ms_median": round(statistics.median(latencies) * 1000, 1),
            "health_ms_max": round(max(latencies) * 1000, 1), "health_polls": len(latencies)}


def timed_post(server: ServerProcess, body: dict) -> tuple[float, int]:
    started = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
    return time.monotonic() - started, response.status_code


def measure(checkout: str) -> dict:
    server = start(checkout)
    try:
        figures: dict = {}
        big = json.dumps({"prompt": "hello world " * (20 * 2**20 // 12)}).encode()
        figures["20MB_completion"] = health_during(server, lambda: httpx.post(
            server.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
            timeout=600).status_code)
        four = {"prompt": "lorem ipsum dolor " * (4 * 2**20 // 18)}
        figures["4MB_tokenize"] = health_during(server, lambda: httpx.post(
            server.url + "/tokenize", json=four, timeout=600).status_code)

        plain = {"prompt": "Count: one, two,", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        stops = {**plain, "prompt": "List of words:", "stop": [f"never-{i:05d}-appears" for i in range(10_000)]}
        timed_post(server, plain)  # warm-up
        alone = [timed_post(server, plain)[0] for _ in range(3)]
        def pair(other: dict) -> tuple[float, float, int]:
            """The plain request's time beside `other`, and `other`'s own."""
            out: dict = {}
            worker = threading.Thread(target=lambda: out.update(r=timed_post(server, other)))
            worker.start()
            time.sleep(0.3)
            beside = timed_post(server, plain)[0]
            worker.join()
            return beside, out["r"][0], out["r"][1]

        no_stops = {key: value for key, value in stops.items() if key != "stop"}
        control = [pair(no_stops) for _ in range(3)]  # the same batch of two, without stop strings
        loaded = [pair(stops) for _ in range(3)]
        figures["stop_strings"] = {
            "plain_alone_s": round(statistics.median(alone), 2),
            "plain_beside_a_plain_request_s": round(statistics.median(c[0] for c in control), 2),
            "plain_beside_10k_stops_s": round(statistics.median(c[0] for c in loaded), 2),
            "request_without_stops_s": round(statistics.median(c[1] for c in control), 2),
            "request_with_10k_stops_s": round(statistics.median(c[1] for c in loaded), 2),
            "10k_stops_status": loaded[0][2],
        }
        return figures
    finally:
        server.stop()


if __name__ == "__main__":
    results = {checkout: measure(checkout) for checkout in sys.argv[1:]}
    print(json.dumps(results, indent=1))
