"""Draft-model proposer: a second, smaller model with the same vocabulary guesses the next
k tokens, one forward pass each, and the target verifies them in one step.

The draft runs on its own `ModelRunner` (the same code as the target's: layout, paged
attention, execution plan) over its own paged KV cache. Its blocks are kept by a
`KVBlockManager` of its own and follow the request's life: allocated when the request is
first drafted for, extended as it grows, freed when the engine says it finished, was
aborted or preempted (`release`). Between steps the draft's KV holds the request's known
tokens plus the proposals it computed; after verification, the accepted prefix of those
proposals stays valid, the rest is overwritten ("catching up" costs one forward pass over
the tokens the draft has not seen: the accepted ones beyond what it computed, and the
token the target sampled).

Each proposal is drawn from the draft's distribution processed exactly as the target's
(the request's temperature, top-k, top-p, min-p, penalties, logit bias), greedy requests
take its argmax. For sampled requests those distributions are kept until the target's
verification asks for them (`draft_probs`), since the rejection rule needs q(x) and the
residual max(0, p - q).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.engine.batch import RequestState, ScheduledRequest, StepRequest
from tokenmill.engine.block_manager import KVBlockManager
from tokenmill.engine.request import Request
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.rejection import process_logits, sampling_probs
from tokenmill.sampling.sampler import SamplingRow, make_generator
from tokenmill.spec_decode.proposer import proposal_room


@dataclass
class DraftSequence:
    """One request as the draft sees it. Quacks like a `Request` for the block manager
    (id, known tokens, computed count, params, cache salt)."""

    request_id: str
    params: SamplingParams
    cache_salt: str | None
    all_token_ids: list[int]  # the request's known tokens (the request's own list)
    state: RequestState  # the runner's view: token_ids = tokens whose KV the draft holds or computes now
    num_computed_tokens: int = 0  # tokens whose KV the draft's cache holds and that are still valid

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:  # as its request's does (Request.reads_prefix_cache)
        return self.params.prompt_logprobs is None


@dataclass
class _Job:
    """One request drafted for in this call."""

    request: Request
    seq: DraftSequence
    k: int  # proposals wanted
    proposals: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q per proposal (sampled requests)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, seed: int = 0) -> None:
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = KVBlockManager(runner.kv_cache.num_blocks, runner.block_size, enable_prefix_caching)
        self.sequences: dict[str, DraftSequence] = {}
        self.distributions: dict[str, tuple[list[int], torch.Tensor]] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.shared_generator = make_generator(seed + 1, runner.device)  # not the target sampler's stream

    # ----- the engine's side ----------------------------------------------------------------

    def propose(self, requests: Sequence[Request]) -> None:
        jobs = []
        for request in requests:
            request.spec_token_ids = []
            k = proposal_room(request, self.num_speculative_tokens)
            seq = self._sync(request) if k > 0 else None
            if seq is not None:
                jobs.append(_Job(request, seq, k))
        if not jobs:
            return
        with torch.inference_mode():
            logits = self._catch_up(jobs)
            active = jobs
            while True:
                self._sample(active, logits)
                active = [job for job in active if len(job.proposals) < job.k]
                if not active:
                    break
                logits = self._decode(active)
        for job in jobs:
            job.request.spec_token_ids = job.proposals
            if job.probs:
                self.distributions[job.request.request_id] = (job.proposals, torch.stack(job.probs))
            else:
                self.distributions.pop(job.request.request_id, None)

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            seq = self.sequences.pop(request_id, None)
            if seq is not None:
                self.kv.free(seq)
            self.distributions.pop(request_id, None)
            self.generators.pop(request_id, None)

    # ----- the target runner's side ------------------------------------------------------

    def draft_probs(self, request_id: str, proposals: list[int]) -> torch.Tensor | None:
        """The distributions the proposals being verified were drawn from (None for
        greedy requests, whose verification needs none)."""
        entry = self.distributions.pop(request_id, None)
        if entry is None:
            return None
        drafted, probs = entry
        if drafted[: len(proposals)] != proposals:
            raise RuntimeError(f"{request_id}: verifying {proposals}, but the draft proposed {drafted}")
        return probs[: len(proposals)]

    # ----- KV -------------------------------------------------------------------------------

    def _sync(self, request: Request) -> DraftSequence | None:
        """Bring the request's draft state up to its known tokens: keep the KV of the
        proposals the target accepted, drop the rest, and allocate slots for what this call
        computes (the tokens the draft has not seen, and all but the last proposal).
        None when the draft's cache has no room (no proposals for it this time)."""
        k = proposal_room(request, self.num_speculative_tokens)
        known = request.all_token_ids
        seq = self.sequences.get(request.request_id)
        if seq is None:
            state = RequestState(request.request_id, request.prompt_token_ids, request.params, [], [])
            seq = DraftSequence(request.request_id, request.params, request.cache_salt, known, state)
            hits, num_hit_tokens = self.kv.get_computed_blocks(seq)
            if not self.kv.allocate_slots(seq, len(known) - num_hit_tokens + k - 1, hits):
                return None
            self.sequences[request.request_id] = seq
            seq.num_computed_tokens = num_hit_tokens
        else:
            seq.all_token_ids = known
            computed = seq.state.token_ids
            valid = 0
            limit = min(len(computed), len(known) - 1)  # the last known token is always new to the draft
            while valid < limit and computed[valid] == known[valid]:
                valid += 1
            seq.num_computed_tokens = valid
            if not self.kv.allocate_slots(seq, len(known) - valid + k - 1):
                seq.state.token_ids = known[:valid]
                return None
        seq.state.token_ids = list(known)
        seq.state.block_ids = self.kv.get_block_ids(request.request_id)
        return seq

    # ----- forward passes ------------------------------------------------------------------

    def _catch_up(self, jobs: list[_Job]) -> torch.Tensor:
        """Compute each job's unseen known tokens, in passes of at most
        max_num_batched_tokens tokens; returns the logits at each job's last known token."""
        remaining = {id(job): job.seq.num_computed_tokens for job in jobs}  # next position to compute
        last_logits: dict[int, torch.Tensor] = {}
        while len(last_logits) < len(jobs):
            budget, items, finishing = self.max_num_batched_tokens, [], []
            for job in jobs:
                start, end = remaining[id(job)], job.seq.num_tokens
                if start >= end or budget == 0:
                    continue
                n = min(end - start, budget)
                items.append(self._step_request(job.seq, start, n))
                remaining[id(job)] = start + n
                budget -= n
                if start + n == end:
                    finishing.append((job, len(items) - 1))
            hidden, starts = self.runner.forward(items)
            if finishing:
                rows = [starts[i + 1] - 1 for _, i in finishing]
                logits = self.runner.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
                for (job, _), row in zip(finishing, logits):
                    last_logits[id(job)] = row
        for job in jobs:
            job.seq.num_computed_tokens = job.seq.num_tokens
        return torch.stack([last_logits[id(job)] for job in jobs])

    def _decode(self, jobs: list[_Job]) -> torch.Tensor:
        """One token per job: its latest proposal, at the position after the ones before."""
        items = []
        for job in jobs:
            job.seq.state.token_ids.append(job.proposals[-1])
            items.append(self._step_request(job.seq, len(job.seq.state.token_ids) - 1, 1))
        hidden, _ = self.runner.forward(items)
        return self.runner.model.compute_logits(hidden)

    @staticmethod
    def _step_request(seq: DraftSequence, start: int, num_tokens: int) -> StepRequest:
        item = ScheduledRequest(seq.request_id, start, num_tokens, [], [], sample=True)
        return StepRequest(seq.state, item)

    # ----- sampling ----------------------------------------------------------------------

    def _sample(self, jobs: list[_Job], logits: torch.Tensor) -> None:
        """Each job's next proposal from its row of logits: the argmax for greedy
        requests, a draw from the processed distribution (kept) for the others."""
        rows = [self._sampling_row(job) for job in jobs]
        logits = logits.float().clone()
        greedy = [i for i, job in enumerate(jobs) if job.request.params.greedy]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            tokens = process_logits(logits[index], [rows[i] for i in greedy]).argmax(dim=-1).tolist()
            for i, token in zip(greedy, tokens):
                jobs[i].proposals.append(token)
        random = [i for i, job in enumerate(jobs) if not job.request.params.greedy]
        if random:
            index = torch.tensor(random, device=logits.device)
            probs = sampling_probs(logits[index], [rows[i] for i in random])
            cdf = probs.cumsum(dim=-1)
            points = torch.tensor([self._uniform(jobs[i]) for i in random], device=logits.device) * cdf[:, -1]
            tokens = torch.searchsorted(cdf, points.unsqueeze(1), right=True).squeeze(1)
            tokens = tokens.clamp_(max=probs.shape[1] - 1).tolist()
            for i, token, q in zip(random, tokens, probs):
                jobs[i].proposals.append(token)
                jobs[i].probs.append(q)

    @staticmethod
    def _sampling_row(job: _Job) -> SamplingRow:
        request = job.request
        # Proposals only come once min_tokens is reached, so nothing is banned.
        return SamplingRow(request.params, None, request.prompt_token_ids,
                           request.output_token_ids + job.proposals, [])

    def _uniform(self, job: _Job) -> float:
        """A seeded request drafts from its own generator (seeded apart from the target's)."""
        seed = job.request.params.seed
        if seed is None:
            generator = self.shared_generator
        else:
            generator = self.generators.get(job.request.request_id)
            if generator is None:
                generator = make_generator((seed ^ 0x5DEECE66D) & (2**63 - 1), self.runner.device)
                self.generators[job.request.request_id] = generator
        return float(torch.rand(1, generator=generator, device=self.runner.device))
