"""`tokenmill bench offline`: fixed synthetic workloads through the offline API.

Workloads (greedy, `ignore_eos=True`, so every request produces exactly the tokens
asked for; prompts are random token ids drawn from the ordinary vocabulary, with
special and added tokens left out):

- W1: one request, 128 prompt tokens, 128 new tokens -> TTFT and decode tokens/s,
  decode = (new - 1) / (e2e - TTFT).
- W2: one request, 1024 prompt tokens, 16 new tokens -> prefill tokens/s = prompt / TTFT.
- W3: 64 requests submitted at once, prompt lengths uniform in [64, 512], output
  lengths uniform in [32, 256] -> total and output tokens/s, wall time.
- W4: 32 requests sharing one 512-token prefix, each with its own 32-token suffix,
  64 new tokens each -> throughput and mean TTFT, with prefix caching on and off.

Every repetition (and the warm-up) draws fresh token ids from its own seed, so no
repetition can be served from an earlier one's prefix cache; W4's prefix is shared
within a repetition only. Times are taken from the submission of the whole batch:
TTFT = first token - submission, e2e = last token - submission.

The reported figure of every metric is its median over the measured runs. With
`--baseline hf` the same requests (same token ids) also go through Hugging Face
transformers' `generate` on the same weights, interleaved run by run with
tokenmill's so that slow drifts of background load hit both alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.hardware import cpu_info

SCHEMA = "tokenmill.bench.offline/1"
WORKLOADS = ("W1", "W2", "W3", "W4")

# A request: (prompt token ids, number of tokens to generate).
Request = tuple[list[int], int]


# ----- workload shapes ------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    w1_prompt: int = 128
    w1_new: int = 128
    w2_prompt: int = 1024
    w2_new: int = 16
    w3_requests: int = 64
    w3_prompt: tuple[int, int] = (64, 512)
    w3_new: tuple[int, int] = (32, 256)
    w4_requests: int = 32
    w4_prefix: int = 512
    w4_suffix: int = 32
    w4_new: int = 64
    # transformers runs W3 as padded batches of this many requests (W4 goes as one batch).
    hf_batch_size: int = 16


FULL = Sizes()
QUICK = Sizes(
    w1_prompt=16, w1_new=8, w2_prompt=64, w2_new=4,
    w3_requests=4, w3_prompt=(8, 32), w3_new=(4, 12),
    w4_requests=4, w4_prefix=32, w4_suffix=8, w4_new=8,
    hf_batch_size=2,
)


def describe(name: str, s: Sizes) -> str:
    if name == "W1":
        return f"1 request, {s.w1_prompt} prompt + {s.w1_new} new tokens"
    if name == "W2":
        return f"1 request, {s.w2_prompt} prompt + {s.w2_new} new tokens"
    if name == "W3":
        return (f"{s.w3_requests} requests at once, prompts U[{s.w3_prompt[0]}, {s.w3_prompt[1]}], "
                f"outputs U[{s.w3_new[0]}, {s.w3_new[1]}]")
    return (f"{s.w4_requests} requests, shared {s.w4_prefix}-token prefix + {s.w4_suffix}-token suffix, "
            f"{s.w4_new} new tokens each")


def build_requests(name: str, sizes: Sizes, rng: random.Random, pool: Sequence[int]) -> list[Request]:
    """The requests of one repetition of a workload, drawn from `rng`."""

    def ids(n: int) -> list[int]:
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    if name == "W1":
        return [(ids(sizes.w1_prompt), sizes.w1_new)]
    if name == "W2":
        return [(ids(sizes.w2_prompt), sizes.w2_new)]
    if name == "W3":
        lengths = [(rng.randint(*sizes.w3_prompt), rng.randint(*sizes.w3_new)) for _ in range(sizes.w3_requests)]
        return [(ids(p), n) for p, n in lengths]
    if name == "W4":
        prefix = ids(sizes.w4_prefix)
        return [(prefix + ids(sizes.w4_suffix), sizes.w4_new) for _ in range(sizes.w4_requests)]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def repetition_rng(seed: int, workload: str, repetition: int | str) -> random.Random:
    """A distinct, reproducible stream per (seed, workload, repetition); `str` seeds are
    hashed deterministically by `random`, unlike `hash()`."""
    return random.Random(f"tokenmill-bench:{seed}:{workload}:{repetition}")


def ordinary_token_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """Token ids a random prompt may use: everything but special and added tokens
    (BOS, EOS, chat markers...), which would change how the model behaves."""
    excluded: set[int] = set()
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        excluded.update(backend.get_added_tokens_decoder())
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        excluded.add(bos)
    excluded.update(getattr(tokenizer, "eos_token_ids", ()) or ())
    is_special = getattr(tokenizer, "is_special", None)
    pool = [i for i in range(vocab_size) if i not in excluded and not (is_special and is_special(i))]
    if not pool:
        raise ValueError("the vocabulary has no ordinary tokens to build prompts from")
    return pool


# ----- measurements ---------------------------------------------------------------------


@dataclass
class RunRecord:
    """What one system did with one repetition's requests. Times in seconds from the
    submission of the whole batch."""

    wall_s: float
    ttft_s: list[float]
    e2e_s: list[float]
    prompt_tokens: list[int]
    output_tokens: list[int]
    cached_tokens: list[int]
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    generated_tokens: int | None = None  # incl. tokens a static batch computed but nobody asked for
    cpu_s: float = 0.0
    loadavg_1m: float = 0.0


# name -> (label, unit scale, higher is better)
METRICS: dict[str, tuple[str, float, bool]] = {
    "ttft_ms": ("TTFT (ms)", 1.0, False),
    "mean_ttft_ms": ("mean TTFT (ms)", 1.0, False),
    "e2e_s": ("end-to-end (s)", 1.0, False),
    "decode_tok_s": ("decode (tok/s)", 1.0, True),
    "tpot_ms": ("time per output token (ms)", 1.0, False),
    "prefill_tok_s": ("prefill (tok/s)", 1.0, True),
    "wall_s": ("wall time (s)", 1.0, False),
    "total_tok_s": ("total (tok/s)", 1.0, True),
    "output_tok_s": ("output (tok/s)", 1.0, True),
    "cached_prompt_tokens": ("prompt tokens from cache", 1.0, True),
}

# The metrics each workload reports, in table order.
WORKLOAD_METRICS: dict[str, tuple[str, ...]] = {
    "W1": ("ttft_ms", "decode_tok_s", "tpot_ms", "e2e_s"),
    "W2": ("ttft_ms", "prefill_tok_s", "e2e_s"),
    "W3": ("total_tok_s", "output_tok_s", "wall_s", "mean_ttft_ms"),
    "W4": ("total_tok_s", "output_tok_s", "mean_ttft_ms", "wall_s", "cached_prompt_tokens"),
}

# Keys of every run entry besides the workload's metrics.
RUN_KEYS = ("seed", "num_requests", "prompt_tokens", "output_tokens", "cpu_util", "loadavg_1m")


def metrics_of(workload: str, record: RunRecord) -> dict[str, float]:
    n_prompt, n_out = sum(record.prompt_tokens), sum(record.output_tokens)
    if workload in ("W1", "W2"):
        ttft, e2e, n = record.ttft_s[0], record.e2e_s[0], record.output_tokens[0]
        decode_s = e2e - ttft
        out = {"ttft_ms": 1000 * ttft, "e2e_s": e2e}
        if workload == "W1":
            out["decode_tok_s"] = (n - 1) / decode_s if decode_s > 0 else float("nan")
            out["tpot_ms"] = 1000 * decode_s / (n - 1) if n > 1 else float("nan")
        else:
            out["prefill_tok_s"] = record.prompt_tokens[0] / ttft
        return out
    out = {
        "total_tok_s": (n_prompt + n_out) / record.wall_s,
        "output_tok_s": n_out / record.wall_s,
        "wall_s": record.wall_s,
        "mean_ttft_ms": 1000 * statistics.fmean(record.ttft_s),
    }
    if workload == "W4":
        out["cached_prompt_tokens"] = float(sum(record.cached_tokens))
    return out


def run_entry(workload: str, record: RunRecord, seed: str, threads: int) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "seed": seed,
        "num_requests": len(record.prompt_tokens),
        "prompt_tokens": sum(record.prompt_tokens),
        "output_tokens": sum(record.output_tokens),
        # Busy CPU time over the available (thread) time: well below 1 under contention.
        "cpu_util": record.cpu_s / (record.wall_s * max(threads, 1)) if record.wall_s > 0 else 0.0,
        "loadavg_1m": record.loadavg_1m,
        **metrics_of(workload, record),
    }
    if record.generated_tokens is not None:
        entry["generated_tokens"] = record.generated_tokens
    return entry


def medians(runs: list[dict[str, Any]], keys: Sequence[str]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def speedup(metric: str, ours: float, theirs: float) -> float | None:
    """> 1 when `ours` is better (higher rate, or lower time)."""
    higher_better = METRICS[metric][2]
    if not ours or not theirs:
        return None
    return ours / theirs if higher_better else theirs / ours


# ----- tokenmill ------------------------------------------------------------------------


class TokenmillSystem:
    """Runs request lists through an `LLM`. `engines[flag]` is the LLM whose prefix
    caching is `flag`; the second one shares the first one's model and KV memory
    (used strictly one at a time), so W4 on/off costs a single model load."""

    def __init__(self, llm: Any) -> None:
        self.default = llm  # W1-W3 run on the engine as configured
        self.engines = {bool(llm.engine.config.cache.enable_prefix_caching): llm}
        self._last: Any = llm

    def llm(self, prefix_caching: bool | None = None) -> Any:
        if prefix_caching is None:
            return self.default
        if prefix_caching not in self.engines:
            self.engines[prefix_caching] = _sibling_llm(self.default, prefix_caching)
        return self.engines[prefix_caching]

    def run(self, requests: list[Request], prefix_caching: bool | None = None) -> RunRecord:
        from tokenmill.sampling.params import SamplingParams

        llm = self.llm(prefix_caching)
        if llm is not self._last:
            # The other engine wrote into the shared KV memory: forget what this one cached.
            _reset_prefix_cache(llm)
            self._last = llm
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        prompts = [p for p, _ in requests]
        load = os.getloadavg()[0]
        cpu0, t0, m0 = time.process_time(), time.perf_counter(), time.monotonic()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        record = RunRecord(wall, [], [], [], [], [], cpu_s=cpu, loadavg_1m=load)
        for (prompt, n), out in zip(requests, outputs):
            tokens = out.outputs[0].token_ids
            if len(tokens) != n:
                raise RuntimeError(f"tokenmill generated {len(tokens)} tokens where {n} were asked for")
            m = out.metrics
            record.ttft_s.append(m.first_token_time - m0)
            record.e2e_s.append(m.finished_time - m0)
            record.prompt_tokens.append(len(prompt))
            record.output_tokens.append(len(tokens))
            record.cached_tokens.append(out.num_cached_tokens)
            record.output_token_ids.append(list(tokens))
        return record


def _sibling_llm(llm: Any, enable_prefix_caching: bool) -> Any:
    """An LLM on `llm`'s executor (model and KV tensors) with prefix caching switched."""
    import copy

    engine = llm.engine.sibling(enable_prefix_caching=enable_prefix_caching)
    from_engine = getattr(type(llm), "from_engine", None)
    if from_engine is not None:
        return from_engine(engine)
    other = copy.copy(llm)
    other.engine, other.tokenizer = engine, engine.tokenizer
    return other


