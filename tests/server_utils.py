"""A real `tokenmill serve` subprocess for the server tests, and helpers to talk to it.

Loading the model takes ~20-30 s, so each test module shares one server
(module-scoped fixture) and keeps generations short.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# Small limits keep the KV cache and every request cheap on a 2-core CPU. One torch
# thread: the test client needs the other core, and two OpenMP threads on a busy
# 2-core machine made steps 5-10x slower (spinning threads time-sliced against
# each other), where one thread keeps a 32-sequence decode step near 0.5 s.
BASE_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
             "--num-threads", "1", "--disable-access-log"]
STARTUP_TIMEOUT = 240.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m tokenmill.cli serve ...` on a free loopback port."""

    def __init__(self, *args: str, api_key: str | None = None, env: dict[str, str] | None = None,
                 base_args: list[str] | None = None) -> None:
        self.args = list(args)
        self.api_key = api_key
        self.env = dict(env or {})
        self.base_args = BASE_ARGS if base_args is None else base_args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="tokenmill-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None
        self.saw_loading_503 = False  # /health answered 503 "loading" while the model loaded
        self.model = ""

    # ----- lifecycle ---------------------------------------------------------------------

    def start(self) -> ServerProcess:
        command = [sys.executable, "-m", "tokenmill.cli", "serve", *self.base_args, "--port", str(self.port),
                   *self.args]
        if self.api_key:
            command += ["--api-key", self.api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("TOKENMILL_API_KEY", None)
        env.pop("TOKENMILL_FAULT_INJECTION", None)
        env.update(self.env)
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()
        self.model = self.get("/v1/models").json()["data"][0]["id"]
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(self.url + "/health", headers=self.headers, timeout=5)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if response.status_code == 200:
                return
            if response.status_code == 503 and "loading" in response.text:
                self.saw_loading_503 = True
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server was not healthy after {STARTUP_TIMEOUT} s:\n{self.log_tail()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    # ----- requests ----------------------------------------------------------------------

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, headers={**self.headers, **kwargs.pop("headers", {})},
                         timeout=kwargs.pop("timeout", 120), **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, headers={**self.headers, **kwargs.pop("headers", {})},
                          timeout=kwargs.pop("timeout", 300), **kwargs)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until nothing runs or waits and the KV cache is empty; the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = (metrics["tokenmill:num_requests_running"], metrics["tokenmill:num_requests_waiting"],
                    metrics["tokenmill:kv_cache_usage_perc"]) == (0, 0, 0)
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.1)


def vllm_router(*args: str) -> list[str]:
    """The real vllm-router's command line with `args`, its Prometheus exporter on a port of
    its own (its default, 29000, is taken by any other router running on the machine)."""
    import shutil

    import pytest

    path = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(path).exists():
        pytest.fail("vllm-router is not installed: pip install 'tokenmill[router]'")
    return [path, *args, "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1"]


def raw_exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one HTTP/1.1 request on an open socket and read one response (Content-Length
    framed): (status, lower-cased headers, body). The socket stays open for the next."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection; got {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-body")
        body += chunk
    return int(status_line.split()[1]), headers, body


def http_request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels but model_name}: value}:
    `tokenmill:request_success_total{finished_reason="length"}`, `tokenmill:num_requests_running`.
    A data-parallel router's /metrics holds each replica's samples with a `replica` label:
    those are summed over the replicas (the router's own `tokenmill:router_*` keep it), so
    that a test reads the same keys from the single server and from the router."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("tokenmill:"):
            continue
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})? (\S+)$", line)
        if not match:
            continue
        name, labels, value = match.groups()
        dropped = ("model_name=",) if name.startswith("tokenmill:router_") else ("model_name=", "replica=")
        kept = [label for label in re.findall(r'(\w+="[^"]*")', labels or "") if not label.startswith(dropped)]
        key = f"{name}{{{','.join(kept)}}}" if kept else name
        values[key] = values.get(key, 0.0) + float(value) if "replica=" in (labels or "") else float(value)
    return values


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    payloads = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        assert "\n" not in block, block  # one line per event
        payloads.append(block[len("data: "):])
    return payloads


def sse_json(raw: str) -> list[dict]:
    payloads = sse_events(raw)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """An OpenAI-shaped error body with the given status."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
