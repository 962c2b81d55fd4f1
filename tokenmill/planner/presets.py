"""Popular architectures as `ModelShape`s, from their Hugging Face config.json files.

Shapes only: a preset plans a model without its checkpoint. Parameter counts follow from
`roofline.param_counts` and match the published totals (Llama 3.1 8B 8.03B, 70B 70.55B;
Mixtral 8x7B 46.7B total / 12.9B active; Qwen3-30B-A3B 30.5B / 3.3B; DeepSeek-V3 671B /
37.6B). What the formulas simplify for MoE, MLA and sliding windows is said in each
preset's `notes` and in `roofline`'s docstring.
"""

from __future__ import annotations

from tokenmill.planner.shape import ModelShape

_MOE_NOTE = ("MoE: a step reads the experts its tokens pick, E x (1 - (1 - k/E)^tokens) per layer under "
             "uniform routing; real routers are skewed (fewer distinct experts), and expert parallelism is not modeled")
_MLA_NOTE = ("MLA: the KV cache is the compressed latent (kv_lora_rank + qk_rope_head_dim = 576 values per "
             "token and layer, K and V together), replicated on every TP rank; attention FLOPs are counted "
             "without absorbing the up-projections; the multi-token-prediction module (14B) is left out")
_GEMMA_NOTE = ("Gemma 3: 5 of every 6 layers attend through a sliding window, so past the window only 1 layer "
               "in 6 keeps growing its KV cache; the vision tower of the 4B/27B models is not counted")


def _llama(name: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           head_dim: int = 128, tied: bool = False, max_pos: int = 131072, **extra) -> ModelShape:
    return ModelShape(name=name, architecture=extra.pop("architecture", "llama"), vocab_size=vocab,
                      hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tied,
                      max_position_embeddings=max_pos, **extra)


PRESETS: dict[str, ModelShape] = {
    shape.name.lower(): shape
    for shape in (
        _llama("Llama-3.1-8B", 128256, 4096, 14336, 32, 32, 8),
        _llama("Llama-3.1-70B", 128256, 8192, 28672, 80, 64, 8),
        _llama("Llama-3.2-1B", 128256, 2048, 8192, 16, 32, 8, head_dim=64, tied=True),
        _llama("Llama-3.2-3B", 128256, 3072, 8192, 28, 24, 8, tied=True),
        _llama("Qwen2.5-7B", 152064, 3584, 18944, 28, 28, 4, max_pos=32768, architecture="qwen2",
               attention_bias=True),
        _llama("Qwen2.5-72B", 152064, 8192, 29568, 80, 64, 8, max_pos=32768, architecture="qwen2",
               attention_bias=True),
        _llama("Qwen3-8B", 151936, 4096, 12288, 36, 32, 8, max_pos=40960, architecture="qwen3", qk_norm=True),
        _llama("Qwen3-30B-A3B", 151936, 2048, 6144, 48, 32, 4, max_pos=40960, architecture="qwen3_moe",
               qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
               notes=(_MOE_NOTE,)),
        _llama("Mistral-7B-v0.3", 32768, 4096, 14336, 32, 32, 8, max_pos=32768, architecture="mistral"),
        _llama("Mixtral-8x7B", 32000, 4096, 14336, 32, 32, 8, max_pos=32768, architecture="mixtral",
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, notes=(_MOE_NOTE,)),
        _llama("Gemma-3-270M", 262144, 640, 2048, 18, 4, 1, head_dim=256, tied=True, max_pos=32768,
               architecture="gemma3_text", qk_norm=True, norms_per_layer=4, sliding_window=512,
               num_sliding_layers=15, notes=(_GEMMA_NOTE,)),
        _llama("Gemma-3-4B", 262208, 2560, 10240, 34, 8, 4, head_dim=256, tied=True, architecture="gemma3",
               qk_norm=True, norms_per_layer=4, sliding_window=1024, num_sliding_layers=29, notes=(_GEMMA_NOTE,)),
        _llama("Gemma-3-27B", 262208, 5376, 21504, 62, 32, 16, tied=True, architecture="gemma3",
               qk_norm=True, norms_per_layer=4, sliding_window=1024, num_sliding_layers=52, notes=(_GEMMA_NOTE,)),
        _llama("DeepSeek-V3", 129280, 7168, 18432, 61, 128, 128, max_pos=163840, architecture="deepseek_v3",
               num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
               shared_expert_intermediate_size=2048, first_dense_layers=3, q_lora_rank=1536, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, notes=(_MOE_NOTE, _MLA_NOTE)),
    )
}


def preset(name: str) -> ModelShape:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[key]
