"""Two tokenmill replicas behind vllm-router: the kv_aware policy (routing on the replicas'
KV events, --kv-events-config) against cache_aware (the router's own prefix tree of the
requests it saw), on a multi-turn trace: S sessions of T turns, each session a private
H-token history (token ids) growing by U tokens a turn, turns round-robin over the sessions,
one request at a time. Reported: the prefix hit rate summed over both replicas (hit tokens /
prompt tokens, from their /metrics) and how the requests split. Fresh replicas per policy.
Not part of CI.

    .venv/bin/python benchmarks/kv_aware_router.py --sessions 8 --turns 3 --history 256 --output router.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.server_utils import ServerProcess, free_port  # noqa: E402
from tokenmill.hardware import cpu_info  # noqa: E402


def counter(server: ServerProcess, name: str) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith(name))


def run(policy: str, args: argparse.Namespace) -> dict:
    ports = [free_port() for _ in range(2)]
    replicas, router = [], None
    try:
        for port in ports:
            events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
            replicas.append(ServerProcess("--kv-events-config", json.dumps(events), "--kv-cache-memory",
                                          args.kv_cache_memory).start())
        router_port = free_port()
        command = [str(Path(sys.executable).with_name("vllm-router")), "--host", "127.0.0.1", "--port",
                   str(router_port), "--policy", policy, "--worker-urls", *(r.url for r in replicas)]
        if policy == "kv_aware":
            command += ["--kv-event-block-size", "16", "--kv-event-model", replicas[0].model]
            if args.session_affinity_ttl:  # vllm-router keys a session on its x-session-id header
                command += ["--kv-aware-session-affinity-ttl-secs", str(args.session_affinity_ttl)]
            for replica, port in zip(replicas, ports):
                command += ["--kv-event-source", f"{replica.url}=tcp://127.0.0.1:{port}"]
        router = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{router_port}"
        for _ in range(200):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        rng = random.Random(args.seed)
        histories = [[rng.randrange(300, 5000) for _ in range(args.history)] for _ in range(args.sessions)]
        turns = [[[rng.randrange(300, 5000) for _ in range(args.user)] for _ in range(args.turns)]
                 for _ in range(args.sessions)]
        model = replicas[0].model
        load = []

        def send(s: int, turn: int) -> None:
            histories[s] += turns[s][turn]
            body = {"model": model, "prompt": histories[s], "max_tokens": args.answer, "temperature": 0}
            # A multi-turn client names its conversation, as agents do; only session affinity reads it.
            headers = {"x-session-id": f"session-{s}"}
            httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=600).raise_for_status()
            load.append(os.getloadavg()[0])
            time.sleep(args.gap)  # the replica's events reach the router before the session's next turn

        def session(s: int) -> None:
            for turn in range(args.turns):
                send(s, turn)

        if args.concurrent:  # every session at once, each one's turns in order
            with ThreadPoolExecutor(args.sessions) as pool:
                list(pool.map(session, range(args.sessions)))
        else:  # round-robin, one request at a time
            for turn in range(args.turns):
                for s in range(args.sessions):
                    send(s, turn)
        hits = sum(counter(r, "tokenmill:prefix_cache_hits_total") for r in replicas)
        queries = sum(counter(r, "tokenmill:prefix_cache_queries_total") for r in replicas)
        served = [counter(r, "tokenmill:request_success_total") for r in replicas]
        return {"hit_rate": hits / queries, "hit_tokens": hits, "prompt_tokens": queries, "served": served,
                "load_avg_1m": [min(load), max(load)]}
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for replica in replicas:
            replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--history", type=int, default=256)
    parser.add_argument("--user", type=int, default=32)
    parser.add_argument("--answer", type=int, default=4)
    parser.add_argument("--gap", type=float, default=0.2)
    parser.add_argument("--concurrent", action="store_true", help="all sessions at once (each one's turns in order)")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--session-affinity-ttl", type=int, default=0,
                        help="kv_aware only: vllm-router's --kv-aware-session-affinity-ttl-secs (0: off)")
    parser.add_argument("--policies", nargs="+", default=["kv_aware", "cache_aware"])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    report = {"cpu": cpu_info().model_name, "cores": cpu_info().num_cores,
              "trace": {k: getattr(args, k) for k in ("sessions", "turns", "history", "user", "answer", "concurrent",
                                                                 "session_affinity_ttl")}}
    for policy in args.policies:
        report[policy] = run(policy, args)
        print(policy, report[policy], flush=True)
    print(json.dumps(report, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
