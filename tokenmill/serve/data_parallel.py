"""`tokenmill serve --data-parallel-size N`: N engine replicas behind one API port.

Each replica is a whole `tokenmill serve` (its own process, engine, KV cache and
threads: the host's threads divided among them) on a loopback port; this process is the
router in front of them, the role vllm-router or SGLang's router plays for separate
servers. It forwards each generation request to the replica `routing.py` picks
(prefix-aware by default) and every other route to the first healthy replica, streaming
the replica's bytes back as they come; a client that disconnects closes the upstream
request, and the replica aborts it. It checks the replicas' /health every second, takes
a failed one out of rotation and retries a request that could not be sent on another
replica. /health is 200 while at least one replica is healthy; the server exits
non-zero once none is. /metrics holds the router's own counters and every replica's
metrics with a `replica` label.

The router keeps the single server's contract (docs/reliability.md): the same middleware
stack (`api_server.add_contract_middlewares`: the API key and the body limit checked
before the body is read, the 500 guard, CORS), the same header timeout and stream send
timeout, the replicas' answers passed through with their headers (Retry-After,
Connection: close, WWW-Authenticate), and a stream whose replica fails mid-way ends with
an OpenAI error event and `data: [DONE]`, as the single server's does when its engine
dies. The replicas keep the API key (their loopback ports are reachable by any local
user): the router sends it on everything it asks them, health checks included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

# At module level: FastAPI resolves the handlers' annotations in this module's globals.
from fastapi import Request

logger = logging.getLogger("tokenmill.serve.dp")

# One replica's server: settings in, exit status out (`serve.cli.serve`; a module-level
# function, so a spawned replica process receives it by name).
ServeFn = Callable[[argparse.Namespace], int]

HEALTH_INTERVAL_S = 1.0
# Request headers that describe the client's connection to the router (or its key: the
# router sends its own Authorization); every other one reaches the replica (content type,
# X-Request-Id, llm-d's x-slo-ttft-ms...).
NOT_FORWARDED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                           "te", "trailer", "expect", "authorization", "proxy-authorization"})
# Response headers that describe the router's connection to the replica, not the answer:
# uvicorn writes its own. Everything else (Retry-After, WWW-Authenticate, Connection:
# close, X-Request-Id...) reaches the client.
NOT_PASSED = frozenset({"content-length", "transfer-encoding", "keep-alive", "server", "date"})
PARSE_OFF_LOOP_BYTES = 64 * 1024  # bigger bodies are parsed in a thread (the loop serves the others)
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@dataclass
class Replica:
    index: int
    url: str
    process: multiprocessing.Process
    healthy: bool = False
    load: int = 0  # requests in flight through the router
    routed: int = 0
    failures: int = 0
    kv_events_endpoint: str | None = None  # where it publishes its KV events (None: it does not)


@dataclass
class RouterStats:
    requests: int = 0
    matched_blocks: int = 0
    prompt_blocks: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _replica_main(serve: ServeFn, settings: argparse.Namespace) -> None:
    # Its own process group: a terminal's Ctrl-C reaches the router only, which drains
    # the replicas with one SIGTERM each (a second signal would make a replica exit at
    # once, mid-drain).
    os.setsid()
    _exit_with_parent(os.getppid())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s dp%(process)d %(name)s: %(message)s")
    sys.exit(serve(settings))


def _exit_with_parent(parent: int) -> None:
    """SIGTERM this replica (a drain) once the router is gone, killed or crashed: a
    replica without its router serves nobody and holds a model's memory."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tokenmill-dp-parent-watch", daemon=True).start()


def replica_settings(settings: argparse.Namespace, port: int, threads: int, index: int = 0) -> argparse.Namespace:
    """A replica's flags: the router's, on a loopback port, plain HTTP (TLS and CORS end
    at the router), its share of the threads, its own KV-event endpoint."""
    return argparse.Namespace(**{**vars(settings), "host": "127.0.0.1", "port": port, "num_threads": threads,
                                 "data_parallel_size": 1, "ssl_keyfile": None, "ssl_certfile": None,
                                 "ssl_ca_certs": None, "allowed_origins": None,
                                 "kv_events_config": replica_kv_events(settings, index)})


