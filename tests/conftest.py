"""Shared fixtures: the default model loaded once per test session, and a default-model
`tokenmill serve` (with an official `openai` client for it) once per test module."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.server_utils import ServerProcess
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


@pytest.fixture(scope="module")
def server():
    """`tokenmill serve` with the default model and default flags, one per test module (a
    module that needs other flags defines its own `server`)."""
    process = ServerProcess().start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
