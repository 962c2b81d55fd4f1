"""Benchmarks of the scale-out modes (docs/parallelism.md has the tables they print).

    python benchmarks/parallel.py collectives   # shm vs gloo all-reduce, step message cost
    python benchmarks/parallel.py tp            # TP 2 (1 thread/rank) vs 1 process x 2 threads
    python benchmarks/parallel.py dp            # prefix-cache hit rates: DP 2 routers vs one engine

Runs are interleaved (A, B, A, B, ...) and medians reported, because other jobs share
this machine's cores; read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ----- collectives --------------------------------------------------------------------------


def _collectives_rank(rank: int, port: int, kind: str, iters: int, queue) -> None:
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.parallel.group import DistributedContext

    torch.set_num_threads(1)
    config = EngineConfig.from_kwargs(tensor_parallel_size=2, master_port=port, all_reduce=kind)
    ctx = DistributedContext(config, rank)
    results = {}
    for tokens in (1, 16, 64):
        x = torch.randn(tokens, 576)
        times = []
        for i in range(iters + 20):
            started = time.perf_counter()
            ctx.tp.all_reduce_(x)
            if i >= 20:
                times.append(time.perf_counter() - started)
            x.mul_(0.5)
        results[tokens] = (statistics.median(times) * 1e6, percentile(times, 0.9) * 1e6)
    if rank == 0:
        queue.put(results)
    ctx.close()


def collectives(args: argparse.Namespace) -> None:
    import multiprocessing

    from tokenmill.hardware import cpu_info

    print(f"CPU: {cpu_info().model_name}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    context = multiprocessing.get_context("spawn")
    rows = {}
    for round_ in range(args.rounds):
        for kind in ("shm", "gloo"):
            queue = context.Queue()
            port = 29700 + round_ * 2 + (kind == "gloo")
            procs = [context.Process(target=_collectives_rank, args=(r, port, kind, args.iters, queue))
                     for r in (0, 1)]
            for p in procs:
                p.start()
            result = queue.get(timeout=300)
            for p in procs:
                p.join()
            for tokens, (p50, p90) in result.items():
                rows.setdefault((kind, tokens), []).append((p50, p90))
    print("\n| all-reduce, 2 ranks x 1 thread | tokens x 576 fp32 | p50 (us) | p90 (us) |")
    print("|---|---|---|---|")
    for (kind, tokens), values in sorted(rows.items()):
        p50 = statistics.median(v[0] for v in values)
        p90 = statistics.median(v[1] for v in values)
        print(f"| {kind} | {tokens} | {p50:.1f} | {p90:.1f} |")
    step_message_cost()


def _echo(address) -> None:
    from multiprocessing.connection import Client

    from tokenmill.parallel.channel import no_delay

    conn = no_delay(Client(address, authkey=b"k"))
    while True:
        data = conn.recv_bytes()
        if data == b"stop":
            return
        pickle.loads(data)
        conn.send_bytes(b"ok")


def step_message_cost() -> None:
    """Pickle + loopback socket of a decode step of 64 requests and of a step adding 64
    new requests (the diffs the step channel carries), to another process and back."""
    import multiprocessing
    from multiprocessing.connection import Listener

    from tokenmill.engine.batch import NewRequestData, ScheduledRequest, SchedulerOutput
    from tokenmill.sampling.params import SamplingParams

    decode = SchedulerOutput([ScheduledRequest(str(i), 300 + i, 1, [1234], [], True) for i in range(64)])
    new = SchedulerOutput([ScheduledRequest(str(i), 0, 300, [], list(range(19)), True,
                                            NewRequestData(list(range(300)), SamplingParams(max_tokens=64)))
                           for i in range(64)])
    listener = Listener(("127.0.0.1", 0), authkey=b"k")
    echo = multiprocessing.get_context("spawn").Process(target=_echo, args=(listener.address,))
    echo.start()
    from tokenmill.parallel.channel import no_delay

    conn = no_delay(listener.accept())
    print("\n| step message (pickle + loopback socket + unpickle) | bytes | p50 one way (us) |")
    print("|---|---|---|")
    for name, message in (("decode step, 64 requests", decode), ("64 new requests of 300 tokens", new)):
        times = []
        for _ in range(300):
            started = time.perf_counter()
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            conn.send_bytes(data)
            conn.recv_bytes()
            times.append((time.perf_counter() - started) / 2)
        print(f"| {name} | {len(data)} | {statistics.median(times) * 1e6:.0f} |")
    conn.send_bytes(b"stop")
    echo.join()


# ----- tensor parallelism against one process --------------------------------------------


def _requests(name: str, tokenizer, vocab: int, seed: int, small_w3: bool):
    from tokenmill.workloads.offline import (
        FULL,
        Sizes,
        build_requests,
        ordinary_token_ids,
    )

    sizes = Sizes(w3_requests=16, w3_prompt=(64, 256), w3_new=(32, 64)) if small_w3 else FULL
    return build_requests(name, sizes, random.Random(f"parallel:{name}:{seed}"), ordinary_token_ids(tokenizer, vocab))


def _run(llm, requests) -> tuple[float, int, float]:
    """(wall seconds, generated tokens, first-token seconds of the first request)."""
    from tokenmill import SamplingParams

    engine = llm.engine
    started = time.perf_counter()
    first = None
    for i, (prompt, new) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter() - started
            if output.finished:
                generated += len(output.outputs[0].token_ids)
    return time.perf_counter() - started, generated, first or 0.0


TP_ENGINES = {"1 process x 2 threads": {}, "TP 2 x 1 thread": {"tensor_parallel_size": 2}}


def tp(args: argparse.Namespace) -> None:
    """Each engine in its own process (torch's thread pool is process-wide: an engine sharing
    its process with TP rank 0 ran at about half its speed), the two alternating rep by rep."""
    from tokenmill.hardware import cpu_info

    if args.engine:
        return _tp_engine(args)
    results: dict[tuple[str, str], list[float]] = {}
    collectives: dict[str, list[float]] = {}
    plans: dict[str, str] = {}
    for rep in range(args.reps):
        for name in TP_ENGINES:
            command = [sys.executable, __file__, "tp", "--engine", name, "--rep", str(rep), "--dtype", args.dtype]
            out = json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout)
            plans[name] = out["plan"]
            for workload, value in out["values"].items():
                results.setdefault((workload, name), []).append(value)
                print(f"  rep {rep} {workload} {name}: {value:.1f} tok/s", flush=True)
            for workload, ms in out.get("collective_ms", {}).items():
                collectives.setdefault(workload, []).append(ms)
    print(f"CPU: {cpu_info().model_name}, {os.cpu_count()} cores; dtype {args.dtype}; plans: "
          + " | ".join(f"{name}: {plan}" for name, plan in plans.items()))
    print("\n| workload | 1 process x 2 threads | TP 2 x 1 thread per rank | ratio |")
    print("|---|---|---|---|")
    for workload, label in (("W1", "W1 decode (tok/s)"), ("W3", "W3 small, 16 requests (output tok/s)")):
        a = statistics.median(results[(workload, "1 process x 2 threads")])
        b = statistics.median(results[(workload, "TP 2 x 1 thread")])
        print(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    for workload, values in collectives.items():
        print(f"{workload}: rank 0 spends {statistics.median(values):.2f} ms per step in its collectives")


def _tp_engine(args: argparse.Namespace) -> None:
    """One engine, one rep of W1 and W3; prints JSON for the parent."""
    from tokenmill.llm import LLM

    llm = LLM(num_threads=2, dtype=args.dtype, max_model_len=1024, kv_cache_memory="1GiB", **TP_ENGINES[args.engine])
    comm = llm.engine.executor.ctx.tp if "tensor_parallel_size" in TP_ENGINES[args.engine] else None
    _run(llm, _requests("W1", llm.tokenizer, llm.engine.vocab_size, 1000 + args.rep, small_w3=True))  # warm-up
    values, collective_ms = {}, {}
    for workload in ("W1", "W3"):
        requests = _requests(workload, llm.tokenizer, llm.engine.vocab_size, args.rep, small_w3=True)
        steps_before = llm.engine.num_steps
        busy = comm.busy_s if comm is not None else 0.0
        wall, generated, ttft = _run(llm, requests)
        values[workload] = (generated - 1) / (wall - ttft) if workload == "W1" else generated / wall
        if comm is not None:
            collective_ms[workload] = (comm.busy_s - busy) / (llm.engine.num_steps - steps_before) * 1e3
    print(json.dumps({"plan": llm.engine.facts.execution_plan, "values": values, "collective_ms": collective_ms}))
    if comm is not None:
        llm.engine.executor.close()


# ----- data parallelism: prefix-cache hit rates ----------------------------------------------


def _serve(args: list[str], port: int, log: Path) -> subprocess.Popen:
    import httpx

    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--disable-access-log", *args]
    proc = subprocess.Popen(command, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError("server not healthy")


def _sessions(args: argparse.Namespace) -> list[str]:
    """W4-like traffic from many sessions: each has a long context (a system prompt plus
    history) that all its turns share; turns of different sessions interleave."""
    rng = random.Random(7)
    words = [f"{a}{b}" for a in ("re", "con", "de", "pro", "in", "ex", "sub", "per") for b in
             ("port", "tain", "sign", "vide", "duct", "fine", "struct", "form", "tend", "mit")]
    contexts = [" ".join(rng.choice(words) for _ in range(args.context_words)) for _ in range(args.sessions)]
    return [f"{contexts[s]} question {turn} of session {s}:" for turn in range(args.turns) for s in range(args.sessions)]


def _drive(url: str, prompts: list[str], concurrency: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def one(prompt: str) -> None:
        response = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                              "temperature": 0}, timeout=600)
        response.raise_for_status()

    started = time.perf_counter()
    # Turn by turn: a session's next turn comes after its previous one (a conversation).
    per_turn = len(prompts) // max(1, len({p.rsplit(" question ", 1)[0] for p in prompts}))
    sessions = len(prompts) // per_turn
    with ThreadPoolExecutor(concurrency) as pool:
        for turn in range(per_turn):
            list(pool.map(one, prompts[turn * sessions : (turn + 1) * sessions]))
    return time.perf_counter() - started


def _hit_rate(urls: list[str]) -> float:
    import httpx

    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("tokenmill:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("tokenmill:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits / queries if queries else 0.0


def dp(args: argparse.Namespace) -> None:
    from tokenmill.hardware import cpu_info

    prompts = _sessions(args)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    engine = ["--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048"]
    print(f"CPU: {cpu_info().model_name}; {args.sessions} sessions x {args.turns} turns, contexts of "
          f"{args.context_words} words, {args.concurrency} clients; KV cache {args.kv_cache_memory} per replica")
    rows = []

    def measure(label: str, servers: list[tuple[list[str], int]], front: str | None = None,
                router_args: list[str] | None = None) -> None:
        procs = []
        try:
            for i, (flags, port) in enumerate(servers):
                procs.append(_serve(flags, port, logs / f"{label.replace(' ', '_')}-{i}.log"))
            urls = [f"http://127.0.0.1:{port}" for _, port in servers]
            url = urls[0]
            if router_args is not None:
                router_port = 18390
                procs.append(subprocess.Popen([str(Path(sys.executable).with_name("vllm-router")), "--host",
                                               "127.0.0.1", "--port", str(router_port), "--worker-urls", *urls,
                                               *router_args], stdout=(logs / f"{label}-router.log").open("w"),
                                              stderr=subprocess.STDOUT))
                url = f"http://127.0.0.1:{router_port}"
                import httpx

                for _ in range(120):
                    try:
                        if httpx.get(url + "/health", timeout=2).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.5)
            wall = _drive(url, prompts, args.concurrency)
            rate = _hit_rate(urls if router_args is not None else [url])
            rows.append((label, rate, wall))
            print(f"  {label}: hit rate {rate:.3f}, {wall:.1f} s", flush=True)
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(60)

    threads = ["--num-threads", "2"]
    half = ["--num-threads", "1"]
    measure("one engine (2 threads)", [(engine + threads, 18301)])
    measure("serve --data-parallel-size 2, cache_aware", [(engine + threads + ["--data-parallel-size", "2"], 18302)])
    measure("serve --data-parallel-size 2, round_robin",
            [(engine + threads + ["--data-parallel-size", "2", "--data-parallel-policy", "round_robin"], 18303)])
    for policy in ("cache_aware", "round_robin"):
        measure(f"vllm-router {policy}, 2 replicas", [(engine + half, 18311), (engine + half, 18312)],
                router_args=["--policy", policy])
    print("\n| setup | prefix-cache hit rate | wall (s) |")
    print("|---|---|---|")
    for label, rate, wall in rows:
        print(f"| {label} | {rate:.3f} | {wall:.1f} |")
    print(json.dumps({label: rate for label, rate, _ in rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collectives")
    c.add_argument("--iters", type=int, default=2000)
    c.add_argument("--rounds", type=int, default=3)
    t = sub.add_parser("tp")
    t.add_argument("--reps", type=int, default=3)
    t.add_argument("--dtype", default="float32")
    t.add_argument("--engine", choices=list(TP_ENGINES), default=None, help=argparse.SUPPRESS)
    t.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    d = sub.add_parser("dp")
    d.add_argument("--sessions", type=int, default=16)
    d.add_argument("--turns", type=int, default=4)
    d.add_argument("--context-words", type=int, default=300)
    d.add_argument("--concurrency", type=int, default=8)
    d.add_argument("--dtype", default="float32")
    d.add_argument("--kv-cache-memory", default="256MiB")
    d.add_argument("--logs", default="/tmp/tokenmill-dp-bench")
    args = parser.parse_args()
    {"collectives": collectives, "tp": tp, "dp": dp}[args.command](args)


if __name__ == "__main__":
    main()
