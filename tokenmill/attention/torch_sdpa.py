"""Paged attention in plain PyTorch: works on any device, tuned for none.

Decode requests (one query token) are attended in one padded batch: their histories
gathered from the cache (padded to the longest) and SDPA with a mask over them; prefill
chunks as in `paged_sdpa`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend, BatchLayout, padded_block_tables
from tokenmill.attention.paged_sdpa import PrefillSpan, attend_prefills, prefill_spans, sdpa, write_kv


@dataclass
class PaddedDecode:
    rows: torch.Tensor  # query rows of the decode requests
    gather: torch.Tensor  # [decodes, max_context] cache slots, padded
    mask: torch.Tensor  # [decodes, 1, 1, max_context] True = attend


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor  # [tokens]
    decode: PaddedDecode | None
    prefills: list[PrefillSpan]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> SDPAMetadata:
        decodes = [i for i, n in enumerate(layout.query_lens) if n == 1]
        return SDPAMetadata(
            slot_mapping=torch.tensor(layout.slot_mapping, dtype=torch.long, device=device),
            decode=_padded_decode(layout, decodes, device) if decodes else None,
            prefills=prefill_spans(layout, device),
        )

    def forward(self, q, k, v, kv_cache, metadata: SDPAMetadata, scale: float) -> torch.Tensor:
        q, k, v = kv_cache.rotate_in(q, k, v)
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        if metadata.decode is not None:
            decode = metadata.decode
            qd = q[decode.rows].unsqueeze(2)  # [D, H, 1, d]
            kd, vd = kv_cache.read(decode.gather, q.dtype)  # [D, L, KVH, d]
            kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)
            out[decode.rows] = sdpa(qd, kd, vd, decode.mask, scale, causal=False).squeeze(2)
        attend_prefills(q, k, v, kv_cache, metadata.prefills, scale, out, metadata.slot_mapping, self.prefill_dtype)
        return kv_cache.rotate_out(out)


def _padded_decode(layout: BatchLayout, decodes: list[int], device: torch.device) -> PaddedDecode:
    size, starts = layout.block_size, layout.query_starts
    lens = [layout.context_lens[i] for i in decodes]
    max_ctx = max(lens)
    num_blocks = -(-max_ctx // size)
    # One padded block table for all decodes; the mask hides the padding.
    tables = padded_block_tables([layout.block_tables[i] for i in decodes], num_blocks)
    table = torch.tensor(tables, dtype=torch.long, device=device)
    gather = (table.unsqueeze(2) * size + torch.arange(size, device=device)).flatten(1)[:, :max_ctx]
    lens_t = torch.tensor(lens, device=device)
    mask = torch.arange(max_ctx, device=device).unsqueeze(0) < lens_t.unsqueeze(1)
    return PaddedDecode(
        rows=torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device),
        gather=gather,
        mask=mask[:, None, None, :],
    )
