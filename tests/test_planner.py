"""tokenmill.planner: the roofline formulas as issue 16 states them, model shapes from
presets, config.json and GGUF headers, the device probe's record, and `tokenmill plan`."""

from __future__ import annotations

import json
import math

import pytest

from tokenmill.cli import main
from tokenmill.gguf_file import read_gguf_metadata
from tokenmill.model.loader import default_model_path
from tokenmill.planner import catalog, presets, roofline
from tokenmill.planner.machine import device_from_probe, measure, model_bounds
from tokenmill.planner.roofline import (
    GIB,
    KIB,
    KV_CACHE_DTYPES,
    Deployment,
    Device,
    Parallelism,
    attention_flops,
    compute_bound_batch,
    decode_step,
    experts_touched,
    kv_bytes_per_request,
    kv_bytes_per_token,
    param_counts,
    prefill_step,
    weight_bytes,
    weight_format,
)
from tokenmill.planner.model_spec import read_model
from tokenmill.planner.shape import read_gguf

BF16 = KV_CACHE_DTYPES["bfloat16"]
A100_2TB = Device("A100 at 2.0 TB/s", 80 * GIB, 2.0e12, {"bfloat16": 312e12})


def deployment(shape, fmt="bfloat16", device=A100_2TB, kv="bfloat16", parallel=None) -> Deployment:
    fmt = weight_format(fmt)
    params = param_counts(shape)
    return Deployment(shape, params, weight_bytes(params, fmt), KV_CACHE_DTYPES[kv], device, fmt.compute_dtype,
                      parallel or Parallelism())


def llama_params_by_hand(vocab, h, inter, layers, heads, kv_heads, head_dim, tied) -> int:
    """The issue's count: per layer q, k, v, o + a SwiGLU MLP + two norms; embedding, head, final norm."""
    attention = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    per_layer = attention + 3 * h * inter + 2 * h
    return layers * per_layer + vocab * h * (1 if tied else 2) + h


# ----- the worked figures ----------------------------------------------------------------


def test_llama3_70b_bf16_weights_are_140_gb_and_70_ms_per_token_on_an_a100() -> None:
    shape = presets.preset("llama-3.1-70b")
    params = llama_params_by_hand(128256, 8192, 28672, 80, 64, 8, 128, tied=False)
    weights = weight_bytes(param_counts(shape), weight_format("bf16"))
    assert weights.total == 2 * params
    assert weights.total / 1e9 == pytest.approx(140, rel=0.01)
    # Batch 1, empty cache: every weight but the embedding table is read once.
    step = decode_step(deployment(shape), batch=1, context=0)
    assert step.bytes == 2 * (params - 128256 * 8192)
    assert step.seconds == step.bytes / 2.0e12
    assert step.seconds == pytest.approx(0.070, rel=0.01)
    assert step.bound == "memory"


def test_llama3_8b_kv_cache_is_128_kib_per_token_and_half_a_gib_at_4k() -> None:
    shape = presets.preset("llama-3.1-8b")
    assert kv_bytes_per_token(shape, BF16) == 2 * 32 * 8 * 128 * 2 == 128 * KIB
    assert kv_bytes_per_request(shape, BF16, 4096) == GIB // 2


def test_llama3_70b_kv_cache_is_1_25_gib_at_4k_and_40_gib_at_128k() -> None:
    shape = presets.preset("llama-3.1-70b")
    assert kv_bytes_per_token(shape, BF16) == 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_request(shape, BF16, 4096) == 1.25 * GIB
    assert kv_bytes_per_request(shape, BF16, 131072) == 40 * GIB


def test_default_model_kv_per_token_in_each_cache_dtype() -> None:
    shape, _ = read_gguf(default_model_path())
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    values = 2 * 30 * 3 * 64
    assert kv_bytes_per_token(shape, KV_CACHE_DTYPES["float32"]) == 4 * values
    assert kv_bytes_per_token(shape, BF16) == 2 * values == 23040
    # An 8-bit cache adds one fp16 scale per token, layer, K/V and head.
    assert kv_bytes_per_token(shape, KV_CACHE_DTYPES["int8"]) == values + 2 * 30 * 3 * 2 == 11880


# ----- model shapes ---------------------------------------------------------------------------------


