"""The hybrid KV cache: sliding-window layers keep only the blocks inside their window,
in a pool of their own, and prefix caching still hits across the turns of a conversation
(issue 26). Engine-level tests on a tiny random Gemma 3 (window 16, blocks of 4 tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.engine.block_manager import NULL_BLOCK, HybridKVBlockManager
from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams
from tests.tiny_checkpoint import write_tiny_gemma3

WINDOW, BLOCK = 16, 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), window=WINDOW)


def _llm(checkpoint: Path, **settings) -> LLM:
    return LLM(model=str(checkpoint), dtype="float32", block_size=BLOCK, max_model_len=512,
               kv_cache_memory=4 * 2**20, max_num_seqs=4, max_num_batched_tokens=64, **settings)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_second_turn_prefills_only_the_new_tokens(checkpoint: Path) -> None:
    """Turn 1: 70 tokens (4x the window) and 12 generated. Turn 2 resends all of it plus
    9 new tokens: the prefix cache covers every full block of turn 1, although the
    sliding pool let go of all but the last window's blocks; the outputs equal an engine
    without prefix caching (and with every block kept)."""
    llm = _llm(checkpoint)
    kv = llm.engine.scheduler.kv
    assert isinstance(kv, HybridKVBlockManager) and kv.sliding.window == WINDOW
    turn1 = _prompt(70, 1)
    out1 = llm.generate([turn1], GREEDY)[0]
    history = turn1 + out1.outputs[0].token_ids
    turn2 = history + _prompt(9, 2)
    out2 = llm.generate([turn2], GREEDY)[0]
    expected_hit = (len(history) - 1) // BLOCK * BLOCK  # full blocks of turn 1 (its last token had no KV)
    assert out2.num_cached_tokens == expected_hit
    assert len(turn2) - out2.num_cached_tokens <= 9 + BLOCK  # only the new tokens (and a partial block) prefilled
    plain = _llm(checkpoint, enable_prefix_caching=False, disable_hybrid_kv_cache_manager=True)
    assert not isinstance(plain.engine.scheduler.kv, HybridKVBlockManager)
    assert plain.generate([turn2], GREEDY)[0].outputs[0].token_ids == out2.outputs[0].token_ids
    kv.check_integrity()
    assert kv.full.num_free_blocks == kv.full.num_usable_blocks  # nothing leaked
    assert kv.sliding.num_free_blocks == kv.sliding.num_usable_blocks


def test_sliding_pool_holds_only_the_window(checkpoint: Path) -> None:
    """While a long request decodes, its sliding table holds blocks only inside the window
    (NULL before it); the full table holds every block."""
    llm = _llm(checkpoint, enable_prefix_caching=False)
    engine, kv = llm.engine, llm.engine.scheduler.kv
    engine.add_request("long", _prompt(100, 3), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        sliding = kv.get_sliding_block_ids("long")
        if sliding:
            held = [b for b in sliding if b != NULL_BLOCK]
            assert len(held) <= -(-(WINDOW - 1) // BLOCK) + 1 + -(-64 // BLOCK)  # window + one step's chunk
            assert len(kv.get_block_ids("long")) == len(sliding)
            seen = max(seen, len(sliding))
        kv.check_integrity()
    assert seen >= 100 // BLOCK  # the table spans the whole context; most of it NULL


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_hybrid_equals_every_block_kept_across_requests(checkpoint: Path, policy: str) -> None:
    """Concurrent requests sharing a prefix, chunked prefill past the window: the same
    tokens with the hybrid cache as with every block kept (both scheduling policies:
    priority admission counts a hit's blocks too)."""
    llm = _llm(checkpoint, scheduling_policy=policy)
    shared = _prompt(40, 4)
    prompts = [shared + _prompt(n, 5 + n) for n in (3, 30, 50)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]  # now with prefix hits
    plain = _llm(checkpoint, enable_prefix_caching=False, disable_hybrid_kv_cache_manager=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    assert got == expected and again == expected


def test_served_conversation_hits_across_turns(checkpoint: Path) -> None:
    """`tokenmill serve` on the tiny Gemma 3, driven by the openai client: the second turn
    of a chat (history at 4x the window) computes only its new prompt tokens, by the
    server's own Prometheus counters."""
    from openai import OpenAI
    from server_utils import ServerProcess

    server = ServerProcess("--model", str(checkpoint), "--block-size", str(BLOCK)).start()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        words = " ".join(f"w{t}" for t in _prompt(70, 6))
        messages = [{"role": "user", "content": words}]
        first = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "w5 w6 w7 w8 w9"}]
        before = server.wait_idle()
        second = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
        after = server.wait_idle()
        computed = after["tokenmill:prompt_tokens_computed_total"] - before["tokenmill:prompt_tokens_computed_total"]
        hits = after["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
        assert second.usage.prompt_tokens > 4 * WINDOW
        assert hits >= first.usage.prompt_tokens + first.usage.completion_tokens - 2 * BLOCK
        assert computed == second.usage.prompt_tokens - hits and computed <= 5 + 2 * BLOCK
    except Exception:
        print(server.log_tail())
        raise
    finally:
        server.stop()


def test_a_host_tier_turns_the_hybrid_manager_off_and_serves_a_returning_prefix(checkpoint: Path, caplog) -> None:
    """--kv-offloading-size on a model with sliding-window layers: the engine starts (as vLLM's
    does with a KV connector, the hybrid manager steps aside, saying so), and a prefix pushed
    out of a small pool comes back from the host tier with the tokens of an engine without
    any cache."""
    import logging

    with caplog.at_level(logging.INFO, logger="tokenmill.runner.worker"):
        llm = LLM(model=str(checkpoint), dtype="float32", block_size=BLOCK, max_model_len=512, kv_cache_memory=2**20,
                  max_num_seqs=4, max_num_batched_tokens=64, kv_offloading_size=0.01)
    assert "hybrid KV cache manager off" in caplog.text and "--kv-offloading-size" in caplog.text
    kv = llm.engine.scheduler.kv
    assert not isinstance(kv, HybridKVBlockManager) and kv.host_tier is not None
    returning = _prompt(70, 5)
    llm.generate([returning], GREEDY)
    pool_tokens = llm.engine.facts.num_blocks * BLOCK
    for seed in range(6, 6 + pool_tokens // 400 + 2):  # other prompts fill the pool: the first one's blocks go to the tier
        llm.generate([_prompt(400, seed)], GREEDY)
    out = llm.generate([returning], GREEDY)[0]
    assert out.num_cached_tokens == (70 - 1) // BLOCK * BLOCK and kv.host_tier.stats.hit_tokens > 0
    plain = _llm(checkpoint, enable_prefix_caching=False)
    assert plain.generate([returning], GREEDY)[0].outputs[0].token_ids == out.outputs[0].token_ids
