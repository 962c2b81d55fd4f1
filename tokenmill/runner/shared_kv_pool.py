"""The KV pool's side of disaggregation on one host (kv_transfer/shared_memory.py): a producer's
pool carved from its shared region, and a consumer's copy of blocks from a producer's mapped
pool into its own."""

from __future__ import annotations

import warnings

import torch

from tokenmill.attention.kv_cache import PagedKVCache, TensorAllocator
from tokenmill.kv_transfer.shared_memory import PeerRegion, PoolTensor, SharedRegion
from tokenmill.runner.kv_offload import COPY_IN_CHUNK, as_words, block_tensors, word_dtype


def shared_allocator(region: SharedRegion) -> TensorAllocator:
    """torch.empty's signature, each tensor a view of the next bytes of the region (CPU)."""

    def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        if torch.device(device).type != "cpu":
            raise ValueError("a shared-memory KV pool is CPU memory")
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        offset = region.allocate(nbytes)
        return torch.frombuffer(region.mapping, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)

    return empty


def pool_layout(region: SharedRegion, kv_cache: PagedKVCache) -> list[PoolTensor]:
    """Where each of the pool's tensors (block_tensors' order) lies in the region."""
    base = torch.frombuffer(region.mapping, dtype=torch.uint8, count=1).data_ptr()
    layout = []
    for tensor in block_tensors(kv_cache):
        offset = tensor.data_ptr() - base
        if not 0 <= offset < region.size:
            raise ValueError("the KV pool is not in the shared region")
        layout.append(PoolTensor(offset, tensor[0].numel(), tensor.shape[0]))
    return layout


def peer_tensors(peer: PeerRegion, words: torch.dtype) -> list[torch.Tensor]:
    """The producer's pool tensors as [blocks, words] views of its read-only mapping."""
    with warnings.catch_warnings():  # read-only: nothing here writes them
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return [torch.frombuffer(peer.mapping, dtype=torch.uint8, count=t.block_bytes * t.num_blocks,
                                 offset=t.offset).view(t.num_blocks, t.block_bytes).view(words) for t in peer.tensors]


def copy_from_peer(pool: list[torch.Tensor], peer: PeerRegion, remote_blocks: list[int],
                   local_blocks: list[int]) -> None:
    """Blocks of a producer's pool (mapped) into these blocks of this pool, tensor by tensor,
    as words (kv_offload.word_dtype): an index_select of up to COPY_IN_CHUNK blocks into a
    small staging buffer (one tensor's blocks: 192 KiB for the default model's bfloat16 K,
    cache-resident), then an index_copy_."""
    words = word_dtype(pool)
    if len(peer.tensors) != len(pool) or any(t.block_bytes != p[0].numel() for t, p in zip(peer.tensors, pool)):
        raise RuntimeError("the prefill instance's pool tensors differ from this instance's")
    remote = peer_tensors(peer, words)
    staging = torch.empty(COPY_IN_CHUNK * max(r.shape[1] for r in remote), dtype=words)
    for start in range(0, len(remote_blocks), COPY_IN_CHUNK):
        source = torch.tensor(remote_blocks[start:start + COPY_IN_CHUNK], dtype=torch.long)
        target = torch.tensor(local_blocks[start:start + COPY_IN_CHUNK], dtype=torch.long)
        if int(source.max()) >= remote[0].shape[0]:
            raise RuntimeError(f"block {int(source.max())} is past the prefill instance's pool")
        for local, theirs in zip(pool, remote):
            staged = staging[:len(source) * theirs.shape[1]].view(len(source), theirs.shape[1])
            torch.index_select(theirs, 0, source, out=staged)
            as_words(local, words).index_copy_(0, target, staged)
