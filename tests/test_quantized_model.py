"""Quantized weights behind the weight-format seam, in whole models: GGUF blocks served as
stored, int8/int4 computed at load; each against the same model on its dequantized
weights, the fused decode layer against the per-op path, and the errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill import kernels
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model_arch import ModelArchConfig
from tokenmill.quantization import QuantizedTensor
from tokenmill.quantization.formats import QuantizedWeights
from tokenmill.quantization.gguf_blocks import from_gguf_blocks
from tokenmill.runner.plan import apply_plan, cpu_native_plan, quantized_plan

CFG = ModelArchConfig(
    architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=128, tie_word_embeddings=True,
)


@pytest.fixture(scope="module", autouse=True)
def native() -> None:
    if not kernels.cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")


def checkpoint(cfg: ModelArchConfig, gguf_type: str | None, seed: int = 0) -> list[tuple[str, object]]:
    """A random tiny checkpoint under Hugging Face names; linear weights (and the tied
    embedding) as GGUF blocks of `gguf_type` when given, converted exactly."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out = []
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for name, param in model.named_parameters():
        p = param.detach().clone() * (0.5 if param.dim() == 2 else 1.0)
        parts = [(name, p)]
        if "qkv_proj" in name:
            parts = [(name.replace("qkv_proj", n), t) for n, t in zip(("q_proj", "k_proj", "v_proj"), p.split([q, kv, kv]))]
        elif "gate_up_proj" in name:
            parts = [(name.replace("gate_up_proj", n), t) for n, t in zip(("gate_proj", "up_proj"), p.split([inter, inter]))]
        for part_name, tensor in parts:
            if gguf_type is not None and tensor.dim() == 2:
                qtype = gguf.GGMLQuantizationType[gguf_type]
                blocks = gguf.quants.quantize(tensor.numpy().astype(np.float32), qtype)
                tensor = from_gguf_blocks(blocks, qtype.value)
            out.append((part_name, tensor))
    return out


def dequantized(ckpt: list[tuple[str, object]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.dequantize() if isinstance(t, QuantizedTensor) else t) for n, t in ckpt]


def build(ckpt, plan) -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG).eval()
    model.load_weights(iter(ckpt), plan.weight_format)
    return model, apply_plan(model, plan)


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_gguf_blocks_served_as_stored_match_the_dequantized_model(gguf_type) -> None:
    ckpt = checkpoint(CFG, gguf_type)
    dense_plan = cpu_native_plan(torch.float32, fused_decode=False)
    stored, plan = build(ckpt, quantized_plan(dense_plan, "stored"))
    reference, _ = build(dequantized(ckpt), dense_plan)
    assert all(isinstance(m.weights, QuantizedWeights) for m in stored.modules() if getattr(m, "weights", None))
    assert stored.embed_tokens.weight is None  # the tied quantized table serves the lookups
    ids = torch.randint(0, CFG.vocab_size, (11,))
    got, want = logits(stored, ids), logits(reference, ids)
    # The activations are rounded to int8 per 32 for the integer dot products (llama.cpp's Q8_1).
    rel = (got - want).norm() / want.norm()
    assert rel < 0.02, f"relative error {rel:.4f}"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q8_0"])
