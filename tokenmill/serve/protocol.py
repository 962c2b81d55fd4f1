"""Request bodies of the OpenAI-compatible API, as pydantic models.

Validation is strict (a string is not a number, a float is not an int), because
OpenAI's server rejects what these reject; unknown fields are ignored, because
OpenAI clients send fields this server has no use for (`user`, `store`, ...).
Value ranges that SamplingParams already checks are left to it, so that one
place owns each rule; only limits that SamplingParams cannot see (the seed's
64 bits, OpenAI's `n` ceiling) are declared here, and the server's own request
limits (serve/limits.py) are checked by the handlers.

The response models at the end are what the routes declare in the OpenAPI schema
(the handlers build plain dicts of the same shape); the reliability suite checks
every 2xx response against them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.sampling.params import SamplingParams
from tokenmill.serve.limits import MAX_N
from tokenmill.serve.structured import ResponseFormat, StructuredOutputsField
from tokenmill.serve.tools import ToolChoice, ToolDef

TokenIds = list[StrictInt]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class RequestBody(OpenAIModel):
    """A whole request body: its strings must be valid Unicode. JSON may spell a lone
    UTF-16 surrogate ("\\ud800"), which Python keeps in a str but no tokenizer or
    UTF-8 encoder accepts; it is refused here, naming where it is."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = _find_lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError(
                "lone_surrogate", "{where}: the string holds a lone surrogate (U+{code}), which is not valid "
                "Unicode; encode the text as UTF-8", {"where": where[0] or "body", "code": where[1]})
        return data


def _find_lone_surrogate(data: Any) -> tuple[str, str] | None:
    """(dotted path, code point) of the first string, key or value, that cannot be
    encoded as UTF-8; iterative, so a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                return path, f"{ord(value[error.start]):04X}"
        elif isinstance(value, dict):
            for key, item in value.items():
                # Escaped: pydantic cannot even render a message that holds a surrogate.
                name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
                stack.append((f"{path}.{name}" if path else name, key))
                stack.append((f"{path}.{name}" if path else name, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{index}" if path else str(index), item) for index, item in enumerate(value))
    return None


class StreamOptions(OpenAIModel):
    include_usage: bool = False


def sampling_field(name: str, nullable: bool = True) -> Any:
    """A request field that is a SamplingParams field, described as SamplingParams describes
    it. A nullable field defaults to null, which means SamplingParams's default (serving.py
    leaves it out); the others take SamplingParams's default itself."""
    declared = SamplingParams.__dataclass_fields__[name]
    return Field(None if nullable else declared.default, description=declared.metadata["help"])


