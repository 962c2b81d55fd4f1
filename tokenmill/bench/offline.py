"""`tokenmill bench offline`: fixed synthetic workloads through the offline API.

The workloads W1-W6 are `tokenmill.workloads.offline`' (greedy; W1-W4 with `ignore_eos=True`,
so every request produces exactly the tokens asked for; the input-grounded W5/W6 end at
EOS, the same tokens whatever the engine settings, since greedy output does not change).
With `--speculative-config`, every workload but W4 runs twice per repetition, back to
back: as configured and on a sibling engine with speculation off (same model, same KV
memory), and reports the speedup and the draft acceptance.

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

from tokenmill.workloads.offline import (
    FULL,
    GROUNDED,
    ONE_AT_A_TIME,
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
from tokenmill.workloads.report import LABELS, add_speedups, format_table, machine_info

SCHEMA = "tokenmill.bench.offline/1"

__all__ = ["SCHEMA", "RUN_KEYS", "TokenmillSystem", "cmd_offline", "add_offline_args"]


# ----- tokenmill ------------------------------------------------------------------------


class TokenmillSystem:
    """Runs request lists through an `LLM`. `engines[(caching, speculation)]` is the LLM
    with prefix caching `caching` and speculative decoding as configured (True) or off;
    the others share the first one's model and KV memory (used strictly one at a time),
    so W4 on/off and speculation on/off cost a single model load."""

    def __init__(self, llm: Any) -> None:
        self.default = llm  # W1-W3 run on the engine as configured
        self.caching = bool(llm.engine.config.cache.enable_prefix_caching)
        self.speculative = llm.engine.config.speculative.speculative_config is not None
        self.engines = {(self.caching, self.speculative): llm}
        self._last: Any = llm

    def llm(self, prefix_caching: bool | None = None, speculative: bool | None = None) -> Any:
        key = (self.caching if prefix_caching is None else prefix_caching,
               self.speculative if speculative is None else speculative)
        if key not in self.engines:
            settings = {"enable_prefix_caching": key[0]}
            if not key[1]:
                settings["speculative_config"] = None
            self.engines[key] = _sibling_llm(self.default, **settings)
        return self.engines[key]

    def run(self, requests: list[Request], prefix_caching: bool | None = None, workload: str = "",
            speculative: bool | None = None) -> RunRecord:
        """Greedy; W1-W4 to exactly the tokens asked for, the input-grounded workloads to
        EOS; W5's requests one at a time (each one's times from its own submission)."""
        llm = self.llm(prefix_caching, speculative)
        if llm is not self._last:
            # The other engine wrote into the shared KV memory: forget what this one cached.
            _reset_prefix_cache(llm)
            self._last = llm
        exact = workload not in GROUNDED
        batches = [[r] for r in requests] if workload in ONE_AT_A_TIME else [requests]
        load = os.getloadavg()[0]
        spec0 = _spec_counts(llm)
        record = RunRecord(0.0, [], [], [], [], [], loadavg_1m=load)
        cpu0 = time.process_time()
        for batch in batches:
            self._generate(llm, batch, exact, record)
        record.cpu_s = time.process_time() - cpu0
        spec1 = _spec_counts(llm)
        record.spec_drafts, record.spec_draft_tokens, record.spec_accepted_tokens = (
            b - a for a, b in zip(spec0, spec1))
        return record

    @staticmethod
    def _generate(llm: Any, requests: list[Request], exact: bool, record: RunRecord) -> None:
        from tokenmill.sampling.params import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=exact) for _, n in requests]
        t0, m0 = time.perf_counter(), time.monotonic()
        outputs = llm.generate([p for p, _ in requests], params)
        record.wall_s += time.perf_counter() - t0
        for (prompt, n), out in zip(requests, outputs):
            tokens = out.outputs[0].token_ids
            if exact and len(tokens) != n:
                raise RuntimeError(f"tokenmill generated {len(tokens)} tokens where {n} were asked for")
            m = out.metrics
            record.ttft_s.append(m.first_token_time - m0)
            record.e2e_s.append(m.finished_time - m0)
            record.prompt_tokens.append(len(prompt))
            record.output_tokens.append(len(tokens))
            record.cached_tokens.append(out.num_cached_tokens)
            record.output_token_ids.append(list(tokens))


def _as_dict(speculative: Any) -> dict[str, Any] | None:
    return None if speculative is None else speculative.to_dict()


def _spec_counts(llm: Any) -> tuple[int, int, int]:
    stats = llm.engine.stats().spec_decode
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def _sibling_llm(llm: Any, **settings: Any) -> Any:
    """An LLM on `llm`'s executor (model and KV tensors) with some settings switched."""
    import copy

    engine = llm.engine.sibling(**settings)
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
        systems = [System("tokenmill", lambda r: tokenmill.run(r, workload=workload), threads)]
        if tokenmill.speculative:
            systems.append(System("tokenmill_spec_off",
                                  lambda r: tokenmill.run(r, workload=workload, speculative=False), threads))
    if hf is not None and workload not in GROUNDED:  # transformers' baseline generates exactly n tokens
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
    encode_chat: Callable[[list[dict[str, str]]], list[int]] | None = None,
) -> dict[str, Any]:
    results: dict[str, Any] = {s.name: {"runs": []} for s in systems}
    first_outputs: dict[str, list[list[int]]] = {}
    total = warmup + runs
    for rep in range(total):
        is_warmup = rep < warmup
        tag = f"warmup{rep}" if is_warmup else str(rep - warmup)
        requests = build_requests(workload, sizes, repetition_rng(seed, workload, tag), pool, encode_chat)
        # Alternate which system goes first, so a load that drifts within a repetition favours neither.
        for system in systems if rep % 2 == 0 else systems[::-1]:
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
    if "tokenmill_spec_off" in first_outputs:  # greedy: speculation must not change a token
        out["spec_greedy_agreement"] = agreement(first_outputs["tokenmill"], first_outputs["tokenmill_spec_off"])
    return out


def _headline(workload: str, entry: dict[str, Any]) -> str:
    if workload == "W1":
        return f"TTFT {entry['ttft_ms']:.0f} ms, decode {entry['decode_tok_s']:.1f} tok/s"
    if workload == "W2":
        return f"TTFT {entry['ttft_ms']:.0f} ms, prefill {entry['prefill_tok_s']:.0f} tok/s"
    if workload in GROUNDED:
        return (f"{entry['output_tok_s']:.1f} tok/s output, acceptance {entry['acceptance_rate']:.2f}, "
                f"mean acceptance length {entry['mean_acceptance_length']:.2f}")
    return f"{entry['total_tok_s']:.0f} tok/s total, {entry['output_tok_s']:.1f} tok/s output"


# ----- command line ---------------------------------------------------------------------


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
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
        tokenmill.llm(prefix_caching=not kwargs["enable_prefix_caching"])  # build the siblings now
    if tokenmill.speculative:
        tokenmill.llm(speculative=False)

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
    machine["speculative"] = facts.speculative
    machine["loadavg_start"] = list(os.getloadavg())

    results: dict[str, Any] = {}
    for workload in workloads:
        progress(f"{workload}: {describe(workload, sizes)}")
        systems = systems_for(workload, tokenmill, hf, sizes, threads)
        results[workload] = run_workload(workload, systems, sizes, pool, args.bench_seed, args.runs, args.warmup,
                                         llm.encode_chat)
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
            "engine": {**kwargs, "model": model_path, "speculative_config": _as_dict(kwargs["speculative_config"])},
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