def test_gguf_header_gives_the_default_models_shape_and_exact_bytes() -> None:
    path = default_model_path()
    shape, stored = read_gguf(path)
    meta = read_gguf_metadata(path, "llama.")
    assert shape.architecture == "llama"
    assert shape.num_layers == meta["llama.block_count"]
    assert shape.hidden_size == meta["llama.embedding_length"]
    assert shape.intermediate_size == meta["llama.feed_forward_length"]
    assert shape.num_heads == meta["llama.attention.head_count"]
    assert shape.num_kv_heads == meta["llama.attention.head_count_kv"]
    assert shape.vocab_size == meta["llama.vocab_size"] == 49152
    assert shape.max_position_embeddings == meta["llama.context_length"]
    assert shape.tie_word_embeddings and not shape.is_moe
    # The tensors' element counts are what the formula gives for that shape.
    assert stored.params == param_counts(shape)
    # Bytes as stored: Q4_1 layers at 5 bits, the Q8_0 embedding at 8.5 bits, float32 norms.
    assert stored.bytes.attention == stored.params.attention * 5 // 8
    assert stored.bytes.mlp == stored.params.mlp * 5 // 8
    assert stored.bytes.embedding == stored.params.embedding * 17 // 16
    assert stored.bytes.layer_norms == 4 * stored.params.layer_norms
    assert stored.format_name.startswith("Q4_1")


