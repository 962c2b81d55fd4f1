"""The step loop: schedule, run the model, update requests, build outputs.

Torch-free: the runner arrives as an object with `execute(SchedulerOutput) ->
RunnerOutput` and `vocab_size`, built by `LLMEngine.from_config`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.batch import RunnerOutput, SchedulerOutput
from tokenmill.engine.block_manager import KVBlockManager
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from tokenmill.outputs import RequestOutput
from tokenmill.sampling.params import SamplingParams
from tokenmill.tokenizer import Tokenizer


class Executor(Protocol):
    vocab_size: int

    def execute(self, batch: SchedulerOutput) -> RunnerOutput: ...


@dataclass
class EngineStats(SchedulerStats):
    num_prompt_tokens: int = 0  # computed prompt tokens (prefill work), cumulative
    num_generation_tokens: int = 0  # sampled tokens, cumulative
    num_steps: int = 0


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer: Tokenizer,
        num_blocks: int,
        max_model_len: int,
        model_name: str = "model",
    ) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = executor.vocab_size
        kv = KVBlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len), kv
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from tokenmill.runner.factory import build_runner  # torch lives behind this import

        built = build_runner(config)
        return cls(config, built.runner, built.tokenizer, built.num_blocks, built.max_model_len, built.model_name)

    # ----- requests ------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        final_only: bool = False,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (naming the problem and
        the limit) before anything is allocated."""
        params = params or SamplingParams()
        prompt_text, prompt_ids = self._tokenize(prompt)
        params.validate_token_ids(self.vocab_size)
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=prompt_ids,
                params=self._sample_params(params, i),
                eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                max_total_tokens=self.max_model_len,
                arrival_time=arrival_time or time.monotonic(),
                cache_salt=cache_salt,
            )
            for i in range(params.n)
        ]
        for rid in [request_id, *(s.request_id for s in samples)]:
            if rid in self.output_processor.user_requests or rid in self.scheduler.requests:
                raise ValueError(f"request id {rid!r} is already in use")
        for sample in samples:
            self.scheduler.check_can_admit(sample)
        for sample in samples:
            self.scheduler.add_request(sample)
        self.output_processor.add(request_id, prompt_text, samples, final_only)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once; returns its final output."""
        sample_ids = self.output_processor.sample_ids(request_id)
        self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.finish_externally(request_id, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def requests_queued_since(self, arrived_before: float) -> list[str]:
        """Ids of the requests that arrived before `arrived_before` (time.monotonic) and
        have never been scheduled (a server's queue-wait limit aborts them)."""
        owners = {
            self.output_processor.sample_owner[r.request_id][0].request_id
            for r in self.scheduler.waiting
            if r.first_scheduled_time is None and r.arrival_time < arrived_before
            and r.request_id in self.output_processor.sample_owner
        }
        return sorted(owners)

    # ----- the step ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty and not batch.finished_ids:
            return []
        runner_output = self.executor.execute(batch)
        updated = self.scheduler.update_from_output(batch, runner_output)
        outputs, stopped = self.output_processor.process(updated, runner_output)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.num_steps += 1
        self.num_generation_tokens += len(runner_output.sampled_token_ids)
        self.num_prompt_tokens += sum(
            r.num_tokens for r in batch.scheduled if r.start_pos < len(r.prompt_token_ids)
        )
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            **dataclasses.asdict(self.scheduler.stats()),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps,
        )

    # ----- internals -----------------------------------------------------------------

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: it must contain at least one token")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of the vocabulary (size {self.vocab_size})")
        return None, ids

    @staticmethod
    def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
        """Each of n samples runs as its own request; seeded ones get distinct seeds."""
        if params.n == 1:
            return params
        seed = None if params.seed is None else params.seed + index
        return dataclasses.replace(params, n=1, seed=seed)