def _reset_prefix_cache(llm: Any) -> None:
    kv = llm.engine.scheduler.kv
    if not kv.reset_prefix_cache():
        raise RuntimeError("cannot reset the prefix cache while requests hold KV blocks")


# ----- the benchmark --------------------------------------------------------------------


@dataclass
class System:
    """One column of results: a name and how to run a request list."""

    name: str
    run: Callable[[list[Request]], RunRecord]
    threads: int


def systems_for(workload: str, tokenmill: TokenmillSystem, hf: Any | None, sizes: Sizes, threads: int) -> list[System]:
    if workload == "W4":
        systems = [
            System("tokenmill_prefix_on", lambda r: tokenmill.run(r, prefix_caching=True), threads),
            System("tokenmill_prefix_off", lambda r: tokenmill.run(r, prefix_caching=False), threads),
        ]
    else:
        systems = [System("tokenmill", lambda r: tokenmill.run(r), threads)]
    if hf is not None:
        batch = sizes.w4_requests if workload == "W4" else sizes.hf_batch_size
        systems.append(System("hf", lambda r: hf.run(r, batch_size=batch), threads))
    return systems


# Which pairs get a speedup column: (name, numerator system, denominator system).
COMPARISONS = {
    "W4": (("prefix_on_vs_off", "tokenmill_prefix_on", "tokenmill_prefix_off"),
           ("tokenmill_vs_hf", "tokenmill_prefix_on", "hf")),
}
DEFAULT_COMPARISONS = (("tokenmill_vs_hf", "tokenmill", "hf"),)

