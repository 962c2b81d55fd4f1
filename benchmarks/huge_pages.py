"""Weights and KV cache on 2 MiB pages vs 4 KiB pages, side by side in one process.

    .venv/bin/python benchmarks/huge_pages.py [--rounds 24] [--only kernels|engine]

- kernels: the default model's 120 Q4_1 layer matrices (random codes, its shapes) at 1, 4
  and 8 rows, streamed from an arena on huge pages vs from ordinary allocations; paged
  decode attention (bf16 cache, 9/3 heads, head_dim 64) over a pool on huge pages vs not,
  blocks in order and shuffled. Alternated, medians of medians.
- engine: two default-model LLMs in this process, one with TOKENMILL_HUGE_PAGES=1 and one
  with 0, alternately running W1 (128 prompt + 128 new tokens, greedy) `--rounds` times;
  end-to-end seconds, medians and pairwise wins.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def median_of(f: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def alternate(candidates: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    medians: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, f in candidates.items():
            medians[name].append(median_of(f, reps))
    return {name: statistics.median(v) for name, v in medians.items()}


def bench_kernels(rounds: int) -> None:
    from test_quantization import GGUF_TYPES, _gguf_blocks

    from tokenmill import kernels
    from tokenmill.kernels import huge_pages
    from tokenmill.quantization.gguf_blocks import from_gguf_blocks

    if not kernels.cpu_kernels_available():
        raise SystemExit("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate_up, down x 30 layers
    weights = [from_gguf_blocks(_gguf_blocks("Q4_1", n, k), GGUF_TYPES["Q4_1"]) for n, k in shapes]
    small = [w.packed.clone() for w in weights]
    arena = huge_pages.HugePageArena(huge_pages.HugePageArena.measure(small))
    huge = [arena.place(p) for p in small]
    print(f"weights: {len(weights)} Q4_1 matrices, {arena.used / 2**20:.0f} MiB")
    for rows in (1, 4, 8):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}

        def layers(packs: list[torch.Tensor]) -> Callable[[], None]:
            return lambda: [kernels.quant_linear(xs[w.shape[1]], p, w.format) for w, p in zip(weights, packs)]

        t = alternate({"4k": layers(small), "2M": layers(huge)}, rounds, 7)
        print(f"  {rows} rows: 4 KiB pages {t['4k'] * 1e3:.2f} ms, 2 MiB pages {t['2M'] * 1e3:.2f} ms: "
              f"{t['4k'] / t['2M']:.2f}x")
    heads, kv_heads, head_dim, block, num_blocks = 9, 3, 64, 16, 8000
    shape = (num_blocks, block, kv_heads, head_dim)
    caches = {"4k": [torch.randn(shape).bfloat16() for _ in range(2)]}
    caches["2M"] = [huge_pages.empty(shape, torch.bfloat16).copy_(c) for c in caches["4k"]]
    print(f"paged decode attention, bf16 cache of {num_blocks} blocks x {block} tokens")
    for seqs, ctx, shuffled in ((32, 530, False), (32, 530, True), (64, 400, True)):
        ids = list(range(num_blocks))
        if shuffled:
            random.Random(0).shuffle(ids)
        per = -(-ctx // block)
        tables = torch.tensor([ids[i * per:(i + 1) * per] for i in range(seqs)], dtype=torch.int32)
        lens = torch.full((seqs,), ctx, dtype=torch.int32)
        q = torch.randn(seqs, heads, head_dim)
        out = torch.empty_like(q)

        def attend(kv: list[torch.Tensor]) -> Callable[[], None]:
            return lambda: kernels.paged_decode_attention(out, q, kv[0], kv[1], tables, lens, 0.125)

        t = alternate({name: attend(kv) for name, kv in caches.items()}, rounds, 9)
        print(f"  {seqs} x {ctx} tokens, blocks {'shuffled' if shuffled else 'in order'}: 4 KiB pages "
              f"{t['4k'] * 1e3:.3f} ms, 2 MiB pages {t['2M'] * 1e3:.3f} ms: {t['4k'] / t['2M']:.2f}x")


def bench_engine(rounds: int) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.workloads.offline import FULL, build_requests, ordinary_token_ids, repetition_rng

    llms = {}
    for name, flag in (("2M", "1"), ("4k", "0")):
        os.environ["TOKENMILL_HUGE_PAGES"] = flag
        llms[name] = LLM(enable_prefix_caching=False, seed=0)
    pool = ordinary_token_ids(llms["2M"].engine.tokenizer, llms["2M"].engine.facts.vocab_size)
    prompt, new = build_requests("W1", FULL, repetition_rng(0, "W1", 0), pool)[0]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            t = time.perf_counter()
            llm.generate([prompt], params)
            seconds[name].append(time.perf_counter() - t)
    wins = sum(h < s for h, s in zip(seconds["2M"], seconds["4k"]))
    a, b = statistics.median(seconds["2M"]), statistics.median(seconds["4k"])
    print(f"W1 end to end ({len(prompt)} + {new} tokens), {rounds} alternated rounds: 2 MiB pages {a:.3f} s "
          f"[{min(seconds['2M']):.3f}-{max(seconds['2M']):.3f}], 4 KiB pages {b:.3f} s "
          f"[{min(seconds['4k']):.3f}-{max(seconds['4k']):.3f}]: {b / a:.2f}x; huge pages faster in {wins} of {rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--only", choices=("kernels", "engine"))
    args = parser.parse_args()
    from tokenmill.kernels import huge_pages

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU {cpu}, {torch.get_num_threads()} threads, THP {huge_pages.thp_mode() or 'unknown'}, "
          f"load {os.getloadavg()[0]:.2f}")
    if not huge_pages.available():
        raise SystemExit("this machine gives no transparent huge pages on request: nothing to compare")
    if args.only in (None, "kernels"):
        bench_kernels(max(3, args.rounds // 4))
    if args.only in (None, "engine"):
        bench_engine(args.rounds)


if __name__ == "__main__":
    main()
