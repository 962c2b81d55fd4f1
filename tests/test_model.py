"""The model against Hugging Face transformers, and the paged path against the dense one."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM as HFLlama, Qwen2Config, Qwen2ForCausalLM as HFQwen2

from tokenmill import kernels
from tokenmill.attention.backend import BatchLayout, ForwardContext, StepKind, forward_context
from tokenmill.attention.kv_cache import LayerKVCache
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model_arch import ModelArchConfig

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, max_position_embeddings=256, rms_norm_eps=1e-5)


def _hf_llama(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**TINY, **overrides})
    model = HFLlama(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a mis-loaded norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _ours_from(hf: torch.nn.Module) -> LlamaForCausalLM:
    arch = ModelArchConfig.from_hf_config(hf.config.to_dict())
    ours = LlamaForCausalLM(arch).eval()
    ours.load_weights(hf.state_dict().items())
    return ours


CASES = {
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mha-untied": dict(num_key_value_heads=8, tie_word_embeddings=False),
    "llama3-rope-scaling": dict(
        num_key_value_heads=4,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
}


@pytest.mark.parametrize("case", CASES)
@torch.inference_mode()
def test_logits_match_transformers(case: str) -> None:
    hf = _hf_llama(**CASES[case])
    ours = _ours_from(hf)
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    expected = hf(ids.unsqueeze(0)).logits[0]
    got = ours.compute_logits(ours(ids, torch.arange(40)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_qwen2_with_qkv_bias_matches_transformers() -> None:
    torch.manual_seed(0)
    cfg = Qwen2Config(**{**TINY, "num_key_value_heads": 2, "tie_word_embeddings": False})
    hf = HFQwen2(cfg).eval()
    ours = _ours_from(hf)
    assert ours.cfg.attention_bias
    ids = torch.randint(0, TINY["vocab_size"], (30,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        ours.compute_logits(ours(ids, torch.arange(30))), hf(ids.unsqueeze(0)).logits[0], atol=1e-4, rtol=1e-4
    )


def test_missing_weight_is_named() -> None:
    hf = _hf_llama(num_key_value_heads=2)
    ours = LlamaForCausalLM(ModelArchConfig.from_hf_config(hf.config.to_dict()))
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj"):
        ours.load_weights(state.items())


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        ModelArchConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


# ----- paged attention against dense ---------------------------------------------------


def _backend(name: str):
    if name == "torch_sdpa":
        return TorchSDPABackend()
    from tokenmill.kernels import cpu_kernels_available

    if not cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")
    from tokenmill.attention.cpu_native import CPUNativeBackend

    return CPUNativeBackend()


def _paged_logits(
    model: LlamaForCausalLM, seqs: list[list[int]], chunks: list[list[int]], backend_name: str, block_size: int = 4,
    kv_dtype: torch.dtype = torch.float32, plan=None, rotation: int = 0, caches: list[LayerKVCache] | None = None,
):
    """Run `seqs` through the paged backend in several steps, the i-th step computing
    chunks[i][r] tokens of sequence r, with shuffled block ids; returns per-sequence
    logits of every position. Pure decode steps run the fused decode layer where `plan`
    (the model's execution plan) says so, as the runner decides it. `caches` (optional)
    receives the layers' caches, to look at what was written."""
    cfg = model.cfg
    num_blocks = sum(-(-len(s) // block_size) for s in seqs) + 3
    layers = [LayerKVCache.allocate(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, rotation=rotation)
              for _ in range(cfg.num_layers)]
    if caches is not None:
        caches.extend(layers)
    caches = layers
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [[free.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    backend = _backend(backend_name)
    for step in chunks:
        active = [r for r, n in enumerate(step) if n]
        ids, pos, slots = [], [], []
        for r in active:
            for p in range(done[r], done[r] + step[r]):
                ids.append(seqs[r][p])
                pos.append(p)
                slots.append(tables[r][p // block_size] * block_size + p % block_size)
        layout = BatchLayout(
            query_lens=[step[r] for r in active],
            context_lens=[done[r] + step[r] for r in active],
            block_tables=[tables[r] for r in active],
            slot_mapping=slots,
            block_size=block_size,
        )
        cpu = torch.device("cpu")
        kind = StepKind.PER_OP if plan is None else plan.step_kind(len(active), layout.all_decode)
        ctx = ForwardContext.for_step(kind, backend, layout, caches, cpu)
        with forward_context(ctx):
            out = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos)))
        row = 0
        for r in active:
            logits[r].append(out[row : row + step[r]])
            row += step[r]
            done[r] += step[r]
    return [torch.cat(parts) for parts in logits]


@pytest.mark.parametrize(
    "backend_name,prepared",
    [("torch_sdpa", False), ("cpu_native", False), ("cpu_native", True)],
    ids=["torch_sdpa", "cpu_native", "cpu_native-prepared"],
)
@pytest.mark.parametrize(
    "chunks",
    [
        [[5, 7, 8], [6, 0, 8], [1, 0, 3], [1, 0, 1]],
        # decode, prefill chunk, decode in one step: decode rows not contiguous
        [[5, 3, 8], [1, 3, 1], [1, 1, 8], [1, 0, 3]],
        # all-decode steps: with prepared weights, the fused native decode layer
        [[5, 4, 8], [1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 0, 0]],
    ],
    ids=["decodes-contiguous", "decodes-split", "all-decode-steps"],
)
@torch.inference_mode()
def test_paged_chunked_batched_attention_equals_dense(
    backend_name: str, prepared: bool, chunks: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prepared`: the CPU execution plan (runner.plan.cpu_native_plan): the skinny and
    oneDNN linears, and for all-decode steps the fused decode layer."""
    model = _ours_from(_hf_llama(num_key_value_heads=2))
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (13, 7, 20)]
    dense = [model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq)))) for seq in seqs]
    plan = None
    if prepared:
        from tokenmill.runner.plan import apply_plan, cpu_native_plan

        plan = apply_plan(model, cpu_native_plan(torch.float32))
        assert plan.fused_decode and model.fused_layers is not None
    fused_calls = []
    original = kernels.llama_decode_layer
    monkeypatch.setattr(kernels, "llama_decode_layer", lambda *a, **k: fused_calls.append(1) or original(*a, **k))
    # Step 1: prefill chunks; then mixed chunks and single-token decodes.
    paged = _paged_logits(model, seqs, chunks, backend_name, plan=plan)
    all_decode_steps = sum(all(n in (0, 1) for n in step) for step in chunks)
    assert len(fused_calls) == (all_decode_steps * model.cfg.num_layers if prepared else 0)
    for expected, got in zip(dense, paged):
        torch.testing.assert_close(got, expected[: got.shape[0]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "backend_name,prepared",
    [("torch_sdpa", False), ("cpu_native", False), ("cpu_native", True)],
    ids=["torch_sdpa", "cpu_native", "cpu_native-prepared"],
)
@torch.inference_mode()
def test_bfloat16_kv_cache_with_float32_compute(backend_name: str, prepared: bool) -> None:
    """A bf16 cache under float32 activations (--dtype bfloat16 on a CPU without bf16
    arithmetic): every path rounds K/V the same way, so they agree closely with each
    other, and with the float32 cache up to bf16 rounding."""
    model = _ours_from(_hf_llama(num_key_value_heads=2))
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (13, 7, 20)]
    chunks = [[5, 4, 8], [1, 1, 1], [6, 1, 8], [1, 1, 3]]
    reference = _paged_logits(model, seqs, chunks, "torch_sdpa", kv_dtype=torch.bfloat16)
    exact = _paged_logits(model, seqs, chunks, "torch_sdpa")
    plan = None
    if prepared:
        from tokenmill.runner.plan import apply_plan, cpu_native_plan

        plan = apply_plan(model, cpu_native_plan(torch.float32))
    got = _paged_logits(model, seqs, chunks, backend_name, kv_dtype=torch.bfloat16, plan=plan)
    for g, r, e in zip(got, reference, exact):
        # The paths' float32 sums differ in order (the skinny kernel and oneDNN vs F.linear):
        # up to 2.9e-5 on an AMD EPYC (AVX-512), far below the bf16 rounding checked next.
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)
        assert not torch.equal(g, e)  # the rounding is real


def test_explicit_rope_factors_equal_llama3_scaling() -> None:
    """GGUF stores Llama 3.1 scaling as divisors; they must reproduce the llama3 formula."""
    from tokenmill.model.layers import rope_inv_freq

    scaling = CASES["llama3-rope-scaling"]["rope_scaling"]
    plain = rope_inv_freq(64, 500000.0, None).double()
    scaled = rope_inv_freq(64, 500000.0, scaling).double()
    factors = (plain / scaled).tolist()
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, {"rope_type": "factors", "factors": factors}), scaled.float())


def test_sliding_window_is_recorded_unless_disabled() -> None:
    base = {"architectures": ["MistralForCausalLM"], **TINY}
    assert ModelArchConfig.from_hf_config({**base, "sliding_window": 4096}).sliding_window == 4096
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": False}
    assert ModelArchConfig.from_hf_config(qwen).sliding_window is None
