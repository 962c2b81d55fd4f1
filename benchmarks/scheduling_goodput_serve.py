"""Goodput of fcfs, priority and SLO mode on a real server (issue 29): the chat workload
(random 128-token prompts, 64 output tokens, Poisson arrivals; or `--dataset shared-prefix
--prefix-len 512 --num-prefixes 4`: one of 4 prefixes, then 128 random tokens) at a few request rates,
goodput = TTFT <= 1 s and TPOT <= 100 ms, through `tokenmill bench serve --goodput`.
One fresh `tokenmill serve` (the default model) per policy, the rates in turn on it:

- fcfs: the defaults;
- SLO mode: `--slo-ttft-ms 1000 --slo-tpot-ms 100`;
- priority: `--scheduling-policy priority` (the step bound at its default), the load sent by
  two `bench serve` at once: 90% of the rate with `priority` 1, 10% with `priority` 0.

Prints, per policy and rate, the share of requests meeting both SLOs (and each alone), and
for priority the high-priority tenth's share and p99 TTFT. Not CI (minutes per policy).

    .venv/bin/python benchmarks/scheduling_goodput_serve.py --rates 0.5 1 1.5 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenmill.workloads.local_server import LocalServer

POLICIES = {"fcfs": [], "SLO mode": ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"],
            "priority": ["--scheduling-policy", "priority"]}
TTFT_S, TPOT_S = 1.0, 0.1


def bench(url: str, rate: float, num: int, seed: int, out: Path, a: argparse.Namespace,
          priority: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url, "--dataset", a.dataset,
           "--prefix-len", str(a.prefix_len), "--num-prefixes", str(a.num_prefixes), "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--num-prompts", str(num),
           "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
           "--goodput", "ttft:1000", "tpot:100", "--save-result", str(out), "--num-warmups", "0"]
    if priority is not None:
        cmd += ["--extra-body", json.dumps({"priority": priority})]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def shares(result: dict) -> tuple[list[bool], list[bool], list[float]]:
    ttft_ok, tpot_ok = [], []
    for ttft, latency, n, err in zip(result["ttfts"], result["latencies"], result["output_lens"], result["errors"]):
        ok = not err and n > 0
        ttft_ok.append(ok and ttft <= TTFT_S)
        tpot_ok.append(ok and (n <= 1 or (latency - ttft) / (n - 1) <= TPOT_S))
    return ttft_ok, tpot_ok, [t for t, e in zip(result["ttfts"], result["errors"]) if not e]


def fmt(ttft_ok: list[bool], tpot_ok: list[bool]) -> str:
    n = len(ttft_ok)
    good = sum(a and b for a, b in zip(ttft_ok, tpot_ok))
    return f"{good / n:.0%} (TTFT ok {sum(ttft_ok) / n:.0%}, TPOT ok {sum(tpot_ok) / n:.0%})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix"])
    p.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: e.g. 512 (random: 0)")
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random), suffix tokens (shared-prefix)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--serve-args", default="--max-model-len 1024")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="goodput-"))
    for policy in a.policies:
        server = LocalServer([*POLICIES[policy], "--disable-access-log", *a.serve_args.split()]).start()
        try:
            # warm-up: a few requests so kernels and the step cost are ready
            bench(server.url, 4.0, 8, 99, tmp / "warm.json", a).wait()
            for rate in a.rates:
                num = max(int(rate * a.seconds), 10)
                # A seed per rate: the same seed at every rate sent the same prompts again, and the
                # prefix cache answered the later rates' prompts (49% at 8/s, then 70% at 10/s).
                seed = round(rate * 100)
                if policy != "priority":
                    out = tmp / f"{policy}-{rate}.json"
                    proc = bench(server.url, rate, num, seed, out, a)
                    if proc.wait() != 0:
                        raise RuntimeError(proc.stderr.read().decode()[-2000:])
                    ttft_ok, tpot_ok, _ = shares(json.loads(out.read_text()))
                    print(f"{policy} rate {rate}/s n={num}: goodput {fmt(ttft_ok, tpot_ok)}", flush=True)
                    continue
                hi_n = max(num // 10, 3)
                procs = [bench(server.url, rate * 0.9, num - hi_n, seed, tmp / f"lo-{rate}.json", a, priority=1),
                         bench(server.url, rate * 0.1, hi_n, seed + 1, tmp / f"hi-{rate}.json", a, priority=0)]
                for proc in procs:
                    if proc.wait() != 0:
                        raise RuntimeError(proc.stderr.read().decode()[-2000:])
                lo = shares(json.loads((tmp / f"lo-{rate}.json").read_text()))
                hi = shares(json.loads((tmp / f"hi-{rate}.json").read_text()))
                ttfts = sorted(hi[2])
                p99 = ttfts[min(int(0.99 * len(ttfts)), len(ttfts) - 1)] if ttfts else float("nan")
                print(f"priority rate {rate}/s n={num} ({hi_n} high): goodput {fmt(lo[0] + hi[0], lo[1] + hi[1])}; "
                      f"high-priority {fmt(hi[0], hi[1])}, p99 TTFT {p99 * 1e3:.0f} ms", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
