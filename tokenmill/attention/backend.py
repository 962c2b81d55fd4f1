"""The attention backend interface and the per-step forward context.

A backend builds its metadata once per step from plain lists (the batch
layout), then, in every attention layer, writes the step's K/V into the paged
cache and attends over each request's cached context. The model reaches the
metadata through a scoped forward context, so it never sees requests.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """One step's batch, request by request, as plain lists built by the runner."""

    query_lens: list[int]  # tokens computed now, per request
    context_lens: list[int]  # tokens in the KV cache after this step, per request
    block_tables: list[list[int]]
    slot_mapping: list[int]  # per token: block_id * block_size + offset
    block_size: int

    @property
    def query_starts(self) -> list[int]:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts


class AttentionBackend(ABC):
    """Peers behind one interface: a CPU backend now, CUDA ones beside it later."""

    name: str

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> object: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # K, V: [blocks, block_size, kv_heads, head_dim]
        metadata: object,
        scale: float,
    ) -> torch.Tensor: ...  # [tokens, heads, head_dim]

    def decode_only(self, metadata: object) -> DecodeOnly | None:
        """The step in the form of a fused decode layer (kernels.llama_decode_layer), when
        every token is a decode and this backend can hand its cache walk over; else None."""
        return None


@dataclass
class DecodeOnly:
    """An all-decode step (token i is sequence i's next token), as a native decode layer
    reads it."""

    slots: torch.Tensor  # int64 [tokens]: where each token's K/V goes in the flattened cache
    block_tables: torch.Tensor  # int32 [tokens, max_blocks]
    context_lens: torch.Tensor  # int32 [tokens], including this token


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: object
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _context
    previous, _context = _context, ctx
    try:
        yield
    finally:
        _context = previous


def get_forward_context() -> ForwardContext | None:
    """None outside a runner step: attention then runs dense and causal over one
    sequence (the reference path used by tests)."""
    return _context
