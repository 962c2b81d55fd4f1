"""The paged KV cache as an object: per layer K and V blocks (and, for quantized
formats, their scales), with the bytes per token that KV capacity is computed from.

Layout per layer: K and V as [num_blocks, block_size, num_kv_heads, head_dim]; a token's
slot is `block_id * block_size + offset` in the flattened [slots, heads, head_dim] view.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # what K and V are stored in

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer (scales included once formats have them)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block


@dataclass
class LayerKVCache:
    """One layer's cache. Iterates as (k, v), so `k_cache, v_cache = layer_cache` works."""

    k: torch.Tensor
    v: torch.Tensor

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.k, self.v))

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype


class PagedKVCache:
    """Every layer's cache, allocated once."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeroed, not empty: padded decode reads touch unwritten slots (masked out, but
        # garbage NaNs would still poison the weighted sum).
        self.layers = [
            LayerKVCache(torch.zeros(shape, dtype=spec.dtype, device=device),
                         torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(spec.num_layers)
        ]

    def __getitem__(self, layer: int) -> LayerKVCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerKVCache]:
        return iter(self.layers)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block
