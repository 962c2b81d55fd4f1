"""Micro-benchmarks of tokenmill's CPU kernels against what PyTorch offers for the same work.

    .venv/bin/python benchmarks/kernels.py [--threads 2] [--only linear|attention]

- linear: `skinny_linear` on tiled weights (float32 and bfloat16) against oneDNN on its packed
  float32 weights, for the default model's projection shapes and 1-64 rows. Each call gets
  weights not in cache (a rotating set of ~200 MB), as in a decode step.
- attention: `paged_decode_attention` over 32 sequences x 530 tokens (9 query / 3 KV heads,
  head_dim 64), blocks in order and shuffled, float32 and bfloat16 caches.

Median of up to 7 timed calls after a warm-up call (compare.py's timing helper). Not part of CI: timings on shared machines
are noisy, compare within one run.
"""

from __future__ import annotations

import argparse
import random

import torch

from tokenmill.kernels import cpu_kernels_available, paged_decode_attention, skinny_linear, tile_for_skinny
from tokenmill.planner.machine import median_seconds

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def bench_linear() -> None:
    print("linear: ms per call (GB/s of weights read, GFLOP/s)")
    print(f"{'shape':>8} {'rows':>4} {'tiled f32':>26} {'tiled bf16':>26} {'oneDNN packed f32':>20}")
    for name, (n, k) in SHAPES.items():
        copies = max(1, int(200e6 / (n * k * 4)))
        weights = [torch.randn(n, k) for _ in range(copies)]
        tiled32 = [tile_for_skinny(w) for w in weights]
        tiled16 = [tile_for_skinny(w, torch.bfloat16) for w in weights]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        for rows in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(rows, k)
            torch.testing.assert_close(skinny_linear(x, tiled32[0], n), x @ weights[0].T, atol=1e-3, rtol=1e-4)
            t32 = median_seconds(lambda: [skinny_linear(x, w, n) for w in tiled32], 7) / copies
            t16 = median_seconds(lambda: [skinny_linear(x, w, n) for w in tiled16], 7) / copies
            tdn = median_seconds(
                lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed], 7
            ) / copies
            flop = 2 * rows * n * k

            def cell(t: float, weight_bytes: int) -> str:
                return f"{t * 1e3:.3f} ({weight_bytes / t / 1e9:.1f} GB/s, {flop / t / 1e9:.0f})"

            print(f"{name:>8} {rows:>4} {cell(t32, n * k * 4):>26} {cell(t16, n * k * 2):>26} "
                  f"{tdn * 1e3:>9.3f} ({flop / tdn / 1e9:.0f})")


def bench_attention() -> None:
    seqs, ctx, heads, kv_heads, head_dim, block = 32, 530, 9, 3, 64, 16
    num_blocks = 8000
    per_seq = -(-ctx // block)
    print(f"\nattention: {seqs} sequences x {ctx} tokens, {heads}/{kv_heads} heads, head_dim {head_dim}")
    for dtype in (torch.float32, torch.bfloat16):
        k_cache = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
        v_cache = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
        for order in ("in order", "shuffled"):
            ids = list(range(num_blocks))
            if order == "shuffled":
                random.Random(0).shuffle(ids)
            tables = torch.tensor([ids[i * per_seq:(i + 1) * per_seq] for i in range(seqs)], dtype=torch.int32)
            lens = torch.full((seqs,), ctx, dtype=torch.int32)
            q = torch.randn(seqs, heads, head_dim)
            out = torch.empty_like(q)
            t = median_seconds(lambda: paged_decode_attention(out, q, k_cache, v_cache, tables, lens, 0.125), 7)
            read = seqs * ctx * kv_heads * head_dim * 2 * k_cache.element_size()
            print(f"  {str(dtype).removeprefix('torch.'):>8} cache, blocks {order:>8}: {t * 1e3:.2f} ms "
                  f"({read / t / 1e9:.1f} GB/s of K/V)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("linear", "attention"))
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the native CPU kernels did not build: python -m tokenmill.kernels -v shows why")
    torch.set_num_threads(args.threads)
    if args.only in (None, "linear"):
        bench_linear()
    if args.only in (None, "attention"):
        bench_attention()


if __name__ == "__main__":
    main()
