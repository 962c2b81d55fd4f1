"""Prefill-decode interference, colocated vs disaggregated (docs/disaggregation.md). Not in CI.

S decode streams (short random-token prompts, M output tokens each, streamed) run while a
closed loop sends long random-token prompts one after another (each a new prefix, a few output
tokens). Reported per system: the decode streams' inter-token latency (p50, p99) without and
with the prompt load, and the long prompts' TTFT.

- colocated: one `tokenmill serve` pinned to every core given (`--cores`, one thread each, or
  `--colocated-threads`), the scheduler's defaults (chunked prefill);
- 1P1D: a kv_producer pinned to the first core and a kv_consumer pinned to the second (one
  thread each), behind `vllm-router --vllm-pd-disaggregation`; on one host the consumer copies
  the KV from the producer's shared memory;
- 1P1D-tcp: the same consumer behind another router with a second producer (first core too)
  whose shared memory is off: the KV comes over TCP;
- 1P1D-control: the streams through 1P1D's router, the long prompts to its producer alone.

Systems and modes are alternated over `--rounds`; medians and the spread are reported.
On a shared machine, the load average is printed with every run: read the ratios.

    .venv/bin/python benchmarks/disaggregation.py --streams 4 --output-tokens 64 --prompt-tokens 2048 --rounds 2

`--simulate PROFILE.json` predicts the same cells with `tokenmill simulate`'s engine instead
(no server; docs/disaggregation.md, "Predicting it").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenmill.hardware import cpu_info  # noqa: E402
from tokenmill.workloads.local_server import LocalServer, free_port  # noqa: E402


class PinnedServer(LocalServer):
    def __init__(self, args: list[str], cores: str) -> None:
        super().__init__(args)
        self.cores = cores

    @property
    def command(self) -> list[str]:
        return ["taskset", "-c", self.cores, *super().command]


def router(prefill: LocalServer, decode: LocalServer) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("vllm-router")), "--host", "127.0.0.1", "--port",
                             str(port), "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
                             "--prometheus-port", str(free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.3)
    return proc, url


def stream_times(url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the streamed tokens (one SSE chunk per engine step and token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    times, started = [], time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"]:
                    times.append(time.monotonic())
    return [started, *times]


def measure(url: str, model: str, args: argparse.Namespace, load: bool, rng: random.Random,
            load_url: str | None = None) -> dict:
    """`load_url`: where the long prompts go (default: `url`)."""
    stop = threading.Event()
    ttfts: list[float] = []

    def prompt_load() -> None:
        while not stop.is_set():
            prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
            times = stream_times(load_url or url, model, prompt, 4)
            ttfts.append(times[1] - times[0])

    loader = threading.Thread(target=prompt_load) if load else None
    if loader is not None:
        loader.start()
        time.sleep(args.load_lead)  # the first long prompt is being computed when the streams start
    results: list[list[float]] = [[] for _ in range(args.streams)]

    def one(i: int) -> None:
        prompt = [rng.randrange(1000, 40000) for _ in range(32)]
        results[i] = stream_times(url, model, prompt, args.output_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if loader is not None:
        loader.join()
    gaps = [(b - a, b) for times in results for a, b in zip(times[1:], times[2:])]
    itl = sorted(g for g, _ in gaps)
    worst = max(gaps)
    wall = time.time() - time.monotonic()
    return {"itl_p50_ms": 1e3 * itl[len(itl) // 2], "itl_p99_ms": 1e3 * itl[min(len(itl) - 1, int(0.99 * len(itl)))],
            "num_itl": len(itl), "long_prompts": len(ttfts),
            "worst_gap": [round(1e3 * worst[0]), time.strftime("%H:%M:%S", time.localtime(worst[1] + wall))],
            "long_ttft_ms": 1e3 * statistics.median(ttfts) if ttfts else None, "load_avg": os.getloadavg()[0]}


def predict(args: argparse.Namespace) -> dict:
    """The same measurement on `tokenmill simulate`'s engine (no server started): a calibration
    profile (`--simulate PROFILE`, `tokenmill simulate calibrate --num-threads 1 --max-model-len
    8192`) prices every step; colocated is one instance, 1P1D two (simulator/disaggregation.py)
    with the KV pulled at --kv-transfer-bandwidth. The workload is built as `measure` sends it:
    the first long prompt, then the streams `--load-lead` s later, then the closed loop (one
    long prompt in flight at a time, the client's cap = streams + 1)."""
    from tokenmill.config import EngineConfig
    from tokenmill.planner.costmodel import MEASURED_KV_TRANSFER_BANDWIDTH, KVTransferCost
    from tokenmill.simulator.disaggregation import Layout
    from tokenmill.simulator.profile import load_profile
    from tokenmill.simulator.setup import setup_from_profile
    from tokenmill.simulator.simulate import simulate
    from tokenmill.workloads.trace import Trace, TraceRequest

    profile = load_profile(args.simulate)
    setup = setup_from_profile(EngineConfig.from_kwargs(max_model_len=8192), profile, args.simulate)
    bandwidth = args.kv_transfer_bandwidth * 1e9 if args.kv_transfer_bandwidth else MEASURED_KV_TRANSFER_BANDWIDTH
    transfer = KVTransferCost(bandwidth)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    summary = {}
    for system, layout in (("colocated", Layout()), ("1P1D", Layout.parse("1P1D"))):
        for load in (False, True):
            longs = 400 if load else 0
            requests = [TraceRequest(0.0, prompt(args.prompt_tokens), 4)] if load else []
            streams = list(range(len(requests), len(requests) + args.streams))
            requests += [TraceRequest(args.load_lead if load else 0.0, prompt(32), args.output_tokens)
                         for _ in streams]
            requests += [TraceRequest(args.load_lead, prompt(args.prompt_tokens), 4) for _ in range(longs - 1)]
            trace = Trace(requests, f"{args.streams} streams + closed loop of {args.prompt_tokens}-token prompts", {})
            run = simulate(trace, setup, max_concurrency=args.streams + (1 if load else 0), layout=layout,
                           transfer=transfer)
            end = max(run.records[i].start_time + run.records[i].latency for i in streams)
            itl = sorted(g for i in streams for g in run.records[i].itl)
            ttfts = [r.ttft for k, r in enumerate(run.records) if k not in streams and r.start_time < end]
            pulls = [p.done - p.started for p in run.pulls]
            key = f"{system} {'with' if load else 'without'} prompt load"
            summary[key] = {"itl_p50_ms": 1e3 * itl[len(itl) // 2],
                            "itl_p99_ms": 1e3 * itl[min(len(itl) - 1, int(0.99 * len(itl)))],
                            "long_ttft_ms": 1e3 * statistics.median(ttfts) if ttfts else None,
                            "median_pull_ms": 1e3 * statistics.median(pulls) if pulls else None}
            print(key, json.dumps(summary[key]), flush=True)
    return {"profile": args.simulate, "cost_model": setup.cost_model_source, "transfer": transfer.to_dict(),
            "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--load-lead", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", default="0,1")
    parser.add_argument("--colocated-threads", type=int, default=None,
                        help="the colocated server's --num-threads (default: one per core given)")
    parser.add_argument("--server-args", default="--max-model-len 8192")
    parser.add_argument("--systems", default="colocated,1P1D")
    parser.add_argument("--output")
    parser.add_argument("--simulate", default=None, metavar="PROFILE.json",
                        help="predict the measurement with tokenmill simulate's engine and this calibration instead "
                             "of running servers")
    parser.add_argument("--kv-transfer-bandwidth", type=float, default=None, metavar="GB/s",
                        help="with --simulate: the pull's bandwidth (default: the loopback pull measured here)")
    args = parser.parse_args()
    if args.simulate:
        report = predict(args)
        print(json.dumps(report["summary"], indent=1))
        if args.output:
            Path(args.output).write_text(json.dumps(report, indent=1))
        return
    extra = args.server_args.split()
    first, second = args.cores.split(",")[:2]
    threads = str(args.colocated_threads or len(args.cores.split(",")))
    colocated = PinnedServer([*extra, "--num-threads", threads], args.cores)
    kv_port = free_port()
    producer = PinnedServer([*extra, "--num-threads", "1", "--kv-transfer-config", json.dumps(
        {"kv_connector": "TokenmillConnector", "kv_role": "kv_producer", "kv_port": kv_port})], first)
    consumer = PinnedServer([*extra, "--num-threads", "1", "--kv-transfer-config", json.dumps(
        {"kv_connector": "TokenmillConnector", "kv_role": "kv_consumer"})], second)
    servers = [colocated, producer, consumer]
    wanted = args.systems.split(",")
    if "1P1D-tcp" in wanted:
        producer_tcp = PinnedServer([*extra, "--num-threads", "1", "--kv-transfer-config", json.dumps(
            {"kv_connector": "TokenmillConnector", "kv_role": "kv_producer", "kv_port": free_port(),
             "kv_connector_extra_config": {"shared_memory": False}})], first)
        servers.append(producer_tcp)
    proc = proc_tcp = None
    rows: list[dict] = []
    try:
        for server in servers:
            server.start()
        proc, pd_url = router(producer, consumer)
        tcp_url = None
        if "1P1D-tcp" in wanted:
            proc_tcp, tcp_url = router(producer_tcp, consumer)
        model = httpx.get(colocated.url + "/v1/models").json()["data"][0]["id"]
        # 1P1D-control: the streams through the router, the long prompts to the prefill instance
        # alone (its core busy, the decode instance never sees them): what pinning and a busy
        # neighbour core do to the decode instance, without any KV transfer.
        systems = {k: v for k, v in {"colocated": colocated.url, "1P1D": pd_url, "1P1D-tcp": tcp_url,
                                     "1P1D-control": pd_url}.items() if k in wanted}
        rng = random.Random(0)
        for url in systems.values():  # warm-up: kernels, tuning, a long prompt each
            stream_times(url, model, [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)], 4)
        for r in range(args.rounds):
            for system, url in systems.items():
                for load in (False, True):
                    load_url = producer.url if system == "1P1D-control" else None
                    row = {"round": r, "system": system, "prompt_load": load,
                           **measure(url, model, args, load, rng, load_url)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        for p in (proc, proc_tcp):
            if p is not None:
                p.terminate()
                p.wait(10)
        for server in servers:
            server.stop()
    summary = {}
    for system in args.systems.split(","):
        for load in (False, True):
            sel = [x for x in rows if x["system"] == system and x["prompt_load"] == load]
            key = f"{system} {'with' if load else 'without'} prompt load"
            summary[key] = {m: (statistics.median(x[m] for x in sel), min(x[m] for x in sel), max(x[m] for x in sel))
                            for m in ("itl_p50_ms", "itl_p99_ms", "load_avg")}
            ttft = [x["long_ttft_ms"] for x in sel if x["long_ttft_ms"] is not None]
            if ttft:
                summary[key]["long_ttft_ms"] = (statistics.median(ttft), min(ttft), max(ttft))
    report = {"cpu": cpu_info().model_name if hasattr(cpu_info(), "model_name") else str(cpu_info()),
              "args": vars(args), "rows": rows, "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
