"""Turns a SchedulerOutput into tensors, runs the model and samples.

It owns the paged KV cache tensors, the attention backend and the per-request
random generators; it knows requests only as the plain ScheduledRequest items.
"""

from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend, BatchLayout, ForwardContext, forward_context
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.engine.batch import PromptLogprobsChunk, RunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.model.config import ModelArchConfig
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.sampling.sampler import Sampler, SamplingRow, compute_token_logprobs

# Prompt positions whose logprobs are computed together (bounds the [rows, vocab] logits).
_PROMPT_LOGPROBS_ROWS = 128


def kv_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        backend: AttentionBackend | None = None,
        kv_dtype: torch.dtype | None = None,  # None: the model's compute dtype
    ) -> None:
        self.model = model
        self.arch = model.cfg
        self.vocab_size = model.cfg.vocab_size
        self.block_size = block_size
        self.device = device
        self.dtype = model.dtype  # activations and KV cache
        self.weight_dtype = model.embed_tokens.weight.dtype  # may be narrower (CPU, --dtype bfloat16)
        self.kv_dtype = kv_dtype or self.dtype
        self.backend = backend or TorchSDPABackend()
        self.sampler = Sampler(seed)
        self.generators: dict[str, torch.Generator] = {}
        shape = (num_blocks, block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # Zeroed, not empty: padded decode reads touch unwritten slots (masked out,
        # but garbage NaNs would still poison the weighted sum).
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=device), torch.zeros(shape, dtype=self.kv_dtype, device=device))
            for _ in range(self.arch.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        for request_id in batch.finished_ids:
            self.generators.pop(request_id, None)
        if batch.is_empty:
            return RunnerOutput()
        items = batch.scheduled
        layout = self._layout(items)
        input_ids = torch.tensor([t for r in items for t in r.token_ids], dtype=torch.long, device=self.device)
        positions = torch.tensor(
            [p for r in items for p in range(r.start_pos, r.context_len)], dtype=torch.long, device=self.device
        )
        ctx = ForwardContext(self.backend, self.backend.build_metadata(layout, self.device), self.kv_caches)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        starts = layout.query_starts
        output = RunnerOutput()
        self._sample(items, hidden, starts, output)
        self._prompt_logprobs(items, hidden, starts, output)
        return output

    def _layout(self, items: list[ScheduledRequest]) -> BatchLayout:
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

    def _sample(self, items: list[ScheduledRequest], hidden: torch.Tensor, starts: list[int], output: RunnerOutput) -> None:
        to_sample = [i for i, r in enumerate(items) if r.sample]
        if not to_sample:
            return
        rows = torch.tensor([starts[i + 1] - 1 for i in to_sample], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        sampling_rows = [self._sampling_row(items[i]) for i in to_sample]
        result = self.sampler(logits, sampling_rows)
        for i, token_id, logprobs in zip(to_sample, result.token_ids, result.logprobs):
            request_id = items[i].request_id
            output.sampled_token_ids[request_id] = token_id
            if logprobs is not None:
                output.logprobs[request_id] = logprobs

    def _sampling_row(self, item: ScheduledRequest) -> SamplingRow:
        return SamplingRow(
            params=item.params,
            generator=self._generator(item),
            prompt_token_ids=item.prompt_token_ids,
            output_token_ids=item.output_token_ids,
            banned_token_ids=item.banned_token_ids,
        )

    def _generator(self, item: ScheduledRequest) -> torch.Generator | None:
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
        self, items: list[ScheduledRequest], hidden: torch.Tensor, starts: list[int], output: RunnerOutput
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
