"""Concurrent requests that need three times the KV cache all complete, through
preemption and recomputation, and each greedy output equals the same request run
alone (float32: exact). On a server of its own with a 16 MiB KV cache (about 350
tokens in float32)."""

from __future__ import annotations

import asyncio

import httpx

import pytest

from tests.reliability.support import RESULTS, start_server


@pytest.fixture(scope="module")
def small_kv_server():
    process = start_server("--kv-cache-memory", "16MiB")
    yield process
    assert process.stop() == 0, process.log_tail()


def test_requests_needing_3x_the_kv_cache_complete_exactly(small_kv_server):
    rserver = small_kv_server
    capacity_tokens = 16 * 2**20 // (30 * 2 * 3 * 64 * 4)  # layers x (K, V) x KV heads x head dim x float32
    max_tokens = 24
    prompts = [f"Story {i}: " + "the old lighthouse keeper watched the sea " * (22 + i % 3) for i in range(6)]
    needed = sum(len(rserver.post("/tokenize", json={"prompt": p}).json()["tokens"]) + max_tokens for p in prompts)
    assert needed >= 3 * capacity_tokens * 0.9, (needed, capacity_tokens)
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    alone = [rserver.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"] for p in prompts]
    before = rserver.metrics()["tokenmill:num_preemptions_total"]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=600) as client:
            responses = await asyncio.gather(*(client.post(rserver.url + "/v1/completions", json={**body, "prompt": p})
                                               for p in prompts))
        return [r.json()["choices"][0]["text"] for r in responses]

    concurrent = asyncio.run(together())
    preemptions = rserver.metrics()["tokenmill:num_preemptions_total"] - before
    assert preemptions > 0  # the cache really ran out
    assert concurrent == alone
    assert rserver.wait_idle()["tokenmill:kv_cache_usage_perc"] == 0
    RESULTS["kv_exhaustion"] = {"requests": len(prompts), "kv_tokens_needed": needed,
                                "kv_capacity_tokens": capacity_tokens, "preemptions": preemptions,
                                "outputs_equal_alone": True}
