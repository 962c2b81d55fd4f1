"""The panel kernel against the dense split it replaces, matrix by matrix: for each weight
shape and row count, `kernels.panel_linear` on panels, the skinny kernel on its tiles and
oneDNN on its packed copy (float32 weights: float32 oneDNN; bf16 weights: bf16 oneDNN on
bf16 inputs, what the split ran past its rows), alternated in one process, medians of --reps
after a warm-up. Times are per call over 8 distinct copies of the weight, so a decode row
streams them from memory as a real step does. Prints the CPU and the thread count. Not part
of CI.

    .venv/bin/python benchmarks/panel_linear.py --reps 7
    .venv/bin/python benchmarks/panel_linear.py --shapes 14336x4096,4096x14336 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tokenmill import kernels
from tokenmill.hardware import cpu_info
from tokenmill.quantization.dense import CPUDenseWeights, CPUMatmulChoice

COPIES = 8  # distinct weights per timed pass (several MB: streamed from memory, not cache)


def timed(calls: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median milliseconds a pass, the callables alternated rep by rep."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(reps):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def case(n: int, k: int, dtype: torch.dtype, rows: tuple[int, ...], reps: int) -> None:
    gemm = "onednn_bf16" if dtype == torch.bfloat16 else "onednn_f32"
    gen = torch.Generator().manual_seed(0)
    floats = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(COPIES)]
    split = [CPUDenseWeights(w, dtype, CPUMatmulChoice(0, gemm)) for w in floats]
    panels = [kernels.pack_panels(w, dtype) for w in floats]
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        xg = x.to(split[0].packed.dtype)
        t = timed({
            "skinny": lambda: [kernels.skinny_linear(x, s.tiled, n) for s in split],
            "onednn": lambda: [s._onednn(xg) for s in split],
            "panels": lambda: [kernels.panel_linear(x, p, n) for p in panels],
        }, reps)
        flops = 2 * m * n * k * COPIES / 1e9
        print(f"| {n}x{k} | {str(dtype).removeprefix('torch.')} | {m} | {t['skinny']:.3f} | {t['onednn']:.3f} | "
              f"{t['panels']:.3f} ({flops / t['panels'] * 1e3:.0f} GFLOP/s) | {t['panels'] / t['skinny']:.2f}x | "
              f"{t['panels'] / t['onednn']:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="960x576,1536x576,576x1536,49152x576",
                        help="out x in of each weight (default: the default model's qkv, gate/up half, down, head)")
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.cpu_kernels_available():
        raise SystemExit("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")
    print(f"CPU: {cpu_info().describe()}; {torch.get_num_threads()} threads; medians of {args.reps}, ms per pass over "
          f"{COPIES} copies of the weight")
    print("| weight (out x in) | dtype | rows | skinny ms | oneDNN ms | panels ms | panels / skinny | panels / oneDNN |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = tuple(int(r) for r in args.rows.split(","))
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        if not kernels.panel_linear_built(dtype):
            print(f"(no panel kernel for {dtype} in this build)")
            continue
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            case(n, k, dtype, tuple(r for r in rows if n * r <= 49152 * 64), args.reps)


if __name__ == "__main__":
    main()
