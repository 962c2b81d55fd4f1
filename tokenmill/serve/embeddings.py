"""POST /v1/embeddings: OpenAI's embeddings API on the pooling runner (`--runner pooling`).

Each input (a text, a list of token ids, or a batch of either; or, vLLM's chat form, a
conversation in `messages` rendered with the chat template) becomes one pooling request:
prefilled with the scheduler's normal batching and chunking, its final hidden states pooled
(serve's pooler config; docs/models.md), the vector returned as floats or, with
`encoding_format: base64`, as the base64 of its little-endian float32 bytes (what the
official `openai` client asks for by default). `dimensions` keeps the first N of a
Matryoshka model's vector and is a 400 for any other model; an input longer than
max_model_len is a 400 with vLLM's sentence; a server on the generate runner answers 404.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.params import SamplingParams
from tokenmill.serve.errors import APIError, bad_request, from_value_error
from tokenmill.serve.protocol import EmbeddingRequest, EmbeddingResponse
from tokenmill.serve.serving import OpenAIServing, Prompt, _collect, _prompt_list, _unless_disconnected


def add_embeddings_route(app: FastAPI, serving: OpenAIServing, errors: dict[int | str, dict[str, Any]]) -> None:
    @app.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **errors})
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        return await create_embedding(serving, body, raw)


async def create_embedding(serving: OpenAIServing, body: EmbeddingRequest, raw: Request) -> Response:
    serving.check_accepting()
    model = serving.check_model(body.model)
    serving.check_runner("pooling", "Embeddings API")
    if (body.input is None) == (body.messages is None):
        raise bad_request("send exactly one of 'input' or 'messages'", param="input")
    if body.input == []:
        raise bad_request("input must not be empty: send a string, a list of token ids, or a list of either",
                          param="input")
    try:
        params = PoolingParams(body.dimensions, body.normalize, body.truncate_prompt_tokens)
    except ValueError as error:
        raise from_value_error(error) from error
    if body.messages is not None:  # vLLM's chat embedding request: one conversation, one vector
        ids = await serving.encode_chat(body.messages, body.add_generation_prompt, body.chat_template,
                                        body.chat_template_kwargs)
        prompts = [Prompt(await serving.off_loop(serving.processor.truncate, ids, params.truncate_prompt_tokens))]
    else:
        inputs = _prompt_list(body.input)
        serving.limits.check_sequences(len(inputs), 1)
        prompts = await serving.off_loop(_tokenize_inputs, serving.processor, inputs, params.truncate_prompt_tokens)
    _admit(serving, prompts, params, body.priority)
    request_id = f"embd-{uuid.uuid4().hex}"
    stream = await serving._submit(request_id, [p.token_ids for p in prompts], SamplingParams(max_tokens=1),
                                   body.priority, pooling_params=params)
    finals = await _unless_disconnected(_collect(stream), stream, raw)
    return JSONResponse(_response(request_id, model, finals, prompts, body.encoding_format))


def _tokenize_inputs(processor: Any, inputs: list[str | list[int]], truncate: int | None) -> list[Prompt]:
    """Token ids of every input (the last `truncate` of them, as vLLM's truncate_prompt_tokens)."""
    tokenized = [processor.tokenize(text, "input") for text in inputs]
    return [Prompt(processor.truncate(ids, truncate), text) for text, ids in tokenized]


def _admit(serving: OpenAIServing, prompts: list[Prompt], params: PoolingParams, priority: int) -> None:
    """The input processor's checks for every input before any is queued."""
    processor = serving.processor
    try:
        processor.check_priority(priority)
        processor.check_pooling_params(params)
        for prompt in prompts:
            processor.check_pooling(len(prompt.token_ids), "input")
    except ValueError as error:
        raise from_value_error(error) from error


def _response(request_id: str, model: str, finals: dict[int, RequestOutput], prompts: list[Prompt],
              encoding_format: str) -> dict[str, Any]:
    data = [{"object": "embedding", "index": index, "embedding": _encode(finals[index].pooled, encoding_format)}
            for index in range(len(prompts))]
    num_tokens = sum(len(p.token_ids) for p in prompts)
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _encode(vector: list[float] | None, encoding_format: str) -> list[float] | str:
    if vector is None:  # aborted before its prompt was pooled (the server is draining)
        raise APIError(503, "the embedding request was aborted before it finished (the server is shutting down)",
                       code="engine_unavailable")
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
