"""The paged KV cache as an object: per layer K and V blocks (and, for 8-bit formats,
their scales), with the bytes per token that KV capacity is computed from.

Layout per layer: K and V as [num_blocks, block_size, num_kv_heads, head_dim]; a token's
slot is `block_id * block_size + offset` in the flattened [slots, heads, head_dim] view.
8-bit caches (int8, fp8 e4m3; see kv_quant.py) keep one float16 scale per (token, KV head)
beside them, [num_blocks, num_kv_heads, block_size] (a block's scales of one head side by
side, as the native kernel applies them), and may hold K and V Hadamard-rotated.
Everything that writes or reads the cache in PyTorch goes through `LayerKVCache.write` and
`LayerKVCache.read`; the native kernels take the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tokenmill.attention import kv_quant
from tokenmill.kernels.huge_pages import empty as huge_pages_empty
from tokenmill.dtypes import dtype_name

# (shape, dtype=, device=) -> an uninitialized tensor, as torch.empty
TensorAllocator = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # what K and V are stored in
    rotation: int = 0  # Hadamard block K and V are rotated by (8-bit formats); 0 = none

    def __post_init__(self) -> None:
        if self.rotation and (not self.quantized or self.head_dim % self.rotation):
            raise ValueError(f"a rotation of {self.rotation} needs an 8-bit cache whose head_dim is a multiple of it")

    @property
    def quantized(self) -> bool:
        return kv_quant.is_quantized(self.dtype)

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer, scales included."""
        scale = kv_quant.SCALE_DTYPE.itemsize if self.quantized else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * self.element_size + scale)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def describe(self) -> str:
        """e.g. 'bfloat16', 'int8 + float16 scale per (token, head), Hadamard-64 rotated'."""
        name = dtype_name(self.dtype)
        if not self.quantized:
            return name
        rotated = f", Hadamard-{self.rotation} rotated" if self.rotation else ""
        return f"{name} + {str(kv_quant.SCALE_DTYPE).removeprefix('torch.')} scale per (token, head){rotated}"


@dataclass
class LayerKVCache:
    """One layer's cache. Iterates as (k, v), so `k_cache, v_cache = layer_cache` works."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [blocks, kv_heads, block_size] float16, 8-bit formats only
    v_scale: torch.Tensor | None = None
    rotation: int = 0  # K and V stored rotated by the Hadamard matrix of this block (0 = not)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.k, self.v))

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", rotation: int = 0, huge_pages: bool = False,
                 empty: TensorAllocator | None = None) -> LayerKVCache:
        # Zeroed, not empty: padded decode reads touch unwritten slots (masked out, but
        # garbage NaNs would still poison the weighted sum). On huge pages (CPU): advised
        # before the zeros first touch them (kernels/huge_pages.py; paged attention reads
        # blocks scattered over the pool, 1.1-1.3x faster on 2 MiB pages on a Zen 4).
        # `empty`: where else the tensors live (a disaggregated producer's shared memory).
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        empty = empty or (huge_pages_empty if huge_pages else torch.empty)
        k, v = (empty(shape, dtype=dtype, device=device).zero_() for _ in range(2))
        if not kv_quant.is_quantized(dtype):
            return cls(k, v)
        scale_shape = (num_blocks, num_kv_heads, block_size)
        k_scale, v_scale = (empty(scale_shape, dtype=kv_quant.SCALE_DTYPE, device=device).zero_() for _ in range(2))
        return cls(k, v, k_scale, v_scale, rotation)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.k_scale is None else (self.k_scale, self.v_scale)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """K and V rows [tokens, kv_heads, head_dim] (already rotated if the cache is) into
        their slots: cast to the cache dtype, or quantized with a scale per (token, head)."""
        for rows, cache, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            flat = cache.view(-1, *cache.shape[2:])
            if scales is None:  # the cache may be narrower than the activations
                flat.index_copy_(0, slots, rows.to(flat.dtype))
                continue
            codes, row_scales = kv_quant.quantize(rows, cache.dtype)
            # index_copy_ has no float8 kernel: move the codes as bytes.
            flat.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
            scales.view(-1).index_copy_(0, self.scale_index(slots).flatten(), row_scales.flatten())

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots (any index shape) as [*slots.shape, kv_heads, head_dim]
        in `dtype`: as stored (rotated if the cache is), dequantized."""
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            rows = cache.view(-1, *cache.shape[2:])[slots]
            if scales is None:
                out.append(rows.to(dtype))
            else:
                out.append(kv_quant.dequantize(rows, scales.view(-1)[self.scale_index(slots)], dtype))
        return out[0], out[1]

    def scale_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Where the scales of the given slots' heads are in the flattened scales: [*slots.shape, heads]."""
        block_size, heads = self.k.shape[1], self.k.shape[2]
        first = (slots // block_size) * (heads * block_size) + slots % block_size
        return first.unsqueeze(-1) + torch.arange(heads, device=slots.device) * block_size

    def rotate_in(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Q, K and V as a rotated cache holds them (unchanged for one that is not)."""
        if not self.rotation:
            return q, k, v
        return tuple(kv_quant.rotate(t, self.rotation) for t in (q, k, v))

    def rotate_out(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output rotated back (H is its own inverse)."""
        return kv_quant.rotate(out, self.rotation) if self.rotation else out


class PagedKVCache:
    """Every layer's cache, allocated once. A hybrid cache (sliding-window layers) gives
    the layers in `sliding_layers` a pool of their own, `num_sliding_blocks` blocks, which
    their own block tables index (the engine's HybridKVBlockManager)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                 sliding_layers: frozenset[int] = frozenset(), num_sliding_blocks: int = 0,
                 huge_pages: bool = False, empty: TensorAllocator | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_sliding_blocks = num_sliding_blocks if sliding_layers else 0
        self.sliding_layers = sliding_layers if self.num_sliding_blocks else frozenset()
        self.device = device
        self.layers = [
            LayerKVCache.allocate(self.num_sliding_blocks if i in self.sliding_layers else num_blocks,
                                  spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype, device, spec.rotation,
                                  huge_pages, empty)
            for i in range(spec.num_layers)
        ]

    def __getitem__(self, layer: int) -> LayerKVCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerKVCache]:
        return iter(self.layers)

    @property
    def nbytes(self) -> int:
        per_layer_block = self.spec.bytes_per_block // self.spec.num_layers
        sliding = len(self.sliding_layers)
        return per_layer_block * (self.num_blocks * (self.spec.num_layers - sliding) + self.num_sliding_blocks * sliding)
