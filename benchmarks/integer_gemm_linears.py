"""The default model's 120 layer linears (Q4_1 as stored: qkv, o, gate_up, down of 30
layers) at M rows through quant_linear's whole-block integer GEMM, once each per pass: the
prefill GEMM time of an M-token prompt. Prints the median pass, its spread and int8 GMAC/s.
To compare two checkouts' kernels, run it from each in turn, alternating, e.g.:

    for r in 1 2 3 4; do for d in /work/main /work/wt/x; do
      (cd $d && M=128 PYTHONPATH=$PWD .venv/bin/python benchmarks/integer_gemm_linears.py); done; done

M (rows, default 128), R (passes, default 15) and OMP_NUM_THREADS come from the environment.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from kernels import cpu_description, default_model_weights

    from tokenmill.kernels import build_cpu_kernels, quant_integer_gemm_built, quant_linear

    build_cpu_kernels()
    if not quant_integer_gemm_built():
        raise SystemExit("no integer GEMM in this build (it needs AVX512-VNNI)")
    rows, passes = int(os.environ.get("M", "128")), int(os.environ.get("R", "15"))
    layers, _ = default_model_weights()
    inputs = [torch.randn(rows, w.shape[1]) for w in layers]

    def one_pass() -> None:
        for w, x in zip(layers, inputs):
            quant_linear(x, w.packed, w.format, w.col_perm, 8, -1, True)

    one_pass()  # warm-up
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    macs = sum(rows * w.shape[0] * w.shape[1] for w in layers)
    median = statistics.median(times)
    print(f"{cpu_description()}; {torch.get_num_threads()} threads; checkout {Path(__file__).resolve().parents[1]}")
    print(f"M={rows}: {median * 1e3:.1f} ms per pass ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}), "
          f"{macs / median / 1e9:.1f} GMAC/s")


if __name__ == "__main__":
    main()
