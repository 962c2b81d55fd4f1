"""The CPU backend: decode attention by tokenmill's native paged kernel, prefill by SDPA
(bf16 prefill by the native AVX-512 BF16 kernel where the build has it).

Decode queries (one token each) attend over their histories read in place from the
paged cache (`tokenmill/kernels/csrc/cpu_attention.cpp`), instead of the padded gather
plus masked SDPA of the pure-PyTorch backend; it reads int8/fp8 caches with their scales
as they are. Prefill chunks go through the shared SDPA path (`paged_sdpa`), except bf16
ones (the plan's prefill attention dtype) where the build has AVX-512 BF16 and the CPU no
AMX: those run the native kernel (`cpu_prefill_attention.cpp`: 2x torch's flash kernel at a
1024-token layer of 9 heads of 64 on a Zen 4 core), an 8-bit cache's K/V dequantized to bf16
first. An 8-bit cache is written by the native write (one op
instead of a dozen per layer), to the same bytes as the PyTorch write.

A sliding-window layer's decodes attend natively over their last `window` keys (the
kernel's `window`); its prefill chunks through SDPA narrowed to the window.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from tokenmill.attention.backend import AttentionBackend, BatchLayout, padded_block_tables
from tokenmill.attention.paged_sdpa import PrefillSpan, attend_prefills, prefill_spans, windowed_spans, write_kv
from tokenmill.hardware import cpu_info
from tokenmill.kernels import (hadamard_, has_prefill_attention, paged_decode_attention, prefill_attention,
                               prefill_attention_chunks, write_kv_cache)


@dataclass
class NativeDecode:
    rows: torch.Tensor | slice  # query rows of the decodes (a slice when contiguous)
    block_tables: torch.Tensor  # int32 [decodes, max_blocks]
    context_lens: torch.Tensor  # int32 [decodes]
    window: int = 0  # a sliding-window layer's: each row attends its last `window` keys


@dataclass
class NativeMetadata:
    slot_mapping: torch.Tensor  # [tokens]
    decode: NativeDecode | None
    prefills: list[PrefillSpan]
    layout: BatchLayout | None = None
    windowed: dict[int, NativeMetadata] = field(default_factory=dict)  # per sliding window, built on first use
    # The prompt chunks as `prefill_attention_chunks` takes them (row starts, every chunk's key
    # slots, key starts), built on first use; None: the chunks' rows are not one run.
    chunk_keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, init=False)
    _chunk_keys_built: bool = field(default=False, init=False)

    def prefill_chunks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not self._chunk_keys_built:
            self._chunk_keys_built = True
            spans = self.prefills
            if spans and len(_row_runs(spans)) == 1:
                slots = [span.context_gather if span.context_gather is not None
                         else self.slot_mapping[span.start : span.end] for span in spans]
                key_starts = [0]
                for keys in slots:
                    key_starts.append(key_starts[-1] + len(keys))
                self.chunk_keys = (torch.tensor([spans[0].start] + [span.end for span in spans], dtype=torch.long),
                                   torch.cat(slots).to(torch.long), torch.tensor(key_starts, dtype=torch.long))
        return self.chunk_keys

    def for_window(self, window: int | None, device: torch.device) -> NativeMetadata:
        if window is None or self.layout is None:
            return self
        if window not in self.windowed:
            decode = None if self.decode is None else dataclasses.replace(self.decode, window=window)
            self.windowed[window] = NativeMetadata(self.slot_mapping, decode,
                                                   windowed_spans(self.prefills, window, device))
        return self.windowed[window]


class CPUNativeBackend(AttentionBackend):
    name = "cpu_native"

    def chunk_invariant(self, head_dim: int) -> bool:
        """The native bf16 prefill kernel computes each query row alone, over keys in blocks
        of 32 from position 0 whoever else is in the chunk, and the K/V it reads are the same
        bf16 values from the step's projections or from the cache (an 8-bit cache's always
        from the cache, dequantized)."""
        return self.prefill_dtype == torch.bfloat16 and native_prefill_attention(head_dim)

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> NativeMetadata:
        decodes = layout.decodes
        return NativeMetadata(
            slot_mapping=torch.tensor(layout.slot_mapping, dtype=torch.long, device=device),
            decode=_native_decode(layout, decodes, device) if decodes else None,
            prefills=prefill_spans(layout, device),
            layout=layout,
        )

    def forward(self, q, k, v, kv_cache, metadata: NativeMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        metadata = metadata.for_window(window, q.device)
        # A packed cache (float32 or bf16 rows) and an 8-bit one (float32 rows) by the native write.
        native = kv_cache.packed or (kv_cache.quantized and q.dtype == torch.float32)
        if not native:
            q, k, v = kv_cache.rotate_in(q, k, v)
            write_kv(k, v, kv_cache, metadata.slot_mapping)
        else:  # rotated in place (fresh activations of this layer) and written by the native ops
            for t in (q, k, v) if kv_cache.rotation else ():
                hadamard_(t, kv_cache.rotation)
            write_kv_cache(k, v, (kv_cache.k, kv_cache.v), kv_cache.scales, metadata.slot_mapping)
        out = torch.empty_like(q)
        if metadata.decode is not None:
            self._decode(q, kv_cache, metadata.decode, scale, out)
        self._prefills(q, k, v, kv_cache, metadata, scale, out, window)
        if native and kv_cache.rotation:
            hadamard_(out, kv_cache.rotation)
            return out
        return kv_cache.rotate_out(out)

    def _prefills(self, q, k, v, kv_cache, metadata: NativeMetadata, scale: float, out: torch.Tensor,
                  window: int | None) -> None:
        """Prefill chunks in bf16 (the plan's prefill dtype, or bf16 activations) by the native
        kernel where the build has it (AVX-512 BF16; head_dim 32-128; no window); otherwise, and
        for float32 attention, by SDPA. An 8-bit cache's K/V are read back dequantized to bf16,
        the chunk's own included (it attends to them as stored, as later tokens will)."""
        bf16 = torch.bfloat16
        native = native_prefill_attention(q.shape[-1])
        if (self.prefill_dtype or q.dtype) != bf16 or window is not None or not native:
            attend_prefills(q, k, v, kv_cache, metadata.prefills, scale, out, metadata.slot_mapping,
                            self.prefill_dtype)
            return
        in_place = not kv_cache.quantized and kv_cache.k.dtype == bf16  # a bf16 cache's context read where it is
        if out.dtype == bf16:
            q16, out16 = q, out
        else:  # the step's queries cast once and its outputs copied back once, not once per prompt
            q16, out16 = q.to(bf16), torch.empty(q.shape, dtype=bf16)
        k16 = v16 = None
        chunks = metadata.prefill_chunks() if in_place else None
        if kv_cache.packed:  # read where the cache holds it, nothing packed (a chunk per call if their rows are apart)
            for each in [chunks] if chunks is not None else [_one_chunk(span, metadata) for span in metadata.prefills]:
                prefill_attention_chunks(out16, q16, kv_cache.k, kv_cache.v, scale, *each)
        elif chunks is not None:  # every chunk in one call, reading its keys where the cache holds them
            cache_k, cache_v = kv_cache.k.view(-1, *kv_cache.k.shape[2:]), kv_cache.v.view(-1, *kv_cache.v.shape[2:])
            prefill_attention_chunks(out16, q16, cache_k, cache_v, scale, *chunks)
        for span in metadata.prefills if chunks is None and not kv_cache.packed else ():
            rows = slice(span.start, span.end)
            key_slots = None
            if span.context_gather is not None and in_place:  # earlier context: the cache's rows, the chunk's last
                ks, vs = kv_cache.k.view(-1, *kv_cache.k.shape[2:]), kv_cache.v.view(-1, *kv_cache.v.shape[2:])
                key_slots = span.context_gather.to(torch.long).contiguous()
            elif span.context_gather is not None:
                ks, vs = kv_cache.read(span.context_gather, bf16)
            elif kv_cache.quantized:
                ks, vs = kv_cache.read(metadata.slot_mapping[rows], bf16)
            else:
                if k16 is None:  # (cast once for every prompt of the step that has no earlier context)
                    k16, v16 = k.to(bf16), v.to(bf16)
                ks, vs = k16[rows], v16[rows]
            prefill_attention(out16[rows], q16[rows], ks, vs, scale, key_slots)
        if out16 is not out:
            for first, last in _row_runs(metadata.prefills):
                out[first:last] = out16[first:last]

    @staticmethod
    def _decode(q, kv_cache, native: NativeDecode, scale: float, out: torch.Tensor) -> None:
        k_cache, v_cache = kv_cache
        if isinstance(native.rows, slice):  # write straight into the output rows
            paged_decode_attention(out[native.rows], q[native.rows], k_cache, v_cache, native.block_tables,
                                   native.context_lens, scale, kv_cache.scales, native.window)
            return
        qd = q[native.rows]
        od = torch.empty_like(qd)
        paged_decode_attention(od, qd, k_cache, v_cache, native.block_tables, native.context_lens, scale,
                               kv_cache.scales, native.window)
        out[native.rows] = od


def _one_chunk(span: PrefillSpan, metadata: NativeMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One prompt chunk as `prefill_attention_chunks` takes a step's chunks."""
    keys = span.context_gather if span.context_gather is not None else metadata.slot_mapping[span.start : span.end]
    return (torch.tensor([span.start, span.end], dtype=torch.long), keys.to(torch.long).contiguous(),
            torch.tensor([0, len(keys)], dtype=torch.long))


def _row_runs(spans: list) -> list[tuple[int, int]]:
    """The spans' rows as runs of consecutive rows (a step's prompts usually sit together)."""
    runs: list[tuple[int, int]] = []
    for span in spans:
        if runs and runs[-1][1] == span.start:
            runs[-1] = (runs[-1][0], span.end)
        else:
            runs.append((span.start, span.end))
    return runs


@functools.cache
def native_prefill_attention(head_dim: int) -> bool:
    """Whether bf16 prefill chunks run the native kernel here: built with AVX-512 BF16 for this
    head_dim, on a CPU without AMX (there torch's flash kernel multiplies on AMX tiles, 2.8x
    its float32 at 1024 tokens on a Xeon; the two were not measured against each other)."""
    return has_prefill_attention(head_dim) and not cpu_info().has("amx_bf16")


def _native_decode(layout: BatchLayout, decodes: list[int], device: torch.device) -> NativeDecode:
    size, starts = layout.block_size, layout.query_starts
    lens = [layout.context_lens[i] for i in decodes]
    width = -(-max(lens) // size)
    tables = padded_block_tables([layout.block_tables[i] for i in decodes], width)
    rows = [starts[i] for i in decodes]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return NativeDecode(
        rows=slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
    )
