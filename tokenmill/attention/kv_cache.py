"""The paged KV cache as an object: per layer K and V blocks (and, for 8-bit formats,
their scales), with the bytes per token that KV capacity is computed from.

Layout per layer: K and V as [num_blocks, block_size, num_kv_heads, head_dim]; a token's
slot is `block_id * block_size + offset` in the flattened [slots, heads, head_dim] view.
8-bit caches (int8, fp8 e4m3; see kv_quant.py) keep one float16 scale per (token, KV head)
beside them, [num_blocks, num_kv_heads, block_size] (a block's scales of one head side by
side, as the native kernel applies them), and may hold K and V Hadamard-rotated.

A bf16 cache may instead be *packed* (`KVCacheSpec.packed`): each block as the native bf16
prefill kernel (cpu_prefill_attention.cpp) reads keys, K as [num_kv_heads, block_size / 16,
head_dim / 2, 16, 2] (per 16 keys, one vector of their (2p, 2p + 1) column pairs per p) and V as
[num_kv_heads, block_size / 2, head_dim, 2] (per two keys, their columns interleaved). Then
prompt chunks read their keys where they are, with no packing per step, and a decode token
attends by the same arithmetic as a prompt token (the same bits for the same token, whichever
step computes it).
Everything that writes or reads the cache in PyTorch goes through `LayerKVCache.write` and
`LayerKVCache.read`; the native kernels take the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tokenmill.attention import kv_quant
from tokenmill.kernels.huge_pages import HugePageArena, available as huge_pages_available, empty as huge_pages_empty
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
    packed: bool = False  # bf16 blocks in the prefill kernel's layout (module doc)

    def __post_init__(self) -> None:
        if self.rotation and (not self.quantized or self.head_dim % self.rotation):
            raise ValueError(f"a rotation of {self.rotation} needs an 8-bit cache whose head_dim is a multiple of it")
        if self.packed and not can_pack(self.dtype, self.block_size, self.head_dim):
            raise ValueError(f"a packed KV cache needs bfloat16, a block_size that is a multiple of 16 and an even "
                             f"head_dim, not {dtype_name(self.dtype)}, {self.block_size} and {self.head_dim}")

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
            return f"{name}, packed for the prefill kernel" if self.packed else name
        rotated = f", Hadamard-{self.rotation} rotated" if self.rotation else ""
        return f"{name} + {str(kv_quant.SCALE_DTYPE).removeprefix('torch.')} scale per (token, head){rotated}"


def can_pack(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    return dtype == torch.bfloat16 and block_size % 16 == 0 and head_dim % 2 == 0


def packed_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], ...]:
    """K's and V's shapes in the packed layout (module doc)."""
    return ((num_blocks, num_kv_heads, block_size // 16, head_dim // 2, 16, 2),
            (num_blocks, num_kv_heads, block_size // 2, head_dim, 2))


def packed_as_tokens(x: torch.Tensor) -> torch.Tensor:
    """Packed K [n, heads, block_size / 16, d / 2, 16, 2] or V [n, heads, block_size / 2, d, 2]
    blocks as [n, block_size, heads, d] (a copy)."""
    if x.dim() == 6:
        n, heads, groups, pairs = x.shape[:4]
        return x.permute(0, 2, 4, 1, 3, 5).reshape(n, groups * 16, heads, pairs * 2)
    n, heads, key_pairs, d = x.shape[:4]
    return x.permute(0, 2, 4, 1, 3).reshape(n, key_pairs * 2, heads, d)


def tokens_as_packed(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[n, block_size, heads, d] blocks in the packed layout of `like` (a packed K or V)."""
    n, block_size, heads, d = x.shape
    if like.dim() == 6:
        return x.reshape(n, block_size // 16, 16, heads, d // 2, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return x.reshape(n, block_size // 2, 2, heads, d).permute(0, 3, 1, 4, 2).contiguous()


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
                 empty: TensorAllocator | None = None, packed: bool = False) -> LayerKVCache:
        # Zeroed, not empty: padded decode reads touch unwritten slots (masked out, but
        # garbage NaNs would still poison the weighted sum). On huge pages (CPU): advised
        # before the zeros first touch them (kernels/huge_pages.py; paged attention reads
        # blocks scattered over the pool, 1.1-1.3x faster on 2 MiB pages on a Zen 4).
        # `empty`: where else the tensors live (a disaggregated producer's shared memory).
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        empty = empty or (huge_pages_empty if huge_pages else torch.empty)
        if packed:
            k_shape, v_shape = packed_shapes(num_blocks, block_size, num_kv_heads, head_dim)
            return cls(empty(k_shape, dtype=dtype, device=device).zero_(), empty(v_shape, dtype=dtype, device=device).zero_())
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
    def packed(self) -> bool:
        return self.k.dim() == 6

    @property
    def block_size(self) -> int:
        return self.v.shape[2] * 2 if self.packed else self.k.shape[1]

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.k_scale is None else (self.k_scale, self.v_scale)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """K and V rows [tokens, kv_heads, head_dim] (already rotated if the cache is) into
        their slots: cast to the cache dtype, or quantized with a scale per (token, head)."""
        if self.packed:
            k_at, v_at = self._packed_index(slots)
            self.k[k_at] = rows_as_pairs(k.to(self.k.dtype))
            self.v[v_at] = v.to(self.v.dtype)
            return
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
        if self.packed:
            k_at, v_at = self._packed_index(slots)
            k = self.k[k_at]  # [*slots.shape, heads, d / 2, 2]
            return k.reshape(*k.shape[:-2], -1).to(dtype), self.v[v_at].to(dtype)
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            rows = cache.view(-1, *cache.shape[2:])[slots]
            if scales is None:
                out.append(rows.to(dtype))
            else:
                out.append(kv_quant.dequantize(rows, scales.view(-1)[self.scale_index(slots)], dtype))
        return out[0], out[1]

    def _packed_index(self, slots: torch.Tensor) -> tuple[tuple, tuple]:
        """Indices of the slots' K and V in the packed tensors: K[k_at] is [*slots.shape,
        heads, d / 2, 2], V[v_at] [*slots.shape, heads, d]."""
        block, j = slots // self.block_size, slots % self.block_size
        everything = slice(None)
        return (block, everything, j // 16, everything, j % 16), (block, everything, j // 2, everything, j % 2)

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


def rows_as_pairs(rows: torch.Tensor) -> torch.Tensor:
    """K rows [..., heads, d] as [..., heads, d / 2, 2] (the packed K's column pairs)."""
    return rows.reshape(*rows.shape[:-1], rows.shape[-1] // 2, 2)


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

        def allocate(empty: TensorAllocator | None) -> list[LayerKVCache]:
            return [
                LayerKVCache.allocate(self.num_sliding_blocks if i in self.sliding_layers else num_blocks,
                                      spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype, device,
                                      spec.rotation, huge_pages, empty, packed=spec.packed and i not in self.sliding_layers)
                for i in range(spec.num_layers)
            ]

        if empty is None and huge_pages and torch.device(device).type == "cpu" and huge_pages_available():
            empty = self._huge_page_arena(allocate)
        self.layers = allocate(empty)

    @staticmethod
    def _huge_page_arena(allocate: Callable[[TensorAllocator], list[LayerKVCache]]) -> TensorAllocator:
        """Every layer's tensors in one huge-page arena, sized by allocating them as meta
        tensors first (each tensor on 2 MiB pages of its own rounds each up to whole pages)."""
        tensors: list[torch.Tensor] = []

        def measure(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
            tensors.append(torch.empty(shape, dtype=dtype, device="meta"))
            return tensors[-1]

        allocate(measure)
        return HugePageArena(HugePageArena.measure(tensors)).empty

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
