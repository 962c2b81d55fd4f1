"""What a speculative step costs against a plain decode step, on the default model.

    .venv/bin/python benchmarks/spec_decode.py [--threads 1] [--context 300] [--batch 1] [--draft-dtype bfloat16]

`--batch` requests with `--context` tokens each in the KV cache; each iteration times, back to back
(so that a background load that drifts hits all alike), the target's forward pass plus
LM head for:
- decode: each request's last token (1 row each; the fused decode layer up to 16 rows);
- verify k+1 as rows: the last token and k proposals as k+1 one-token rows over their own
  context lengths (the runner's path for short chunks: the fused decode layer);
- verify k+1 as chunk: the same tokens as one chunk (per-op layers, SDPA with a
  bottom-right causal mask);
and the draft model's decode step (its own dtype and plan). Reported: medians over the
iterations and the median of the per-iteration ratios to the decode step. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.engine.batch import RequestState, ScheduledRequest, StepRequest
from tokenmill.llm import LLM
from tokenmill.config import default_model_path


def step_request(state: RequestState, start: int, num_tokens: int) -> StepRequest:
    return StepRequest(state, ScheduledRequest(state.request_id, start, num_tokens, [], [], sample=True))


def timed(runner, items: list[StepRequest]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        hidden, _ = runner.forward(items)
        runner.model.compute_logits(hidden)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--draft-dtype", default="bfloat16")
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--ks", default="2,4,7")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    draft = {"method": "draft_model", "model": default_model_path(), "dtype": args.draft_dtype,
             "num_speculative_tokens": max(ks)}
    llm = LLM(dtype="float32", max_model_len=2048, kv_cache_memory="1GiB", num_threads=args.threads,
              speculative_config=draft)
    target, drafter = llm.engine.executor, llm.engine.proposer.runner
    print(f"target: {llm.engine.facts.execution_plan}\ndraft: {drafter.plan.describe()}")
    print(f"{args.batch} request(s), {args.context} tokens of context each, {args.threads} thread(s)")
    per_request = -(-(args.context + max(ks) + 1) // target.block_size)
    states = []
    for r in range(args.batch):
        tokens = [1000 + (i * 7 + r) % 5000 for i in range(args.context + max(ks) + 1)]
        blocks = list(range(r * per_request, (r + 1) * per_request))
        states.append(RequestState(str(r), tokens, None, tokens, blocks))
    for runner in (target, drafter):  # fill the KV caches of the contexts
        for state in states:
            timed(runner, [step_request(state, 0, args.context)])

    cases = {"decode": (target, 1, True)}
    for k in ks:
        cases[f"verify {k + 1} as rows"] = (target, k + 1, True)
        cases[f"verify {k + 1} as chunk"] = (target, k + 1, False)
    cases["draft decode"] = (drafter, 1, True)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.iterations + 1):  # the first round warms up
        for name, (runner, n, as_rows) in cases.items():
            runner.short_chunks_as_decodes = as_rows
            times[name].append(timed(runner, [step_request(state, args.context, n) for state in states]))
    base = times["decode"][1:]
    print(f"\n{'step':<22} {'ms':>8} {'x decode':>9}")
    for name, values in times.items():
        values = values[1:]
        ratio = statistics.median(v / b for v, b in zip(values, base))
        print(f"{name:<22} {1000 * statistics.median(values):>8.1f} {ratio:>9.2f}")


if __name__ == "__main__":
    main()
