"""The host tier's memory and copies: the runner side of tokenmill's KV connector.

The engine's `HostTier` (torch-free) decides which pool block goes to which host slot
and back; each step's `KVTransfers` reach the runner with the `SchedulerOutput`, and
`HostKVBuffer.apply` makes the copies before the step's forward: every store (pool ->
host) first, then every load (host -> pool). The buffer keeps, per layer, each cache
tensor's blocks (K, V and an 8-bit cache's scales) as bytes, `[num_host_blocks, ...]`,
allocated when the first transfer names the tier's size (so engines sharing a runner
size it from their own settings).

With `--kv-offloading-cache-dtype int8|fp8` (`host_spec`) the tiers keep a 16- or 32-bit
pool's blocks in the 8-bit cache format instead (codes, a float16 scale per token and KV
head, Hadamard-rotated): a store quantizes (`kv_quant`, the reference of the 8-bit cache's
write), a load dequantizes into the pool's dtype, and the disk tier's files hold the 8-bit
bytes too. Lossy, as an 8-bit KV cache is; the pool keeps computing in its own dtype.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.attention import kv_quant
from tokenmill.attention.kv_cache import KVCacheSpec, LayerKVCache, PagedKVCache, packed_as_tokens, tokens_as_packed
from tokenmill.engine.batch import KVTransfers
from tokenmill.engine.kv_tiers import encode_block_file, write_block_file

logger = logging.getLogger(__name__)


def block_tensors(kv_cache: PagedKVCache) -> list[torch.Tensor]:
    """Every tensor of the cache indexed by block, viewed as bytes (index_copy_ has no
    float8 kernel; bytes copy any dtype)."""
    tensors = []
    for layer in kv_cache:
        for t in (layer.k, layer.v, layer.k_scale, layer.v_scale):
            if t is not None:
                tensors.append(t.view(torch.uint8))
    return tensors


COPY_IN_CHUNK = 32  # blocks staged at a time (11.8 MB of the default model's bfloat16 KV)
HOST_COPY_ROWS = 128  # blocks a host-tier copy stages at a time, at most (47 MB of the default model's bf16 KV)
HOST_COPY_STAGING_BYTES = 64 << 20  # and at most this much staging memory (an 8B model's 2 MB blocks: 32 rows)


def word_dtype(pool: list[torch.Tensor]) -> torch.dtype:
    """The widest integer (up to 4 bytes) whose size divides every pool tensor's bytes per
    block. Block copies move words, not bytes: index_select + index_copy_ of a 2,048-token
    prompt's 47.2 MB (the default model, 60 tensors) take 41 ms as uint8, 16 ms as int16 and
    8 ms as int32 on one Zen 4 core."""
    for dtype in (torch.int32, torch.int16):
        if all(t[0].numel() % dtype.itemsize == 0 for t in pool):
            return dtype
    return torch.uint8


def as_words(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [blocks, ...] byte tensor (or a [blocks, bytes] slice with word-aligned rows) as
    [blocks, words] of `dtype`, a view."""
    return rows.reshape(rows.shape[0], -1).view(dtype)


def copy_in_blocks(pool: list[torch.Tensor], payloads: list[bytes], blocks: list[int],
                   staging: torch.Tensor | None = None) -> None:
    """Blocks' bytes (each every cache tensor's, in `block_bytes`' order) into these pool
    blocks: up to COPY_IN_CHUNK payloads at a time are staged in one [blocks, bytes] tensor
    (`staging`, reused by a caller that copies often: a fresh one costs its page faults),
    then one index_copy_ of words per cache tensor writes them all, where a copy per block and
    tensor made 7,680 small copies for a 2,048-token prompt of the default model (128 blocks,
    47.2 MB; on one core of the loaded 2-core EPYC 77-79 ms staged as bytes, 78-164 ms per block)."""
    if not blocks:
        return
    size = len(payloads[0])
    if staging is None or staging.shape[1] != size:
        staging = torch.empty((min(COPY_IN_CHUNK, len(blocks)), size), dtype=torch.uint8)
    rows = staging.numpy()
    device = pool[0].device
    words = word_dtype(pool)
    for start in range(0, len(blocks), len(staging)):
        chunk = blocks[start:start + len(staging)]
        for i, payload in enumerate(payloads[start:start + len(chunk)]):
            rows[i] = np.frombuffer(payload, dtype=np.uint8)
        source = staging[:len(chunk)].to(device)
        index = torch.tensor(chunk, dtype=torch.long, device=device)
        offset = 0
        for tensor in pool:
            n = tensor[0].numel()
            as_words(tensor, words).index_copy_(0, index, source[:, offset:offset + n].view(words))
            offset += n


