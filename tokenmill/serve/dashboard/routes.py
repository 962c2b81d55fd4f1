"""The dashboard's HTTP side: the page, its assets, and its data.

    GET /dashboard                  the page (public: it holds no data)
    GET /dashboard/dashboard.js     its script and style (public)
    GET /dashboard/dashboard.css
    GET /dashboard/state            the newest snapshot as JSON            (API key)
    GET /dashboard/events           server-sent events: each new snapshot  (API key)

With `--api-key` the page's shell loads without the key; everything it shows comes from
/dashboard/state and /dashboard/events, which the API key middleware guards like any
other route. The page sends the key as `Authorization: Bearer` (it reads it from the
URL fragment, `/dashboard#key=...`, which browsers never send to the server, or from
the key field it shows after a 401), so the key appears in no URL the server logs.
EventSource cannot send headers, so the page reads the event stream with fetch().
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.serve.async_engine import AsyncEngine, EngineState
from tokenmill.serve.dashboard.state import DashboardObserver
from tokenmill.serve.metrics import ServerMetrics

ASSETS = {
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
PUBLIC_PATHS = frozenset(ASSETS)  # open without the API key: static files, no data
HEARTBEAT_S = 1.0  # a tick when no snapshot came: the page's clock moves, rates decay to 0
_ENDED = (EngineState.STOPPING, EngineState.STOPPED, EngineState.DEAD)


class Dashboard:
    """The observer (engine thread) and the routes (event loop) of one server."""

    def __init__(self, engine: Callable[[], AsyncEngine], metrics: ServerMetrics, max_rate_hz: float = 4.0) -> None:
        # A callable, as for the metrics: the AsyncEngine is built with this observer.
        self._engine = engine
        self.metrics = metrics
        self.observer = DashboardObserver(lambda: engine().engine, max_rate_hz)
        self._encoded: tuple[int, bytes] | None = None  # the newest snapshot as an SSE event

    def add_routes(self, app: FastAPI) -> None:
        for path, (name, media_type) in ASSETS.items():
            app.add_api_route(path, _asset_route(name, media_type), methods=["GET"], include_in_schema=False)
        app.add_api_route("/dashboard/state", self.state, methods=["GET"], include_in_schema=False)
        app.add_api_route("/dashboard/events", self.events, methods=["GET"], include_in_schema=False)

    async def state(self) -> Response:
        snapshot = self.observer.current()
        if snapshot is None:
            return JSONResponse({"loading": True, "now": _now()})
        return Response(json.dumps(self._payload(snapshot), separators=(",", ":")), media_type="application/json")

    async def events(self) -> Response:
        queue = self.observer.subscribe()

        async def stream():
            try:
                snapshot = self.observer.current()
                if snapshot is not None:
                    yield self._event(snapshot)
                while self._engine().state not in _ENDED:
                    try:
                        snapshot = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                    except asyncio.TimeoutError:
                        yield f"event: tick\ndata: {{\"now\": {_now()}}}\n\n".encode()
                        continue
                    yield self._event(snapshot)
            finally:
                self.observer.unsubscribe(queue)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    # ----- internals -----------------------------------------------------------------------

    def _event(self, snapshot: dict[str, Any]) -> bytes:
        """Encoded once per snapshot, however many pages watch."""
        if self._encoded is None or self._encoded[0] != snapshot["seq"]:
            data = json.dumps(self._payload(snapshot), separators=(",", ":"))
            self._encoded = (snapshot["seq"], f"event: snapshot\ndata: {data}\n\n".encode())
        return self._encoded[1]

    def _payload(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        """The snapshot plus what the event loop adds: the latency histograms (the same
        Prometheus objects /metrics renders) and the engine's state."""
        return {**snapshot, "engine_state": self._engine().state.value, "sent": _now(),
                "ttft": histogram(self.metrics.ttft), "itl": histogram(self.metrics.itl)}


def histogram(metric: Any) -> dict[str, Any]:
    """A prometheus_client Histogram, summed over its label sets: bucket upper bounds,
    per-bucket (not cumulative) counts, count and sum."""
    cumulative: dict[float, float] = {}
    count = total = 0.0
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                cumulative[bound] = cumulative.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    bounds = sorted(cumulative)
    counts, previous = [], 0.0
    for bound in bounds:
        counts.append(int(cumulative[bound] - previous))
        previous = cumulative[bound]
    return {"bounds": [b if b != float("inf") else None for b in bounds], "counts": counts,
            "count": int(count), "sum": total}


def _asset_route(name: str, media_type: str):
    body = resources.files("tokenmill.serve.dashboard").joinpath("static", name).read_bytes()

    async def asset() -> Response:
        return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache"})

    return asset


def _now() -> float:
    return round(time.monotonic(), 4)
