"""The architecture of a Llama-family model, read from GGUF metadata or config.json.

Ground floor (stdlib only, no torch): the model code builds its layers from it, the
parallel layout splits by it, and the torch-free planner reads the same fields
(`planner.shape.ModelShape.from_arch_config`) without importing `model/`.

One decoder definition serves every family here; what sets a family apart is a feature
of this config (q/k norms, the MLP's activation, Gemma's norm layout and scaling, which
layers attend through a sliding window, a mixture of experts in place of the MLP), not a
model class of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "olmoe")
SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    # Sliding-window attention: a layer sees the last `sliding_window` tokens (itself
    # included). `layer_types` says which layers (SLIDING / FULL); empty: every layer slides
    # when there is a window (Mistral v0.1).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    hidden_act: str = "silu"  # the MLP gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    # Gemma: RMSNorm scales by (norm_weight_offset + stored weight): 1 in Hugging Face
    # checkpoints, 0 in GGUF files (llama.cpp's converter adds the 1 in).
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power (default head_dim)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (no scaling)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # OLMoE: q and k are normed as whole vectors (all heads at once), not head by head.
    qk_norm_whole: bool = False
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip] after the projections
    # Mixture of experts (num_experts 0: a dense model): each MoE layer's MLP is
    # `num_experts` gated MLPs of width `moe_intermediate_size`, a token runs the
    # `num_experts_per_tok` its router scores highest (softmax, then top-k), weighted by
    # their probabilities, renormalised to sum to 1 when `norm_topk_prob` (Mixtral always).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE's mlp_only_layers (and decoder_sparse_step): dense MLPs

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; tokenmill supports {SUPPORTED_ARCHITECTURES}"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {self.hidden_act!r}; tokenmill supports silu, gelu_tanh")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size):
            raise ValueError(f"a mixture of experts needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= "
                             f"num_experts ({self.num_experts}) and a moe_intermediate_size")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layer(self, layer: int) -> bool:
        """Whether a (global) layer's MLP is a mixture of experts."""
        return self.is_moe and layer not in self.dense_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer; None: it attends to the whole context."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != SLIDING):
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        arch = _hf_architecture(cfg)
        if cfg.get("attn_logit_softcapping"):
            raise ValueError(f"attn_logit_softcapping ({cfg['attn_logit_softcapping']}) is not supported: "
                             "tokenmill's attention kernels do not cap attention scores")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters (Gemma 3:
        # one set per layer type).
        rope_params = cfg.get("rope_parameters") or {}
        local_rope = dict(rope_params.get(SLIDING) or {}) if arch == "gemma3" else {}
        if arch == "gemma3" and FULL in rope_params:
            rope_params = rope_params[FULL]
        rope = dict(rope_params or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 1e6 if arch == "gemma3" else 10000.0)
        fields = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            layer_types=tuple(cfg.get("layer_types") or ()),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
        )
        if arch == "gemma3":
            fields.update(_gemma_features(cfg, local_rope))
        if arch in ("qwen3_moe", "mixtral", "olmoe"):
            fields.update(_moe_features(cfg, arch))
        return cls(**fields)


def _gemma_features(cfg: dict, local_rope: dict) -> dict:
    """What a Hugging Face Gemma 3 text config sets beyond the Llama shape."""
    layers = cfg["num_hidden_layers"]
    every = cfg.get("sliding_window_pattern", 6)  # older configs: every 6th layer global
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    return dict(
        layer_types=tuple(types), hidden_act="gelu_tanh", norm_weight_offset=1.0, sandwich_norms=True,
        embedding_scale=cfg["hidden_size"] ** 0.5, query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        rope_local_theta=local_rope.get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def _moe_features(cfg: dict, arch: str) -> dict:
    """The router and experts as each family's Hugging Face config names them."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    layers = cfg["num_hidden_layers"]
    dense: tuple[int, ...] = ()
    if arch == "qwen3_moe":  # as Qwen3MoeDecoderLayer decides which layers are sparse
        step = cfg.get("decoder_sparse_step") or 1
        only = set(cfg.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    features = dict(
        num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
        # Qwen3-MoE names the experts' width apart (its dense layers use intermediate_size);
        # Mixtral and OLMoE have only experts, of width intermediate_size.
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        # Mixtral's router always renormalises the top-k (softmax over the top-k logits).
        norm_topk_prob=True if arch == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        dense_layers=dense,
    )
    if arch == "olmoe":
        features.update(qk_norm_whole=True, clip_qkv=cfg.get("clip_qkv"))
    return features


_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                     "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3",
                     "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
                     "OlmoeForCausalLM": "olmoe",
                     # The bare decoders without an LM head (embedding checkpoints such as
                     # e5-mistral's MistralModel): served by the pooling runner.
                     "LlamaModel": "llama", "MistralModel": "llama", "Qwen2Model": "qwen2", "Qwen3Model": "qwen3"}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
                   "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "olmoe": "olmoe"}


def _hf_architecture(cfg: dict) -> str:
    names = cfg.get("architectures") or []
    for name in names:
        if name in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[name]
    if not names and cfg.get("model_type") in _HF_MODEL_TYPES:
        return _HF_MODEL_TYPES[cfg["model_type"]]
    raise ValueError(
        f"unsupported architecture {names or cfg.get('model_type')!r}; "
        f"tokenmill supports {sorted(_HF_ARCHITECTURES)}"
    )
