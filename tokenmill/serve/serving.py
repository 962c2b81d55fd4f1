"""OpenAI requests -> engine requests -> OpenAI responses and SSE streams.

A handler checks the server's own request limits and the model name, then runs the
engine's input processor (`tokenmill.engine.input_processor`, the admission path `LLM`
takes too: tokenize, render chat, check lengths, vocabulary and KV capacity) before
queueing anything; the engine thread adds the requests through `LLMEngine.add_request` (the
same processor again, on token ids: cheap) after checking the waiting queue's limit, and
answers through a future, so a bad request is refused before any step works on it.

Tokenizing and rendering chat templates run in a small thread pool, never on the
event loop (the tokenizer releases the GIL while it works), so a big prompt does
not stall /health or the other streams. A streamed response starts (status 200
and headers) only once the engine has produced its first output, so everything
that can fail before that (queue full or timed out, engine failure) is a plain
HTTP error, and the first chunk a client sees carries the first token.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.engine.engine import LLMEngine, SLOUnattainableError
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.params import SamplingParams, default, sampling_fields
from tokenmill.serve.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    NewRequest,
    OutputStream,
    QueueFullError,
    QueueTimeoutError,
)
from tokenmill.serve.errors import APIError, bad_request, error_body, from_value_error
from tokenmill.serve.limits import RequestLimits
from tokenmill.serve.logprobs import CompletionLogprobs, chat_logprobs
from tokenmill.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    Usage,
    sse_json,
)
from tokenmill.serve.reasoning import END as REASONING_END
from tokenmill.serve.reasoning import START as REASONING_START
from tokenmill.serve.reasoning import get_reasoning_parser
from tokenmill.serve.structured import compile_constraint, constraint_of
from tokenmill.serve.tools import (
    AgentSettings,
    ChoiceOutput,
    ToolPlan,
    plan_tools,
    shipped_tool_template,
    template_handles_tools,
)
from tokenmill.structured_output import compiler_for

# Seconds a client told "queue full" or "queue wait too long" should wait before retrying.
RETRY_AFTER_SECONDS = 1
# Threads that tokenize prompts and render chat templates: a burst of big prompts
# queues here instead of taking every core from the engine.
PROMPT_THREADS = 2

T = TypeVar("T")
logger = logging.getLogger(__name__)
# Seconds one write of a stream may wait for its client to read before the request is
# aborted (its KV freed) and the connection dropped (--stream-send-timeout).
DEFAULT_STREAM_SEND_TIMEOUT = 60.0
# How to drop the current connection at once, set by api_server.ConnectionAbortMiddleware
# for the request's task: closing politely would wait for a client that does not read to
# take the buffered bytes. (A context variable: the scope dict does not reach the
# response unchanged through FastAPI's routing.)
abort_connection: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "tokenmill_abort_connection", default=None)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # as the client sent it, when it sent text


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


class OpenAIServing:
    """Request handling shared by the endpoints; one per server."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str] | None = None,
                 limits: RequestLimits | None = None, trust_request_chat_template: bool = False,
                 stream_send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT, chat_template: str | None = None,
                 log_requests: bool = False, allow_special_tokens_in_content: bool = False,
                 agent: AgentSettings | None = None) -> None:
        """`chat_template`: the operator's (--chat-template), used instead of the model's."""
        self.engine = engine
        self.agent = agent or AgentSettings()
        self._served_names = served_model_names
        self.limits = limits or RequestLimits()
        self.trust_request_chat_template = trust_request_chat_template
        self.stream_send_timeout = stream_send_timeout
        self.chat_template = chat_template
        self.log_requests = log_requests
        # Special-token text in messages is text unless the operator allows it (Tokenizer.encode_chat).
        self.allow_special_tokens_in_content = allow_special_tokens_in_content
        self._prompt_pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="tokenmill-prompts")

    async def off_loop(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU work on the prompt threads (ValueError becomes a 400)."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._prompt_pool, functools.partial(function, *args, **kwargs))
        except ValueError as error:
            raise from_value_error(error) from error

    def close(self) -> None:
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    # ----- model and engine --------------------------------------------------------------

    @property
    def model_names(self) -> list[str]:
        """--served-model-name, else the name the engine gave the model once loaded."""
        if self._served_names:
            return self._served_names
        return [self.engine.engine.model_name] if self.engine.engine is not None else []

    @property
    def processor(self) -> InputProcessor:
        """The engine's input processor (admission: the same checks as `LLM`'s)."""
        return self.core.input_processor

    @property
    def core(self) -> LLMEngine:
        """The loaded engine (its tokenizer and limits); 503 while it loads."""
        engine = self.engine.engine
        if engine is None:
            raise APIError(503, "the model is still loading; retry shortly")
        return engine

    def check_model(self, requested: str | None) -> str:
        """The model name to answer with; 404 for a name this server does not serve."""
        names = self.model_names
        if not names:
            raise APIError(503, "the model is still loading; retry shortly")
        if requested is None or requested == "":
            return names[0]
        if requested not in names:
            raise APIError(
                404, f"the model {requested!r} does not exist; this server serves {names}",
                param="model", code="model_not_found",
            )
        return requested

    def check_runner(self, wanted: str, api: str) -> None:
        """404 for an API the engine's runner does not serve (vLLM registers only the routes
        of its runner's tasks): embeddings need the pooling runner, generation the other."""
        runner = self.core.facts.runner
        if runner != wanted:
            raise APIError(404, f"The model does not support {api}: this server runs the {runner} runner "
                                f"(start it with --runner {wanted})", code="unsupported_api")

    # ----- /v1/completions ---------------------------------------------------------------

    def check_accepting(self) -> None:
        """503 before any work when no request can be admitted (draining, dead, stuck)."""
        try:
            self.engine.check_available()
        except EngineUnavailableError as error:
            raise unavailable(error) from error

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_accepting()
        model = self.check_model(body.model)
        self.check_runner("generate", "Completions API")
        _check_stream_options(body)
        texts = _prompt_list(body.prompt)
        self._check_limits(body, len(texts))
        self.limits.check_logprobs(body.logprobs, "logprobs")
        core = self.core
        prompts = await self.off_loop(_tokenize_prompts, self.processor, texts)
        max_tokens = body.max_tokens
        if max_tokens is None:  # OpenAI's and vLLM's default (SamplingParams's), within what the context leaves
            room = core.max_model_len - max(len(p.token_ids) for p in prompts)
            max_tokens = min(default("max_tokens"), room) if room > 0 else default("max_tokens")
        echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = _sampling_params(body, max_tokens, body.logprobs, prompt_logprobs=echo_logprobs)
        slo = _slo_targets(body, raw)
        for prompt in prompts:
            self._admit(len(prompt.token_ids), params, body.priority, "prompt", slo)
        await self.constrain(params, body)
        await self._check_kv_transfer(body, len(prompts) * params.n)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._submit(request_id, [p.token_ids for p in prompts], params, body.priority, slo,
                                    kv_transfer_params=body.kv_transfer_params)
        renderer = _CompletionRenderer(request_id, model, prompts, body, core)
        return await _respond(stream, renderer, body, raw, self.stream_send_timeout)

    # ----- /v1/chat/completions ----------------------------------------------------------

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_accepting()
        model = self.check_model(body.model)
        self.check_runner("generate", "Chat Completions API")
        _check_stream_options(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        self._check_limits(body, 1)
        self.limits.check_logprobs(body.top_logprobs, "top_logprobs")
        core = self.core
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.agent)
        prompt_ids = await self.encode_chat(body.messages, body.add_generation_prompt, body.chat_template,
                                            body.chat_template_kwargs, tools=plan)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(body, max_tokens, num_logprobs)
        slo = _slo_targets(body, raw)
        self._admit(len(prompt_ids), params, body.priority, "messages", slo)
        await self.constrain(params, body, plan)
        await self._check_kv_transfer(body, params.n)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._submit(request_id, [prompt_ids], params, body.priority, slo,
                                    kv_transfer_params=body.kv_transfer_params)
        reasoning = get_reasoning_parser(self.agent.reasoning_parser) if self.agent.reasoning_parser else None
        renderer = _ChatRenderer(request_id, model, len(prompt_ids), body, core, plan, reasoning)
        return await _respond(stream, renderer, body, raw, self.stream_send_timeout)

    async def encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          chat_template: str | None = None,
                          template_kwargs: dict[str, Any] | None = None, tools: ToolPlan | None = None) -> list[int]:
        """Render and tokenize a conversation on the prompt threads."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise bad_request("this server does not accept chat templates in requests (the operator can allow "
                              "them with --trust-request-chat-template)", param="chat_template")
        dicts = [m.to_template_dict() for m in messages]
        tool_template = self._template_for(dicts, tools)
        if tool_template is not None and chat_template is None:
            # Tools or tool messages, and a template that ignores them: the shipped one.
            tool_dicts = tools.tools if tools is not None and tools.shows_tools else None
            try:
                return await self.off_loop(self._render_and_encode, dicts, add_generation_prompt, tool_template,
                                           template_kwargs, tool_dicts)
            except APIError as error:
                error.param = error.param or "messages"
                raise
        return await self.off_loop(self.processor.render_chat, dicts, add_generation_prompt,
                                   chat_template=chat_template or self.chat_template, template_kwargs=template_kwargs,
                                   allow_special_tokens_in_content=self.allow_special_tokens_in_content)
    def _template_for(self, messages: list[dict[str, Any]], tools: ToolPlan | None) -> str | None:
        """The shipped tool template when the request has tools or tool messages and the
        template in use (--chat-template, else the model's) ignores them; else None."""
        if self.chat_template:  # --chat-template: the operator's choice stands
            return None
        uses_tools = (tools is not None and tools.shows_tools) or any(
            m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if uses_tools and not template_handles_tools(self.core.tokenizer.chat_template):
            return shipped_tool_template()
        return None

    def _render_and_encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                           chat_template: str | None, template_kwargs: dict[str, Any] | None,
                           tools: list[dict[str, Any]] | None = None) -> list[int]:
        tokenizer = self.core.tokenizer
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             chat_template=chat_template, template_kwargs=template_kwargs)
        self.processor.check_chars(len(text), "messages")
        # The template writes its own special tokens (BOS included), as LLM.encode_chat does.
        return tokenizer.encode(text, add_special_tokens=False)

    # ----- admission -----------------------------------------------------------------------

    async def constrain(self, params: SamplingParams, body: Any, tools: ToolPlan | None = None) -> None:
        """Set the request's output constraint (response_format, structured_outputs,
        guided_*, or the grammar of a required / named tool choice), compiled now on the
        prompt threads so a bad one is a 400 here. With a reasoning parser the constraint
        starts after the reasoning (`</think>`)."""
        constraint, param = constraint_of(body)
        if tools is not None and tools.constraint is not None:
            if constraint is not None:
                raise bad_request(f"{param} cannot be combined with tool_choice {tools.mode!r}", param=param)
            constraint, param = tools.constraint, "tools"
        if constraint is None:
            return
        core = self.core
        compiler = compiler_for(core.tokenizer, core.vocab_size, core.config.model.structured_outputs_backend)
        if not compiler.is_cached(constraint):  # a cached one needs no trip to the prompt threads
            await self.off_loop(compile_constraint, compiler, constraint, param)
        if self.agent.reasoning_parser:
            # As vLLM: the reasoning is free, the grammar constrains the answer after it.
            parser = get_reasoning_parser(self.agent.reasoning_parser)
            constraint = dataclasses.replace(constraint, reasoning_end=REASONING_END,
                                             reasoning_start=None if parser.implicit_start else REASONING_START)
        params.structured_outputs = constraint

    def _check_limits(self, body: SamplingFields, num_prompts: int) -> None:
        self.limits.check_sequences(num_prompts, body.n)
        self.limits.check_stop(body.stop, body.stop_token_ids)
        self.limits.check_logit_bias(body.logit_bias)

    def _admit(self, prompt_len: int, params: SamplingParams, priority: int, prompt_param: str,
               slo: tuple[float | None, float | None] = (None, None)) -> None:
        """The input processor's checks, with OpenAI's rule for max_tokens: a prompt plus
        max_tokens over max_model_len is refused (`LLM` caps max_tokens instead)."""
        try:
            self.processor.check_priority(priority)
            self.processor.check_slo(*slo)
            self.processor.check(prompt_len, params, strict_max_tokens=True, prompt_param=prompt_param)
        except ValueError as error:
            raise from_value_error(error) from error

    async def _check_kv_transfer(self, body: SamplingFields, num_sequences: int) -> None:
        """kv_transfer_params this server cannot honour are a 400; a decode instance checks
        the prefill instance's KV layout (once per prefill instance) before queueing."""
        if not body.kv_transfer_params:
            return
        try:
            remote = self.core.check_kv_transfer_params(body.kv_transfer_params, num_sequences)
            if remote is not None:
                await self.off_loop(self.core.kv_connector.check_peer, remote)
        except ValueError as error:
            raise from_value_error(error) from error

    async def _submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                      priority: int = 0, slo: tuple[float | None, float | None] = (None, None),
                      pooling_params: PoolingParams | None = None,
                      kv_transfer_params: dict | None = None) -> OutputStream:
        arrival = time.monotonic()
        if self.log_requests:  # --enable-log-requests; no prompt text (it may be private)
            logger.info("received request %s: %s prompt tokens, %s", request_id,
                        "+".join(str(len(p)) for p in prompts), params)
        requests = [
            NewRequest(request_id if len(prompts) == 1 else f"{request_id}-{i}", ids, params, arrival, priority, slo,
                       pooling_params, kv_transfer_params)
            for i, ids in enumerate(prompts)
        ]
        try:
            return await self.engine.add_requests(requests)
        except ValueError as error:
            raise from_value_error(error) from error
        except QueueFullError as error:
            raise APIError(429, str(error), code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from error
        except SLOUnattainableError as error:  # --slo-reject
            retry_after = max(RETRY_AFTER_SECONDS, math.ceil(error.retry_after))
            raise APIError(429, str(error), code="slo_unattainable", param="slo_ttft_ms",
                           headers={"Retry-After": str(retry_after)}) from error
        except EngineUnavailableError as error:
            raise unavailable(error) from error


# llm-d's request headers for the same targets (its gateway's SLO-aware routing reads them).
SLO_HEADERS = {"slo_ttft_ms": "x-slo-ttft-ms", "slo_tpot_ms": "x-slo-tpot-ms"}


def _slo_targets(body: Any, raw: Request) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) targets in ms: the body's slo_ttft_ms / slo_tpot_ms, else the
    x-slo-ttft-ms / x-slo-tpot-ms headers; a header that is not a number is a 400."""
    targets = []
    for name, header in SLO_HEADERS.items():
        value = getattr(body, name, None)
        text = raw.headers.get(header)
        if value is None and text is not None:
            try:
                value = float(text)
            except ValueError:
                raise bad_request(f"the {header} header must be a number of milliseconds, got {text!r}",
                                  param=name) from None
        targets.append(value)
    return targets[0], targets[1]


def unavailable(error: EngineUnavailableError) -> APIError:
    """503; a queue timeout says when to retry."""
    if isinstance(error, QueueTimeoutError):
        return APIError(503, str(error), code="queue_timeout", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    # Connection: close, so that a load balancer's next request opens a fresh connection
    # (to another replica, while this one drains or restarts).
    return APIError(503, str(error), code="engine_unavailable", headers={"Connection": "close"})


# ----- request -> engine ---------------------------------------------------------------------


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or isinstance(prompt[0], int):
        return [prompt]  # one prompt as token ids (an empty one the engine refuses)
    return list(prompt)


def _tokenize_prompts(processor: InputProcessor, prompts: list[str | list[int]]) -> list[Prompt]:
    prompts_ids = [processor.tokenize(p) for p in prompts]
    return [Prompt(ids, text) for text, ids in prompts_ids]


def _check_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


def _include_usage(body: SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


# SamplingParams fields whose request field means something else or needs parsing: the
# handler computes them (max_tokens's default, logprobs from chat's bool + top_logprobs).
_COMPUTED_FIELDS = ("max_tokens", "logprobs", "prompt_logprobs", "logit_bias")


def _sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    """OpenAI fields -> SamplingParams, field by field of the same name; a field the client
    left out or sent as null takes SamplingParams's default. Its ValueErrors become 400s
    naming the field."""
    given = {f.name: getattr(body, f.name) for f in sampling_fields()
             if f.name not in _COMPUTED_FIELDS and getattr(body, f.name, None) is not None}
    try:
        return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              logit_bias=_logit_bias(body.logit_bias))
    except ValueError as error:
        raise from_value_error(error) from error


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    if bias is None:
        return None
    parsed = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                              param="logit_bias")
        parsed[int(key)] = value
    return parsed


# ----- engine -> responses -------------------------------------------------------------------


async def _respond(stream: OutputStream, renderer: _Renderer, body: SamplingFields, raw: Request,
                   send_timeout: float) -> Response:
    if body.stream:
        # The response starts with the first output: errors before it are plain HTTP errors.
        first = await _unless_disconnected(stream.get(), stream, raw)
        return SSEResponse(_stream_events(stream, renderer, _include_usage(body), first), send_timeout)
    return JSONResponse(renderer.response(await _unless_disconnected(_collect(stream), stream, raw)))


async def _collect(stream: OutputStream) -> dict[int, RequestOutput]:
    """Every request of the group, finished."""
    finals: dict[int, RequestOutput] = {}
    async for batch in stream:
        finals.update(batch)
    return finals


async def _unless_disconnected(work: Awaitable[T], stream: OutputStream, raw: Request) -> T:
    """Await `work`; abort the group if the client disconnects first (ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (e.g. shutdown timeout)
        disconnect.cancel()
        if not task.done():
            task.cancel()
            stream.abort()
    if not task.done() or task.cancelled():
        raise ClientDisconnected()
    try:
        return task.result()
    except EngineUnavailableError as error:
        raise unavailable(error) from error


async def _wait_for_disconnect(raw: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


class _SendTimeout(Exception):
    pass


class SSEResponse(StreamingResponse):
    """An SSE stream whose client must keep reading. While a write waits for the client
    (its socket buffers are full), the engine's outputs merge into one pending output
    per request (async_engine), so waiting costs nothing; a write that waits longer than
    `send_timeout` seconds aborts the request (its KV blocks are freed) and drops the
    connection. The data-parallel router relays a replica's stream with it too (its own
    status and headers, bytes as events)."""

    def __init__(self, events: AsyncIterator[str] | AsyncIterator[bytes], send_timeout: float,
                 status_code: int = 200, headers: dict[str, str] | None = None) -> None:
        super().__init__(events, status_code=status_code, media_type="text/event-stream",
                         headers=headers if headers is not None else {"Cache-Control": "no-cache",
                                                                      "X-Accel-Buffering": "no"})
        self._events = events
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: dict[str, Any]) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except TimeoutError:
                raise _SendTimeout() from None

        try:
            await super().__call__(scope, receive, timed_send)
        except _SendTimeout:
            logger.warning("a stream's client read nothing for %g s: its request is aborted and the "
                           "connection dropped", self.send_timeout)
            drop = abort_connection.get()
            if drop is not None:
                drop()
                await asyncio.sleep(0.01)  # uvicorn sees the connection lost, not an unfinished response
        finally:
            await self._events.aclose()  # its finally aborts what has not finished


def _event(payload: dict[str, Any]) -> str:
    return f"data: {sse_json(payload)}\n\n"


class _Renderer:
    """Per-choice state of one response; subclasses give the object shapes."""

    def __init__(self, request_id: str, model: str, n: int, num_choices: int, core: LLMEngine) -> None:
        self.request_id = request_id
        self.model = model
        self.n = n
        self.created = int(time.time())
        self.tokenizer = core.tokenizer
        self.sent_chars = [0] * num_choices
        self.sent_tokens = [0] * num_choices
        self.finish_sent = [False] * num_choices
        self.completion_tokens = [0] * num_choices

    # subclasses
    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def choice_chunk(self, choice: int, output: RequestOutput, comp: CompletionOutput) -> dict[str, Any] | None: ...

    def prompt_tokens(self) -> int: ...

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """The stream chunks for one new output: one per choice that has news."""
        chunks = []
        for comp in output.outputs:
            choice = prompt_index * self.n + comp.index
            self.completion_tokens[choice] = len(comp.token_ids)
            chunk = self.choice_chunk(choice, output, comp)
            if isinstance(chunk, list):
                chunks.extend(chunk)
            elif chunk is not None:
                chunks.append(chunk)
        return chunks

    def _news(self, choice: int, comp: CompletionOutput) -> tuple[str, int, str | None]:
        """(new text, index of the first new token, finish reason to send now), and
        marks them sent. The engine's text never ends mid-character, so a slice of it
        is always valid UTF-8."""
        text = comp.text[self.sent_chars[choice]:]
        first_new = self.sent_tokens[choice]
        self.sent_chars[choice] = len(comp.text)
        self.sent_tokens[choice] = len(comp.token_ids)
        finish = None
        if comp.finish_reason is not None and not self.finish_sent[choice]:
            finish = comp.finish_reason
            self.finish_sent[choice] = True
        return text, first_new, finish

    def usage(self) -> dict[str, Any]:
        return Usage.of(self.prompt_tokens(), sum(self.completion_tokens)).model_dump()

    def usage_chunk(self, object_name: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}


class _CompletionRenderer(_Renderer):
    def __init__(self, request_id: str, model: str, prompts: list[Prompt], body: CompletionRequest,
                 core: LLMEngine) -> None:
        super().__init__(request_id, model, body.n, len(prompts) * body.n, core)
        self.prompts = prompts
        self.echo = body.echo
        self.num_logprobs = body.logprobs
        self.echoed = [False] * (len(prompts) * body.n)
        self.logprobs = [CompletionLogprobs(body.logprobs or 0) for _ in self.echoed]

    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def choice_chunk(self, choice: int, output: RequestOutput, comp: CompletionOutput) -> dict[str, Any] | None:
        text, first_new, finish = self._news(choice, comp)
        prefix = self._echo(choice, output)
        new_tokens = len(comp.token_ids) > first_new
        if not (prefix or text or new_tokens or finish):
            return None
        logprobs = None
        if self.num_logprobs is not None:
            self._add_logprobs(choice, comp, first_new)
            logprobs = self.logprobs[choice].take()
        return self._body("text_completion", [self._choice(choice, prefix + text, logprobs, comp, finish)])

    def _echo(self, choice: int, output: RequestOutput) -> str:
        """The prompt (text, and logprobs when asked), once, before the choice's first text."""
        if not self.echo or self.echoed[choice]:
            return ""
        self.echoed[choice] = True
        prompt_index = choice // self.n
        if self.num_logprobs is not None:
            ids = self.prompts[prompt_index].token_ids
            positions = output.prompt_logprobs or [None] * len(ids)
            self.logprobs[choice].add(ids, positions, self.tokenizer.token_to_text)
        return self._prompt_text(prompt_index)

    def _add_logprobs(self, choice: int, comp: CompletionOutput, first_new: int) -> None:
        if comp.logprobs is None:
            return
        self.logprobs[choice].add(comp.token_ids[first_new:], comp.logprobs[first_new:],
                                  self.tokenizer.token_to_text)

    def response(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index in sorted(finals):
            output = finals[prompt_index]
            for comp in output.outputs:
                choice = prompt_index * self.n + comp.index
                self.completion_tokens[choice] = len(comp.token_ids)
                prefix = self._echo(choice, output)
                logprobs = None
                if self.num_logprobs is not None:
                    self._add_logprobs(choice, comp, 0)
                    logprobs = self.logprobs[choice].take()
                choices.append(self._choice(choice, prefix + comp.text, logprobs, comp, comp.finish_reason))
        choices.sort(key=lambda c: c["index"])
        return {**self._body("text_completion", choices), "usage": self.usage(), **_kv_transfer(finals)}

    @staticmethod
    def _choice(index: int, text: str, logprobs: dict[str, Any] | None, comp: CompletionOutput,
                finish: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": comp.stop_reason if finish else None}

    def _body(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices}


class _ChatRenderer(_Renderer):
    def __init__(self, request_id: str, model: str, num_prompt_tokens: int, body: ChatCompletionRequest,
                 core: LLMEngine, tools: ToolPlan | None = None, reasoning: Any = None) -> None:
        super().__init__(request_id, model, body.n, body.n, core)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        # Tool calls and reasoning reshape the message: one ChoiceOutput per choice.
        tools = tools or ToolPlan("none")
        self.outputs = ([ChoiceOutput(tools, reasoning) for _ in range(body.n)]
                        if tools.mode != "none" or reasoning is not None else None)

    def prompt_tokens(self) -> int:
        return self.num_prompt_tokens

    def opening_chunks(self) -> list[dict[str, Any]]:
        """The assistant role goes first, in a delta of its own for each choice."""
        return [self._chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(self.n)]

    def choice_chunk(self, choice: int, output: RequestOutput,
                     comp: CompletionOutput) -> dict[str, Any] | list[dict[str, Any]] | None:
        text, first_new, finish = self._news(choice, comp)
        new_tokens = len(comp.token_ids) > first_new
        if not (text or new_tokens or finish):
            return None
        if self.outputs is not None:
            return self._shaped_chunks(choice, comp, text, first_new, finish)
        delta = {"content": text} if text or not finish else {}
        return self._chunk(choice, delta, self._logprobs(comp, first_new), finish)

    def _shaped_chunks(self, choice: int, comp: CompletionOutput, text: str, first_new: int,
                       finish: str | None) -> list[dict[str, Any]]:
        """Reasoning / content / tool-call deltas, one chunk each (as OpenAI sends them);
        logprobs ride on the first, the finish reason on the last."""
        shaper = self.outputs[choice]
        deltas = shaper.feed(text, final=finish is not None)
        if finish is not None:
            finish = shaper.finish_reason(finish)
        if not deltas:
            deltas = [{}] if finish is not None or len(comp.token_ids) > first_new else []
        logprobs = self._logprobs(comp, first_new)
        return [self._chunk(choice, delta, logprobs if i == 0 else None, finish if i == len(deltas) - 1 else None)
                for i, delta in enumerate(deltas)]

    def _logprobs(self, comp: CompletionOutput, first_new: int) -> dict[str, Any] | None:
        if self.num_logprobs is None or comp.logprobs is None:
            return None
        return chat_logprobs(comp.token_ids[first_new:], comp.logprobs[first_new:], self.num_logprobs,
                             self.tokenizer.token_to_text)

    def _chunk(self, choice: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               finish: str | None) -> dict[str, Any]:
        return {
            "id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }

    def response(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        output = finals[0]
        choices = []
        for comp in output.outputs:
            self.completion_tokens[comp.index] = len(comp.token_ids)
            message = {"role": "assistant", "content": comp.text}
            finish = comp.finish_reason
            if self.outputs is not None:
                shaper = self.outputs[comp.index]
                message = shaper.message(comp.text)
                finish = shaper.finish_reason(finish)
            choices.append({
                "index": comp.index,
                "message": message,
                "logprobs": self._logprobs(comp, 0),
                "finish_reason": finish,
                "stop_reason": comp.stop_reason,
            })
        return {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage(), **_kv_transfer(finals)}


def _kv_transfer(finals: dict[int, RequestOutput]) -> dict[str, Any]:
    """A prefill instance's kv_transfer_params for the decode instance (vLLM's response field)."""
    params = next((o.kv_transfer_params for o in finals.values() if o.kv_transfer_params), None)
    return {"kv_transfer_params": params} if params else {}


async def _stream_events(stream: OutputStream, renderer: _Renderer, include_usage: bool,
                         first: list[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    """SSE events: the opening chunks (chat's role) with the first output, then one per
    choice with news each engine step, then usage and [DONE]. Whatever ends this
    generator early (a disconnect cancels it) aborts the requests."""
    object_name = "chat.completion.chunk" if isinstance(renderer, _ChatRenderer) else "text_completion"
    try:
        for chunk in renderer.opening_chunks():
            yield _event(chunk)
        batch = first
        while True:
            for prompt_index, output in batch:
                for chunk in renderer.chunks(prompt_index, output):
                    yield _event(chunk)
            if stream.finished:
                break
            batch = await stream.get()
        if include_usage:
            yield _event(renderer.usage_chunk(object_name))
    except EngineUnavailableError as error:
        # Headers are sent; the error can only travel as an event.
        api_error = unavailable(error)
        yield _event(error_body(api_error.status, api_error.message, code=api_error.code))
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"

