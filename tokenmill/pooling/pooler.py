"""The Pooler: each pooling request's hidden rows, chunk by chunk, -> its vector."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.pooling_params import PoolingParams


@dataclass
class _Partial:
    """What a request's earlier chunks left: the next position expected, and for MEAN the
    float32 sum of the rows so far, for CLS the first row."""

    next_pos: int = 0
    total: torch.Tensor | None = None
    first: torch.Tensor | None = None


class Pooler:
    """LAST (the last prompt token's state: a decoder's summary of the whole prompt, as
    Qwen3-Embedding and e5-mistral pool), MEAN (every prompt token) or CLS (the first
    token). MEAN and CLS need every position computed here, so the builder turns prefix
    caching off for them (as vLLM does); LAST reads only the last row, which a prefix hit
    never covers."""

    def __init__(self, pooling_type: str, normalize: bool) -> None:
        if pooling_type not in ("LAST", "MEAN", "CLS"):
            raise ValueError(f"unknown pooling type {pooling_type!r}")
        self.pooling_type = pooling_type
        self.normalize = normalize
        self.partial: dict[str, _Partial] = {}

    @property
    def needs_every_position(self) -> bool:
        return self.pooling_type != "LAST"

    def add(self, request_id: str, start_pos: int, rows: torch.Tensor, last: bool,
            params: PoolingParams) -> list[float] | None:
        """`rows`: the final hidden states of positions start_pos, start_pos + 1, ... of one
        request's chunk; `last`: the chunk ends the prompt. Returns the vector then, else None."""
        if self.pooling_type == "LAST":
            return self._finish(rows[-1], params) if last else None
        partial = self.partial.setdefault(request_id, _Partial())
        if start_pos != partial.next_pos:  # the builder keeps prefix hits away from MEAN and CLS
            raise RuntimeError(f"{self.pooling_type} pooling of {request_id}: got positions from {start_pos}, "
                               f"expected {partial.next_pos} (a prefix-cache hit skipped hidden states)")
        partial.next_pos += rows.shape[0]
        if self.pooling_type == "MEAN":
            chunk = rows.float().sum(dim=0)
            partial.total = chunk if partial.total is None else partial.total + chunk
        elif partial.first is None:
            partial.first = rows[0].float()
        if not last:
            return None
        del self.partial[request_id]
        pooled = partial.total / partial.next_pos if self.pooling_type == "MEAN" else partial.first
        return self._finish(pooled, params)

    def release(self, request_ids: list[str]) -> None:
        """Forget requests that finished, were aborted or preempted (recomputed from 0)."""
        for request_id in request_ids:
            self.partial.pop(request_id, None)

    def _finish(self, pooled: torch.Tensor, params: PoolingParams) -> list[float]:
        """Matryoshka: the first `dimensions` entries, normalized after the cut (vLLM's order)."""
        pooled = pooled.float()
        if params.dimensions is not None:
            pooled = pooled[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.tolist()
