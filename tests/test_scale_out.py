"""Scale-out around the server: two loopback "hosts", a rank dying under `serve`,
`serve --data-parallel-size`, and tokenmill replicas behind the real vllm-router."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_utils import REPO, ServerProcess, free_port, sse_json, vllm_router
from tests.test_distributed import assert_same, engine_settings, run
from tests.tiny_checkpoint import write_tiny_llama
from tokenmill.serve.routing import (
    CacheAwarePolicy,
    KVAwarePolicy,
    PromptTokens,
    RoundRobinPolicy,
    block_hashes,
    prompt_key,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tied")


# ----- the routing policy ------------------------------------------------------------------


def test_prompt_keys_and_block_hashes_share_prefixes() -> None:
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "hello"}]}
    assert prompt_key("/v1/chat/completions", longer).startswith(prompt_key("/v1/chat/completions", chat))
    assert prompt_key("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_key("/v1/completions", {"prompt": ["a b", "c"]}) == "a b"
    assert prompt_key("/v1/embeddings", {"input": ["a b", "c"]}) == "a b"
    assert prompt_key("/v1/embeddings", {"input": [4, 5]}) == [4, 5]
    a, b = block_hashes("x" * 200), block_hashes("x" * 128 + "y" * 72)
    assert a[:2] == b[:2] and a[2:] != b[2:] and len(a) == 4
    assert len(block_hashes(list(range(40)))) == 3


def test_cache_aware_keeps_sessions_together_until_loads_drift_apart() -> None:
    policy = CacheAwarePolicy(2, balance_abs=4)
    sessions = [f"session {s} " + "context " * 40 for s in range(4)]
    first = {s: policy.choose(sessions[s] + "q0", [0, 0], [True, True]).replica for s in range(4)}
    assert set(first.values()) == {0, 1}  # spread by load while nothing matches
    for turn in range(1, 4):
        for s in range(4):
            choice = policy.choose(sessions[s] + f"q{turn}", [1, 1], [True, True])
            assert choice.replica == first[s] and choice.reason == "prefix"
    assert policy.choose(sessions[0] + "q9", [9, 1], [True, True]).reason == "balance"
    assert policy.choose(sessions[0] + "q9", [0, 0], [False, True]).replica == 1
    with pytest.raises(LookupError):
        policy.choose("x", [0, 0], [False, False])


def test_round_robin_skips_unhealthy_replicas() -> None:
    policy = RoundRobinPolicy(3)
    assert [policy.choose("", [0] * 3, [True, False, True]).replica for _ in range(4)] == [0, 2, 0, 2]


def test_replica_metrics_get_a_replica_label_and_each_family_stays_together() -> None:
    from tokenmill.serve.data_parallel import merge_metrics

    text = ('# HELP tokenmill:x help\n# TYPE tokenmill:x counter\ntokenmill:x{model_name="m"} 3.0\n'
            "tokenmill:y 1.0\n")
    router = "# HELP tokenmill:router_z z\n# TYPE tokenmill:router_z gauge\ntokenmill:router_z 2.0\n"
    merged = merge_metrics([(router, None), (text, 'replica="0"'), (text, 'replica="1"')]).splitlines()
    assert merged == ["# HELP tokenmill:router_z z", "# TYPE tokenmill:router_z gauge", "tokenmill:router_z 2.0",
                      "# HELP tokenmill:x help", "# TYPE tokenmill:x counter",
                      'tokenmill:x{replica="0",model_name="m"} 3.0', 'tokenmill:x{replica="1",model_name="m"} 3.0',
                      'tokenmill:y{replica="0"} 1.0', 'tokenmill:y{replica="1"} 1.0']


# ----- two loopback hosts ------------------------------------------------------------------


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)], ids=["tp-across-hosts", "pp-across-hosts"])
def test_two_loopback_nodes_equal_one_process(tiny: Path, tp: int, pp: int) -> None:
    """Host 1 runs `serve --headless`; host 0 (this process) the engine. TP 2 over two hosts
    all-reduces over gloo; TP 2 x PP 2 keeps each stage on one host (shared memory) and
    sends hidden states across."""
    reference = run(engine_settings(tiny))
    port = free_port()
    settings = engine_settings(tiny, tp, pp, nnodes=2, master_addr="127.0.0.1", master_port=port)
    flags = ["--model", str(tiny), "--dtype", "float32", "--max-model-len", "256", "--num-threads", "1",
             "--block-size", "4", "--kv-cache-memory", str(settings["kv_cache_memory"]),
             "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp), "--nnodes", "2",
             "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--distributed-timeout", "30"]
    node1 = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--headless", *flags], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert_same(run(settings), reference)
        out, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, out[-3000:]  # rank 0 stopped it
        assert "headless node 1 of 2" in out
    finally:
        if node1.poll() is None:
            node1.kill()


# ----- a rank dies under the server ---------------------------------------------------------


def test_server_with_a_dead_rank_fails_the_request_and_exits(tiny: Path) -> None:
    server = ServerProcess("--model", str(tiny), "--tensor-parallel-size", "2", "--distributed-timeout", "30").start()
    try:
        pid = int(re.search(r"rank 1 \(pid (\d+)\) ready", server.log_tail(100_000)).group(1))
        body = {"model": server.model, "prompt": "w1 w2 w3", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            killed = time.monotonic()
            subprocess.run(["kill", "-9", str(pid)], check=True)
            rest = "\n".join(lines)
        errors = [json.loads(line[6:])["error"] for line in rest.splitlines() if line.startswith('data: {"error"')]
        # The client is told the engine failed and by what (details stay in the log: no internals in bodies).
        assert errors and errors[0]["code"] == "engine_unavailable", rest[-500:]
        assert "DistributedError" in errors[0]["message"], rest[-500:]
        server.proc.wait(timeout=30)
        assert time.monotonic() - killed < 30
        assert server.proc.returncode != 0
        assert "rank 1 (pid" in server.log_tail()
    finally:
        server.stop()


def test_a_rank_that_dies_while_idle_fails_health_and_the_server_exits(tiny: Path) -> None:
    server = ServerProcess("--model", str(tiny), "--tensor-parallel-size", "2", "--distributed-timeout", "30").start()
    try:
        assert server.get("/health").status_code == 200
        pid = int(re.search(r"rank 1 \(pid (\d+)\) ready", server.log_tail(100_000)).group(1))
        killed = time.monotonic()
        subprocess.run(["kill", "-9", str(pid)], check=True)
        server.proc.wait(timeout=30)  # no request needed: the idle engine notices
        assert time.monotonic() - killed < 30
        assert server.proc.returncode != 0
        assert "rank 1 (pid" in server.log_tail()
    finally:
        server.stop()


# ----- data parallelism in one server ---------------------------------------------------


def session_requests(sessions: int, turns: int) -> list[tuple[int, str]]:
    """W4-like traffic: each session a long shared context, its turns interleaved with the
    other sessions'."""
    contexts = [" ".join(f"w{(s * 37 + i) % 500 + 3}" for i in range(48)) for s in range(sessions)]
    return [(s, contexts[s] + f" w{400 + turn} w{450 + s}") for turn in range(turns) for s in range(sessions)]


