"""The attention backend interface and the per-step forward context.

A backend builds its metadata once per step from plain lists (the batch layout), then,
in every attention layer, writes the step's K/V into the paged cache and attends over
each request's cached context. Backends are peers behind this interface (none
subclasses another). The model reaches the step's metadata through a forward context
scoped to the running thread (a ContextVar), so it never sees requests, and a second
engine or a draft model on another thread has its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tokenmill.attention.kv_cache import LayerKVCache, PagedKVCache
from tokenmill.engine.interrupt import StepInterrupt


@dataclass
class BatchLayout:
    """One step's batch, request by request, as plain lists built by the runner."""

    query_lens: list[int]  # tokens computed now, per request
    context_lens: list[int]  # tokens in the KV cache after this step, per request
    block_tables: list[list[int]]
    slot_mapping: list[int]  # per token: block_id * block_size + offset
    block_size: int
    # Requests that compute one token of their prompt and attend as a chunk, not as a decode
    # (ExecutionPlan.prompts_as_chunks): a prompt's token then attends through one kernel
    # whether the tokens before it came in its chunk or from the cache.
    one_token_chunks: frozenset[int] = frozenset()

    @property
    def query_starts(self) -> list[int]:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts

    def is_decode(self, i: int) -> bool:
        """Request i attends as a decode: one query row over its cached context."""
        return self.query_lens[i] == 1 and i not in self.one_token_chunks

    @property
    def decodes(self) -> list[int]:
        return [i for i in range(len(self.query_lens)) if self.is_decode(i)]

    @property
    def all_decode(self) -> bool:
        """Every request computes one token as a decode (a pure decode step)."""
        return not self.one_token_chunks and all(n == 1 for n in self.query_lens)


def padded_block_tables(tables: list[list[int]], width: int) -> list[list[int]]:
    """Each table cut or padded to `width` blocks; padding points at block 0, real (finite)
    cache memory that the context lengths keep out of reach."""
    return [t[:width] + [0] * (width - len(t[:width])) for t in tables]


class AttentionBackend(ABC):
    """Peers behind one interface: the CPU backends now, CUDA ones beside them later."""

    name: str
    # Prefill chunks' SDPA computes in this dtype (None: the activations'): the execution
    # plan's (`ExecutionPlan.prefill_attention_dtype`), through `for_plan`.
    prefill_dtype: torch.dtype | None = None

    def for_plan(self, prefill_dtype: torch.dtype | None) -> AttentionBackend:
        """This backend for a model whose plan computes prefill attention in `prefill_dtype`
        (a copy: a draft model's plan may differ from its target's)."""
        backend = copy.copy(self)
        backend.prefill_dtype = prefill_dtype
        return backend

    def chunk_invariant(self, head_dim: int) -> bool:
        """Whether a chunk's query row gets the same bits from this backend whatever the chunk
        (its other rows, where it starts, whether the keys before it come from the cache):
        then every prompt chunk attends as a chunk (ExecutionPlan.prompts_as_chunks)."""
        return False

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> object: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: object,
        scale: float,
        window: int | None = None,  # a sliding-window layer: each query sees its last `window` keys
    ) -> torch.Tensor: ...  # [tokens, heads, head_dim]


@dataclass
class PagedDecode:
    """A pure decode step (token i is sequence i's next token) in the form native fused
    decode layers read: the runner builds it once per step when the execution plan uses
    such a layer."""

    slots: torch.Tensor  # int64 [tokens]: where each token's K/V goes in the flattened cache
    block_tables: torch.Tensor  # int32 [tokens, max_blocks]
    context_lens: torch.Tensor  # int32 [tokens], including this token

    @classmethod
    def from_layout(cls, layout: BatchLayout, device: torch.device) -> PagedDecode:
        width = -(-max(layout.context_lens) // layout.block_size)
        return cls(
            slots=torch.tensor(layout.slot_mapping, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded_block_tables(layout.block_tables, width), dtype=torch.int32,
                                      device=device),
            context_lens=torch.tensor(layout.context_lens, dtype=torch.int32, device=device),
        )


class StepKind(enum.Enum):
    """What runs a step's decoder layers, as the execution plan names it (runner/plan.py,
    `ExecutionPlan.step_kind`); the model runs what it is told."""

    FUSED = "fused native decoder layer"  # one native op per layer (pure decode steps that fit)
    PER_OP = "per-op native"  # op by op: native element-wise ops, the weight format's kernels
    REFERENCE = "reference"  # op by op in plain PyTorch

    @property
    def fused(self) -> bool:
        return self is StepKind.FUSED


@dataclass
class ForwardContext:
    backend: AttentionBackend
    metadata: object  # the backend's, for op-by-op steps (None for fused ones)
    kv_cache: PagedKVCache | list[LayerKVCache]
    decode: PagedDecode | None = None  # a FUSED step's decode tensors
    kind: StepKind = StepKind.PER_OP
    # A hybrid KV cache: the sliding-window layers' metadata, over their own block tables.
    sliding_metadata: object | None = None
    # The plan's bf16 activation path for this step (ExecutionPlan.activation_dtype): the
    # decoder layers' activations in this dtype, the residual stream in the model's; None:
    # the model's dtype throughout.
    activation_dtype: torch.dtype | None = None
    # --priority-interrupt: the forward stops between layers once it is `requested`.
    interrupt: StepInterrupt | None = None

    @classmethod
    def for_step(cls, kind: StepKind, backend: AttentionBackend, layout: BatchLayout,
                 kv_cache: PagedKVCache | list[LayerKVCache], device: torch.device) -> ForwardContext:
        """The context of a step of `kind`: a fused step reads the decode tensors, an
        op-by-op one the backend's metadata."""
        if kind.fused:
            return cls(backend, None, kv_cache, PagedDecode.from_layout(layout, device), kind)
        return cls(backend, backend.build_metadata(layout, device), kv_cache, None, kind)

    def metadata_for(self, window: int | None) -> object:
        """The metadata a layer attends with: its group's (sliding layers of a hybrid cache
        have their own block tables)."""
        return self.sliding_metadata if window is not None and self.sliding_metadata is not None else self.metadata


_context: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("tokenmill_forward", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    token = _context.set(ctx)
    try:
        yield
    finally:
        _context.reset(token)


def get_forward_context() -> ForwardContext | None:
    """None outside a runner step: attention then runs dense and causal over one
    sequence (the reference path used by tests)."""
    return _context.get()
