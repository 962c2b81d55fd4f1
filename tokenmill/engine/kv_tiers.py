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
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenmill.engine.batch import KVTransfers
from tokenmill.engine.kv_events import BlockMeta

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
    # What a KV event says of a block (the block manager's, when events are on): written
    # into its disk file, so a restarted engine can announce the file.
    meta_of: Callable[[BlockHash], BlockMeta | None] | None = None
    entries: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)  # head: evicted first
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"the host KV tier needs room for at least one block ({self.bytes_per_block} bytes)")
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self._pinned: set[BlockHash] = set()
        self._store: dict[int, int] = {}  # host slot -> pool block (a reused slot keeps the last store)
        self._load: list[tuple[int, int]] = []
        # (host slot | pool block, file, hash, record): dropped entries to write to disk
        self._spill: list[tuple[int | None, int | None, str, BlockHash, bytes]] = []
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
        if self.disk is None:
            return
        record = encode_block_record(self.meta_of(block_hash) if self.meta_of is not None else None)
        path = self.disk.admit(block_hash, record)
        if path is not None:
            self._spill.append((slot, block_id, path, block_hash, record))

    def check_integrity(self) -> None:
        slots = list(self.entries.values())
        assert len(set(slots)) == len(slots), "two host entries share a slot"
        assert not set(slots) & set(self._free_slots), "a host slot is both used and free"
        assert len(slots) + len(self._free_slots) == self.num_blocks, "host slots lost"


# ----- the disk tier ------------------------------------------------------------------

FILE_MAGIC = b"TMKV2\0"  # TMKV1 files (no record) read as foreign: deleted, recomputed
# magic, fingerprint, block hash, payload bytes, blake2b of record + payload, record bytes
_HEADER = struct.Struct("<6s32s32sQ32sI")
# The block's record, after the header: whether it has a parent, the parent hash, the extra
# key's UTF-8 bytes, the token count; then the extra key, then the token ids (int32). What a
# KV event says of the block, so a restarted engine can announce the files it finds.
_RECORD = struct.Struct("<B32sHH")


def kv_fingerprint(*parts: object) -> bytes:
    """32 bytes naming what a block's KV depends on besides its tokens (model, weight
    format, KV dtype and layout, block size, bytes per token = layers x heads x dims)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=32).digest()


def encode_block_record(meta: BlockMeta | None) -> bytes:
    """What a file says of its block besides its KV (b"": nothing known, e.g. events off)."""
    if meta is None:
        return b""
    extra = (meta.extra_key or "").encode()
    parent = meta.parent.ljust(32, b"\0")[:32] if meta.parent is not None else bytes(32)
    head = _RECORD.pack(meta.parent is not None, parent, len(extra), len(meta.token_ids))
    return head + extra + struct.pack(f"<{len(meta.token_ids)}i", *meta.token_ids)


def decode_block_record(record: bytes) -> BlockMeta | None:
    """The inverse of `encode_block_record` (None: no record, or one that does not parse)."""
    if len(record) < _RECORD.size:
        return None
    has_parent, parent, extra_len, num_tokens = _RECORD.unpack_from(record)
    if len(record) != _RECORD.size + extra_len + 4 * num_tokens:
        return None
    extra = record[_RECORD.size: _RECORD.size + extra_len]
    tokens = list(struct.unpack_from(f"<{num_tokens}i", record, _RECORD.size + extra_len))
    try:
        extra_key = extra.decode() if extra_len else None
    except UnicodeDecodeError:
        return None
    return BlockMeta(parent if has_parent else None, tokens, extra_key)


def encode_block_file(fingerprint: bytes, block_hash: BlockHash, payload: bytes, record: bytes = b"") -> bytes:
    """A disk-tier file: header (magic, fingerprint, block hash, length, checksum, record
    length), the block's record (`encode_block_record`), then the KV bytes."""
    digest = hashlib.blake2b(record + payload, digest_size=32).digest()
    header = _HEADER.pack(FILE_MAGIC, fingerprint, block_hash.ljust(32, b"\0")[:32], len(payload), digest, len(record))
    return header + record + payload


def decode_block_file(data: bytes, fingerprint: bytes, block_hash: BlockHash, payload_bytes: int) -> bytes | None:
    """The KV bytes of a file, or None when it is truncated, corrupt or another model's / block's."""
    if len(data) < _HEADER.size:
        return None
    magic, fp, h, n, digest, record_bytes = _HEADER.unpack_from(data)
    if (magic != FILE_MAGIC or fp != fingerprint or h != block_hash.ljust(32, b"\0")[:32] or n != payload_bytes
            or len(data) != _HEADER.size + record_bytes + payload_bytes):
        return None
    if hashlib.blake2b(data[_HEADER.size:], digest_size=32).digest() != digest:
        return None
    return data[_HEADER.size + record_bytes:]


