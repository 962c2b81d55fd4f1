"""Would an asynchronous host-tier promotion pay on this CPU? (docs/kv-tiers.md, "Promotion
is synchronous"). The default model decodes 16 requests; each round times, alternated: one
engine step alone, the host tier's load of N blocks alone (`HostKVBuffer.apply`, into free
pool blocks), and the two at once (the load in a second thread while the step runs: the
overlap an asynchronous promotion would buy). Not in CI.

    .venv/bin/python benchmarks/kv_promotion_overlap.py [--blocks 280] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill.engine.batch import KVTransfers  # noqa: E402
from tokenmill.hardware import cpu_info  # noqa: E402
from tokenmill.llm import LLM  # noqa: E402
from tokenmill.runner.kv_offload import HostKVBuffer  # noqa: E402
from tokenmill.sampling.params import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=280, help="blocks per load (a 4.5k-token prefix: 280)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    print(cpu_info().describe())
    llm = LLM(kv_cache_memory="1GiB", max_model_len=4096)
    engine, runner = llm.engine, llm.engine.executor
    host = HostKVBuffer(runner.kv_cache)
    num_blocks = runner.kv_cache.num_blocks
    spare = list(range(num_blocks - args.blocks, num_blocks))  # the pool's last blocks: never reached here
    host.apply(KVTransfers(args.blocks, store=[(b, i) for i, b in enumerate(spare)]))
    load = KVTransfers(args.blocks, load=[(i, b) for i, b in enumerate(spare)])
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [1 + (7 * i + j) % 4000 for j in range(256)], params)
    for _ in range(3):  # prefills done: every step after is a decode step of all of them
        engine.step()
    assert len(engine.scheduler.running) == args.requests and max(engine.scheduler.kv.req_blocks[r][-1] for r in
                                                                 engine.scheduler.kv.req_blocks) < spare[0]
    step, copy, both = [], [], []
    for _ in range(args.rounds):
        started = time.perf_counter()
        engine.step()
        step.append(time.perf_counter() - started)
        started = time.perf_counter()
        host.apply(load)
        copy.append(time.perf_counter() - started)
        started = time.perf_counter()
        worker = threading.Thread(target=host.apply, args=(load,))
        worker.start()
        engine.step()
        worker.join()
        both.append(time.perf_counter() - started)
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    mb = args.blocks * runner.kv_cache.spec.bytes_per_block / 1e6
    print(f"{args.requests} decoding, medians of {args.rounds}: step {med(step):.1f} ms, load of {args.blocks} blocks "
          f"({mb:.0f} MB) {med(copy):.1f} ms, one after the other {med(step) + med(copy):.1f} ms, "
          f"at once {med(both):.1f} ms: an overlap saves {med(step) + med(copy) - med(both):.1f} ms "
          f"({100 * (med(step) + med(copy) - med(both)) / med(copy):.0f}% of the load)")
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)


if __name__ == "__main__":
    main()
