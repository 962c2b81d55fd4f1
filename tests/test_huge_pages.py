"""Weights and KV cache on 2 MiB pages (kernels/huge_pages.py): the kernel really backs them
with huge pages where transparent huge pages are on, and nothing an engine computes changes."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache
from tokenmill.kernels import huge_pages
from tokenmill.llm import LLM
from tokenmill import SamplingParams


def anon_huge_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding `tensor`'s first byte (/proc/self/smaps)."""
    address = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_tensor_gets_huge_pages_when_the_kernel_offers_them() -> None:
    mode = huge_pages.thp_mode()
    tensor = huge_pages.empty((3, 1 << 22), torch.float32)  # 48 MiB
    assert tensor.shape == (3, 1 << 22) and tensor.dtype == torch.float32 and not tensor.any()  # zeros
    tensor.fill_(1.5)
    assert float(tensor.sum()) == 1.5 * 3 * (1 << 22)
    if mode in ("always", "madvise"):
        assert huge_pages.available() and tensor.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
        assert anon_huge_bytes(tensor) >= 32 << 20, f"THP is {mode}, yet the 48 MiB tensor got few huge pages"
    else:  # the kernel gives none: a plain allocation
        assert not huge_pages.available()


def test_the_arena_places_copies_on_aligned_boundaries_and_refuses_overflow() -> None:
    tensors = [torch.randn(37, 5), torch.arange(1000, dtype=torch.int64), torch.randint(0, 255, (3, 333), dtype=torch.uint8),
               torch.randn(7).bfloat16()]
    arena = huge_pages.HugePageArena(huge_pages.HugePageArena.measure(tensors))
    assert arena.buffer.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    placed = [arena.place(t) for t in tensors]
    for original, copy in zip(tensors, placed):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.data_ptr() % 64 == 0 and copy.is_contiguous()
    assert arena.used == arena.nbytes
    with pytest.raises(ValueError, match="arena holds"):
        arena.place(torch.zeros(1))


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Rss of the mappings holding the tensors' first bytes, each mapping once (/proc/self/smaps)."""
    addresses = [t.data_ptr() for t in tensors]
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = any(start <= a < end for a in addresses)
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("dtype, packed", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.int8, False)])
def test_a_small_kv_cache_on_huge_pages_takes_its_budget_not_a_huge_page_per_tensor(dtype, packed) -> None:
    """The default model's 30 layers at a 16 MiB budget: 60 K/V tensors (and 60 scale tensors
    in int8) of ~270 KiB, each on 2 MiB pages of its own, were 120 MiB resident; in one arena
    they take their bytes, on huge pages, and read and write as zeros-initialised tensors."""
    spec = KVCacheSpec(30, 3, 64, 16, dtype, packed=packed)
    num_blocks = (16 << 20) // spec.bytes_per_block
    cache = PagedKVCache(spec, num_blocks, torch.device("cpu"), huge_pages=True)
    tensors = [t for layer in cache for t in (layer.k, layer.v, *(layer.scales or ()))]
    assert all(not t.any() for t in tensors)
    for i, t in enumerate(tensors):
        t.view(-1)[::97] = i % 5 + 1  # written through, each its own bytes
    assert all(bool((t.view(-1)[::97] == i % 5 + 1).all()) for i, t in enumerate(tensors))
    stored = sum(t.numel() * t.element_size() for t in tensors)
    if huge_pages.available():
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one arena
        assert anon_huge_bytes(tensors[0]) > 0
        assert resident_bytes(tensors) <= stored + 2 * huge_pages.HUGE_PAGE_BYTES, \
            f"{resident_bytes(tensors) >> 20} MiB resident for {stored >> 20} MiB of KV"


def test_the_default_model_on_huge_pages_computes_what_it_does_on_small_pages(monkeypatch) -> None:
    """The same greedy tokens and logprobs bit for bit, prompt and batched decode, with the
    weights' arena and the KV cache really on huge pages (when the kernel offers them)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    results = {}
    for on in (True, False):
        monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "1" if on else "0")
        llm = LLM(max_model_len=512, kv_cache_memory="64MiB", seed=0)
        assert llm.engine.config.device.huge_pages is on
        described = "2 MiB pages" in llm.engine.facts.execution_plan
        assert described is on
        outputs = llm.generate(prompts, params)
        results[on] = [(o.outputs[0].token_ids, [sorted(step.items()) for step in o.outputs[0].logprobs])
                       for o in outputs]
        if on and huge_pages.available():
            runner = llm.engine.executor
            assert anon_huge_bytes(runner.kv_cache[0].k) > 0
            streamed = runner.model.layers[0].mlp.gate_up_proj.weights.qt.packed
            assert anon_huge_bytes(streamed) > 0  # the arena holding the layers' Q4_1 streams
        del llm
    assert results[True] == results[False]
