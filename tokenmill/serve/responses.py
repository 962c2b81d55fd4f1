"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A response request is turned into the chat request it means (instructions -> a system
message, input items -> messages, tools and `text.format` -> their chat fields) and runs
through the same machinery as /v1/chat/completions: chat template, tool plan (constrained
required / named calls, the auto parser), structured output, reasoning parser. Its output
comes back as Responses items (`message`, `function_call`, `reasoning`), whole or streamed
as the Responses event types.

`store` (default true) keeps the response and its conversation in a bounded in-memory
store (oldest dropped first), so `previous_response_id` continues it and GET / DELETE
find it; an unknown id is a 404. `background` is not supported.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.outputs import RequestOutput
from tokenmill.serve.async_engine import EngineUnavailableError
from tokenmill.serve.errors import APIError, bad_request, error_body
from tokenmill.serve.protocol import ChatCompletionRequest, ChatMessage, OpenAIModel, RequestBody, sse_content, sse_json
from tokenmill.serve.reasoning import get_reasoning_parser
from tokenmill.serve.serving import (
    OpenAIServing,
    _collect,
    _sampling_params,
    SSEResponse,
    _unless_disconnected,
    unavailable,
)
from tokenmill.serve.tools import ChoiceOutput, plan_tools

MAX_STORED_RESPONSES = 1000


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """Validated as the other bodies (protocol.py): strictly (`store: 0.0` was taken for
    false: a schema-violating body the long fuzz found), unknown fields ignored."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None


# ----- answers (declared in the OpenAPI schema) --------------------------------------------


class ResponseObject(BaseModel):
    """A response (POST without `stream`, GET by id, and inside the stream's events); its
    items and settings are OpenAI's, described here only as far as the server relies on them."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response, named by its `type` (`response.created`,
    `response.output_text.delta`, ... `response.completed`; `error` when it fails)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseStore:
    """Responses and their conversations, newest kept, at most `capacity`."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (response, history)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        try:
            return self._items[response_id]
        except KeyError:
            raise APIError(404, f"no response with id {response_id!r} (never stored, deleted, or evicted)",
                           param="response_id", code="not_found") from None

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


# ----- request -> chat ------------------------------------------------------------------------


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input -> chat messages (user / system / developer / assistant messages,
    function_call and function_call_output items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"input[{index}].role must be user, system, developer or assistant",
                                  param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), index)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not replayed to the model
        else:
            raise bad_request(f"input[{index}] has type {kind!r}; supported: message, function_call, "
                              "function_call_output, reasoning", param="input")
    return messages


def _text_of(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise bad_request(f"input[{index}].content: only text parts are supported", param="input")
            texts.append(part.get("text", ""))
        return "\n".join(texts)
    raise bad_request(f"input[{index}].content must be a string or a list of text parts", param="input")


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    tools = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
             for tool in body.tools or [] if tool.get("type") == "function"]
    if body.tools and len(tools) != len(body.tools):
        raise bad_request("only tools of type function are supported", param="tools")
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fields: dict[str, Any] = {"messages": messages, "tools": tools or None, "tool_choice": choice,
                              "parallel_tool_calls": body.parallel_tool_calls, "max_tokens": body.max_output_tokens,
                              "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed}
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", param="text")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name or "response", "schema": text_format.schema_, "strict": text_format.strict}}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValueError as error:
        raise bad_request(f"input: {error}", param="input") from None


# ----- output -> Responses objects ---------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(call: dict[str, Any], status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store or ResponseStore()

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        serving = self.serving
        serving.check_accepting()
        model = serving.check_model(body.model)
        serving.check_runner("generate", "Responses API")
        if body.background:
            raise bad_request("background responses are not supported", param="background")
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            _, history = self.store.get(body.previous_response_id)
        history = history + input_messages(body.input)
        chat = chat_request(body, history)
        plan = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls, serving.agent)
        prompt_ids = await serving.encode_chat(chat.messages, True, None, None, tools=plan)
        params = _sampling_params(chat, chat.max_tokens, None)
        serving._admit(len(prompt_ids), params, 0, "input")
        await serving.constrain(params, chat, plan)
        response_id = _id("resp")
        stream = await serving._submit(response_id, [prompt_ids], params)
        agent = serving.agent
        shaper = ChoiceOutput(plan, get_reasoning_parser(agent.reasoning_parser) if agent.reasoning_parser else None)
        base = self._base(response_id, model, body)
        if body.stream:
            first = await _unless_disconnected(stream.get(), stream, raw)
            return SSEResponse(self._events(stream, first, shaper, base, body, history, len(prompt_ids)),
                                serving.stream_send_timeout)
        finals = await _unless_disconnected(_collect(stream), stream, raw)
        output = finals[0]
        comp = output.outputs[0]
        message = shaper.message(comp.text)
        response = self._finish(base, self._items(message), comp.finish_reason, len(prompt_ids), len(comp.token_ids))
        self._remember(body, response, history, message)
        return JSONResponse(response)

    # ----- building the response -------------------------------------------------------------

    @staticmethod
    def _base(response_id: str, model: str, body: ResponsesRequest) -> dict[str, Any]:
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "instructions": body.instructions, "error": None,
            "incomplete_details": None, "previous_response_id": body.previous_response_id,
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens, "store": body.store,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text is not None and body.text.format is not None else {"type": "text"}},
            "metadata": body.metadata or {}, "usage": None,
        }

    @staticmethod
    def _items(message: dict[str, Any]) -> list[dict[str, Any]]:
        items = []
        if message.get("reasoning_content"):
            items.append(reasoning_item(message["reasoning_content"]))
        if message.get("content") is not None and (message["content"] or not message.get("tool_calls")):
            items.append(message_item(message["content"]))
        items += [function_call_item(call) for call in message.get("tool_calls") or []]
        return items

    @staticmethod
    def _finish(base: dict[str, Any], items: list[dict[str, Any]], finish_reason: str | None, prompt_tokens: int,
                output_tokens: int) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        return {**base, "status": "incomplete" if incomplete else "completed", "output": items,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": prompt_tokens + output_tokens}}

    def _remember(self, body: ResponsesRequest, response: dict[str, Any], history: list[dict[str, Any]],
                  message: dict[str, Any]) -> None:
        if not body.store:
            return
        assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            assistant["tool_calls"] = message["tool_calls"]
        self.store.put(response, history + [assistant])

    # ----- streaming ---------------------------------------------------------------------------

    async def _events(self, stream, first: list[tuple[int, RequestOutput]], shaper: ChoiceOutput,
                      base: dict[str, Any], body: ResponsesRequest, history: list[dict[str, Any]],
                      prompt_tokens: int) -> AsyncIterator[str]:
        events = _EventWriter()
        try:
            yield events.emit("response.created", response=base)
            yield events.emit("response.in_progress", response=base)
            sent = 0
            batch = first
            output: RequestOutput | None = None
            while True:
                for _, output in batch:
                    comp = output.outputs[0]
                    delta, sent = comp.text[sent:], len(comp.text)
                    final = comp.finish_reason is not None
                    for chat_delta in shaper.feed(delta, final):
                        for event in events.delta(chat_delta):
                            yield event
                if stream.finished:
                    break
                batch = await stream.get()
            for event in events.close_item():
                yield event
            comp = output.outputs[0]
            message = shaper.message(comp.text)
            response = self._finish(base, events.items, comp.finish_reason, prompt_tokens, len(comp.token_ids))
            self._remember(body, response, history, message)
            yield events.emit("response.completed" if response["status"] == "completed" else "response.incomplete",
                              response=response)
        except EngineUnavailableError as error:  # headers are sent: the error travels as an event
            api_error = unavailable(error)
            # OpenAI's error event: its own `type` ("error"), the error's code, message and param
            error = error_body(api_error.status, api_error.message, code=api_error.code)["error"]
            yield events.emit("error", code=error["code"], message=error["message"], param=error["param"])
        finally:
            stream.abort()


class _EventWriter:
    """Responses stream events: output items open and close as the kind of delta changes
    (reasoning text, message text, one function call each)."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""
        self.call_index: int | None = None

    def emit(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {sse_json(payload)}\n\n"

    @property
    def index(self) -> int:
        return len(self.items)

    def delta(self, chat_delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if "reasoning_content" in chat_delta or "content" in chat_delta:
            kind = "reasoning" if "reasoning_content" in chat_delta else "message"
            text = chat_delta.get("reasoning_content") or chat_delta.get("content") or ""
            if self.open is None or self.open["type"] != kind:
                out += self.close_item()
                out += self._open_text(kind)
            self.text += text
            item_id = self.open["id"]
            if text:
                if kind == "message":
                    out.append(self.emit("response.output_text.delta", item_id=item_id, output_index=self.index,
                                         content_index=0, delta=text, logprobs=[]))
                else:
                    out.append(self.emit("response.reasoning_text.delta", item_id=item_id, output_index=self.index,
                                         content_index=0, delta=text))
        for call in chat_delta.get("tool_calls") or []:
            if "id" in call:  # a new call
                out += self.close_item()
                item = function_call_item({"id": call["id"], "function": {"name": call["function"]["name"],
                                                                           "arguments": ""}}, "in_progress")
                self.open, self.text = item, ""
                out.append(self.emit("response.output_item.added", output_index=self.index, item=item))
            arguments = call.get("function", {}).get("arguments") or ""
            if arguments:
                self.text += arguments
                out.append(self.emit("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=self.index, delta=arguments))
        return out

    def _open_text(self, kind: str) -> list[str]:
        if kind == "message":
            item = message_item("", "in_progress")
            item["content"] = []
            self.open, self.text = item, ""
            return [self.emit("response.output_item.added", output_index=self.index, item=item),
                    self.emit("response.content_part.added", item_id=item["id"], output_index=self.index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
        item = reasoning_item("")
        item["content"] = []
        self.open, self.text = item, ""
        return [self.emit("response.output_item.added", output_index=self.index, item=item)]

    def close_item(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        out = []
        if item["type"] == "message":
            done = message_item(self.text, item_id=item["id"])
            out.append(self.emit("response.output_text.done", item_id=item["id"], output_index=self.index,
                                 content_index=0, text=self.text, logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=item["id"], output_index=self.index,
                                 content_index=0, part=done["content"][0]))
        elif item["type"] == "reasoning":
            done = reasoning_item(self.text, item_id=item["id"])
            out.append(self.emit("response.reasoning_text.done", item_id=item["id"], output_index=self.index,
                                 content_index=0, text=self.text))
        else:
            done = {**item, "arguments": self.text, "status": "completed"}
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=self.index, arguments=self.text, name=item["name"]))
        out.append(self.emit("response.output_item.done", output_index=self.index, item=done))
        self.items.append(done)
        self.open, self.text = None, ""
        return out


def add_responses_routes(app: FastAPI, serving: OpenAIServing, errors: dict[int | str, dict[str, Any]]) -> None:
    responses = ResponsesServing(serving)

    @app.post("/v1/responses", responses={
        200: {"model": ResponseObject, "content": sse_content("ResponseStreamEvent", named=True)}, **errors})
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await responses.create(body, raw)

    @app.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject}, **errors})
    async def retrieve_response(response_id: str) -> Response:
        return JSONResponse(responses.store.get(response_id)[0])

    @app.delete("/v1/responses/{response_id}", responses={200: {"model": ResponseDeleted}, **errors})
    async def delete_response(response_id: str) -> Response:
        responses.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
