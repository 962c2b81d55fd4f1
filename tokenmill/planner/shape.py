"""A model's shape: everything the roofline needs, nothing that needs the weights.

`ModelShape` uses the field names of `ModelArchConfig` (the ground-floor
`tokenmill/model_arch.py`, so the planner imports nothing from `model/`) for what the two
share, and adds what tokenmill's model code does not run yet: mixture-of-experts MLPs,
multi-head latent attention (MLA, DeepSeek-V2/V3) and sliding-window layers (Gemma,
Mistral v0.1).

A shape comes from a preset (`presets.py`), a `ModelArchConfig`, a Hugging Face
`config.json`, or a GGUF file's metadata (`model_spec.read_model` picks among them for a
name given on the command line). A GGUF also gives its tensors' element counts and stored
bytes exactly (`StoredWeights`), so a plan for a GGUF needs no bits-per-weight formula.
Torch-free: no weight is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.model_arch import ModelArchConfig


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer with SwiGLU/GeGLU MLPs (three matrices each)."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width (dense layers of a MoE included)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head (Qwen3, Gemma 3)
    norms_per_layer: int = 2  # RMSNorm weights per layer (Gemma 2/3: 4)
    max_position_embeddings: int = 4096
    # Mixture of experts; num_experts == 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one routed expert's width
    shared_expert_intermediate_size: int = 0  # all shared experts of a MoE layer together
    first_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek-V3: 3)
    # Multi-head latent attention; kv_lora_rank == 0 is ordinary (grouped-query) attention.
    q_lora_rank: int = 0  # 0: a full q projection
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Sliding-window attention: that many layers see only the last `sliding_window` tokens.
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)  # what the formulas simplify for it

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{self.name}: {name} must be at least 1, got {getattr(self, name)}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.name}: num_experts_per_tok must be in 1..{self.num_experts}, "
                             f"got {self.num_experts_per_tok}")
        if self.num_sliding_layers and not self.sliding_window:
            raise ValueError(f"{self.name}: num_sliding_layers needs a sliding_window")
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(f"{self.name}: num_sliding_layers must be in 0..{self.num_layers}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query/key (MLA: the no-RoPE part plus the RoPE part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @classmethod
    def from_arch_config(cls, arch: ModelArchConfig, name: str) -> ModelShape:
        """The shape of a model tokenmill runs (Llama, Qwen2/3, Gemma 3, Qwen3-MoE, Mixtral, OLMoE).
        Qwen3-MoE's dense layers count as leading ones (`first_dense_layers`): the weights
        and a step's reads do not depend on where they are."""
        sliding = arch.sliding_window
        num_sliding = sum(1 for i in range(arch.num_layers) if arch.layer_window(i) is not None)
        return cls(
            name=name, architecture=arch.architecture, vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
            num_layers=arch.num_layers, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim, tie_word_embeddings=arch.tie_word_embeddings,
            attention_bias=arch.attention_bias, max_position_embeddings=arch.max_position_embeddings,
            sliding_window=sliding if num_sliding else None, num_sliding_layers=num_sliding,
            qk_norm=arch.qk_norm, norms_per_layer=4 if arch.sandwich_norms else 2,
            num_experts=arch.num_experts, num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            first_dense_layers=len(arch.dense_layers) if arch.is_moe else 0,
        )


# ----- Hugging Face config.json ------------------------------------------------------------

# model_type -> (tied embeddings by default, q/k norms, norms per layer, layers per global layer)
_HF_FAMILIES: dict[str, tuple[bool, bool, int, int]] = {
    "llama": (False, False, 2, 0), "mistral": (False, False, 2, 0), "mixtral": (False, False, 2, 0),
    "qwen2": (False, False, 2, 0), "qwen2_moe": (False, False, 2, 0),
    "qwen3": (False, True, 2, 0), "qwen3_moe": (False, True, 2, 0),
    "gemma": (True, False, 2, 0), "gemma2": (True, False, 4, 2),
    "gemma3": (True, True, 4, 6), "gemma3_text": (True, True, 4, 6),
    "deepseek_v2": (False, False, 2, 0), "deepseek_v3": (False, False, 2, 0),
}


