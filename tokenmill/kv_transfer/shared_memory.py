"""A prefill instance's KV pool in shared memory, copied from in place by decode instances on its host.

Over TCP a pull costs the producer a copy of every block into messages, the loopback socket two
more, and the consumer a copy out of the messages into its pool: 315 ms for a 2,048-token
prompt's 47.2 MB on the loaded 2-core EPYC (docs/disaggregation.md), most of it on the producer's
core, busy prefilling the next prompt. On one host the producer allocates its pool in a memfd
and its `hello` answer describes it (`SharedRegion.describe`: the path `/proc/<pid>/fd/<fd>`, a
token written in the region's header, where each pool tensor lives); a consumer that can open and
map it (same host, a user allowed to read the producer's fds, the token read back equal)
copies a request's blocks from the producer's pool straight into its own (the runner's
`copy_shared_kv_blocks`), and nothing goes through a socket but two small messages. Any consumer
that cannot map it pulls over TCP, as before.

A memfd rather than a file under /dev/shm: its memory is freed with the last process that maps
it, so a killed producer leaks nothing, and it is not capped by /dev/shm's size (64 MB in a
default container). Its pages are shmem: transparent huge pages there follow
/sys/kernel/mm/transparent_hugepage/shmem_enabled, not the anonymous-memory setting
(kernels/huge_pages.py), so a producer's pool may lose the 2 MiB pages a private pool gets.

The connector (connector.py) keeps the blocks pinned while a consumer copies them: see `pin`.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096  # the token, then the pool's tensors from the next page on
ALIGN = 4096


@dataclass(frozen=True)
class PoolTensor:
    """Where one pool tensor lives in the region: its blocks are `block_bytes` apart from `offset`."""

    offset: int
    block_bytes: int
    num_blocks: int

    @property
    def end(self) -> int:
        return self.offset + self.block_bytes * self.num_blocks


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class SharedRegion:
    """The producer's memfd, mapped; the runner carves the pool's tensors from it (`allocate`)."""

    def __init__(self, nbytes: int) -> None:
        self.token = uuid.uuid4().hex
        self.size = HEADER_BYTES + _round_up(nbytes, ALIGN)
        self.fd = os.memfd_create(f"tokenmill-kv-{self.token[:8]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.mapping = mmap.mmap(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise
        if hasattr(mmap, "MADV_HUGEPAGE"):  # honoured only where shmem_enabled allows it
            self.mapping.madvise(mmap.MADV_HUGEPAGE)
        self.mapping[:len(self.token)] = self.token.encode()
        self.used = HEADER_BYTES

    def allocate(self, nbytes: int) -> int:
        """The offset of `nbytes` (page-aligned) not handed out before."""
        offset = self.used
        if offset + nbytes > self.size:
            raise ValueError(f"the shared KV region holds {self.size} bytes; {offset + nbytes} were asked for")
        self.used = offset + _round_up(nbytes, ALIGN)
        return offset

    def describe(self, tensors: list[PoolTensor]) -> dict[str, Any]:
        """What a consumer needs to map the region and find each pool tensor (hello's answer)."""
        return {"path": f"/proc/{os.getpid()}/fd/{self.fd}", "token": self.token, "size": self.size,
                "tensors": [[t.offset, t.block_bytes, t.num_blocks] for t in tensors]}

    def close(self) -> None:
        try:
            os.close(self.fd)  # the mapping (and every tensor on it) stays valid
        except OSError:
            pass


@dataclass
class PeerRegion:
    """A producer's region, mapped read-only by a consumer."""

    mapping: mmap.mmap
    tensors: list[PoolTensor]
    token: str  # the producer's, read back from the region's header


def open_peer_region(description: dict[str, Any] | None) -> tuple[PeerRegion | None, str]:
    """Map a producer's region from its hello answer; (None, why) when this process cannot,
    e.g. another host, another user, another pid namespace, or a producer without one."""
    if not description:
        return None, "the prefill instance has no shared KV pool"
    path = str(description.get("path"))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return None, f"cannot open {path} ({e.strerror}): another host or user"
    try:
        if os.fstat(fd).st_size != description.get("size"):
            return None, f"{path} is not the prefill instance's region (size differs)"
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        return None, f"cannot map {path} ({e})"
    finally:
        os.close(fd)
    token = str(description.get("token", "")).encode()
    if not token or mapping[:len(token)] != token:
        mapping.close()
        return None, f"{path} is not the prefill instance's region (another pid namespace?)"
    tensors = [PoolTensor(*map(int, t)) for t in description.get("tensors", [])]
    if not tensors or any(t.offset < HEADER_BYTES or t.end > len(mapping) for t in tensors):
        mapping.close()
        return None, f"{path}: the described tensors do not fit the region"
    return PeerRegion(mapping, tensors, token.decode()), ""


def close_region(region: PeerRegion | None) -> None:
    """Unmap a producer's region; a view still alive (a failed copy's traceback) leaves it to the
    garbage collector."""
    if region is None:
        return
    try:
        region.mapping.close()
    except BufferError:
        pass