def read_blocks(pool: list[torch.Tensor], blocks: list[int]) -> list[bytes]:
    """These pool blocks as bytes, one entry per block in `block_bytes`' layout (what a
    disaggregated producer sends): COPY_IN_CHUNK blocks at a time gathered as words, one
    index_select per cache tensor, where a slice per block and tensor made 7,680 small copies
    for a 2,048-token prompt of the default model."""
    words = word_dtype(pool)
    size = sum(t[0].numel() for t in pool)
    out: list[bytes] = []
    for start in range(0, len(blocks), COPY_IN_CHUNK):
        chunk = blocks[start:start + COPY_IN_CHUNK]
        index = torch.tensor(chunk, dtype=torch.long, device=pool[0].device)
        staged = torch.empty((len(chunk), size), dtype=torch.uint8)
        offset = 0
        for tensor in pool:
            n = tensor[0].numel()
            staged[:, offset:offset + n].view(words).copy_(as_words(tensor, words).index_select(0, index).cpu())
            offset += n
        out += [row.tobytes() for row in staged.numpy()]
    return out


# The disk tier's writes run on a writer thread while the step computes. A disk that keeps
# up finishes a step's files before the step returns (the runner waits for them, at most
# DISK_WRITE_WAIT_SECONDS), so the next step's lookups find them. A disk that falls behind
# (files still queued when a step starts) is not waited for: writes queue in memory up to
# DISK_WRITE_BUFFER_BYTES and past that are dropped (the block is recomputed if it is ever
# wanted), so a slow disk never stalls the steps for more than one wait.
DISK_WRITE_BUFFER_BYTES = 256 * 2**20
DISK_WRITE_WAIT_SECONDS = 1.0