LABELS = {
    "tokenmill": "tokenmill",
    "tokenmill_prefix_on": "tokenmill (prefix cache on)",
    "tokenmill_prefix_off": "tokenmill (prefix cache off)",
    "hf": "transformers",
}


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_workload(
    workload: str,
    systems: list[System],
    sizes: Sizes,
    pool: Sequence[int],
    seed: int,
    runs: int,
    warmup: int,
) -> dict[str, Any]:
    results: dict[str, Any] = {s.name: {"runs": []} for s in systems}
    first_outputs: dict[str, list[list[int]]] = {}
    total = warmup + runs
    for rep in range(total):
        is_warmup = rep < warmup
        tag = f"warmup{rep}" if is_warmup else str(rep - warmup)
        requests = build_requests(workload, sizes, repetition_rng(seed, workload, tag), pool)
        for system in systems:
            what = f"warm-up {rep + 1}/{warmup}" if is_warmup else f"run {rep - warmup + 1}/{runs}"
            progress(f"{workload} {what}: {LABELS.get(system.name, system.name)} ...")
            record = system.run(requests)
            entry = run_entry(workload, record, tag, system.threads)
            progress(f"{workload} {what}: {LABELS.get(system.name, system.name)} done in {record.wall_s:.2f} s "
                     f"({_headline(workload, entry)})")
            if not is_warmup:
                results[system.name]["runs"].append(entry)
                first_outputs.setdefault(system.name, record.output_token_ids)
    for name, result in results.items():
        result["median"] = medians(result["runs"], WORKLOAD_METRICS[workload])
    out: dict[str, Any] = {
        "description": describe(workload, sizes),
        "metrics": list(WORKLOAD_METRICS[workload]),
        "systems": results,
        "speedup": {},
    }
    add_speedups(workload, out)
    if "hf" in first_outputs:
        ours = first_outputs.get("tokenmill") or first_outputs.get("tokenmill_prefix_on")
        out["greedy_agreement"] = _agreement(ours, first_outputs["hf"])
    return out


