"""The priority step bound on a real server (issue 29): `tokenmill serve --scheduling-policy
priority --priority-step-fraction F` with the default model, overloaded by a closed loop of
low-priority long prompts (`--low-concurrency` always outstanding) while a short
high-priority prompt arrives every `--high-every` seconds (plus up to 0.5 s of jitter).
Reports the high-priority TTFT (p50 / p99 / max) against their unloaded TTFT (the same kind
of request, one at a time on the idle server, measured first on each server), and the
low-priority prompt tokens completed per second. Prompts are random token ids (no prefix
cache hits), streamed /v1/completions, TTFT = the first streamed chunk. Not CI (minutes).
`--interrupt off on` runs each fraction without and with `--priority-interrupt` (a
high-priority arrival cuts the low-priority step in flight), alternated.

    .venv/bin/python benchmarks/priority_step_bound_serve.py --fractions 0 0.25 --repeat 2
    .venv/bin/python benchmarks/priority_step_bound_serve.py --fractions 0.25 --interrupt off on
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from tokenmill.workloads.local_server import LocalServer


MODEL = ""


async def ttft_of(client: httpx.AsyncClient, prompt: list[int], priority: int, max_tokens: int) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "priority": priority,
            "ignore_eos": True}
    start = time.monotonic()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and first is None:
                first = time.monotonic() - start
    assert first is not None
    return first


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


async def measure(url: str, a: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    global MODEL
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        MODEL = (await client.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(3):  # warm-up: both kinds, so the step cost has been learned
            await ttft_of(client, prompt(a.low_len), 1, 2)
            await ttft_of(client, prompt(a.high_len), 0, 2)
        unloaded = []
        for _ in range(a.unloaded):
            unloaded.append(await ttft_of(client, prompt(a.high_len), 0, a.output_len))
            await asyncio.sleep(0.2)
        stop = time.monotonic() + a.seconds
        low_done = 0

        async def low_loop() -> None:
            nonlocal low_done
            while time.monotonic() < stop:
                await ttft_of(client, prompt(a.low_len), 1, a.output_len)  # the whole stream is read
                if time.monotonic() <= stop:
                    low_done += 1

        async def high_loop() -> list[float]:
            out = []
            await asyncio.sleep(1.0)  # the low stream is under way
            while time.monotonic() + a.high_every < stop:
                out.append(await ttft_of(client, prompt(a.high_len), 0, a.output_len))
                await asyncio.sleep(a.high_every + rng.uniform(0, 0.5) - out[-1])
            return out

        started = time.monotonic()
        lows = [asyncio.create_task(low_loop()) for _ in range(a.low_concurrency)]
        high = await high_loop()
        await asyncio.sleep(max(stop - time.monotonic(), 0))
        elapsed = time.monotonic() - started
        for task in lows:
            task.cancel()
        await asyncio.gather(*lows, return_exceptions=True)
        metrics = (await client.get("/metrics")).text
    interrupted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("tokenmill:num_interrupted_steps_total"))
    return {"unloaded": unloaded, "high": high, "low_tok_s": low_done * a.low_len / elapsed, "interrupted": interrupted}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--low-concurrency", type=int, default=6)
    p.add_argument("--low-len", type=int, default=512)
    p.add_argument("--high-every", type=float, default=2.0)
    p.add_argument("--high-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--unloaded", type=int, default=10)
    p.add_argument("--serve-args", default="--max-model-len 1024")
    p.add_argument("--interrupt", nargs="+", choices=["off", "on"], default=["off"],
                   help="run each fraction without and/or with --priority-interrupt")
    a = p.parse_args()
    for rep in range(a.repeat):
        for f, interrupt in [(f, i) for f in a.fractions for i in a.interrupt]:  # alternate the settings
            extra = ["--priority-interrupt"] if interrupt == "on" else []
            server = LocalServer(["--scheduling-policy", "priority", "--priority-step-fraction", str(f), *extra,
                                  "--disable-access-log", *a.serve_args.split()]).start()
            try:
                r = asyncio.run(measure(server.url, a, seed=rep))
            finally:
                server.stop()
            un = statistics.median(r["unloaded"])
            h = r["high"]
            print(f"F={f} interrupt {interrupt} run {rep}: unloaded TTFT median {un * 1e3:.0f} ms (min {min(r['unloaded']) * 1e3:.0f}, "
                  f"max {max(r['unloaded']) * 1e3:.0f}); under load n={len(h)} p50 {pct(h, .5) * 1e3:.0f} "
                  f"p99 {pct(h, .99) * 1e3:.0f} max {max(h) * 1e3:.0f} ms -> p99 {pct(h, .99) / un:.2f}x, "
                  f"p50 {pct(h, .5) / un:.2f}x unloaded; low-priority prompt tok/s {r['low_tok_s']:.0f}; "
                  f"interrupted steps {r['interrupted']:.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
