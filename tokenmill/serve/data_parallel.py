"""`tokenmill serve --data-parallel-size N`: N engine replicas behind one API port.

Each replica is a whole `tokenmill serve` (its own process, engine, KV cache and
threads: the host's threads divided among them) on a loopback port; this process is the
router in front of them, the role vllm-router or SGLang's router plays for separate
servers. It forwards each request to the replica `routing.py` picks (prefix-aware by
default), streaming the replica's bytes back as they come; a client that disconnects
closes the upstream request, and the replica aborts it. It checks the replicas' /health
every second, takes a failed one out of rotation and retries a request that could not be
sent on another replica. /health is 200 while at least one replica is healthy; the
server exits non-zero once none is. /metrics holds the router's own counters and every
replica's metrics with a `replica` label.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

# At module level: FastAPI resolves the handlers' annotations in this module's globals.
from fastapi import Request

logger = logging.getLogger("tokenmill.serve.dp")

# One replica's server: settings in, exit status out (`serve.cli.serve`; a module-level
# function, so a spawned replica process receives it by name).
ServeFn = Callable[[argparse.Namespace], int]

HEALTH_INTERVAL_S = 1.0
FORWARDED_HEADERS = ("authorization", "content-type", "accept")


@dataclass
class Replica:
    index: int
    url: str
    process: multiprocessing.Process
    healthy: bool = False
    load: int = 0  # requests in flight through the router
    routed: int = 0
    failures: int = 0


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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s dp%(process)d %(name)s: %(message)s")
    sys.exit(serve(settings))


def start_replicas(settings: argparse.Namespace, count: int, serve: ServeFn) -> list[Replica]:
    from tokenmill.hardware import cpu_info

    context = multiprocessing.get_context("spawn")
    threads = max(1, (settings.num_threads or cpu_info().num_cores) // count)
    replicas = []
    for index in range(count):
        port = _free_port()
        replica_settings = argparse.Namespace(**{**vars(settings), "host": "127.0.0.1", "port": port,
                                                 "num_threads": threads, "data_parallel_size": 1})
        process = context.Process(target=_replica_main, args=(serve, replica_settings), name=f"tokenmill-dp{index}")
        process.start()
        replicas.append(Replica(index, f"http://127.0.0.1:{port}", process))
    return replicas


class Router:
    def __init__(self, replicas: list[Replica], policy_name: str, api_key: str | None = None) -> None:
        from tokenmill.serve.routing import make_policy

        self.replicas = replicas
        self.policy = make_policy(policy_name, len(replicas))
        self.api_key = api_key
        self.stats = RouterStats()
        self.ready = False  # every replica answered /health once
        self.client = None
        self.fatal: str | None = None

    # ----- health ---------------------------------------------------------------------

    async def watch(self, on_all_dead) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=2.0) as probe:
            while True:
                for replica in self.replicas:
                    await self._probe(probe, replica)
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
        if alive:
            try:
                ok = (await probe.get(replica.url + "/health")).status_code == 200
            except Exception:  # noqa: BLE001 - any failure to answer is unhealthy
                ok = False
        if replica.healthy and not ok:
            reason = "its process died" if not alive else "its /health failed"
            logger.error("replica %d (%s) is out of rotation: %s", replica.index, replica.url, reason)
        elif ok and not replica.healthy and self.ready:
            logger.info("replica %d (%s) is back in rotation", replica.index, replica.url)
        replica.healthy = ok

    def health(self) -> tuple[bool, str]:
        if self.fatal:
            return False, self.fatal
        if not self.ready:
            return False, "the replicas are loading"
        healthy = sum(r.healthy for r in self.replicas)
        return (healthy > 0), f"{healthy} of {len(self.replicas)} replicas healthy"

    # ----- forwarding -------------------------------------------------------------------

    def choose(self, path: str, body: dict) -> Replica:
        from tokenmill.serve.routing import prompt_key

        choice = self.policy.choose(prompt_key(path, body), [r.load for r in self.replicas],
                                    [r.healthy for r in self.replicas])
        stats = self.stats
        stats.requests += 1
        stats.matched_blocks += choice.matched_blocks
        stats.prompt_blocks += choice.total_blocks
        stats.reasons[choice.reason] = stats.reasons.get(choice.reason, 0) + 1
        return self.replicas[choice.replica]

    async def forward(self, request, path: str):
        """Send a generation request to a replica and stream its answer back."""
        import httpx
        from fastapi.responses import StreamingResponse

        raw = await request.body()
        try:
            import json

            body = json.loads(raw or b"{}")
        except ValueError:
            body = {}
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: set[int] = set()
        while True:
            try:
                replica = self.choose(path, body if isinstance(body, dict) else {})
            except LookupError:
                return _error(503, "no healthy data-parallel replica")
            if replica.index in tried:  # the policy insists on one that just failed
                candidates = [r for r in self.replicas if r.healthy and r.index not in tried]
                if not candidates:
                    return _error(503, "no data-parallel replica could take the request")
                replica = min(candidates, key=lambda r: r.load)
            tried.add(replica.index)
            upstream_request = self.client.build_request("POST", replica.url + path, content=raw, headers=headers)
            replica.load += 1
            try:
                upstream = await self.client.send(upstream_request, stream=True)
            except httpx.TransportError as exc:
                replica.load -= 1
                replica.failures += 1
                replica.healthy = False
                logger.error("replica %d did not take a request (%s): out of rotation, trying another",
                             replica.index, exc)
                continue
            replica.routed += 1
            break

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when the client went away: closing aborts the replica's request
                replica.load -= 1
                await upstream.aclose()

        passed = {k: v for k, v in upstream.headers.items()
                  if k.lower() in ("content-type", "cache-control", "x-request-id")}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(relay(), status_code=upstream.status_code, headers=passed)
        try:
            content = await upstream.aread()
        finally:
            replica.load -= 1
            await upstream.aclose()
        return _raw_response(content, upstream.status_code, passed)

    async def get_from_any(self, path: str, request):
        import httpx

        for replica in sorted(self.replicas, key=lambda r: not r.healthy):
            try:
                upstream = await self.client.get(replica.url + path, headers={
                    k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS})
            except httpx.TransportError:
                continue
            passed = {k: v for k, v in upstream.headers.items() if k.lower() == "content-type"}
            return _raw_response(upstream.content, upstream.status_code, passed)
        return _error(503, "no data-parallel replica answered")

    async def post_to_any(self, path: str, request):
        import httpx

        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        for replica in sorted(self.replicas, key=lambda r: not r.healthy):
            try:
                upstream = await self.client.post(replica.url + path, content=raw, headers=headers)
            except httpx.TransportError:
                continue
            passed = {k: v for k, v in upstream.headers.items() if k.lower() == "content-type"}
            return _raw_response(upstream.content, upstream.status_code, passed)
        return _error(503, "no data-parallel replica answered")

    async def metrics(self) -> str:
        lines = [
            "# HELP tokenmill:router_requests_total Requests routed, by replica.",
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
        seen_meta: set[str] = set()
        for replica in self.replicas:
            try:
                text = (await self.client.get(replica.url + "/metrics")).text
            except Exception:  # noqa: BLE001 - a dead replica has no metrics
                continue
            lines.extend(label_metrics(text, f'replica="{replica.index}"', seen_meta))
        return "\n".join(lines) + "\n"


def label_metrics(text: str, label: str, seen_meta: set[str]) -> list[str]:
    """Prometheus text with `label` added to every sample; HELP/TYPE lines once."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            if line not in seen_meta:
                seen_meta.add(line)
                out.append(line)
            continue
        name, _, rest = line.partition(" ")
        if "{" in name:
            metric, _, labels = name.partition("{")
            out.append(f"{metric}{{{label},{labels} {rest}" if labels != "}" else f"{metric}{{{label}}} {rest}")
        else:
            out.append(f"{name}{{{label}}} {rest}")
    return out


