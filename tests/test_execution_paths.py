"""Every execution path of a decoder layer against `DecoderLayer.forward`, the reference.

One matrix: tier (fused native layer, per-op native, reference PyTorch) x weight format
(float32, bfloat16, GGUF Q4_1 and Q8_0 as stored, int8 at load) x KV cache dtype (auto, int8)
x tensor parallelism 1, on the tiny checkpoint (tests/tiny_checkpoint.py). Each path runs a
prefill of two prompts, then decode steps and a verification-like short chunk (laid out as
one-token rows, as the runner does) through a paged cache, asking the plan what each step
runs, exactly as the runner does; its layer output and residual stream are compared, row by
row, with the reference layer run densely over each whole sequence on the same weights (as
the path stores them, dequantized to float32). So a difference is the path's own: its
kernels, its activation rounding (int8 per 32 in the quantized integer kernels, bf16 in
their GEMM) and its KV cache's rounding, bounded per dtype below.

Also here: the plan refuses the fused layer at load, naming the feature, for a layer it
does not cover (Qwen2's q/k/v biases), and that model then runs every step op by op.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tiny_checkpoint import write_tiny_llama
from tokenmill import kernels
from tokenmill.attention.backend import BatchLayout, ForwardContext, StepKind, forward_context
from tokenmill.attention.kv_cache import LayerKVCache
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.kernels import fused_layer
from tokenmill.kernels.ops import NATIVE_OPS, REFERENCE_OPS
from tokenmill.model_arch import ModelArchConfig
from tokenmill.model.layers import Linear
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.quantization import QuantizedTensor
from tokenmill.quantization.gguf_blocks import from_gguf_blocks
from tokenmill.quantization.dense import PANELS, CPUMatmulChoice
from tokenmill.runner.plan import ROWS, ExecutionPlan, apply_plan, cpu_native_plan, quantized_plan, reference_plan

TIERS = ("fused", "per-op", "reference")
FORMATS = ("float32", "bfloat16", "float32-panels", "bfloat16-panels", "Q4_1", "Q8_0", "int8")
KV_DTYPES = ("auto", "int8")
LAYER = 1  # a layer with a residual stream coming in
BLOCK_SIZE = 4

# max |path - reference| / max |reference| over a step's layer output and residual rows.
# Float weights: the kernels compute the reference's float32 arithmetic (1.3e-6 measured); a
# quantized weight's integer kernel rounds activations to int8 per 32 and its GEMM to bf16
# (3.5e-2 measured with a bf16 cache, 3.7e-2 int8 at load with an int8 cache); a bf16 / int8
# KV cache rounds K and V once (6.9e-3 / 1.2e-2 measured with float weights).
# The panel kernel's bf16 panels round activations to bf16 (1.5e-2 measured on a prefill step, a bf16
# cache's rounding included).
WEIGHT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-4, "float32-panels": 1e-4, "bfloat16-panels": 2e-2, "Q4_1": 4e-2,
                    "Q8_0": 4e-2, "int8": 4e-2}
KV_TOLERANCE = {torch.float32: 0.0, torch.bfloat16: 1e-2, torch.int8: 3e-2}


@pytest.fixture(scope="module", autouse=True)
def native() -> None:
    if not kernels.cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    directory = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    cfg = ModelArchConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
    return cfg, load_file(directory / "model.safetensors")


def _checkpoint(tensors: dict[str, torch.Tensor], fmt: str) -> list[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The tiny checkpoint with its layers' linear weights as GGUF blocks of `fmt` (exact
    conversions of what gguf-py writes) for Q4_1 / Q8_0, as it is otherwise."""
    if fmt not in ("Q4_1", "Q8_0"):
        return list(tensors.items())
    qtype = gguf.GGMLQuantizationType[fmt]
    out = []
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            tensor = from_gguf_blocks(gguf.quants.quantize(tensor.float().numpy().astype(np.float32), qtype), qtype.value)
        out.append((name, tensor))
    return out