def shape_from_hf_config(cfg: dict[str, Any], name: str) -> ModelShape:
    """A shape from a Hugging Face config.json (a multimodal one's `text_config`)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    model_type = cfg.get("model_type") or ""
    tied_default, qk_norm, norms, global_every = _HF_FAMILIES.get(model_type, (False, False, 2, 0))
    try:
        hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        vocab = cfg["vocab_size"]
    except KeyError as exc:
        raise ValueError(f"{name}: config.json has no {exc.args[0]!r}; is it a decoder-only language model?") from None
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    moe_width = cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if experts else 0)
    shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * moe_width
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    sliding = _hf_sliding_layers(cfg, layers, window, global_every)
    return ModelShape(
        name=name, architecture=model_type or "unknown", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size") or 0, num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied_default)),
        attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
        qk_norm=qk_norm, norms_per_layer=norms,
        max_position_embeddings=cfg.get("max_position_embeddings") or 4096,
        num_experts=experts, num_experts_per_tok=(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=moe_width, shared_expert_intermediate_size=shared,
        first_dense_layers=(cfg.get("first_k_dense_replace") or 0) if experts else 0,
        q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg.get("kv_lora_rank") or 0,
        qk_nope_head_dim=cfg.get("qk_nope_head_dim") or 0, qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
        v_head_dim=cfg.get("v_head_dim") or 0,
        sliding_window=window if sliding else None, num_sliding_layers=sliding,
    )


def _hf_sliding_layers(cfg: dict[str, Any], layers: int, window: int | None, global_every: int) -> int:
    if not window:
        return 0
    if isinstance(cfg.get("layer_types"), list):
        return sum(1 for kind in cfg["layer_types"] if kind == "sliding_attention")
    every = cfg.get("sliding_window_pattern") or global_every
    if every:  # every `every`-th layer attends globally, the others through the window
        return layers - layers // every
    if cfg.get("max_window_layers") is not None and cfg.get("use_sliding_window"):
        return max(0, layers - cfg["max_window_layers"])  # Qwen2: the layers above max_window_layers
    return layers  # Mistral v0.1: every layer


# ----- GGUF ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorGroups:
    """Element counts or bytes of a checkpoint's tensors, grouped as the roofline needs them.

    `lm_head` is the output projection; when tied it is the embedding matrix itself (its
    value repeats `embedding`, and `total` counts it once)."""

    embedding: int = 0
    lm_head: int = 0
    tied: bool = False
    attention: int = 0  # projections, their biases and q/k norms, all layers
    mlp: int = 0  # dense MLPs and shared experts, all layers
    experts: int = 0  # routed experts, all layers
    router: int = 0
    layer_norms: int = 0
    final_norm: int = 0
    other: int = 0  # e.g. llama.cpp's rope_freqs

    @property
    def layers(self) -> int:
        return self.attention + self.mlp + self.experts + self.router + self.layer_norms

    @property
    def total(self) -> int:
        return self.embedding + (0 if self.tied else self.lm_head) + self.layers + self.final_norm + self.other


@dataclass(frozen=True)
class StoredWeights:
    """What a GGUF file holds, exactly: element counts and bytes per group, and its types."""

    params: TensorGroups
    bytes: TensorGroups
    types: dict[str, int]  # ggml type name -> number of tensors

    @property
    def format_name(self) -> str:
        """'Q4_1 (+Q8_0, F32)': the type holding most bytes first."""
        names = sorted(self.types, key=lambda t: -self.types[t])
        return names[0] + (f" (+{', '.join(names[1:])})" if len(names) > 1 else "")


_GGUF_LAYER_NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "attn_post_norm",
                     "ffn_post_norm", "layer_output_norm")


def _gguf_group(name: str) -> str:
    """The `TensorGroups` field a GGUF tensor (llama.cpp naming) belongs to."""
    if name.startswith("token_embd."):
        return "embedding"
    if name.startswith("output."):
        return "lm_head"
    if name.startswith("output_norm."):
        return "final_norm"
    if not name.startswith("blk."):
        return "other"
    parts = name.split(".")
    base = parts[2]
    if base in _GGUF_LAYER_NORMS:
        return "layer_norms"
    if base.startswith("attn_"):
        return "attention"
    if base.endswith("_exps") or (base.startswith("ffn_") and len(parts) > 4 and parts[3].isdigit()):
        return "experts"  # merged (ffn_up_exps) or, in old Mixtral files, one tensor per expert
    if base.startswith(("ffn_gate_inp", "exp_probs")):
        return "router"
    if base.startswith("ffn_"):
        return "mlp"  # dense and shared-expert (`_shexp`) MLPs
    return "other"


def read_gguf(path: str | os.PathLike[str]) -> tuple[ModelShape, StoredWeights]:
    """The shape and stored weights of a GGUF file, from its header only."""
    import gguf

    from tokenmill.gguf_file import GGUFFile

    file = GGUFFile(path)
    params: dict[str, int] = {}
    stored: dict[str, int] = {}
    types: dict[str, int] = {}
    for info in file.tensors:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        elements = 1
        for dim in info.shape:
            elements *= dim
        group = _gguf_group(info.name)
        params[group] = params.get(group, 0) + elements
        stored[group] = stored.get(group, 0) + elements // block_size * type_size
        types[qtype.name] = types.get(qtype.name, 0) + elements // block_size * type_size
    names = {t.name for t in file.tensors}
    tied = "output.weight" not in names
    if tied:
        params["lm_head"], stored["lm_head"] = params.get("embedding", 0), stored.get("embedding", 0)
    weights = StoredWeights(TensorGroups(tied=tied, **params), TensorGroups(tied=tied, **stored), types)
    return _gguf_shape(file, Path(path).name.removesuffix(".gguf"), names), weights


def _gguf_shape(file: Any, name: str, names: set[str]) -> ModelShape:
    meta = file.metadata
    arch = meta.get("general.architecture")
    if not arch:
        raise ValueError(f"{file.path}: no general.architecture in the GGUF metadata")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        return max(value) if isinstance(value, list) else value  # per-layer lists: the widest

    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    if not (hidden and heads and layers):
        raise ValueError(f"{file.path}: the {arch} metadata lacks embedding_length/head_count/block_count")
    embedding = next((t for t in file.tensors if t.name == "token_embd.weight"), None)
    vocab = embedding.shape[1] if embedding else get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    key_length = get("attention.key_length") or hidden // heads
    value_length = get("attention.value_length") or key_length
    kv_lora = get("attention.kv_lora_rank") or 0
    rope_dim = get("rope.dimension_count") or 0
    if kv_lora:  # newer files store the absorbed MLA sizes in key/value_length, the real ones in *_mla
        key_length = get("attention.key_length_mla") or key_length
        value_length = get("attention.value_length_mla") or value_length
    window = get("attention.sliding_window")
    sliding = _gguf_sliding_layers(meta.get(f"{arch}.attention.sliding_window_pattern"), arch, layers) if window else 0
    layer0_norms = sum(1 for n in names if n.startswith("blk.0.") and n.split(".")[2] in _GGUF_LAYER_NORMS
                       and n.endswith(".weight"))
    experts = get("expert_count") or 0
    moe_width = get("expert_feed_forward_length") or (get("feed_forward_length") if experts else 0)
    return ModelShape(
        name=name, architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=get("feed_forward_length") or 0, num_layers=layers, num_heads=heads,
        num_kv_heads=get("attention.head_count_kv") or heads,
        head_dim=key_length if not kv_lora else value_length,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        norms_per_layer=layer0_norms or 2, max_position_embeddings=get("context_length") or 4096,
        num_experts=experts, num_experts_per_tok=(get("expert_used_count") or 0) if experts else 0,
        moe_intermediate_size=moe_width or 0,
        shared_expert_intermediate_size=get("expert_shared_feed_forward_length")
        or (get("expert_shared_count") or 0) * (moe_width or 0),
        first_dense_layers=(get("leading_dense_block_count") or 0) if experts else 0,
        q_lora_rank=get("attention.q_lora_rank") or 0, kv_lora_rank=kv_lora,
        qk_nope_head_dim=key_length - rope_dim if kv_lora else 0, qk_rope_head_dim=rope_dim if kv_lora else 0,
        v_head_dim=value_length if kv_lora else 0,
        sliding_window=window if sliding else None, num_sliding_layers=sliding,
    )


def _gguf_sliding_layers(pattern: Any, arch: str, layers: int) -> int:
    """Layers that attend through the window: a per-layer list of flags, a period (every
    n-th layer global), or llama.cpp's fixed pattern for Gemma 2/3; 0 where none is known."""
    if isinstance(pattern, list):
        return sum(1 for flag in pattern[:layers] if flag)
    every = pattern if isinstance(pattern, int) and pattern > 0 else {"gemma2": 2, "gemma3": 6}.get(arch, 0)
    return layers - layers // every if every else 0
