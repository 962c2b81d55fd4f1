"""Shared fixtures: the default model loaded once per test session."""

from __future__ import annotations

import pytest

from tokenmill.llm import LLM


@pytest.fixture(scope="session")
def llm_f32() -> LLM:
    """The default model in float32 (the dtype in which exact equalities hold).

    Prefix caching is off here because tests build `sibling` engines on the same KV
    tensors: a block this engine kept cached-and-free could be overwritten by them.
    Tests of caching use a fresh caching sibling instead."""
    return LLM(dtype="float32", max_model_len=2048, kv_cache_memory="512MiB", seed=0, enable_prefix_caching=False)


def sibling(llm: LLM, num_blocks: int | None = None, **overrides) -> LLM:
    """An LLM sharing `llm`'s loaded model and KV tensors, with other engine settings.

    Engines sharing KV tensors must be used one at a time, and only one of them may
    keep a prefix cache alive across uses (see llm_f32)."""
    return LLM.from_engine(llm.engine.sibling(num_blocks, **overrides))


def assert_engine_idle(llm: LLM) -> None:
    """No request left and every block free (cached-and-free counts as free)."""
    kv = llm.engine.scheduler.kv
    kv.check_integrity()
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.req_blocks
