"""Paged attention in plain PyTorch: works on any device, tuned for none.

K/V are written with `index_copy_` on the flattened cache through the slot
mapping. Decode requests (one query token) are attended in one padded batch;
prefill chunks one by one, with a causal mask aligned to the bottom right so a
chunk also sees the earlier chunks of its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, BatchLayout


@dataclass
class PrefillSpan:
    start: int  # first query row
    end: int
    context_gather: torch.Tensor | None  # cache slots of the whole context; None: no earlier context
    mask: torch.Tensor | None  # bottom-right causal mask [q_len, context_len]


@dataclass
class PaddedDecode:
    rows: torch.Tensor  # query rows of the decode requests
    gather: torch.Tensor  # [decodes, max_context] cache slots, padded
    mask: torch.Tensor  # [decodes, 1, 1, max_context] True = attend


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor  # [tokens]
    decode: object | None  # the decode requests, in the form the backend's _decode reads
    prefills: list[PrefillSpan]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> SDPAMetadata:
        starts = layout.query_starts
        decodes = [i for i, n in enumerate(layout.query_lens) if n == 1]
        prefills = [i for i, n in enumerate(layout.query_lens) if n > 1]
        return SDPAMetadata(
            slot_mapping=torch.tensor(layout.slot_mapping, dtype=torch.long, device=device),
            decode=self._decode_batch(layout, decodes, starts, device) if decodes else None,
            prefills=[self._prefill_span(layout, i, starts[i], device) for i in prefills],
        )

    def forward(self, q, k, v, kv_cache, metadata: SDPAMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        # The cache may be narrower than the activations (bf16 KV, float32 compute).
        k_flat.index_copy_(0, metadata.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, metadata.slot_mapping, v.to(v_flat.dtype))

        out = torch.empty_like(q)
        if metadata.decode is not None:
            self._decode(q, k_cache, v_cache, metadata, scale, out)
        for span in metadata.prefills:
            qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
            if span.context_gather is None:  # the whole context is this chunk
                kp, vp = k[span.start : span.end], v[span.start : span.end]
            else:
                kp, vp = k_flat[span.context_gather].to(q.dtype), v_flat[span.context_gather].to(q.dtype)
            kp = kp.transpose(0, 1).unsqueeze(0)
            vp = vp.transpose(0, 1).unsqueeze(0)
            o = _sdpa(qp, kp, vp, span.mask, scale, causal=span.mask is None)
            out[span.start : span.end] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(self, q, k_cache, v_cache, metadata: SDPAMetadata, scale: float, out: torch.Tensor) -> None:
        """Attention of the one-token queries: their padded histories gathered, then SDPA."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        decode: PaddedDecode = metadata.decode
        qd = q[decode.rows].unsqueeze(2)  # [D, H, 1, d]
        kd = k_flat[decode.gather].to(q.dtype).transpose(1, 2)  # [D, KVH, L, d]
        vd = v_flat[decode.gather].to(q.dtype).transpose(1, 2)
        o = _sdpa(qd, kd, vd, decode.mask, scale, causal=False)
        out[decode.rows] = o.squeeze(2)

    # ----- metadata ------------------------------------------------------------------

    @staticmethod
    def _prefill_span(layout: BatchLayout, i: int, start: int, device: torch.device) -> PrefillSpan:
        q_len, ctx_len = layout.query_lens[i], layout.context_lens[i]
        if q_len == ctx_len:
            return PrefillSpan(start, start + q_len, None, None)
        gather = _context_slots(layout.block_tables[i], ctx_len, layout.block_size, device)
        # Query row r sits at position ctx_len - q_len + r and sees keys up to it.
        rows = torch.arange(q_len, device=device).unsqueeze(1) + (ctx_len - q_len)
        mask = torch.arange(ctx_len, device=device).unsqueeze(0) <= rows
        return PrefillSpan(start, start + q_len, gather, mask)

    @staticmethod
    def _decode_batch(layout: BatchLayout, decodes: list[int], starts: list[int], device: torch.device) -> PaddedDecode:
        size = layout.block_size
        lens = [layout.context_lens[i] for i in decodes]
        max_ctx = max(lens)
        num_blocks = -(-max_ctx // size)
        # One padded block table for all decodes; padding points at block 0, real
        # (finite) cache memory that the mask hides.
        table = torch.tensor(
            [layout.block_tables[i][:num_blocks] + [0] * (num_blocks - len(layout.block_tables[i][:num_blocks]))
             for i in decodes],
            dtype=torch.long,
            device=device,
        )
        gather = (table.unsqueeze(2) * size + torch.arange(size, device=device)).flatten(1)[:, :max_ctx]
        lens_t = torch.tensor(lens, device=device)
        mask = torch.arange(max_ctx, device=device).unsqueeze(0) < lens_t.unsqueeze(1)
        return PaddedDecode(
            rows=torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device),
            gather=gather,
            mask=mask[:, None, None, :],
        )


def _context_slots(block_table: list[int], ctx_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Cache slots of a request's first ctx_len tokens, in order."""
    num_blocks = -(-ctx_len // block_size)
    blocks = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=device)
    slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size, device=device)).flatten()
    return slots[:ctx_len]


def _sdpa(q, k, v, mask, scale: float, causal: bool) -> torch.Tensor:
    # enable_gqa shares each KV head among its query heads without copying K/V
    # (about 10x faster than repeat_interleave for decode on CPU).
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
