"""uvicorn's HTTP/1.1 protocol (h11) with a deadline for a request's headers.

uvicorn times a connection out only between requests (`timeout_keep_alive`, armed once a
response is complete): a client that opens a connection and drips its headers a byte at
a time, or never finishes them, holds a socket and a file descriptor for as long as it
likes (issue 31: 500 such connections took the server from 8 to 507 descriptors). Here
the headers of every request, the first on a connection and each later one, must be
complete within `header_timeout` seconds of the connection opening or of the previous
response ending; else the connection is closed. Bodies are not timed here (the body
limit bounds them; a stalled stream's writes have --stream-send-timeout).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 20.0  # seconds; Apache's RequestReadTimeout starts at 20 s for headers


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn.Config(http=...) takes a protocol class: this one, with the timeout set."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": header_timeout})


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout: float = DEFAULT_HEADER_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers are in
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the next request's headers are timed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("closing a connection whose request headers took more than %g s", self.header_timeout)
            self.transport.close()
