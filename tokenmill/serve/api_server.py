"""The FastAPI app: OpenAI-compatible routes, tokenizer routes, health and metrics.

`create_server()` wires the pieces: the AsyncEngine (engine thread), the
metrics it reports to, the request handling, and the app whose lifespan starts
the engine thread and stops it at shutdown. Around the routes sit four pure-ASGI
middlewares (outermost first): HTTP metrics, a guard that turns any unexpected
exception into a plain 500 (and keeps the connection usable), the API key check,
and the request-body size limit. docs/reliability.md is the contract they keep.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill import __version__
from tokenmill.engine.engine import LLMEngine, StepObserver
from tokenmill.serve.async_engine import AsyncEngine, EngineUnavailableError
from tokenmill.serve.dashboard import PUBLIC_PATHS as DASHBOARD_PUBLIC_PATHS
from tokenmill.serve.dashboard import Dashboard
from tokenmill.serve.embeddings import add_embeddings_route
from tokenmill.serve.errors import bad_request, error_response, install_error_handlers, internal_error_response
from tokenmill.serve.faults import FaultInjector
from tokenmill.serve.limits import RequestLimits, payload_too_large
from tokenmill.serve.metrics import ServerMetrics
from tokenmill.serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    sse_content,
)
from tokenmill.serve.serving import (
    DEFAULT_STREAM_SEND_TIMEOUT,
    ClientDisconnected,
    OpenAIServing,
    abort_connection,
)
from tokenmill.serve.recalibration import MIN_STEPS, OnlineCalibration, Planner
from tokenmill.serve.responses import ResponseStreamEvent, add_responses_routes
from tokenmill.serve.tools import AgentSettings

logger = logging.getLogger(__name__)

# Routes that stay open without the API key unless --protect-health-and-metrics:
# probes and scrapers carry no secrets.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


@dataclass
class CORSSettings:
    """vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials."""

    allowed_origins: list[str]
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerSettings:
    served_model_names: list[str] | None = None
    api_key: str | None = None
    protect_health_and_metrics: bool = False  # the API key also guards /health and /metrics
    max_queued_requests: int | None = None
    max_queue_wait_s: float | None = None  # a request not scheduled in this long gets 503
    shutdown_timeout: float = 25.0  # graceful drain of running requests (fits Kubernetes' 30 s grace)
    health_stall_timeout: float = 60.0  # /health fails when work sits this long without a step
    limits: RequestLimits = field(default_factory=RequestLimits)
    trust_request_chat_template: bool = False
    agent: AgentSettings = field(default_factory=AgentSettings)  # tool calling, reasoning (serve/tools.py)
    enable_dashboard: bool = True  # /dashboard, a live view of the engine (serve/dashboard/)
    allow_special_tokens_in_content: bool = False  # special-token text in messages becomes control tokens
    stream_send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT  # a stream's client that reads nothing this long
    chat_template: str | None = None  # --chat-template: the operator's, instead of the model's
    enable_log_requests: bool = False  # a log line per request (vLLM's --enable-log-requests)
    cors: CORSSettings | None = None  # --allowed-origins and friends; None: no CORS headers
    planner: Planner | None = None  # POST /v1/plan (what-if), when given
    on_fatal: Callable[[BaseException], None] | None = None  # e.g. stop uvicorn when the engine dies


@dataclass
class Server:
    app: FastAPI
    engine: AsyncEngine
    serving: OpenAIServing
    metrics: ServerMetrics
    settings: ServerSettings
    calibration: OnlineCalibration | None = None

    async def drain(self) -> bool:
        """SIGTERM's first half: refuse new requests with 503, let the admitted ones finish
        within the shutdown timeout, abort the rest (finish_reason "abort"). False when the
        engine was dead or stuck."""
        return await self.engine.drain(self.settings.shutdown_timeout)


def create_server(build_engine: Callable[[], LLMEngine], settings: ServerSettings) -> Server:
    # The metrics read the engine's stats and the model's name through closures: both
    # exist only after the metrics (the engine's observer) are built.
    metrics = ServerMetrics(lambda: engine.stats, lambda: (serving.model_names or [""])[0],
                            lambda: engine.engine.facts if engine.engine is not None else None,
                            lambda: engine.num_pending_outputs)
    faults = FaultInjector.from_env()
    dashboard = Dashboard(lambda: engine, metrics) if settings.enable_dashboard else None
    calibration = OnlineCalibration()  # recent steps, for the what-if's step cost model
    observers: list[StepObserver] = [metrics, calibration] + ([dashboard.observer] if dashboard else [])
    engine = AsyncEngine(
        build_engine,
        max_queued_requests=settings.max_queued_requests,
        max_queue_wait=settings.max_queue_wait_s,
        stall_timeout=settings.health_stall_timeout,
        observers=observers,
        on_fatal=settings.on_fatal,
        before_step=faults.before_step if faults else None,
    )
    serving = OpenAIServing(engine, settings.served_model_names, settings.limits,
                            settings.trust_request_chat_template, settings.stream_send_timeout,
                            settings.chat_template, settings.enable_log_requests,
                            settings.allow_special_tokens_in_content, agent=settings.agent)
    app = _build_app(engine, serving, metrics, settings, dashboard)
    if settings.planner is not None:
        _add_plan_route(app, serving, calibration, settings.planner)
    return Server(app, engine, serving, metrics, settings, calibration)


def _build_app(engine: AsyncEngine, serving: OpenAIServing, metrics: ServerMetrics,
               settings: ServerSettings, dashboard: Dashboard | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        yield
        # A SIGTERM has drained already; otherwise (engine death) what is left is aborted.
        await engine.shutdown(timeout=min(5.0, settings.shutdown_timeout))
        serving.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    add_contract_middlewares(app, settings, metrics,
                             public_paths=DASHBOARD_PUBLIC_PATHS if dashboard is not None else frozenset())
    _add_routes(app, engine, serving, metrics)
    add_responses_routes(app, serving, _ERRORS)
    add_embeddings_route(app, serving, _ERRORS)
    _document_stream_payloads(app)
    if dashboard is not None:
        dashboard.add_routes(app)
    return app


class HTTPObserver(Protocol):
    def observe_http(self, method: str, handler: str, status: int) -> None: ...


def add_contract_middlewares(app: FastAPI, settings: ServerSettings, metrics: HTTPObserver,
                             public_paths: frozenset[str] = frozenset()) -> None:
    """The middlewares that keep docs/reliability.md's contract, in the order the contract
    needs (outermost first): CORS (a browser's preflight carries no API key), HTTP
    metrics, the 500 guard, the API key (before the body is read), the body limit (before
    the body is parsed). The single server and the data-parallel router both use this, so
    that a client sees the same answers from either. `public_paths` stay open with a key
    set (the dashboard's static shell)."""
    # add_middleware puts each new one outside the previous ones.
    app.add_middleware(BodyLimitMiddleware, limit=settings.limits.max_request_body_bytes)
    if settings.api_key:
        open_paths = (frozenset() if settings.protect_health_and_metrics else OPEN_PATHS) | public_paths
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, open_paths=open_paths)
    app.add_middleware(ErrorGuardMiddleware)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    if settings.cors is not None:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors.allowed_origins,
                           allow_methods=settings.cors.allowed_methods, allow_headers=settings.cors.allowed_headers,
                           allow_credentials=settings.cors.allow_credentials)


