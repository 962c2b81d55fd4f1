"""The host tier's bookkeeping: the scheduler side of tokenmill's KV connector. Knows no
tensors (vLLM's offloading connector has the same split: the scheduler decides, the
worker copies).

The tier is `num_blocks` slots of host memory, each holding one pool block's KV (every
layer, scales included), keyed by the block's chained hash. The block manager stores a
hashed block here when it evicts it from the pool (a demotion) and loads one back when a
prefix lookup runs past the pool's hits into this tier (a promotion); the copies travel to
the runner as `batch.KVTransfers` in the step's `SchedulerOutput`. Least recently used out
first; a slot read by this step's loads is pinned until the step's transfers are taken, so
no store of the same step can reuse it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.engine.batch import KVTransfers

BlockHash = bytes

logger = logging.getLogger(__name__)


@dataclass
class TierStats:
    """Cumulative counts of one tier (vLLM's offloading metrics count the same things)."""

    hit_tokens: int = 0  # prompt tokens a prefix hit served from this tier
    stored_blocks: int = 0  # demotions: pool blocks copied in
    loaded_blocks: int = 0  # promotions: blocks copied back into the pool
    evicted_blocks: int = 0  # entries dropped to make room
    rejected_blocks: int = 0  # demotions refused (every slot pinned by this step's loads)


@dataclass
class HostTier:
    """LRU map of block hash -> host slot, and the transfers decided since the last step."""

    num_blocks: int
    bytes_per_block: int
    medium: str = "CPU"  # vLLM's name of the host medium in KV events
    disk: DiskTier | None = None  # where entries the LRU drops are written (None: dropped)
    entries: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)  # head: evicted first
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"the host KV tier needs room for at least one block ({self.bytes_per_block} bytes)")
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self._pinned: set[BlockHash] = set()
        self._store: dict[int, int] = {}  # host slot -> pool block (a reused slot keeps the last store)
        self._load: list[tuple[int, int]] = []
        self._spill: list[tuple[int | None, int | None, str, BlockHash]] = []  # (host slot | pool block, file, hash): dropped entries to write to disk
        self.removed: list[BlockHash] = []  # evicted since the events were last taken

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes_used(self) -> int:
        return len(self.entries) * self.bytes_per_block

    def store(self, block_hash: BlockHash, block_id: int) -> bool:
        """Demote pool block `block_id` (holding `block_hash`), evicted now. True when it
        is (or already was) in the tier."""
        if block_hash in self.entries:  # promoted earlier and unchanged since: nothing to copy
            self.entries.move_to_end(block_hash)
            return True
        slot = self._free_slots.pop() if self._free_slots else self._evict()
        if slot is None:
            self.stats.rejected_blocks += 1
            self._to_disk(block_hash, None, block_id)
            return False
        self.entries[block_hash] = slot
        self._store[slot] = block_id
        self.stats.stored_blocks += 1
        return True

    def load(self, hashes: Iterable[BlockHash], block_ids: Iterable[int]) -> None:
        """Promote: copy each hash's slot into the pool block given for it."""
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            self.entries.move_to_end(block_hash)
            self._load.append((self.entries[block_hash], block_id))
            self.stats.loaded_blocks += 1

    def pin(self, hashes: Iterable[BlockHash]) -> None:
        """Keep these entries (about to be loaded) in place until the step's transfers are taken."""
        self._pinned.update(hashes)

    def take_transfers(self) -> KVTransfers | None:
        """The copies decided since the last call (None: none); unpins everything."""
        self._pinned.clear()
        disk_load = self.disk.take_loads() if self.disk is not None else []
        if not self._store and not self._load and not self._spill and not disk_load:
            return None
        transfers = KVTransfers(self.num_blocks, [(b, s) for s, b in self._store.items()], self._load,
                                spill=self._spill, disk_load=disk_load,
                                disk_header=self.disk.fingerprint if self.disk is not None else b"")
        self._store, self._load, self._spill = {}, [], []
        return transfers

    def clear(self) -> None:
        self.removed.extend(self.entries)
        self.entries.clear()
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self._store.clear()
        self._spill.clear()
        if self.disk is not None:
            self.disk.clear()

    def _evict(self) -> int | None:
        for block_hash in self.entries:
            if block_hash not in self._pinned:
                slot = self.entries.pop(block_hash)
                stored_now = self._store.pop(slot, None)  # stored earlier in this step and already gone
                if stored_now is None:  # the slot holds its KV: to disk from there
                    self._to_disk(block_hash, slot, None)
                else:  # its KV never reached the slot: to disk from the evicted pool block
                    self._to_disk(block_hash, None, stored_now)
                self.removed.append(block_hash)
                self.stats.evicted_blocks += 1
                return slot
        return None

    def _to_disk(self, block_hash: BlockHash, slot: int | None, block_id: int | None) -> None:
        """A block dropped from this tier: written to the disk tier, if any, from its host slot
        or (its KV not copied here yet) its pool block; the runner writes before any copy."""
        path = self.disk.admit(block_hash) if self.disk is not None else None
        if path is not None:
            self._spill.append((slot, block_id, path, block_hash))

    def check_integrity(self) -> None:
        slots = list(self.entries.values())
        assert len(set(slots)) == len(slots), "two host entries share a slot"
        assert not set(slots) & set(self._free_slots), "a host slot is both used and free"
        assert len(slots) + len(self._free_slots) == self.num_blocks, "host slots lost"


