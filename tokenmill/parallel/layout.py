"""What each rank holds of a Llama-family model under tensor and pipeline parallelism.

Torch-free arithmetic, computed identically on every rank from the model's shape:

- tensor parallelism (TP) splits every layer: query/key/value heads and the MLP's
  intermediate columns (column-parallel: each rank computes its outputs), the same ranges
  as the input columns of o_proj and down_proj (row-parallel: the ranks' partial outputs
  are summed by one all-reduce each), and the vocabulary (embedding rows and LM-head rows);
- pipeline parallelism (PP) gives each stage a contiguous range of decoder layers; the
  first stage embeds, the last one normalizes and computes logits;
- a mixture of experts is split over the TP ranks one of two ways: by default every rank
  holds every expert's slice of the intermediate columns (as a dense MLP), with expert
  parallelism (`--enable-expert-parallel`, vLLM's flag) each rank holds whole experts, a
  contiguous range of them. Either way every rank routes every token and the layer's
  one all-reduce sums the ranks' parts (a token's experts on other ranks add zero here).

Heads are split by KV groups, so each rank's query heads share its KV heads as in the
full model. When the KV heads do not divide evenly (SmolLM2-135M: 3 KV heads, TP = 2) the
ranks get uneven groups (2 and 1), and the MLP split leans the other way so every rank
streams about the same weight bytes per token (decode is weight streaming). vLLM refuses
such a split; tokenmill takes it. With more ranks than KV heads each KV head is
replicated on `tp / kv_heads` ranks, which share its query heads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.model_arch import ModelArchConfig


@dataclass(frozen=True)
class Span:
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


def split_sizes(total: int, parts: int, weights: list[float] | None = None) -> list[int]:
    """`total` units in `parts` whole parts proportional to `weights` (even when None), every
    part at least one unit; rounding leftovers go to the last parts (rank 0 also schedules)."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} units into {parts} non-empty parts")
    weights = weights or [1.0] * parts
    exact = [w * total / sum(weights) for w in weights]
    sizes = [max(1, int(e)) for e in exact]
    while sum(sizes) < total:
        i = max(range(parts), key=lambda j: (exact[j] - sizes[j], j))
        sizes[i] += 1
    while sum(sizes) > total:
        i = max((j for j in range(parts) if sizes[j] > 1), key=lambda j: (sizes[j] - exact[j], j))
        sizes[i] -= 1
    return sizes


def spans(sizes: list[int], unit: int = 1) -> list[Span]:
    out, start = [], 0
    for size in sizes:
        out.append(Span(start * unit, size * unit))
        start += size
    return out


