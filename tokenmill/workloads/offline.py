"""The offline workloads W1-W6 and their metrics: shapes, request lists, per-run records.

Shared by `tokenmill bench offline`, the transformers baseline and the side-by-side
harness (`benchmarks/compare.py`), so every system runs exactly the same requests.

- W1: one request, 128 prompt tokens, 128 new tokens -> TTFT and decode tokens/s,
  decode = (new - 1) / (e2e - TTFT).
- W2: one request, 1024 prompt tokens, 16 new tokens -> prefill tokens/s = prompt / TTFT.
- W3: 64 requests submitted at once, prompt lengths uniform in [64, 512], output
  lengths uniform in [32, 256] -> total and output tokens/s, wall time.
- W4: 32 requests sharing one 512-token prefix, each with its own 32-token suffix,
  64 new tokens each -> throughput and mean TTFT, with prefix caching on and off.
- W5: input-grounded prompts (repeat, correct, rewrite, summarize a passage; annotate
  code: `tokenmill.workloads.grounded`) in the chat template, one request at a time, up to
  256 new tokens each, stopping at EOS -> output tokens/s at batch 1, and the draft
  acceptance when speculative decoding is on.
- W6: the same kind of prompts, 32 at once -> output tokens/s under load.

W1-W4 prompts are random token ids drawn from the ordinary vocabulary (special and added
tokens left out); every repetition draws fresh ids from its own seed (`repetition_rng`).
W5/W6 draw their task/passage pairs and document numbers from it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6")
GROUNDED = ("W5", "W6")  # chat prompts over a given passage; outputs end at EOS
ONE_AT_A_TIME = ("W5",)  # requests submitted one after the other (batch 1)

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
    w5_requests: int = 6
    w6_requests: int = 32
    grounded_new: int = 256  # max_tokens of W5/W6; most answers end at EOS before it
    # transformers runs W3 as padded batches of this many requests (W4 goes as one batch).
    hf_batch_size: int = 16


FULL = Sizes()
QUICK = Sizes(
    w1_prompt=16, w1_new=8, w2_prompt=64, w2_new=4,
    w3_requests=4, w3_prompt=(8, 32), w3_new=(4, 12),
    w4_requests=4, w4_prefix=32, w4_suffix=8, w4_new=8,
    w5_requests=2, w6_requests=4, grounded_new=12,
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
    if name == "W4":
        return (f"{s.w4_requests} requests, shared {s.w4_prefix}-token prefix + {s.w4_suffix}-token suffix, "
                f"{s.w4_new} new tokens each")
    if name == "W5":
        return f"{s.w5_requests} input-grounded chat requests one at a time, up to {s.grounded_new} new tokens each"
    return f"{s.w6_requests} input-grounded chat requests at once, up to {s.grounded_new} new tokens each"


def build_requests(name: str, sizes: Sizes, rng: random.Random, pool: Sequence[int],
                   encode_chat: Callable[[list[dict[str, str]]], list[int]] | None = None) -> list[Request]:
    """The requests of one repetition of a workload, drawn from `rng`. The input-grounded
    workloads need `encode_chat` (messages -> prompt ids in the model's chat template)."""
    if name in GROUNDED:
        if encode_chat is None:
            raise ValueError(f"{name} needs the model's chat template (encode_chat)")
        from tokenmill.workloads.grounded import grounded_messages

        count = sizes.w5_requests if name == "W5" else sizes.w6_requests
        return [(encode_chat(messages), sizes.grounded_new) for messages in grounded_messages(count, rng)]

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
    # Speculative decoding in this run (0 when off): drafts, proposed and accepted tokens.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


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
    "output_tok_per_cpu_s": ("output (tok per CPU s)", 1.0, True),
    "acceptance_rate": ("draft acceptance rate", 1.0, True),
    "mean_acceptance_length": ("mean acceptance length", 1.0, True),
}
# Reported beside the speed, never compared as a speedup.
NOT_SPEEDUPS = ("cached_prompt_tokens", "acceptance_rate", "mean_acceptance_length")

# The metrics each workload reports, in table order.
WORKLOAD_METRICS: dict[str, tuple[str, ...]] = {
    "W1": ("ttft_ms", "decode_tok_s", "tpot_ms", "e2e_s"),
    "W2": ("ttft_ms", "prefill_tok_s", "e2e_s"),
    "W3": ("total_tok_s", "output_tok_s", "wall_s", "mean_ttft_ms"),
    "W4": ("total_tok_s", "output_tok_s", "mean_ttft_ms", "wall_s", "cached_prompt_tokens"),
    "W5": ("output_tok_s", "output_tok_per_cpu_s", "tpot_ms", "mean_ttft_ms", "wall_s", "acceptance_rate",
           "mean_acceptance_length"),
    "W6": ("output_tok_s", "output_tok_per_cpu_s", "total_tok_s", "mean_ttft_ms", "wall_s", "acceptance_rate",
           "mean_acceptance_length"),
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
    if workload == "W5":  # per request: its own decode time over its tokens after the first
        decode = [(e - t) / (n - 1) for t, e, n in zip(record.ttft_s, record.e2e_s, record.output_tokens) if n > 1]
        out["tpot_ms"] = 1000 * statistics.fmean(decode) if decode else float("nan")
    if workload in GROUNDED:
        # With one compute thread, CPU time is the work done whatever else shares the cores.
        out["output_tok_per_cpu_s"] = n_out / record.cpu_s if record.cpu_s > 0 else float("nan")
        out.update(acceptance(record))
    return out


def acceptance(record: RunRecord) -> dict[str, float]:
    """vLLM's two summaries: accepted / proposed tokens, and 1 + accepted per draft
    (the tokens a verifying step emits per request). 0 when nothing was proposed."""
    rate = record.spec_accepted_tokens / record.spec_draft_tokens if record.spec_draft_tokens else 0.0
    length = 1.0 + record.spec_accepted_tokens / record.spec_drafts if record.spec_drafts else 0.0
    return {"acceptance_rate": rate, "mean_acceptance_length": length}


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


def parse_workloads(text: str) -> list[str]:
    names = [w.strip().upper() for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise ValueError(f"unknown workload(s) {bad or text!r}; choose from {', '.join(WORKLOADS)}")
    return list(dict.fromkeys(names))


def agreement(ours: list[list[int]] | None, theirs: list[list[int]]) -> dict[str, Any]:
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
