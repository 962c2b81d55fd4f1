"""The batched sampler: turns one row of logits per request into the next token.

Semantics follow vLLM v1:

1. logit processors on the float32 logits: `logit_bias`, then banned ids (EOS/stop
   ids below `min_tokens`) to -inf, then repetition / frequency / presence penalties;
2. the returned logprobs are the log_softmax of the *raw* model logits (vLLM's
   default `raw_logprobs`), so they do not depend on the processing above;
3. greedy rows take the argmax of the processed logits; random rows divide by the
   temperature, drop tokens by min-p, top-k and top-p (one sort for all three, only
   for the rows that use them), and draw by inverse CDF: one uniform number per row
   located in the cumulative distribution (far cheaper than one random number per
   vocabulary entry, as an exponential race or Gumbel-max would need).

A seeded request draws only from its own generator, exactly one number per step, so
its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import torch

from tokenmill.sampling.logprobs import TokenLogprobs
from tokenmill.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own (seeded) generator; None -> the sampler's
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # set to -inf this step (EOS/stop ids while below min_tokens)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # filled for rows whose params.logprobs is not None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for a seeded request; it must live on the device of the logits."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax) -> None:
        """`argmax`: greedy rows' argmax over the last dim, torch.argmax's answer (the runner
        hands in the native one where it has the kernels: kernels.argmax_rows)."""
        self.seed = seed
        self.argmax = argmax
        # One shared generator per device, for the rows without a seed of their own.
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of `logits` [n, V]."""
        if len(rows) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} sampling rows")
        if all(_is_plain_greedy(row) for row in rows):
            # Hot path: one argmax over the whole batch, no copies, one host sync.
            return SamplerOutput(self.argmax(logits).tolist(), [None] * len(rows))

        # Raw logprobs are taken before any processing; `.float()` copies only when
        # the dtype changes, so clone to keep the caller's tensor untouched.
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(logits[logprob_rows].float(), dim=-1) if logprob_rows else None
        )
        logits = logits.float().clone() if logits.dtype == torch.float32 else logits.float()

        apply_logit_bias(logits, rows)
        apply_banned_tokens(logits, rows)
        apply_penalties(logits, rows)

        token_ids = self._sample(logits, rows)
        logprobs = _chosen_logprobs(raw_logprobs, token_ids, rows, logprob_rows)
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Argmax for greedy rows, a random draw for the others; returns [n] int64."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):
            return self.argmax(logits)
        if not greedy:
            return self._sample_random(logits, rows)

        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        token_ids[greedy] = self.argmax(logits[greedy])
        token_ids[random] = self._sample_random(logits[random], [rows[i] for i in random])
        return token_ids

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, then min-p / top-k / top-p, then an inverse-CDF draw. In place."""
        temperatures = _row_tensor([row.params.temperature for row in rows], logits)
        logits.div_(temperatures.unsqueeze(1))
        filtered = [i for i, row in enumerate(rows) if _has_filter(row.params)]
        if len(filtered) == len(rows):
            apply_top_k_top_p_min_p(logits, rows)
        elif filtered:  # sort only the rows that need it
            index = _index_tensor(filtered, logits)
            sub = apply_top_k_top_p_min_p(logits.index_select(0, index), [rows[i] for i in filtered])
            logits.index_copy_(0, index, sub)
        cdf = torch.softmax(logits, dim=-1).cumsum_(dim=-1)
        # One uniform per row, scaled by the row's total mass (rounding keeps it near 1).
        # A token with zero probability adds nothing to the CDF, so it is never picked.
        points = self._uniforms(rows, logits.device).mul_(cdf[:, -1])
        token_ids = torch.searchsorted(cdf, points.unsqueeze(1), right=True).squeeze(1)
        return token_ids.clamp_(max=logits.shape[1] - 1)

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row.

        Unseeded rows share the sampler's generator (one call for the batch); each
        seeded row draws from its own generator, exactly one number per step, so its
        samples depend only on its seed and step count, never on the batch.
        """
        draws = torch.rand(len(rows), generator=self.shared_generator(device), device=device)
        for i, row in enumerate(rows):
            if row.generator is not None:
                draws[i] = torch.rand(1, generator=row.generator, device=device)[0]
        return draws

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator of rows without a seed of their own (the verifier of proposed
        tokens draws from it too)."""
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()  # non-deterministic
            else:
                generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


# --- logit processors: each works in place on float32 logits [n, V] and returns them ---


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Add each row's `logit_bias` to its logits."""
    entries = [
        (i, token_id, bias)
        for i, row in enumerate(rows)
        for token_id, bias in (row.params.logit_bias or {}).items()
    ]
    if entries:
        row_idx, token_idx, biases = zip(*entries)
        logits.index_put_(
            (_index_tensor(row_idx, logits), _index_tensor(token_idx, logits)),
            _row_tensor(biases, logits),
            accumulate=True,
        )
    return logits