def test_gguf_stored_bytes_agree_with_the_gguf_package() -> None:
    import gguf

    path = default_model_path()
    _, stored = read_gguf(path)
    assert stored.bytes.total == sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def write_gguf(path, arch: str, meta: dict, tensors: dict[str, tuple[int, ...]]) -> None:
    """A GGUF with llama.cpp's metadata keys and float32 tensors of the given (numpy) shapes."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_header_of_a_moe_model_with_qk_norms(tmp_path) -> None:
    h, vocab, heads, kv, d, experts, width = 64, 100, 4, 2, 16, 4, 32
    tensors = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h)}
    for i in range(2):
        tensors |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                    f"blk.{i}.attn_q.weight": (heads * d, h), f"blk.{i}.attn_k.weight": (kv * d, h),
                    f"blk.{i}.attn_v.weight": (kv * d, h), f"blk.{i}.attn_output.weight": (h, heads * d),
                    f"blk.{i}.attn_q_norm.weight": (d,), f"blk.{i}.attn_k_norm.weight": (d,),
                    f"blk.{i}.ffn_gate_inp.weight": (experts, h),
                    f"blk.{i}.ffn_gate_exps.weight": (experts, width, h),
                    f"blk.{i}.ffn_up_exps.weight": (experts, width, h),
                    f"blk.{i}.ffn_down_exps.weight": (experts, h, width)}
    meta = {"block_count": 2, "embedding_length": h, "feed_forward_length": 96, "attention.head_count": heads,
            "attention.head_count_kv": kv, "attention.key_length": d, "context_length": 256,
            "expert_count": experts, "expert_used_count": 2, "expert_feed_forward_length": width}
    write_gguf(tmp_path / "moe.gguf", "qwen3moe", meta, tensors)
    shape, stored = read_gguf(tmp_path / "moe.gguf")
    assert (shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size) == (experts, 2, width)
    assert shape.qk_norm and not shape.tie_word_embeddings and shape.head_dim == d
    assert stored.params == param_counts(shape)
    assert stored.params.experts == 2 * experts * 3 * h * width
    assert stored.bytes.total == 4 * stored.params.total


def test_gguf_header_of_an_mla_model_with_a_leading_dense_layer(tmp_path) -> None:
    h, vocab, heads, q_lora, kv_lora, rope, nope, v, experts, width = 64, 100, 4, 32, 16, 8, 16, 16, 4, 32
    tensors = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h)}
    for i in range(2):
        tensors |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                    f"blk.{i}.attn_q_a.weight": (q_lora, h), f"blk.{i}.attn_q_a_norm.weight": (q_lora,),
                    f"blk.{i}.attn_q_b.weight": (heads * (nope + rope), q_lora),
                    f"blk.{i}.attn_kv_a_mqa.weight": (kv_lora + rope, h), f"blk.{i}.attn_kv_a_norm.weight": (kv_lora,),
                    f"blk.{i}.attn_kv_b.weight": (heads * (nope + v), kv_lora),
                    f"blk.{i}.attn_output.weight": (h, heads * v)}
    tensors |= {"blk.0.ffn_gate.weight": (96, h), "blk.0.ffn_up.weight": (96, h), "blk.0.ffn_down.weight": (h, 96),
                "blk.1.ffn_gate_inp.weight": (experts, h), "blk.1.ffn_gate_exps.weight": (experts, width, h),
                "blk.1.ffn_up_exps.weight": (experts, width, h), "blk.1.ffn_down_exps.weight": (experts, h, width),
                "blk.1.ffn_gate_shexp.weight": (width, h), "blk.1.ffn_up_shexp.weight": (width, h),
                "blk.1.ffn_down_shexp.weight": (h, width)}
    meta = {"block_count": 2, "embedding_length": h, "feed_forward_length": 96, "attention.head_count": heads,
            "attention.head_count_kv": heads, "attention.key_length": kv_lora + rope,
            "attention.value_length": kv_lora, "attention.key_length_mla": nope + rope,
            "attention.value_length_mla": v, "attention.q_lora_rank": q_lora, "attention.kv_lora_rank": kv_lora,
            "rope.dimension_count": rope, "expert_count": experts, "expert_used_count": 2,
            "expert_feed_forward_length": width, "expert_shared_count": 1, "leading_dense_block_count": 1}
    write_gguf(tmp_path / "mla.gguf", "deepseek2", meta, tensors)
    shape, stored = read_gguf(tmp_path / "mla.gguf")
    assert shape.is_mla and (shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.v_head_dim) == (nope, rope, v)
    assert (shape.first_dense_layers, shape.shared_expert_intermediate_size) == (1, width)
    assert stored.params == param_counts(shape)
    assert kv_bytes_per_token(shape, BF16) == 2 * (kv_lora + rope) * 2


def test_gguf_sliding_window_pattern_flags(tmp_path) -> None:
    h, vocab = 32, 50
    tensors = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    for i in range(4):
        tensors |= {f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (h, h),
                    f"blk.{i}.attn_v.weight": (h, h), f"blk.{i}.attn_output.weight": (h, h),
                    f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                    f"blk.{i}.post_attention_norm.weight": (h,), f"blk.{i}.post_ffw_norm.weight": (h,),
                    f"blk.{i}.ffn_gate.weight": (64, h), f"blk.{i}.ffn_up.weight": (64, h),
                    f"blk.{i}.ffn_down.weight": (h, 64)}
    meta = {"block_count": 4, "embedding_length": h, "feed_forward_length": 64, "attention.head_count": 2,
            "attention.head_count_kv": 2, "attention.sliding_window": 8,
            "attention.sliding_window_pattern": [True, True, True, False]}
    write_gguf(tmp_path / "swa.gguf", "gemma3", meta, tensors)
    shape, stored = read_gguf(tmp_path / "swa.gguf")
    assert (shape.num_sliding_layers, shape.sliding_window, shape.norms_per_layer) == (3, 8, 4)
    assert shape.tie_word_embeddings and stored.params == param_counts(shape)
    assert kv_bytes_per_request(shape, BF16, 100) == (1 * 100 + 3 * 8) * 2 * 2 * 16 * 2


def test_gguf_block_bits_match_ggml_block_sizes() -> None:
    import gguf

    for name, bits in roofline.GGUF_BITS_PER_WEIGHT.items():
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert bits == 8 * size / block, name
        assert weight_format(name.lower()).bits_per_weight == bits


PUBLISHED = {  # total and active parameters from the model cards, in billions
    "llama-3.1-8b": (8.03, None), "llama-3.1-70b": (70.6, None), "llama-3.2-1b": (1.24, None),
    "llama-3.2-3b": (3.21, None), "qwen2.5-7b": (7.61, None), "qwen2.5-72b": (72.7, None),
    "qwen3-8b": (8.19, None), "qwen3-30b-a3b": (30.5, 3.3), "mistral-7b-v0.3": (7.25, None),
    "mixtral-8x7b": (46.7, 12.9), "gemma-3-270m": (0.268, None), "deepseek-v3": (671, 37),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_parameter_counts(name: str) -> None:
    shape = presets.preset(name)
    params = param_counts(shape)
    total, active = PUBLISHED[name]
    assert params.total / 1e9 == pytest.approx(total, rel=0.015)
    assert roofline.active_params(params, shape) / 1e9 == pytest.approx(active or total, rel=0.025)


def test_llama_preset_counts_are_the_hand_formula() -> None:
    assert param_counts(presets.preset("llama-3.2-1b")).total == llama_params_by_hand(
        128256, 2048, 8192, 16, 32, 8, 64, tied=True)


def test_every_preset_has_a_notes_line_for_what_the_formulas_simplify() -> None:
    for shape in presets.PRESETS.values():
        if shape.is_moe or shape.is_mla or shape.num_sliding_layers:
            assert shape.notes, shape.name


def test_hf_config_json_dense_moe_and_multimodal(tmp_path) -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    directory = tmp_path / "Llama-3.1-8B"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(llama))
    spec = read_model(str(directory))
    assert spec.shape.name == "Llama-3.1-8B" and spec.checkpoint_format == "bfloat16"
    assert param_counts(spec.shape) == param_counts(presets.preset("llama-3.1-8b"))

    moe = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
           "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "tie_word_embeddings": False,
           "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64}}
    (tmp_path / "moe.json").write_text(json.dumps(moe))
    spec = read_model(str(tmp_path / "moe.json"))
    assert spec.checkpoint_format == "int4-g64"
    assert param_counts(spec.shape) == param_counts(presets.preset("qwen3-30b-a3b"))

    gemma = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "text_config": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376,
                             "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
                             "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
                             "sliding_window_pattern": 6}}
    (tmp_path / "gemma.json").write_text(json.dumps(gemma))
    shape = read_model(str(tmp_path / "gemma.json")).shape
    assert (shape.num_sliding_layers, shape.sliding_window, shape.tie_word_embeddings) == (52, 1024, True)
    assert param_counts(shape) == param_counts(presets.preset("gemma-3-27b"))


# ----- the formulas ---------------------------------------------------------------------------------


def test_int4_group_bits_count_the_scale_and_zero_point() -> None:
    assert weight_format("int4").bits_per_weight == 4 + (16 + 4) / 128
    assert weight_format("int4-g32").bits_per_weight == 4 + 20 / 32
    params = param_counts(presets.preset("llama-3.1-8b"))
    int4 = weight_bytes(params, weight_format("int4-g32"))
    assert int4.attention == math.ceil(params.attention * 4.625 / 8)
    assert int4.embedding == 2 * params.embedding  # kept in bf16


def test_sliding_window_layers_stop_growing_past_the_window() -> None:
    shape = presets.preset("gemma-3-27b")
    per_layer_token = 2 * 16 * 128 * 2
    assert kv_bytes_per_request(shape, BF16, 1000) == 62 * 1000 * per_layer_token
    assert kv_bytes_per_request(shape, BF16, 32768) == (10 * 32768 + 52 * 1024) * per_layer_token


def test_mla_caches_the_latent_once_per_layer() -> None:
    shape = presets.preset("deepseek-v3")
    assert kv_bytes_per_token(shape, BF16) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(shape, BF16, Parallelism(tensor_parallel_size=8)) == 61 * 576 * 2


def test_tensor_parallel_splits_kv_heads_and_replicates_past_their_count() -> None:
    shape = presets.preset("llama-3.1-70b")
    whole = kv_bytes_per_token(shape, BF16)
    assert kv_bytes_per_token(shape, BF16, Parallelism(4)) == whole // 4
    assert kv_bytes_per_token(shape, BF16, Parallelism(16)) == whole // 8  # one KV head per rank
    assert kv_bytes_per_token(shape, BF16, Parallelism(1, 4)) == whole // 4  # 20 layers per stage


def test_attention_flops_decode_and_causal_prefill() -> None:
    shape = presets.preset("llama-3.1-8b")
    per_key = 2 * 32 * (128 + 128) * 32
    assert attention_flops(shape, 1, 4095) == per_key * 4096
    assert attention_flops(shape, 100) == per_key * 100 * 101 // 2
    assert attention_flops(shape, 10, 90) == per_key * sum(range(91, 101))
    window = presets.preset("gemma-3-270m")  # 3 global layers, 15 through a 512 window
    per_key = 2 * 4 * 512
    assert attention_flops(window, 1, 999) == per_key * (3 * 1000 + 15 * 512)
    assert attention_flops(window, 600) == per_key * (3 * 600 * 601 // 2 + 15 * (512 * 513 // 2 + 512 * 88))


def test_moe_reads_the_experts_its_tokens_touch() -> None:
    assert experts_touched(8, 2, 1) == pytest.approx(2)
    assert experts_touched(128, 8, 10_000) == pytest.approx(128)
    assert experts_touched(8, 2, 3) == pytest.approx(8 * (1 - 0.75**3))
    shape = presets.preset("mixtral-8x7b")
    dep = deployment(shape)
    w = dep.weights
    one = decode_step(dep, 1, 0)
    assert one.bytes == pytest.approx(w.layers - w.experts + w.experts / 4 + w.lm_head + w.final_norm)
    assert decode_step(dep, 64, 0).bytes == pytest.approx(w.total - w.embedding, rel=1e-6)


def test_compute_bound_batch_is_the_dense_closed_form() -> None:
    shape = presets.preset("llama-3.1-8b")
    device = catalog.device("h100-sxm")
    dep = deployment(shape, device=device)
    weights = decode_step(dep, 1, 0).bytes
    flops_per_sequence = decode_step(dep, 1, 0).flops
    expected = math.ceil((weights / device.bandwidth) / (flops_per_sequence / device.flops["bfloat16"]))
    assert compute_bound_batch(dep, 0) == expected
    assert decode_step(dep, expected, 0).bound == "compute"
    assert decode_step(dep, expected - 1, 0).bound == "memory"
    # At a long context the KV reads (4 bytes per 8 FLOPs under GQA 4:1) outgrow the FLOPs.
    assert compute_bound_batch(dep, 8192) is None


def test_prefill_is_compute_bound_at_two_flops_per_active_weight() -> None:
    shape = presets.preset("llama-3.1-8b")
    dep = deployment(shape, device=catalog.device("a100-80gb"))
    params = dep.params
    step = prefill_step(dep, batch=1, prompt_len=2048)
    linear = 2 * (params.layers) * 2048
    assert step.flops == linear + attention_flops(shape, 2048) + 2 * 128256 * 4096
    assert step.seconds == step.flops / 312e12 and step.bound == "compute"


def test_tensor_parallel_adds_the_ring_allreduce_when_a_link_is_given() -> None:
    shape = presets.preset("llama-3.1-70b")
    device = catalog.device("h100-sxm")
    plain = decode_step(deployment(shape, device=device, parallel=Parallelism(4)), 8, 1024)
    linked = decode_step(deployment(shape, device=device, parallel=Parallelism(4, 1, 450e9, 5e-6)), 8, 1024)
    message = 8 * 8192 * 2
    assert linked.comm_s == pytest.approx(2 * 80 * (2 * 3 * 5e-6 + 2 * 3 / 4 * message / 450e9))
    assert linked.seconds == pytest.approx(plain.seconds + linked.comm_s)
    assert plain.bytes == pytest.approx(decode_step(deployment(shape, device=device), 8, 1024).bytes / 4, rel=1e-3)


def test_unknown_names_list_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown weight format 'q4_k_m'.*file mix.*choose from float32"):
        weight_format("q4_k_m")
    with pytest.raises(ValueError, match="unknown device 'h300'; choose from H100-SXM, H200"):
        catalog.device("h300")
    with pytest.raises(ValueError, match="unknown preset 'llama-5'; choose from llama-3.1-8b"):
        presets.preset("llama-5")
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int3'; choose from auto"):
        roofline.kv_cache_dtype("int3", weight_format("bf16"))
    with pytest.raises(ValueError, match="FLOP/s are needed"):
        Device("empty", GIB, 1e9, {})


# ----- this machine --------------------------------------------------------------------------------


def test_probe_returns_a_device_record_like_the_catalogs() -> None:
    result = measure(threads=1, mem_mib=16, gemm_n=128, reps=1)
    for key in ("sum_gb_s", "gemv_gb_s", "bandwidth_gb_s", "gemm_float32_gflop_s", "gemm_bfloat16_gflop_s"):
        assert result[key] > 0, key
    device = device_from_probe(result)
    assert isinstance(device, Device) and device.kind == "cpu"
    assert device.bandwidth == result["bandwidth_gb_s"] * 1e9
    assert device.compute_rate("int8") == (result["gemm_bfloat16_gflop_s"] * 1e9, "bfloat16")
    assert Device.from_dict(device.to_dict()) == device


def test_model_bounds_are_the_roofline_at_batch_one() -> None:
    machine = {"threads": 2, "sum_gb_s": 20.0, "gemv_gb_s": 25.0, "bandwidth_gb_s": 25.0,
               "gemm_float32_gflop_s": 100.0, "gemm_bfloat16_gflop_s": 400.0}
    shape, stored = read_gguf(default_model_path())
    p = param_counts(shape)
    bounds = model_bounds(machine, default_model_path())
    read = p.layers + p.final_norm + p.lm_head
    assert bounds["decode_params_read_per_step"] == read
    assert bounds["decode_tok_s_float32"] == 25e9 / (4 * read)
    assert bounds["decode_tok_s_bfloat16"] == 25e9 / (2 * read)
    assert bounds["prefill_tok_s_bfloat16"] == 400e9 / (2 * p.layers)
    assert bounds["gguf_decode_bytes_per_step"] == stored.bytes.total  # tied: the embedding is the head


# ----- tokenmill plan ------------------------------------------------------------------------------


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_json_for_a_preset_on_a_catalog_device(capsys) -> None:
    rc, out, _ = run_plan(capsys, "llama-3.1-8b", "--device", "a100-80gb", "--weights", "bf16",
                          "--context-len", "4096", "--max-batch", "64", "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["kv"]["bytes_per_token"] == 128 * KIB
    assert plan["kv"]["bytes_per_request"] == GIB // 2
    budget = (80 * GIB - plan["memory"]["weights_bytes"]) // 2  # the engine's default on a GPU
    assert plan["memory"]["kv_budget_bytes_per_device"] == budget
    assert plan["kv"]["max_concurrent_requests"] == int(budget // (GIB // 2))
    assert [row["batch"] for row in plan["batches"]] == [1, 2, 4, 8, 16, 32, 64]
    for row in plan["batches"]:
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / row["tpot_s"])
        assert row["kv_fits"]
    assert plan["compute_bound_batch"]["empty_cache"] > 64
    # vLLM's rule when asked for, with the new spellings of the flags.
    rc, out, _ = run_plan(capsys, "llama-3.1-8b", "--target-device", "a100-80gb", "--weights", "bf16",
                          "--max-model-len", "4096", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.9",
                          "--json")
    plan = json.loads(out)
    assert plan["memory"]["kv_budget_bytes_per_device"] == 0.9 * 80 * GIB - plan["memory"]["weights_bytes"]


def test_plan_flags_are_the_engines_settings_with_the_engines_defaults(capsys) -> None:
    """The flags that mean engine settings are config.py's (same defaults as `serve`): the
    model's whole context, 64 sequences, the engine's KV memory on the target device."""
    from tokenmill.cli import build_parser
    from tokenmill.config import EngineConfig, default_kv_cache_memory

    args = build_parser().parse_args(["plan"])
    config = EngineConfig()
    assert args.max_model_len == config.model.max_model_len is None
    assert args.max_num_seqs == config.scheduler.max_num_seqs == 64
    assert args.kv_cache_memory == config.cache.kv_cache_memory is None
    assert args.kv_cache_dtype == config.cache.kv_cache_dtype == "auto"
    assert args.tensor_parallel_size == args.pipeline_parallel_size == 1 and args.target_device == "this"
    rc, out, _ = run_plan(capsys, "--target-device", "epyc-9654", "--json")
    plan = json.loads(out)
    assert plan["kv"]["context_len"] == 8192 == plan["model"]["max_position_embeddings"]  # as serve's
    device = plan["device"]["memory_bytes"]
    assert plan["memory"]["kv_budget_bytes_per_device"] == default_kv_cache_memory(False, device, device) == 2 * GIB
    assert plan["batches"][-1]["batch"] == 64
    with pytest.raises(SystemExit):  # the engine's choices
        build_parser().parse_args(["plan", "--kv-cache-dtype", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_plan_text_with_tensor_parallelism_and_a_kv_budget(capsys) -> None:
    rc, out, _ = run_plan(capsys, "llama-3.1-70b", "--device", "h100-sxm", "--tensor-parallel-size", "4",
                          "--kv-cache-memory", "10GiB", "--max-batch", "16", "--context-len", "4096")
    assert rc == 0
    assert "4 x H100-SXM (TP 4)" in out
    assert "320 KiB per token (80 KiB per device)" in out
    assert "1.25 GiB per request of 4,096 tokens (320 MiB per device)" in out
    assert "at most 32 concurrent requests" in out  # 10 GiB / 320 MiB
    assert "TPOT ms" in out and "TTFT ms" in out


def test_plan_default_model_as_stored_with_a_plot(capsys, tmp_path) -> None:
    png = tmp_path / "plan.png"
    rc, out, err = run_plan(capsys, "--device", "epyc-9654", "--max-batch", "8", "--json", "--plot", str(png))
    assert rc == 0
    plan = json.loads(out)
    _, stored = read_gguf(default_model_path())
    assert plan["memory"]["weights_bytes"] == stored.bytes.total
    assert plan["settings"]["weights"].startswith("Q4_1")
    assert plan["kv"]["bytes_per_token"] == 23040
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_reads_a_device_json_file(capsys, tmp_path) -> None:
    device = Device("my box", 64 * GIB, 100e9, {"float32": 2e12, "bfloat16": 8e12}, "cpu", "hand-written")
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"device": device.to_dict()}))
    rc, out, _ = run_plan(capsys, "qwen3-8b", "--device", str(path), "--weights", "q8_0", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["device"]["name"] == "my box"
    assert plan["settings"]["compute_dtype"] == "bfloat16"  # int8 falls back to the bf16 rate
    assert any("no int8 figure" in note for note in plan["notes"])


def test_plan_weights_that_do_not_fit_leave_no_requests(capsys) -> None:
    rc, out, _ = run_plan(capsys, "llama-3.1-70b", "--device", "l4", "--max-batch", "4", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["kv"]["max_concurrent_requests"] == 0
    assert not any(row["kv_fits"] for row in plan["batches"])
    assert any("leave no KV memory" in note for note in plan["notes"])


@pytest.mark.parametrize("args, message", [
    (["llama-3.1-8b", "--device", "h300"], "unknown device 'h300'; choose from H100-SXM"),
    (["llama-5"], "unknown model 'llama-5': neither a preset (llama-3.1-8b"),
    (["llama-3.1-8b", "--device", "l4", "--weights", "int3"], "unknown weight format 'int3'; choose from"),
    (["llama-3.2-1b", "--device", "l4", "-pp", "32"], "pipeline-parallel-size (32) exceeds the model's 16 layers"),
    (["llama-3.1-8b", "--device", "l4", "--context-len", "0"], "context-len must be at least 1"),
])
def test_plan_errors_name_the_choices(capsys, args, message) -> None:
    rc, out, err = run_plan(capsys, *args)
    assert rc == 2 and out == ""
    assert message in err


def test_plan_help_and_list(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--tensor-parallel-size" in out and "--kv-cache-dtype" in out
    rc, out, _ = run_plan(capsys, "--list")
    assert rc == 0
    for name in ("llama-3.1-70b", "deepseek-v3", "h100-sxm", "mi300x", "epyc-9654", "xeon-8480+", "q6_k", "int4-g32"):
        assert name in out


def test_planner_modules_do_not_import_torch() -> None:
    import subprocess
    import sys

    modules = ["roofline", "shape", "presets", "catalog", "machine", "plan", "cli", "costmodel"]
    code = "import sys\n" + "".join(f"import tokenmill.planner.{m}\n" for m in modules) + "print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_arch_config_and_planner_read_a_config_json_alike() -> None:
    from tokenmill.model_arch import ModelArchConfig
    from tokenmill.planner.shape import ModelShape, shape_from_hf_config

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "max_position_embeddings": 32768, "tie_word_embeddings": False,
           "use_sliding_window": False, "sliding_window": 131072}
    from_arch = ModelShape.from_arch_config(ModelArchConfig.from_hf_config(cfg), "Qwen2.5-7B")
    assert param_counts(from_arch) == param_counts(shape_from_hf_config(cfg, "Qwen2.5-7B"))
    assert param_counts(from_arch) == param_counts(presets.preset("qwen2.5-7b"))
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
           "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
           "num_experts_per_tok": 8, "norm_topk_prob": True, "tie_word_embeddings": False}
    from_arch = ModelShape.from_arch_config(ModelArchConfig.from_hf_config(moe), "Qwen3-30B-A3B")
    assert from_arch.is_moe and param_counts(from_arch) == param_counts(shape_from_hf_config(moe, "Qwen3-30B-A3B"))


# ----- the step cost model (for the simulator) ------------------------------------------------------


def synthetic_steps(truth, noise: float = 0.0, seed: int = 0):
    import random

    from tokenmill.planner.costmodel import StepFeatures

    rng = random.Random(seed)
    steps = []
    for prefill in (0, 16, 128, 512):
        for decode in (0, 1, 8, 32):
            if prefill == decode == 0:
                continue
            context = decode * rng.randrange(16, 2048)
            step = StepFeatures(prefill, decode, context)
            steps.append((step, truth.predict(step) * (1 + rng.uniform(-noise, noise))))
    return steps


def test_cost_model_fit_recovers_known_coefficients() -> None:
    from tokenmill.planner.costmodel import StepCostModel, fit_step_cost_model

    truth = StepCostModel(0.012, 0.0009, 0.0004, 2.5e-7)
    fit = fit_step_cost_model(synthetic_steps(truth))
    for name, value in truth.to_dict().items():
        assert getattr(fit.model, name) == pytest.approx(value, rel=1e-9), name
    assert fit.max_relative_error < 1e-9
    noisy = fit_step_cost_model(synthetic_steps(truth, noise=0.05, seed=1))
    assert noisy.max_relative_error <= 0.11  # the fit is at most the noise off, both ways
    assert noisy.model.intercept_s == pytest.approx(truth.intercept_s, rel=0.15)
    assert noisy.model.per_prefill_token_s == pytest.approx(truth.per_prefill_token_s, rel=0.1)
    assert StepCostModel.from_dict(noisy.model.to_dict()) == noisy.model


def test_cost_model_fit_keeps_coefficients_non_negative() -> None:
    from tokenmill.planner.costmodel import StepCostModel, fit_step_cost_model

    import numpy as np

    from tokenmill.planner.costmodel import _nonnegative_least_squares

    # min (x1 - 1)^2 + (x2 + 1)^2 + (x1 + x2)^2: unconstrained (1, -1), with x >= 0 (0.5, 0).
    a, b = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), np.array([1.0, -1.0, 0.0])
    assert np.allclose(np.linalg.lstsq(a, b, rcond=None)[0], [1.0, -1.0])
    assert np.allclose(_nonnegative_least_squares(a, b), [0.5, 0.0])
    # No context term, and noise that pulls an unconstrained fit below zero (seed 0).
    truth = StepCostModel(0.010, 0.001, 0.0005, 0.0)
    samples = synthetic_steps(truth, noise=0.08, seed=0)
    x = np.array([step.vector() for step, _ in samples]) / np.array([[t] for _, t in samples])
    assert np.linalg.lstsq(x, np.ones(len(samples)), rcond=None)[0][3] < 0
    fit = fit_step_cost_model(samples)
    assert fit.model.per_context_token_s == 0.0
    assert all(value >= 0 for value in fit.model.to_dict().values())
    assert fit.median_relative_error < 0.08


def test_cost_model_fit_refuses_samples_that_cannot_fit_it() -> None:
    from tokenmill.planner.costmodel import StepCostModel, StepFeatures, fit_step_cost_model

    with pytest.raises(ValueError, match="at least 4 samples"):
        fit_step_cost_model([(StepFeatures(1, 1, 1), 0.1)])
    decode_only = [(StepFeatures(0, b, 100 * b), 0.01 * b) for b in range(1, 9)]
    with pytest.raises(ValueError, match="no sample has prefill tokens"):
        fit_step_cost_model(decode_only)
    fixed_context = [(StepFeatures(p, b, 64 * b), 0.01 + 0.001 * p + 0.002 * b) for p in (0, 8) for b in (1, 2, 3)]
    with pytest.raises(ValueError, match="cannot tell the 4 coefficients apart"):
        fit_step_cost_model(fixed_context)
    with pytest.raises(ValueError, match="positive and finite"):
        fit_step_cost_model(synthetic_steps(StepCostModel(0.0, 0.0, 0.0, 0.0)))
    with pytest.raises(ValueError, match="missing per_context_token_s"):
        StepCostModel.from_dict({"intercept_s": 1, "per_prefill_token_s": 1, "per_decode_token_s": 1})


def test_planner_kv_bytes_match_the_engines_kv_cache_spec() -> None:
    import torch

    from tokenmill.attention.kv_cache import KVCacheSpec

    shape, _ = read_gguf(default_model_path())
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.int8, "int8"),
                        (torch.float8_e4m3fn, "fp8_e4m3")):
        spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, 16, dtype)
        assert spec.bytes_per_token == kv_bytes_per_token(shape, KV_CACHE_DTYPES[name])


def test_cost_model_decode_curve_fits_steps_that_are_not_linear_in_rows() -> None:
    """Pure decode steps that grow as sqrt(rows) (a runner switching kernels with the batch):
    the linear model misses them, the curve fits each profiled batch size exactly and
    interpolates between them; prefill and mixed steps keep the linear terms."""
    from tokenmill.planner.costmodel import StepCostModel, StepFeatures, decode_curve_value, fit_step_cost_model

    def truth(step: StepFeatures) -> float:
        if step.prefill_tokens == 0:
            return 0.05 * step.decode_tokens ** 0.5 + 1e-6 * step.decode_context
        return 0.04 + 0.002 * step.prefill_tokens + 0.003 * step.decode_tokens + 1e-6 * step.decode_context \
            + 2e-8 * step.prefill_attention

    steps = [StepFeatures(0, b, b * c) for b in (1, 4, 16, 64) for c in (10, 100, 1000)]
    steps += [StepFeatures(p, d, d * 50, p * (p + 1) // 2) for p in (16, 128, 512) for d in (0, 4, 16)]
    samples = [(step, truth(step)) for step in steps]
    linear = fit_step_cost_model(samples, prefill_attention=True)
    curved = fit_step_cost_model(samples, prefill_attention=True, decode_curve=True)
    assert linear.max_relative_error > 0.1
    assert curved.max_relative_error < 1e-9
    model = curved.model
    assert model.decode_rows == (1, 4, 16, 64)
    assert model.decode_seconds == pytest.approx([0.05, 0.1, 0.2, 0.4])
    assert model.per_prefill_pair_s == pytest.approx(2e-8) and model.per_decode_token_s == pytest.approx(0.003)
    # Between profiled sizes: linear interpolation; past the last, its segment extended.
    assert model.predict(StepFeatures(0, 10, 0)) == pytest.approx(0.15)
    assert model.predict(StepFeatures(0, 100, 0)) == pytest.approx(0.4 + 0.2 / 48 * 36)
    assert decode_curve_value((1,), (0.3,), 7) == 0.3
    assert StepCostModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError, match="needs at least 3 pure decode steps"):
        fit_step_cost_model(samples[12:], decode_curve=True)
    with pytest.raises(ValueError, match="increasing batch sizes"):
        StepCostModel(0, 0, 0, 0, decode_rows=(4, 2), decode_seconds=(0.1, 0.2))