@dataclass(frozen=True)
class ShardLayout:
    """One rank's part of the model: ranges in the full model's coordinates."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    head_dim: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span
    vocab_sizes: tuple[int, ...]  # every TP rank's vocabulary part, for gathering logits
    layers: Span
    tie_word_embeddings: bool
    experts: Span = Span(0, 0)  # the routed experts this rank holds (all of them without expert parallelism)
    expert_intermediate: Span = Span(0, 0)  # each held expert's intermediate columns (all with expert parallelism)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def holds_embedding(self) -> bool:
        return self.first_stage or (self.last_stage and self.tie_word_embeddings)

    @classmethod
    def single(cls, arch: ModelArchConfig) -> ShardLayout:
        return build_layout(arch, 1, 0, 1, 0)

    # ----- checkpoint tensors ----------------------------------------------------------

    def local_name(self, name: str) -> str | None:
        """A checkpoint name (Hugging Face, without 'model.') in this rank's model, with
        the layer index made stage-local (and an expert's index rank-local); None when this
        rank holds no part of it."""
        match = _LAYER.match(name)
        if match is not None:
            index = int(match.group(1))
            if not self.layers.start <= index < self.layers.stop:
                return None
            rest = match.group(2)
            expert = _EXPERT.match(rest)
            if expert is not None:
                e = int(expert.group(2))
                if not self.experts.start <= e < self.experts.stop:
                    return None  # another rank's expert (expert parallelism): not even read
                rest = f"{expert.group(1)}.experts.{e - self.experts.start}.{expert.group(3)}"
            return f"layers.{index - self.layers.start}.{rest}"
        if name.startswith("embed_tokens."):
            return name if self.holds_embedding else None
        if name.startswith("lm_head."):
            return name if self.last_stage else None
        return name  # the final norm too: every stage keeps it (a few bytes; it gives the model its dtype)

    def checkpoint_part(self, name: str) -> tuple[int, Span] | None:
        """(dimension, range) of a checkpoint tensor this rank keeps, or None when it keeps
        all of it. Dimension 0 cuts rows (column-parallel layers, vocabulary), 1 cuts
        columns (row-parallel layers)."""
        hd = self.head_dim
        if _EXPERT.search(name):  # one expert's gate/up (w1/w3) rows or down (w2) columns
            if self.expert_intermediate.size == 0:
                return None
            return (1 if name.endswith(("down_proj.weight", "w2.weight")) else 0), self.expert_intermediate
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return 0, Span(self.q_heads.start * hd, self.q_heads.size * hd)
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return 0, Span(self.kv_heads.start * hd, self.kv_heads.size * hd)
        if name.endswith("o_proj.weight"):
            return 1, Span(self.q_heads.start * hd, self.q_heads.size * hd)
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return 0, self.intermediate
        if name.endswith("down_proj.weight"):
            return 1, self.intermediate
        if name.startswith(("embed_tokens.", "lm_head.")):
            return 0, self.vocab
        return None


_LAYER = re.compile(r"layers\.(\d+)\.(.*)")
# One expert's tensor: Qwen3-MoE / OLMoE `mlp.experts.E.gate_proj.weight`, Mixtral `block_sparse_moe.experts.E.w1.weight`.
_EXPERT = re.compile(r"(mlp|block_sparse_moe)\.experts\.(\d+)\.(.*)")


def build_layout(arch: ModelArchConfig, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int,
                 column_unit: int = 1, expert_parallel: bool = False) -> ShardLayout:
    """This rank's layout. `column_unit`: row-parallel cuts of the MLP's intermediate
    dimension fall on multiples of it (the quantization group of the stored weights).
    `expert_parallel`: a mixture of experts is split by whole experts, not by columns."""
    check_parallel_sizes(arch, tp_size, pp_size, expert_parallel)
    experts, expert_columns = _expert_spans(arch, tp_size, expert_parallel, column_unit)
    q_heads, kv_heads = _head_spans(arch, tp_size)
    intermediate = _intermediate_spans(arch, tp_size, q_heads, kv_heads, column_unit)
    vocab = spans(split_sizes(arch.vocab_size, tp_size))
    layers = spans(split_sizes(arch.num_layers, pp_size, _stage_weights(arch, pp_size)))
    return ShardLayout(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, head_dim=arch.head_dim,
        q_heads=q_heads[tp_rank], kv_heads=kv_heads[tp_rank], intermediate=intermediate[tp_rank],
        vocab=vocab[tp_rank], vocab_sizes=tuple(s.size for s in vocab), layers=layers[pp_rank],
        tie_word_embeddings=arch.tie_word_embeddings, experts=experts[tp_rank], expert_intermediate=expert_columns[tp_rank],
    )


# Deterministic inference sums every row-parallel linear as a split of this many ranks
# does, whatever the degree it runs at (ModelParallel.reduce_as): tensor parallelism 1 and 2
# then give the same bits. Other degrees add other partial products (deterministic among
# runs at that degree).
REFERENCE_TP_SIZE = 2


def reference_split(arch: ModelArchConfig, column_unit: int = 1) -> tuple[ShardLayout, ...]:
    """The layouts of the reference split's ranks, as `build_layout` cuts them (same column
    unit); () when the model does not split so (then there is nothing to match)."""
    try:
        return tuple(build_layout(arch, REFERENCE_TP_SIZE, r, 1, 0, column_unit) for r in range(REFERENCE_TP_SIZE))
    except ValueError:
        return ()


def _expert_spans(arch: ModelArchConfig, tp_size: int, expert_parallel: bool,
                  column_unit: int) -> tuple[list[Span], list[Span]]:
    """Per rank: the experts held and their intermediate columns (nothing for a dense model)."""
    if not arch.is_moe:
        return [Span(0, 0)] * tp_size, [Span(0, 0)] * tp_size
    width = arch.moe_intermediate_size
    if expert_parallel:
        return spans(split_sizes(arch.num_experts, tp_size)), [Span(0, width)] * tp_size
    unit = column_unit if width % column_unit == 0 and width // column_unit >= tp_size else 1
    return [Span(0, arch.num_experts)] * tp_size, spans(split_sizes(width // unit, tp_size), unit)


def check_parallel_sizes(arch: ModelArchConfig, tp_size: int, pp_size: int, expert_parallel: bool = False) -> None:
    """Raise ValueError naming the limit when the model cannot be split this way."""
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tensor and pipeline parallel sizes must be at least 1, got {tp_size} and {pp_size}")
    if expert_parallel and tp_size > arch.num_experts:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {tp_size} exceeds the model's "
                         f"{arch.num_experts} experts (each rank holds whole experts)")
    if arch.is_moe and not expert_parallel and tp_size > arch.moe_intermediate_size:
        raise ValueError(f"tensor_parallel_size {tp_size} exceeds the experts' width {arch.moe_intermediate_size}")
    if arch.qk_norm_whole and tp_size > 1:
        raise ValueError(f"tensor parallelism does not split the {arch.architecture} model: its q/k norms span "
                         "every head (a rank holds only some)")
    kv, heads = arch.num_kv_heads, arch.num_heads
    if tp_size > kv:
        group = heads // kv
        if tp_size % kv or group % (tp_size // kv):
            raise ValueError(
                f"tensor_parallel_size {tp_size} does not fit {heads} query / {kv} KV heads: with more ranks than "
                f"KV heads, the ranks must be a multiple of the KV heads ({kv}) and split each group of {group} "
                f"query heads evenly"
            )
    if tp_size > arch.intermediate_size or tp_size > arch.vocab_size:
        raise ValueError(f"tensor_parallel_size {tp_size} exceeds the model's MLP or vocabulary width")
    if pp_size > arch.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {arch.num_layers} layers")


def _head_spans(arch: ModelArchConfig, tp_size: int) -> tuple[list[Span], list[Span]]:
    kv, group = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
    if tp_size <= kv:  # whole KV groups per rank, as even as they go
        kv_spans = spans(split_sizes(kv, tp_size))
        return [Span(s.start * group, s.size * group) for s in kv_spans], kv_spans
    replicas = tp_size // kv  # each KV head on `replicas` ranks, its query heads split among them
    per_rank = group // replicas
    kv_spans = [Span(r // replicas, 1) for r in range(tp_size)]
    q_spans = [Span((r // replicas) * group + (r % replicas) * per_rank, per_rank) for r in range(tp_size)]
    return q_spans, kv_spans


def _attention_params(arch: ModelArchConfig, q: Span, kv: Span) -> int:
    """Weights of one rank's attention part in a layer: q, k, v rows and o_proj columns."""
    return arch.hidden_size * arch.head_dim * (2 * q.size + 2 * kv.size)


