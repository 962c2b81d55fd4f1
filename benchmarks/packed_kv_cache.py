"""The packed bf16 KV cache against the token layout, kernel by kernel (one layer of the default
model's heads, 9 query / 3 KV heads of 64, both layouts holding the same K and V, alternated in
one process, medians of --reps): decode attention (`paged_decode_attention`: the paged kernel on
the token layout, the prefill kernel's arithmetic in place on the packed one) and a step's
prompt attention (`prefill_attention_chunks`: packed per call from the token layout, read in
place from the packed one). Prints the CPU. Not part of CI.

    .venv/bin/python benchmarks/packed_kv_cache.py --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import kernels
from tokenmill.attention.kv_cache import LayerKVCache
from tokenmill.hardware import cpu_info

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def caches(tokens: int) -> tuple[LayerKVCache, LayerKVCache]:
    """A token-layout and a packed cache with the same random K and V in every slot."""
    blocks = -(-tokens // BLOCK) + 4
    layouts = [LayerKVCache.allocate(blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, packed=p) for p in (False, True)]
    slots = torch.arange(blocks * BLOCK)
    k, v = torch.randn(len(slots), KV_HEADS, HEAD_DIM), torch.randn(len(slots), KV_HEADS, HEAD_DIM)
    for cache in layouts:
        kernels.write_kv_cache(k, v, (cache.k, cache.v), None, slots)
    return layouts[0], layouts[1]


def timed(calls: dict, reps: int, inner: int) -> dict[str, float]:
    """Median microseconds a call, the callables alternated rep by rep."""
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(reps):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def decode_case(batch: int, context: int, reps: int) -> None:
    tokens, packed = caches(batch * context + BLOCK * batch)
    per_seq = -(-context // BLOCK)
    tables = torch.randperm(tokens.k.shape[0])[: batch * per_seq].view(batch, per_seq).int().contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32)
    q, out = torch.randn(batch, HEADS, HEAD_DIM), torch.empty(batch, HEADS, HEAD_DIM)
    t = timed({layout: (lambda c=cache: kernels.paged_decode_attention(out, q, c.k, c.v, tables, lens, 0.125))
               for layout, cache in (("token layout", tokens), ("packed", packed))}, reps, 20)
    print(f"decode, {batch} sequences of {context} keys: token layout {t['token layout']:.1f} us, packed "
          f"{t['packed']:.1f} us, packed / token {t['packed'] / t['token layout']:.2f}x")


def chunks_case(prefix: int, chunks: int, own: int, reps: int) -> None:
    """`chunks` prompt chunks of `own` rows after a shared `prefix` (the same slots)."""
    tokens, packed = caches(prefix + chunks * own)
    keys, row_starts, key_starts = [], [0], [0]
    for c in range(chunks):
        keys.append(torch.cat([torch.arange(prefix), prefix + c * own + torch.arange(own)]))
        row_starts.append(row_starts[-1] + own)
        key_starts.append(key_starts[-1] + len(keys[-1]))
    tables = (torch.tensor(row_starts), torch.cat(keys), torch.tensor(key_starts))
    q = torch.randn(row_starts[-1], HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    flat = [t.view(-1, KV_HEADS, HEAD_DIM) for t in tokens]
    t = timed({"token layout": lambda: kernels.prefill_attention_chunks(out, q, *flat, 0.125, *tables),
               "packed": lambda: kernels.prefill_attention_chunks(out, q, packed.k, packed.v, 0.125, *tables)},
              reps, 5)
    print(f"prompts, {chunks} chunk(s) of {own} rows after a shared {prefix}-token prefix: token layout "
          f"{t['token layout']:.0f} us, packed {t['packed']:.0f} us, packed / token {t['packed'] / t['token layout']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not kernels.cpu_kernels_available() or not kernels.has_prefill_attention(HEAD_DIM):
        raise SystemExit("the packed cache needs the native kernels built with AVX-512 BF16")
    print(f"CPU: {cpu_info().describe()}; {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    for batch, context in ((1, 600), (16, 400), (32, 600), (64, 400)):
        decode_case(batch, context, args.reps)
    for prefix, chunks, own in ((512, 32, 64), (512, 8, 64), (0, 1, 1024)):
        chunks_case(prefix, chunks, own, args.reps)


if __name__ == "__main__":
    main()
