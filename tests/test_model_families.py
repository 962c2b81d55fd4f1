"""Qwen3 and Gemma 3 against Hugging Face transformers on tiny random configs, and
sliding-window attention through the paged backends against the dense reference."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM as HFGemma3, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM as HFQwen3

from tokenmill.model_arch import FULL, SLIDING, ModelArchConfig
from tokenmill.model.llama import LlamaForCausalLM
from tests.test_model import _paged_logits

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
            rms_norm_eps=1e-6)


def _randomize_norms(model: torch.nn.Module, low: float, high: float) -> None:
    """Non-trivial norm weights, so a norm loaded wrongly (or Gemma's 1 + w missed) shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(low, high)


def hf_qwen3(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = HFQwen3(Qwen3Config(**{**TINY, "tie_word_embeddings": False, **overrides})).eval()
    _randomize_norms(model, 0.5, 1.5)
    return model


def hf_gemma3(window: int = 8, **overrides) -> torch.nn.Module:
    """4 layers, the 3rd global (sliding_window_pattern 3), window of 8 tokens, local and
    global RoPE bases apart, a query scalar unlike head_dim, final soft-capping."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**{**TINY, "num_hidden_layers": 4, "sliding_window": window,
                              "layer_types": [SLIDING, SLIDING, FULL, SLIDING],
                              "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1e6},
                                                  SLIDING: {"rope_type": "default", "rope_theta": 1e4}},
                              "query_pre_attn_scalar": 48, "final_logit_softcapping": 5.0,
                              "initializer_range": 0.1, **overrides})
    model = HFGemma3(cfg).eval()
    _randomize_norms(model, -0.5, 0.5)  # Gemma's norms scale by (1 + w)
    return model


def ours_from(hf: torch.nn.Module) -> LlamaForCausalLM:
    arch = ModelArchConfig.from_hf_config(hf.config.to_dict())
    ours = LlamaForCausalLM(arch).eval()
    ours.load_weights(hf.state_dict().items())
    return ours


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _check_logits_and_greedy(hf: torch.nn.Module, ours: LlamaForCausalLM, prompt_len: int, new_tokens: int) -> None:
    ids = _ids(prompt_len, 1)
    torch.testing.assert_close(ours.compute_logits(ours(ids, torch.arange(prompt_len))), hf(ids.unsqueeze(0)).logits[0],
                               atol=1e-4, rtol=1e-4)
    expected = hf.generate(ids.unsqueeze(0), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    seq = ids.tolist()
    for _ in range(new_tokens):
        logits = ours.compute_logits(ours(torch.tensor(seq), torch.arange(len(seq))))
        seq.append(int(logits[-1].argmax()))
    assert seq == expected[0].tolist()


def test_qwen3_matches_transformers() -> None:
    hf = hf_qwen3()
    ours = ours_from(hf)
    assert ours.cfg.architecture == "qwen3" and ours.cfg.qk_norm and not ours.cfg.attention_bias
    _check_logits_and_greedy(hf, ours, prompt_len=30, new_tokens=8)


def test_gemma3_matches_transformers_past_the_window() -> None:
    """A sequence of 40 tokens over a window of 8: the sliding layers must drop the rest."""
    hf = hf_gemma3()
    ours = ours_from(hf)
    cfg = ours.cfg
    assert [cfg.layer_window(i) for i in range(4)] == [8, 8, None, 8]
    assert cfg.rope_local_theta == 1e4 and cfg.rope_theta == 1e6 and cfg.final_logit_softcapping == 5.0
    _check_logits_and_greedy(hf, ours, prompt_len=40, new_tokens=8)


def test_gemma3_legacy_config_keys() -> None:
    """Older configs: sliding_window_pattern and rope_local_base_freq instead of
    layer_types and per-type rope_parameters."""
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **TINY, "num_hidden_layers": 6,
           "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "query_pre_attn_scalar": 256}
    arch = ModelArchConfig.from_hf_config(cfg)
    assert arch.layer_types == (SLIDING,) * 5 + (FULL,)
    assert arch.rope_theta == 1e6 and arch.rope_local_theta == 1e4 and arch.attention_scale == 256**-0.5
    assert arch.norm_weight_offset == 1.0 and arch.hidden_act == "gelu_tanh"


def test_attention_softcapping_is_refused() -> None:
    cfg = {"architectures": ["Gemma3ForCausalLM"], **TINY, "attn_logit_softcapping": 50.0}
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelArchConfig.from_hf_config(cfg)


@pytest.mark.parametrize("backend_name", ["torch_sdpa", "cpu_native"])
@pytest.mark.parametrize("chunks", [
    [[20, 7, 30], [6, 0, 5], [1, 1, 1], [1, 1, 1]],  # prefill chunks past the window, then decodes past it
    [[3, 3, 3], [15, 10, 20], [1, 1, 1], [5, 1, 1], [1, 0, 1]],  # a chunk bigger than the window over a context
], ids=["long-chunks", "mixed"])
@torch.inference_mode()
def test_gemma3_paged_equals_dense(backend_name: str, chunks: list[list[int]]) -> None:
    """The sliding-window paged paths (prefill chunks narrowed to the window, decodes past
    it: the native backend's padded fallback) against the dense reference."""
    model = ours_from(hf_gemma3())
    gen = torch.Generator().manual_seed(4)
    lens = [sum(step[r] for step in chunks) for r in range(3)]
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lens]
    dense = [model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq)))) for seq in seqs]
    paged = _paged_logits(model, seqs, chunks, backend_name)
    for expected, got in zip(dense, paged):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_qwen3_paged_fused_plan_is_not_used() -> None:
    """q/k norms are not in the fused native decode layer: the plan must not pick it."""
    from tokenmill.runner.plan import apply_plan, cpu_native_plan

    model = ours_from(hf_qwen3())
    plan = apply_plan(model, cpu_native_plan(torch.float32))
    assert not plan.fused_decode
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 12)]
    chunks = [[8, 11], [1, 1]]
    dense = [model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq)))) for seq in seqs]
    for expected, got in zip(dense, _paged_logits(model, seqs, chunks, "cpu_native", plan=plan)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _write_qwen3_gguf(hf: torch.nn.Module, path) -> None:
    """The Hugging Face model's tensors as float32 GGUF tensors under llama.cpp's names
    (gguf's own map), with a placeholder sentencepiece vocabulary of the model's size."""
    import gguf

    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"p{i}" for i in range(cfg.vocab_size - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 259)])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.inference_mode()
def test_qwen3_from_gguf_matches_transformers(tmp_path) -> None:
    """GGUF architecture `qwen3`: blk.N.attn_q_norm / attn_k_norm find their places."""
    from tokenmill.model.loader import load_model

    hf = hf_qwen3()
    _write_qwen3_gguf(hf, tmp_path / "qwen3.gguf")
    loaded = load_model(str(tmp_path / "qwen3.gguf"), "float32", torch.device("cpu"))
    assert loaded.arch.architecture == "qwen3" and loaded.arch.qk_norm
    ids = _ids(30, 3)
    torch.testing.assert_close(loaded.model.compute_logits(loaded.model(ids, torch.arange(30))),
                               hf(ids.unsqueeze(0)).logits[0], atol=1e-4, rtol=1e-4)
