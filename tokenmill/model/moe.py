"""The mixture-of-experts MLP of Qwen3-MoE, Mixtral and OLMoE.

A router scores every expert for each token (softmax over its logits, in float32), the
token runs its `top_k` best, and their outputs are summed weighted by those
probabilities, renormalised to sum to 1 where the family does (`norm_topk_prob`), as
each Hugging Face model computes it.

The experts run as grouped GEMMs: the step's (token, expert) pairs are sorted by expert,
and each expert that has tokens multiplies its group of rows at once, never a loop over
tokens. With the skinny-kernel tiles (float32 / bf16 weights, the native plan) and groups
of few rows (decode), every active expert's matrix runs in one native call
(`kernels.grouped_skinny_linear`: the threads meet once per matrix, as for a dense MLP);
otherwise each expert calls its weight format (a GEMM for many rows, int8 / int4 kernels).
A decode step at batch 1 reads `top_k` experts' weights, as a dense MLP of `top_k` times
an expert's width would.

Under tensor parallelism a rank holds either every expert's slice of the intermediate
columns or (expert parallelism) whole experts; it routes every token, computes what it
holds, and the decoder layer's all-reduce sums the ranks' parts, as for a dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.ops import REFERENCE_OPS, TorchOps
from tokenmill.model.layers import Experts, Linear
from tokenmill.model_arch import ModelArchConfig
from tokenmill.parallel.layout import ShardLayout


class SparseMoE(nn.Module):
    ops: TorchOps = REFERENCE_OPS  # the execution plan's element-wise ops, handed over at load

    def __init__(self, cfg: ModelArchConfig, layout: ShardLayout) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.act = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act
        # The router, a logit per expert (every rank holds all of it): a linear in the plan's
        # float format, never quantized (a quantized router would pick other experts).
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, quantize=False)
        self.experts = Experts(layout.experts.size, cfg.hidden_size, layout.expert_intermediate.size)
        self.first_expert = layout.experts.start  # this rank's experts are [first, first + experts.num_experts)
        self.partial = layout.experts.size < cfg.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return self.run_experts(x, weights, ids)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (weights in x's dtype, expert ids), [tokens, top_k] each."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over a token's experts held here of weight * expert(token), [tokens, hidden]."""
        groups = expert_groups(ids, self.first_expert, self.experts.num_experts, self.partial)
        rows = x.index_select(0, groups.tokens)  # the pairs' tokens, grouped by expert
        active = [(expert, count) for expert, count in enumerate(groups.counts) if count]
        if not active:  # expert parallelism: no token of this step chose an expert held here
            return torch.zeros_like(x)
        out = self.experts.grouped_mlp(rows, active, lambda h: self.ops.act_and_mul(h, self.act))
        if out is None:  # quantized experts, or groups past the skinny kernel's rows: an expert at a time
            out, start = torch.empty_like(rows), 0
            for expert, count in active:
                group = rows[start : start + count]
                out[start : start + count] = self.experts.down(
                    expert, self.ops.act_and_mul(self.experts.gate_up(expert, group), self.act))
                start += count
        # Back to (token, k) order (a zero row for pairs held by other ranks), then each
        # token's weighted sum over its k experts: no scatter-add.
        tokens, top_k = ids.shape
        if self.partial:
            out = torch.cat([out, out.new_zeros(1, out.shape[1])])
        per_pair = out.index_select(0, groups.inverse)
        return (per_pair.view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)


@dataclass
class ExpertGroups:
    """The step's (token, expert) pairs that fall on this rank's experts, sorted by expert:
    `tokens` the pairs' tokens in that order, `counts[e]` how many pairs local expert e has
    (consecutive), and `inverse`, for each pair of the flattened [tokens, top_k] routing,
    its row in that order (the row past the last for a pair held by another rank).

    Index tensors are applied with index_select throughout: on this CPU build advanced
    indexing (x[idx], x[idx] = y) runs a threaded loop even for a few rows, and a
    threaded loop per layer costs what a whole expert's matrix does when the cores are
    shared."""

    tokens: torch.Tensor
    counts: list[int]
    inverse: torch.Tensor


def expert_groups(ids: torch.Tensor, first: int, num_local: int, partial: bool) -> ExpertGroups:
    """`ids` [tokens, top_k] global expert ids; this rank holds [first, first + num_local),
    all of them unless `partial`."""
    top_k = ids.shape[1]
    local = ids.flatten() - first
    pairs = torch.arange(local.numel())
    held = None
    if partial:  # expert parallelism: the pairs of the experts held here
        held = (local >= 0) & (local < num_local)
        pairs = held.nonzero().squeeze(1)
        local = local.index_select(0, pairs)
    order = torch.argsort(local, stable=True)  # stable: a token's pairs keep their top-k order within an expert
    counts = torch.bincount(local, minlength=num_local).tolist()
    sorted_pairs = pairs.index_select(0, order)
    rank = torch.argsort(order)  # each held pair's row in expert order (pairs ascending)
    if held is not None and len(order) == 0:  # no pair held here (a decode row whose experts are all elsewhere)
        rank = torch.zeros_like(held, dtype=torch.long)
    elif held is not None:
        before = (held.cumsum(0) - 1).clamp(min=0)
        rank = torch.where(held, rank.index_select(0, before), len(order))
    return ExpertGroups(torch.div(sorted_pairs, top_k, rounding_mode="floor"), counts, rank)
