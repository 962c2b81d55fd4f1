"""The one admission path: prompt in, engine `Request`s out, or a clear refusal.

Every front door (the OpenAI server, `LLM`, `LLMEngine.add_request` and so the CLI,
the bench and the simulator) turns a prompt into requests here, as vLLM's
`InputProcessor` does for its `LLM` and its server alike: tokenize a text prompt or
check a list of token ids, render a chat conversation with the model's template,
check lengths and limits against the facts found at load (max_model_len, the
vocabulary, the KV cache's capacity), and make one `Request` per sample. Nothing is
allocated or queued here, so a refusal leaves nothing behind.

A refusal is an `AdmissionError` (a ValueError) whose `param` names the request field
at fault, so the server answers with an OpenAI error that points at it and `LLM` raises
the same sentence. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.config import PoolingFacts
from tokenmill.engine.request import Request, slo_aim
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.params import SamplingParams

Prompt = str | Sequence[int]


class AdmissionError(ValueError):
    """A request this engine refuses; `param` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTokenizer(Protocol):
    """What admission needs of a tokenizer (tokenmill.tokenizer.Tokenizer has it all)."""

    eos_token_ids: Sequence[int]

    @property
    def max_token_chars(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                    allow_special_tokens_in_content: bool = False,
                    check_text: Callable[[str], None] | None = None) -> tuple[str, list[int]]: ...


@dataclass(frozen=True)
class AdmissionLimits:
    """The facts admission checks against (from EngineFacts: found at load)."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    runner: str = "generate"  # generate | pooling: which requests the engine runs
    pooling: PoolingFacts | None = None  # the pooling runner's

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class ProcessedRequest:
    """One user request, admitted: its samples (n of them, sharing the prompt) ready for
    the scheduler, and the prompt's text when it came as text."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    samples: list[Request]