def hit_rate(metrics: dict[str, float]) -> float:
    hits = sum(v for k, v in metrics.items() if k.startswith("tokenmill:prefix_cache_hits_total"))
    queries = sum(v for k, v in metrics.items() if k.startswith("tokenmill:prefix_cache_queries_total"))
    return hits / queries


def test_data_parallel_server_routes_by_prefix_and_survives_a_replica(tiny: Path) -> None:
    server = ServerProcess("--model", str(tiny), "--data-parallel-size", "2", "--block-size", "4").start()
    try:
        for _, prompt in session_requests(4, 3):
            response = server.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 2})
            assert response.status_code == 200, response.text
        metrics = server.metrics()
        routed = [metrics[f'tokenmill:router_requests_total{{replica="{r}"}}'] for r in (0, 1)]
        assert sum(routed) == 12 and min(routed) >= 3  # sessions spread over both replicas
        assert metrics["tokenmill:router_prefix_matched_blocks_total"] > 0
        assert hit_rate(metrics) > 0.5  # turns after the first find their session's context cached

        body = {"model": server.model, "prompt": "w5 w6", "max_tokens": 4, "stream": True}
        events = sse_json(server.post("/v1/completions", json=body).text)
        assert events[-1]["choices"][0]["finish_reason"] == "length"

        replica_pids = [int(p) for p in re.findall(r"replica \d pid (\d+)", server.log_tail(200_000))]
        assert replica_pids, server.log_tail()
        subprocess.run(["kill", "-9", str(replica_pids[0])], check=True)
        time.sleep(3)  # one health-check round
        assert server.get("/health").status_code == 200
        for _, prompt in session_requests(4, 1):
            response = server.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 2})
            assert response.status_code == 200, response.text
    finally:
        server.stop()


