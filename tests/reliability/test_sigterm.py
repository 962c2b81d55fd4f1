"""--max-queue-wait-s and a SIGTERM drain, on a server of their own: 2 running
sequences, a 2 s queue wait, a 4 s shutdown timeout.

The drain: the server keeps listening and answers new requests 503 (Connection:
close), the short request that was running finishes normally, the long one ends at
the timeout with finish_reason "abort" and [DONE], and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.reliability.support import RESULTS, start_server
from tests.server_utils import assert_error, sse_json

LONG = {"prompt": "Write a long poem about rivers.", "max_tokens": 230, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    process = start_server("--max-num-seqs", "2", "--max-queue-wait-s", "2", "--shutdown-timeout", "4")
    yield process
    if process.alive:
        process.proc.kill()


def test_a_request_not_scheduled_within_the_queue_wait_gets_503(server):
    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            async def run_long():
                async with client.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as r:
                    assert r.status_code == 200
                    await r.aread()

            runners = [asyncio.ensure_future(run_long()) for _ in range(2)]
            await asyncio.sleep(1.0)
            started = time.monotonic()
            plain, streamed = await asyncio.gather(
                client.post(server.url + "/v1/completions", json={"prompt": "queued", "max_tokens": 4}),
                client.post(server.url + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}))
            waited = time.monotonic() - started
            for runner in runners:
                runner.cancel()
            await asyncio.gather(*runners, return_exceptions=True)
            return plain, streamed, waited

    plain, streamed, waited = asyncio.run(scenario())
    for response in (plain, streamed):
        error = assert_error(response, 503)
        assert error["code"] == "queue_timeout" and response.headers["retry-after"].isdigit()
    assert 2.0 <= waited < 10
    server.wait_idle()
    RESULTS["queue_wait"] = {"limit_s": 2, "answered_503_after_s": round(waited, 1)}


def test_sigterm_drains_then_exits_0(server):
    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            async def long_stream() -> str:
                async with client.stream("POST", server.url + "/v1/completions",
                                         json={**LONG, "stream": True}) as response:
                    assert response.status_code == 200
                    return "".join([chunk async for chunk in response.aiter_text()])

            long = asyncio.ensure_future(long_stream())
            short = asyncio.ensure_future(client.post(server.url + "/v1/completions",
                                                      json={"prompt": "Hi", "max_tokens": 12, "ignore_eos": True}))
            while (await asyncio.to_thread(server.metrics))["tokenmill:num_requests_running"] < 2:
                await asyncio.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            refused = await client.post(server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
            health = await client.get(server.url + "/health")
            return await long, await short, refused, health, signalled

    long, short, refused, health, signalled = asyncio.run(scenario())
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert short.json()["usage"]["completion_tokens"] == 12
    chunks = sse_json(long)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["abort"]
    assert_error(refused, 503)
    assert refused.headers.get("connection") == "close"
    assert_error(health, 503)
    assert server.proc.wait(30) == 0, server.log_tail()
    exited_after = time.monotonic() - signalled
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)
    RESULTS["sigterm_drain"] = {"short_request": "finished", "long_request": "abort", "late_request": 503,
                                "exit_status": 0, "exited_after_s": round(exited_after, 1)}
