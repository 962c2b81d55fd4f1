"""The architecture of a Llama-family model, read from GGUF metadata or config.json.

Ground floor (stdlib only, no torch): the model code builds its layers from it, the
parallel layout splits by it, and the torch-free planner reads the same fields
(`planner.shape.ModelShape.from_arch_config`) without importing `model/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # "llama" or "qwen2"
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
    sliding_window: int | None = None  # not implemented: max_model_len must stay within it

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; tokenmill supports {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArchConfig:
        arch = _hf_architecture(cfg)
        heads = cfg["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        return cls(
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
        )


_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


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
