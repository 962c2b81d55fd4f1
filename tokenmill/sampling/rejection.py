"""Verification of proposed tokens inside the target's step.

For a request with proposals x_1..x_s the target computed s + 1 rows of logits: row j
scores the token after the known tokens and x_1..x_j. Each row is processed exactly as
the plain sampler processes a row (logit bias, banned ids, penalties counting the
proposals before it as output), then:

- greedy: accept the longest prefix of proposals equal to the rows' argmax, then emit the
  argmax of the first disagreeing row (or of the last row when all agree): token for token
  what decoding without speculation emits;
- sampled (Leviathan et al. 2023; Chen et al. 2023): with p_j the row's distribution
  after temperature, top-k, top-p and min-p, and q_j the distribution the draft sampled
  x_j from (a point mass for n-gram proposals), accept x_j when u * q_j(x_j) < p_j(x_j)
  with u ~ U[0, 1); at the first rejection emit a token drawn from max(0, p_j - q_j)
  (renormalized) and stop; when all are accepted, emit a bonus token drawn from p_{s+1}.
  The emitted tokens are then distributed exactly as sampling from p one token at a time.

A seeded request draws its uniforms from its own generator, so its output depends only
on its seed and its proposals. Logprobs (raw model logprobs, as the sampler reports them)
are given for every emitted token at its own row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tokenmill.sampling.logprobs import TokenLogprobs
from tokenmill.sampling.sampler import (
    Sampler,
    SamplingRow,
    apply_banned_tokens,
    apply_logit_bias,
    apply_penalties,
    apply_top_k_top_p_min_p,
    compute_token_logprobs,
)


@dataclass
class Verification:
    """One request's proposals to verify in this step."""

    row: SamplingRow  # the request as the sampler sees it, before its proposals
    proposals: list[int]
    # [len(proposals), V]: the distributions a draft model sampled the proposals from;
    # None: point masses (n-gram proposals, greedy drafts).
    draft_probs: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.proposals) + 1

    def rows(self) -> list[SamplingRow]:
        """One sampling row per position: row j sees proposals before it as output."""
        row = self.row
        return [row] + [dataclasses.replace(row, output_token_ids=row.output_token_ids + self.proposals[:j])
                        for j in range(1, self.num_rows)]


@dataclass
class Verified:
    token_ids: list[int]  # accepted proposals, then the token sampled after them
    logprobs: list[TokenLogprobs] | None  # aligned with token_ids, when asked for


