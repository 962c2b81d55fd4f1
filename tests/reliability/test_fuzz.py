"""Fuzzing every route from the server's own OpenAPI schema (schemathesis: schema-valid
and schema-violating requests), plus hand-written hostile bodies. No answer is a 5xx,
every 4xx is an OpenAI error object, every 2xx matches the response schema the route
declares; the server is healthy and idle afterwards. Each test runs against the single
server and through the data-parallel router (`any_rserver`), which must keep the same
contract: the same statuses, the same error objects, the same schema."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import socket

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.reliability.support import RESULTS, long_run
from tests.server_utils import http_request, raw_exchange

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


def assert_openai_error(status: int, body: bytes) -> None:
    error = json.loads(body)
    assert set(error) == {"error"}, body[:300]
    assert set(error["error"]) == {"message", "type", "param", "code"}, body[:300]
    assert isinstance(error["error"]["message"], str) and error["error"]["message"], body[:300]
    assert "Traceback" not in error["error"]["message"] and "site-packages" not in error["error"]["message"]


def fuzz_examples(config: pytest.Config) -> int | None:
    """Examples per route and generation mode: TOKENMILL_FUZZ_EXAMPLES (the long run; 500
    gives 1,000 cases per route), 500 under `-m slow`, else None (CI: 12, a smoke run of
    the long one, which has found what the fuzz found)."""
    examples = os.environ.get("TOKENMILL_FUZZ_EXAMPLES")
    return int(examples) if examples else (500 if long_run(config) else None)


def fuzz(url: str, operations: list, examples: int, label: str) -> dict[str, object]:
    """Every operation with schema-valid cases and, for a POST, as many schema-violating
    ones (a route without a negative mode, GET or DELETE with a path parameter, gets twice
    the valid ones, so that every route can reach 2 x `examples` cases). A case that fails
    a check is recorded and the run goes on, so that one run finds every failure; the
    caller asserts there are none. Per route: cases by status class; running counts on stdout."""
    routes: dict[str, collections.Counter[str]] = {}
    failures: list[str] = []
    empty: list[str] = []  # routes with no schema-violating case
    for operation in operations:
        route = f"{operation.method.upper()} {operation.path}"
        statuses = routes.setdefault(route, collections.Counter())
        negative = operation.method.upper() == "POST"
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if negative else [])
        for mode in modes:
            @settings(max_examples=examples if negative or "{" not in operation.path else 2 * examples,
                      deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck),
                      phases=[Phase.explicit, Phase.generate])
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                response = case.call(base_url=url, timeout=300)
                statuses[f"{response.status_code // 100}xx"] += 1
                try:
                    if 400 <= response.status_code < 500:
                        assert_openai_error(response.status_code, response.content)
                    case.validate_response(response, checks=CHECKS)
                except (AssertionError, BaseExceptionGroup) as failure:
                    found = failure.exceptions if isinstance(failure, BaseExceptionGroup) else [failure]
                    failures.append(f"{route} {mode.value} -> {response.status_code}: "
                                    f"{'; '.join(str(f)[:1000] for f in found)}\n{case.as_curl_command()[:2000]}")
                    print(f"fuzz {label}: FAILED {failures[-1]}", flush=True)

            try:
                run()
            except Unsatisfiable:
                # no schema-violating case exists for this route's schema (nothing in it to
                # violate): only the negative mode may come out empty
                assert mode == GenerationMode.NEGATIVE, route
                empty.append(route)
            print(f"fuzz {label}: {route} {mode.value}: {dict(statuses)}", flush=True)
    total: collections.Counter[str] = sum(routes.values(), collections.Counter())
    assert not failures, "\n\n".join(failures)
    assert total["5xx"] == 0
    return {"operations": len(operations), "cases": sum(total.values()), **dict(total), "no_negative_case": empty,
            "routes": {route: dict(counts) for route, counts in routes.items()}}


def calibrate_plan(url: str) -> None:
    """Enough steps timed for POST /v1/plan's step cost model (before, it answers 503
    `not_calibrated`: a documented state, not a fault, but a 5xx for the fuzz). Through the
    router, the replica that answers /v1/plan is the one that must have them."""
    def complete(n: int) -> None:
        # a prompt of its own (prompts sharing a prefix all go to one replica under
        # cache_aware routing, maybe not the one that answers /v1/plan: a run failed so),
        # of 2 to 181 tokens (the context is 256)
        httpx.post(url + COMPLETIONS, json={"prompt": f"{n} " + "a b c " * (1 + n % 60), "max_tokens": 12,
                                            "ignore_eos": True}, timeout=120)

    for attempt in range(10):
        if httpx.post(url + "/v1/plan", json={}, timeout=120).status_code != 503:
            return
        # a refit tells its terms apart only from varied steps: prompts of several
        # lengths, decoded in batches of several sizes
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(complete, [7 * attempt + 13 * i for i in range(8)]))
    raise AssertionError("POST /v1/plan stayed 503 after 80 varied requests")


def test_fuzz_every_route_from_the_openapi_schema(any_rserver, request):
    """Every route of the server's /openapi.json. /v1/embeddings answers 404 to every
    valid body on this (generate runner) server, so the long run fuzzes it again where it
    embeds: on the same server with `--runner pooling` (single, or behind the router)."""
    mode = request.node.callspec.params["any_rserver"]
    examples = fuzz_examples(request.config)
    schema = schemathesis.openapi.from_url(any_rserver.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize",
                                              "/detokenize", "/v1/models", "/health", "/metrics", "/v1/embeddings"}
    # TOKENMILL_FUZZ_ROUTES=/v1/responses,/v1/embeddings: a long run of some routes only
    only = [path for path in os.environ.get("TOKENMILL_FUZZ_ROUTES", "").split(",") if path]
    operations = [op for op in operations if not only or op.path.split("/{")[0] in only]
    calibrate_plan(any_rserver.url)
    results = fuzz(any_rserver.url, operations, examples or 12, mode)
    assert httpx.get(any_rserver.url + "/health", timeout=10).status_code == 200
    assert any_rserver.wait_idle(timeout=30)["tokenmill:num_requests_running"] == 0
    if examples is not None and (not only or "/v1/embeddings" in only):  # the long run: where they embed
        pooling = request.getfixturevalue("pooling_rserver" if mode == "single" else "dp_pooling_rserver")
        schema = schemathesis.openapi.from_url(pooling.url + "/openapi.json")
        embeddings = [result.ok() for result in schema.get_all_operations() if result.ok().path == "/v1/embeddings"]
        results["pooling"] = fuzz(pooling.url, embeddings, examples, mode + " pooling")
        assert results["pooling"].get("2xx", 0) > 0  # it embeds
        assert pooling.wait_idle(timeout=30)["tokenmill:num_requests_running"] == 0
    RESULTS["fuzz" if mode == "single" else "fuzz_router"] = results


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
STREAMS = [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "stream": True, "logprobs": 2, "echo": True, "n": 2,
                   "stream_options": {"include_usage": True}}),
    (CHAT, {"messages": HI, "max_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 2,
            "stream_options": {"include_usage": True}}),
    (CHAT, {"messages": HI, "max_tokens": 24, "stream": True, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), STREAMS, ids=["completions", "chat", "chat-tools", "responses"])
def test_a_stream_matches_the_events_its_route_declares(any_rserver, path, body):
    """Every event of a streamed 200 against the route's `text/event-stream` itemSchema
    (schemathesis's own check): the string schema declared before was true of no event
    (ST108), which the fuzz met only when it happened to send `stream: true` (and then
    read only the first 20 events)."""
    schema = schemathesis.openapi.from_url(any_rserver.url + "/openapi.json")
    schema.config.max_stream_events = 10_000  # the whole stream (schemathesis reads 20 events by default)
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call(base_url=any_rserver.url, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
    case.validate_response(response, checks=CHECKS)
    assert response.text.endswith("data: [DONE]\n\n") != path.endswith("responses")


def test_the_router_documents_the_routes_of_the_single_server(rserver, dp_rserver):
    """The router proxies /openapi.json to a replica; the replicas must serve what the
    single server does (they had no POST /v1/plan: the planner was not handed to them)."""
    def routes(server) -> set[tuple[str, str]]:
        document = httpx.get(server.url + "/openapi.json", timeout=30).json()
        return {(method.upper(), path) for path, item in document["paths"].items() for method in item}

    single = routes(rserver)
    assert ("POST", "/v1/plan") in single and ("POST", "/v1/responses") in single
    assert routes(dp_rserver) == single
HOSTILE: list[tuple[str, str, bytes, set[int]]] = [
    ("over the body limit", COMPLETIONS, json.dumps({"prompt": "x" * 70_000}).encode(), {413}),
    ("1 MB of JSON", CHAT, b'{"messages": [' + b'{"role": "user", "content": "a"},' * 40_000 + b"]}", {413}),
    ("deep nesting", COMPLETIONS, b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", {400}),
    ("deep nesting in a message", CHAT,
     b'{"messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 5_000 + b"]" * 5_000 + b"}]}", {200, 400}),
    ("NaN", COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', {400}),
    ("Infinity", COMPLETIONS, b'{"prompt": "a", "top_p": Infinity}', {400}),
    ("-Infinity logit bias", COMPLETIONS, b'{"prompt": "a", "logit_bias": {"5": -Infinity}}', {400}),
    ("invalid UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe\xfd"}', {400}),
    ("truncated UTF-8", CHAT, b'{"messages": [{"role": "user", "content": "\xe2\x82"}]}', {400}),
    ("lone high surrogate", COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 1}', {400}),
    ("lone low surrogate in a key", CHAT,
     b'{"messages": [{"role": "user", "content": "hi", "\\udc00": 1}], "max_tokens": 1}', {400}),
    ("NUL bytes", COMPLETIONS, b'{"prompt": "a\\u0000b\\u0000", "max_tokens": 2}', {200}),
    ("NUL in a role", CHAT, b'{"messages": [{"role": "us\\u0000er", "content": "hi"}], "max_tokens": 2}', {200, 400}),
    ("wrong types everywhere", COMPLETIONS,
     b'{"prompt": {"a": 1}, "max_tokens": "many", "n": [], "stream": 1, "stop": 5}', {400}),
    ("booleans as numbers", COMPLETIONS, b'{"prompt": "a", "max_tokens": true}', {400}),
    ("huge integers", COMPLETIONS, b'{"prompt": "a", "max_tokens": 1' + b"0" * 400 + b"}", {400}),
    ("huge seed", COMPLETIONS, b'{"prompt": "a", "seed": -1' + b"0" * 30 + b"}", {400}),
    ("float token ids", COMPLETIONS, b'{"prompt": [1.0, 2.5]}', {400}),
    ("unknown fields", COMPLETIONS, b'{"prompt": "a", "max_tokens": 2, "frobnicate": {"x": [1, 2]}, "user": "u"}',
     {200}),
    ("duplicate keys", COMPLETIONS, b'{"prompt": "a", "prompt": [1, 2], "max_tokens": 2}', {200}),
    ("empty object", CHAT, b"{}", {400}),
    ("null body", COMPLETIONS, b"null", {400}),
    ("a number", COMPLETIONS, b"12345", {400}),
    ("trailing garbage", COMPLETIONS, b'{"prompt": "a"} xyz', {400}),
    ("a thousand stop strings", COMPLETIONS,
     json.dumps({"prompt": "a", "stop": [f"s{i}" for i in range(1000)]}).encode(), {400}),
    ("a long stop string", COMPLETIONS, json.dumps({"prompt": "a", "stop": "y" * 5000}).encode(), {400}),
    ("many logit biases", CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                            "logit_bias": {str(i): 0 for i in range(2000)}}).encode(), {400}),
    ("thousands of prompts", COMPLETIONS, json.dumps({"prompt": ["a"] * 5000}).encode(), {400}),
    ("template injection", CHAT,
     b'{"messages": [{"role": "user", "content": "{{ cycler.__init__.__globals__.os.popen(\'id\').read() }}"}],'
     b' "max_tokens": 2}', {200}),
    ("hostile template kwargs", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": 1}}', {400}),
    ("request template", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% for i in range(99999999) %}{% endfor %}"}',
     {400}),
    ("image part", CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     {400}),
    ("tool message without content", CHAT, b'{"messages": [{"role": "tool"}], "max_tokens": 2}', {200, 400}),
    ("tokenize both", "/tokenize", b'{"prompt": "a", "messages": []}', {400}),
    ("detokenize huge id", "/detokenize", b'{"tokens": [99999999999999999999]}', {400}),
    ("detokenize negative id", "/detokenize", b'{"tokens": [-1]}', {400}),
]


@pytest.mark.parametrize(("path", "body", "expected"), [case[1:] for case in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_bodies(any_rserver, request, path, body, expected):
    rserver = any_rserver
    with socket.create_connection(("127.0.0.1", rserver.port), timeout=120) as sock:
        status, headers, payload = raw_exchange(sock, http_request("POST", path, body))
        assert status in expected, (status, payload[:300])
        if status >= 400:
            assert_openai_error(status, payload)
        else:
            assert "choices" in json.loads(payload) or path.startswith("/")
        if status != 413:  # a 413 closes the connection; anything else keeps it
            status, _, _ = raw_exchange(sock, http_request("GET", "/health"))
            assert status == 200
    key = "hostile_bodies" if request.node.callspec.params["any_rserver"] == "single" else "hostile_bodies_router"
    hostile = RESULTS.setdefault(key, {"cases": 0, "5xx": 0})
    hostile["cases"] += 1  # type: ignore[index]
