"""The OpenAI-compatible server end to end: a real `tokenmill serve` subprocess,
driven by the official openai client and by raw httpx.

One server for the module (the model loads once); generations stay a few tokens
long so the module runs in well under two minutes on a 2-core CPU.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server_utils import sse_json

LENGTH_SUCCESS = 'tokenmill:request_success_total{finished_reason="length"}'
ABORT_SUCCESS = 'tokenmill:request_success_total{finished_reason="abort"}'
GENERATED = "tokenmill:generation_tokens_total"


def test_health_is_503_while_loading_and_200_once_loaded(server):
    assert server.saw_loading_503
    response = httpx.get(server.url + "/health")
    assert response.status_code == 200


def test_the_server_freezes_its_start_up_heap(server):
    """After the engine loads, the server moves what start-up left alive into the garbage
    collector's permanent generation (vLLM's freeze_gc_heap), so no full collection walks the
    model again mid-request; the log says how many objects."""
    log = Path(server.log.name).read_text(errors="replace")
    frozen = re.search(r"garbage collector: froze (\d+) objects alive after start-up \(server\)", log)
    assert frozen is not None, log[-2000:]
    assert int(frozen.group(1)) > 10_000  # the model's modules, the tokenizer, the libraries


def test_models_lists_the_served_model(server, client):
    (card,) = client.models.list().data
    assert card.id == server.model
    assert server.get("/v1/models").json()["data"][0]["max_model_len"] == 1024


# ----- the openai client ---------------------------------------------------------------------


def test_streamed_completion_equals_the_non_streamed_one(server, client):
    request = dict(model=server.model, prompt="The capital of France is", max_tokens=10, temperature=0)
    full = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))

    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert usage_chunk.choices == []
    assert usage_chunk.usage == full.usage
    assert full.usage.prompt_tokens == len(server.post("/tokenize", json={"prompt": request["prompt"]}).json()["tokens"])
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert 1 <= full.usage.completion_tokens <= 10


def test_streamed_chat_equals_the_non_streamed_one(server, client):
    request = dict(model=server.model, messages=[{"role": "user", "content": "Name a color."}],
                   max_completion_tokens=8, temperature=0)
    full = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))

    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert streamed == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    counted = server.post("/tokenize", json={"messages": request["messages"]}).json()["count"]
    assert full.usage.prompt_tokens == counted


def test_n_choices_each_finish_once(server, client):
    completion = client.completions.create(model=server.model, prompt="Once upon a time", n=2, max_tokens=4,
                                           seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in completion.choices) == [0, 1]
    assert completion.usage.completion_tokens == 8

    chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=3, seed=3,
        stream=True, extra_body={"ignore_eos": True},
    ))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]


def test_prompt_batches_map_to_choice_indices(server, client):
    prompts = ["Paris is a city", "Zebras live in"]
    token_prompts = [server.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    for prompt in (prompts, token_prompts):  # a list of strings, a list of token-id lists
        completion = client.completions.create(
            model=server.model, prompt=prompt, n=2, max_tokens=2, echo=True, temperature=0,
            extra_body={"ignore_eos": True},
        )
        texts = {c.index: c.text for c in completion.choices}
        assert sorted(texts) == [0, 1, 2, 3]
        # choice index = prompt index * n + sample index; echo shows which prompt each is.
        for index, text in texts.items():
            assert text.startswith(prompts[index // 2]), (index, text)
        # Prompt tokens count once per prompt, not once per choice.
        assert completion.usage.prompt_tokens == sum(len(t) for t in token_prompts)
        assert completion.usage.completion_tokens == 8


def test_logprobs_in_openai_shapes(server, client):
    completion = client.completions.create(model=server.model, prompt="Hello there", max_tokens=3, logprobs=2,
                                           echo=True, temperature=0, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    logprobs = choice.logprobs
    total = completion.usage.prompt_tokens + 3
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == total
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts token 0
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and all(offsets[i + 1] == offsets[i] + len(logprobs.tokens[i]) for i in range(total - 1))

    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2, temperature=0,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    # Greedy: the chosen token is the most likely one.
    assert all(entry.token == entry.top_logprobs[0].token for entry in content)


# ----- raw HTTP ------------------------------------------------------------------------------


def test_sse_framing(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": "One, two,", "max_tokens": 3, "stream": True, "ignore_eos": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    chunks = sse_json(raw)  # checks `data: ...\n\n` framing and the final [DONE]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert "usage" not in chunks[-1] or chunks[-1]["usage"] is None


def test_stream_lines_survive_unicode_line_separators(server, client):
    """U+2028, U+2029 and U+0085 are escaped in every data line: a client that reads the
    stream with httpx's `iter_lines` (which splits where str.splitlines does) gets whole JSON
    lines, and the text round-trips (the soak's client once got a line cut at a generated U+2028)."""
    prompt = "one\u2028two\u2029three\x85four"
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "echo": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    whole = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, echo=True, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert streamed == whole and streamed.startswith(prompt)


def test_sse_json_escapes_only_what_line_readers_split_on() -> None:
    from tokenmill.serve.protocol import sse_json

    payload = {"text": "a\u2028b\u2029c\x85d\u00e9\n"}
    line = sse_json(payload)
    assert line.splitlines() == [line] and json.loads(line) == payload
    assert "\u00e9" in line  # other text stays UTF-8 as is


def test_tokenize_and_detokenize_round_trip(server):
    tokens = server.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    text = server.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def test_chat_content_parts_and_generation_prompt(server):
    as_text = [{"role": "user", "content": "first\nsecond"}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    tokens = server.post("/tokenize", json={"messages": as_text}).json()["tokens"]
    assert server.post("/tokenize", json={"messages": as_parts}).json()["tokens"] == tokens
    without = server.post("/tokenize", json={"messages": as_text, "add_generation_prompt": False}).json()["tokens"]
    assert tokens[: len(without)] == without and len(tokens) > len(without)  # the assistant header follows


def test_32_concurrent_streams_complete_and_metrics_agree(server):
    before = server.wait_idle()
    max_tokens = 5

    async def one(aclient: AsyncOpenAI, i: int) -> tuple[int, list[str], int]:
        stream = await aclient.completions.create(
            model=server.model, prompt=f"Request {i} says", max_tokens=max_tokens, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        finishes, usage, pieces = [], None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces += 1
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        return usage.completion_tokens, finishes, pieces

    async def run_all():
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert all(tokens == max_tokens and finishes == ["length"] for tokens, finishes, _ in results), results
    after = server.wait_idle()
    assert after[GENERATED] - before[GENERATED] == 32 * max_tokens
    assert after[LENGTH_SUCCESS] - before.get(LENGTH_SUCCESS, 0) == 32
    assert after["tokenmill:time_to_first_token_seconds_count"] >= 32


def test_disconnected_clients_free_their_requests(server):
    """Clients that go away mid-stream (or before a non-streamed answer) are aborted
    within a step: nothing runs or waits afterwards, and the KV cache is empty."""
    before = server.wait_idle()
    body = {"prompt": "Write a very long story about a dragon.", "max_tokens": 400, "ignore_eos": True}

    async def streaming(aclient: httpx.AsyncClient) -> None:
        async with aclient.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as response:
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    return  # leaving the block closes the connection

    async def non_streaming(aclient: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await aclient.post(server.url + "/v1/completions", json=body, timeout=3)

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as aclient:
            await asyncio.gather(*(streaming(aclient) for _ in range(20)), *(non_streaming(aclient) for _ in range(2)))

    asyncio.run(run_all())
    after = server.wait_idle(timeout=10)
    assert after["tokenmill:num_requests_running"] == 0
    assert after["tokenmill:num_requests_waiting"] == 0
    assert after["tokenmill:kv_cache_usage_perc"] == 0
    assert after[ABORT_SUCCESS] - before.get(ABORT_SUCCESS, 0) == 22
    # Every aborted request stopped early: far fewer tokens than 22 full generations.
    assert after[GENERATED] - before[GENERATED] < 22 * 400 / 4


def test_metrics_exposes_the_vllm_style_families(server):
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for family in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                   "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                   "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket"]:
        assert f"tokenmill:{family}{{" in text, family
    assert f'model_name="{server.model}"' in text
    metrics = server.metrics()
    assert metrics["tokenmill:prompt_tokens_total"] > 0
    assert metrics["tokenmill:prefix_cache_queries_total"] >= metrics["tokenmill:prefix_cache_hits_total"]


def test_stop_strings_end_the_choice_with_reason_stop(server, client):
    full = client.completions.create(model=server.model, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    text = full.choices[0].text
    words = text.split()
    if len(words) < 2:
        pytest.skip(f"greedy output too short to pick a stop string: {text!r}")
    stop = words[1]
    stopped = client.completions.create(model=server.model, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                        stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert json.loads(stopped.model_dump_json())["choices"][0]["stop_reason"] == stop
