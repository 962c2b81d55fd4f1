"""Turns a SchedulerOutput into tensors, runs the model and samples.

It owns the paged KV cache, the attention backend, the execution plan and the
per-request random generators; it knows requests only through the step messages
(rebuilt into whole views by a `RequestTable`).
"""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend, BatchLayout, ForwardContext, PagedDecode, forward_context
from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.engine.batch import PromptLogprobsChunk, RequestTable, RunnerOutput, SchedulerOutput, StepRequest
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.runner.plan import ExecutionPlan
from tokenmill.runner.threads import ThreadGovernor
from tokenmill.sampling.sampler import Sampler, SamplingRow, compute_token_logprobs

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
        self.sampler = Sampler(seed)
        self.requests = RequestTable()
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        for request_id in batch.finished_ids:
            self.generators.pop(request_id, None)
        return self.run(self.requests.apply(batch))

    @torch.inference_mode()
    def run(self, items: list[StepRequest]) -> RunnerOutput:
        """Compute and sample some of a step's requests (all of them, or a pipeline
        micro-batch); a pipeline stage before the last returns an empty output."""
        if not items:
            return RunnerOutput()
        if self.threads is not None:
            self.threads.update()
        layout = self._layout(items)
        input_ids = torch.tensor([t for r in items for t in r.token_ids], dtype=torch.long, device=self.device)
        positions = torch.tensor(
            [p for r in items for p in range(r.start_pos, r.context_len)], dtype=torch.long, device=self.device
        )
        if self.plan.use_fused_decode(len(items), layout.all_decode):
            ctx = ForwardContext(self.backend, None, self.kv_cache, PagedDecode.from_layout(layout, self.device))
        else:
            ctx = ForwardContext(self.backend, self.backend.build_metadata(layout, self.device), self.kv_cache)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        if hidden is None:  # a pipeline stage before the last: its hidden states went on
            return RunnerOutput()
        starts = layout.query_starts
        output = RunnerOutput()
        self._sample(items, hidden, starts, output)
        self._prompt_logprobs(items, hidden, starts, output)
        return output

    def _layout(self, items: list[StepRequest]) -> BatchLayout:
        size = self.block_size
        slots = [
            r.block_ids[p // size] * size + p % size for r in items for p in range(r.start_pos, r.context_len)
        ]
        return BatchLayout(
            query_lens=[r.num_tokens for r in items],
            context_lens=[r.context_len for r in items],
            block_tables=[r.block_ids for r in items],
            slot_mapping=slots,
            block_size=size,
        )

    def _sample(self, items: list[StepRequest], hidden: torch.Tensor, starts: list[int], output: RunnerOutput) -> None:
        """One token after the last known token of each request that samples."""
        to_sample = [i for i, r in enumerate(items) if r.sample]
        if not to_sample:
            return
        rows = torch.tensor([starts[i] + items[i].item.num_new_tokens - 1 for i in to_sample], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        sampling_rows = [self._sampling_row(items[i]) for i in to_sample]
        result = self.sampler(logits, sampling_rows)
        for i, token_id, logprobs in zip(to_sample, result.token_ids, result.logprobs):
            request_id = items[i].request_id
            output.sampled_token_ids[request_id] = [token_id]
            if logprobs is not None:
                output.logprobs[request_id] = [logprobs]

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
