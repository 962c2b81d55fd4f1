"""The FastAPI app: OpenAI-compatible routes, tokenizer routes, health and metrics.

`create_server()` wires the pieces: the AsyncEngine (engine thread), the
metrics it reports to, the request handling, and the app whose lifespan starts
the engine thread and drains it at shutdown.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.engine.engine import LLMEngine
from tokenmill.serve.async_engine import AsyncEngine
from tokenmill.serve.errors import bad_request, error_response, install_error_handlers
from tokenmill.serve.metrics import ServerMetrics
from tokenmill.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenmill.serve.serving import ClientDisconnected, OpenAIServing

# Routes that stay open without the API key: probes and scrapers carry no secrets.
OPEN_PATHS = frozenset({"/health", "/metrics"})


@dataclass
class ServerSettings:
    served_model_names: list[str] | None = None
    api_key: str | None = None
    max_queued_requests: int | None = None
    shutdown_timeout: float = 30.0  # graceful drain of running requests
    health_stall_timeout: float = 60.0  # /health fails when work sits this long without a step
    on_fatal: Callable[[BaseException], None] | None = None  # e.g. stop uvicorn when loading fails


@dataclass
class Server:
    app: FastAPI
    engine: AsyncEngine
    serving: OpenAIServing
    metrics: ServerMetrics


def create_server(build_engine: Callable[[], LLMEngine], settings: ServerSettings) -> Server:
    # The metrics read the engine's stats and the model's name through closures: both
    # exist only after the metrics (the engine's observer) are built.
    metrics = ServerMetrics(lambda: engine.stats, lambda: (serving.model_names or [""])[0],
                            lambda: engine.engine.facts if engine.engine is not None else None)
    engine = AsyncEngine(
        build_engine,
        max_queued_requests=settings.max_queued_requests,
        stall_timeout=settings.health_stall_timeout,
        observers=[metrics],
        on_fatal=settings.on_fatal,
    )
    serving = OpenAIServing(engine, settings.served_model_names)
    app = _build_app(engine, serving, metrics, settings)
    return Server(app, engine, serving, metrics)


def _build_app(engine: AsyncEngine, serving: OpenAIServing, metrics: ServerMetrics,
               settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        yield
        # uvicorn has already waited (up to the shutdown timeout) for open responses;
        # what is left is aborted after a short grace period.
        await engine.shutdown(timeout=min(5.0, settings.shutdown_timeout))

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    _add_routes(app, engine, serving, metrics)
    return app


def _add_routes(app: FastAPI, engine: AsyncEngine, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        ok, reason = engine.health()
        if ok:
            return JSONResponse({"status": "ok"})
        return error_response(503, reason)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> Response:
        core = engine.engine
        cards = [
            {"id": name, "object": "model", "created": started, "owned_by": "tokenmill",
             "root": core.model_name if core else None, "max_model_len": core.max_model_len if core else None}
            for name in serving.model_names
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        serving.check_model(body.model)
        core = serving.core
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' or 'messages'")
        if body.messages is not None:
            tokens = serving.encode_chat(body.messages, body.add_generation_prompt)
        else:
            tokens = core.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": core.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        serving.check_model(body.model)
        core = serving.core
        bad = next((t for t in body.tokens if not 0 <= t < core.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of the vocabulary (size {core.vocab_size})", param="tokens")
        return JSONResponse({"prompt": core.tokenizer.decode(body.tokens)})


async def _client_gone(_: Request, __: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


class APIKeyMiddleware:
    """Bearer-token check for every route but OPEN_PATHS. Pure ASGI (not
    BaseHTTPMiddleware), so it neither buffers streams nor hides disconnects, and
    it runs before the body is parsed: a bad key is 401 even for a bad body."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected)