# Declared in the OpenAPI schema: every error is an ErrorResponse.
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)
}
# What each event of a stream holds (sse_content): components of their own, since no
# route returns them whole.
STREAM_PAYLOADS: tuple[type[BaseModel], ...] = (CompletionResponse, ChatCompletionChunk, ResponseStreamEvent)


def _document_stream_payloads(app: FastAPI) -> None:
    """app.openapi() with the stream payloads among its components, as OpenAPI 3.2 (the
    version whose `itemSchema` describes a stream's events; the rest of FastAPI's 3.1
    document is valid 3.2)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            _, definitions = models_json_schema([(model, "serialization") for model in STREAM_PAYLOADS],
                                                ref_template="#/components/schemas/{model}")
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in definitions.get("$defs", {}).items():
                schemas.setdefault(name, schema)
            document["openapi"] = "3.2.0"
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_plan_route(app: FastAPI, serving: OpenAIServing, calibration: OnlineCalibration, planner: Planner) -> None:
    """POST /v1/plan: the predicted TTFT, TPOT and goodput of a proposed configuration and
    load, simulated with the step cost model refit from this server's recent steps
    (serve/recalibration.py, simulator/what_if.py; docs/scheduling.md). tokenmill's own."""
    base_lock = asyncio.Lock()
    looked_up: list[bool] = []

    @app.post("/v1/plan", responses={status: {"model": ErrorResponse} for status in (400, 503)},
              openapi_extra={"requestBody": {"required": True,
                                             "content": {"application/json": {"schema": planner.body_schema}}}})
    async def plan(raw: Request) -> Response:
        core = serving.core  # 503 while the model loads
        try:
            body = await raw.json()
        except ValueError:
            raise bad_request("the body must be a JSON object (settings, load, goodput)") from None
        async with base_lock:  # this machine's stored calibration, looked up once
            if not looked_up:
                calibration.base, calibration.base_source = await asyncio.to_thread(planner.base_model, core.config)
                looked_up.append(True)
        online = await asyncio.to_thread(calibration.model)
        if online.model is None:
            return error_response(
                503, f"no step cost model yet: the server has timed {online.steps} steps (a refit needs "
                f"{MIN_STEPS}, with prefill and decode steps among them) and this machine has no calibration of "
                "the model (`tokenmill simulate calibrate`); retry after some traffic", code="not_calibrated")
        source = online.source + (f" ({calibration.base_source})" if "calibration" in online.source else "")
        try:
            result = await asyncio.to_thread(planner.what_if, core.config, core.facts.num_blocks,
                                             core.max_model_len, online.model, body, source)
        except ValueError as error:
            raise bad_request(str(error)) from error
        result["step_cost_model"] = {**online.to_dict(), "base": calibration.base_source or None}
        return JSONResponse(result)


