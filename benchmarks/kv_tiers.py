"""The host KV tier on a multi-turn chat trace whose working set is many times the pool.

S sessions of T turns each. A session starts with its own H-token history (random ordinary
token ids: a system prompt and earlier conversation); every turn appends a U-token user
message, the model answers A tokens (greedy), and the answer joins the history. Turns go
round-robin over the sessions (turn 1 of every session, then turn 2, ...), so every
session returns after all the others have run: with a pool of P blocks and S x (H + T x
(U + A)) tokens of history, the pool alone has evicted a session's prefix by the time it
returns. Requests run one at a time (TTFT is the prefill of one turn, not a queue).

Three engines on one loaded model (siblings sharing the KV tensors, a fresh one per run so
no cache outlives its run), measured in alternation round by round:
  pool       --num-blocks P, prefix caching (what tokenmill does without the tier: recompute)
  pool+host  the same pool and --kv-offloading-size GIB
  unbounded  a pool that holds the whole working set (the prefix hit rate to compare with)
  pool+host8 (--host8) the pool and the same GiB of host tier in the 8-bit format
             (--kv-offloading-cache-dtype int8: about twice the blocks below a bfloat16 pool)
  pool+disk  (--disk-dir) a small host tier over a disk tier; with --restart, after its trace
             a new engine over the same directory (empty pool and host tier) takes one more
             turn of every session: the first returning turn after a restart, against the
             same turn recomputed
For each: the prefix hit rate (hit tokens / prompt tokens, all turns), and the median TTFT
of the returning turns (turn >= 2). Not part of CI.

    .venv/bin/python benchmarks/kv_tiers.py --sessions 12 --turns 4 --history 512 --rounds 3 --output kv_tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from tokenmill.hardware import cpu_info


def make_sessions(args: argparse.Namespace, pool: list[int]) -> list[dict]:
    rng = random.Random(args.seed)
    lengths = ([rng.randint(args.history, args.history_max) for _ in range(args.sessions)] if args.history_max
               else [args.history] * args.sessions)  # (the fixed length draws nothing: earlier traces unchanged)
    return [{"history": [rng.choice(pool) for _ in range(length)],
             "users": [[rng.choice(pool) for _ in range(args.user)] for _ in range(args.turns)]}
            for length in lengths]


def run_trace(llm, sessions: list[dict], args: argparse.Namespace) -> dict:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    histories = [list(s["history"]) for s in sessions]
    returning_ttft, first_ttft, answers = [], [], []
    queries = hits = 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for i, session in enumerate(sessions):
            prompt = histories[i] + session["users"][turn]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            ttft = out.metrics.first_token_time - out.metrics.arrival_time
            (returning_ttft if turn else first_ttft).append(ttft)
            queries += len(prompt)
            hits += out.num_cached_tokens
            answer = list(out.outputs[0].token_ids)
            answers.append(answer)
            histories[i] = prompt + answer
    args.final_histories = histories
    stats = llm.engine.stats()
    return {"hit_rate": hits / queries, "prompt_tokens": queries, "hit_tokens": hits,
            "returning_ttft_ms": 1e3 * statistics.median(returning_ttft),
            "first_turn_ttft_ms": 1e3 * statistics.median(first_ttft), "wall_s": time.perf_counter() - start,
            "host_hit_tokens": stats.external_prefix_cache_hits, "host_loaded_blocks": stats.kv_offload_loaded_blocks,
            "host_stored_blocks": stats.kv_offload_stored_blocks, "answers": answers,
            "disk_hit_tokens": _disk_hit_tokens(llm)}


def one_more_turn(llm, histories: list[list[int]], users: list[list[int]], args: argparse.Namespace) -> dict:
    """Every session's next turn on `llm` (one at a time): median TTFT and hit tokens."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    ttfts, hits = [], 0
    for history, user in zip(histories, users):
        out = llm.generate([history + user], params, use_tqdm=False)[0]
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        hits += out.num_cached_tokens
    return {"ttft_ms": 1e3 * statistics.median(ttfts), "hit_tokens": hits, "disk_hit_tokens": _disk_hit_tokens(llm)}


