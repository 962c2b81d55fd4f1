"""The CPU backend: decode attention by tokenmill's native paged kernel, prefill by SDPA.

Decode queries (one token each) attend over their histories read in place from the
paged cache (`tokenmill/kernels/csrc/cpu_attention.cpp`), instead of the padded gather
plus masked SDPA of the pure-PyTorch backend. Prefill chunks are matrix-shaped work that
SDPA's flash kernel already does well, so they keep the parent's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.backend import BatchLayout, DecodeOnly
from tokenmill.attention.torch_sdpa import SDPAMetadata, TorchSDPABackend
from tokenmill.kernels import paged_decode_attention


@dataclass
class NativeDecode:
    rows: torch.Tensor | slice  # query rows of the decodes (a slice when contiguous)
    block_tables: torch.Tensor  # int32 [decodes, max_blocks]
    context_lens: torch.Tensor  # int32 [decodes]


class CPUNativeBackend(TorchSDPABackend):
    name = "cpu_native"

    @staticmethod
    def _decode_batch(layout: BatchLayout, decodes: list[int], starts: list[int], device: torch.device) -> NativeDecode:
        size = layout.block_size
        lens = [layout.context_lens[i] for i in decodes]
        width = -(-max(lens) // size)
        tables = [layout.block_tables[i][:width] for i in decodes]
        rows = [starts[i] for i in decodes]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        return NativeDecode(
            rows=slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        )

    def decode_only(self, metadata: SDPAMetadata) -> DecodeOnly | None:
        native: NativeDecode | None = metadata.decode
        if metadata.prefills or native is None or not isinstance(native.rows, slice) or native.rows.start != 0:
            return None
        return DecodeOnly(metadata.slot_mapping, native.block_tables, native.context_lens)

    def _decode(self, q, k_cache, v_cache, metadata: SDPAMetadata, scale: float, out: torch.Tensor) -> None:
        native: NativeDecode = metadata.decode
        if isinstance(native.rows, slice):  # write straight into the output rows
            paged_decode_attention(
                out[native.rows], q[native.rows], k_cache, v_cache, native.block_tables, native.context_lens, scale
            )
            return
        qd = q[native.rows]
        od = torch.empty_like(qd)
        paged_decode_attention(od, qd, k_cache, v_cache, native.block_tables, native.context_lens, scale)
        out[native.rows] = od
