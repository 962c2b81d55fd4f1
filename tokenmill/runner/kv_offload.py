"""The host tier's memory and copies: the runner side of tokenmill's KV connector.

The engine's `HostTier` (torch-free) decides which pool block goes to which host slot
and back; each step's `KVTransfers` reach the runner with the `SchedulerOutput`, and
`HostKVBuffer.apply` makes the copies before the step's forward: every store (pool ->
host) first, then every load (host -> pool). The buffer keeps, per layer, each cache
tensor's blocks (K, V and an 8-bit cache's scales) as bytes, `[num_host_blocks, ...]`,
allocated when the first transfer names the tier's size (so engines sharing a runner
size it from their own settings).
"""

from __future__ import annotations

import logging

import torch

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.engine.batch import KVTransfers
from tokenmill.engine.kv_tiers import encode_block_file, write_block_file

logger = logging.getLogger(__name__)


def _block_tensors(kv_cache: PagedKVCache) -> list[torch.Tensor]:
    """Every tensor of the cache indexed by block, viewed as bytes (index_copy_ has no
    float8 kernel; bytes copy any dtype)."""
    tensors = []
    for layer in kv_cache:
        for t in (layer.k, layer.v, layer.k_scale, layer.v_scale):
            if t is not None:
                tensors.append(t.view(torch.uint8))
    return tensors


class HostKVBuffer:
    def __init__(self, kv_cache: PagedKVCache) -> None:
        if kv_cache.num_sliding_blocks:
            raise ValueError("the host KV tier does not take a hybrid KV cache (sliding-window layers)")
        self.pool = _block_tensors(kv_cache)
        self.host: list[torch.Tensor] = []
        self.num_blocks = 0
        self.disk_write_failed = False  # warned once

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.host)

    def apply(self, transfers: KVTransfers) -> None:
        if transfers.num_host_blocks != self.num_blocks:
            self._allocate(transfers.num_host_blocks)
        device = self.pool[0].device
        for slot, block, path, block_hash in transfers.spill:  # before any copy overwrites its source
            if slot is not None:
                payload = b"".join(host[slot].numpy().tobytes() for host in self.host)
            else:
                payload = self.block_bytes(block)
            self._write(path, encode_block_file(transfers.disk_header, block_hash, payload))
        if transfers.store:
            blocks, slots = zip(*transfers.store)
            blocks, slots = _index(blocks, device), _index(slots, "cpu")
            for pool, host in zip(self.pool, self.host):
                host.index_copy_(0, slots, pool.index_select(0, blocks).to("cpu"))
        if transfers.load:
            slots, blocks = zip(*transfers.load)
            slots, blocks = _index(slots, "cpu"), _index(blocks, device)
            for pool, host in zip(self.pool, self.host):
                pool.index_copy_(0, blocks, host.index_select(0, slots).to(device))
        for payload, block in (*transfers.disk_load, *transfers.remote_load):  # verified by the engine
            self._copy_in(payload, block)

    def _copy_in(self, payload: bytes, block: int) -> None:
        """One block's bytes (every cache tensor's, in order) into pool block `block`."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for pool in self.pool:
            n = pool[block].numel()
            pool[block].copy_(data[offset: offset + n].view(pool.shape[1:]))
            offset += n

    def block_bytes(self, block: int) -> bytes:
        """Pool block `block` as bytes: every cache tensor's (K, V, an 8-bit cache's scales), in
        the order `_copy_in` reads them (the disk tier's files, a disaggregated producer's replies)."""
        return b"".join(t[block].cpu().numpy().tobytes() for t in self.pool)

    def _write(self, path: str, data: bytes) -> None:
        try:
            write_block_file(path, data)
        except OSError as e:  # a full disk or a directory gone read-only: the block is recomputed later
            if not self.disk_write_failed:
                logger.warning("disk KV tier: cannot write %s (%s); those blocks will be recomputed", path, e)
            self.disk_write_failed = True

    def _allocate(self, num_blocks: int) -> None:
        # Not zeroed: a slot is always written before it is read. Host memory: pinned on a
        # GPU machine would let the copies overlap compute; plain here (CPU pool).
        self.host = [torch.empty((num_blocks, *t.shape[1:]), dtype=torch.uint8) for t in self.pool]
        self.num_blocks = num_blocks


def _index(ids: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)
