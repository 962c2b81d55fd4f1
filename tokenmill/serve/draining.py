"""uvicorn's Server, with the first SIGTERM or SIGINT draining instead of closing.

uvicorn alone closes the listening socket at once on a signal (new clients get
"connection refused" while it waits for open responses) and re-raises the signal
when it is done. Here the first signal starts the app's drain while the server keeps
listening, so a request that arrives meanwhile is answered 503 (with Connection:
close) and a load balancer moves on; once the drain is done (admitted requests
finished, or aborted at --shutdown-timeout), uvicorn's own shutdown closes the
connections and `run()` returns, and the process exits 0. A second signal exits at
once, with status 128 + the signal's number (what a shell reports for a killed
process): the operator asked twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[bool]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.drained_cleanly = True  # False when the drain found the engine dead or stuck

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler (main thread)."""
        if self._draining:
            logger.warning("signal %d during the drain: exiting now", sig)
            os._exit(128 + sig)
        self._draining = True
        if self._loop is None or not self.started:  # not serving yet: nothing to drain
            self.should_exit = True
            return
        logger.info("signal %d: draining (new requests get 503), then exiting", sig)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            self.drained_cleanly = await self._drain()
        finally:
            self.should_exit = True