def apply_banned_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Set each row's banned ids to -inf so they can never be sampled."""
    row_idx = [i for i, row in enumerate(rows) for _ in row.banned_token_ids]
    if row_idx:
        token_idx = list(chain.from_iterable(row.banned_token_ids for row in rows))
        logits[_index_tensor(row_idx, logits), _index_tensor(token_idx, logits)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, as vLLM (and HF) apply them.

    - repetition (> 1 discourages): a token seen in the prompt or the output has a
      positive logit divided by the penalty and a negative one multiplied by it;
    - frequency: subtract penalty × the token's count in the output;
    - presence: subtract penalty once for each token present in the output.

    Only the rows with a penalty are touched, and the token sets are built only then.
    """
    penalized = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not penalized:
        return logits
    sub_rows = [rows[i] for i in penalized]
    index = _index_tensor(penalized, logits)
    sub = logits.index_select(0, index)
    vocab_size = logits.shape[1]

    output_counts = _token_counts([row.output_token_ids for row in sub_rows], vocab_size, logits)
    output_mask = output_counts > 0

    repetition = _row_tensor([row.params.repetition_penalty for row in sub_rows], logits)
    if bool((repetition != 1.0).any()):
        prompt_ids = [row.prompt_token_ids for row in sub_rows]
        prompt_mask = _token_counts(prompt_ids, vocab_size, logits) > 0
        factors = torch.where(prompt_mask | output_mask, repetition.unsqueeze(1), 1.0)
        sub = torch.where(sub > 0, sub / factors, sub * factors)

    frequency = [row.params.frequency_penalty for row in sub_rows]
    if any(frequency):
        sub -= _row_tensor(frequency, logits).unsqueeze(1) * output_counts
    presence = [row.params.presence_penalty for row in sub_rows]
    if any(presence):
        sub -= _row_tensor(presence, logits).unsqueeze(1) * output_mask

    logits.index_copy_(0, index, sub)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask to -inf the tokens that min-p, top-k or top-p drop, with one sort.

    Call on temperature-scaled logits. As in vLLM v1, min-p (keep tokens with
    prob >= min_p × max prob) and top-k (ties with the k-th logit are kept) look at
    the full distribution, and top-p then keeps the smallest set of the survivors
    whose renormalized cumulative prob reaches top_p. The top token always stays.
    """
    params = [row.params for row in rows]
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    if not (use_top_k or use_top_p or use_min_p):
        return logits

    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)

    if use_min_p:
        min_p = _row_tensor([p.min_p for p in params], logits)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]

    if use_top_k:
        k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        kth_logit = sorted_logits.gather(1, _index_tensor(k, logits).sub_(1).unsqueeze(1))
        drop |= sorted_logits < kth_logit

    if use_top_p:
        # A row without top-p gets a threshold above 1, so rounding in the cumsum
        # can never drop its tail.
        top_p = _row_tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], logits)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)

    drop[:, 0] = False
    return logits.masked_fill_(drop.scatter(1, sorted_idx, drop), float("-inf"))


# --- logprobs ---


def compute_token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> list[TokenLogprobs]:
    """The logprob and 1-based rank of each chosen token, plus the top `num_top`.

    `logprobs` [n, V] is already log_softmax'ed; `token_ids` [n]. The rank counts
    the tokens at least as likely as the chosen one (vLLM's convention, so ties
    share the worse rank). Everything crosses to the host in one go per tensor.
    """
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
        top_id_list, top_logprob_list = top_ids.tolist(), top_logprobs.tolist()
    else:
        top_id_list = [[] for _ in range(len(token_ids))]
        top_logprob_list = [[] for _ in range(len(token_ids))]
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=r, top_ids=ids, top_logprobs=lps)
        for t, lp, r, ids, lps in zip(
            token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(),
            top_id_list, top_logprob_list,
        )
    ]


def _chosen_logprobs(
    raw_logprobs: torch.Tensor | None,
    token_ids: torch.Tensor,
    rows: list[SamplingRow],
    logprob_rows: list[int],
) -> list[TokenLogprobs | None]:
    """Logprobs for the rows that asked: `raw_logprobs` holds those rows, in order."""
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is None:
        return logprobs
    # One top-k for all rows at the largest N asked, then trimmed per row.
    num_top = max(rows[i].params.logprobs for i in logprob_rows)
    entries = compute_token_logprobs(raw_logprobs, token_ids[logprob_rows], num_top)
    for i, entry in zip(logprob_rows, entries):
        wanted = rows[i].params.logprobs
        entry.top_ids = entry.top_ids[:wanted]
        entry.top_logprobs = entry.top_logprobs[:wanted]
        logprobs[i] = entry
    return logprobs


# --- helpers ---


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def _has_filter(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that changes the logits or asks for logprobs."""
    params = row.params
    return (
        params.greedy
        and not params.logit_bias
        and not row.banned_token_ids
        and params.logprobs is None
        and not _has_penalty(params)
    )


def _row_tensor(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def _index_tensor(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, like: torch.Tensor
) -> torch.Tensor:
    """How often each token id occurs in each list: [len(token_lists), V] float32.

    Built from one flat id tensor with index_add on the flattened counts, so there
    is no padding and no per-row tensor work.
    """
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=like.device)
    lengths = _index_tensor([len(ids) for ids in token_lists], like)
    flat_ids = _index_tensor(list(chain.from_iterable(token_lists)), like)
    if flat_ids.numel():
        rows = torch.repeat_interleave(torch.arange(len(token_lists), device=like.device), lengths)
        ones = torch.ones_like(flat_ids, dtype=torch.float32)
        counts.view(-1).index_add_(0, rows * vocab_size + flat_ids, ones)
    return counts
