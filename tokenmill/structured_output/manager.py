"""The model runner's side of structured output: one grammar matcher per sequence.

Per step, for every sampled request with a constraint, the runner asks for its
logits rows' masks before the forward pass (`start`): a helper thread fills xgrammar's
token bitmask from each matcher and unpacks it into a boolean "disallowed" mask while
the forward runs (xgrammar and torch release the GIL), so the only work left on the
critical path is one `masked_fill_` per constrained row (`apply`). After sampling,
`advance` feeds each matcher the tokens the request gained.

A request with proposed tokens (speculative decoding) gets one mask per verified row:
the matcher is advanced through the proposals to fill each row and rolled back after,
so a proposal the grammar forbids has probability zero and is rejected.

The matcher follows the request's output token ids, as the runner's `RequestTable`
knows them: when the counts differ (a preempted request recomputed from scratch, a run
of tokens cut by a stop) it is rebuilt by replaying the output. A token the grammar
rejects (it cannot happen through the mask, but a logit processor could ban every
allowed token) leaves the matcher broken: only EOS is allowed from then on, so the
sequence ends.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.engine.batch import RunnerOutput, StepRequest
from tokenmill.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass
class _Sequence:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # output tokens fed to the matcher
    broken: bool = False


@dataclass
class PendingMasks:
    """Masks being computed for one step: logits row -> its mask row."""

    rows: list[int]  # logits rows (in the runner's sampling order) that are constrained
    future: concurrent.futures.Future  # -> torch.BoolTensor [len(rows), vocab]: True = disallowed
    request_ids: list[str] = field(default_factory=list)  # constrained requests of the step


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.sequences: dict[str, _Sequence] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._eos_only: torch.Tensor | None = None

    def release(self, request_ids) -> None:
        """Forget finished and preempted requests (a preempted one is rebuilt on return)."""
        for request_id in request_ids:
            self.sequences.pop(request_id, None)

    # ----- before the forward --------------------------------------------------------

    def start(self, items: list[StepRequest]) -> PendingMasks | None:
        """Begin filling the masks of this step's constrained rows, in the order the
        runner lays out its logits: requests without proposals first (one row each),
        then each request with proposals (one row per proposal plus one)."""
        plain = [r for r in items if r.sample and not r.spec_token_ids]
        spec = [r for r in items if r.sample and r.spec_token_ids]
        work: list[tuple[StepRequest, int]] = []  # (request, its first logits row)
        row = 0
        for item in plain:
            if item.params.structured_outputs is not None:
                work.append((item, row))
            row += 1
        for item in spec:
            if item.params.structured_outputs is not None:
                work.append((item, row))
            row += len(item.spec_token_ids) + 1
        if not work:
            return None
        # Matchers are looked up (and compiled, if the server did not) here, on the
        # runner's thread; only the filling runs beside the forward.
        sequences = [(self._sync(item), item, first) for item, first in work]
        rows = [first + j for _, item, first in sequences for j in range(len(item.spec_token_ids) + 1)]
        future = self._pool.submit(self._fill, sequences, len(rows))
        return PendingMasks(rows, future, [item.request_id for item, _ in work])

    def _sync(self, item: StepRequest) -> _Sequence:
        """The request's matcher, having accepted exactly its output tokens."""
        outputs = item.output_token_ids
        seq = self.sequences.get(item.request_id)
        if seq is None or seq.num_accepted != len(outputs):
            seq = self._new_sequence(item)
            for token_id in outputs:
                if not seq.broken and not seq.matcher.accept_token(token_id):
                    seq.broken = True
            seq.num_accepted = len(outputs)
            self.sequences[item.request_id] = seq
        return seq

    def _new_sequence(self, item: StepRequest) -> _Sequence:
        """A fresh matcher. The API compiles every constraint before admission, so this
        finds it cached; one that fails here anyway ends its request, not the step."""
        import xgrammar as xgr

        try:
            grammar = self.compiler.compile(item.params.structured_outputs)
        except ValueError as error:
            logger.error("request %s: structured output not compiled (%s); ending it", item.request_id, error)
            return _Sequence(None, broken=True)
        return _Sequence(xgr.GrammarMatcher(grammar))

    def _fill(self, sequences: list[tuple[_Sequence, StepRequest, int]], num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        index = 0
        for seq, item, _ in sequences:
            proposals = item.spec_token_ids
            if seq.broken or seq.matcher.is_terminated():  # only EOS from now on
                for _ in range(len(proposals) + 1):
                    bitmask[index] = self._eos_bitmask(bitmask.shape[1])
                    index += 1
                continue
            advanced, alive = 0, True
            for j in range(len(proposals) + 1):
                if alive:
                    seq.matcher.fill_next_token_bitmask(bitmask, index)
                else:  # after a forbidden proposal: never used (the verifier stops there)
                    bitmask[index] = bitmask[index - 1]
                index += 1
                if j < len(proposals) and alive:
                    accepted = seq.matcher.accept_token(proposals[j])
                    advanced += int(accepted)
                    alive = accepted and not seq.matcher.is_terminated()
            if advanced:
                seq.matcher.rollback(advanced)
        allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(num_rows, -1)[:, : self.vocab_size]
        return allowed == 0

    def _eos_bitmask(self, words: int) -> torch.Tensor:
        if self._eos_only is None:
            mask = torch.zeros(words, dtype=torch.int32)
            for token_id in self.compiler.tokenizer_info.stop_token_ids:
                word, bit = divmod(token_id, 32)
                value = 1 << bit
                mask[word] |= value - 2**32 if value >= 2**31 else value  # int32 holds bit 31 as the sign
            self._eos_only = mask
        return self._eos_only

    # ----- after the forward ---------------------------------------------------------

    def apply(self, pending: PendingMasks, logits: torch.Tensor) -> None:
        """Set every token the grammar forbids to -inf, in place (waits for the masks)."""
        disallowed = pending.future.result().to(logits.device)
        width = logits.shape[1]
        for k, row in enumerate(pending.rows):
            logits[row, : disallowed.shape[1]].masked_fill_(disallowed[k, :width], float("-inf"))

    def advance(self, pending: PendingMasks, output: RunnerOutput) -> None:
        """Feed each constrained request's matcher the tokens it gained this step."""
        for request_id in pending.request_ids:
            seq = self.sequences.get(request_id)
            tokens = output.sampled_token_ids.get(request_id)
            if seq is None or not tokens:
                continue
            for token_id in tokens:
                if not seq.broken and not seq.matcher.is_terminated() and not seq.matcher.accept_token(token_id):
                    logger.warning("request %s: token %d is outside its grammar; ending it", request_id, token_id)
                    seq.broken = True
            seq.num_accepted += len(tokens)