def replica_kv_events(settings: argparse.Namespace, index: int):
    """A replica's --kv-events-config: the operator's with vLLM's per-rank endpoints (a TCP
    port plus the replica's index), or, for the kv_aware policy without one, an ipc socket
    of the router's own (local to this host, never a network port)."""
    from tokenmill.config import KVEventsConfig, parse_kv_events_config
    from tokenmill.kv_events.subscriber import offset_endpoint

    config = parse_kv_events_config(getattr(settings, "kv_events_config", None))
    if config is not None and config.publishes:
        replay = config.replay_endpoint and offset_endpoint(config.replay_endpoint, index)
        return dataclasses.replace(config, endpoint=offset_endpoint(config.endpoint, index), replay_endpoint=replay)
    if getattr(settings, "data_parallel_policy", None) == "kv_aware":
        return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{_events_dir()}/kv-events-{index}")
    return config


_EVENTS_DIR: str | None = None


def _events_dir() -> str:
    global _EVENTS_DIR
    if _EVENTS_DIR is None:
        import tempfile

        _EVENTS_DIR = tempfile.mkdtemp(prefix="tokenmill-dp-")
    return _EVENTS_DIR


def start_replicas(settings: argparse.Namespace, count: int, serve: ServeFn) -> list[Replica]:
    from tokenmill.hardware import cpu_info

    context = multiprocessing.get_context("spawn")
    threads = max(1, (settings.num_threads or cpu_info().num_cores) // count)
    replicas = []
    for index in range(count):
        port = _free_port()
        own = replica_settings(settings, port, threads, index)
        process = context.Process(target=_replica_main, args=(serve, own), name=f"tokenmill-dp{index}")
        process.start()
        events = own.kv_events_config.endpoint if own.kv_events_config is not None and \
            own.kv_events_config.publishes else None
        replicas.append(Replica(index, f"http://127.0.0.1:{port}", process, kv_events_endpoint=events))
    return replicas


class RouterMetrics:
    """The router's own HTTP answers (the replicas count theirs as
    tokenmill:http_requests_total, with a `replica` label in the router's /metrics)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "tokenmill:router_http_requests", "HTTP requests the router answered, by method, route and status code.",
            ["method", "handler", "status"], registry=self.registry)

    def observe_http(self, method: str, handler: str, status: int) -> None:
        # The catch-all route's pattern would say nothing: those are proxied to a replica.
        self.http_requests.labels(method, "proxied" if handler == "/{path:path}" else handler, str(status)).inc()

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class Router:
    def __init__(self, replicas: list[Replica], policy_name: str, api_key: str | None = None,
                 send_timeout: float = 60.0, block_size: int = 16, tokenizer=None) -> None:
        """`tokenizer`: the model's, for a policy that hashes token ids (kv_aware)."""
        from tokenmill.serve.routing import make_policy

        self.replicas = replicas
        self.policy = make_policy(policy_name, len(replicas), block_size)
        self.tokenizer = tokenizer
        self.subscriber = None  # the replicas' KV events, for kv_aware
        self.api_key = api_key
        self.send_timeout = send_timeout  # --stream-send-timeout, for the relayed streams
        self.stats = RouterStats()
        self.http = RouterMetrics()
        self.ready = False  # every replica answered /health once
        self.draining = False  # SIGTERM: new requests get 503 while the replicas drain
        self.client = None
        self.fatal: str | None = None

    @property
    def upstream_headers(self) -> dict[str, str]:
        """What the router sends on every request to a replica: the replicas hold the
        same API key as the router (their ports are reachable by any local user)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ----- health ---------------------------------------------------------------------

    async def watch(self, on_all_dead) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=2.0, headers=self.upstream_headers) as probe:
            while not self.draining:
                for replica in self.replicas:
                    await self._probe(probe, replica)
                if self.draining:  # replicas going down during a drain are expected
                    return
                if not self.ready and all(r.healthy for r in self.replicas):
                    self.ready = True
                    logger.info("all %d replicas are ready", len(self.replicas))
                if self.ready and not any(r.healthy for r in self.replicas):
                    self.fatal = "every data-parallel replica has failed"
                    on_all_dead()
                    return
                if not self.ready and not any(r.process.is_alive() for r in self.replicas):
                    self.fatal = "the data-parallel replicas failed to start"
                    on_all_dead()
                    return
                await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _probe(self, probe, replica: Replica) -> None:
        alive = replica.process.is_alive()
        ok = False
        reason = "its process died"
        if alive:
            try:
                response = await probe.get(replica.url + "/health")
                ok = response.status_code == 200
                reason = f"its /health answered {response.status_code}"
            except Exception as exc:  # noqa: BLE001 - any failure to answer is unhealthy
                reason = f"its /health did not answer ({type(exc).__name__})"
        if replica.healthy and not ok:
            logger.error("replica %d (%s) is out of rotation: %s", replica.index, replica.url, reason)
        elif ok and not replica.healthy and self.ready:
            logger.info("replica %d (%s) is back in rotation", replica.index, replica.url)
        elif not ok and not self.ready and not alive and replica.failures == 0:
            replica.failures += 1
            logger.error("replica %d (%s) exited while starting (status %s)", replica.index, replica.url,
                         replica.process.exitcode)
        replica.healthy = ok

    def health(self) -> tuple[bool, str]:
        if self.fatal:
            return False, self.fatal
        if self.draining:
            return False, "the server is shutting down"
        if not self.ready:
            return False, "the replicas are loading"
        healthy = sum(r.healthy for r in self.replicas)
        return (healthy > 0), f"{healthy} of {len(self.replicas)} replicas healthy"

    async def drain(self, timeout: float) -> bool:
        """SIGTERM's first half for the whole server: new requests get 503 from the router,
        each replica drains its own requests (they finish, or end `abort` + `[DONE]` at
        its --shutdown-timeout) and exits; the streams relayed meanwhile end with them.
        False when a replica did not exit cleanly."""
        self.draining = True
        for replica in self.replicas:
            if replica.process.is_alive():
                replica.process.terminate()
        deadline = time.monotonic() + timeout + 5.0
        while any(r.process.is_alive() for r in self.replicas) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        while any(r.load for r in self.replicas) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the relays write their last bytes
        return all(r.process.exitcode == 0 for r in self.replicas)

    # ----- forwarding -------------------------------------------------------------------

    def subscribe_kv_events(self, topic: str = "", layout: str = "map") -> None:
        """kv_aware: follow each replica's KV events into the policy's indexes."""
        from tokenmill.kv_events.subscriber import KVEventSubscriber

        endpoints = [r.kv_events_endpoint for r in self.replicas]
        if not getattr(self.policy, "needs_tokens", False) or None in endpoints:
            return
        self.subscriber = KVEventSubscriber(endpoints, self.policy.on_batch, topic, layout).start()

    async def route_key(self, path: str, body: Any):
        """What the policy matches: the prompt's characters or ids (cache_aware), or its
        token ids as the engine will see them (kv_aware: tokenized off the event loop)."""
        from tokenmill.serve.routing import prompt_key

        if not isinstance(body, dict):
            return None if getattr(self.policy, "needs_tokens", False) else ""
        if getattr(self.policy, "needs_tokens", False):
            return await asyncio.to_thread(self.prompt_tokens, path, body)
        try:
            return prompt_key(path, body)
        except (TypeError, ValueError):  # a body the replica will refuse with a 400
            return ""

    def prompt_tokens(self, path: str, body: dict[str, Any]):
        """The token ids the replica's engine will hash for this body, or None when the
        router cannot tell (no tokenizer, a body the replica will refuse, tools or a chat
        template of the request's own: routed by load)."""
        from tokenmill.serve.routing import PromptTokens

        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        try:
            if path.endswith("/chat/completions"):
                messages = body.get("messages")
                if not isinstance(messages, list) or body.get("tools") or body.get("chat_template"):
                    return None
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.get(
                    "add_generation_prompt", True) is not False)
                return PromptTokens(tokenizer.encode(text, add_special_tokens=False), salt)
            prompt = body.get("input" if path.endswith("/embeddings") else "prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch of prompts: route by the first
            if isinstance(prompt, str):
                return PromptTokens(tokenizer.encode(prompt) if prompt else [], salt)
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return PromptTokens(list(prompt), salt)
        except Exception:  # noqa: BLE001 - a body the replica will refuse (with its own error)
            return None
        return None

    def choose(self, key: Any) -> Replica:
        choice = self.policy.choose(key, [r.load for r in self.replicas], [r.healthy for r in self.replicas])
        stats = self.stats
        stats.requests += 1
        stats.matched_blocks += choice.matched_blocks
        stats.prompt_blocks += choice.total_blocks
        stats.reasons[choice.reason] = stats.reasons.get(choice.reason, 0) + 1
        return self.replicas[choice.replica]

    async def forward(self, request: Request, path: str):
        """A generation request: to the replica the policy picks (the body is within the
        limit: the middleware refused a bigger one before it was read)."""
        if self.draining:
            return _unavailable("the server is shutting down")
        raw = await request.body()
        body = await _parse(raw)
        key = await self.route_key(path, body)
        tried: set[int] = set()

        def pick() -> Replica | None:
            try:
                replica = self.choose(key)
            except LookupError:
                return None
            if replica.index in tried:  # the policy insists on one that just failed
                candidates = [r for r in self.replicas if r.healthy and r.index not in tried]
                return min(candidates, key=lambda r: r.load) if candidates else None
            return replica

        return await self._send(request, path, raw, pick, tried, generation=True)

    async def proxy(self, request: Request):
        """Any other route (models, tokenizer, responses, the dashboard, the OpenAPI
        schema, unknown paths): to the first healthy replica, so that state kept by one
        replica (stored responses) is found on the next request while it stays healthy."""
        if self.draining:
            return _unavailable("the server is shutting down")
        raw = await request.body()
        tried: set[int] = set()

        def pick() -> Replica | None:
            return next((r for r in self.replicas if r.healthy and r.index not in tried), None)

        return await self._send(request, upstream_target(request), raw, pick, tried, generation=False)

    async def _send(self, request: Request, path: str, raw: bytes, pick: Callable[[], Replica | None],
                    tried: set[int], generation: bool):
        import httpx

        headers = {**{k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED},
                   **self.upstream_headers}
        while True:
            replica = pick()
            if replica is None:
                return _unavailable("no healthy data-parallel replica")
            tried.add(replica.index)
            upstream_request = self.client.build_request(request.method, replica.url + path, content=raw,
                                                         headers=headers)
            replica.load += 1
            try:
                upstream = await self.client.send(upstream_request, stream=True)
            except httpx.TransportError as exc:
                replica.load -= 1
                replica.failures += 1
                # Out of rotation only when it cannot take connections (the health check
                # brings it back); a replica that merely broke this request stays in.
                if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) or not replica.process.is_alive():
                    replica.healthy = False
                    logger.error("replica %d did not take a request (%s): out of rotation, trying another",
                                 replica.index, type(exc).__name__)
                    continue
                logger.error("replica %d failed a request (%s)", replica.index, type(exc).__name__)
                return _unavailable("the data-parallel replica failed while taking the request")
            replica.routed += generation  # tokenmill:router_requests_total counts generation requests
            return await self._answer(upstream, replica)

    async def _answer(self, upstream, replica: Replica):
        import httpx
        from fastapi.responses import Response

        from tokenmill.serve.serving import SSEResponse

        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in NOT_PASSED}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            responses = upstream.request.url.path.startswith("/v1/responses")
            return SSEResponse(self._relay(upstream, replica, responses), self.send_timeout, upstream.status_code,
                               headers)
        try:
            content = b"".join([chunk async for chunk in upstream.aiter_raw()])
        except httpx.TransportError as exc:
            logger.error("replica %d failed while answering (%s)", replica.index, type(exc).__name__)
            return _unavailable("the data-parallel replica failed while answering")
        finally:
            replica.load -= 1
            await upstream.aclose()
        return Response(content=content, status_code=upstream.status_code, headers=headers)

    async def _relay(self, upstream, replica: Replica, responses: bool = False) -> AsyncIterator[bytes]:
        """A replica's SSE stream, passed on whole events at a time, so that a replica that
        fails mid-stream leaves no half event: its stream then ends as the single server's
        does when its engine dies, with an error event and `data: [DONE]` (a Responses API
        stream: an `error` event numbered after the events relayed, and no `[DONE]`)."""
        import httpx

        pending = b""
        events = 0
        try:
            async for chunk in upstream.aiter_raw():
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    events += pending.count(b"\n\n", 0, end + 2)
                    yield pending[:end + 2]
                    pending = pending[end + 2:]
            if pending:
                yield pending
        except httpx.TransportError as exc:
            logger.error("replica %d failed mid-stream (%s): the stream ends with an error event",
                         replica.index, type(exc).__name__)
            yield _stream_error("the data-parallel replica serving this stream failed",
                                sequence_number=events if responses else None)
        finally:  # also when the client went away: closing aborts the replica's request
            replica.load -= 1
            await upstream.aclose()

    async def metrics(self) -> str:
        lines = [
            "# HELP tokenmill:router_requests_total Generation requests routed, by replica.",
            "# TYPE tokenmill:router_requests_total counter",
            *(f'tokenmill:router_requests_total{{replica="{r.index}"}} {r.routed}' for r in self.replicas),
            "# HELP tokenmill:router_replica_healthy 1 while the replica is in rotation.",
            "# TYPE tokenmill:router_replica_healthy gauge",
            *(f'tokenmill:router_replica_healthy{{replica="{r.index}"}} {int(r.healthy)}' for r in self.replicas),
            "# HELP tokenmill:router_prefix_matched_blocks_total Prompt blocks the chosen replica had seen.",
            "# TYPE tokenmill:router_prefix_matched_blocks_total counter",
            f"tokenmill:router_prefix_matched_blocks_total {self.stats.matched_blocks}",
            "# HELP tokenmill:router_prompt_blocks_total Prompt blocks routed.",
            "# TYPE tokenmill:router_prompt_blocks_total counter",
            f"tokenmill:router_prompt_blocks_total {self.stats.prompt_blocks}",
        ]
        sources: list[tuple[str, str | None]] = [("\n".join(lines), None), (self.http.render(), None)]

        async def scrape(replica: Replica) -> str | None:
            try:
                response = await self.client.get(replica.url + "/metrics", headers=self.upstream_headers,
                                                  timeout=10.0)
            except Exception:  # noqa: BLE001 - a dead replica has no metrics
                return None
            return response.text if response.status_code == 200 else None

        texts = await asyncio.gather(*(scrape(r) for r in self.replicas))
        sources += [(text, f'replica="{r.index}"') for r, text in zip(self.replicas, texts) if text is not None]
        return merge_metrics(sources)