def test_kv_aware_matches_what_the_replicas_events_say_they_hold(tmp_path) -> None:
    """The engine's own events (its block manager, the real publisher and subscriber over
    ipc) fill the policy's index; a prompt is matched block for block, a removal or a
    reset takes the credit back."""
    from tokenmill.config import KVEventsConfig
    from tokenmill.engine import kv_events as ev
    from tokenmill.engine.block_manager import KVBlockManager, hash_block
    from tokenmill.kv_events.publisher import ZmqEventPublisher
    from tokenmill.kv_events.subscriber import KVEventSubscriber

    policy = KVAwarePolicy(2, block_size=4)
    endpoints = [f"ipc://{tmp_path}/events-{i}" for i in range(2)]
    publishers = [ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=e)) for e in endpoints]
    subscriber = KVEventSubscriber(endpoints, policy.on_batch).start()
    try:
        time.sleep(0.5)  # ZMQ's slow joiner: a subscription made after a batch misses it
        tokens = list(range(100, 117))  # 4 full blocks (the 17th token is the one computed)
        chain = []
        for i in range(4):
            chain.append(hash_block(chain[-1] if chain else None, tokens[4 * i : 4 * i + 4]))
        stored = ev.BlockStored(chain[:3], None, tokens[:12], 4, ev.MEDIUM_POOL)
        publishers[1].publish_events([stored])
        prompt = PromptTokens(tokens + [7])
        deadline = time.monotonic() + 10
        while policy.indexes[1].match(policy.hashes(prompt)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        choice = policy.choose(prompt, [0, 0], [True, True])
        assert (choice.replica, choice.matched_blocks, choice.total_blocks, choice.reason) == (1, 3, 4, "prefix")
        assert policy.choose(PromptTokens(tokens, cache_salt="other tenant"), [0, 0], [True, True]).replica == 0
        assert policy.choose(prompt, [30, 0], [True, True]).reason == "balance"
        # Demoted to the host tier: still held (another medium); then dropped there too.
        publishers[1].publish_events([ev.BlockRemoved(chain[1:3], ev.MEDIUM_POOL),
                                      ev.BlockStored(chain[1:3], chain[0], tokens[4:12], 4, ev.MEDIUM_HOST)])
        publishers[1].publish_events([ev.BlockRemoved(chain[1:3], ev.MEDIUM_HOST)])
        deadline = time.monotonic() + 10
        while subscriber.batches < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert policy.indexes[1].match(policy.hashes(prompt)) == 1
        publishers[1].publish_events([ev.AllBlocksCleared()])
        deadline = time.monotonic() + 10
        while len(policy.indexes[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert policy.choose(prompt, [0, 0], [True, True]).reason == "load" and subscriber.gaps == 0
    finally:
        subscriber.close()
        for publisher in publishers:
            publisher.shutdown()


@pytest.mark.parametrize("policy, owner", [("kv_aware", 1), ("cache_aware", 0)])
def test_kv_aware_routing_finds_a_prefix_the_router_never_saw(tiny: Path, policy: str, owner: int) -> None:
    """A prefix computed on replica 1 through its own port: kv_aware learns it from the
    replica's KV events and sends the next turn there; cache_aware (the control) cannot
    know and picks the idle replica 0."""
    server = ServerProcess("--model", str(tiny), "--data-parallel-size", "2", "--block-size", "4",
                           "--data-parallel-policy", policy).start()
    try:
        urls = dict(re.findall(r"replica (\d) pid \d+ at (http://[\d.:]+)", server.log_tail(200_000)))
        assert set(urls) == {"0", "1"}, server.log_tail()
        context = " ".join(f"w{5 + i % 40}" for i in range(60))
        direct = httpx.post(urls["1"] + "/v1/completions", timeout=60,
                            json={"model": server.model, "prompt": context, "max_tokens": 1})
        assert direct.status_code == 200, direct.text
        time.sleep(1.0)  # the events reach the router
        for turn in range(2):
            body = {"model": server.model, "prompt": context + f" w{turn + 6}", "max_tokens": 1}
            response = server.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
        metrics = server.metrics()
        routed = [metrics[f'tokenmill:router_requests_total{{replica="{r}"}}'] for r in (0, 1)]
        assert routed[owner] == 2, (policy, routed)
        # server.metrics() sums the replicas: with kv_aware both turns hit the 60-token context on
        # replica 1; with cache_aware the first turn computes it again on replica 0, the second hits.
        hits = metrics["tokenmill:prefix_cache_hits_total"]
        assert (hits >= 2 * 56) == (policy == "kv_aware"), (policy, hits)
    finally:
        server.stop()


# ----- replicas behind vllm-router -----------------------------------------------------------


def finished(server: ServerProcess) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("tokenmill:request_success_total"))



def test_replicas_behind_vllm_router(tiny: Path) -> None:
    replicas = [ServerProcess("--model", str(tiny), "--block-size", "4").start() for _ in range(2)]
    port = free_port()
    log = open(replicas[0].log.name + ".router", "w")
    router = subprocess.Popen(vllm_router("--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                                          "--worker-urls", *(r.url for r in replicas), "--health-check-interval-secs",
                                          "1", "--health-failure-threshold", "1"), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        models = httpx.get(url + "/v1/models", timeout=10).json()
        model = models["data"][0]["id"]
        for _, prompt in session_requests(4, 3):
            response = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2},
                                  timeout=60)
            assert response.status_code == 200, response.text
        served = [finished(r) for r in replicas]
        assert sum(served) == 12  # where cache_aware sent them is its business (docs/parallelism.md measures it)

        chat = {"model": model, "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 3, "stream": True}
        events = sse_json(httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).text)
        assert events[-1]["choices"][0]["finish_reason"] == "length"

        # A client that goes away mid-stream: the router drops its upstream request, the replica aborts.
        long = {"model": model, "prompt": "w7 w8", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as response:
            next(response.iter_lines())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            aborted = sum(r.metrics().get('tokenmill:request_success_total{finished_reason="abort"}', 0)
                          for r in replicas)
            if aborted:
                break
            time.sleep(0.2)
        assert aborted == 1

        replicas[1].proc.send_signal(signal.SIGKILL)
        replicas[1].proc.wait()
        time.sleep(4)  # the router's health checks take it out
        for _, prompt in session_requests(4, 1):
            response = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2},
                                  timeout=60)
            assert response.status_code == 200, response.text
    finally:
        router.terminate()
        router.wait(10)
        for replica in replicas:
            replica.stop()
