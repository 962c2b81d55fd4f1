"""Every failure of the server answers with the right status and an OpenAI-shaped
error body, refuses before any work, and leaves the server healthy; plus the API
key, the waiting-queue limit (429) and a graceful SIGTERM.

One server for the module, started with --api-key, --served-model-name and a
tiny scheduler (2 running, 2 waiting) so the queue limit is easy to reach. The
SIGTERM test stops that server, so it comes last; the `live` fixture restarts
the server should any test run after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time

import httpx
import pytest

from tests.server_utils import ServerProcess, assert_error

API_KEY = "test-secret"
SERVED_NAME = "tiny-model"


@pytest.fixture(scope="module")
def server_holder():
    holder = {"server": None}
    yield holder
    if holder["server"] is not None:
        holder["server"].stop()


@pytest.fixture
def live(server_holder, tmp_path_factory) -> ServerProcess:
    server = server_holder["server"]
    if server is None or not server.alive:
        # Some flags come from a YAML file, as a deployment would write them.
        config = tmp_path_factory.mktemp("serve") / "serve.yaml"
        config.write_text(f"served-model-name: {SERVED_NAME}\nmax_num_seqs: 2\nmax-queued-requests: 2\n")
        server = server_holder["server"] = ServerProcess("--config", str(config), api_key=API_KEY).start()
    return server


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}

# (case, path, body: dict -> JSON, bytes -> sent raw, expected status, expected param or None)
BAD_REQUESTS = [
    ("malformed JSON", COMPLETIONS, b'{"prompt": "x",', 400, None),
    ("JSON array body", COMPLETIONS, b"[1, 2]", 400, None),
    ("JSON string body", CHAT, b'"hello"', 400, None),
    ("empty body", COMPLETIONS, b"", 400, None),
    ("missing prompt", COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    ("missing messages", CHAT, {"max_tokens": 2}, 400, "messages"),
    ("prompt of the wrong type", COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    ("mixed prompt list", COMPLETIONS, {"prompt": ["a", 1]}, 400, "prompt"),
    ("max_tokens as a string", COMPLETIONS, {"prompt": "a", "max_tokens": "2"}, 400, "max_tokens"),
    ("temperature as a string", COMPLETIONS, {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("stream as a string", COMPLETIONS, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("message content as a number", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content"),
    ("message without a role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("negative temperature", COMPLETIONS, {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_p above one", CHAT, {"messages": HI, "top_p": 1.5}, 400, "top_p"),
    ("max_tokens zero", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", CHAT, {"messages": HI, "max_tokens": -3}, 400, "max_tokens"),
    ("n zero", COMPLETIONS, {"prompt": "a", "n": 0}, 400, "n"),
    ("too many logprobs", COMPLETIONS, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("seed beyond 64 bits", COMPLETIONS, {"prompt": "a", "seed": 2**64}, 400, "seed"),
    ("prompt longer than max_model_len", COMPLETIONS, {"prompt": "hi " * 1100}, 400, "prompt"),
    ("prompt + max_tokens over max_model_len", COMPLETIONS, {"prompt": "hi " * 900, "max_tokens": 500}, 400,
     "max_tokens"),
    ("chat over max_model_len", CHAT, {"messages": HI, "max_completion_tokens": 5000}, 400, "max_tokens"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, None),
    ("empty token list", COMPLETIONS, {"prompt": []}, 400, None),
    ("out-of-vocabulary token id", COMPLETIONS, {"prompt": [1, 49152]}, 400, None),
    ("negative token id", COMPLETIONS, {"prompt": [[5], [-1]]}, 400, None),
    ("stream_options without stream", COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("chat stream_options with stream false", CHAT,
     {"messages": HI, "stream": False, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("logit_bias key not a number", COMPLETIONS, {"prompt": "a", "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("logit_bias key out of the vocabulary", CHAT, {"messages": HI, "logit_bias": {"100000000": 1}}, 400, None),
    ("logit_bias value out of range", COMPLETIONS, {"prompt": "a", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("top_logprobs without logprobs", CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    ("empty stop string", COMPLETIONS, {"prompt": "a", "stop": [""]}, 400, None),
    # vLLM's rule: a priority other than 0 needs --scheduling-policy priority (this server is fcfs).
    ("priority under fcfs", COMPLETIONS, {"prompt": "a", "priority": 1}, 400, "priority"),
    ("chat priority under fcfs", CHAT, {"messages": HI, "priority": -1}, 400, "priority"),
    ("priority as a string", COMPLETIONS, {"prompt": "a", "priority": "1"}, 400, "priority"),
    ("unknown model", COMPLETIONS, {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("unknown chat model", CHAT, {"messages": HI, "model": "gpt-4"}, 404, "model"),
    ("tokenize without prompt or messages", "/tokenize", {}, 400, None),
    ("detokenize out-of-vocabulary id", "/detokenize", {"tokens": [10**6]}, 400, "tokens"),
]


def _send(server: ServerProcess, path: str, body, headers: dict | None = None) -> httpx.Response:
    headers = {**server.headers, **(headers or {})}
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={**headers, **JSON}, timeout=60)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(("path", "body", "status", "param"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_an_openai_error(live, path, body, status, param):
    assert_error(_send(live, path, body), status, param)


def test_the_server_stays_healthy_and_idle_after_bad_requests(live):
    for _, path, body, _, _ in BAD_REQUESTS:
        _send(live, path, body)
    assert httpx.get(live.url + "/health").status_code == 200
    metrics = live.wait_idle()
    assert metrics["tokenmill:num_requests_waiting"] == 0  # nothing was queued for any of them
    response = live.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2, "model": SERVED_NAME})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 2


def test_a_body_not_sent_as_json_says_which_content_type_to_use(live):
    response = httpx.post(live.url + COMPLETIONS, content=b'{"prompt": "a"}',
                          headers={**live.headers, "content-type": "application/x-www-form-urlencoded"})
    assert "Content-Type: application/json" in assert_error(response, 400)["message"]


def test_unknown_routes_and_methods_answer_in_openai_shape(live):
    assert_error(live.get("/v1/nothing-here"), 404)
    assert_error(live.get(COMPLETIONS), 405)


def test_api_key_is_required_except_for_health_and_metrics(live):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(live.url + "/v1/models", headers=headers)
        assert assert_error(response, 401)["code"] == "invalid_api_key"
    # Checked before the body is read: a bad body without a key is still a 401.
    assert_error(httpx.post(live.url + COMPLETIONS, content=b"{", headers=JSON), 401)
    assert httpx.get(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/metrics").status_code == 200
    assert live.get("/v1/models").status_code == 200


def test_served_model_name_replaces_the_model_name(live):
    assert [card["id"] for card in live.get("/v1/models").json()["data"]] == [SERVED_NAME]


def test_a_full_waiting_queue_answers_429_with_retry_after(live):
    body = {"prompt": "Count to a thousand:", "max_tokens": 300, "ignore_eos": True, "stream": True}

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(headers=live.headers, timeout=60) as client, contextlib.AsyncExitStack() as open_streams:
            async def open_stream() -> None:
                response = await open_streams.enter_async_context(
                    client.stream("POST", live.url + COMPLETIONS, json=body))
                assert response.status_code == 200

            # Two fill the running slots (--max-num-seqs 2), two fill the queue (--max-queued-requests 2);
            # opened in order so that each is counted where it belongs. A stream's headers come
            # with its first token, so the queued two are still waiting for theirs.
            await asyncio.gather(open_stream(), open_stream())
            await _until(lambda: live.metrics()["tokenmill:num_requests_running"] == 2)
            queued = [asyncio.ensure_future(open_stream()) for _ in range(2)]
            await _until(lambda: live.metrics()["tokenmill:num_requests_waiting"] == 2)
            refused = await client.post(live.url + COMPLETIONS, json=body)
            for task in queued:
                task.cancel()
            await asyncio.gather(*queued, return_exceptions=True)
            return refused

    response = asyncio.run(scenario())
    error = assert_error(response, 429)
    assert response.headers["retry-after"].isdigit()
    assert "waiting" in error["message"]
    metrics = live.wait_idle()  # the four streams were closed: all aborted and freed
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0


async def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_sigterm_lets_the_running_request_finish_and_exits_0(live):
    """Last in the module: it stops the server."""
    result: dict = {}

    def request() -> None:
        result["response"] = live.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 24, "ignore_eos": True})
        result["answered"] = time.monotonic()

    worker = threading.Thread(target=request)
    worker.start()
    deadline = time.monotonic() + 30
    while live.metrics()["tokenmill:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    live.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    worker.join(60)
    response = result["response"]
    assert result["answered"] > signalled  # it was still running when the signal came
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 24
    assert live.proc.wait(60) == 0, live.log_tail()
    with pytest.raises(httpx.TransportError):
        httpx.get(live.url + "/health", timeout=5)