def add_speedups(workload: str, result: dict[str, Any]) -> None:
    """`speedup`: ratio of the two systems' medians. `paired_speedup`: the median of the
    per-run ratios; both systems ran the same requests back to back in each run, so a
    background load that drifts between runs hits both alike and cancels out."""
    systems = result["systems"]
    result["speedup"], result["paired_speedup"] = {}, {}
    for key, a, b in COMPARISONS.get(workload, DEFAULT_COMPARISONS):
        if a not in systems or b not in systems:
            continue
        metrics = [m for m in WORKLOAD_METRICS[workload] if m != "cached_prompt_tokens"]
        result["speedup"][key] = {m: speedup(m, systems[a]["median"][m], systems[b]["median"][m]) for m in metrics}
        paired = {}
        for m in metrics:
            ratios = [speedup(m, x[m], y[m]) for x, y in zip(systems[a]["runs"], systems[b]["runs"])]
            ratios = [r for r in ratios if r is not None]
            paired[m] = statistics.median(ratios) if ratios else None
        result["paired_speedup"][key] = paired


def _headline(workload: str, entry: dict[str, Any]) -> str:
    if workload == "W1":
        return f"TTFT {entry['ttft_ms']:.0f} ms, decode {entry['decode_tok_s']:.1f} tok/s"
    if workload == "W2":
        return f"TTFT {entry['ttft_ms']:.0f} ms, prefill {entry['prefill_tok_s']:.0f} tok/s"
    return f"{entry['total_tok_s']:.0f} tok/s total, {entry['output_tok_s']:.1f} tok/s output"


def _agreement(ours: list[list[int]] | None, theirs: list[list[int]]) -> dict[str, Any]:
    """How far the greedy outputs of both systems agree (first measured run): in
    bfloat16 different kernels round differently, so a late divergence is expected."""
    if not ours:
        return {}
    prefixes = []
    for a, b in zip(ours, theirs):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(k)
    return {
        "identical_requests": sum(int(a == b) for a, b in zip(ours, theirs)),
        "num_requests": len(prefixes),
        "mean_common_prefix_tokens": statistics.fmean(prefixes),
        "mean_output_tokens": statistics.fmean(len(a) for a in ours),
    }


