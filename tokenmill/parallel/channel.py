"""The step channel: rank 0 sends each step's `SchedulerOutput` to every other rank, and
the rank that samples for the last pipeline stage sends its `RunnerOutput` back.

A connection per rank (`multiprocessing.connection` over TCP, authenticated with a key
from the rendezvous store), so ranks on other hosts are reached the same way as local
ones. The step is pickled once and the same bytes are written to every connection; it is
a diff (a request's prompt travels once), so a decode step of 64 requests is a few KB.
Measured against a shared-memory ring: docs/parallelism.md.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

STOP = ("stop",)


def no_delay(conn: Connection) -> Connection:
    """Turn Nagle's algorithm off: `send_bytes` writes a header, then the body, and with
    Nagle on, a body that waits for the header's delayed ACK costs 40 ms (measured: a
    57 KB step took 22 ms one way instead of well under 1)."""
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup of the same socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


class ChannelClosed(RuntimeError):
    """The other end went away."""


class StepServer:
    """Rank 0's end: one connection per other rank."""

    def __init__(self, store, host: str, num_peers: int) -> None:
        self.authkey = os.urandom(16)
        self.listener = Listener((host, 0), backlog=max(1, num_peers), authkey=self.authkey)
        port = self.listener.address[1]
        store.set("step_channel", f"{host}:{port}:{self.authkey.hex()}")
        self.num_peers = num_peers
        self.conns: dict[int, Connection] = {}

    def accept(self) -> None:
        while len(self.conns) < self.num_peers:
            conn = no_delay(self.listener.accept())
            rank = conn.recv()
            self.conns[rank] = conn
        self.listener.close()

    def broadcast(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in self.conns.items():
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise ChannelClosed(f"rank {rank} closed its step channel ({exc})") from exc

    def recv_from(self, rank: int, timeout: float, check: Callable[[], None]) -> Any:
        """The next message of `rank`; `check` runs every 50 ms of waiting (raises when a
        peer died), and TimeoutError after `timeout` seconds."""
        conn = self.conns[rank]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.05):
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} sent no step result within {timeout:.0f} s")
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise ChannelClosed(f"rank {rank} closed its step channel") from exc

    def errors(self) -> dict[int, str]:
        """Error reports workers sent before dying (read without waiting)."""
        found = {}
        for rank, conn in self.conns.items():
            try:
                while conn.poll(0):
                    message = pickle.loads(conn.recv_bytes())
                    if isinstance(message, tuple) and message[:1] == ("error",):
                        found[rank] = message[1]
            except (EOFError, OSError, pickle.UnpicklingError):
                continue
        return found

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send_bytes(pickle.dumps(STOP))
            except OSError:
                pass
            conn.close()
        self.conns.clear()


class StepClient:
    """A worker rank's end."""

    def __init__(self, store, rank: int) -> None:
        host, port, key = store.get("step_channel").decode().rsplit(":", 2)
        self.conn = no_delay(Client((host, int(port)), authkey=bytes.fromhex(key)))
        self.conn.send(rank)

    def recv(self) -> Any:
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise ChannelClosed("rank 0 closed the step channel") from exc

    def send(self, message: Any) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_error(self, text: str) -> None:
        try:
            self.send(("error", text))
        except OSError:
            pass
