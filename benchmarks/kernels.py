"""Micro-benchmarks of tokenmill's CPU kernels against what PyTorch offers for the same work.

    .venv/bin/python benchmarks/kernels.py [--threads 2] [--only linear|attention|quant|decode-step|column-splits]

- linear: `skinny_linear` on tiled weights (float32 and bfloat16) against oneDNN on its packed
  float32 weights, for the default model's projection shapes and 1-64 rows. Each call gets
  weights not in cache (a rotating set of ~200 MB), as in a decode step.
- attention: `paged_decode_attention` over 32 sequences x 530 tokens (9 query / 3 KV heads,
  head_dim 64), blocks in order and shuffled, float32 and bfloat16 caches.
- quant: `quant_linear` on GGUF Q4_1 and Q8_0 weights (tokenmill/quantization) against the
  bf16 `skinny_linear`, aten's `_weight_int4pack_mm_for_cpu` (bf16 activations, group 32) and
  bf16 F.linear, for the default model's shapes and 1-512 rows. Every candidate streams its
  own set of distinct weight copies of `--quant-set-mib` (default 256 MiB, beyond this
  machine's cache), the candidates taking turns within each timing round.
- column-splits: deterministic inference's row-parallel linears (the default model's o_proj and
  down_proj, all 30 layers, cut where a 2-rank split's second rank starts) at 1-32 rows on the
  plan's integer kernels: whole with no split (the default plan), as two parts computed apart
  (`column_parts_linear`), whole with the cut as a column split (`quant_linear(..., column_splits=)`).

Median of up to 7 timed calls after a warm-up call (compare.py's timing helper). Not part of CI: timings on shared machines
are noisy, compare within one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.kernels import (
    cpu_kernels_available,
    paged_decode_attention,
    quant_isa,
    quant_linear,
    skinny_linear,
    tile_for_skinny,
)
from tokenmill.runner.plan import ROWS
from tokenmill.planner.machine import median_seconds
from tokenmill.quantization.qtensor import QuantizedTensor

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


def cpu_description() -> str:
    with open("/proc/cpuinfo") as f:
        info = f.read()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{name}; {' '.join(wanted)}"


def interleaved_medians(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per candidate, the candidates taking turns within each round (so a
    change in machine load hits them all alike); one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for r in range(rounds + 1):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def read_bandwidth(mib: int = 1024) -> float:
    """GB/s of a plain read (sum) of `mib` MiB of float32, median of 5."""
    a = torch.ones(mib * 2**18)
    return a.numel() * 4 / median_seconds(a.sum, 5) / 1e9


def bench_quant(set_mib: int, rounds: int) -> None:
    import gguf

    from tokenmill.quantization.gguf_blocks import from_gguf_blocks

    print(f"\nquant: {cpu_description()}")
    print(f"quant_linear integer path: {quant_isa()}; threads: {torch.get_num_threads()}; "
          f"plain read of 1 GiB: {read_bandwidth():.1f} GB/s")
    print("us per matrix (GB/s of weight bytes as stored); each candidate streams its own "
          f"{set_mib} MiB of distinct copies (M = 64: the first 16 copies, M = 512: 4)")
    names = ("Q4_1 int", "Q4_1 gemm", "Q8_0 int", "Q8_0 gemm", "bf16 skinny", "int4pack bf16", "F.linear bf16")
    print("  Q4_1/Q8_0 int: quant_linear's integer path (float32 x); gemm: its dequantize + bf16 GEMM path (bf16 x "
          "and y, as F.linear bf16; default: int up to "
          f"{ROWS.quant_integer_rows[4]} rows for Q4_1, {ROWS.quant_integer_rows[8]} for Q8_0); bf16 skinny: skinny_linear on "
          "bf16 tiles; int4pack bf16: "
          "aten._weight_int4pack_mm_for_cpu, group 32, bf16 x; F.linear bf16: bf16 x and W")
    print(f"{'shape':>8} {'N x K':>11} {'M':>4} " + " ".join(f"{n:>19}" for n in names))
    rng = np.random.default_rng(0)
    for name, (n, k) in SHAPES.items():
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        q41 = from_gguf_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), 3)
        q80 = from_gguf_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), 8)
        wt = torch.from_numpy(w)
        # aten int4pack: codes 0..15 with w = (q - 8) * scale + zero, bf16 scales/zeros [K/32, N, 2].
        int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q41.codes().int(), 1)
        sz = torch.stack((q41.scales(), q41.mins() + 8 * q41.scales()), dim=-1).transpose(0, 1).contiguous().bfloat16()
        nbytes = {"Q4_1": n * k * 20 // 32, "Q8_0": n * k * 34 // 32, "bf16 skinny": n * k * 2,
                  "int4pack bf16": int4.numel() + sz.numel() * 2, "F.linear bf16": n * k * 2}
        base = {"Q4_1": (q41.packed,), "Q8_0": (q80.packed,), "bf16 skinny": (tile_for_skinny(wt, torch.bfloat16),),
                "int4pack bf16": (int4, sz), "F.linear bf16": (wt.bfloat16(),)}
        sets = {c: [tuple(t.clone() for t in base[c]) for _ in range(max(2, set_mib * 2**20 // nbytes[c]))]
                for c in base}
        for rows in (1, 4, 16, 64, 512):
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            limit = None if rows <= 16 else 16 if rows <= 64 else 4

            def each(c: str, f: Callable[..., object]) -> Callable[[], object]:
                return lambda: [f(*t) for t in sets[c][:limit]]

            big = 1 << 30
            candidates = {
                "Q4_1 int": each("Q4_1", lambda t: quant_linear(x, t, q41.format, None, big)),
                "Q4_1 gemm": each("Q4_1", lambda t: quant_linear(xb, t, q41.format, None, 0)),
                "Q8_0 int": each("Q8_0", lambda t: quant_linear(x, t, q80.format, None, big)),
                "Q8_0 gemm": each("Q8_0", lambda t: quant_linear(xb, t, q80.format, None, 0)),
                "bf16 skinny": each("bf16 skinny", lambda t: skinny_linear(x, t, n)),
                "int4pack bf16": each("int4pack bf16", lambda t, s: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, t, 32, s)),
                "F.linear bf16": each("F.linear bf16", lambda t: F.linear(xb, t)),
            }
            if rows > 64:  # compute-bound kernels made for few rows: minutes, and nothing to learn
                for c in ("Q4_1 int", "Q8_0 int", "bf16 skinny", "int4pack bf16"):
                    del candidates[c]
            med = interleaved_medians(candidates, rounds)
            cells = []
            for c in names:
                key = c.split(" ")[0] if c.startswith("Q") else c
                if c not in med:
                    cells.append("-")
                    continue
                per = med[c] / len(sets[key][:limit])
                cells.append(f"{per * 1e6:8.1f} ({nbytes[key] / per / 1e9:4.1f} GB/s)")
            print(f"{name:>8} {f'{n}x{k}':>11} {rows:>4} " + " ".join(f"{cell:>19}" for cell in cells), flush=True)


def default_model_weights() -> tuple[list[QuantizedTensor], QuantizedTensor]:
    """The default GGUF's layer weights as stored (q/k/v and gate/up rows fused), and its
    Q8_0 token embedding, the tied LM head."""
    from tokenmill.gguf_file import GGUFFile
    from tokenmill.config import default_model_path
    from tokenmill.quantization.gguf_blocks import GGUF_BLOCK_TYPES, from_gguf_blocks

    file = GGUFFile(default_model_path())
    infos = {t.name: t for t in file.tensors}

    def load(name: str) -> QuantizedTensor:
        info = infos[name]
        _, block, size = GGUF_BLOCK_TYPES[info.ggml_type]
        rows, row_bytes = info.shape[1], info.shape[0] // block * size
        raw = np.frombuffer(file._data, dtype=np.uint8, count=rows * row_bytes, offset=info.offset)
        return from_gguf_blocks(raw.reshape(rows, row_bytes), info.ggml_type)

    layers = []
    for i in range(file.metadata["llama.block_count"]):
        b = f"blk.{i}."
        layers.append(QuantizedTensor.cat_rows([load(b + "attn_q.weight"), load(b + "attn_k.weight"), load(b + "attn_v.weight")]))
        layers.append(load(b + "attn_output.weight"))
        layers.append(QuantizedTensor.cat_rows([load(b + "ffn_gate.weight"), load(b + "ffn_up.weight")]))
        layers.append(load(b + "ffn_down.weight"))
    return layers, load("token_embd.weight")


def bench_decode_step(rounds: int) -> None:
    """All matmuls of one decode step of the default model (30 x [qkv, o, gate_up, down] +
    the LM head) on its GGUF weights as stored, against the bf16 skinny kernel on the same
    weights dequantized: the weight stream of batch-1 decode, and its bound."""
    layers, head = default_model_weights()
    stored = sum(w.packed.numel() for w in layers) + head.packed.numel()
    tiled = [tile_for_skinny(w.dequantize(), torch.bfloat16) for w in layers + [head]]
    bf16_bytes = sum(t.numel() * 2 for t in tiled)
    bandwidth = read_bandwidth()
    print(f"\ndecode step of the default model ({len(layers)} layer matmuls + LM head), threads: "
          f"{torch.get_num_threads()}; weights as stored {stored / 2**20:.1f} MiB, bf16 {bf16_bytes / 2**20:.1f} MiB; "
          f"plain read {bandwidth:.1f} GB/s -> bound {stored / bandwidth / 1e6:.2f} ms (stored), "
          f"{bf16_bytes / bandwidth / 1e6:.2f} ms (bf16)")
    bound = stored / (bandwidth * 1e9)
    for rows in (1, 2, 4, 8):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in layers + [head]}
        candidates = {
            "GGUF as stored": lambda: [quant_linear(xs[w.shape[1]], w.packed, w.format) for w in layers + [head]],
            "bf16 skinny": lambda: [skinny_linear(xs[w.shape[1]], t, w.shape[0]) for w, t in zip(layers + [head], tiled)],
        }
        med = interleaved_medians(candidates, rounds)
        q, b = med["GGUF as stored"], med["bf16 skinny"]
        print(f"  M={rows}: GGUF as stored {q * 1e3:.2f} ms ({stored / q / 1e9:.1f} GB/s, "
              f"{bound / q:.0%} of the bound), bf16 skinny {b * 1e3:.2f} ms ({bf16_bytes / b / 1e9:.1f} GB/s); "
              f"ratio {b / q:.2f}x", flush=True)


def bench_column_splits(rounds: int) -> None:
    from tokenmill.kernels import column_parts_linear, quant_gemm_panels, quant_integer_gemm_built
    from tokenmill.model_arch import ModelArchConfig
    from tokenmill.parallel.layout import reference_split
    from tokenmill.parallel.model_parallel import ModelParallel

    if not quant_integer_gemm_built():
        raise SystemExit("column splits run on the block-order integer kernels: an AVX512-VNNI build")
    layers, _ = default_model_weights()
    smollm2 = ModelArchConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True)
    single = ModelParallel.single(smollm2, reduce_as=reference_split(smollm2, 32))
    cuts = {576: single.column_cuts("layers.0.self_attn.o_proj.weight"),
            1536: single.column_cuts("layers.0.mlp.down_proj.weight")}
    weights = [w for i, w in enumerate(layers) if i % 4 in (1, 3)]  # o_proj, down_proj
    rows_gemm = ROWS.quant_integer_rows[4]

    def parts_of(w: QuantizedTensor) -> list[QuantizedTensor]:
        bounds = [0, *cuts[w.shape[1]], w.shape[1]]
        return [w.narrow_cols(a, b - a) for a, b in zip(bounds, bounds[1:])]

    whole = [(w, quant_gemm_panels(w.packed, w.format)) for w in weights]
    parts = [[(p, quant_gemm_panels(p.packed, p.format)) for p in parts_of(w)] for w in weights]
    print(f"\ncolumn splits: o_proj and down_proj of the default model's 30 layers, cut at {cuts[576]} / {cuts[1536]}; "
          f"threads: {torch.get_num_threads()}; microseconds a layer (both linears)")
    for rows in (1, 8, 16, 32):
        xs = {k: torch.randn(rows, k) for k in cuts}
        candidates = {
            "whole, no split": lambda: [quant_linear(xs[w.shape[1]], w.packed, w.format, None, rows_gemm, integer_gemm=True,
                                                     gemm_panels=p) for w, p in whole],
            "two parts": lambda: [column_parts_linear(xs[sum(p.shape[1] for p, _ in ps)], [p.packed for p, _ in ps],
                                                      [v for p, _ in ps for v in p.format], [None] * len(ps), rows_gemm,
                                                      True, gemm_panels=[g for _, g in ps]) for ps in parts],
            "whole, split": lambda: [quant_linear(xs[w.shape[1]], w.packed, w.format, None, rows_gemm, integer_gemm=True,
                                                  gemm_panels=p, column_splits=cuts[w.shape[1]]) for w, p in whole],
        }
        med = interleaved_medians(candidates, rounds)
        print(f"  M={rows}: " + ", ".join(f"{name} {t / 30 * 1e6:.0f} us" for name, t in med.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=("linear", "attention", "quant", "decode-step", "column-splits"))
    parser.add_argument("--quant-set-mib", type=int, default=256, help="distinct weights per candidate (quant)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per candidate (quant)")
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the native CPU kernels did not build: python -m tokenmill.kernels -v shows why")
    torch.set_num_threads(args.threads)
    if args.only in (None, "linear"):
        bench_linear()
    if args.only in (None, "attention"):
        bench_attention()
    if args.only in (None, "quant"):
        bench_quant(args.quant_set_mib, args.rounds)
    if args.only in (None, "quant", "decode-step"):
        bench_decode_step(args.rounds)
    if args.only in (None, "column-splits"):
        bench_column_splits(args.rounds)


if __name__ == "__main__":
    main()
