"""This machine, measured: memory read bandwidth and GEMM FLOP/s with a number of threads.

`probe` is what `benchmarks/compare.py probe` prints beside every benchmark (its record,
with the default model's bounds); `this_device` turns the same measurements into a
`Device`, the record the catalog holds, for `tokenmill plan --target-device this`. torch is
imported inside the functions only.

How: bandwidth is the faster of a sum over a float32 buffer and a GEMV over a float32
matrix of the same size (median times); FLOP/s are the better of `a @ b` and
`linear(a, b)` on square matrices (CPUs without native bf16 take very different paths for
the two). A size is measured only when a 512 run predicts one call under `max_call_s`.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.hardware import cpu_info
from tokenmill.planner.roofline import (
    WEIGHT_FORMATS,
    Deployment,
    Device,
    kv_cache_dtype,
    linear_flops_per_token,
    weight_bytes,
    weights_read_per_step,
)
from tokenmill.planner.shape import read_gguf

Log = Callable[[str], None]


def median_seconds(fn: Callable[[], Any], reps: int, budget_s: float = 4.0) -> float:
    """Median wall time of `fn` after one warm-up call; fewer reps when a call is slow."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    reps = max(1, min(reps, int(budget_s / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(threads: int, mem_mib: int = 1024, gemm_n: int = 2048, reps: int = 5,
            log: Log | None = None) -> dict[str, Any]:
    """Memory bandwidth and GEMM throughput with `threads` threads (GB/s and GFLOP/s)."""
    import torch

    torch.set_num_threads(threads)
    if log:
        log(f"probe: {threads} threads, {mem_mib} MiB for bandwidth, {gemm_n}^2 GEMM")
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "buffer_mib": mem_mib, "gemm_n": gemm_n}
    with torch.inference_mode():
        n = mem_mib * 2**20 // 4
        x = torch.ones(n, dtype=torch.float32)
        out["sum_gb_s"] = x.nbytes / median_seconds(lambda: x.sum(), reps) / 1e9
        del x
        m = int(math.isqrt(n))
        a, v = torch.ones(m, m, dtype=torch.float32), torch.ones(m, dtype=torch.float32)
        out["gemv_gb_s"] = a.nbytes / median_seconds(lambda: torch.mv(a, v), reps) / 1e9
        del a, v
        out["bandwidth_gb_s"] = max(out["sum_gb_s"], out["gemv_gb_s"])
        for dtype in ("float32", "bfloat16"):
            rates = gemm_rates(getattr(torch, dtype), gemm_n, reps)
            out[f"gemm_{dtype}_by_op"] = rates
            out[f"gemm_{dtype}_gflop_s"] = max(r["gflop_s"] for r in rates.values())
    return out


def gemm_rates(dtype: Any, n: int, reps: int, max_call_s: float = 2.0) -> dict[str, dict[str, float]]:
    """GFLOP/s of `a @ b` and of `linear(a, b)` (= a @ b.T, the layout of model weights):
    on CPUs without native bf16 the two take very different paths. A size is measured at
    `n` only when a 512 run predicts one call under `max_call_s`."""
    import torch

    ops = {"matmul": lambda a, b: a @ b, "linear": torch.nn.functional.linear}
    rates = {}
    for name, op in ops.items():
        size, rate = 512, 0.0
        for size in (512, n) if n > 512 else (n,):
            if rate and 2 * size**3 / (rate * 1e9) > max_call_s:
                break
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            rate = 2 * size**3 / median_seconds(lambda: op(a, b), reps) / 1e9
            rates[name] = {"n": size, "gflop_s": rate}
    return rates


def device_from_probe(result: dict[str, Any], name: str | None = None) -> Device:
    """A `Device` record of measurements (`measure`'s or `probe`'s), with this machine's RAM."""
    cpu = cpu_info()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    flops = {dtype: result[f"gemm_{dtype}_gflop_s"] * 1e9 for dtype in ("float32", "bfloat16")}
    return Device(
        name or f"this machine ({result['threads']} threads)", memory, result["bandwidth_gb_s"] * 1e9, flops, "cpu",
        source=f"measured with {result['threads']} threads: {cpu.describe()}",
        notes=(f"memory read {result['bandwidth_gb_s']:.1f} GB/s (sum {result['sum_gb_s']:.1f}, "
               f"GEMV {result['gemv_gb_s']:.1f}); GEMM float32 {result['gemm_float32_gflop_s']:.1f}, "
               f"bfloat16 {result['gemm_bfloat16_gflop_s']:.1f} GFLOP/s",
               "int8 and fp8 are not measured: they run at the measured bfloat16 rate"),
    )


