"""The model runner's side of structured output: one grammar matcher per sequence.

Per step, for every sampled request with a constraint, the runner asks for its
logits rows' masks before the forward pass (`start`): a helper thread fills the
backend's token bitmask from each matcher and unpacks it into a boolean "disallowed"
mask while the forward runs (xgrammar, llguidance and torch release the GIL), so the
only work left on the critical path is one `masked_fill_` per constrained row
(`apply`). After sampling, `advance` feeds each matcher the tokens the request gained.

A request with proposed tokens (speculative decoding) gets one mask per verified row:
the matcher is advanced through the proposals to fill each row and rolled back after,
so a proposal the grammar forbids has probability zero and is rejected.

The matcher follows the request's output token ids, as the runner's `RequestTable`
knows them: when the counts differ (a preempted request recomputed from scratch, a run
of tokens cut by a stop) it is rebuilt by replaying the output. A token the grammar
rejects (it cannot happen through the mask, but a logit processor could ban every
allowed token) leaves the matcher broken: only EOS is allowed from then on, so the
sequence ends.

A constraint with `reasoning_end` (a reasoning parser is on) waits for the reasoning to
end, as vLLM's engine does: until the output has produced the marker (`</think>`, found
in the tokens' decoded bytes, so any tokenization of it counts) the request's rows are
not masked and its matcher is not fed; the first token after the marker is the
grammar's first. A prompt that already ends with the marker (thinking switched off by
the chat template) starts constrained. With `reasoning_start` too (Qwen3: reasoning
only if the output opens with `<think>`), the first token may be the grammar's or a
`<think>` token; any other first token begins the answer.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tokenmill.engine.batch import RunnerOutput, StepRequest
from tokenmill.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class _Phase:
    """Where a request with a reasoning marker is: at its first token with `<think>` still
    possible (`may_open`), reasoning (waiting for `marker`), or answering (the grammar's)."""

    may_open: bool = False
    start: bytes = b""  # reasoning_start
    marker: bytes | None = None  # reasoning_end, while it has not come
    tail: bytes = b""  # the last bytes of the reasoning, to find a marker split over tokens

    @property
    def answering(self) -> bool:
        return not self.may_open and self.marker is None

    def after(self, piece: bytes) -> tuple[_Phase, bool]:
        """The phase after a token with these bytes, and whether the grammar takes it."""
        if self.may_open:
            if piece.startswith(self.start):  # the output opens with <think>: reasoning
                return replace(self, may_open=False).after(piece[len(self.start):])[0], False
            return _Phase(), True  # the answer began with this token
        if self.marker is not None:
            tail = self.tail + piece
            if self.marker in tail:
                return _Phase(), False
            keep = len(self.marker) - 1
            return replace(self, tail=tail[-keep:] if keep else b""), False
        return self, True


@dataclass
class _Sequence:
    matcher: Any  # the backend's matcher (backends.py: xgrammar's calls)
    num_accepted: int = 0  # output tokens taken (fed to the matcher, or read as reasoning)
    broken: bool = False
    phase: _Phase = field(default_factory=_Phase)

    @property
    def reasoning(self) -> bool:
        """Still reasoning: no mask until a token could begin the answer."""
        return self.phase.marker is not None and not self.phase.may_open


@dataclass
class PendingMasks:
    """Masks being computed for one step: logits row -> its mask row."""

    rows: list[int]  # logits rows (in the runner's sampling order) that are constrained
    future: concurrent.futures.Future | None  # -> torch.BoolTensor [len(rows), vocab]: True = disallowed
    request_ids: list[str] = field(default_factory=list)  # constrained requests of the step


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.sequences: dict[str, _Sequence] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._eos_only: torch.Tensor | None = None
        self._decoded_vocab: list[bytes] | None = None  # each token's bytes (the backend's)
        self._opening: dict[bytes, torch.Tensor] = {}  # bitmasks of the tokens that open <think>

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
        # runner's thread; only the filling runs beside the forward. A request still
        # reasoning without proposals has no row to mask; with proposals it keeps its
        # rows, in case a proposal ends the reasoning.
        synced = [(self._sync(item), item, first) for item, first in work]
        sequences = [(seq, item, first) for seq, item, first in synced if not seq.reasoning or item.spec_token_ids]
        rows = [first + j for _, item, first in sequences for j in range(len(item.spec_token_ids) + 1)]
        future = self._pool.submit(self._fill, sequences, len(rows)) if rows else None
        return PendingMasks(rows, future, [item.request_id for item, _ in work])

    def _sync(self, item: StepRequest) -> _Sequence:
        """The request's matcher, having accepted exactly its output tokens."""
        outputs = item.output_token_ids
        seq = self.sequences.get(item.request_id)
        if seq is None or seq.num_accepted != len(outputs):
            seq = self._new_sequence(item)
            for token_id in outputs:
                self._take(seq, token_id)
            self.sequences[item.request_id] = seq
        return seq

    def _take(self, seq: _Sequence, token_id: int) -> bool:
        """One more output token: read as reasoning, or fed to the matcher; False if the
        grammar rejects it (the matcher is broken from then on)."""
        seq.num_accepted += 1
        if not seq.phase.answering:
            seq.phase, to_grammar = seq.phase.after(self._token_bytes(token_id))
            if not to_grammar:
                return True
        if seq.broken or seq.matcher.is_terminated():
            return True
        if not seq.matcher.accept_token(token_id):
            seq.broken = True
            return False
        return True

    def _token_bytes(self, token_id: int) -> bytes:
        vocab = self._token_bytes_all()
        return vocab[token_id] if 0 <= token_id < len(vocab) else b""

    def _token_bytes_all(self) -> list[bytes]:
        if self._decoded_vocab is None:
            self._decoded_vocab = self.compiler.token_bytes()
        return self._decoded_vocab

    def _reasoning_phase(self, item: StepRequest) -> _Phase:
        """Where the request starts: answering (no reasoning parser, or the prompt ends
        the reasoning already), reasoning (the output may begin inside `<think>`), or
        opening (reasoning only if the output opens with `<think>`)."""
        constraint = item.params.structured_outputs
        if constraint.reasoning_end is None:
            return _Phase()
        marker = constraint.reasoning_end.encode("utf-8")
        prompt_end = b"".join(self._token_bytes(t) for t in item.prompt_token_ids[-16:])
        if prompt_end.rstrip().endswith(marker):
            return _Phase()
        if constraint.reasoning_start is not None:
            return _Phase(may_open=True, start=constraint.reasoning_start.encode("utf-8"), marker=marker)
        return _Phase(marker=marker)

    def _new_sequence(self, item: StepRequest) -> _Sequence:
        """A fresh matcher. The API compiles every constraint before admission, so this
        finds it cached; one that fails here anyway ends its request, not the step."""
        try:
            grammar = self.compiler.compile(item.params.structured_outputs)
        except ValueError as error:
            logger.error("request %s: structured output not compiled (%s); ending it", item.request_id, error)
            return _Sequence(None, broken=True)
        return _Sequence(grammar.matcher(), phase=self._reasoning_phase(item))

    def _fill(self, sequences: list[tuple[_Sequence, StepRequest, int]], num_rows: int) -> torch.Tensor:
        bitmask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        index = 0
        for seq, item, _ in sequences:
            proposals = item.spec_token_ids
            if seq.broken or seq.matcher.is_terminated():  # only EOS from now on
                for _ in range(len(proposals) + 1):
                    bitmask[index] = self._eos_bitmask(bitmask.shape[1])
                    index += 1
                continue
            advanced, alive = 0, True
            phase = seq.phase  # a proposal may open or end the reasoning
            for j in range(len(proposals) + 1):
                if phase.answering and not alive:  # after a forbidden proposal: never used
                    bitmask[index] = bitmask[index - 1]
                elif phase.answering or phase.may_open:
                    seq.matcher.fill_next_token_bitmask(bitmask, index)
                    if phase.may_open:  # or a token that opens with <think>
                        bitmask[index] |= self._opening_bitmask(phase.start, bitmask.shape[1])
                else:  # reasoning: every token allowed
                    bitmask[index] = -1
                index += 1
                if j == len(proposals) or not alive:
                    continue
                to_grammar = phase.answering
                if not to_grammar:
                    phase, to_grammar = phase.after(self._token_bytes(proposals[j]))
                if to_grammar:
                    accepted = seq.matcher.accept_token(proposals[j])
                    advanced += int(accepted)
                    alive = accepted and not seq.matcher.is_terminated()
            if advanced:
                seq.matcher.rollback(advanced)
        allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(num_rows, -1)[:, : self.vocab_size]
        return allowed == 0

    def _opening_bitmask(self, start: bytes, words: int) -> torch.Tensor:
        """The tokens that open with `start` whole (Qwen3's and DeepSeek-R1's `<think>` is
        one token). A token that is only its first bytes ("<") is not one of them: a
        model whose vocabulary spells `<think>` in pieces does not reason, and "<" must
        not lead it out of the grammar."""
        mask = self._opening.get(start)
        if mask is None:
            ids = [i for i, piece in enumerate(self._token_bytes_all()) if piece.startswith(start)]
            mask = self._opening[start] = _bits(ids, words)
        return mask

    def _eos_bitmask(self, words: int) -> torch.Tensor:
        if self._eos_only is None:
            self._eos_only = _bits(self.compiler.stop_token_ids, words)
        return self._eos_only

    # ----- after the forward ---------------------------------------------------------

    def apply(self, pending: PendingMasks, logits: torch.Tensor) -> None:
        """Set every token the grammar forbids to -inf, in place (waits for the masks)."""
        if pending.future is None:  # only requests still reasoning
            return
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
                if not self._take(seq, token_id):
                    logger.warning("request %s: token %d is outside its grammar; ending it", request_id, token_id)


def _bits(token_ids, words: int) -> torch.Tensor:
    """A bitmask row (xgrammar's and llguidance's layout) allowing exactly these tokens."""
    mask = torch.zeros(words, dtype=torch.int32)
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        if word < words:
            value = 1 << bit
            mask[word] |= value - 2**32 if value >= 2**31 else value  # int32 holds bit 31 as the sign
    return mask
