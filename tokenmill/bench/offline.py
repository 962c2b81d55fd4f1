"""`tokenmill bench offline`: fixed synthetic workloads through the offline API.

The workloads W1-W4 are `tokenmill.bench.workloads`' (greedy, `ignore_eos=True`, so every
request produces exactly the tokens asked for).

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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.report import LABELS, add_speedups, format_table, machine_info
from tokenmill.bench.workloads import (
    FULL,
    QUICK,
    RUN_KEYS,
    WORKLOAD_METRICS,
    WORKLOADS,
    Request,
    RunRecord,
    Sizes,
    agreement,
    build_requests,
    describe,
    medians,
    ordinary_token_ids,
    parse_workloads,
    repetition_rng,
    run_entry,
)

SCHEMA = "tokenmill.bench.offline/1"

__all__ = ["SCHEMA", "RUN_KEYS", "TokenmillSystem", "cmd_offline", "add_offline_args"]


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
        out["greedy_agreement"] = agreement(ours, first_outputs["hf"])
    return out


def _headline(workload: str, entry: dict[str, Any]) -> str:
    if workload == "W1":
        return f"TTFT {entry['ttft_ms']:.0f} ms, decode {entry['decode_tok_s']:.1f} tok/s"
    if workload == "W2":
        return f"TTFT {entry['ttft_ms']:.0f} ms, prefill {entry['prefill_tok_s']:.0f} tok/s"
    return f"{entry['total_tok_s']:.0f} tok/s total, {entry['output_tok_s']:.1f} tok/s output"


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
    facts = llm.engine.facts
    dtype = facts.compute_dtype  # what --dtype auto resolved to here
    vocab = min(llm.engine.facts.vocab_size, llm.tokenizer.vocab_size)
    pool = ordinary_token_ids(llm.tokenizer, vocab)
    hf = None
    if args.baseline == "hf":
        from tokenmill.bench.hf_baseline import HFBaseline

        progress(f"loading transformers baseline ({dtype}, dequantizing the weights)")
        t0 = time.perf_counter()
        hf = HFBaseline(model_path, dtype, device=facts.device)
        load_s["hf"] = time.perf_counter() - t0

    machine = machine_info(dtype)
    machine["weight_dtype"] = facts.weight_format
    machine["execution_plan"] = facts.execution_plan
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
