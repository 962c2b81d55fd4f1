"""Request bodies of the OpenAI-compatible API, as pydantic models.

Validation is strict (a string is not a number, a float is not an int), because
OpenAI's server rejects what these reject; unknown fields are ignored, because
OpenAI clients send fields this server has no use for (`user`, `store`, ...).
Value ranges that SamplingParams already checks are left to it, so that one
place owns each rule; only limits that SamplingParams cannot see (the seed's
64 bits, OpenAI's `n` ceiling) are declared here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

TokenIds = list[StrictInt]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # torch generators take 64-bit seeds; a larger one would only fail inside a step.
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them.
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
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
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
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
