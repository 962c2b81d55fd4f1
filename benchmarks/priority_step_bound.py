"""The priority step bound (issue 29, `--priority-step-fraction`) on the simulator: a stream
of low-priority long prompts overloads the machine while short high-priority prompts arrive
periodically; the high-priority requests' TTFT (p50 / p99 / max) against their unloaded TTFT
(the same requests alone), and what the low-priority stream pays (its completed prompt
tokens per second). Virtual time on the CPU-like cost model of benchmarks/scheduling_goodput.py
(the default model on the 2-core AMD EPYC box: 53 ms + 1.55 ms per prefill token). Not CI.

    .venv/bin/python benchmarks/priority_step_bound.py --fractions 0 0.25 0.5 1
"""

from __future__ import annotations

import argparse
import random

from tokenmill.config import EngineConfig
from tokenmill.planner.costmodel import StepCostModel
from tokenmill.simulator.simulate import SimulationSetup, simulate
from tokenmill.workloads.trace import Trace, TraceRequest

CPU_LIKE = StepCostModel(0.053, 0.00155, 0.0028, 0.0, decode_rows=(1, 8, 32, 64),
                         decode_seconds=(0.046, 0.063, 0.130, 0.222))


def workload(seconds: float, low_rate: float, low_len: int, high_every: float, high_len: int, out: int,
             seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    reqs, t = [], 0.0
    while t < seconds:
        t += rng.expovariate(low_rate)
        reqs.append(TraceRequest(t, [rng.randrange(10, 30000) for _ in range(low_len)], out, 1))
    t = 0.0  # the first high-priority request (a warm-up, not counted) comes before the stream starts
    reqs = [r for r in reqs if r.arrival_s >= 0.5]
    while t < seconds:
        reqs.append(TraceRequest(t + (rng.uniform(0, 0.5) if t else 0.0), [rng.randrange(10, 30000) for _ in range(high_len)], out, 0))
        t += high_every
    return sorted(reqs, key=lambda r: r.arrival_s)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5])
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--low-rate", type=float, default=2.0)
    p.add_argument("--low-len", type=int, default=512)
    p.add_argument("--high-every", type=float, default=2.0)
    p.add_argument("--high-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    a = p.parse_args()
    reqs = workload(a.seconds, a.low_rate, a.low_len, a.high_every, a.high_len, a.output_len)
    high = [i for i, r in enumerate(reqs) if r.priority == 0][1:]  # not the warm-up

    def run(requests, fraction):
        config = EngineConfig.from_kwargs(scheduling_policy="priority", priority_step_fraction=fraction,
                                          max_num_batched_tokens=a.max_num_batched_tokens)
        return simulate(Trace(requests, "priority-overload", {}),
                        SimulationSetup(config, 8192, 4096, CPU_LIKE, model_name="cpu-like"), warm_step_cost=True)

    alone = [r.ttft for r in run([reqs[i] for i in high], 0.0).records]
    unloaded = sorted(alone)[len(alone) // 2]
    print(f"{len(reqs)} requests ({len(high)} high), unloaded high TTFT median {unloaded * 1e3:.0f} ms")
    for f in a.fractions:
        result = run(reqs, f)
        recs = result.records
        ht = [recs[i].ttft for i in high]
        ratio = [recs[i].ttft / alone[k] for k, i in enumerate(high)]
        low = [r for r in reqs if r.priority == 1]
        # overloaded throughout: the time to finish everything is the work over the throughput
        done = sum(len(r.prompt_token_ids) for r in low) / result.duration
        print(f"fraction {f}: high TTFT p50 {pct(ht, .5) * 1e3:.0f} p99 {pct(ht, .99) * 1e3:.0f} "
              f"max {max(ht) * 1e3:.0f} ms; p99 / unloaded {pct(ht, .99) / unloaded:.2f}x, "
              f"p99 of per-request ratio {pct(ratio, .99):.2f}x; all done at {result.duration:.1f} s, low-priority prompt tok/s {done:.0f}")


if __name__ == "__main__":
    main()
