"""Bursts past the queue cap: every answer is 200 or 429 (with Retry-After), and every
accepted request completes with all its tokens."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

from tests.reliability.support import RESULTS, long_run


async def _one(client: httpx.AsyncClient, url: str, index: int) -> tuple[int, dict]:
    body = {"prompt": f"Request {index}: count slowly:", "max_tokens": 12, "ignore_eos": True,
            "stream": index % 2 == 0}
    if body["stream"]:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            text = (await response.aread()).decode()
            if response.status_code != 200:
                return response.status_code, {"json": json.loads(text), "headers": dict(response.headers)}
            return response.status_code, {"text": text, "headers": dict(response.headers)}
    response = await client.post(url + "/v1/completions", json=body)
    return response.status_code, {"json": response.json(), "headers": dict(response.headers)}


def test_bursts_get_200_or_429_and_accepted_requests_complete(rserver, request):
    bursts, size = (10, 80) if long_run(request.config) else (3, 60)
    statuses: collections.Counter[int] = collections.Counter()

    async def burst() -> list[tuple[int, dict]]:
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_one(client, rserver.url, i) for i in range(size)))

    for _ in range(bursts):
        for status, result in asyncio.run(burst()):
            statuses[status] += 1
            assert status in (200, 429), (status, result)
            if status == 429:
                assert result["headers"]["retry-after"].isdigit()
                assert result["json"]["error"]["code"] == "queue_full"
            elif "json" in result:
                assert result["json"]["usage"]["completion_tokens"] == 12
                assert result["json"]["choices"][0]["finish_reason"] == "length"
            else:
                assert result["text"].endswith("data: [DONE]\n\n")
                assert result["text"].count('"finish_reason":"length"') == 1
    assert statuses[429] > 0 and statuses[200] > 0, statuses  # the cap was reached, and work was done
    idle = rserver.wait_idle(timeout=10)
    assert (idle["tokenmill:num_requests_running"], idle["tokenmill:num_requests_waiting"]) == (0, 0)
    RESULTS["overload"] = {"requests": sum(statuses.values()), "ok": statuses[200], "429": statuses[429],
                           "other": sum(v for k, v in statuses.items() if k not in (200, 429))}


def test_a_request_that_can_never_fit_the_queue_is_400_not_429(rserver):
    """n alone over --max-queued-requests (32 here): a 429 told the client to retry a
    request that can never be admitted, forever (issue 31)."""
    response = rserver.post("/v1/completions", json={"prompt": "hi", "n": 33, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert "can never be admitted" in response.json()["error"]["message"]
    assert "retry-after" not in response.headers
    ok = rserver.post("/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 2})
    assert ok.status_code == 200