async def _parse(raw: bytes) -> Any:
    """The body's JSON for routing (None if it is not JSON, or nested too deep for Python's
    parser, a RecursionError that was a 500: the replica answers the 400)."""

    def parse() -> Any:
        try:
            return json.loads(raw or b"{}")
        except (ValueError, RecursionError):
            return None

    return await asyncio.to_thread(parse) if len(raw) > PARSE_OFF_LOOP_BYTES else parse()


def upstream_target(request: Request) -> str:
    """The path and query to send a replica: as the client sent them, still percent-encoded
    (the decoded path may hold control characters, `%08`, that no URL can carry: httpx
    refuses to build the request, which was a 500 where the replica answers 404), any byte
    the client left unencoded encoded now."""
    raw_path = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string") or b""
    target = quote(raw_path, safe="/%:@!$&'()*+,;=~")
    return target + ("?" + quote(query, safe="/%:@!$&'()*+,;=~?") if query else "")


def merge_metrics(sources: list[tuple[str, str | None]]) -> str:
    """Prometheus texts as one exposition: `label` (e.g. `replica="0"`) added to every
    sample of its source, each family's samples together under one HELP and one TYPE
    line (the text format wants a family's samples in one group)."""
    families: dict[str, tuple[dict[str, str], list[str]]] = {}
    for text, label in sources:
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    families.setdefault(family, ({}, []))[0].setdefault(parts[1], line)
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if family is None or not name.startswith(family):  # a sample without metadata
                family = name
            families.setdefault(family, ({}, []))[1].append(_with_label(line, label) if label else line)
    out = []
    for meta, samples in families.values():
        out += [meta[kind] for kind in ("HELP", "TYPE") if kind in meta] + samples
    return "\n".join(out) + "\n"