def _plan(tier: str, fmt: str) -> ExecutionPlan:
    """The plan the builder chooses for this tier and format (the reference tier is a CPU
    without the native kernels: stored GGUF blocks are served dequantized there)."""
    weight_dtype = _weight_dtype(fmt)
    if tier == "reference":
        return reference_plan(weight_dtype)
    choice = CPUMatmulChoice(ROWS.skinny_max_rows, PANELS) if fmt.endswith("panels") else None
    dense = cpu_native_plan(weight_dtype, fused_decode=tier == "fused", choice=choice)
    if fmt in ("Q4_1", "Q8_0"):
        return quantized_plan(dense, "stored")
    return quantized_plan(dense, "int8") if fmt == "int8" else dense


def _build(cfg: ModelArchConfig, ckpt, plan: ExecutionPlan, kv_dtype: str) -> tuple[LlamaForCausalLM, ExecutionPlan]:
    model = LlamaForCausalLM(cfg).eval()
    stored_ok = plan.native_ops  # without the native kernels, quantized blocks are read dequantized
    model.load_weights(iter(ckpt), plan.weight_format if stored_ok else None)
    return model, apply_plan(model, plan, kv_dtype)


def _reference_layer(cfg: ModelArchConfig, model: LlamaForCausalLM):
    """A plain float32 copy of `model`'s layer LAYER (its weights as stored, dequantized)
    with the reference ops: DecoderLayer.forward on it is the reference."""
    reference = LlamaForCausalLM(cfg).eval()
    layer, ref = model.layers[LAYER], reference.layers[LAYER]
    with torch.no_grad():
        for name, module in layer.named_modules():
            target = ref.get_submodule(name)
            if isinstance(module, Linear):
                weight = module.weights.dequantize() if module.weights is not None else module.weight.float()
                target.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
                if module.bias is not None:
                    target.bias.copy_(module.bias)
        ref.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        ref.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    assert ref.input_layernorm.ops is REFERENCE_OPS
    return reference


def _weight_dtype(fmt: str) -> torch.dtype:
    """How float weights are stored: bf16 but for float32 (the default model is a GGUF served
    with bf16 float tensors)."""
    return torch.float32 if fmt.startswith("float32") else torch.bfloat16


def _kv_torch_dtype(kv_dtype: str, fmt: str) -> torch.dtype:
    """auto follows the weights' storage dtype, as builder.resolve_dtype does."""
    return torch.int8 if kv_dtype == "int8" else _weight_dtype(fmt)


def _backend(tier: str):
    if tier == "reference":
        return TorchSDPABackend()
    from tokenmill.attention.cpu_native import CPUNativeBackend

    return CPUNativeBackend()


# Steps: tokens of sequence 0 and 1 (lengths 11 + 5 then 6 + 1 + 1 + 3 + 1 ...).
PROMPTS = (11, 6)
STEPS = [(11, 6), (1, 1), (1, 1), (3, 1), (1, 2)]


