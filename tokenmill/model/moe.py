"""The mixture-of-experts MLP of Qwen3-MoE, Mixtral and OLMoE.

A router scores every expert for each token (softmax over its logits, in float32), the
token runs its `top_k` best, and their outputs are summed weighted by those
probabilities, renormalised to sum to 1 where the family does (`norm_topk_prob`), as
each Hugging Face model computes it.

The experts run as grouped GEMMs: the step's (token, expert) pairs are sorted by expert,
and each expert that has tokens multiplies its group of rows in one call per matrix
(`Experts.gate_up` / `down`, the weight format's kernels: the skinny kernel for a few
rows, a GEMM for many), never a loop over tokens. A decode step at batch 1 reads
`top_k` experts' weights, as a dense MLP of `top_k` times an expert's width would.

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
from tokenmill.model.layers import Experts
from tokenmill.model_arch import ModelArchConfig
from tokenmill.parallel.layout import ShardLayout


class Router(nn.Module):
    """The gate: a logit per expert, [num_experts, hidden] (every rank holds all of it)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.uniform_(self.weight, -hidden**-0.5, hidden**-0.5)


class SparseMoE(nn.Module):
    ops: TorchOps = REFERENCE_OPS  # the execution plan's element-wise ops, handed over at load

    def __init__(self, cfg: ModelArchConfig, layout: ShardLayout) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.act = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(layout.experts.size, cfg.hidden_size, layout.expert_intermediate.size)
        self.first_expert = layout.experts.start  # this rank's experts are [first, first + experts.num_experts)
        self.partial = layout.experts.size < cfg.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return self.run_experts(x, weights, ids)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k (weights in x's dtype, expert ids), [tokens, top_k] each."""
        probs = F.softmax(F.linear(x, self.gate.weight.to(x.dtype)).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over a token's experts held here of weight * expert(token), [tokens, hidden]."""
        groups = expert_groups(ids, self.first_expert, self.experts.num_experts, self.partial)
        rows = x[groups.tokens]  # the pairs' tokens, grouped by expert
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(groups.counts):
            if count:
                group = rows[start : start + count]
                out[start : start + count] = self.experts.down(
                    expert, self.ops.act_and_mul(self.experts.gate_up(expert, group), self.act))
                start += count
        out.mul_(weights.flatten()[groups.pairs].unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, groups.tokens, out)


@dataclass
class ExpertGroups:
    """The step's (token, expert) pairs that fall on this rank's experts, sorted by expert:
    `pairs` indexes the flattened [tokens, top_k] routing, `tokens` the pair's token, and
    `counts[e]` how many pairs local expert e has (consecutive in that order)."""

    pairs: torch.Tensor
    tokens: torch.Tensor
    counts: list[int]


def expert_groups(ids: torch.Tensor, first: int, num_local: int, partial: bool) -> ExpertGroups:
    """`ids` [tokens, top_k] global expert ids; this rank holds [first, first + num_local),
    all of them unless `partial`."""
    top_k = ids.shape[1]
    local = ids.flatten() - first
    pairs = torch.arange(local.numel())
    if partial:  # expert parallelism: the pairs of the experts held here
        held = (local >= 0) & (local < num_local)
        pairs, local = pairs[held], local[held]
    order = torch.argsort(local, stable=True)  # stable: a token's pairs keep their top-k order within an expert
    pairs, local = pairs[order], local[order]
    counts = torch.bincount(local, minlength=num_local).tolist()
    return ExpertGroups(pairs, pairs // top_k, counts)
