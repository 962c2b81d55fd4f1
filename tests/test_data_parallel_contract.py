"""The data-parallel router keeps the single server's contract where only it can break it
(issue 31): health checks that carry the API key, replicas' answers passed through with
their headers, a stream whose replica dies ending in an error event and `[DONE]`, and a
SIGTERM drain of the whole server. The contract tests that hold for any server
(test_server_hardening.py: auth, body limits, caps, streams, the openai client) run
through the router too.

The tiny checkpoint (loads in seconds) with a long context, so that a stream lasts long
enough to be caught running; round-robin routing, so that which replica gets a request is
known; 1 running and 1 queued sequence per replica, so that the queue fills at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import alive, wait_until
from tests.server_utils import ServerProcess, assert_error, sse_events
from tests.tiny_checkpoint import write_tiny_llama

API_KEY = "dp-key"
COMPLETIONS = "/v1/completions"
LONG = {"prompt": "w5 w6 w7", "max_tokens": 3500, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "long", max_position_embeddings=4096)


def start_router(tiny: Path, *flags: str) -> ServerProcess:
    return ServerProcess("--model", str(tiny), "--max-model-len", "4096", "--data-parallel-size", "2",
                         "--data-parallel-policy", "round_robin", "--max-num-seqs", "1", "--max-queued-requests", "1",
                         "--protect-health-and-metrics", *flags, api_key=API_KEY).start()


@pytest.fixture(scope="module")
def router(tiny: Path):
    server = start_router(tiny)
    yield server
    server.stop()


def replica_pids(server: ServerProcess) -> dict[int, int]:
    """{replica index: pid}, from the router's start-up line."""
    found = re.findall(r"replica (\d+) pid (\d+)", server.log_tail(200_000))
    assert found, server.log_tail()
    return {int(index): int(pid) for index, pid in found}


def replica_gauge(server: ServerProcess, name: str) -> dict[int, float]:
    """A gauge per replica, from the router's /metrics (`replica` label kept)."""
    text = server.get("/metrics").text
    return {int(r): float(v) for r, v in re.findall(rf'^{re.escape(name)}{{replica="(\d+)"[^}}]*}} (\S+)$', text, re.M)}


def first_event(chunks) -> str:
    """A stream's text up to the end of its first event."""
    text = ""
    while "\n\n" not in text:
        text += next(chunks)
    return text


