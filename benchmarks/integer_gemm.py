"""Quantized weights past the integer rows: the whole-block integer GEMM vs the bf16 GEMM on
dequantized tiles, side by side in one process.

    .venv/bin/python benchmarks/integer_gemm.py [--rounds 5] [--only kernels|engine]

- kernels: the default model's layer shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
  576x1536; Q4_1 from random weights, 8 layers' distinct copies so they stream) at 16-512 rows:
  quant_linear with `integer_gemm` on float32 rows vs the bf16 GEMM on bf16 rows (what the
  bf16 activation path hands it). Alternated, medians of the per-round medians.
- engine: two default-model LLMs in this process, `quant_gemm="integer"` and `"bf16"`,
  alternately running W2 (1024-token prompt + 16 new), W3's first 16 requests and W1
  (128 + 128; its TTFT is a 128-row prefill), greedy, prefix caching off; seconds per run,
  medians, spread and pairwise wins.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def bench_kernels(rounds: int) -> None:
    from test_quantization import GGUF_TYPES, _gguf_blocks

    from tokenmill import kernels
    from tokenmill.quantization.gguf_blocks import from_gguf_blocks

    if not kernels.quant_integer_gemm_built():
        raise SystemExit(f"no integer GEMM in this build ({kernels.quant_isa()}; it needs AVX512-VNNI)")
    layers = [from_gguf_blocks(_gguf_blocks("Q4_1", n, k, seed=i), GGUF_TYPES["Q4_1"])
              for i in range(8) for n, k in SHAPES]
    print("rows  shape      integer us  bf16 gemm us  gemm/integer")
    for rows in (16, 32, 64, 128, 512):
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        for n, k in SHAPES:
            mine = [w for w in layers if w.shape == (n, k)]
            runs = {"integer": lambda: [kernels.quant_linear(xs[k], w.packed, w.format, None, 8, integer_gemm=True)
                                        for w in mine],
                    "gemm": lambda: [kernels.quant_linear(xb[k], w.packed, w.format, None, 8) for w in mine]}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(rounds):
                for name, f in runs.items():
                    samples = []
                    for _ in range(5):
                        t = time.perf_counter()
                        f()
                        samples.append((time.perf_counter() - t) / len(mine))
                    times[name].append(statistics.median(samples))
            a, b = statistics.median(times["integer"]) * 1e6, statistics.median(times["gemm"]) * 1e6
            print(f"{rows:4d}  {n}x{k:<5d}  {a:10.0f}  {b:12.0f}  {b / a:12.2f}", flush=True)


def bench_engine(rounds: int) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.workloads.offline import FULL, build_requests, ordinary_token_ids, repetition_rng

    llms = {name: LLM(enable_prefix_caching=False, seed=0, quant_gemm=name) for name in ("integer", "bf16")}
    first = llms["integer"]
    print("plan:", first.engine.describe_plan() if hasattr(first.engine, "describe_plan") else "")
    pool = ordinary_token_ids(first.engine.tokenizer, first.engine.facts.vocab_size)
    workloads = {w: build_requests(w, FULL, repetition_rng(0, w, 0), pool) for w in ("W2", "W3", "W1")}
    workloads["W3"] = workloads["W3"][:16]
    for w, requests in workloads.items():
        prompts = [p for p, _ in requests]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
        seconds: dict[str, list[float]] = {name: [] for name in llms}
        outputs = {}
        for _ in range(rounds):
            for name, llm in llms.items():
                t = time.perf_counter()
                outputs[name] = llm.generate(prompts, params)
                seconds[name].append(time.perf_counter() - t)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outputs["integer"], outputs["bf16"]))
        wins = sum(i < b for i, b in zip(seconds["integer"], seconds["bf16"]))
        a, b = statistics.median(seconds["integer"]), statistics.median(seconds["bf16"])
        tokens = sum(len(p) + n for p, n in requests)
        print(f"{w} ({len(requests)} requests, {tokens} tokens), {rounds} alternated rounds: integer GEMM {a:.3f} s "
              f"[{min(seconds['integer']):.3f}-{max(seconds['integer']):.3f}], bf16 GEMM {b:.3f} s "
              f"[{min(seconds['bf16']):.3f}-{max(seconds['bf16']):.3f}]: {b / a:.2f}x; integer faster in {wins} of "
              f"{rounds}; greedy tokens identical for {same} of {len(requests)} requests", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("kernels", "engine"))
    args = parser.parse_args()
    from tokenmill.hardware import cpu_info

    print(f"CPU {cpu_info().describe()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    if args.only in (None, "kernels"):
        bench_kernels(args.rounds)
    if args.only in (None, "engine"):
        bench_engine(args.rounds)


if __name__ == "__main__":
    main()