# ----- the disk tier ------------------------------------------------------------------

FILE_MAGIC = b"TMKV1\0"
_HEADER = struct.Struct("<6s32s32sQ32s")  # magic, fingerprint, block hash, payload bytes, blake2b of payload


def kv_fingerprint(*parts: object) -> bytes:
    """32 bytes naming what a block's KV depends on besides its tokens (model, weight
    format, KV dtype and layout, block size, bytes per token = layers x heads x dims)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=32).digest()


def encode_block_file(fingerprint: bytes, block_hash: BlockHash, payload: bytes) -> bytes:
    """A disk-tier file: header (magic, fingerprint, block hash, length, checksum), then the KV bytes."""
    digest = hashlib.blake2b(payload, digest_size=32).digest()
    return _HEADER.pack(FILE_MAGIC, fingerprint, block_hash.ljust(32, b"\0")[:32], len(payload), digest) + payload


def decode_block_file(data: bytes, fingerprint: bytes, block_hash: BlockHash, payload_bytes: int) -> bytes | None:
    """The KV bytes of a file, or None when it is truncated, corrupt or another model's / block's."""
    if len(data) != _HEADER.size + payload_bytes:
        return None
    magic, fp, h, n, digest = _HEADER.unpack_from(data)
    if magic != FILE_MAGIC or fp != fingerprint or h != block_hash.ljust(32, b"\0")[:32] or n != payload_bytes:
        return None
    payload = data[_HEADER.size:]
    if hashlib.blake2b(payload, digest_size=32).digest() != digest:
        return None
    return payload


def write_block_file(path: str, data: bytes) -> None:
    """Write atomically (a temporary file renamed): a reader never sees half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


@dataclass
class DiskStats:
    hit_tokens: int = 0
    stored_blocks: int = 0  # files queued for writing (host-tier entries dropped to disk)
    loaded_blocks: int = 0  # blocks read back into the pool
    evicted_blocks: int = 0  # files deleted by the size cap (LRU)
    corrupt_blocks: int = 0  # files found truncated, corrupt or foreign: deleted, recomputed