def _layout(plan: ExecutionPlan, done: list[int], step: tuple[int, ...], tables: list[list[int]]) -> BatchLayout:
    """The runner's layout of a step (short chunks after context as one-token rows)."""
    query_lens, context_lens, block_tables, slots = [], [], [], []
    for r, n in enumerate(step):
        slots += [tables[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(done[r], done[r] + n)]
        if plan.chunk_as_rows(done[r], n):
            query_lens += [1] * n
            context_lens += range(done[r] + 1, done[r] + n + 1)
            block_tables += [tables[r]] * n
        else:
            query_lens.append(n)
            context_lens.append(done[r] + n)
            block_tables.append(tables[r])
    return BatchLayout(query_lens, context_lens, block_tables, slots, BLOCK_SIZE)


# int8 at load and the panel kernel run on the native kernels only (runner/worker.py refuses
# int8 with the kernels off), so the reference tier has no such path to compare.
PATHS = [(tier, fmt) for tier in TIERS for fmt in FORMATS
         if not (tier == "reference" and (fmt == "int8" or fmt.endswith("panels")))]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("tier,fmt", PATHS)
@torch.inference_mode()
def test_every_path_matches_the_reference_decoder_layer(tiny, tier: str, fmt: str, kv_dtype: str) -> None:
    cfg, tensors = tiny
    if fmt.endswith("panels") and not kernels.panel_linear_built(_weight_dtype(fmt)):
        with pytest.raises(RuntimeError, match="needs an AVX-512 build"):  # this build says so instead
            kernels.panel_linear(torch.randn(2, 64), kernels.pack_panels(torch.randn(8, 64), _weight_dtype(fmt)), 8)
        return
    kv_name = "int8" if kv_dtype == "int8" else str(_weight_dtype(fmt)).removeprefix("torch.")
    model, plan = _build(cfg, _checkpoint(tensors, fmt), _plan(tier, fmt), kv_name)
    assert plan.tier == {"fused": "fused decode layer", "per-op": "per-op native", "reference": "reference"}[tier]
    reference = _reference_layer(cfg, model)
    layer, ref_layer = model.layers[LAYER], reference.layers[LAYER]
    kv_torch = _kv_torch_dtype(kv_dtype, fmt)

    total = [sum(s[r] for s in STEPS) for r in range(2)]
    gen = torch.Generator().manual_seed(7)
    h_all = [torch.randn(n, cfg.hidden_size, generator=gen) for n in total]
    res_all = [torch.randn(n, cfg.hidden_size, generator=gen) for n in total]
    rope_table = layer.self_attn.rotary
    with torch.inference_mode():  # the reference: each whole sequence at once, dense causal attention
        want = [ref_layer(rope_table.table(torch.arange(n)), h, res.clone()) for n, h, res in zip(total, h_all, res_all)]

    blocks = sum(-(-n // BLOCK_SIZE) for n in total) + 2
    cache = LayerKVCache.allocate(blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, kv_torch)
    free = torch.randperm(blocks, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in total]
    backend = _backend(tier).for_plan(plan.prefill_attention_dtype)
    done, kinds = [0, 0], []
    bound = WEIGHT_TOLERANCE[fmt] + KV_TOLERANCE[kv_torch]
    for step in STEPS:
        layout = _layout(plan, done, step, tables)
        kind = plan.step_kind(len(layout.query_lens), layout.all_decode)  # as the runner asks
        kinds.append(kind)
        spans = [(r, done[r], done[r] + n) for r, n in enumerate(step)]
        h = torch.cat([h_all[r][a:b] for r, a, b in spans])
        residual = torch.cat([res_all[r][a:b] for r, a, b in spans])
        positions = torch.cat([torch.arange(a, b) for _, a, b in spans])
        rope = rope_table.table(positions)
        caches = [cache if i == LAYER else None for i in range(cfg.num_layers)]  # the cache of layer LAYER
        ctx = ForwardContext.for_step(kind, backend, layout, caches, torch.device("cpu"))
        with forward_context(ctx):
            if kind.fused:
                out = layer.fused_decode(model.fused_layers[LAYER], rope, h, residual, cache, ctx.decode)
            else:
                out, residual = layer(rope, h, residual)
        row = 0
        for r, a, b in spans:
            for got, expected in ((out, want[r][0]), (residual, want[r][1])):
                g, e = got[row : row + b - a], expected[a:b]
                err = float((g - e).abs().max() / e.abs().max())
                assert err < bound, f"{tier}/{fmt}/kv {kv_dtype}: step {step}, sequence {r}: error {err:.2e} >= {bound}"
            row += b - a
        done = [d + n for d, n in zip(done, step)]

    decode_kind = {"fused": StepKind.FUSED, "per-op": StepKind.PER_OP, "reference": StepKind.REFERENCE}[tier]
    assert kinds[0] == (StepKind.REFERENCE if tier == "reference" else StepKind.PER_OP)  # a prefill
    assert kinds[1:] == [decode_kind] * (len(STEPS) - 1)  # decodes and short chunks as rows


def qwen2_with_biases(cfg: ModelArchConfig, tensors: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """The tiny checkpoint as a Qwen2 model: q/k/v biases (random), unformatted."""
    qwen = dataclasses.replace(cfg, architecture="qwen2", attention_bias=True)
    model = LlamaForCausalLM(qwen).eval()
    ckpt = list(tensors.items())
    for i in range(qwen.num_layers):
        for part, size in (("q_proj", qwen.num_heads), ("k_proj", qwen.num_kv_heads), ("v_proj", qwen.num_kv_heads)):
            ckpt.append((f"model.layers.{i}.self_attn.{part}.bias", torch.randn(size * qwen.head_dim) * 0.1))
    model.load_weights(iter(ckpt))
    return model


def test_the_plan_refuses_the_fused_layer_for_a_feature_it_does_not_cover(tiny, caplog) -> None:
    """Qwen2's q/k/v biases are not in the fused op: refused at load with a log line naming
    the feature; every step then runs op by op (and still matches the reference)."""
    model = qwen2_with_biases(*tiny)
    with caplog.at_level(logging.INFO, logger="tokenmill.runner.plan"):
        plan = apply_plan(model, cpu_native_plan(torch.float32), "float32")
    assert not plan.fused_decode and model.fused_layers is None
    assert "qkv_bias" in caplog.text and "op by op" in caplog.text
    assert plan.step_kind(1, all_decode=True) is StepKind.PER_OP
    assert model.layers[0].input_layernorm.ops is NATIVE_OPS  # the rest of the plan stands


def test_coverage_is_one_table_that_names_what_is_missing() -> None:
    """The fused op's coverage: every LayerFeatures field is in COVERED, and a layer asking
    for more is told what (the next architectures extend this table, not the runner)."""
    assert set(fused_layer.COVERED) <= set(fused_layer.LayerFeatures.__dataclass_fields__)
    plain = fused_layer.LayerFeatures(weights=("tiled float32", "quantized"))
    assert fused_layer.uncovered([plain, plain], "int8") == []
    wanted = fused_layer.LayerFeatures(qk_norm=True, sliding_window=4096, logit_softcap=50.0, tensor_parallel=True,
                                       weights=("tiled float32", None))
    missing = fused_layer.uncovered([plain, wanted], "int4")
    assert missing[:4] == ["qk_norm", "sliding_window", "logit_softcap", "tensor_parallel"]
    assert "plain tensor" in missing[4] and "int4" in missing[5]


@pytest.mark.parametrize("family,features", [
    ("qwen3", ["qk_norm"]),
    ("gemma3", ["qk_norm", "sliding_window", "sandwich_norms", "geglu_mlp"]),
])
def test_qwen3_and_gemma3_layers_are_refused_the_fused_layer_by_name(family, features, caplog) -> None:
    """The layer kinds the next architectures brought: each uncovered feature is named at load."""
    from test_model_families import hf_gemma3, hf_qwen3, ours_from

    model = ours_from(hf_qwen3() if family == "qwen3" else hf_gemma3())
    with caplog.at_level(logging.INFO, logger="tokenmill.runner.plan"):
        plan = apply_plan(model, cpu_native_plan(torch.float32), "float32")
    assert not plan.fused_decode and model.fused_layers is None
    for name in features:
        assert name in caplog.text


def test_a_tokens_attention_follows_what_the_token_is_under_prompts_as_chunks() -> None:
    """`attention_spans`: with `prompts_as_chunks`, prompt tokens attend as a chunk however
    few (a prompt's 3-token or 1-token tail after a cached prefix), generated tokens as rows
    (a decode, a verification, a recomputation after a preemption split at the prompt's
    end); without it, by the chunk's length as before. The layout sends a one-token prompt
    chunk to the prefill path, not the decode path, and the step is then no pure decode."""
    from tokenmill.runner.plan import AttentionSpan

    before = cpu_native_plan(torch.float32)
    plan = dataclasses.replace(before, prompts_as_chunks=True)
    assert plan.attention_spans(16, 3, prompt_len=19) == [AttentionSpan(16, 3, as_rows=False)]
    assert before.attention_spans(16, 3, prompt_len=19) == [AttentionSpan(16, 3, as_rows=True)]
    assert plan.attention_spans(18, 1, prompt_len=19) == [AttentionSpan(18, 1, as_rows=False)]
    assert before.attention_spans(18, 1, prompt_len=19) == [AttentionSpan(18, 1, as_rows=True)]
    assert plan.attention_spans(19, 1, prompt_len=19) == [AttentionSpan(19, 1, as_rows=True)]  # a decode
    assert plan.attention_spans(25, 4, prompt_len=19) == [AttentionSpan(25, 4, as_rows=True)]  # a verification
    assert plan.attention_spans(0, 30, prompt_len=19) == [AttentionSpan(0, 19, as_rows=False),  # recomputed
                                                          AttentionSpan(19, 11, as_rows=True)]
    assert before.attention_spans(0, 30, prompt_len=19) == [AttentionSpan(0, 30, as_rows=False)]
    # deterministic inference: prompts as chunks where the prefill kernel is chunk-invariant, else every token a row
    invariant = dataclasses.replace(plan, batch_invariant=True)
    assert invariant.attention_spans(0, 30, prompt_len=19) == [AttentionSpan(0, 19, as_rows=False),
                                                               AttentionSpan(19, 11, as_rows=True)]
    rows = dataclasses.replace(before, batch_invariant=True)
    assert rows.attention_spans(0, 30, prompt_len=19) == [AttentionSpan(0, 30, as_rows=True)]
    assert rows.attention_spans(16, 3, prompt_len=19) == [AttentionSpan(16, 3, as_rows=True)]
    # the default plan on dense float32 panels: every prompt token a row, as decodes
    float_rows = dataclasses.replace(before, prompts_as_rows=True)
    assert float_rows.attention_spans(0, 30, prompt_len=19) == [AttentionSpan(0, 30, as_rows=True)]
    assert float_rows.attention_spans(0, 19, prompt_len=19) == [AttentionSpan(0, 19, as_rows=True)]
    assert float_rows.attention_spans(16, 100, prompt_len=200) == [AttentionSpan(16, 100, as_rows=True)]
    assert before.attention_spans(16, 100, prompt_len=200) == [AttentionSpan(16, 100, as_rows=False)]
    assert "every prompt token attends as a row" in float_rows.describe()

    tables = [list(range(5)), list(range(5, 15))]  # 19 and 40 tokens in blocks of 4
    layout = BatchLayout([1, 1], [19, 40], tables, [4 * 4 + 2, 14 * 4 + 3], BLOCK_SIZE, frozenset({0}))
    assert layout.decodes == [1] and not layout.all_decode
    metadata = TorchSDPABackend().build_metadata(layout, torch.device("cpu"))
    assert [(s.start, s.end) for s in metadata.prefills] == [(0, 1)]


@torch.inference_mode()
def test_the_integer_gemms_panels_are_unpacked_at_load_within_their_share_of_memory(tiny, monkeypatch, caplog) -> None:
    """The plan keeps quantized weights' integer GEMM panels unpacked from load only if all of them
    fit GEMM_PANELS_MEMORY_FRACTION of the machine's memory: over it, none are (a log line says how
    much they would take), the plan does not claim them, and the GEMM unpacks per call."""
    import tokenmill.runner.plan as plan_module
    from tokenmill.model.layers import linear_weights

    cfg, tensors = tiny
    dense = cpu_native_plan(torch.bfloat16)
    monkeypatch.setattr(plan_module, "GEMM_PANELS_MEMORY_FRACTION", 1e-12)
    with caplog.at_level(logging.INFO, logger="tokenmill.runner.plan"):
        model, plan = _build(cfg, _checkpoint(tensors, "Q4_1"), quantized_plan(dense, "stored", integer_gemm=True),
                             "bfloat16")
    weights = linear_weights(model)
    assert not plan.gemm_panels and "panels" not in plan.describe()
    assert model.fused_layers[LAYER].gemm_panels == [] and all(getattr(w, "gemm_panels", None) is None for w in weights)
    needed = sum(w.gemm_panels_nbytes for w in weights)
    if kernels.quant_integer_gemm_built():
        assert needed == sum(w.qt.gemm_panels_nbytes for w in weights if hasattr(w, "qt")) > 0
        assert "the integer GEMM's panels would take" in caplog.text
    else:
        assert needed == 0


def test_with_the_integer_gemm_a_many_row_decode_step_runs_fused_with_the_per_op_bits(tiny) -> None:
    """A quantized plan on the whole-block integer GEMM runs pure decode steps of any size as
    the fused layer (its Python between the ops gone), handing the op the plan's integer rows
    and GEMM: a 24-row decode step (past the integer kernel's 8 rows) gives the op-by-op
    path's layer output and residual bit for bit, and is planned fused. A model with a float
    weight left keeps the fused layer to the integer rows (oneDNN is faster past them for it)."""
    from tokenmill.runner.plan import EVERY_ROW

    cfg, tensors = tiny
    dense = cpu_native_plan(torch.bfloat16)
    model, plan = _build(cfg, _checkpoint(tensors, "Q4_1"), quantized_plan(dense, "stored", integer_gemm=True), "bfloat16")
    assert plan.fused_decode and plan.fused_decode_max_rows == EVERY_ROW and "of any size" in plan.describe()
    rows = 24
    assert rows > max(ROWS.quant_integer_rows.values()) and plan.step_kind(rows, all_decode=True) is StepKind.FUSED
    assert model.fused_layers[LAYER].quantized_settings == ([ROWS.quant_integer_rows[4]] * 4, True)
    operands = model.fused_layers[LAYER]
    panels_built = kernels.quant_integer_gemm_built()
    assert plan.gemm_panels == panels_built and ("panels unpacked at load" in plan.describe()) == panels_built
    assert len(operands.gemm_panels) == (4 if panels_built else 0)

    block = 16
    gen = torch.Generator().manual_seed(11)
    context = [int(n) for n in torch.randint(5, 60, (rows,), generator=gen)]
    tables, next_block = [], 0
    for n in context:
        tables.append(list(range(next_block, next_block + -(-n // block))))
        next_block += len(tables[-1])
    slots = [tables[r][(n - 1) // block] * block + (n - 1) % block for r, n in enumerate(context)]
    layout = BatchLayout([1] * rows, context, tables, slots, block)
    h, residual = torch.randn(rows, cfg.hidden_size, generator=gen), torch.randn(rows, cfg.hidden_size, generator=gen)
    layer = model.layers[LAYER]
    rope = layer.self_attn.rotary.table(torch.tensor(context) - 1)
    backend = _backend("per-op").for_plan(plan.prefill_attention_dtype)
    history = (torch.randn(next_block * block, cfg.num_kv_heads, cfg.head_dim, generator=gen),
               torch.randn(next_block * block, cfg.num_kv_heads, cfg.head_dim, generator=gen))
    # The same step without the GEMM's panels unpacked at load: the op unpacks per call, same bits.
    unpacked = dataclasses.replace(operands, weights=[dataclasses.replace(w, gemm_panels=None) for w in operands.weights])
    assert unpacked.gemm_panels == []
    results = {}
    for kind, fused_operands in ((StepKind.FUSED, operands), (StepKind.PER_OP, None), ("unpacked", unpacked)):
        cache = LayerKVCache.allocate(next_block, block, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
        kernels.write_kv_cache(*history, (cache.k, cache.v), None, torch.arange(next_block * block))
        caches = [cache if i == LAYER else None for i in range(cfg.num_layers)]
        step_kind = StepKind.PER_OP if fused_operands is None else StepKind.FUSED
        ctx = ForwardContext.for_step(step_kind, backend, layout, caches, torch.device("cpu"))
        res = residual.clone()
        with forward_context(ctx):
            if fused_operands is not None:
                out = layer.fused_decode(fused_operands, rope, h.clone(), res, cache, ctx.decode)
            else:
                out, res = layer(rope, h.clone(), res)
        results[kind] = (out, res, cache.k.clone())
    fused, per_op = results[StepKind.FUSED], results[StepKind.PER_OP]
    assert all(torch.equal(a, b) for a, b in zip(fused, per_op))
    assert all(torch.equal(a, b) for a, b in zip(fused, results["unpacked"]))

    mixed = [(name, t) for name, t in _checkpoint(tensors, "Q4_1") if "self_attn.o_proj" not in name]
    mixed += [(name, t) for name, t in tensors.items() if "self_attn.o_proj" in name]  # o_proj stays bf16
    _, capped = _build(cfg, mixed, quantized_plan(dense, "stored", integer_gemm=True), "bfloat16")
    assert capped.fused_decode and capped.fused_decode_max_rows == min(ROWS.quant_integer_rows.values())
    assert capped.step_kind(rows, all_decode=True) is StepKind.PER_OP
