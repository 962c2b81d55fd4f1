"""Hundreds of streams cut at random points, three ways: the client closes the
connection, resets it (RST), or is killed. Within 2 s nothing runs or waits and the KV
cache is empty; the server's file descriptors and asyncio tasks return to where they
were."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

from tests.reliability.support import RESULTS, long_run, process_stats, wait_until
from tests.server_utils import http_request

BODY = {"prompt": "Tell me a very long story about the sea.", "max_tokens": 200, "ignore_eos": True, "stream": True}


async def cut_stream(port: int, events: int, reset: bool) -> str:
    """Open a stream, read `events` SSE events (0: not even the headers), then close or
    reset the connection. Returns how it went: "cut", "429" or "finished"."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_request("POST", "/v1/completions", json.dumps(BODY).encode()))
    await writer.drain()
    outcome = "cut"
    try:
        if events:
            status_line = await asyncio.wait_for(reader.readline(), 120)
            if b" 200 " not in status_line:
                return status_line.split()[1].decode()
            seen = 0
            while seen < events:
                line = await asyncio.wait_for(reader.readline(), 120)
                if not line or b"[DONE]" in line:
                    outcome = "finished"
                    break
                seen += line.startswith(b"data: ")
    finally:
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()
    return outcome


KILLED_CLIENT = textwrap.dedent("""
    import socket, sys, time
    port, count, request = int(sys.argv[1]), int(sys.argv[2]), sys.stdin.buffer.read()
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(request)
        socks.append(s)
    for s in socks[:2]:
        s.recv(1)  # at least one stream is under way
    print("ready", flush=True)
    time.sleep(600)
""")


def killed_client(port: int, count: int) -> None:
    """A client process with `count` open streams, killed with SIGKILL mid-stream."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, str(port), str(count)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(http_request("POST", "/v1/completions", json.dumps(BODY).encode()))
    proc.stdin.close()
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(random.uniform(0.1, 1.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def server_tasks(server) -> float:
    return server.metrics()["tokenmill:server_asyncio_tasks"]


def test_abort_storm_leaves_nothing_behind(rserver, request):
    total = 1000 if long_run(request.config) else 240
    rng = random.Random(1)
    random.seed(2)
    pid = rserver.proc.pid
    rserver.wait_idle()
    baseline = process_stats(pid)
    baseline_tasks = server_tasks(rserver)
    before = rserver.metrics()
    outcomes: dict[str, int] = {}

    async def wave(size: int) -> list[str]:
        return await asyncio.gather(*(cut_stream(rserver.port, rng.randint(0, 6), rng.random() < 0.5)
                                      for _ in range(size)))

    done = 0
    started = time.monotonic()
    while done < total:
        size = min(20, total - done)
        for outcome in asyncio.run(wave(size)):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        killed_client(rserver.port, 6)
        outcomes["killed"] = outcomes.get("killed", 0) + 6
        done += size + 6
    storm_seconds = time.monotonic() - started

    cut_at = time.monotonic()
    idle = wait_until(lambda: (lambda m: (m["tokenmill:num_requests_running"], m["tokenmill:num_requests_waiting"],
                                          m["tokenmill:kv_cache_usage_perc"]) == (0, 0, 0))(rserver.metrics()), 2.0)
    settle = time.monotonic() - cut_at
    assert idle, rserver.metrics()
    assert wait_until(lambda: process_stats(pid)["fds"] <= baseline["fds"], 5.0), (process_stats(pid), baseline)
    assert wait_until(lambda: server_tasks(rserver) <= baseline_tasks, 5.0), (server_tasks(rserver), baseline_tasks)
    after = rserver.metrics()
    aborted = after['tokenmill:request_success_total{finished_reason="abort"}'] - \
        before.get('tokenmill:request_success_total{finished_reason="abort"}', 0)
    assert outcomes.get("cut", 0) + outcomes["killed"] >= aborted > 0
    RESULTS["abort_storm"] = {"streams": done, "outcomes": outcomes, "aborted_by_server": aborted,
                              "storm_seconds": round(storm_seconds, 1), "idle_after_s": round(settle, 2),
                              "fds": [baseline["fds"], process_stats(pid)["fds"]],
                              "tasks": [baseline_tasks, server_tasks(rserver)]}