class SamplingFields(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions. Those named as
    SamplingParams's fields are its fields (serving.py maps them by name)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = sampling_field("n", nullable=False)
    # None: completions take SamplingParams's default (16) within what the context leaves,
    # chat the rest of the context (as vLLM's server).
    max_tokens: int | None = Field(None, description="most tokens to generate (default: 16 for a completion, "
                                                     "the rest of the context for a chat)")
    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
    top_k: int | None = sampling_field("top_k")
    min_p: float | None = sampling_field("min_p")
    presence_penalty: float | None = sampling_field("presence_penalty")
    frequency_penalty: float | None = sampling_field("frequency_penalty")
    repetition_penalty: float | None = sampling_field("repetition_penalty")
    # torch generators take 64-bit seeds; a larger one would only fail inside a step.
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = sampling_field("seed")
    stop: str | list[str] | None = sampling_field("stop")
    stop_token_ids: TokenIds | None = sampling_field("stop_token_ids")
    logit_bias: dict[str, float] | None = sampling_field("logit_bias")  # token ids as strings (JSON keys)
    ignore_eos: bool = sampling_field("ignore_eos", nullable=False)
    min_tokens: int = sampling_field("min_tokens", nullable=False)
    skip_special_tokens: bool = sampling_field("skip_special_tokens", nullable=False)
    include_stop_str_in_output: bool = sampling_field("include_stop_str_in_output", nullable=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's field: lower is served first under --scheduling-policy priority; anything but
    # 0 is refused (400) under fcfs, as vLLM does.
    priority: Annotated[int, Field(ge=-(2**63), lt=2**63)] = 0
    # This request's latency targets for SLO mode (docs/scheduling.md), in milliseconds:
    # named as the server's --slo-ttft-ms / --slo-tpot-ms and llm-d's x-slo-ttft-ms /
    # x-slo-tpot-ms request headers (also accepted; the body wins). vLLM has no such field.
    slo_ttft_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    slo_tpot_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    # Output constraints (serve/structured.py): OpenAI's, vLLM's, and vLLM's older names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's field for prefill-decode disaggregation (docs/disaggregation.md): what
    # vllm-router --vllm-pd-disaggregation sends ({"do_remote_decode": true} to a prefill
    # instance; the prefill's answer to a decode instance). Needs --kv-transfer-config.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them.
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0)] | None = None  # at most --max-logprobs
    echo: bool = False


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    # Other fields (tool_calls, ...) are kept: a chat template may use them.
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError(
                        "unsupported_content_part",
                        "content part {index} has type '{kind}': this server's model reads text only, so only "
                        "parts of type 'text' are supported (no images, audio or files)",
                        {"index": index, "kind": kind})
        return content

    def to_template_dict(self) -> dict[str, Any]:
        """The message as a chat template expects it: content as one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None  # at most --max-logprobs
    add_generation_prompt: bool = True
    # vLLM's fields; a request's own template is refused unless --trust-request-chat-template.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (serve/tools.py).
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


class EmbeddingRequest(RequestBody):
    """OpenAI's embeddings request, and vLLM's fields: `normalize`, `truncate_prompt_tokens`,
    `priority`, and its chat form (`messages` instead of `input`, rendered with the chat
    template, without the generation prompt unless asked)."""

    model: str | None = None
    # One input (text or token ids) or a batch of them; or a conversation in `messages`.
    input: str | TokenIds | list[str] | list[TokenIds] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None  # a Matryoshka model's; else 400
    user: str | None = None
    normalize: bool | None = None  # vLLM's: None follows the server's pooler config
    truncate_prompt_tokens: StrictInt | None = None  # vLLM's: embed the last k tokens (-1: max_model_len)
    priority: StrictInt = 0


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: TokenIds


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


# ----- responses (declared in the OpenAPI schema) ------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body."""

    error: ErrorDetail


class CompletionLogprobsBody(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobsBody | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's, for the decode instance


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallBody(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallBody] | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's, for the decode instance


class ChatToolCallFunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ChatToolCallDelta(BaseModel):
    """A tool call in a stream: its id, type and name with its first piece, then
    `arguments` a piece at a time."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChatToolCallFunctionDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat (the last, with `stream_options.include_usage`, has
    no choices and the usage)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# Characters JSON leaves raw that Python's str.splitlines, and so httpx's `aiter_lines` and
# other line readers, take for line ends (JSON escapes every other one: they are below 0x20).
# SSE ends lines only at CR/LF, but a generated U+2028 split a data line in two for such a
# client (the soak's). Escaped, the JSON is the same and every data line stays one line.
_JSON_RAW_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(payload: Any) -> str:
    """`payload` as the JSON of one SSE `data:` line: compact, UTF-8 text as is, the
    characters line readers split on escaped."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_JSON_RAW_LINE_BREAKS)


def sse_content(payload: str, *, named: bool = False) -> dict[str, Any]:
    """The OpenAPI description of a `text/event-stream` answer, one event at a time
    (OpenAPI 3.2's `itemSchema`; schemathesis checks every event against it), `payload`
    naming the component each event's `data` holds as JSON.

    OpenAI's chat and completions streams (`named=False`): an event is a `payload`, or an
    ErrorResponse when the stream fails after it started, or the closing `[DONE]`. The
    Responses API's (`named=True`): every event has an `event:` name (its payload's
    `type`), its errors are events of their own type ("error"), and there is no `[DONE]`.

    No `schema` for the whole stream: under OpenAPI 3.2 it describes the events as an
    array, and the string schema declared before (`{"type": "string"}`) was true of no
    event (schemathesis's ST108 on every streamed 200)."""
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in [payload] + ([] if named else ["ErrorResponse"])]
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json",
                            "contentSchema": {"anyOf": refs} if len(refs) > 1 else refs[0]}
    properties: dict[str, Any] = {"data": data if named else {"anyOf": [{"const": "[DONE]"}, data]}}
    if named:
        properties["event"] = {"type": "string"}
    return {"text/event-stream": {"itemSchema": {"type": "object", "properties": properties,
                                                 "required": sorted(properties)}}}


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # float: the numbers; base64: little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]


class VersionResponse(BaseModel):
    version: str
