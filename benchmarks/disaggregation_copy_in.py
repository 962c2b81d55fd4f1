"""The decode instance's step times while pulled KV is copied into its pool: on the engine
thread before a step (as before 1bacd2b) vs on another thread while the steps run (the
puller thread's copy now). Not in CI; docs/disaggregation.md.

One engine in this process (the default model, `--num-threads 1`; pin it with taskset),
`--streams` requests decoding; every `--every` steps a "pull" of `--prompt-tokens` tokens of
KV (random bytes, the pool's block size) is written into free pool blocks no request uses:
- engine-thread, per-block: the copy as it was (one copy per block and cache tensor),
  synchronously between two steps (the step after it pays for it);
- engine-thread: the staged copy (`ModelRunner.write_kv_blocks`), synchronously;
- thread: the staged copy on a second thread, started between two steps, overlapping them.
Reported per mode: step time p50, p99 and max (a step's time = the stream's inter-token
latency, plus the copy when it ran before the step), alternated over `--rounds`.

    taskset -c 1 .venv/bin/python benchmarks/disaggregation_copy_in.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.hardware import cpu_info  # noqa: E402


def per_block_copy(pool, payloads, blocks) -> None:
    """The copy-in as it was before 1bacd2b (HostKVBuffer._copy_in per block)."""
    import torch

    for payload, block in zip(payloads, blocks):
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for tensor in pool:
            n = tensor[0].numel()
            tensor[block].copy_(data[offset:offset + n].view(1, *tensor.shape[1:])[0])
            offset += n


def run(llm: LLM, mode: str, args: argparse.Namespace, rng: random.Random) -> dict:
    import torch

    from tokenmill.runner.kv_offload import block_tensors

    engine = llm.engine
    runner = engine.executor
    pool = block_tensors(runner.kv_cache)
    block_bytes = sum(t[0].numel() for t in pool)
    num_blocks = -(-args.prompt_tokens // engine.config.cache.block_size)
    free = sorted(engine.scheduler.kv.free_queue)[-num_blocks:]  # the last blocks: no stream reaches them
    payloads = [os.urandom(block_bytes) for _ in range(num_blocks)]
    for i in range(args.streams):
        engine.add_request(f"{mode}-{i}-{rng.random()}", [rng.randrange(1000, 40000) for _ in range(32)],
                           SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, temperature=0))
    engine.step()  # the prompts
    times, copies, worker = [], [], None
    for step in range(args.steps):
        before = 0.0
        if step % args.every == args.every // 2:
            started = time.perf_counter()
            if mode == "thread":
                def copy() -> None:
                    t0 = time.perf_counter()
                    runner.write_kv_blocks(free, payloads)
                    copies.append(time.perf_counter() - t0)
                if worker is not None:
                    worker.join()
                worker = threading.Thread(target=copy)
                worker.start()
            else:
                with torch.inference_mode():
                    if mode == "engine-thread":
                        runner.write_kv_blocks(free, payloads)
                    else:
                        per_block_copy(pool, payloads, free)
                before = time.perf_counter() - started
                copies.append(before)
        t0 = time.perf_counter()
        engine.step()
        times.append(before + time.perf_counter() - t0)
    if worker is not None:
        worker.join()
    while engine.has_unfinished_requests():
        engine.step()
    times.sort()
    return {"mode": mode, "step_p50_ms": 1e3 * times[len(times) // 2],
            "step_p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], "step_max_ms": 1e3 * times[-1],
            "copy_ms": 1e3 * statistics.median(copies), "copies": len(copies), "load_avg": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="tokens of KV a pull carries")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25, help="a pull every this many steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="engine-thread-per-block,engine-thread,thread")
    args = parser.parse_args()
    llm = LLM(max_model_len=8192, num_threads=1, seed=0)
    rng = random.Random(0)
    run(llm, "thread", argparse.Namespace(**{**vars(args), "steps": 10, "every": 5}), rng)  # warm-up
    rows = []
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            row = {"round": r, **run(llm, mode, args, rng)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {}
    for mode in args.modes.split(","):
        sel = [x for x in rows if x["mode"] == mode]
        summary[mode] = {k: (round(statistics.median(x[k] for x in sel), 1), round(min(x[k] for x in sel), 1),
                             round(max(x[k] for x in sel), 1))
                         for k in ("step_p50_ms", "step_p99_ms", "step_max_ms", "copy_ms", "load_avg")}
    print(json.dumps({"cpu": cpu_info().model_name, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
