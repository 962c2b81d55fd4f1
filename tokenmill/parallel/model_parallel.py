"""What a model needs at run time to be one rank of a split: its layout and its links.

`ModelParallel` is handed to `LlamaForCausalLM`; the model asks it for its sizes (the
layout), sums row-parallel outputs (`all_reduce`), gathers the vocabulary-parallel logits
(`gather_logits`) and, between pipeline stages, receives and sends the hidden states.
`ModelParallel.single(arch)` is the whole model in one process: every call is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.model_arch import ModelArchConfig
from tokenmill.parallel.layout import ShardLayout


class TPCommunicator(Protocol):
    """The collectives of one tensor-parallel group."""

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor: ...  # sums in place over the group

    def all_gather(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor: ...  # concat of dim -1


class StageLink(Protocol):
    """Hidden states between neighbouring pipeline stages (same TP rank)."""

    def send(self, tensors: tuple[torch.Tensor, ...]) -> None: ...

    def recv(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]: ...


@dataclass
class ModelParallel:
    layout: ShardLayout
    tp: TPCommunicator | None = None  # None when tp_size == 1
    prev_stage: StageLink | None = None  # None on the first stage
    next_stage: StageLink | None = None  # None on the last stage
    # Deterministic inference: the ranks' layouts of a reference tensor-parallel split
    # (`reference_split`) whose row-parallel products this rank computes as they do, so
    # that one process and that split give the same bits (`column_cuts`). Empty: none.
    reduce_as: tuple[ShardLayout, ...] = ()

    @classmethod
    def single(cls, arch: ModelArchConfig, reduce_as: tuple[ShardLayout, ...] = ()) -> ModelParallel:
        return cls(ShardLayout.single(arch), reduce_as=reduce_as)

    def column_cuts(self, checkpoint_name: str) -> tuple[int, ...]:
        """Where a row-parallel linear's local input columns are cut so its partial products
        are the reference split's ranks' (added in rank order, as the all-reduce adds them):
        inside this rank's columns, where a reference rank's columns start."""
        mine = self.layout.checkpoint_part(checkpoint_name)
        if mine is None or mine[0] != 1 or not self.reduce_as:  # not cut along its input columns
            return ()
        local = mine[1]
        starts = (ref.checkpoint_part(checkpoint_name)[1].start for ref in self.reduce_as)
        return tuple(start - local.start for start in starts if local.start < start < local.stop)

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.all_reduce_(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns -> the whole vocabulary on every rank of the group."""
        return logits if self.tp is None else self.tp.all_gather(logits, self.layout.vocab_sizes)

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) from the previous stage."""
        assert self.prev_stage is not None
        h, residual = self.prev_stage.recv(((num_tokens, hidden_size), (num_tokens, hidden_size)), dtype)
        return h, residual

    def send_hidden(self, h: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.next_stage is not None
        self.next_stage.send((h, residual))