@dataclass
class DiskTier:
    """Files of block KV below the host tier, one per chained block hash, in a directory
    keyed by the fingerprint (so a restarted engine with the same settings finds them).
    Bookkeeping and reads here (bytes, no tensors); the runner writes the files a step's
    `KVTransfers.spill` names. Least recently used out first past `max_bytes`. A directory
    that cannot be made or written disables the tier with one warning: the pool and the
    host tier keep serving."""

    root: str
    fingerprint: bytes
    bytes_per_block: int
    max_bytes: int
    medium: str = "DISK"
    entries: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)  # head: deleted first
    stats: DiskStats = field(default_factory=DiskStats)

    def __post_init__(self) -> None:
        self.directory = os.path.join(self.root, self.fingerprint.hex()[:32])
        self.file_bytes = _HEADER.size + self.bytes_per_block
        self.max_files = max(self.max_bytes // self.file_bytes, 0)
        self.enabled = True
        self._loads: list[tuple[bytes, int]] = []
        self._pending: set[BlockHash] = set()  # admitted, written by the runner in the coming step
        self.added: list[BlockHash] = []  # admitted since the events were last taken
        self.removed: list[BlockHash] = []  # dropped since then (size cap, corrupt or missing file)
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".probe.{os.getpid()}")
            write_block_file(probe, b"")
            os.remove(probe)
        except OSError as e:
            self.disable(f"{self.directory}: {e}")
            return
        found = []
        for name in os.listdir(self.directory):
            if name.endswith(".kv") and len(name) == 67:
                path = os.path.join(self.directory, name)
                try:
                    found.append((os.path.getmtime(path), bytes.fromhex(name[:64])))
                except (OSError, ValueError):
                    continue
        for _, block_hash in sorted(found):  # oldest first: the LRU head
            self.entries[block_hash] = None
        self._trim()
        self.removed.clear()  # files of an earlier run: never announced in this one's events
        if self.max_files < 1:
            self.disable(f"--kv-offloading-disk-size holds no block ({self.file_bytes} bytes a file)")

    def disable(self, reason: str) -> None:
        if self.enabled:
            logger.warning("the disk KV tier is off (%s); serving from the pool and the host tier", reason)
        self.enabled = False
        self.removed.extend(self.entries)
        self.entries.clear()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return self.enabled and block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes_used(self) -> int:
        return len(self.entries) * self.file_bytes

    def path(self, block_hash: BlockHash) -> str:
        return os.path.join(self.directory, block_hash.hex() + ".kv")

    def admit(self, block_hash: BlockHash) -> str | None:
        """A host entry dropped now: the file to write it to (None: already there, or no tier)."""
        if not self.enabled:
            return None
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        self.entries[block_hash] = None
        self._pending.add(block_hash)
        self.added.append(block_hash)
        self.stats.stored_blocks += 1
        self._trim()
        return self.path(block_hash)

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's KV bytes, verified; a missing, truncated, corrupt or foreign file is
        forgotten (and deleted): the caller recomputes."""
        if block_hash not in self or block_hash in self._pending:
            return None
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except OSError:
            del self.entries[block_hash]  # never written (a failed write) or deleted by someone
            self.removed.append(block_hash)
            return None
        payload = decode_block_file(data, self.fingerprint, block_hash, self.bytes_per_block)
        if payload is None:
            self.stats.corrupt_blocks += 1
            logger.warning("disk KV tier: %s is truncated, corrupt or foreign; deleted, recomputing", path)
            del self.entries[block_hash]
            self.removed.append(block_hash)
            self._remove(path)
            return None
        self.entries.move_to_end(block_hash)
        return payload

    def load(self, payloads: Iterable[bytes], block_ids: Iterable[int]) -> None:
        for payload, block_id in zip(payloads, block_ids, strict=True):
            self._loads.append((payload, block_id))
            self.stats.loaded_blocks += 1

    def take_loads(self) -> list[tuple[bytes, int]]:
        """The step's reads into the pool; the files admitted before now are written in this step."""
        self._pending.clear()
        loads, self._loads = self._loads, []
        return loads

    def clear(self) -> None:
        for block_hash in list(self.entries):
            self._remove(self.path(block_hash))
        self.entries.clear()
        self._loads.clear()
        self._pending.clear()
        self.added.clear()
        self.removed.clear()

    def _trim(self) -> None:
        while len(self.entries) > self.max_files:
            block_hash, _ = self.entries.popitem(last=False)
            self.removed.append(block_hash)
            self._remove(self.path(block_hash))
            self.stats.evicted_blocks += 1

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass
