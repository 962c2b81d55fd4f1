"""Paged attention in plain PyTorch: works on any device, tuned for none.

Decode requests (one query token) are attended in one padded batch: their histories
gathered from the cache (padded to the longest) and SDPA with a mask over them; prefill
chunks as in `paged_sdpa`. A sliding-window layer gets the same step narrowed to its
window (built once per step and window).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention.backend import AttentionBackend, BatchLayout
from tokenmill.attention.paged_sdpa import (PaddedDecode, PrefillSpan, attend_padded_decode, attend_prefills,
                                            padded_decode, prefill_spans, windowed_spans, write_kv)


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor  # [tokens]
    decode: PaddedDecode | None
    prefills: list[PrefillSpan]
    layout: BatchLayout | None = None
    windowed: dict[int, SDPAMetadata] = field(default_factory=dict)  # per sliding window, built on first use

    def for_window(self, window: int | None, device: torch.device) -> SDPAMetadata:
        if window is None or self.layout is None:
            return self
        if window not in self.windowed:
            decodes = self.layout.decodes
            self.windowed[window] = SDPAMetadata(
                self.slot_mapping, padded_decode(self.layout, decodes, device, window) if decodes else None,
                windowed_spans(self.prefills, window, device))
        return self.windowed[window]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> SDPAMetadata:
        decodes = layout.decodes
        return SDPAMetadata(
            slot_mapping=torch.tensor(layout.slot_mapping, dtype=torch.long, device=device),
            decode=padded_decode(layout, decodes, device) if decodes else None,
            prefills=prefill_spans(layout, device),
            layout=layout,
        )

    def forward(self, q, k, v, kv_cache, metadata: SDPAMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        metadata = metadata.for_window(window, q.device)
        q, k, v = kv_cache.rotate_in(q, k, v)
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        if metadata.decode is not None:
            attend_padded_decode(q, kv_cache, metadata.decode, scale, out)
        attend_prefills(q, k, v, kv_cache, metadata.prefills, scale, out, metadata.slot_mapping, self.prefill_dtype)
        return kv_cache.rotate_out(out)