def test_an_untied_quantized_embedding_table_is_kept_as_stored_not_as_floats(gguf_type) -> None:
    """An untied GGUF token_embd as stored serves the lookups from its blocks (Llama-3.1-8B's is
    2.1 GB as float32, 0.3 GB as Q4_0), rows equal to the dequantized table's."""
    import dataclasses

    cfg = dataclasses.replace(CFG, tie_word_embeddings=False)
    ckpt = checkpoint(cfg, gguf_type)
    table = dict(ckpt)["embed_tokens.weight"]
    assert isinstance(table, QuantizedTensor)
    dense_plan = cpu_native_plan(torch.float32, fused_decode=False)
    stored, reference = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
    stored.load_weights(iter(ckpt), quantized_plan(dense_plan, "stored").weight_format)
    apply_plan(stored, quantized_plan(dense_plan, "stored"))
    reference.load_weights(iter(dequantized(ckpt)), dense_plan.weight_format)
    apply_plan(reference, dense_plan)
    assert stored.embed_tokens.weight is None and stored.table_rows is not None
    assert stored.lm_head.weights is not stored.table_rows  # the head keeps its own (untied) weight
    ids = torch.tensor([0, 5, 319, 5, 77])
    with torch.inference_mode():
        torch.testing.assert_close(stored._lookup(ids), table.dequantize()[ids], rtol=0, atol=0)
    got, want = logits(stored, ids), logits(reference, ids)
    assert (got - want).norm() / want.norm() < 0.02


@pytest.mark.parametrize("method,bound", [("int8", 0.02), ("int4", 0.15)])
def test_int8_and_int4_at_load_match_their_own_dequantized_weights(method, bound) -> None:
    ckpt = checkpoint(CFG, None)
    dense_plan = cpu_native_plan(torch.float32, fused_decode=False)
    quantized, _ = build(ckpt, quantized_plan(dense_plan, method, 32))
    head = quantized.lm_head.weights
    assert isinstance(head, QuantizedWeights) and head.qt.bits == 8  # the head stays at 8 bits under int4
    layer_bits = quantized.layers[0].mlp.down_proj.weights.qt.bits
    assert layer_bits == (8 if method == "int8" else 4)
    # Against the same weights dequantized: only activation rounding separates them.
    same, _ = build([(n, t) for n, t in _dequantized_weights_of(quantized, ckpt)], dense_plan)
    ids = torch.randint(0, CFG.vocab_size, (9,))
    got, want = logits(quantized, ids), logits(same, ids)
    assert ((got - want).norm() / want.norm()) < 0.02
    # Against the float model: the quantization error itself, bounded.
    full, _ = build(ckpt, dense_plan)
    ref = logits(full, ids)
    assert ((got - ref).norm() / ref.norm()) < bound


def _dequantized_weights_of(model, ckpt):
    """The checkpoint with every linear weight replaced by what `model` stores for it."""
    q = CFG.num_heads * CFG.head_dim
    kv, inter = CFG.num_kv_heads * CFG.head_dim, CFG.intermediate_size
    stored = {name: m.weights.dequantize() for name, m in model.named_modules() if getattr(m, "weights", None)}
    out = []
    for name, tensor in ckpt:
        owner = name.rsplit(".", 1)[0].removeprefix("model.")
        for part, (fused, index, sizes) in {"q_proj": ("qkv_proj", 0, [q, kv, kv]), "k_proj": ("qkv_proj", 1, [q, kv, kv]),
                                             "v_proj": ("qkv_proj", 2, [q, kv, kv]), "gate_proj": ("gate_up_proj", 0, [inter, inter]),
                                             "up_proj": ("gate_up_proj", 1, [inter, inter])}.items():
            if owner.endswith(part):
                tensor = stored[owner.replace(part, fused)].split(sizes)[index]
                break
        else:
            if owner in stored:
                tensor = stored[owner]
            elif name.endswith("embed_tokens.weight"):
                tensor = stored["lm_head"]  # tied
        out.append((name, tensor))
    return out


