"""Collectives over shared memory for the tensor-parallel ranks of one host.

vLLM's CPU backend replaces gloo's all-reduce by one over shared memory (its C++
`_CPUSHMDistributed`); this is the same idea in PyTorch ops over an mmap'd file in
/dev/shm. Each rank has two slots (double buffering) and a sequence flag on its own
cache line. An all-reduce: copy the tensor into this rank's slot of the current buffer,
publish the sequence number, wait until every rank has published it, then sum the slots in
rank order (every rank computes the same sum, bit for bit). The next call uses the other
buffer, and a rank can only be there once every rank has read this one: one wait per
collective. Memory order: x86 keeps stores in order and loads in order (TSO), so a
flag seen implies the slot written before it is seen.

Waiting: spin on the flags for a few microseconds (a peer on another core arrives soon),
then yield, then sleep in short steps with the timer slack lowered, so two ranks sharing
cores with an API server and other jobs give the CPU away instead of burning their
scheduler quantum. While sleeping the waiter checks that its peers are alive and that the
timeout has not passed: a dead rank fails the collective within milliseconds.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable

import torch

FLAG_BYTES = 64  # one cache line per rank's flag
DEFAULT_SLOT_BYTES = 8 * 2**20


class PeerFailure(RuntimeError):
    """A rank of the group died or stopped answering."""


def lower_timer_slack() -> None:
    """Let short sleeps be short (Linux default slack is 50 us per sleep)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 us
    except (OSError, AttributeError):
        pass


class ShmCommunicator:
    """All-reduce and all-gather among `world` ranks of one host through `path`."""

    def __init__(self, path: str, rank: int, world: int, *, create: bool, timeout: float,
                 check_peers: Callable[[], None] = lambda: None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 spin: int = 400, yields: int = 20, sleep_s: float = 5e-6) -> None:
        self.rank, self.world = rank, world
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self.check_peers = check_peers
        self.spin, self.yields, self.sleep_s = spin, yields, sleep_s
        header = world * FLAG_BYTES
        size = header + world * 2 * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._flags = memoryview(self._mm)[:header].cast("q")
        self._flag_index = [r * (FLAG_BYTES // 8) for r in range(world)]
        self._others = [self._flag_index[r] for r in range(world) if r != rank]
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header, count=world * 2 * slot_bytes)
        self._slots = data.view(world, 2, slot_bytes)
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._seq = 0
        self.calls = 0  # collectives run, and the time spent in them (copies, waiting, sums)
        self.busy_s = 0.0
        self.wait_s = 0.0  # of which waiting for peers

    # ----- collectives -------------------------------------------------------------------

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        per_chunk = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), per_chunk):
            chunk = flat[start : start + per_chunk]
            n = chunk.numel()
            slots = self._exchange(chunk.view(1, n), x.dtype)[:, :n]
            torch.add(slots[0], slots[1], out=chunk)
            for r in range(2, self.world):
                chunk.add_(slots[r])
        if not x.is_contiguous():
            x.copy_(flat.view(x.shape))
        self.calls += 1
        self.busy_s += time.perf_counter() - started
        return x

    def all_gather(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """x [rows, sizes[rank]] from every rank -> [rows, sum(sizes)], ranks side by side."""
        started = time.perf_counter()
        rows = x.shape[0]
        out = torch.empty(rows, sum(sizes), dtype=x.dtype)
        per_chunk = max(1, self.slot_bytes // (max(sizes) * x.element_size()))
        offsets = [sum(sizes[:r]) for r in range(self.world)]
        for start in range(0, rows, per_chunk):
            part = x[start : start + per_chunk].contiguous()
            t = part.shape[0]
            slots = self._exchange(part.view(1, -1), x.dtype)
            for r in range(self.world):
                out[start : start + t, offsets[r] : offsets[r] + sizes[r]] = slots[r, : t * sizes[r]].view(t, sizes[r])
        self.calls += 1
        self.busy_s += time.perf_counter() - started
        return out

    def barrier(self) -> None:
        self._exchange(torch.zeros(1, 0), torch.float32)

    # ----- internals -----------------------------------------------------------------------

    def _exchange(self, mine: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Publish `mine` [1, n] in this rank's slot; return every rank's slot [world, slot]
        once all have published."""
        self._seq += 1
        seq = self._seq
        slots = self._typed_slots(seq & 1, dtype)
        n = mine.shape[1]
        if n:
            slots[self.rank, :n].copy_(mine[0])
        self._flags[self._flag_index[self.rank]] = seq
        self._wait(seq)
        return slots

    def _typed_slots(self, buffer: int, dtype: torch.dtype) -> torch.Tensor:
        key = (buffer, dtype)
        typed = self._typed.get(key)
        if typed is None:
            typed = self._typed[key] = self._slots[:, buffer].view(dtype)
        return typed

    def _wait(self, seq: int) -> None:
        flags, others = self._flags, self._others
        if all(flags[i] >= seq for i in others):
            return
        started = time.perf_counter()
        spins = 0
        while True:
            if all(flags[i] >= seq for i in others):
                self.wait_s += time.perf_counter() - started
                return
            spins += 1
            if spins <= self.spin:
                continue
            if spins <= self.spin + self.yields:
                os.sched_yield()
                continue
            time.sleep(self.sleep_s)  # releases the GIL too (the API server's event loop)
            if spins % 256 == 0:
                self.check_peers()
                waited = time.perf_counter() - started
                if waited > self.timeout:
                    late = [r for r in range(self.world) if flags[self._flag_index[r]] < seq]
                    raise PeerFailure(f"tensor-parallel rank(s) {late} did not reach collective #{seq} "
                                      f"within {self.timeout:.0f} s")

    def close(self) -> None:
        self._typed.clear()
        self._slots = None
        self._flags.release()
        try:
            self._mm.close()
        except BufferError:  # a tensor view still exists; the mapping goes with the process
            pass
