"""Slow clients. A stream's client that stops reading costs nothing (issue 31): while the server's
writes wait for it, the engine's outputs merge into one pending output per request
(`tokenmill:server_pending_outputs` <= 1), a write that waits `--stream-send-timeout`
seconds aborts the request and drops the connection, and a client that resets its
connection instead has its request aborted at once; either way the KV cache is empty
after it. Before the fix every step queued a new cumulative output (memory grew as
n x max_tokens^2 and stayed after the client left). A client that drips its request
headers is closed after --header-timeout."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from tests.reliability.support import RESULTS, process_stats, start_server, wait_until
from tests.server_utils import http_request, raw_exchange

# The request (n=16, logprobs, streamed), with 20 logprobs (the most) so that
# each step writes more: loopback's socket buffers took 2.8 MB before the writes waited,
# ~400 steps with 5 logprobs, ~200 with 20 (60-80 s on the 2-core box).
BODY = {"prompt": "Tell me a very long story about the sea.", "n": 16, "max_tokens": 600, "logprobs": 20,
        "ignore_eos": True, "stream": True}
SEND_TIMEOUT = 5.0
HEADER_TIMEOUT = 2.0
ABORTED = 'tokenmill:request_success_total{finished_reason="abort"}'


@pytest.fixture(scope="module")
def server():
    process = start_server("--max-model-len", "1024", "--kv-cache-memory", "160MiB", "--max-num-seqs", "16",
                           "--stream-send-timeout", str(SEND_TIMEOUT), "--header-timeout", str(HEADER_TIMEOUT))
    yield process
    assert process.stop() == 0, process.log_tail()


def stalled_client(port: int) -> socket.socket:
    """A socket with a small receive buffer that sends the request and never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(http_request("POST", "/v1/completions", json.dumps(BODY).encode()))
    return sock


def watch(server, until, timeout: float) -> dict[str, float]:
    """Poll /metrics until `until(metrics)`; the largest pending-output count seen, the
    generated tokens, and the server's peak RSS meanwhile."""
    seen = {"pending": 0.0, "rss_peak": 0.0}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = server.metrics()
        seen["pending"] = max(seen["pending"], metrics["tokenmill:server_pending_outputs"])
        seen["rss_peak"] = max(seen["rss_peak"], process_stats(server.proc.pid)["rss"])
        seen["generated"] = metrics["tokenmill:generation_tokens_total"]
        if until(metrics):
            seen["done"] = 1.0
            return seen
        time.sleep(0.5)
    return seen


def idle(metrics: dict[str, float]) -> bool:
    return (metrics["tokenmill:num_requests_running"], metrics["tokenmill:num_requests_waiting"],
            metrics["tokenmill:kv_cache_usage_perc"]) == (0, 0, 0)


def test_a_client_that_never_reads_is_aborted_after_the_send_timeout(server):
    before = server.metrics()
    fds = process_stats(server.proc.pid)["fds"]
    rss = process_stats(server.proc.pid)["rss"]
    started = time.monotonic()
    sock = stalled_client(server.port)
    try:
        seen = watch(server, lambda m: m.get(ABORTED, 0) >= before.get(ABORTED, 0) + 16 and idle(m), 240)
        elapsed = time.monotonic() - started
        assert seen.get("done"), (seen, server.log_tail())
        # The merge: however many steps ran while the writes waited, one pending output.
        assert seen["pending"] <= 1, seen
        generated = seen["generated"] - before["tokenmill:generation_tokens_total"]
        assert generated < 16 * BODY["max_tokens"], "the request ran to its end: it was not aborted"
        assert "read nothing" in server.log_tail(20000)
        # The connection was reset: the megabytes queued for it are dropped, not delivered.
        sock.settimeout(10)
        received = 0
        try:
            while chunk := sock.recv(65536):
                received += len(chunk)
        except ConnectionResetError:
            reset = True
        else:
            reset = False
        assert reset and received < 2**20, (reset, received)
    finally:
        sock.close()
    assert wait_until(lambda: process_stats(server.proc.pid)["fds"] <= fds, 10), (fds, process_stats(server.proc.pid))
    RESULTS["stalled_reader_send_timeout"] = {
        "aborted_after_s": round(elapsed, 1), "send_timeout_s": SEND_TIMEOUT, "generated_tokens": generated,
        "max_pending_outputs": seen["pending"], "rss_growth_mb": round((seen["rss_peak"] - rss) / 2**20, 1),
        "bytes_the_client_could_still_read": received,
    }


def test_a_stalled_client_that_resets_is_aborted_at_once(server):
    before = server.metrics()
    sock = stalled_client(server.port)
    # Let the writes stall: generation well past what the socket buffers hold.
    wait_until(lambda: server.metrics()["tokenmill:generation_tokens_total"]
               >= before["tokenmill:generation_tokens_total"] + 16 * 8, 120, interval=0.5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # RST
    cut = time.monotonic()
    seen = watch(server, lambda m: m.get(ABORTED, 0) >= before.get(ABORTED, 0) + 16 and idle(m), 60)
    assert seen.get("done"), (seen, server.log_tail())
    assert seen["pending"] <= 1, seen
    elapsed = time.monotonic() - cut
    RESULTS["stalled_reader_reset"] = {"idle_after_reset_s": round(elapsed, 2)}


def test_drip_fed_headers_are_closed_after_the_header_timeout(server):
    """A connection whose request headers never complete used to be held forever (500 of
    them: 8 -> 507 descriptors). With --header-timeout 2 each is closed ~2 s after it
    opened, dripping or silent, first request or a later one on a kept-alive connection."""
    fds = process_stats(server.proc.pid)["fds"]
    started = time.monotonic()
    dripping = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    kept_alive = socket.create_connection(("127.0.0.1", server.port))
    status, _, _ = raw_exchange(kept_alive, http_request("GET", "/health"))
    assert status == 200
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next request, never finished
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Drip: "
    for sock in dripping:
        sock.sendall(head)
    closed_after = {}
    while len(closed_after) < 9 and time.monotonic() - started < 20:
        for index, sock in enumerate(dripping + silent + [kept_alive]):
            if index in closed_after:
                continue
            if index < 4:
                try:
                    sock.sendall(b"a")  # a byte every 0.25 s: never idle, never done
                except OSError:
                    closed_after[index] = time.monotonic() - started
                    continue
            sock.setblocking(False)
            try:
                if sock.recv(65536) == b"":
                    closed_after[index] = time.monotonic() - started
            except BlockingIOError:
                pass
            except OSError:
                closed_after[index] = time.monotonic() - started
        time.sleep(0.25)
    for sock in dripping + silent + [kept_alive]:
        sock.close()
    assert len(closed_after) == 9, closed_after
    assert all(1.5 < after < HEADER_TIMEOUT + 4 for after in closed_after.values()), closed_after
    assert wait_until(lambda: process_stats(server.proc.pid)["fds"] <= fds, 10)
    RESULTS["header_timeout"] = {"header_timeout_s": HEADER_TIMEOUT,
                                 "closed_after_s": sorted(round(v, 1) for v in closed_after.values())}
