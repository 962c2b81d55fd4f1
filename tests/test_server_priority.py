"""`tokenmill serve --scheduling-policy priority` end to end, with the official openai
client sending vLLM's `priority` field through `extra_body`.

One server with a single sequence slot: a long low-priority stream holds it when a
high-priority request arrives, which takes the slot (the stream is preempted, and
resumes afterwards). Under fcfs the late request would wait for the whole stream. With
--priority-interrupt the arrival does not even wait for the step in flight.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server_utils import ServerProcess

PREEMPTIONS = "tokenmill:num_preemptions_total"
INTERRUPTS = "tokenmill:num_interrupted_steps_total"


@pytest.fixture(scope="module")
def server():
    # A step bound so loose (100x the better priority's TTFT) that it never chunks a prompt
    # here: the interrupt needs it on, and the cut prompt's answer is compared with its
    # answer alone, computed in one step too.
    process = ServerProcess("--scheduling-policy", "priority", "--max-num-seqs", "1", "--priority-step-fraction", "100",
                            "--priority-interrupt").start()
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


def test_a_high_priority_arrival_cuts_the_low_priority_step_in_flight(server):
    """A ~800-token low-priority prompt is one long prefill step (float32, one thread).
    A high-priority request sent a quarter into that step cuts it between two layers, takes
    the only slot and finishes before the low-priority request's first token; the cut
    prefill is computed again afterwards and its greedy answer is the one it gives alone
    (each with its own cache_salt, so neither is served from the other's prefix cache)."""
    prompt = "The lighthouse keeper counted the waves: " + " ".join(str(i) for i in range(300, 500))
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for salt in ("warm-up", "alone"):  # (the first prefill this long takes longer: timed the second)
        started = time.monotonic()
        alone = client.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0,
                                          extra_body={"priority": 5, "cache_salt": salt})
        prefill_s = time.monotonic() - started
    alone = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"priority": 5, "cache_salt": "alone-8"})
    assert 600 < alone.usage.prompt_tokens < 1000
    before = server.wait_idle()

    async def race(salt: str) -> tuple[float, float, str]:
        async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as aclient:
            async def low() -> tuple[float, str]:
                stream = await aclient.completions.create(
                    model=server.model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                    extra_body={"priority": 5, "cache_salt": salt})
                first, text = None, ""
                async for chunk in stream:
                    first = first or time.monotonic()
                    text += chunk.choices[0].text if chunk.choices else ""
                return first, text

            low_task = asyncio.create_task(low())
            await asyncio.sleep(prefill_s / 4)  # the low-priority prefill step is running
            await aclient.completions.create(model=server.model, prompt="Say hi.", max_tokens=4,
                                             extra_body={"priority": -1, "ignore_eos": True})
            high_done = time.monotonic()
            low_first, low_text = await low_task
            return high_done, low_first, low_text

    # On a shared machine the low-priority step may not have started a quarter of a prefill in
    # (or may have ended): the race is run again, up to three times, until an arrival cuts it.
    for attempt in range(3):
        high_done, low_first, low_text = asyncio.run(race(f"race-{attempt}"))
        after = server.wait_idle()
        assert low_text == alone.choices[0].text  # cut or not, the low-priority answer is its own
        if after[INTERRUPTS] - before.get(INTERRUPTS, 0) >= 1:
            break
        before = after
    assert after[INTERRUPTS] - before.get(INTERRUPTS, 0) >= 1, "no race of three cut the low-priority step"
    assert high_done < low_first, "the high-priority request waited for the low-priority step in flight"