@dataclass
class DiskWriter:
    """Writes the disk tier's files on a background thread, in order. Reports each file
    written or not (dropped past `buffer_bytes`, or a failed write) through `take_report`,
    which the runner returns to the engine with the step's output."""

    buffer_bytes: int = DISK_WRITE_BUFFER_BYTES
    queued_bytes: int = 0
    written: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[tuple[str, bytes, bytes]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._warned_full = self._warned_error = False

    def submit(self, path: str, data: bytes, block_hash: bytes) -> None:
        with self._lock:
            if self.queued_bytes and self.queued_bytes + len(data) > self.buffer_bytes:
                self.failed.append(block_hash)
                if not self._warned_full:
                    logger.warning("disk KV tier: the disk writes slower than blocks arrive (%d MiB waiting); "
                                   "dropping writes until it catches up (those blocks are recomputed)",
                                   self.queued_bytes >> 20)
                    self._warned_full = True
                return
            self.queued_bytes += len(data)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenmill-kv-disk-write", daemon=True)
            self._thread.start()
        self._queue.put((path, data, block_hash))

    def take_report(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes written, hashes not written) since the last call."""
        with self._lock:
            written, failed, self.written, self.failed = self.written, self.failed, [], []
        return written, failed

    @property
    def behind(self) -> bool:
        """Files of earlier steps still queued: the disk does not keep up."""
        with self._lock:
            return self.queued_bytes > 0

    def wait(self, timeout: float) -> bool:
        """Wait until every queued file is written (or failed), at most `timeout` seconds:
        True when none is left."""
        with self._idle:
            return self._idle.wait_for(lambda: not self.queued_bytes, timeout)

    def _run(self) -> None:
        while True:
            path, data, block_hash = self._queue.get()
            try:
                write_block_file(path, data)
                ok = True
            except OSError as e:  # a full disk or a directory gone read-only: the block is recomputed later
                ok = False
                if not self._warned_error:
                    logger.warning("disk KV tier: cannot write %s (%s); those blocks will be recomputed", path, e)
                    self._warned_error = True
            with self._lock:
                self.queued_bytes -= len(data)
                (self.written if ok else self.failed).append(block_hash)
                if not self.queued_bytes:
                    self._warned_full = False  # caught up: a later backlog warns again
                    self._idle.notify_all()
            self._queue.task_done()


class HostKVBuffer:
    def __init__(self, kv_cache: PagedKVCache, host_spec: KVCacheSpec | None = None) -> None:
        if kv_cache.num_sliding_blocks:
            raise ValueError("the host KV tier does not take a hybrid KV cache (sliding-window layers)")
        self.kv_cache = kv_cache
        self.pool = block_tensors(kv_cache)
        self.host_spec = host_spec  # None: the tiers keep the pool's own bytes
        self.host: list[torch.Tensor] = []  # per pool tensor (or, 8-bit, per tensor of the 8-bit format), as bytes
        self.num_blocks = 0
        self.words = word_dtype(self.pool)  # what the copies move (the host tensors' rows divide the same way)
        self.disk_writer = DiskWriter()
        self.staging: list[torch.Tensor] = []  # per pool tensor: rows of its copies (`_copy_rows`)
        self.wait_for_writes = False  # this step's files: wait for them at its end (the disk keeps up)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.host)

    def apply(self, transfers: KVTransfers) -> None:
        if transfers.num_host_blocks != self.num_blocks:
            self._allocate(transfers.num_host_blocks)
        device = self.pool[0].device
        self.wait_for_writes = bool(transfers.spill) and not self.disk_writer.behind
        for slot, block, path, block_hash, record in transfers.spill:  # before any copy overwrites its source
            if slot is not None:
                payload = b"".join(host[slot].numpy().tobytes() for host in self.host)
            else:
                payload = self.tier_block_bytes(block)
            self.disk_writer.submit(path, encode_block_file(transfers.disk_header, block_hash, payload, record),
                                    block_hash)
        words = self.words
        staged = self.host_spec is None and device.type == "cpu"  # the pool's bytes, host memory both sides
        if transfers.store:
            blocks, slots = zip(*transfers.store)
            blocks, slots = _index(blocks, device), _index(slots, "cpu")
            if staged:
                self._copy_rows(self.pool, blocks, self.host, slots)
            else:
                for rows, host in zip(self._tier_rows(blocks), self.host):
                    as_words(host, words).index_copy_(0, slots, as_words(rows, words).to("cpu"))
        if transfers.load:
            slots, blocks = zip(*transfers.load)
            slots, blocks = _index(slots, "cpu"), _index(blocks, device)
            if staged:
                self._copy_rows(self.host, slots, self.pool, blocks)
            else:
                self._put_tier_rows(blocks, [as_words(host, words).index_select(0, slots).to(device)
                                             .view(torch.uint8).view(len(slots), *host.shape[1:])
                                             for host in self.host])
        for payload, block in transfers.disk_load:  # verified by the engine; in the tiers' format
            self._put_tier_rows(_index((block,), device), self._split(payload, self.host, device))
        if transfers.remote_load:  # a disaggregated producer's: the pool's layout
            payloads, blocks = zip(*transfers.remote_load)
            copy_in_blocks(self.pool, list(payloads), list(blocks))

    def _copy_rows(self, sources: list[torch.Tensor], source_rows: torch.Tensor, targets: list[torch.Tensor],
                   target_rows: torch.Tensor) -> None:
        """targets[i][target_rows] = sources[i][source_rows], as words, up to HOST_COPY_ROWS rows
        at a time through staging rows kept for the next copy: a fresh tensor per copy faulted its
        pages in every time (the default model's 280-block load: 49 ms, staged 14 ms); fewer
        rows a chunk cost more calls than they saved (32: a 50-block load 15% slower)."""
        words = self.words
        chunk = max(1, min(HOST_COPY_ROWS, HOST_COPY_STAGING_BYTES // sum(t[0].numel() for t in sources)))
        for i, (source, target) in enumerate(zip(sources, targets)):
            source, target = as_words(source, words), as_words(target, words)
            if len(self.staging) <= i:
                self.staging.append(torch.empty((chunk, source.shape[1]), dtype=words))
            for start in range(0, len(source_rows), chunk):
                picked = source_rows[start:start + chunk]
                rows = self.staging[i][: len(picked)]
                torch.index_select(source, 0, picked, out=rows)
                target.index_copy_(0, target_rows[start:start + chunk], rows)

    def finish_step(self) -> tuple[list[bytes], list[bytes]]:
        """At a step's end: wait for its files if the disk keeps up, then the writer's report
        (hashes written, hashes not written) for the engine."""
        if self.wait_for_writes:
            self.wait_for_writes = False
            self.disk_writer.wait(DISK_WRITE_WAIT_SECONDS)
        return self.disk_writer.take_report()

    @staticmethod
    def _split(payload: bytes, like: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """One block's bytes cut into a row [1, ...] of each tensor of `like` (in order)."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows, offset = [], 0
        for t in like:
            n = t[0].numel()
            rows.append(data[offset: offset + n].view(1, *t.shape[1:]).to(device))
            offset += n
        return rows

    def block_bytes(self, block: int) -> bytes:
        """Pool block `block` as bytes: every cache tensor's (K, V, an 8-bit cache's scales), in
        the order `copy_in_blocks` reads them (a disaggregated producer's replies)."""
        return b"".join(t[block].cpu().numpy().tobytes() for t in self.pool)

    def tier_block_bytes(self, block: int) -> bytes:
        """Pool block `block` as the tiers keep it (a disk-tier file's payload)."""
        rows = self._tier_rows(_index((block,), self.pool[0].device))
        return b"".join(r[0].cpu().numpy().tobytes() for r in rows)

    # ----- the tiers' format -----------------------------------------------------------

    def _tier_rows(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        """These pool blocks as the tiers keep them: one uint8 tensor [len(blocks), ...] per
        host tensor (the pool's bytes, or the 8-bit format's codes and scales)."""
        if self.host_spec is None:  # as words (word_dtype): the same bytes, moved 4 at a time
            return [as_words(pool, self.words).index_select(0, blocks) for pool in self.pool]
        rows = []
        for layer in self.kv_cache:
            for cache in (layer.k, layer.v):
                x = cache.index_select(0, blocks)  # [n, block_size, heads, head_dim]
                x = packed_as_tokens(x) if layer.packed else x
                if self.host_spec.rotation:
                    x = kv_quant.rotate(x.float(), self.host_spec.rotation)
                codes, scales = kv_quant.quantize(x, self.host_spec.dtype)  # scales [n, block_size, heads]
                rows += [codes.view(torch.uint8), scales.transpose(1, 2).contiguous().view(torch.uint8)]
        return [rows[i] for i in self._host_order()]

    def _put_tier_rows(self, blocks: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """The inverse of `_tier_rows`: tier-format rows into these pool blocks."""
        if self.host_spec is None:
            for pool, r in zip(self.pool, rows):
                as_words(pool, self.words).index_copy_(0, blocks, as_words(r, self.words))
            return
        rows = dict(zip(self._host_order(), rows))
        i = 0
        for layer in self.kv_cache:
            for cache in (layer.k, layer.v):
                codes = rows[i].view(self.host_spec.dtype)
                scales = rows[i + 1].view(kv_quant.SCALE_DTYPE).transpose(1, 2)
                x = kv_quant.dequantize(codes, scales)
                if self.host_spec.rotation:
                    x = kv_quant.rotate(x, self.host_spec.rotation)  # H is its own inverse
                x = tokens_as_packed(x, cache) if layer.packed else x
                cache.index_copy_(0, blocks, x.to(cache.dtype))
                i += 2

    def _host_order(self) -> list[int]:
        """K codes, V codes, K scales, V scales per layer: an 8-bit pool's tensor order
        (`block_tensors`), so a tier file reads like an 8-bit pool's block."""
        order = []
        for layer in range(len(self.kv_cache)):
            base = 4 * layer
            order += [base, base + 2, base + 1, base + 3]  # [k codes, k scales, v codes, v scales] -> k, v, ks, vs
        return order

    def _allocate(self, num_blocks: int) -> None:
        # Not zeroed: a slot is always written before it is read. Host memory: pinned on a
        # GPU machine would let the copies overlap compute; plain here (CPU pool).
        like = self.pool if self.host_spec is None else block_tensors(_one_block_cache(self.kv_cache, self.host_spec))
        self.host = [torch.empty((num_blocks, *t.shape[1:]), dtype=torch.uint8) for t in like]
        self.words = word_dtype(self.host)
        self.num_blocks = num_blocks


def _one_block_cache(kv_cache: PagedKVCache, spec: KVCacheSpec) -> list[LayerKVCache]:
    """One block of every layer in the 8-bit format (only its tensors' shapes are used)."""
    return [LayerKVCache.allocate(1, spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype, "cpu",
                                  spec.rotation) for _ in range(len(kv_cache))]


def _index(ids: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)
