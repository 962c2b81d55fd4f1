"""Turns a SchedulerOutput into tensors, runs the model and samples.

It owns the paged KV cache, the attention backend, the execution plan and the
per-request random generators; it knows requests only through the step messages
(rebuilt into whole views by a `RequestTable`). A request with proposed tokens gets one
row of logits per proposal plus one, verified by `sampling.rejection`. A draft model
runs on its own `ModelRunner` through `forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill import kernels
from tokenmill.attention.backend import AttentionBackend, BatchLayout, ForwardContext, forward_context
from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache
from tokenmill.engine.batch import PromptLogprobsChunk, RequestTable, RunnerOutput, SchedulerOutput, StepRequest
from tokenmill.engine.interrupt import StepInterrupt
from tokenmill.kv_transfer.shared_memory import PeerRegion, SharedRegion
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.pooling import Pooler
from tokenmill.runner.kv_offload import COPY_IN_CHUNK, HostKVBuffer, block_tensors, copy_in_blocks, read_blocks
from tokenmill.runner.plan import AttentionSpan, ExecutionPlan
from tokenmill.runner.shared_kv_pool import copy_from_peer, pool_layout
from tokenmill.runner.threads import ThreadGovernor
from tokenmill.sampling.rejection import RejectionSampler, Verification
from tokenmill.sampling.sampler import Sampler, SamplingRow, compute_token_logprobs
from tokenmill.structured_output.manager import PendingMasks, StructuredOutputManager

# (request id, proposals) -> the [len(proposals), V] distributions a draft sampled them
# from, or None for point masses; set by the builder when a draft model proposes.
DraftProbs = Callable[[str, list[int]], "torch.Tensor | None"]

# Prompt positions whose logprobs are computed together (bounds the [rows, vocab] logits).
_PROMPT_LOGPROBS_ROWS = 128


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        plan: ExecutionPlan,
        device: torch.device,
        seed: int = 0,
        threads: ThreadGovernor | None = None,
    ) -> None:
        self.model = model
        self.threads = threads  # None: a fixed thread count (or not a CPU)
        self.kv_cache = kv_cache
        self.backend = backend
        self.plan = plan
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.sampler = Sampler(seed, kernels.argmax_rows)  # torch's argmax where the kernels did not build
        self.verifier = RejectionSampler(self.sampler)
        self.draft_probs: DraftProbs | None = None
        self.requests = RequestTable()
        self.generators: dict[str, torch.Generator] = {}
        self.short_chunks_as_decodes = True  # off: every multi-token chunk attends as one (benchmarks)
        # Grammar matchers of requests with structured outputs (set by the builder).
        self.structured_output: StructuredOutputManager | None = None
        # The pooling runner's (set by the builder): pooling requests' vectors instead of tokens.
        self.pooler: Pooler | None = None
        self.host_kv: HostKVBuffer | None = None  # the host KV tier's memory, made at its first transfer
        self.host_kv_spec: KVCacheSpec | None = None  # its 8-bit block format (--kv-offloading-cache-dtype); None: the pool's
        self._pool_bytes: list[torch.Tensor] | None = None  # the pool's tensors as bytes (pulled KV is written there)
        self._copy_in_staging: torch.Tensor | None = None  # pulled blocks staged for the copy into the pool
        self.shared_kv_region: SharedRegion | None = None  # a disaggregated producer's pool lives there (worker.py)
        # --priority-interrupt: the engine's flag, armed for steps a better-ranked arrival may cut.
        self.interrupt: StepInterrupt | None = None

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        for request_id in batch.finished_ids:
            self.generators.pop(request_id, None)
        for item in batch.scheduled:
            # A request that starts afresh starts its seed's stream afresh: the last request of
            # a run finishes with no step after it to say so, and an engine sharing this
            # runner (LLMEngine.sibling) numbers its requests from 0 again. A preempted one
            # comes back as new with its generated tokens and keeps its stream.
            if item.new is not None and not item.appended_token_ids:
                self.generators.pop(item.request_id, None)
        if self.structured_output is not None:
            self.structured_output.release([*batch.finished_ids, *batch.preempted_ids])
        if self.pooler is not None:
            self.pooler.release([*batch.finished_ids, *batch.preempted_ids])
        if batch.kv_transfers:  # the host tier's copies, before anything reads or writes the pool
            if self.host_kv is None:
                self.host_kv = HostKVBuffer(self.kv_cache, self.host_kv_spec)
            self.host_kv.apply(batch.kv_transfers)
        output = self.run(self.requests.apply(batch))
        if self.host_kv is not None:  # the disk tier's writes finished (or not) since the last step
            output.kv_disk_written, output.kv_disk_failed = self.host_kv.finish_step()
        return output

    def kv_block_bytes(self, block_ids: list[int]) -> list[bytes]:
        """These pool blocks' KV as bytes, one entry per block, in the pool's own layout and
        dtype (a disaggregated producer serves them; the blocks are held, so no step writes
        them meanwhile, and this may run on another thread)."""
        if self._pool_bytes is None:
            self._pool_bytes = block_tensors(self.kv_cache)
        return read_blocks(self._pool_bytes, block_ids)

    def write_kv_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Pulled KV (`kv_block_bytes`' bytes, from a producer) into these pool blocks. A
        disaggregated consumer's puller thread calls it while the engine thread runs steps:
        the blocks belong to a request waiting for its KV, which no step reads or writes, and
        the scheduler frees them only once the pull is reported (engine/kv_transfer.py)."""
        with torch.inference_mode():
            if self._pool_bytes is None:
                self._pool_bytes = block_tensors(self.kv_cache)
            if self._copy_in_staging is None:
                size = sum(t[0].numel() for t in self._pool_bytes)
                self._copy_in_staging = torch.zeros((COPY_IN_CHUNK, size), dtype=torch.uint8)  # touched once
            copy_in_blocks(self._pool_bytes, payloads, block_ids, self._copy_in_staging)

    def shared_kv_pool(self) -> dict | None:
        """Where this producer's pool is in shared memory, for consumers on this host (None: not there)."""
        region = self.shared_kv_region
        return region.describe(pool_layout(region, self.kv_cache)) if region is not None else None

    def copy_shared_kv_blocks(self, peer: PeerRegion, remote_block_ids: list[int], block_ids: list[int]) -> None:
        """A producer's pool blocks (its mapped shared memory) into these pool blocks; the
        puller thread calls it as it calls `write_kv_blocks`, under the same ownership rules."""
        with torch.inference_mode():
            if self._pool_bytes is None:
                self._pool_bytes = block_tensors(self.kv_cache)
            copy_from_peer(self._pool_bytes, peer, remote_block_ids, block_ids)

    @torch.inference_mode()
    def run(self, items: list[StepRequest]) -> RunnerOutput:
        """Compute and sample some of a step's requests (all of them, or a pipeline
        micro-batch); a pipeline stage before the last returns an empty output."""
        if not items:
            return RunnerOutput()
        if self.threads is not None:
            self.threads.update()
        # Grammar masks of the rows sampled next are filled while the forward runs.
        masks = self.structured_output.start(items) if self.structured_output is not None else None
        hidden, starts = self.forward(items)
        if hidden is None:  # a pipeline stage before the last: its hidden states went on
            return RunnerOutput()
        output = RunnerOutput()
        self._pool(items, hidden, starts, output)
        self._sample(items, hidden, starts, output, masks)
        if masks is not None:
            self.structured_output.advance(masks, output)
        self._prompt_logprobs(items, hidden, starts, output)
        return output

    def forward(self, items: list[StepRequest]) -> tuple[torch.Tensor | None, list[int]]:
        """Compute the step's tokens (known and proposed), writing their KV; returns the
        final hidden state of every token (None on a pipeline stage before the last) and
        where each request's rows start."""
        layout = self._layout(items)
        input_ids = torch.tensor([t for r in items for t in r.token_ids], dtype=torch.long, device=self.device)
        positions = torch.tensor(
            [p for r in items for p in range(r.start_pos, r.context_len)], dtype=torch.long, device=self.device
        )
        kind = self.plan.step_kind(len(layout.query_lens), layout.all_decode)  # the step's one decision
        ctx = ForwardContext.for_step(kind, self.backend, layout, self.kv_cache, self.device)
        ctx.activation_dtype = self.plan.activation_dtype(kind, len(input_ids))
        ctx.interrupt = self.interrupt
        if self.kv_cache.num_sliding_blocks:  # a hybrid cache: the sliding layers' own tables and slots
            sliding = self._layout(items, sliding=True)
            ctx.sliding_metadata = self.backend.build_metadata(sliding, self.device)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        starts = [0]
        for r in items:
            starts.append(starts[-1] + r.num_tokens)
        return hidden, starts

    def _layout(self, items: list[StepRequest], sliding: bool = False) -> BatchLayout:
        """The step's layout over the requests' block tables (`sliding`: their tables in a
        hybrid cache's sliding-window pool)."""
        size = self.block_size
        tables = [r.sliding_block_ids if sliding else r.block_ids for r in items]
        slots = [
            table[p // size] * size + p % size for r, table in zip(items, tables) for p in range(r.start_pos, r.context_len)
        ]
        query_lens, context_lens, block_tables, one_token_chunks = [], [], [], set()
        for r, table in zip(items, tables):
            for span in self._attention_spans(r):
                end = span.start + span.count
                if span.as_rows:
                    query_lens += [1] * span.count
                    context_lens += range(span.start + 1, end + 1)
                    block_tables += [table] * span.count
                    continue
                if span.count == 1:
                    one_token_chunks.add(len(query_lens))
                query_lens.append(span.count)
                context_lens.append(end)
                block_tables.append(table)
        return BatchLayout(query_lens, context_lens, block_tables, slots, size, frozenset(one_token_chunks))

    def _attention_spans(self, r: StepRequest) -> list[AttentionSpan]:
        if not self.short_chunks_as_decodes:  # benchmarks: every multi-token chunk as one
            return [AttentionSpan(r.start_pos, r.num_tokens, as_rows=r.num_tokens == 1)]
        return self.plan.attention_spans(r.start_pos, r.num_tokens, len(r.prompt_token_ids))

    def _sample(self, items: list[StepRequest], hidden: torch.Tensor, starts: list[int], output: RunnerOutput,
                masks: PendingMasks | None = None) -> None:
        """One token after the last known token of each request that samples; for one with
        proposals, a row per proposal too, verified. One LM-head pass for all rows; the
        tokens a request's grammar forbids are masked out first (`masks`)."""
        sampled = [i for i, r in enumerate(items) if r.sample and r.pooling_params is None]
        plain = [i for i in sampled if not items[i].spec_token_ids]
        spec = [i for i in sampled if items[i].spec_token_ids]
        if not plain and not spec:
            return
        rows = [starts[i] + items[i].item.num_new_tokens - 1 for i in plain]
        for i in spec:  # the last known token's row, then one per proposal
            first = starts[i] + items[i].item.num_new_tokens - 1
            rows.extend(range(first, first + len(items[i].spec_token_ids) + 1))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        if masks is not None:
            self.structured_output.apply(masks, logits)
        if plain:
            result = self.sampler(logits[: len(plain)], [self._sampling_row(items[i]) for i in plain])
            for i, token_id, logprobs in zip(plain, result.token_ids, result.logprobs):
                request_id = items[i].request_id
                output.sampled_token_ids[request_id] = [token_id]
                if logprobs is not None:
                    output.logprobs[request_id] = [logprobs]
        if spec:
            self._verify([items[i] for i in spec], logits[len(plain):], output)

    def _pool(self, items: list[StepRequest], hidden: torch.Tensor, starts: list[int], output: RunnerOutput) -> None:
        """Hand each pooling request's rows to the pooler; the one whose prompt ends in this
        step gets its vector. Nothing is sampled for them (no LM head pass)."""
        for i, item in enumerate(items):
            if item.pooling_params is None:
                continue
            if self.pooler is None:
                raise RuntimeError(f"{item.request_id} is a pooling request, but this runner has no pooler "
                                   "(the engine runs the generate runner)")
            vector = self.pooler.add(item.request_id, item.start_pos, hidden[starts[i]:starts[i + 1]], item.sample,
                                     item.pooling_params)
            if vector is not None:
                output.pooled[item.request_id] = vector

    def _verify(self, items: list[StepRequest], logits: torch.Tensor, output: RunnerOutput) -> None:
        verifications = [
            Verification(self._sampling_row(item), item.spec_token_ids,
                         self.draft_probs(item.request_id, item.spec_token_ids) if self.draft_probs else None)
            for item in items
        ]
        for item, verified in zip(items, self.verifier(logits, verifications)):
            output.sampled_token_ids[item.request_id] = verified.token_ids
            output.num_draft_tokens[item.request_id] = len(item.spec_token_ids)
            if verified.logprobs is not None:
                output.logprobs[item.request_id] = verified.logprobs

    def _sampling_row(self, item: StepRequest) -> SamplingRow:
        return SamplingRow(
            params=item.params,
            generator=self._generator(item),
            prompt_token_ids=item.prompt_token_ids,
            output_token_ids=item.output_token_ids,
            banned_token_ids=item.banned_token_ids,
        )

    def _generator(self, item: StepRequest) -> torch.Generator | None:
        """A seeded request draws only from its own generator, so its samples do
        not depend on what else is in the batch."""
        if item.params.seed is None:
            return None
        generator = self.generators.get(item.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(item.params.seed)
            self.generators[item.request_id] = generator
        return generator

    def _prompt_logprobs(
        self, items: list[StepRequest], hidden: torch.Tensor, starts: list[int], output: RunnerOutput
    ) -> None:
        for i, item in enumerate(items):
            targets = item.prompt_logprobs_targets
            if not targets:
                continue
            # A few rows at a time: logits of a whole 2048-token chunk are [2048, vocab]
            # floats twice over (~0.8 GB for a 49k vocabulary), which one small request
            # with echo and logprobs could otherwise make the server allocate.
            entries = []
            for first in range(0, len(targets), _PROMPT_LOGPROBS_ROWS):
                block = targets[first : first + _PROMPT_LOGPROBS_ROWS]
                rows = hidden[starts[i] + first : starts[i] + first + len(block)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
                target_ids = torch.tensor(block, device=self.device)
                entries += compute_token_logprobs(logprobs, target_ids, item.params.prompt_logprobs)
            output.prompt_logprobs[item.request_id] = PromptLogprobsChunk(item.start_pos + 1, entries)
