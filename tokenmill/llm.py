"""The offline API users of vLLM know: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from tokenmill.config import EngineConfig, engine_settings
from tokenmill.engine.engine import LLMEngine
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.params import SamplingParams

# A text, token ids, or vLLM's TextPrompt / TokensPrompt dicts: {"prompt": text} or
# {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict[str, object]
Message = dict[str, str]


class LLM:
    """Load a model and generate for batches of prompts with continuous batching.

    `LLM(model=None, **settings)`: `model=None` loads the default model
    (SmolLM2-135M-Instruct, Q4_1 GGUF); the settings are the engine's (see
    `tokenmill.config`, listed below), e.g. `dtype="float32"`, `max_num_seqs=16`,
    `kv_cache_memory="2GiB"`.
    """

    def __init__(self, model: str | None = None, **settings: object) -> None:
        from tokenmill.builder import build_engine  # torch lives behind this import

        self.engine = build_engine(EngineConfig.from_kwargs(model=model, **settings))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one sharing another engine's runner)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm.tokenizer = engine.tokenizer
        return llm

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        slo_ttft_ms: float | Sequence[float | None] | None = None,
        slo_tpot_ms: float | Sequence[float | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt is validated before
        any is queued, so a bad one leaves nothing behind. `priority`: one per prompt
        (lower runs first), with `scheduling_policy="priority"` (vLLM's argument).
        `slo_ttft_ms` / `slo_tpot_ms`: latency targets for SLO mode (docs/scheduling.md),
        one for all prompts or one per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        priorities = _as_priority_list(priority, len(prompts))
        ttfts, tpots = (_per_prompt(name, value, len(prompts))
                        for name, value in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)))
        engine = self.engine
        self._compile_constraints(params)  # a bad one fails here, before anything is queued
        requests = [engine.input_processor.process(engine.new_request_id(), prompt, p, arrival_time=engine.clock(),
                                                   priority=rank, slo_ttft_ms=ttft, slo_tpot_ms=tpot)
                    for prompt, p, rank, ttft, tpot in zip(prompts, params, priorities, ttfts, tpots)]
        # (all are checked before any is queued)
        return self._add_and_run(requests, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (`output.outputs.embedding`), as vLLM's
        `LLM.embed`; needs `runner="pooling"`. Each prompt is prefilled once, batched and
        chunked by the scheduler like any prompt, and its final hidden states pooled as the
        pooler config says. Every prompt is validated before any is queued.
        `truncate_prompt_tokens`: embed only the last k tokens of each (-1: max_model_len)."""
        prompts = _as_prompt_list(prompts)
        params = _as_list(pooling_params, PoolingParams, len(prompts), "pooling params") or [PoolingParams()] * len(prompts)
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        engine = self.engine
        requests = [engine.input_processor.process(engine.new_request_id(), prompt, arrival_time=engine.clock(),
                                                   pooling_params=p)
                    for prompt, p in zip(prompts, params)]
        return [EmbeddingRequestOutput.from_base(o) for o in self._add_and_run(requests, use_tqdm)]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.encode_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    allow_special_tokens_in_content: bool = False) -> list[int]:
        """A conversation's prompt ids in the model's chat template; special-token text in the
        messages is text unless `allow_special_tokens_in_content` (Tokenizer.encode_chat)."""
        return self.engine.input_processor.render_chat(
            messages, add_generation_prompt, allow_special_tokens_in_content=allow_special_tokens_in_content)

    # ----- internals -----------------------------------------------------------------

    def _add_and_run(self, requests: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        added = []
        try:
            for request in requests:
                engine.add_processed(request, final_only=True)
                added.append(request.request_id)
            return self._run(added, use_tqdm)
        except BaseException:
            for request_id in added:  # e.g. KeyboardInterrupt: leave nothing allocated
                engine.abort_request(request_id)
            raise

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        while pending:
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    results[output.request_id] = output
                    pending.discard(output.request_id)
                    bar.update(1)
        bar.close()
        return [results[i] for i in request_ids]


def _compile_constraints_of(llm: LLM, params: list[SamplingParams]) -> None:
    constrained = [p.structured_outputs for p in params if p.structured_outputs is not None]
    if constrained:
        from tokenmill.structured_output import compiler_for

        engine = llm.engine
        compiler = compiler_for(llm.tokenizer, engine.facts.vocab_size, engine.config.model.structured_outputs_backend)
        for constraint in constrained:  # compiled now and cached for the runner
            compiler.compile(constraint)


LLM._compile_constraints = _compile_constraints_of


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """Every prompt as a text or a list of token ids (the input processor's forms)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):  # one prompt given as token ids
        return [prompts]
    return [_unwrap_prompt_dict(p) if isinstance(p, dict) else p for p in prompts]


def _unwrap_prompt_dict(prompt: dict[str, object]) -> str | list[int]:
    """vLLM's TextPrompt {"prompt": text} or TokensPrompt {"prompt_token_ids": ids}."""
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
        return list(prompt["prompt_token_ids"])
    raise ValueError(f"a prompt dict holds exactly one of 'prompt' (a text) or 'prompt_token_ids' (a list of "
                     f"token ids), as vLLM's TextPrompt and TokensPrompt; got the keys {sorted(keys)}")


def _as_priority_list(priority: Sequence[int] | None, count: int) -> list[int]:
    if priority is None:
        return [0] * count
    if isinstance(priority, int):
        raise ValueError("priority takes one integer per prompt (a list), as vLLM's LLM.generate")
    priority = list(priority)
    if len(priority) != count:
        raise ValueError(f"got {len(priority)} priorities for {count} prompts")
    return priority


def _per_prompt(name: str, value: float | Sequence[float | None] | None, count: int) -> list[float | None]:
    """One value for every prompt, or a list of one per prompt."""
    if value is None or isinstance(value, (int, float)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"got {len(values)} values of {name} for {count} prompts")
    return values


def _as_list(value, kind: type, count: int, what: str) -> list | None:
    """None, one `kind` for every prompt, or one per prompt."""
    if value is None:
        return None
    if isinstance(value, kind):
        return [value] * count
    value = list(value)
    if len(value) != count:
        raise ValueError(f"got {len(value)} {what} for {count} prompts")
    return value


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


LLM.__doc__ += "\n    Settings:\n" + "\n".join(
    f"      {s.name} (default {s.default!r}): {s.help}" for s in engine_settings() if s.name != "model"
)