def test_health_checks_carry_the_api_key(router):
    """With --protect-health-and-metrics the router used to probe its replicas without the
    key: they answered 401, and it never became healthy (every request 503)."""
    assert router.get("/health").json()["status"] == "ok"  # start() waited for it
    response = httpx.get(router.url + "/health")
    assert assert_error(response, 401)["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"
    metrics = router.metrics()
    assert [metrics[f'tokenmill:router_replica_healthy{{replica="{r}"}}'] for r in (0, 1)] == [1, 1]
    # refused before routing, as in the single server
    assert metrics['tokenmill:router_http_requests_total{handler="unmatched",method="GET",status="401"}'] >= 1


def test_request_headers_reach_the_replica(router):
    """Every request header but the connection's own and the key reaches the replica: a
    bad llm-d SLO header is the replica's 400."""
    response = router.post(COMPLETIONS, json={"prompt": "w1", "max_tokens": 1}, headers={"x-slo-ttft-ms": "soon"})
    assert "x-slo-ttft-ms" in assert_error(response, 400, "slo_ttft_ms")["message"]


def test_a_path_with_encoded_control_characters_reaches_the_replica(router):
    """The router forwards the path as the client sent it, percent-encoded: it used to
    forward the decoded one, which httpx refuses to put in a URL (`%08`): a 500 where the
    single server answers 404 (found by test_fuzz.py through the router)."""
    response = router.get("/v1/responses/A%08%0B%F3%8A%9C%A1%19F%C3%99")
    assert assert_error(response, 404)
    assert router.get("/v1/models?x=%00%08&y=%E2%82").status_code == 200
    assert router.get("/no/such%08route").status_code == 404


def test_a_replicas_429_reaches_the_client_with_retry_after(router):
    """Round robin: requests 1-4 take each replica's running slot and queue slot, the 5th
    finds its replica's queue full; the replica's 429 and its Retry-After pass through."""

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(headers=router.headers, timeout=120) as client, \
                contextlib.AsyncExitStack() as open_streams:
            async def open_stream() -> None:
                response = await open_streams.enter_async_context(client.stream("POST", router.url + COMPLETIONS,
                                                                                json=LONG))
                assert response.status_code == 200

            await asyncio.gather(open_stream(), open_stream())
            queued = [asyncio.ensure_future(open_stream()) for _ in range(2)]
            await until(lambda: (router.metrics()["tokenmill:num_requests_waiting"],
                                 router.metrics()["tokenmill:num_requests_running"]) == (2, 2))
            refused = await client.post(router.url + COMPLETIONS, json=LONG)
            for task in queued:
                task.cancel()
            await asyncio.gather(*queued, return_exceptions=True)
            return refused

    response = asyncio.run(scenario())
    assert_error(response, 429)
    assert response.headers["retry-after"] == "1"
    metrics = router.wait_idle(30)  # the streams were closed: the replicas aborted them
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0


async def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_done(router):
    """Last of the module's tests on `router`: it kills a replica. The stream's status is
    sent, so the error can only travel as an event; the router then serves on the other."""
    pids = replica_pids(router)
    with httpx.stream("POST", router.url + COMPLETIONS, headers=router.headers, json=LONG, timeout=120) as response:
        assert response.status_code == 200
        chunks = response.iter_text()
        raw = first_event(chunks)
        running = replica_gauge(router, "tokenmill:num_requests_running")
        serving = next(r for r, value in running.items() if value == 1)
        os.kill(pids[serving], signal.SIGKILL)
        raw += "".join(chunks)
    events = sse_events(raw)  # framing checked: whole events, then [DONE]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_unavailable" and "replica" in error["message"], error
    assert all("choices" in json.loads(event) for event in events[:-2])  # no half event before it
    assert wait_until(lambda: not alive(pids[serving]), 10)
    for _ in range(3):  # the dead replica is skipped (or found dead and skipped) at once
        response = router.post(COMPLETIONS, json={"prompt": "w1 w2", "max_tokens": 2})
        assert response.status_code == 200, response.text
    assert wait_until(lambda: router.metrics()[f'tokenmill:router_replica_healthy{{replica="{serving}"}}'] == 0, 5)
    assert router.get("/health").status_code == 200  # one replica is enough


def test_a_responses_stream_whose_replica_dies_ends_with_its_error_event(tiny: Path):
    """A Responses API stream ends as the single server's does when its engine dies: an
    `error` event numbered after the last one relayed, and no `[DONE]` (the router sent the
    chat streams' ErrorResponse and `[DONE]`, which the route's schema does not allow)."""
    server = start_router(tiny)
    pids = replica_pids(server)
    body = {"input": "w5 w6 w7", "max_output_tokens": 3500, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/responses", headers=server.headers, json=body,
                          timeout=120) as response:
            assert response.status_code == 200
            chunks = response.iter_text()
            raw = first_event(chunks)
            serving: list[int] = []  # the replica's gauge may lag the first event
            assert wait_until(lambda: serving.extend(
                r for r, value in replica_gauge(server, "tokenmill:num_requests_running").items() if value == 1)
                or serving, 10)
            os.kill(pids[serving[0]], signal.SIGKILL)
            raw += "".join(chunks)
        blocks = raw.split("\n\n")
        assert blocks[-1] == "" and "[DONE]" not in raw, raw[-300:]
        events = [dict(line.split(": ", 1) for line in block.split("\n")) for block in blocks[:-1]]
        payloads = [json.loads(event["data"]) for event in events]
        assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
        assert all(event["event"] == payload["type"] for event, payload in zip(events, payloads))
        assert payloads[-1] == {"type": "error", "sequence_number": len(payloads) - 1, "code": "engine_unavailable",
                                "message": payloads[-1]["message"], "param": None}, payloads[-1]
        assert "replica" in payloads[-1]["message"] and payloads[-2]["type"] != "response.completed"
    finally:
        server.stop()


def test_sigterm_drains_the_replicas_and_exits_0(tiny: Path):
    """The router's drain is the single server's: new requests 503 with Connection: close,
    /health 503, a running stream ends `abort` + `[DONE]` at the replicas' shutdown
    timeout, exit 0, no replica left."""
    server = start_router(tiny, "--shutdown-timeout", "3")
    pids = replica_pids(server)
    try:
        with httpx.stream("POST", server.url + COMPLETIONS, headers=server.headers, json=LONG,
                          timeout=120) as response:
            chunks = response.iter_text()
            raw = first_event(chunks)
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = server.post(COMPLETIONS, json={"prompt": "w1", "max_tokens": 2})
            assert assert_error(refused, 503)["code"] == "engine_unavailable"
            assert refused.headers["connection"] == "close"
            assert server.get("/health").status_code == 503
            raw += "".join(chunks)
        events = sse_events(raw)
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert server.proc.wait(30) == 0, server.log_tail()
        print(f"SIGTERM to exit: {time.monotonic() - signalled:.1f} s (replicas' --shutdown-timeout 3)")
        assert not [pid for pid in pids.values() if alive(pid)]
    finally:
        server.stop()