# ----- machine --------------------------------------------------------------------------


def machine_info(dtype: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": _cpu_capability(torch),
        # Without it (no AVX512-BF16/AMX), CPU bfloat16 matmuls take a slow fallback path.
        "mkldnn_bf16": _mkldnn_bf16(torch),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dtype": dtype,
        "tokenmill_commit": _git_commit(),
        "tokenmill_dirty": _git_dirty(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def _cpu_capability(torch: Any) -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def _mkldnn_bf16(torch: Any) -> bool | None:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def _cpu_model() -> str:
    return cpu_info().model_name


def _cpu_flags() -> list[str]:
    """The SIMD extensions that decide CPU matmul speed (bf16 needs avx512_bf16/amx to be native)."""
    return cpu_info().simd_flags


def _git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (others' work in progress was measured too)."""
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        result = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=5)
        return bool(result.stdout.strip()) if result.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        result = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5)
        return result.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ----- command line ---------------------------------------------------------------------


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset of W1,W2,W3,W4 (default: all)")
    parser.add_argument("--runs", type=int, default=3, help="measured repetitions per workload; the median is reported")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions before the measured ones")
    parser.add_argument("--output", default=None, help="write the results as JSON to this file")
    parser.add_argument("--baseline", choices=["none", "hf"], default="none",
                        help="hf: also run Hugging Face transformers' generate on the same weights")
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="transformers' batch size for W3 (default 16; W4 always runs as one batch)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")


def parse_workloads(text: str) -> list[str]:
    names = [w.strip().upper() for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise ValueError(f"unknown workload(s) {bad or text!r}; choose from {', '.join(WORKLOADS)}")
    return list(dict.fromkeys(names))


def cmd_offline(args: argparse.Namespace) -> int:
    from tokenmill.config import config_from_args
    from tokenmill.llm import LLM
    from tokenmill.model.loader import resolve_model_path

    workloads = parse_workloads(args.workloads)
    if args.runs < 1 or args.warmup < 0:
        raise ValueError("--runs must be at least 1 and --warmup at least 0")
    sizes = QUICK if args.quick else FULL
    if args.hf_batch_size is not None:
        if args.hf_batch_size < 1:
            raise ValueError("--hf-batch-size must be at least 1")
        sizes = dataclasses.replace(sizes, hf_batch_size=args.hf_batch_size)
    kwargs = config_from_args(args).flat()
    model_path = resolve_model_path(kwargs["model"])
    started = time.time()

    progress(f"loading tokenmill ({model_path}, {args.dtype})")
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = {"tokenmill": time.perf_counter() - t0}
    tokenmill = TokenmillSystem(llm)
    if "W4" in workloads:
        tokenmill.llm(prefix_caching=not kwargs["enable_prefix_caching"])  # build the sibling now

    import torch

    threads = torch.get_num_threads()
    dtype = _engine_dtype(llm, args.dtype)
    vocab = min(llm.engine.facts.vocab_size, llm.tokenizer.vocab_size)
    pool = ordinary_token_ids(llm.tokenizer, vocab)
    hf = None
    if args.baseline == "hf":
        from tokenmill.bench.hf_baseline import HFBaseline

        progress(f"loading transformers baseline ({dtype}, dequantizing the weights)")
        t0 = time.perf_counter()
        hf = HFBaseline(model_path, dtype, device=_engine_device(llm))
        load_s["hf"] = time.perf_counter() - t0

    machine = machine_info(dtype)
    machine["weight_dtype"] = _engine_weight_dtype(llm, args.dtype)
    machine["loadavg_start"] = list(os.getloadavg())

    results: dict[str, Any] = {}
    for workload in workloads:
        progress(f"{workload}: {describe(workload, sizes)}")
        systems = systems_for(workload, tokenmill, hf, sizes, threads)
        results[workload] = run_workload(workload, systems, sizes, pool, args.bench_seed, args.runs, args.warmup)
    machine["loadavg_end"] = list(os.getloadavg())

    report = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "argv": list(sys.argv),
        "machine": machine,
        "settings": {
            "workloads": workloads,
            "runs": args.runs,
            "warmup": args.warmup,
            "quick": args.quick,
            "bench_seed": args.bench_seed,
            "baseline": args.baseline,
            "engine": {**kwargs, "model": model_path},
            "sizes": dataclasses.asdict(sizes),
            "hf": None if hf is None else hf.describe(),
        },
        "load_s": load_s,
        "workloads": results,
    }
    print(format_table(report))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2, allow_nan=True)
            f.write("\n")
        progress(f"wrote {args.output}")
    return 0