def _add_routes(app: FastAPI, engine: AsyncEngine, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    started = int(time.time())

    @app.get("/health", responses={200: {"model": HealthResponse}, 503: {"model": ErrorResponse}})
    async def health() -> Response:
        ok, reason = engine.health()
        if ok:
            return JSONResponse({"status": "ok"})
        return error_response(503, reason, code="unhealthy")

    # vLLM's (SageMaker's) liveness route: the same answer as /health, by GET or POST.
    # POST stays out of the OpenAPI schema: a body-less POST has no invalid variant to fuzz.
    @app.get("/ping", responses={200: {"model": HealthResponse}, 503: {"model": ErrorResponse}})
    @app.post("/ping", include_in_schema=False)
    async def ping() -> Response:
        return await health()

    # vLLM's admin route: forget every cached prefix (pool and host tier; KV events publish
    # AllBlocksCleared). Out of the OpenAPI schema, as vLLM keeps it to its dev mode.
    @app.post("/reset_prefix_cache", include_in_schema=False)
    async def reset_prefix_cache() -> Response:
        try:
            reset = await engine.reset_prefix_cache()
        except EngineUnavailableError as error:
            return error_response(503, str(error), code="engine_unavailable")
        if not reset:
            return error_response(409, "requests are running and hold KV blocks; retry when the server is idle",
                                  code="busy")
        return JSONResponse({"reset": True})

    @app.get("/version", responses={200: {"model": VersionResponse}})
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={200: {"model": ModelList}, **_ERRORS})
    async def list_models() -> Response:
        core = engine.engine
        cards = [
            {"id": name, "object": "model", "created": started, "owned_by": "tokenmill",
             "root": core.model_name if core else None, "max_model_len": core.max_model_len if core else None}
            for name in serving.model_names
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/completions",
              responses={200: {"model": CompletionResponse, "content": sse_content("CompletionResponse")},
                         **_ERRORS})
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions",
              responses={200: {"model": ChatCompletionResponse,
                              "content": sse_content("ChatCompletionChunk")}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(body, raw)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **_ERRORS})
    async def tokenize(body: TokenizeRequest) -> Response:
        serving.check_model(body.model)
        core = serving.core
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            tokens = await serving.encode_chat(body.messages, body.add_generation_prompt, body.chat_template,
                                               body.chat_template_kwargs)
        else:
            tokens = await serving.off_loop(core.tokenizer.encode, body.prompt or "", body.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": core.max_model_len})

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **_ERRORS})
    async def detokenize(body: DetokenizeRequest) -> Response:
        serving.check_model(body.model)
        core = serving.core
        bad = next((t for t in body.tokens if not 0 <= t < core.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of the vocabulary (size {core.vocab_size})", param="tokens")
        return JSONResponse({"prompt": await serving.off_loop(core.tokenizer.decode, body.tokens)})


async def _client_gone(_: Request, __: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


# ----- middlewares (pure ASGI: they neither buffer streams nor hide disconnects) -----------


class APIKeyMiddleware:
    """Bearer-token check for every route but `open_paths`. It runs before the body is
    read: a bad key is 401 even for a bad or huge body."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._expected = api_key.encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected)


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes, before it is parsed: at once when Content-Length
    says so, else as soon as the received bytes pass the limit. The rest of the body is
    read and dropped (up to DRAIN_BYTES), so that the client, still sending, gets to read
    the 413 instead of a reset connection."""

    DRAIN_BYTES = 64 * 2**20

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, body_done=False)
            return
        received = 0
        exceeded = False
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded, body_done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.limit:
                    exceeded = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            if not exceeded:  # once over the limit, the app's own answer is dropped
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if exceeded:
            await self._refuse(scope, receive, send, body_done)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, body_done: bool) -> None:
        drained = 0
        while not body_done and drained < self.DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client is gone
            drained += len(message.get("body", b""))
            body_done = not message.get("more_body", False)
        error = payload_too_large(self.limit)
        await error_response(413, error.message, code=error.code, headers=error.headers)(scope, receive, send)


class ErrorGuardMiddleware:
    """Any exception that escapes a route becomes a 500 with no internals in it. Not
    re-raised (Starlette's own handler re-raises, and uvicorn then drops the keep-alive
    connection, failing the client's next request too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the whole point
            if started:  # a stream broke after its headers: only the log can tell
                logger.error("error after the response started", exc_info=exc)
                return
            await internal_error_response(exc)(scope, receive, send)


class ConnectionAbortMiddleware:
    """Lets a stream whose client stopped reading (serving.SSEResponse) reset its
    connection: a polite close would keep the socket and the megabytes queued for it
    (loopback's buffers held 2.8 MB) until the client reads them. It wraps the whole app
    (cli.serve), so that `send` is still uvicorn's own and its transport reachable; under
    another server there is none and the stream only ends its response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and transport is not None and hasattr(transport, "abort"):
            abort_connection.set(functools.partial(_reset, transport))  # this request's task
        await self.app(scope, receive, send)


def _reset(transport: Any) -> None:
    """Close with RST (SO_LINGER 0): the kernel drops the unsent bytes at once."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


class HTTPMetricsMiddleware:
    """Counts every answer by method, route and status (tokenmill:http_requests_total);
    unknown paths share one label, so fuzzing cannot grow the label set."""

    def __init__(self, app: ASGIApp, metrics: HTTPObserver) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_http(scope["method"], handler, status)
