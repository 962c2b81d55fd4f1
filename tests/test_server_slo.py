"""Per-request SLO targets and early rejection (`--slo-reject`) end to end, with the
official openai client: `slo_ttft_ms` / `slo_tpot_ms` through `extra_body`, or llm-d's
`x-slo-ttft-ms` header; a target predicted missed is a 429 (openai.RateLimitError) with
Retry-After, in OpenAI's error format.

One server under the priority policy with a single sequence slot: a long low-priority
stream holds it; a high-priority request with a target is still admitted (it preempts
the stream), a low-priority one with the same target is refused at once.
"""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.server_utils import ServerProcess


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--scheduling-policy", "priority", "--max-num-seqs", "1", "--slo-reject").start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    # Some steps with prefill and decode tokens: the engine learns what a step costs.
    client.completions.create(model=server.model, prompt="Warm up.", max_tokens=12, extra_body={"ignore_eos": True})
    return client


def test_an_unattainable_ttft_target_is_refused_at_once_with_429(server, client):
    with pytest.raises(openai.RateLimitError) as info:  # no step takes under a millisecond
        client.completions.create(model=server.model, prompt="Hello", max_tokens=2, extra_body={"slo_ttft_ms": 1})
    error = info.value
    assert error.status_code == 429 and error.code == "slo_unattainable" and error.param == "slo_ttft_ms"
    assert "time-to-first-token target of 1 ms" in error.message
    assert int(error.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):  # llm-d's header, on chat
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, extra_headers={"x-slo-ttft-ms": "1"})
    # Targets it can meet (the body's field wins over the header), or none: served.
    ok = client.completions.create(model=server.model, prompt="Hello", max_tokens=2,
                                   extra_body={"slo_ttft_ms": 60000, "slo_tpot_ms": 60000, "ignore_eos": True},
                                   extra_headers={"x-slo-ttft-ms": "1"})
    assert ok.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=server.model, prompt="Hello", max_tokens=2, extra_body={"slo_tpot_ms": -5})
    assert bad.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=server.model, prompt="Hello", max_tokens=2,
                                  extra_headers={"x-slo-ttft-ms": "soon"})
    assert bad.value.body["param"] == "slo_ttft_ms"
    server.wait_idle()


def test_under_load_a_better_priority_meets_a_target_a_worse_one_is_refused(server, client):
    """The stream (priority 10, 400 tokens) holds the only slot for seconds. A request
    ranked behind it would wait for all of it: refused, with a Retry-After of seconds.
    A priority -1 request preempts it, so the same 5 s target is predicted met."""
    stream = client.completions.create(model=server.model, prompt="Write a long story about a lighthouse.",
                                       max_tokens=400, stream=True, extra_body={"ignore_eos": True, "priority": 10})
    try:
        pieces = iter(stream)
        for _ in range(3):
            next(pieces)  # it runs, and the engine has timed decode steps of it
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=server.model, prompt="Hello", max_tokens=2,
                                      extra_body={"priority": 10, "slo_ttft_ms": 5000})
        assert int(info.value.response.headers["retry-after"]) >= 2
        vip = client.completions.create(model=server.model, prompt="Hello", max_tokens=2,
                                        extra_body={"priority": -1, "slo_ttft_ms": 5000, "ignore_eos": True})
        assert vip.usage.completion_tokens == 2
    finally:
        stream.close()  # aborts the rest of the stream
    server.wait_idle()


def test_plan_predicts_a_proposed_config_with_the_servers_own_step_costs(server, client):
    """POST /v1/plan (tokenmill's what-if): after some traffic the server refits its step
    cost model from its own steps and simulates a proposed config and load with it."""
    for i in range(4):  # prefill and decode steps of several shapes
        client.completions.create(model=server.model, prompt="Count: " + "one two " * (3 + 10 * i), max_tokens=8,
                                  extra_body={"ignore_eos": True})
    body = {"settings": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "scheduling_policy": "fcfs",
                         "slo_ttft_ms": 2000},
            "load": {"request_rate": 0.5, "num_prompts": 20, "input_len": 32, "output_len": 8},
            "goodput": {"ttft": 2000, "tpot": 500}}
    response = server.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    plan = response.json()
    assert plan["object"] == "plan" and plan["settings"]["max_num_seqs"] == 8
    assert plan["settings"]["slo_ttft_ms"] == 2000 and plan["settings"]["scheduling_policy"] == "fcfs"
    model = plan["step_cost_model"]
    assert model["steps"] >= 32 and model["source"] in ("refit", "scaled calibration")
    predicted = plan["predicted"]
    assert predicted["completed"] == 20 and 0 <= predicted["goodput_fraction"] <= 1
    assert 0 < predicted["median_ttft_ms"] <= predicted["p99_ttft_ms"]
    assert predicted["mean_tpot_ms"] > 0
    heavier = server.post("/v1/plan", json={**body, "load": {**body["load"], "request_rate": 50}}).json()
    assert heavier["predicted"]["p99_ttft_ms"] > predicted["p99_ttft_ms"]
    bad = server.post("/v1/plan", json={"settings": {"model": "other"}})
    assert bad.status_code == 400
    assert "cannot be changed by a what-if" in bad.json()["error"]["message"]
    assert server.post("/v1/plan", content=b"not json").status_code == 400
