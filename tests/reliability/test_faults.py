"""Engine faults, injected with TOKENMILL_FAULT_INJECTION (tokenmill/serve/faults.py):
a model step that raises, and an engine loop that blocks.

- raise: in-flight requests get an error (a stream: an error event, then [DONE]; a
  plain request: 503), and the process exits with status 1 on its own, leaving no
  process behind; with --keep-alive-on-engine-death it stays up, /health says 503 at
  once and new requests get 503.
- hang: /health turns 503 once no step has ended for --health-stall-timeout, new
  requests get 503; SIGTERM starts a drain that cannot finish, and a second SIGTERM
  exits at once (status 128 + 15).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx

from tests.reliability.support import RESULTS, alive, descendants, start_server, wait_until
from tests.server_utils import assert_error, sse_events

LONG = {"prompt": "Write a long poem about rivers.", "max_tokens": 200, "ignore_eos": True}
FAULTS: dict[str, object] = RESULTS.setdefault("faults", {})  # type: ignore[assignment]


# The Responses API's stream, in flight too (greedy: 200 tokens, past the fault's step)
LONG_RESPONSE = {"input": LONG["prompt"], "max_output_tokens": 200, "temperature": 0, "stream": True}


async def _in_flight(url: str) -> tuple[list[str], list[httpx.Response], str]:
    """Two streams, two plain requests and a Responses stream, running when the fault comes."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def stream(path: str = "/v1/completions", body: dict | None = None) -> str:
            async with client.stream("POST", url + path, json=body or {**LONG, "stream": True}) as response:
                assert response.status_code == 200
                return "".join([chunk async for chunk in response.aiter_text()])

        async def plain() -> httpx.Response:
            return await client.post(url + "/v1/completions", json=LONG)

        results = await asyncio.gather(stream(), stream(), plain(), plain(), stream("/v1/responses", LONG_RESPONSE))
    return list(results[:2]), list(results[2:4]), results[4]


def _check_failed_in_flight(streams: list[str], plain: list[httpx.Response], responses_stream: str) -> None:
    for raw in streams:
        payloads = sse_events(raw)  # framing checked, ends with [DONE]
        error = json.loads(payloads[-2])["error"]
        assert error["code"] == "engine_unavailable" and "the engine failed (InjectedFault)" in error["message"]
        assert "Traceback" not in raw and "/" not in error["message"]
    for response in plain:
        assert assert_error(response, 503)["code"] == "engine_unavailable"
    # OpenAI's error event: named `error`, its payload's type "error" (it was the error's
    # type, "service_unavailable", written over it), then the stream ends
    assert responses_stream.endswith("\n\n"), responses_stream[-200:]
    name, data = responses_stream[:-2].rsplit("\n\n", 1)[-1].split("\n")
    event = json.loads(data.removeprefix("data: "))
    assert name == "event: error" and set(event) == {"type", "sequence_number", "code", "message", "param"}, event
    assert event["type"] == "error" and event["code"] == "engine_unavailable", event
    assert "the engine failed (InjectedFault)" in event["message"]


def test_a_step_that_raises_fails_in_flight_requests_and_the_process_exits_1():
    server = start_server(env={"TOKENMILL_FAULT_INJECTION": "raise_after_steps=40"})
    children_before = descendants(server.proc.pid)
    started = time.monotonic()
    streams, plain, responses_stream = asyncio.run(_in_flight(server.url))
    _check_failed_in_flight(streams, plain, responses_stream)
    assert server.proc.wait(30) == 1, server.log_tail()
    exited_after = time.monotonic() - started
    assert not [pid for pid in children_before | descendants(server.proc.pid) if alive(pid)]
    assert "InjectedFault" in server.log_tail(20000)
    FAULTS["raise"] = {"in_flight_failed_cleanly": len(streams) + len(plain) + 1, "exit_status": 1,
                       "exited_within_s": round(exited_after, 1)}


def test_with_keep_alive_on_engine_death_the_server_stays_up_and_unhealthy():
    server = start_server("--keep-alive-on-engine-death", env={"TOKENMILL_FAULT_INJECTION": "raise_after_steps=40"})
    try:
        streams, plain, responses_stream = asyncio.run(_in_flight(server.url))
        _check_failed_in_flight(streams, plain, responses_stream)
        health = httpx.get(server.url + "/health", timeout=5)
        assert "died" in assert_error(health, 503)["message"]
        assert_error(server.post("/v1/completions", json={"prompt": "hi"}), 503)
        time.sleep(2)
        assert server.alive
    finally:
        status = server.stop()
    assert status == 1  # stopped, but the engine had died: not a clean exit
    FAULTS["raise_keep_alive"] = {"health": 503, "new_requests": 503, "exit_status_on_sigterm": status}


def test_a_stuck_loop_makes_health_fail_and_a_second_signal_exits_at_once():
    server = start_server("--health-stall-timeout", "2", "--shutdown-timeout", "60",
                          env={"TOKENMILL_FAULT_INJECTION": "hang_after_steps=20"})
    try:
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)
            hung_at = time.monotonic()
            assert wait_until(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503, 10, 0.2)
            unhealthy_after = time.monotonic() - hung_at
            assert "no step" in httpx.get(server.url + "/health", timeout=5).json()["error"]["message"]
            assert "unhealthy" in assert_error(server.post("/v1/completions", json={"prompt": "hi"}), 503)["message"]
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert server.alive  # draining: the stuck request holds it (shutdown timeout 60 s)
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            status = server.proc.wait(10)
            exit_seconds = time.monotonic() - signalled
    finally:
        if server.alive:
            server.proc.kill()
    assert status == 128 + signal.SIGTERM, server.log_tail()
    assert exit_seconds < 3
    assert not [pid for pid in descendants(server.proc.pid) if alive(pid)]
    FAULTS["hang"] = {"health_503_after_s": round(unhealthy_after, 1), "second_signal_exit_s": round(exit_seconds, 2),
                      "exit_status": status}
