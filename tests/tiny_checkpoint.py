"""Tiny random checkpoints on disk (config.json, model.safetensors, a word-level
tokenizer): Llama, Gemma 3 and mixtures of experts, for tests whose worker processes load
the model by path."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>"]


def write_tiny_llama(directory: Path, *, tie: bool = True, num_kv_heads: int = 3, seed: int = 0,
                     **overrides) -> Path:
    """6 query heads over `num_kv_heads` KV heads (3: TP = 2 splits them unevenly, TP = 3
    and 6 evenly), head_dim 16, 4 layers, MLP 192, vocabulary 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    settings = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=4,
                    num_attention_heads=6, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
                    initializer_range=0.2, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    config = LlamaConfig(**{**settings, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms and a wider embedding, so a mis-split shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


def write_tiny_gemma3(directory: Path, *, window: int = 16, seed: int = 0) -> Path:
    """A tiny random Gemma 3 text model: 4 layers (the 3rd global, the others sliding over
    `window` tokens), 4 query heads over 2 KV heads of 32, with the same word-level tokenizer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=window,
                              layer_types=layer_types, max_position_embeddings=1024, initializer_range=0.1,
                              query_pre_attn_scalar=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)  # Gemma's norms scale by 1 + w
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


def tiny_moe_model(family: str, *, seed: int = 0, **overrides):
    """A tiny random mixture-of-experts model of `family` (transformers): 2 layers, 4 query
    heads over 2 KV heads, 8 experts of width 32, 2 per token; Qwen3-MoE with its
    renormalised top-k, OLMoE with clip_qkv, Mixtral as its config always is."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, num_experts_per_tok=2)
    config, model = {
        "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**{**common, "head_dim": 32, "intermediate_size": 96,
                                                             "moe_intermediate_size": 32, "num_experts": 8,
                                                             "norm_topk_prob": True, **overrides}),
                      transformers.Qwen3MoeForCausalLM),
        "mixtral": (lambda: transformers.MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": 8,
                                                          **overrides}), transformers.MixtralForCausalLM),
        "olmoe": (lambda: transformers.OlmoeConfig(**{**common, "intermediate_size": 32, "num_experts": 8,
                                                      "clip_qkv": 2.0, **overrides}), transformers.OlmoeForCausalLM),
    }[family]
    hf = model(config()).eval()
    with torch.no_grad():  # non-trivial norms, so a norm loaded wrongly shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf


def write_tiny_moe(directory: Path, family: str, *, seed: int = 0, **overrides) -> Path:
    """`tiny_moe_model` saved as a checkpoint (per-expert tensors, as save_pretrained writes
    them) with the word-level tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_moe_model(family, seed=seed, **overrides).save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }))
