"""`tokenmill serve --scheduling-policy priority` end to end, with the official openai
client sending vLLM's `priority` field through `extra_body`.

One server with a single sequence slot: a long low-priority stream holds it when a
high-priority request arrives, which takes the slot (the stream is preempted, and
resumes afterwards). Under fcfs the late request would wait for the whole stream.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server_utils import ServerProcess

PREEMPTIONS = "tokenmill:num_preemptions_total"


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--scheduling-policy", "priority", "--max-num-seqs", "1").start()
    yield process
    assert process.stop() == 0, process.log_tail()


def test_a_high_priority_request_overtakes_a_running_low_priority_stream(server):
    before = server.wait_idle()
    low_tokens = 160

    async def run() -> tuple[float, float, int, str, str]:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            stream = await client.completions.create(
                model=server.model, prompt="Write a long story about a lighthouse.", max_tokens=low_tokens,
                stream=True, extra_body={"ignore_eos": True, "priority": 10})
            pieces = stream.__aiter__()
            await pieces.__anext__()  # the low-priority request is running: it holds the only slot

            async def drain_low() -> tuple[float, int]:
                count = 1
                async for _ in pieces:
                    count += 1
                return time.monotonic(), count

            low = asyncio.create_task(drain_low())
            high = await client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4,
                extra_body={"ignore_eos": True, "priority": -1})
            high_done = time.monotonic()
            low_done, low_chunks = await low
            return high_done, low_done, low_chunks, high.choices[0].finish_reason, high.choices[0].message.content

    high_done, low_done, low_chunks, high_finish, high_text = asyncio.run(run())
    assert high_finish == "length" and high_text
    assert high_done < low_done, "the high-priority request waited for the low-priority stream"
    assert low_chunks >= 1
    after = server.wait_idle()
    assert after[PREEMPTIONS] - before.get(PREEMPTIONS, 0) == 1  # the stream gave up its slot once
    # The preempted stream still delivered every token (recomputed, not lost).
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == low_tokens + 4


def test_priority_zero_and_equal_priorities_are_served(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for priority in (0, 3, -3):
        response = client.completions.create(model=server.model, prompt="Hello", max_tokens=2,
                                             extra_body={"priority": priority, "ignore_eos": True})
        assert response.usage.completion_tokens == 2
