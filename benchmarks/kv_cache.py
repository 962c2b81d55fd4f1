"""Decode speed per KV cache dtype at a long context: one engine per --kv-cache-dtype, each
with B requests of a C-token prompt decoding N tokens; the step times of the pure decode
steps give tokens/s. Engines are measured in alternation, round by round, so a drift of the
machine's other load hits them alike; after the first round the prompts come from the prefix
cache, so a round costs its decode steps only. First, the native paged decode kernel alone
(the default model's heads, B sequences of C tokens; one layer's call) per cache dtype, also
in alternation. Not part of CI.

    .venv/bin/python benchmarks/kv_cache.py --context 2048 --batch 1 16 --rounds 3 --output kv.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tokenmill.hardware import cpu_info

DTYPES = ["bfloat16", "float32", "int8", "fp8_e4m3"]


def build(kv_dtype: str, max_tokens: int, args: argparse.Namespace):
    from tokenmill.attention.kv_cache import KVCacheSpec
    from tokenmill.dtypes import torch_dtype
    from tokenmill.llm import LLM

    per_token = KVCacheSpec(30, 3, 64, 16, torch_dtype(kv_dtype)).bytes_per_token  # the default model's shape
    tokens = max(args.batch) * (args.context + max_tokens + 32)
    return LLM(kv_cache_dtype=kv_dtype, dtype=args.dtype, num_threads=args.threads,
               kv_cache_memory=int(tokens * per_token * 1.1), max_num_seqs=max(args.batch),
               max_model_len=args.context + max_tokens + 16, seed=0)


def decode_step_times(llm, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Seconds of each step in which every request decodes (after all prefills)."""
    from tokenmill import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(engine.new_request_id(), prompt, params)
    times, decoding = [], False
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if decoding and len(outputs) == len(prompts):
            times.append(elapsed)
        decoding = decoding or (len(outputs) == len(prompts) and all(o.outputs[0].token_ids for o in outputs))
    return times


def kernel_times(dtypes: list[str], batch: int, context: int, rounds: int, calls: int = 20) -> dict[str, float]:
    """Median seconds of one paged_decode_attention call (9 query heads, 3 KV heads of 64)."""
    import torch

    from tokenmill import kernels
    from tokenmill.attention.kv_cache import LayerKVCache
    from tokenmill.dtypes import torch_dtype

    kernels.cpu_kernels_available()
    block = 16
    blocks = -(-context // block)
    caches, times = {}, {d: [] for d in dtypes}
    for d in dtypes:
        cache = LayerKVCache.allocate(batch * blocks, block, 3, 64,
                                      torch_dtype(d))
        rows = torch.randn(batch * blocks * block, 3, 64)
        cache.write(rows, rows, torch.arange(rows.shape[0]))
        caches[d] = cache
    tables = torch.randperm(batch * blocks).view(batch, blocks).int()
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, 9, 64)
    out = torch.empty_like(q)
    for _ in range(rounds):
        for d, cache in caches.items():
            for _ in range(calls):
                start = time.perf_counter()
                kernels.paged_decode_attention(out, q, cache.k, cache.v, tables, lens, 0.125, cache.scales)
                times[d].append(time.perf_counter() - start)
    return {d: statistics.median(t) for d, t in times.items()}


def prefill_seconds(llm, prompt: list[int]) -> float:
    """Wall time of one request of `prompt` (not in the prefix cache) and one output token."""
    from tokenmill import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="weights (--dtype)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    from tokenmill.eval.perplexity import default_text_path

    import torch

    torch.set_num_threads(args.threads)
    kernel = {b: kernel_times(args.dtypes, b, args.context, args.rounds) for b in args.batch}
    print(f"paged decode attention kernel, one layer, {args.context} tokens of context (median us per call):")
    for d in args.dtypes:
        print(f"  {d:9s} " + "  ".join(f"batch {b}: {kernel[b][d] * 1e6:8.1f} "
                                        f"({kernel[b]['bfloat16'] / kernel[b][d]:.2f}x bf16)"
                                        if "bfloat16" in kernel[b] else f"batch {b}: {kernel[b][d] * 1e6:8.1f}"
                                        for b in args.batch))
    engines = {d: build(d, args.decode_tokens, args) for d in args.dtypes}
    text_ids = next(iter(engines.values())).tokenizer.encode(default_text_path().read_text(encoding="utf-8"))
    # Distinct prompts (different offsets into the text), so requests share no prefix.
    prompts = [text_ids[i * 997 : i * 997 + args.context] for i in range(max(args.batch))]
    steps: dict[str, dict[int, list[float]]] = {d: {b: [] for b in args.batch} for d in args.dtypes}
    prefills: dict[str, list[float]] = {d: [] for d in args.dtypes}
    for r in range(args.rounds + 1):  # round 0 fills the prefix caches (not counted)
        for batch in args.batch:
            for dtype, llm in engines.items():
                times = decode_step_times(llm, prompts[:batch], args.decode_tokens)
                if r > 0:
                    steps[dtype][batch].extend(times)
        fresh = text_ids[-args.context - r : len(text_ids) - r]  # a prompt no cache holds
        for dtype, llm in engines.items():
            seconds = prefill_seconds(llm, fresh)
            if r > 0:
                prefills[dtype].append(seconds)
        print(f"round {r} done", flush=True)
    result = {
        "cpu": cpu_info().model_name, "threads": args.threads, "weights": args.dtype, "context": args.context,
        "decode_tokens": args.decode_tokens, "rounds": args.rounds, "load_average": os.getloadavg(),
        "kv_bytes_per_token": {d: llm.engine.facts.kv_bytes_per_token for d, llm in engines.items()},
        "median_step_s": {d: {b: statistics.median(t) for b, t in steps[d].items()} for d in args.dtypes},
        "kernel_median_s": {d: {b: kernel[b][d] for b in args.batch} for d in args.dtypes},
        "prefill_median_s": {d: statistics.median(t) for d, t in prefills.items()},
    }
    base = result["median_step_s"].get("bfloat16")
    print(f"decode at {args.context} tokens of context, {args.threads} thread(s), weights {args.dtype}, "
          f"{cpu_info().model_name}")
    print("| KV cache | bytes/token | " + " | ".join(f"decode batch {b}: tok/s (vs bf16)" for b in args.batch)
          + f" | prefill {args.context} tokens: s (vs bf16) |")
    print("|---|---|" + "---|" * (len(args.batch) + 1))
    for d in args.dtypes:
        cells = []
        for b in args.batch:
            step = result["median_step_s"][d][b]
            ratio = f" ({base[b] / step:.2f}x)" if base else ""
            cells.append(f"{b / step:.1f}{ratio}")
        prefill = result["prefill_median_s"]
        cells.append(f"{prefill[d]:.2f}" + (f" ({prefill[d] / prefill['bfloat16']:.2f}x)" if base else ""))
        print(f"| {d} | {result['kv_bytes_per_token'][d]:,} | " + " | ".join(cells) + " |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