def read_block_record(path: str, fingerprint: bytes) -> BlockMeta | None:
    """The record of a file, from its header alone (the KV is verified when it is read):
    None when the file has none, or is not this tier's."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) != _HEADER.size:
            return None
        magic, fp, _, _, _, record_bytes = _HEADER.unpack(head)
        if magic != FILE_MAGIC or fp != fingerprint or record_bytes > 1 << 20:
            return None
        return decode_block_record(f.read(record_bytes))


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
    read_ahead_blocks: int = 0  # files read in the background before their request was admitted
    dropped_writes: int = 0  # files not written: dropped behind a slow disk, or a failed write


@dataclass
class DiskTier:
    """Files of block KV below the host tier, one per chained block hash, in a directory
    keyed by the fingerprint (so a restarted engine with the same settings finds them).
    Bookkeeping and reads here (bytes, no tensors); the runner writes the files a step's
    `KVTransfers.spill` names. Least recently used out first past `max_bytes`. A directory
    that cannot be made or written disables the tier with one warning: the pool and the
    host tier keep serving. Each file carries its block's record (parent, tokens, extra key)
    when the engine knew it (KV events on): a restarted engine finds the files and `found`
    holds their records, for the block manager to announce on the DISK medium."""

    root: str
    fingerprint: bytes
    bytes_per_block: int
    max_bytes: int
    medium: str = "DISK"
    entries: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)  # -> file bytes; head: deleted first
    stats: DiskStats = field(default_factory=DiskStats)

    def __post_init__(self) -> None:
        self.directory = os.path.join(self.root, self.fingerprint.hex()[:32])
        self.file_bytes = _HEADER.size + self.bytes_per_block  # without a record (the smallest file)
        self.used_bytes = 0
        self.enabled = True
        self.found: dict[BlockHash, BlockMeta] = {}  # files of an earlier run, with a record: to announce
        self._loads: list[tuple[bytes, int]] = []
        self._pending: set[BlockHash] = set()  # admitted, not yet reported written (`writes_done`)
        # Read-ahead (`start_reads`): one background thread reads files a waiting request will
        # hit, so the engine thread never waits on the disk for them; the bytes wait here
        # (checked, and forgotten if bad, when `read` takes them, on the engine thread).
        self._reader: ThreadPoolExecutor | None = None
        self._read_lock = threading.Lock()
        self._read_done = threading.Condition(self._read_lock)
        self._raw: dict[BlockHash, bytes | None] = {}  # read ahead (None: the read failed)
        self._reading: set[BlockHash] = set()
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
        if self.max_bytes < self.file_bytes:
            self.disable(f"--kv-offloading-disk-size holds no block ({self.file_bytes} bytes a file)")
            return
        found = []
        for name in os.listdir(self.directory):
            if name.endswith(".kv") and len(name) == 67:
                path = os.path.join(self.directory, name)
                try:
                    stat = os.stat(path)
                    found.append((stat.st_mtime, bytes.fromhex(name[:64]), stat.st_size, read_block_record(path, self.fingerprint)))
                except (OSError, ValueError):
                    continue
        for _, block_hash, size, meta in sorted(found, key=lambda f: f[0]):  # oldest first: the LRU head
            self.entries[block_hash] = size
            self.used_bytes += size
            if meta is not None:
                self.found[block_hash] = meta
        self._trim()
        self.removed.clear()  # files of an earlier run dropped before anyone heard of them

    def disable(self, reason: str) -> None:
        if self.enabled:
            logger.warning("the disk KV tier is off (%s); serving from the pool and the host tier", reason)
        self.enabled = False
        self.removed.extend(self.entries)
        self.entries.clear()
        self.used_bytes = 0
        self.found.clear()
        self._drop_read_ahead(list(self._raw) + list(self._reading))

    def __contains__(self, block_hash: BlockHash) -> bool:
        return self.enabled and block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes_used(self) -> int:
        return self.used_bytes

    def path(self, block_hash: BlockHash) -> str:
        return os.path.join(self.directory, block_hash.hex() + ".kv")

    def admit(self, block_hash: BlockHash, record: bytes = b"") -> str | None:
        """A host entry dropped now: the file to write it to (None: already there, or no tier);
        `record`: what the file will say of the block (`encode_block_record`)."""
        if not self.enabled:
            return None
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        self.entries[block_hash] = size = self.file_bytes + len(record)
        self.used_bytes += size
        self._pending.add(block_hash)
        self.added.append(block_hash)
        self.stats.stored_blocks += 1
        self._trim()
        return self.path(block_hash)

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's KV bytes, verified; a missing, truncated, corrupt or foreign file is
        forgotten (and deleted): the caller recomputes."""
        if block_hash not in self or self.is_pending(block_hash):
            return None
        path = self.path(block_hash)
        with self._read_lock:
            ahead = self._raw.pop(block_hash, False)
        try:
            data = self._read_file(path, self.entries[block_hash]) if ahead is False else ahead
            if data is None:
                raise OSError("the read-ahead failed")
        except OSError:
            self._forget(block_hash)  # never written (a failed write) or deleted by someone
            return None
        payload = decode_block_file(data, self.fingerprint, block_hash, self.bytes_per_block)
        if payload is None:
            self.stats.corrupt_blocks += 1
            logger.warning("disk KV tier: %s is truncated, corrupt or foreign; deleted, recomputing", path)
            self._forget(block_hash)
            self._remove(path)
            return None
        self.entries.move_to_end(block_hash)
        return payload

    @staticmethod
    def _read_file(path: str, size: int) -> bytes:
        with open(path, "rb") as f:
            return f.read(size + 1)  # its size when written (or found): a longer file reads as corrupt

    # ----- read-ahead ------------------------------------------------------------------

    def start_reads(self, hashes: Iterable[BlockHash]) -> None:
        """Read these files in the background (each once; `read` takes the bytes later)."""
        jobs = [(h, self.path(h), self.entries[h]) for h in hashes
                if h in self and h not in self._raw and h not in self._reading and not self.is_pending(h)]
        if not jobs:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-kv-disk-read")
        with self._read_lock:
            self._reading.update(h for h, _, _ in jobs)
        self._reader.submit(self._read_in_background, jobs)

    def _read_in_background(self, jobs: list[tuple[BlockHash, str, int]]) -> None:
        for block_hash, path, size in jobs:
            try:
                data: bytes | None = self._read_file(path, size)
            except OSError:
                data = None
            with self._read_lock:
                if block_hash in self._reading:  # (not dropped meanwhile)
                    self._reading.discard(block_hash)
                    self._raw[block_hash] = data
                    self.stats.read_ahead_blocks += 1
                self._read_done.notify_all()

    def read_ahead(self, block_hash: BlockHash) -> bool:
        """Whether the block's file is read, or being read, in the background."""
        with self._read_lock:
            return block_hash in self._raw or block_hash in self._reading

    def reads_done(self, hashes: Iterable[BlockHash]) -> bool:
        with self._read_lock:
            return not self._reading.intersection(hashes)

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a background read finishes (or `timeout` seconds): an engine with
        nothing else to do waits here instead of spinning."""
        with self._read_lock:
            if self._reading:
                self._read_done.wait(timeout)

    def _drop_read_ahead(self, hashes: Iterable[BlockHash]) -> None:
        with self._read_lock:
            for h in hashes:
                self._raw.pop(h, None)
                self._reading.discard(h)

    def load(self, payloads: Iterable[bytes], block_ids: Iterable[int]) -> None:
        for payload, block_id in zip(payloads, block_ids, strict=True):
            self._loads.append((payload, block_id))
            self.stats.loaded_blocks += 1

    def take_loads(self) -> list[tuple[bytes, int]]:
        """The step's reads into the pool."""
        loads, self._loads = self._loads, []
        return loads

    def is_pending(self, block_hash: BlockHash) -> bool:
        """Admitted, its file not yet written by the runner's writer (a file renamed into
        place is written, whether or not its report came yet)."""
        if block_hash not in self._pending:
            return False
        if os.path.exists(self.path(block_hash)):
            self._pending.discard(block_hash)
            return False
        return True

    def writes_done(self, written: Iterable[BlockHash], failed: Iterable[BlockHash]) -> None:
        """The runner's writer report (with a step's output): files now on disk, and files
        not written (dropped behind a slow disk, or a failed write: forgotten, recomputed)."""
        for block_hash in written:
            self._pending.discard(block_hash)
            if block_hash not in self.entries:  # trimmed or cleared while it was being written
                self._remove(self.path(block_hash))
        for block_hash in failed:
            self._pending.discard(block_hash)
            self.stats.dropped_writes += 1
            if block_hash in self.entries:
                self._forget(block_hash)

    def clear(self) -> None:
        for block_hash in list(self.entries):
            self._remove(self.path(block_hash))
        self.entries.clear()
        self.used_bytes = 0
        self.found.clear()
        self._drop_read_ahead(list(self._raw) + list(self._reading))
        self._loads.clear()
        self._pending.clear()
        self.added.clear()
        self.removed.clear()

    def _trim(self) -> None:
        while self.used_bytes > self.max_bytes and self.entries:
            block_hash = next(iter(self.entries))
            self._forget(block_hash)
            self._remove(self.path(block_hash))
            self.stats.evicted_blocks += 1

    def _forget(self, block_hash: BlockHash) -> None:
        self._drop_read_ahead((block_hash,))
        self.used_bytes -= self.entries.pop(block_hash)
        self.found.pop(block_hash, None)
        self.removed.append(block_hash)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass
