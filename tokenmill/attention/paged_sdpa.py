"""Pieces of paged attention in plain PyTorch that every backend shares: writing the
step's K/V through the slot mapping, and prefill chunks by SDPA.

A prefill chunk attends to its whole context: when earlier chunks (or cached prefix
blocks) exist, that context is gathered from the cache and a causal mask aligned to the
bottom right lets the chunk see all of it; otherwise the chunk is the whole context and
SDPA's own causal mask applies. Matrix-shaped work that SDPA's flash kernel does well.

A sliding-window layer (query at position p sees keys in (p - window, p]) attends over
the same spans narrowed to the window (`windowed_spans`): keys before the window are
not even gathered, so blocks a hybrid cache has let go of are never read. Decode rows
gathered and padded into one batch (`padded_decode`) are narrowed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import BatchLayout, padded_block_tables
from tokenmill.attention.kv_cache import LayerKVCache


@dataclass
class PrefillSpan:
    start: int  # first query row
    end: int
    context_gather: torch.Tensor | None  # cache slots of the whole context; None: no earlier context
    mask: torch.Tensor | None  # bottom-right causal mask [q_len, context_len]
    context_len: int = 0  # tokens in the context after this chunk


@dataclass
class PaddedDecode:
    """Decode rows attended in one padded batch: each row's context gathered from the
    cache (padded to the longest) and SDPA with a mask over them."""

    rows: torch.Tensor  # query rows of the decode requests
    gather: torch.Tensor  # [decodes, width] cache slots, padded
    mask: torch.Tensor  # [decodes, 1, 1, width] True = attend


def padded_decode(layout: BatchLayout, decodes: list[int], device: torch.device,
                  window: int | None = None) -> PaddedDecode:
    """The decode requests `decodes` (indices into the layout), each over its whole
    context or, with a window, over its last `window` tokens."""
    size, starts = layout.block_size, layout.query_starts
    lens = torch.tensor([layout.context_lens[i] for i in decodes], device=device)
    first = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
    width = int((lens - first).max())
    pos = first.unsqueeze(1) + torch.arange(width, device=device)  # [D, width] positions attended
    mask = pos < lens.unsqueeze(1)
    pos = torch.minimum(pos, lens.unsqueeze(1) - 1)  # padding reads a real slot of the row, masked out
    max_blocks = -(-int(lens.max()) // size)
    table = torch.tensor(padded_block_tables([layout.block_tables[i] for i in decodes], max_blocks),
                         dtype=torch.long, device=device)
    gather = table.gather(1, pos // size) * size + pos % size
    return PaddedDecode(
        rows=torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device),
        gather=gather,
        mask=mask[:, None, None, :],
    )


def attend_padded_decode(q: torch.Tensor, kv_cache: LayerKVCache, decode: PaddedDecode, scale: float,
                         out: torch.Tensor) -> None:
    qd = q[decode.rows].unsqueeze(2)  # [D, H, 1, d]
    kd, vd = kv_cache.read(decode.gather, q.dtype)  # [D, L, KVH, d]
    kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)
    out[decode.rows] = sdpa(qd, kd, vd, decode.mask, scale, causal=False).squeeze(2)


def windowed_spans(spans: list[PrefillSpan], window: int, device: torch.device) -> list[PrefillSpan]:
    """The step's prefill spans for a sliding-window layer: query at position p sees keys
    in (p - window, p]; keys before the first query's window are not gathered."""
    result = []
    for span in spans:
        q_len = span.end - span.start
        first_query = span.context_len - q_len  # position of the chunk's first query
        key_start = 0 if span.context_gather is None else max(0, first_query - window + 1)
        keys = torch.arange(key_start, span.context_len, device=device)
        queries = torch.arange(first_query, span.context_len, device=device).unsqueeze(1)
        mask = (keys <= queries) & (keys > queries - window)
        gather = None if span.context_gather is None else span.context_gather[key_start:]
        if gather is None and q_len <= window:
            mask = None  # the whole chunk fits in every query's window: plain causal
        result.append(PrefillSpan(span.start, span.end, gather, mask, span.context_len))
    return result


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    kv_cache.write(k, v, slot_mapping)


def prefill_spans(layout: BatchLayout, device: torch.device) -> list[PrefillSpan]:
    """The step's chunks (every request that does not attend as a decode)."""
    starts = layout.query_starts
    return [_prefill_span(layout, i, starts[i], device)
            for i in range(len(layout.query_lens)) if not layout.is_decode(i)]


def attend_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache,
                    spans: list[PrefillSpan], scale: float, out: torch.Tensor, slot_mapping: torch.Tensor,
                    compute_dtype: torch.dtype | None = None) -> None:
    """Each chunk attends over its context by SDPA, in `compute_dtype` when given (q, k, v
    cast to it, the output back to out's dtype)."""
    dtype = compute_dtype or q.dtype
    for span in spans:
        qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if span.context_gather is not None:
            kp, vp = kv_cache.read(span.context_gather, dtype)
        elif kv_cache.quantized:
            # The whole context is this chunk: an 8-bit cache attends to it as stored, as
            # it will when later tokens read it (so a prefix-cache hit computes what a miss
            # does, and prefill sees the error decode sees).
            kp, vp = kv_cache.read(slot_mapping[span.start : span.end], dtype)
        else:
            kp, vp = k[span.start : span.end], v[span.start : span.end]
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        qp, kp, vp = qp.to(dtype), kp.to(dtype), vp.to(dtype)
        o = sdpa(qp, kp, vp, span.mask, scale, causal=span.mask is None and span.context_gather is None)
        out[span.start : span.end] = o.squeeze(0).transpose(0, 1)


def sdpa(q, k, v, mask, scale: float, causal: bool) -> torch.Tensor:
    # enable_gqa shares each KV head among its query heads without copying K/V
    # (about 10x faster than repeat_interleave for decode on CPU).
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def context_slots(block_table: list[int], ctx_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Cache slots of a request's first ctx_len tokens, in order."""
    num_blocks = -(-ctx_len // block_size)
    blocks = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=device)
    slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size, device=device)).flatten()
    return slots[:ctx_len]


def _prefill_span(layout: BatchLayout, i: int, start: int, device: torch.device) -> PrefillSpan:
    q_len, ctx_len = layout.query_lens[i], layout.context_lens[i]
    if q_len == ctx_len:
        return PrefillSpan(start, start + q_len, None, None, ctx_len)
    gather = context_slots(layout.block_tables[i], ctx_len, layout.block_size, device)
    # Query row r sits at position ctx_len - q_len + r and sees keys up to it.
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (ctx_len - q_len)
    mask = torch.arange(ctx_len, device=device).unsqueeze(0) <= rows
    return PrefillSpan(start, start + q_len, gather, mask, ctx_len)