class InputProcessor:
    """Tokenize, render chat, check, make requests. One per engine (a sibling engine with
    another KV capacity has its own)."""

    def __init__(self, tokenizer: PromptTokenizer, limits: AdmissionLimits, priority_scheduling: bool = False) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.priority_scheduling = priority_scheduling  # --scheduling-policy priority

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """The longest text that could still fit the context (see Tokenizer.max_token_chars)."""
        return self.limits.max_model_len * self.tokenizer.max_token_chars

    # ----- prompts -----------------------------------------------------------------------

    def tokenize(self, prompt: Prompt, param: str = "prompt") -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a text prompt or a list of token ids, checked:
        not empty, no longer than the context can hold, every id in the vocabulary."""
        if isinstance(prompt, str):
            self.check_chars(len(prompt), param)
            # An empty text stays empty (no BOS-only prompt), so it is refused by name.
            return prompt, self.tokenizer.encode(prompt) if prompt else []
        ids = list(prompt)
        vocab_size = self.limits.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise AdmissionError(f"prompt token id {bad!r} is out of the vocabulary (size {vocab_size})", param)
        return None, ids

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                    chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                    allow_special_tokens_in_content: bool = False, param: str = "messages") -> list[int]:
        """A conversation's prompt ids in the model's chat template (or `chat_template`):
        Tokenizer.encode_chat (the template writes its own special tokens; special-token text
        in the messages stays text unless allowed), the rendered text checked for length
        before it is tokenized. The template's ValueErrors (no template, a malformed message,
        a failing template) are refusals of `param`."""
        try:
            _, ids = self.tokenizer.encode_chat(
                messages, add_generation_prompt, chat_template=chat_template, template_kwargs=template_kwargs,
                allow_special_tokens_in_content=allow_special_tokens_in_content,
                check_text=lambda text: self.check_chars(len(text), param))
        except AdmissionError:
            raise
        except ValueError as error:
            raise AdmissionError(str(error), param) from error
        return ids

    def check_chars(self, num_chars: int, param: str = "prompt") -> None:
        """A text longer than max_model_len times the longest token's length cannot fit the
        context whatever it says: refused before the tokenizer spends time on it."""
        max_chars = self.max_prompt_chars
        if num_chars > max_chars:
            raise AdmissionError(
                f"the {param} has {num_chars} characters, more than this model's context can hold "
                f"(at most {max_chars} characters); shorten it", param)

    # ----- limits ------------------------------------------------------------------------

    def check(self, num_prompt_tokens: int, params: SamplingParams, *, strict_max_tokens: bool = False,
              prompt_param: str = "prompt") -> None:
        """Refuse what could never run to completion. `strict_max_tokens` (the server, as
        OpenAI's) refuses prompt + max_tokens over max_model_len; without it (`LLM`, as
        vLLM's offline API) max_tokens is capped by the room the context leaves."""
        self._check_token_ids(params)
        limit = self.limits.max_model_len
        if num_prompt_tokens == 0:
            raise AdmissionError("the prompt is empty: it must contain at least one token", prompt_param)
        if num_prompt_tokens >= limit:
            raise AdmissionError(
                f"the prompt has {num_prompt_tokens} tokens, but max_model_len is {limit} (this model's maximum "
                "context length), which leaves no room for a completion; shorten the prompt", prompt_param)
        if strict_max_tokens and params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limit:
            raise AdmissionError(
                f"this model's maximum context length is {limit} tokens, but {num_prompt_tokens + params.max_tokens} "
                f"were requested ({num_prompt_tokens} in the prompt, {params.max_tokens} for the completion); "
                "shorten the prompt or lower max_tokens", "max_tokens")
        self._check_kv_capacity(num_prompt_tokens, params)

    def check_runner(self, pooling: bool) -> None:
        """A pooling engine embeds and a generating one generates, as vLLM's runners."""
        runner = self.limits.runner
        if pooling and runner != "pooling":
            raise AdmissionError("this model runs the generate runner: embeddings need the pooling runner "
                                 "(start it with --runner pooling, or LLM(runner=\"pooling\"))")
        if not pooling and runner == "pooling":
            raise AdmissionError("this model runs the pooling runner (embeddings): generation needs the generate "
                                 "runner (start it with --runner generate)")

    def check_pooling(self, num_prompt_tokens: int, prompt_param: str = "input") -> None:
        """A pooling request (an embedding) is prefilled once and never grows: its prompt
        may fill the whole context (vLLM's message when it does not fit)."""
        limit = self.limits.max_model_len
        if num_prompt_tokens == 0:
            raise AdmissionError("the input is empty: it must contain at least one token", prompt_param)
        if num_prompt_tokens > limit:
            raise AdmissionError(
                f"This model's maximum context length is {limit} tokens. However, you requested {num_prompt_tokens} "
                "tokens in the input for embedding generation. Please reduce the length of the input.", prompt_param)
        capacity = self.limits.kv_capacity_tokens
        if num_prompt_tokens > capacity:
            raise AdmissionError(f"the input has {num_prompt_tokens} tokens, which can never fit in the KV cache "
                                 f"({capacity} tokens); shorten it or raise kv_cache_memory", prompt_param)

    def truncate(self, prompt_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last k ids (vLLM's left truncation; -1: the last max_model_len)."""
        k, limit = truncate_prompt_tokens, self.limits.max_model_len
        if k is None:
            return prompt_ids
        if k > limit:
            raise AdmissionError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({limit}). "
                                 "Please, select a smaller truncation size.", "truncate_prompt_tokens")
        return prompt_ids[-(limit if k == -1 else k):]

    def check_pooling_params(self, params: PoolingParams) -> None:
        """`dimensions` only for a Matryoshka model, within its size (vLLM's messages)."""
        pooling, dimensions = self.limits.pooling, params.dimensions
        if dimensions is None or pooling is None:
            return
        allowed = pooling.matryoshka_dimensions
        if allowed is None:
            raise AdmissionError("This model does not support matryoshka representation, changing output dimensions "
                                 "will lead to poor results.", "dimensions")
        if allowed and dimensions not in allowed:
            raise AdmissionError(f"This model only supports {list(allowed)} matryoshka dimensions, use other output "
                                 "dimensions will lead to poor results.", "dimensions")
        if dimensions > pooling.hidden_size:
            raise AdmissionError(f"dimensions {dimensions} exceeds the model's embedding size "
                                 f"({pooling.hidden_size})", "dimensions")

    def check_priority(self, priority: object) -> None:
        """vLLM's rule: a priority other than 0 needs the priority policy."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise AdmissionError(f"priority must be an integer, got {priority!r}", "priority")
        if priority != 0 and not self.priority_scheduling:
            raise AdmissionError(f"priority must be 0 unless priority scheduling is enabled (got {priority}; start "
                                 "the engine with --scheduling-policy priority)", "priority")

    @staticmethod
    def check_slo(slo_ttft_ms: object, slo_tpot_ms: object) -> None:
        """Per-request latency targets: positive, finite milliseconds (or None)."""
        for name, value in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise AdmissionError(f"{name} must be a positive number of milliseconds, got {value!r}", name)

    def _check_kv_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        max_tokens = self.output_room(num_prompt_tokens, params.max_tokens)
        # The last sampled token is never fed back, so it needs no KV slot.
        worst_case = num_prompt_tokens + max_tokens - 1
        capacity = self.limits.kv_capacity_tokens
        if worst_case > capacity:
            raise AdmissionError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {worst_case} KV slots, "
                f"which can never fit in the KV cache ({capacity} tokens); lower max_tokens or raise "
                "kv_cache_memory", "max_tokens")

    def _check_token_ids(self, params: SamplingParams) -> None:
        """The ids in the sampling parameters must be in the vocabulary."""
        vocab_size = self.limits.vocab_size
        for param, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise AdmissionError(f"token id {bad} is out of the vocabulary (size {vocab_size})", param)

    def output_room(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Output tokens a request may produce: max_tokens, capped by what max_model_len
        leaves (None: all of it). The same rule as `Request.max_tokens`."""
        room = self.limits.max_model_len - num_prompt_tokens
        return room if max_tokens is None else min(max_tokens, room)

    # ----- requests ----------------------------------------------------------------------

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                arrival_time: float, cache_salt: str | None = None, priority: int = 0,
                strict_max_tokens: bool = False, prompt_param: str = "prompt",
                slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                pooling_params: PoolingParams | None = None) -> ProcessedRequest:
        """Tokenize and check a prompt and make its requests (one per sample; a pooling
        request, given `pooling_params`, is one request that is prefilled and pooled).
        `slo_ttft_ms` / `slo_tpot_ms`: this request's latency targets (SLO mode)."""
        params = params or SamplingParams()
        self.check_runner(pooling_params is not None)
        self.check_priority(priority)
        self.check_slo(slo_ttft_ms, slo_tpot_ms)
        prompt_text, prompt_ids = self.tokenize(prompt, prompt_param)
        if pooling_params is not None:
            prompt_ids = self.truncate(prompt_ids, pooling_params.truncate_prompt_tokens)
            self.check_pooling_params(pooling_params)
            self.check_pooling(len(prompt_ids), prompt_param)
            request = Request(request_id, prompt_ids, SamplingParams(max_tokens=1), max_total_tokens=len(prompt_ids),
                              arrival_time=arrival_time, cache_salt=cache_salt, priority=priority,
                              slo_ttft=slo_aim(slo_ttft_ms), pooling_params=pooling_params)
            return ProcessedRequest(request_id, prompt_text, prompt_ids, [request])
        self.check(len(prompt_ids), params, strict_max_tokens=strict_max_tokens, prompt_param=prompt_param)
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=prompt_ids,
                params=_sample_params(params, i),
                eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                max_total_tokens=self.limits.max_model_len,
                arrival_time=arrival_time,
                cache_salt=cache_salt,
                priority=priority,
                slo_ttft=slo_aim(slo_ttft_ms),
                slo_tpot=slo_aim(slo_tpot_ms),
            )
            for i in range(params.n)
        ]
        return ProcessedRequest(request_id, prompt_text, prompt_ids, samples)


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n samples runs as its own request; seeded ones get distinct seeds."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