def _with_label(sample: str, label: str) -> str:
    name, _, rest = sample.partition(" ")
    if "{" not in name:
        return f"{name}{{{label}}} {rest}"
    metric, _, labels = name.partition("{")
    return f"{metric}{{{label},{labels} {rest}" if labels != "}" else f"{metric}{{{label}}} {rest}"


def _unavailable(message: str):
    from tokenmill.serve.errors import error_response

    return error_response(503, message, code="engine_unavailable", headers={"Connection": "close"})


def _stream_error(message: str, sequence_number: int | None = None) -> bytes:
    """The single server's last events when its engine dies: an ErrorResponse and `[DONE]`;
    with `sequence_number`, the Responses API's `error` event (what serve/responses.py sends)."""
    from tokenmill.serve.errors import error_body

    error = error_body(503, message, code="engine_unavailable")
    if sequence_number is not None:
        event = {"type": "error", "sequence_number": sequence_number, "code": error["error"]["code"],
                 "message": error["error"]["message"], "param": None}
        return f"event: error\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
    return f"data: {json.dumps(error, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()


def create_router_app(router: Router, settings: argparse.Namespace, on_all_dead):
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    from tokenmill import __version__
    from tokenmill.serve.api_server import CORSSettings, ServerSettings, add_contract_middlewares
    from tokenmill.serve.dashboard import PUBLIC_PATHS as DASHBOARD_PUBLIC_PATHS
    from tokenmill.serve.errors import error_response, install_error_handlers
    from tokenmill.serve.limits import RequestLimits

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                          limits=httpx.Limits(max_connections=1024))
        watcher = asyncio.create_task(router.watch(on_all_dead))
        yield
        watcher.cancel()
        await router.client.aclose()
        if router.subscriber is not None:
            router.subscriber.close()

    # No schema of its own: /openapi.json is proxied, so clients see the replicas' API.
    app = FastAPI(title="tokenmill data-parallel router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    install_error_handlers(app)
    contract = ServerSettings(
        api_key=settings.api_key, protect_health_and_metrics=settings.protect_health_and_metrics,
        limits=RequestLimits(max_request_body_bytes=settings.max_request_body_bytes),
        cors=CORSSettings(settings.allowed_origins, settings.allowed_methods, settings.allowed_headers,
                          settings.allow_credentials) if settings.allowed_origins else None)
    add_contract_middlewares(app, contract, router.http,
                             public_paths=frozenset() if settings.disable_dashboard else DASHBOARD_PUBLIC_PATHS)

    @app.get("/health")
    async def health():
        ok, reason = router.health()
        return JSONResponse({"status": "ok", "detail": reason}) if ok else error_response(503, reason,
                                                                                         code="unhealthy")

    @app.get("/ping")
    @app.post("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await router.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.forward(request, "/v1/chat/completions")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await router.forward(request, "/v1/embeddings")

    @app.api_route("/{path:path}", methods=ALL_METHODS)
    async def everything_else(request: Request):
        return await router.proxy(request)

    return app


def serve_data_parallel(settings: argparse.Namespace, serve: ServeFn) -> int:
    """Start the replicas (each runs `serve`, the single server's body, handed in by
    serve/cli.py so this module never imports it back) and the router; return the exit
    status once it has stopped."""
    import uvicorn

    from tokenmill.serve.api_server import ConnectionAbortMiddleware
    from tokenmill.serve.draining import DrainingServer
    from tokenmill.serve.http_protocol import header_timeout_protocol

    count = settings.data_parallel_size
    if count < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {count}")
    logging.getLogger().setLevel(settings.log_level.upper())
    replicas = start_replicas(settings, count, serve)
    logger.info("data parallel: %d replicas (%s), policy %s", count,
                ", ".join(f"replica {r.index} pid {r.process.pid} at {r.url}" for r in replicas),
                settings.data_parallel_policy)
    router = Router(replicas, settings.data_parallel_policy, settings.api_key, settings.stream_send_timeout,
                    block_size=settings.block_size, tokenizer=_router_tokenizer(settings))
    events = replicas[0].kv_events_endpoint and replica_kv_events(settings, 0)
    if events:
        router.subscribe_kv_events(events.topic, events.event_layout)
    server: DrainingServer | None = None

    def on_all_dead() -> None:
        logger.error("%s: stopping", router.fatal)
        if server is not None:
            server.should_exit = True

    config = uvicorn.Config(
        ConnectionAbortMiddleware(create_router_app(router, settings, on_all_dead)), host=settings.host,
        port=settings.port, log_level=settings.uvicorn_log_level or settings.log_level,
        ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile, ssl_ca_certs=settings.ssl_ca_certs,
        access_log=not settings.disable_access_log, lifespan="on",
        http=header_timeout_protocol(settings.header_timeout),
        timeout_graceful_shutdown=5,  # the drain has waited for the replicas; this only covers closing
    )
    server = DrainingServer(config, lambda: router.drain(settings.shutdown_timeout))
    try:
        server.run()
    finally:
        stop_replicas(replicas, settings.shutdown_timeout)
    if router.fatal:
        return 1
    return 0 if server.drained_cleanly else 1


def _router_tokenizer(settings: argparse.Namespace):
    """The model's tokenizer, for kv_aware (the other policies need none)."""
    if settings.data_parallel_policy != "kv_aware":
        return None
    from tokenmill.config import resolve_model_path
    from tokenmill.tokenizer import Tokenizer

    return Tokenizer.from_model_path(resolve_model_path(settings.model))


def stop_replicas(replicas: list[Replica], timeout: float) -> None:
    """What is left of the replicas after the router stopped (after a drain, nothing)."""
    for replica in replicas:
        if replica.process.is_alive():
            replica.process.terminate()  # SIGTERM: the replica drains, then exits
    deadline = time.monotonic() + timeout + 5.0
    for replica in replicas:
        replica.process.join(max(0.1, deadline - time.monotonic()))
        if replica.process.is_alive():
            replica.process.kill()
            replica.process.join(1.0)
