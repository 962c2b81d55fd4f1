"""The bf16 activation path of many-row steps (runner/plan.py, `ExecutionPlan.activation_dtype`).

Where every linear of a many-row step multiplies in bf16 anyway (bf16 GEMM inputs and
outputs), the path keeps the activations bf16 between them instead of casting at every GEMM:
the same bits, without the casts. So the tests here ask for equality with the float32
activation path on the same plan (a decoder layer of the tiny checkpoint in every weight
format the path serves, and the default model's prompt logprobs and greedy tokens), closeness
to the float32 reference layer, and that the plan picks the path where intended: per-op steps
past the rows of the skinny / integer kernels, where the GEMMs are bf16 (and, for quantized
weights, the CPU has native bf16 arithmetic), never under deterministic inference, for a
layer or KV cache it does not cover, or on the fused and reference tiers.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tests.test_execution_paths import LAYER, _checkpoint, _reference_layer, qwen2_with_biases, tiny  # noqa: F401
from tokenmill import SamplingParams, kernels
from tokenmill.attention.backend import BatchLayout, ForwardContext, StepKind, forward_context
from tokenmill.attention.cpu_native import CPUNativeBackend
from tokenmill.attention.kv_cache import LayerKVCache
from tokenmill.hardware import cpu_info
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.quantization.dense import CPUMatmulChoice
from tokenmill.runner.plan import (ExecutionPlan, apply_plan, batch_invariant_plan, bf16_activations_uncovered,
                                   cpu_native_plan, quantized_plan)

BF16_GEMM = CPUMatmulChoice(16, "onednn_bf16")


@pytest.fixture(scope="module", autouse=True)
def native() -> None:
    if not kernels.cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")


def test_the_plan_picks_bf16_activations_past_the_skinny_and_integer_rows() -> None:
    dense = cpu_native_plan(torch.bfloat16, choice=BF16_GEMM)
    assert dense.bf16_activation_rows == 16 and dense.prefill_attention_dtype == torch.bfloat16
    assert dense.activation_dtype(StepKind.PER_OP, 17) == torch.bfloat16
    assert dense.activation_dtype(StepKind.PER_OP, 16) is None  # the skinny kernel's rows: float32
    assert dense.activation_dtype(StepKind.FUSED, 64) is None
    assert "bf16 activations (float32 residual) for steps of > 16 tokens" in dense.describe()
    # float32 GEMMs (measured faster, or an AVX2 CPU), or no oneDNN copy: float32 activations.
    for plan in (cpu_native_plan(torch.bfloat16, choice=CPUMatmulChoice(16, "onednn_f32")),
                 cpu_native_plan(torch.bfloat16, onednn=False, choice=BF16_GEMM), cpu_native_plan(torch.float32)):
        assert plan.bf16_activation_rows is None and plan.activation_dtype(StepKind.PER_OP, 4096) is None
    # Quantized weights: their GEMM is bf16 on any CPU, the path is taken where bf16 is native.
    f32_dense = cpu_native_plan(torch.bfloat16, choice=CPUMatmulChoice(16, "onednn_f32"))
    quant = quantized_plan(f32_dense, "stored", native_bf16=True)
    assert quant.bf16_activation_rows == 12 and quant.prefill_attention_dtype == torch.bfloat16
    assert quant.activation_dtype(StepKind.PER_OP, 13) == torch.bfloat16
    assert quant.activation_dtype(StepKind.PER_OP, 12) is None  # 8-bit weights' integer kernel takes 12
    avx2 = quantized_plan(f32_dense, "stored", native_bf16=False)
    assert avx2.bf16_activation_rows is None and avx2.prefill_attention_dtype is None
    assert quantized_plan(dense, "int8").bf16_activation_rows == 16  # bf16 dense GEMMs past 16 rows
    # Deterministic inference: one row-wise kernel at every row count, float32 activations.
    for plan in (dense, quant):
        assert batch_invariant_plan(plan).bf16_activation_rows is None


def test_layers_and_caches_the_path_does_not_cover_are_named() -> None:
    from tokenmill.kernels.fused_layer import LayerFeatures

    plain = LayerFeatures(sliding_window=4096)
    assert bf16_activations_uncovered([plain], "bfloat16") == []
    missing = bf16_activations_uncovered([plain, LayerFeatures(qkv_bias=True, tensor_parallel=True)], "int8")
    assert missing == ["qkv_bias", "tensor_parallel", "a int8 KV cache"]


def test_apply_plan_refuses_it_for_an_uncovered_layer_with_a_log_line(tiny, caplog) -> None:  # noqa: F811
    model = qwen2_with_biases(*tiny)
    with caplog.at_level(logging.INFO, logger="tokenmill.runner.plan"):
        plan = apply_plan(model, cpu_native_plan(torch.bfloat16, choice=BF16_GEMM), "bfloat16")
    assert plan.bf16_activation_rows is None
    assert "bf16 activations do not cover" in caplog.text and "qkv_bias" in caplog.text


def _plan(fmt: str) -> ExecutionPlan:
    dense = cpu_native_plan(torch.bfloat16, fused_decode=False, choice=BF16_GEMM)
    if fmt in ("Q4_1", "Q8_0"):
        return quantized_plan(dense, "stored", native_bf16=True)
    return quantized_plan(dense, "int8", native_bf16=True) if fmt == "int8" else dense


@pytest.mark.parametrize("fmt", ["bfloat16", "Q4_1", "Q8_0", "int8"])
@torch.inference_mode()
def test_a_bf16_activation_step_computes_the_float32_activation_bits(tiny, fmt: str) -> None:  # noqa: F811
    """A prefill step of two prompts (plus a decode row: a mixed step) through a decoder
    layer, bf16 activations against float32 ones on the same plan and weights: the layer
    output and the residual stream are equal, bit for bit, for the prompts (their GEMMs,
    attention and element-wise ops round where the float32 path casts); the decode row,
    whose query the paged kernel now reads in bf16, is close. Both are close to the float32
    reference layer."""
    cfg, tensors = tiny
    model = LlamaForCausalLM(cfg).eval()
    plan = _plan(fmt)
    model.load_weights(iter(_checkpoint(tensors, fmt)), plan.weight_format)
    plan = apply_plan(model, plan, "bfloat16")
    layer, ref_layer = model.layers[LAYER], _reference_layer(cfg, model).layers[LAYER]
    backend = CPUNativeBackend().for_plan(plan.prefill_attention_dtype)
    lens, history = [11, 9], 5  # two prompts, and a sequence decoding after `history` cached tokens
    tokens = sum(lens) + 1
    assert plan.activation_dtype(StepKind.PER_OP, tokens) == torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(tokens, cfg.hidden_size, generator=gen)
    residual = torch.randn(tokens, cfg.hidden_size, generator=gen)
    positions = torch.cat([torch.arange(lens[0]), torch.arange(lens[1]), torch.tensor([history])])
    rope = layer.self_attn.rotary.table(positions)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7]]
    slots = [t[p // 4] * 4 + p % 4 for t, n in zip(tables, lens) for p in range(n)] + [tables[2][1] * 4 + 1]
    layout = BatchLayout([*lens, 1], [*lens, history + 1], tables, slots, 4)
    history_kv = torch.randn(2, history, cfg.num_kv_heads, cfg.head_dim, generator=gen).bfloat16()

    def step(activation_dtype):
        cache = LayerKVCache.allocate(8, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
        cache.write(history_kv[0], history_kv[1], torch.tensor([tables[2][p // 4] * 4 + p % 4 for p in range(history)]))
        ctx = ForwardContext.for_step(StepKind.PER_OP, backend, layout, [cache] * cfg.num_layers, torch.device("cpu"))
        ctx.activation_dtype = activation_dtype
        with forward_context(ctx):
            return layer(rope, h, residual.clone(), activation_dtype)

    (out_bf16, res_bf16), (out_f32, res_f32) = step(torch.bfloat16), step(None)
    assert out_bf16.dtype == torch.bfloat16 and res_bf16.dtype == torch.float32 and out_f32.dtype == torch.float32
    prompts = sum(lens)
    assert torch.equal(out_bf16[:prompts].float(), out_f32[:prompts])
    assert torch.equal(res_bf16[:prompts], res_f32[:prompts])
    decode_err = float((out_bf16[prompts:].float() - out_f32[prompts:]).abs().max() / out_f32[prompts:].abs().max())
    assert decode_err < 2e-2, decode_err
    start = 0
    for n in lens:  # each prompt alone through the reference layer (dense causal attention)
        want_out, want_res = ref_layer(layer.self_attn.rotary.table(torch.arange(n)), h[start : start + n],
                                       residual[start : start + n].clone())
        for got, want in ((out_bf16[start : start + n].float(), want_out), (res_bf16[start : start + n], want_res)):
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 5e-2, f"{fmt}: error {err:.2e} against the float32 reference layer"
        start += n


@pytest.fixture(scope="module")
def default_llm():
    """The default model with the bf16 GEMM past the integer rows (where the plan may pick the
    integer GEMM instead, activations stay float32: test_the_default_model_as_served_...)."""
    from tokenmill.llm import LLM

    return LLM(max_model_len=1024, kv_cache_memory="64MiB", seed=0, enable_prefix_caching=False, quant_gemm="bf16")


def test_the_default_model_gives_the_float32_activation_path_tokens(default_llm) -> None:
    """The default model as served (its Q4_1 file as stored): the plan takes the path where
    the CPU computes bf16 natively, and a 300-token prompt's logprobs and greedy tokens are
    those of the float32 activation path on the same plan and attention."""
    runner = default_llm.engine.executor
    assert (runner.plan.bf16_activation_rows is not None) == cpu_info().native_bf16, runner.plan.describe()
    plan, backend = runner.plan, runner.backend
    ids = [(i * 7919) % 40000 + 100 for i in range(300)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    results = {}
    try:
        runner.backend = backend.for_plan(torch.bfloat16)
        for name, rows in (("bf16", 12), ("float32", None)):
            runner.plan = dataclasses.replace(plan, prefill_attention_dtype=torch.bfloat16, bf16_activation_rows=rows)
            out = default_llm.generate([ids], params)[0]
            results[name] = ([{t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs[1:]],
                             out.outputs[0].token_ids)
    finally:
        runner.plan, runner.backend = plan, backend
    assert results["bf16"][1] == results["float32"][1]
    assert results["bf16"][0] == results["float32"][0]


def test_bf16_prefill_attention_runs_natively_where_the_cpu_has_avx512_bf16_and_no_amx() -> None:
    from tokenmill.attention.cpu_native import native_prefill_attention

    cpu = cpu_info()
    assert native_prefill_attention(64) == (cpu.has("avx512_bf16") and not cpu.has("amx_bf16"))
    assert not native_prefill_attention(80)  # no kernel for this head size: SDPA


def test_the_default_model_as_served_agrees_with_transformers(default_llm) -> None:
    """The default model as served (Q4_1 as stored) against transformers in float32 on the
    same dequantized weights, teacher-forced: the argmax at >= 99% of positions, the bar of the
    float32 test (tests/test_default_model.py), with either many-row GEMM: the bf16 one (on a
    native-bf16 CPU with bf16 activations and bf16 prefill attention; measured on an AVX-512
    BF16 EPYC: 447-448 of 449, float32 activations and attention on the same plan: 449) and the
    integer one (int8 activations per 32 on every row, as llama.cpp computes; where it is built),
    whose bar is 98.5%: 444 of 449 on the same EPYC (its perplexity on the shipped text is
    within 0.4% of float32's, llama.cpp's on the same file within 0.3%: docs/quantization.md)."""
    import os

    from transformers import AutoModelForCausalLM

    from tests.test_default_model import TEXT
    from tokenmill import kernels
    from tokenmill.llm import LLM
    from tokenmill.model.loader import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = default_llm.tokenizer.encode(TEXT * 3)[:700]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0].argmax(-1)
    llms = {"bf16": default_llm}
    if kernels.quant_integer_gemm_built():
        llms["integer"] = LLM(max_model_len=1024, kv_cache_memory="64MiB", seed=0, enable_prefix_caching=False,
                              quant_gemm="integer")
        plan = llms["integer"].engine.executor.plan
        assert plan.weight_format.integer_gemm and plan.bf16_activation_rows is None, plan.describe()
    for name, llm in llms.items():
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
        ours = [max(d, key=lambda t: d[t].logprob) for d in out.prompt_logprobs[1:]]
        agree = sum(int(a == b) for a, b in zip(ours, expected[:-1].tolist()))
        bar = 0.985 if name == "integer" else 0.99
        assert agree / len(ours) >= bar, f"{name} GEMM: {agree}/{len(ours)} positions agree"