def _disk_hit_tokens(llm) -> int:
    host = getattr(llm.engine.scheduler.kv, "host_tier", None)
    return host.disk.stats.hit_tokens if host is not None and host.disk is not None else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--history", type=int, default=512, help="tokens of a session's history before turn 1")
    parser.add_argument("--history-max", type=int, default=None,
                        help="histories drawn uniformly from --history to this many tokens (the issue's 1-4k)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="the unbounded pool's KV memory")
    parser.add_argument("--user", type=int, default=64, help="tokens of each user message")
    parser.add_argument("--answer", type=int, default=16, help="tokens of each answer")
    parser.add_argument("--pool-blocks", type=int, default=64)
    parser.add_argument("--offloading-gib", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    parser.add_argument("--disk-dir", default=None, help="also run pool+disk: a host tier of --disk-host-gib "
                                                           "over a disk tier in a fresh subdirectory of this per run")
    parser.add_argument("--disk-host-gib", type=float, default=0.005)
    parser.add_argument("--configs", default=None, help="comma-separated subset of the engines to run")
    parser.add_argument("--host8", action="store_true", help="also run pool+host8: the host tier in int8")
    parser.add_argument("--restart", action="store_true", help="with --disk-dir: time the first returning turn "
                                                               "after a restart (see above)")
    args = parser.parse_args()

    from tokenmill.llm import LLM
    from tokenmill.workloads.offline import ordinary_token_ids

    grown = args.turns * (args.user + args.answer)
    longest = (args.history_max or args.history) + grown
    base = LLM(dtype=args.dtype, num_threads=args.threads, max_model_len=longest + args.user + args.answer + 64, seed=0,
               kv_cache_memory=f"{args.kv_cache_gib}GiB", enable_prefix_caching=False)
    facts = base.engine.facts
    sessions = make_sessions(args, ordinary_token_ids(base.tokenizer, facts.vocab_size))
    working_set_blocks = sum(-(-(len(s["history"]) + grown) // facts.block_size) for s in sessions)
    if working_set_blocks > facts.num_blocks:
        raise SystemExit(f"the unbounded pool ({facts.num_blocks} blocks) cannot hold the working set "
                         f"({working_set_blocks} blocks)")
    host_blocks = int(args.offloading_gib * 2**30) // (facts.kv_bytes_per_token * facts.block_size)
    configs = {
        "pool": dict(num_blocks=args.pool_blocks),
        "pool+host": dict(num_blocks=args.pool_blocks, kv_offloading_size=args.offloading_gib),
        "unbounded": dict(num_blocks=None),
    }
    if args.disk_dir:
        configs["pool+disk"] = dict(num_blocks=args.pool_blocks, kv_offloading_size=args.disk_host_gib)
    base8 = None
    if args.host8:  # the host tier's format is the runner's: its own model and KV memory
        base8 = LLM(dtype=args.dtype, num_threads=args.threads, max_model_len=longest + args.user + args.answer + 64, seed=0,
                    kv_cache_memory=f"{args.kv_cache_gib}GiB", enable_prefix_caching=False, kv_offloading_size=args.offloading_gib,
                    kv_offloading_cache_dtype="int8")
        configs["pool+host8"] = dict(num_blocks=args.pool_blocks, kv_offloading_size=args.offloading_gib)
    if args.configs:
        configs = {k: v for k, v in configs.items() if k in args.configs.split(",")}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    restarts: list[dict] = []
    next_users = [[random.Random(args.seed + 1 + i).choice(sessions[0]["history"]) for _ in range(args.user)]
                  for i in range(args.sessions)]
    load = []
    for rnd in range(args.rounds):
        for name, settings in configs.items():
            num_blocks = settings.get("num_blocks")
            extra = {k: v for k, v in settings.items() if k != "num_blocks"}
            if name == "pool+disk":
                extra["kv_offloading_disk_dir"] = os.path.join(args.disk_dir, f"round{rnd}")
            owner = base8 if name == "pool+host8" else base
            llm = LLM.from_engine(owner.engine.sibling(num_blocks, enable_prefix_caching=True, **extra))
            load.append(os.getloadavg()[0])
            result = run_trace(llm, sessions, args)
            runs[name].append(result)
            if name == "pool+disk" and args.restart:  # a restart, then every session's next turn
                histories = args.final_histories
                del llm
                restarted = LLM.from_engine(base.engine.sibling(num_blocks, enable_prefix_caching=True, **extra))
                after = one_more_turn(restarted, histories, next_users, args)
                del restarted
                recompute = one_more_turn(LLM.from_engine(base.engine.sibling(num_blocks, enable_prefix_caching=True)),
                                          histories, next_users, args)
                restarts.append({"after_restart": after, "recompute": recompute})
                print(f"round {rnd} restart: next turn TTFT {after['ttft_ms']:.1f} ms from disk "
                      f"({after['disk_hit_tokens']} tokens) vs {recompute['ttft_ms']:.1f} ms recomputed", flush=True)
            print(f"round {rnd} {name:10s} hit rate {result['hit_rate']:.3f} returning TTFT "
                  f"{result['returning_ttft_ms']:.1f} ms (first turns {result['first_turn_ttft_ms']:.1f} ms) "
                  f"host+disk hits {result['host_hit_tokens']} tokens (disk {result['disk_hit_tokens']}), "
                  f"wall {result['wall_s']:.1f} s", flush=True)
    # Greedy answers against the unbounded pool's (same hits, so the same KV): the tier must
    # match it exactly; recompute ("pool") may differ in bf16 (one prefill vs a cached prefix
    # and a chunk round differently), not in float32.
    # Without the unbounded pool, against the host tier's (the disk tier has the same hits and KV bytes).
    ref = runs.get("unbounded", runs.get("pool+host", next(iter(runs.values()))))[0]["answers"]
    same = {name: all(r["answers"] == ref for r in rs) for name, rs in runs.items()}
    summary = {}
    for name, rs in runs.items():
        ttft = [r["returning_ttft_ms"] for r in rs]
        summary[name] = {"hit_rate": statistics.median(r["hit_rate"] for r in rs),
                         "returning_ttft_ms_median": statistics.median(ttft),
                         "returning_ttft_ms_min": min(ttft), "returning_ttft_ms_max": max(ttft),
                         "first_turn_ttft_ms_median": statistics.median(r["first_turn_ttft_ms"] for r in rs),
                         "host_hit_tokens": rs[-1]["host_hit_tokens"], "disk_hit_tokens": rs[-1]["disk_hit_tokens"]}
    report = {
        "cpu": cpu_info().model_name, "cores": cpu_info().num_cores,
        "load_avg_1m_during": [round(x, 2) for x in load],
        "trace": {k: getattr(args, k) for k in ("sessions", "turns", "history", "history_max", "user", "answer",
                                                      "seed")},
        "pool_blocks": args.pool_blocks, "host_blocks": host_blocks, "block_size": facts.block_size,
        "working_set_blocks": working_set_blocks, "working_set_over_pool": working_set_blocks / args.pool_blocks,
        "kv_bytes_per_token": facts.kv_bytes_per_token, "dtype": facts.kv_cache_dtype,
        "greedy_answers_identical_to_unbounded_else_host": same,
        "hit_rate_vs_unbounded": ({name: summary[name]["hit_rate"] / summary["unbounded"]["hit_rate"]
                                   for name in summary} if "unbounded" in summary else None),
        "returning_ttft_vs_recompute": {name: summary[name]["returning_ttft_ms_median"]
                                        / summary["pool"]["returning_ttft_ms_median"]
                                        for name in summary if "pool" in summary},
        "summary": summary,
    }
    if restarts:
        ratios = [r["after_restart"]["ttft_ms"] / r["recompute"]["ttft_ms"] for r in restarts]
        report["restart"] = {"rounds": restarts, "ttft_vs_recompute_median": statistics.median(ratios),
                             "ttft_vs_recompute_min": min(ratios), "ttft_vs_recompute_max": max(ratios)}
    if base8 is not None:
        report["host8_blocks"] = int(args.offloading_gib * 2**30) // (
            base8.engine.facts.kv_offload_bytes_per_token * facts.block_size)
    print(json.dumps(report, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