# ----- distributions, as the sampler computes them ----------------------------------------


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The sampler's logit processors (bias, banned ids, penalties), in place on float32."""
    apply_logit_bias(logits, rows)
    apply_banned_tokens(logits, rows)
    apply_penalties(logits, rows)
    return logits


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a random row samples from: processed logits over the temperature,
    min-p / top-k / top-p applied, softmax. In place on float32 logits."""
    process_logits(logits, rows)
    temperatures = torch.tensor([row.params.temperature for row in rows], dtype=logits.dtype, device=logits.device)
    logits.div_(temperatures.unsqueeze(1))
    apply_top_k_top_p_min_p(logits, rows)
    return torch.softmax(logits, dim=-1)


def draw(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF draw from an unnormalized distribution with one uniform number."""
    cdf = probs.cumsum(dim=-1)
    point = torch.tensor([uniform * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    return int(torch.searchsorted(cdf, point, right=True).clamp_(max=probs.shape[-1] - 1))


# ----- the verifier -----------------------------------------------------------------------


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler  # its shared generator serves the requests without a seed

    def __call__(self, logits: torch.Tensor, requests: list[Verification]) -> list[Verified]:
        """`logits` [sum of num_rows, V]: each request's rows, in order."""
        if logits.shape[0] != sum(v.num_rows for v in requests):
            raise ValueError(f"{logits.shape[0]} rows of logits for {sum(v.num_rows for v in requests)} positions")
        starts = [0]
        for v in requests:
            starts.append(starts[-1] + v.num_rows)
        rows = [row for v in requests for row in v.rows()]
        wants_logprobs = [i for i, v in enumerate(requests) if v.row.params.logprobs is not None]
        raw_logprobs = self._raw_logprobs(logits, requests, starts, wants_logprobs)
        processed = logits.float().clone() if logits.dtype == torch.float32 else logits.float()

        token_ids: list[list[int]] = [[] for _ in requests]
        greedy = [i for i, v in enumerate(requests) if v.row.params.greedy]
        if greedy:
            greedy_rows = [r for i in greedy for r in range(starts[i], starts[i + 1])]
            sub = process_logits(processed[greedy_rows], [rows[r] for r in greedy_rows])
            argmax = sub.argmax(dim=-1).tolist()
            offset = 0
            for i in greedy:
                n = requests[i].num_rows
                token_ids[i] = accept_greedy(requests[i].proposals, argmax[offset : offset + n])
                offset += n
        random = [i for i, v in enumerate(requests) if not v.row.params.greedy]
        if random:
            random_rows = [r for i in random for r in range(starts[i], starts[i + 1])]
            probs = sampling_probs(processed[random_rows], [rows[r] for r in random_rows])
            uniforms = self._uniforms([requests[i] for i in random], logits.device)
            offset = 0
            for i, u in zip(random, uniforms):
                n = requests[i].num_rows
                token_ids[i] = self.accept_random(requests[i], probs[offset : offset + n], u)
                offset += n

        results = [Verified(ids, None) for ids in token_ids]
        if raw_logprobs is not None:
            self._fill_logprobs(results, requests, wants_logprobs, raw_logprobs)
        return results

    # ----- the rule ---------------------------------------------------------------------

    def accept_random(self, request: Verification, probs: torch.Tensor, uniforms: list[float]) -> list[int]:
        """The lossless rule for one request: probs [s + 1, V] are the target's
        distributions, uniforms s + 1 draws from U[0, 1)."""
        proposals = request.proposals
        s = len(proposals)
        index = torch.tensor(proposals, dtype=torch.long, device=probs.device)
        target = probs[:s].gather(1, index.unsqueeze(1)).squeeze(1).tolist()
        if request.draft_probs is None:
            draft = [1.0] * s
        else:
            draft = request.draft_probs[:s].gather(1, index.unsqueeze(1)).squeeze(1).tolist()
        for j in range(s):
            if not self.accepts(target[j], draft[j], uniforms[j]):
                residual = self.residual(probs[j], request.draft_probs, j, proposals[j])
                return [*proposals[:j], draw(residual, uniforms[s])]
        return [*proposals, draw(probs[s], uniforms[s])]

    @staticmethod
    def accepts(target_prob: float, draft_prob: float, uniform: float) -> bool:
        """Accept with probability min(1, p(x) / q(x))."""
        return uniform * draft_prob < target_prob

    @staticmethod
    def residual(target: torch.Tensor, draft_probs: torch.Tensor | None, j: int, proposal: int) -> torch.Tensor:
        """max(0, p - q), unnormalized: what a rejection samples from."""
        if draft_probs is None:  # q is a point mass on the proposal
            residual = target.clone()
            residual[proposal] = 0.0
        else:
            residual = (target - draft_probs[j].to(target.dtype)).clamp_(min=0.0)
        # p = q exactly never rejects; guard against rounding leaving nothing.
        return residual if float(residual.sum()) > 0.0 else target

    # ----- internals --------------------------------------------------------------------

    def _uniforms(self, requests: list[Verification], device: torch.device) -> list[list[float]]:
        """num_rows draws per request: one per proposal, one for the emitted token. Seeded
        requests draw from their own generators, the rest share one."""
        generator = self.sampler.shared_generator(device)
        shared = torch.rand(sum(v.num_rows for v in requests), generator=generator, device=device).tolist()
        out, offset = [], 0
        for v in requests:
            n = v.num_rows
            if v.row.generator is not None:
                out.append(torch.rand(n, generator=v.row.generator, device=device).tolist())
            else:
                out.append(shared[offset : offset + n])
            offset += n
        return out

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, requests: list[Verification], starts: list[int],
                      wanted: list[int]) -> torch.Tensor | None:
        if not wanted:
            return None
        rows = [r for i in wanted for r in range(starts[i], starts[i + 1])]
        return torch.log_softmax(logits[rows].float(), dim=-1)

    @staticmethod
    def _fill_logprobs(results: list[Verified], requests: list[Verification], wanted: list[int],
                       raw_logprobs: torch.Tensor) -> None:
        """Each emitted token's logprob at its own row (row j scores emitted token j)."""
        picked, tokens, offset = [], [], 0
        for i in wanted:
            emitted = results[i].token_ids
            picked += range(offset, offset + len(emitted))
            tokens += emitted
            offset += requests[i].num_rows
        num_top = max(requests[i].row.params.logprobs for i in wanted)
        entries = compute_token_logprobs(raw_logprobs[picked], torch.tensor(tokens), num_top)
        offset = 0
        for i in wanted:
            n, top = len(results[i].token_ids), requests[i].row.params.logprobs
            mine = entries[offset : offset + n]
            for entry in mine:
                entry.top_ids, entry.top_logprobs = entry.top_ids[:top], entry.top_logprobs[:top]
            results[i].logprobs = mine
            offset += n


def accept_greedy(proposals: list[int], argmax: list[int]) -> list[int]:
    """Accepted proposals (those equal to the target's argmax, up to the first that is
    not), then the target's argmax after them."""
    emitted = []
    for j, token in enumerate(argmax):
        emitted.append(token)
        if j == len(proposals) or token != proposals[j]:
            break
    return emitted
