"""Turns per-step token updates into RequestOutputs: detokenization, stop strings,
logprobs, and the fan-in of a request's `n` samples. Knows no tensors."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.engine.batch import RunnerOutput, TokenLogprobs
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request
from tokenmill.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from tokenmill.tokenizer import Tokenizer


@dataclass
class _Sample:
    """One of a request's n samples, running as its own engine request."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    prompt_logprobs: list[PositionLogprobs | None] | None
    metrics: RequestMetrics
    final_only: bool
    extra: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self.user_requests: dict[str, _UserRequest] = {}
        self.sample_owner: dict[str, tuple[_UserRequest, _Sample]] = {}

    def add(self, request_id: str, prompt: str | None, samples: list[Request], final_only: bool) -> None:
        params = samples[0].params
        prompt_ids = samples[0].prompt_token_ids
        user = _UserRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            samples=[],
            prompt_logprobs=[None] * len(prompt_ids) if params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(arrival_time=samples[0].arrival_time),
            final_only=final_only,
        )
        for index, request in enumerate(samples):
            sample = _Sample(
                index=index,
                request=request,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, request.params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            user.samples.append(sample)
            self.sample_owner[request.request_id] = (user, sample)
        self.user_requests[request_id] = user

    def sample_ids(self, request_id: str) -> list[str]:
        user = self.user_requests.get(request_id)
        return [s.request.request_id for s in user.samples] if user else []

    def process(
        self, updated: list[Request], runner_output: RunnerOutput
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand out, and the sample ids stopped by a stop
        string (the caller finishes those in the scheduler)."""
        now = self.clock()
        self._record_prompt_logprobs(runner_output)
        touched: dict[str, _UserRequest] = {}
        stopped_by_string: list[str] = []
        for request in updated:
            user, sample = self.sample_owner[request.request_id]
            touched[user.request_id] = user
            self._update_sample(sample, runner_output, now)
            if sample.finish_reason == "stop" and request.status.value != "stop":
                stopped_by_string.append(request.request_id)
        outputs = []
        for user in touched.values():
            if user.metrics.first_token_time is None:
                user.metrics.first_token_time = now
                user.metrics.first_scheduled_time = min(
                    (s.request.first_scheduled_time or now) for s in user.samples
                )
            user.metrics.last_token_time = now
            if user.finished:
                user.metrics.finished_time = now
                self._forget(user)
            if user.finished or not user.final_only:
                outputs.append(self._make_output(user))
        return outputs, stopped_by_string

    def finish_externally(self, request_id: str, reason: str) -> RequestOutput | None:
        """Mark all unfinished samples of a user request (abort); returns its final output."""
        user = self.user_requests.get(request_id)
        if user is None:
            return None
        for sample in user.samples:
            if sample.finish_reason is None:
                sample.finish_reason = reason
        user.metrics.finished_time = self.clock()
        self._forget(user)
        return self._make_output(user)

    # ----- internals -----------------------------------------------------------------

    def _update_sample(self, sample: _Sample, runner_output: RunnerOutput, now: float) -> None:
        request = sample.request
        num_new = request.num_new_output_tokens
        new_tokens = request.output_token_ids[len(request.output_token_ids) - num_new:]
        # An EOS that ends the request is not part of the text (as in vLLM), even
        # with skip_special_tokens=False.
        ended_by_eos = request.status.value == "stop" and request.stop_reason is None
        text_tokens = new_tokens[:-1] if ended_by_eos else new_tokens
        stop_string = sample.detokenizer.append(text_tokens) if text_tokens else None
        if stop_string is not None:
            # The stop string ended the text inside this run: later tokens are not output.
            request.truncate_output(sample.detokenizer.num_tokens)
            sample.finish_reason, sample.stop_reason = "stop", stop_string
        elif request.is_finished:
            sample.finish_reason, sample.stop_reason = request.status.value, request.stop_reason
        token_logprobs = runner_output.logprobs.get(request.request_id)
        if sample.logprobs is not None and token_logprobs is not None:
            kept = token_logprobs[: request.num_new_output_tokens]
            sample.logprobs.extend(self._position_logprobs(entry) for entry in kept)
            sample.cumulative_logprob += sum(entry.logprob for entry in kept)

    def _record_prompt_logprobs(self, runner_output: RunnerOutput) -> None:
        for request_id, chunk in runner_output.prompt_logprobs.items():
            owner = self.sample_owner.get(request_id)
            if owner is None or owner[0].prompt_logprobs is None:
                continue
            # Re-computation after a preemption rewrites the same positions.
            for offset, entry in enumerate(chunk.entries):
                owner[0].prompt_logprobs[chunk.first_position + offset] = self._position_logprobs(entry)

    def _position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        decode = self.tokenizer.token_to_text
        result = {
            token_id: Logprob(logprob, rank + 1, decode(token_id))
            for rank, (token_id, logprob) in enumerate(zip(entry.top_ids, entry.top_logprobs))
        }
        if entry.token_id not in result:
            result[entry.token_id] = Logprob(entry.logprob, entry.rank, decode(entry.token_id))
        return result

    def _make_output(self, user: _UserRequest) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.detokenizer.output_text(finished=s.finish_reason is not None),
                token_ids=list(s.request.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in user.samples
        ]
        return RequestOutput(
            request_id=user.request_id,
            prompt=user.prompt,
            prompt_token_ids=user.prompt_token_ids,
            outputs=completions,
            finished=user.finished,
            prompt_logprobs=list(user.prompt_logprobs) if user.prompt_logprobs is not None else None,
            num_cached_tokens=min(s.request.num_cached_tokens for s in user.samples),
            metrics=user.metrics,
            pooled=user.samples[0].request.pooled_output,
            kv_transfer_params=user.samples[0].request.kv_transfer_params_out,
        )

    def _forget(self, user: _UserRequest) -> None:
        self.user_requests.pop(user.request_id, None)
        for sample in user.samples:
            self.sample_owner.pop(sample.request.request_id, None)