def _intermediate_spans(arch: ModelArchConfig, tp_size: int, q_heads: list[Span], kv_heads: list[Span],
                        column_unit: int) -> list[Span]:
    """MLP columns per rank, in whole `column_unit`s, leaning against the attention split
    so every rank holds about as many layer weights (3 * hidden weights per column)."""
    unit = column_unit if arch.intermediate_size % column_unit == 0 and \
        arch.intermediate_size // column_unit >= tp_size else 1
    units = arch.intermediate_size // unit
    attention = [_attention_params(arch, q, kv) for q, kv in zip(q_heads, kv_heads)]
    per_unit = 3 * arch.hidden_size * unit
    target = (sum(attention) + units * per_unit) / tp_size
    weights = [max(target - a, per_unit) for a in attention]
    return spans(split_sizes(units, tp_size, weights), unit)


def _stage_weights(arch: ModelArchConfig, pp_size: int) -> list[float] | None:
    """Layers per stage so each stage holds about as many weights: the last stage also
    holds the LM head (vocab x hidden, several layers' worth in a small model)."""
    if pp_size == 1:
        return None
    layer = arch.hidden_size * arch.head_dim * (2 * arch.num_heads + 2 * arch.num_kv_heads) + \
        3 * arch.hidden_size * arch.intermediate_size
    head = arch.vocab_size * arch.hidden_size
    total = arch.num_layers * layer + head
    target = total / pp_size
    weights = [target] * (pp_size - 1) + [max(target - head, layer)]
    return weights