def test_the_fused_decode_layer_runs_quantized_weights_as_the_per_op_path_does() -> None:
    from test_model import _paged_logits

    ckpt = checkpoint(CFG, "Q4_1", seed=3)
    fused, plan = build(ckpt, quantized_plan(cpu_native_plan(torch.float32), "stored"))
    per_op, _ = build(ckpt, quantized_plan(cpu_native_plan(torch.float32, fused_decode=False), "stored"))
    assert plan.fused_decode and fused.fused_layers is not None
    calls = []
    original = kernels.llama_decode_layer
    try:
        kernels.llama_decode_layer = lambda *a, **k: calls.append(1) or original(*a, **k)
        seqs = [torch.randint(0, CFG.vocab_size, (n,)).tolist() for n in (9, 8, 12)]
        chunks = [[5, 4, 8], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
        got = _paged_logits(fused, seqs, chunks, "cpu_native", plan=plan)
    finally:
        kernels.llama_decode_layer = original
    want = _paged_logits(per_op, seqs, chunks, "cpu_native")
    assert len(calls) == 3 * CFG.num_layers
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_mixed_block_types_in_one_fused_weight_are_served_dense() -> None:
    """llama.cpp's *_K_M files mix types (e.g. Q4_K q/k beside a Q6_K v): parts that cannot
    share one quantized stream are dequantized and kept in the dense format."""
    ckpt = checkpoint(CFG, "Q4_1")
    mixed = [(n, dequantized([(n, t)])[0][1] if n.endswith("v_proj.weight") else t) for n, t in ckpt]
    model, _ = build(mixed, quantized_plan(cpu_native_plan(torch.float32, fused_decode=False), "stored"))
    assert not isinstance(model.layers[0].self_attn.qkv_proj.weights, QuantizedWeights)
    assert isinstance(model.layers[0].self_attn.o_proj.weights, QuantizedWeights)
    ids = torch.randint(0, CFG.vocab_size, (7,))
    reference, _ = build(dequantized(ckpt), cpu_native_plan(torch.float32, fused_decode=False))
    got, want = logits(model, ids), logits(reference, ids)
    assert ((got - want).norm() / want.norm()) < 0.02


def test_quantization_errors_name_the_problem() -> None:
    from tokenmill.runner.worker import quantized_as_stored
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match="quantized already"):
        quantized_as_stored(EngineConfig.from_kwargs(quantization="int8"), "gguf", True)
    with pytest.raises(ValueError, match="needs a GGUF file"):
        quantized_as_stored(EngineConfig.from_kwargs(quantization="gguf"), None, True)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig.from_kwargs(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        EngineConfig.from_kwargs(quantization_group_size=48)
    assert quantized_as_stored(EngineConfig(), "gguf", True)  # the default: as stored
    assert not quantized_as_stored(EngineConfig.from_kwargs(dtype="float32"), "gguf", True)  # dequantize
    assert not quantized_as_stored(EngineConfig(), "gguf", False)  # no kernels: dequantized
    with pytest.raises(ValueError, match="cannot be kept quantized; supported: Q4_0"):
        from_gguf_blocks(np.zeros((4, 84), dtype=np.uint8), gguf.GGMLQuantizationType.Q2_K.value)
    with pytest.raises(ValueError, match="not divisible|divisible"):
        from tokenmill.quantization.rtn import quantize_int4

        quantize_int4(torch.randn(8, 48), 32)


def test_the_default_model_served_as_stored_agrees_with_its_dequantized_weights(llm_f32) -> None:
    """SmolLM2's Q4_1 GGUF as stored (int8 activations on integer dot products) against the
    same weights dequantized in float32: teacher-forced next-token argmax over a real text."""
    from tokenmill import LLM, SamplingParams

    stored = LLM(kv_cache_memory="128MiB", max_model_len=1024, enable_prefix_caching=False)
    assert stored.engine.facts.weight_format.startswith("q4-g32")
    text = ("The history of the city begins with a small settlement on the river, where traders met to "
            "exchange grain, salt and cloth. Over the centuries the market grew into a town, and the town "
            "into a city with walls, churches and a university that drew students from far away.")
    ids = stored.tokenizer.encode(text)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    a = stored.generate([ids], params)[0].prompt_logprobs[1:]
    b = llm_f32.generate([ids], params)[0].prompt_logprobs[1:]
    top = lambda entry: max(entry.items(), key=lambda kv: kv[1].logprob)[0]  # noqa: E731
    agree = np.mean([top(x) == top(y) for x, y in zip(a, b)])
    assert agree >= 0.9, agree