def _engine_dtype(llm: Any, requested: str) -> str:
    """The dtype the engine really computes in (`--dtype auto` resolves per machine)."""
    facts = getattr(llm.engine, "facts", None)
    return facts.compute_dtype if facts is not None else requested


def _engine_weight_dtype(llm: Any, requested: str) -> str:
    """How the engine stores its weights (e.g. bfloat16 tiles on a float32-computing CPU)."""
    facts = getattr(llm.engine, "facts", None)
    return facts.weight_format.split("-")[0] if facts is not None else _engine_dtype(llm, requested)


def _engine_device(llm: Any) -> str:
    facts = getattr(llm.engine, "facts", None)
    return facts.device if facts is not None else "cpu"


# ----- output ---------------------------------------------------------------------------


def _dtype_text(machine: dict[str, Any]) -> str:
    weights = machine.get("weight_dtype", machine["dtype"])
    return machine["dtype"] if weights == machine["dtype"] else f"{weights} weights, {machine['dtype']} compute"


def format_table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"tokenmill bench offline: {m['cpu_model']}, {m['cores']} cores, torch {m['torch']} "
        f"({m['torch_threads']} threads), {_dtype_text(m)}; median of {report['settings']['runs']} runs",
    ]
    for workload, result in report["workloads"].items():
        systems = list(result["systems"])
        comparisons = list(result["speedup"])
        header = ["metric", *(LABELS.get(s, s) for s in systems), *(f"x {c}" for c in comparisons)]
        rows = []
        for metric in result["metrics"]:
            row = [METRICS[metric][0]]
            row += [_fmt(result["systems"][s]["median"][metric]) for s in systems]
            row += [_fmt_ratio(result["speedup"][c].get(metric), _paired(result, c, metric)) for c in comparisons]
            rows.append(row)
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines.append("")
        lines.append(f"{workload}: {result['description']}")
        for r in [header, *rows]:
            cells = [str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(r)]
            lines.append("  " + "  ".join(cells))
        agreement = result.get("greedy_agreement")
        if agreement:
            lines.append(
                f"  greedy outputs vs transformers: {agreement['identical_requests']}/{agreement['num_requests']} "
                f"identical, mean common prefix {agreement['mean_common_prefix_tokens']:.1f} of "
                f"{agreement['mean_output_tokens']:.1f} tokens"
            )
    if any(result["speedup"] for result in report["workloads"].values()):
        lines.append("")
        lines.append("x columns: speedup, > 1 means the first system is faster (higher rate or lower time): "
                     "ratio of the medians (median of the per-run ratios).")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    """The same tables as `format_table`, as Markdown (for docs/benchmarks.md)."""
    lines = []
    for workload, result in report["workloads"].items():
        systems = list(result["systems"])
        comparisons = list(result["speedup"])
        header = ["metric", *(LABELS.get(s, s) for s in systems),
                  *(f"{_comparison_label(c)} (paired)" for c in comparisons)]
        lines += [f"**{workload}**: {result['description']}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        for metric in result["metrics"]:
            row = [METRICS[metric][0]]
            row += [_fmt(result["systems"][s]["median"][metric]) for s in systems]
            row += [_fmt_ratio(result["speedup"][c].get(metric), _paired(result, c, metric)) for c in comparisons]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the tables of a saved report: `python -m tokenmill.bench.offline results.json [--markdown]`."""
    parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.offline", description=main.__doc__)
    parser.add_argument("report")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    for workload, result in report["workloads"].items():
        add_speedups(workload, result)  # reports written before paired speedups existed
    print(format_markdown(report) if args.markdown else format_table(report))
    return 0


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value != value:  # nan
        return "nan"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _paired(result: dict[str, Any], comparison: str, metric: str) -> float | None:
    return result.get("paired_speedup", {}).get(comparison, {}).get(metric)


def _comparison_label(key: str) -> str:
    return {"tokenmill_vs_hf": "speedup vs transformers", "prefix_on_vs_off": "speedup prefix on vs off"}.get(key, key)


def _fmt_ratio(value: float | None, paired: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if paired is None else f"{value:.2f}x ({paired:.2f}x)"


if __name__ == "__main__":
    sys.exit(main())