def _raw_response(content: bytes, status: int, headers: dict):
    from fastapi.responses import Response

    return Response(content=content, status_code=status, headers=headers)


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    kind = "service_unavailable" if status == 503 else "error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


def create_router_app(router: Router, on_all_dead):
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                          limits=httpx.Limits(max_connections=1024))
        watcher = asyncio.create_task(router.watch(on_all_dead))
        yield
        watcher.cancel()
        await router.client.aclose()

    app = FastAPI(title="tokenmill data-parallel router", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health():
        ok, reason = router.health()
        return JSONResponse({"status": "ok", "detail": reason}) if ok else _error(503, reason)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await router.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.get_from_any("/v1/models", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.forward(request, "/v1/chat/completions")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await router.post_to_any("/tokenize", request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await router.post_to_any("/detokenize", request)

    return app


def serve_data_parallel(settings: argparse.Namespace, serve: ServeFn) -> int:
    """Start the replicas (each runs `serve`, the single server's body, handed in by
    serve/cli.py so this module never imports it back) and the router; return the exit
    status once it has stopped."""
    import uvicorn

    count = settings.data_parallel_size
    if count < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {count}")
    logging.getLogger().setLevel(settings.log_level.upper())
    replicas = start_replicas(settings, count, serve)
    logger.info("data parallel: %d replicas (%s), policy %s", count,
                ", ".join(f"replica {r.index} pid {r.process.pid} at {r.url}" for r in replicas),
                settings.data_parallel_policy)
    router = Router(replicas, settings.data_parallel_policy, settings.api_key)
    server: uvicorn.Server | None = None

    def on_all_dead() -> None:
        logger.error("%s: stopping", router.fatal)
        if server is not None:
            server.should_exit = True

    config = uvicorn.Config(create_router_app(router, on_all_dead), host=settings.host, port=settings.port,
                            log_level=settings.log_level, access_log=not settings.disable_access_log,
                            lifespan="on", timeout_graceful_shutdown=settings.shutdown_timeout)
    from tokenmill.serve.draining import DrainingServer

    server = DrainingServer(config, _nothing_to_drain)  # the replicas drain themselves (stop_replicas)
    try:
        server.run()
    finally:
        stop_replicas(replicas, settings.shutdown_timeout)
    return 1 if router.fatal else 0


async def _nothing_to_drain() -> bool:
    return True


def stop_replicas(replicas: list[Replica], timeout: float) -> None:
    for replica in replicas:
        if replica.process.is_alive():
            replica.process.terminate()  # SIGTERM: the replica drains, then exits
    deadline = time.monotonic() + timeout + 5.0
    for replica in replicas:
        replica.process.join(max(0.1, deadline - time.monotonic()))
        if replica.process.is_alive():
            replica.process.kill()
            replica.process.join(1.0)