def this_device(threads: int | None = None, mem_mib: int = 1024, gemm_n: int = 2048, reps: int = 5,
                log: Log | None = None) -> Device:
    """This machine as a `Device`, measured with `threads` threads (default: all available)."""
    return device_from_probe(measure(threads or cpu_info().num_cores, mem_mib, gemm_n, reps, log))


def probe(threads: int, gguf: str, mem_mib: int = 1024, gemm_n: int = 2048, reps: int = 5,
          log: Log | None = None) -> dict[str, Any]:
    """Memory bandwidth and GEMM throughput with `threads` threads, and the model's bounds."""
    out = measure(threads, mem_mib, gemm_n, reps, log)
    out["bounds"] = model_bounds(out, gguf)
    return out


def model_bounds(machine: dict[str, Any], gguf: str) -> dict[str, Any]:
    """Batch-1 roofline bounds of a GGUF model on measured rates: decode tok/s = bandwidth /
    bytes read per step (layers + final norm + LM head, KV ignored) in float32, bfloat16 and
    as stored; prefill tok/s = GEMM FLOP/s / (2 x layer weights)."""
    shape, stored = read_gguf(gguf)
    params = stored.params
    device = device_from_probe(machine)
    bounds: dict[str, Any] = {
        "model": Path(gguf).name,
        "layer_params": params.layers,
        "lm_head_params": params.lm_head,
        "tied_embeddings": params.tied,
        "decode_params_read_per_step": params.layers + params.final_norm + params.lm_head + params.other,
        "note": "decode: weights read once per step (layers + LM head), KV reads ignored; "
                "prefill: 2 FLOPs per layer weight per token, attention FLOPs and the LM head ignored; "
                "bf16 GEMM rates are torch's kernels, shape-dependent where the CPU has no native bf16",
    }
    for dtype in ("float32", "bfloat16"):
        fmt = WEIGHT_FORMATS[dtype]
        dep = Deployment(shape, params, weight_bytes(params, fmt), kv_cache_dtype("auto", fmt), device, dtype)
        bounds[f"decode_tok_s_{dtype}"] = device.bandwidth / weights_read_per_step(dep, 1)
        bounds[f"prefill_tok_s_{dtype}"] = dep.flops_rate / linear_flops_per_token(params, shape)
    as_stored = Deployment(shape, params, stored.bytes, kv_cache_dtype("auto", WEIGHT_FORMATS["bfloat16"]),
                           device, "int8")
    quantized = weights_read_per_step(as_stored, 1)
    bounds["gguf_decode_bytes_per_step"] = int(quantized)
    bounds["decode_tok_s_gguf_as_stored"] = device.bandwidth / quantized
    return bounds


def format_probe(result: dict[str, Any]) -> str:
    b = result["bounds"]
    return "\n".join([
        f"probe ({result['threads']} threads): memory read {result['bandwidth_gb_s']:.1f} GB/s "
        f"(sum {result['sum_gb_s']:.1f}, GEMV {result['gemv_gb_s']:.1f}); GEMM GFLOP/s, best of "
        f"matmul/linear: {_gemm_text(result, 'float32')}; {_gemm_text(result, 'bfloat16')}",
        f"bounds for {b['model']} ({b['layer_params'] / 1e6:.1f}M layer + {b['lm_head_params'] / 1e6:.1f}M LM head "
        f"params): decode float32 {b['decode_tok_s_float32']:.1f} tok/s, bfloat16 {b['decode_tok_s_bfloat16']:.1f} "
        f"tok/s, GGUF as stored ({b['gguf_decode_bytes_per_step'] / 2**20:.0f} MiB) "
        f"{b['decode_tok_s_gguf_as_stored']:.1f} tok/s; prefill float32 {b['prefill_tok_s_float32']:.0f} tok/s, "
        f"bfloat16 {b['prefill_tok_s_bfloat16']:.0f} tok/s",
        f"  ({b['note']})",
    ])


def _gemm_text(result: dict[str, Any], dtype: str) -> str:
    by_op = result.get(f"gemm_{dtype}_by_op", {})
    ops = ", ".join(f"{op} {r['gflop_s']:.1f} at {r['n']}^2" for op, r in by_op.items())
    return f"{dtype} {result[f'gemm_{dtype}_gflop_s']:.1f}" + (f" ({ops})" if ops else "")
