"""Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window, Qwen2).

`model(input_ids, positions)` takes the step's tokens flattened across requests;
attention reads its per-step metadata from the forward context, so the model
knows nothing of requests. Without a context it runs dense causal attention over
one sequence, which tests use as the reference.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.attention.backend import PagedDecode, get_forward_context
from tokenmill.attention.kv_cache import LayerKVCache
from tokenmill.model.config import ModelArchConfig
from tokenmill.model.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens, qk_size = qkv.shape[0], self.q_size + self.kv_size
        # Q and K heads side by side, rotated in one go.
        qk = self.rotary.rotate(qkv[:, :qk_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        if ctx is None:
            out = self._dense_causal(q, k, v)
        else:
            out = ctx.backend.forward(q, k, v, ctx.kv_cache[self.layer_idx], ctx.metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _dense_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output, not yet added into the residual stream
        (the first layer gets the embeddings and no residual). Each add is fused into the
        norm after it."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x), residual)
        return self.mlp(x), residual

    def _linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj

    def can_fuse_decode(self) -> bool:
        """Whether kernels.llama_decode_layer can run this layer: every weight in a format
        with a fused-decode operand, no biases (SiLU MLP is the only kind here)."""
        return all(
            lin.weights is not None and lin.weights.fused_decode_operand() is not None and lin.bias is None
            for lin in self._linears()
        )

    def fused_decode(
        self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, residual: torch.Tensor,
        kv_cache: LayerKVCache, decode: PagedDecode,
    ) -> torch.Tensor:
        """forward() for an all-decode step as one native op (same kernels, no Python
        between them); adds h into residual in place and returns the MLP output."""
        attn, mlp = self.self_attn, self.mlp
        weights = tuple(lin.weights.fused_decode_operand() for lin in self._linears())
        return kernels.llama_decode_layer(
            h, residual, self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
            weights, rope, (kv_cache.k, kv_cache.v), decode.slots, decode.block_tables, decode.context_lens,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.down_proj.in_features, attn.scale,
            kv_cache.scales, kv_cache.rotation,
        )


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that live fused in one of our matrices: name -> (fused name, shard index).
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelArchConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        rotary = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after moving devices, which
        may untie them)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """What activations (and the KV cache) are computed in. Linear and embedding
        weights may be stored narrower (their weight formats)."""
        return self.norm.weight.dtype

    def can_fuse_decode(self) -> bool:
        return all(layer.can_fuse_decode() for layer in self.layers)

    def use_native_ops(self, enabled: bool) -> None:
        """The execution plan's choice of the fused native element-wise ops (float32 CPU)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, SwiGLU)):
                module.native = enabled

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids).to(self.dtype)
        rope = self.layers[0].self_attn.rotary.table(positions)
        ctx = get_forward_context()
        if ctx is not None and ctx.decode is not None:  # the plan runs this step fused
            residual, h = h, torch.zeros_like(h)  # the first layer adds nothing to the embeddings
            for layer, kv_cache in zip(self.layers, ctx.kv_cache):
                h = layer.fused_decode(rope, h, residual, kv_cache, ctx.decode)
            return self.norm(h, residual)[0]
        residual = None
        for layer in self.layers:
            h, residual = layer(rope, h, residual)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ----- weights -------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names, any float dtype) into the
        parameters, fusing q/k/v and gate/up. Raises if a parameter stays unset."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.cfg.architecture} model")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    _copy(param.data, tensor, name)
                else:
                    offset, size = self._shard_range(target, shard)
                    _copy(param.data.narrow(0, offset, size), tensor, name)
            loaded.add(f"{target}#{shard}")
        expected = {f"{n}#{s}" for n, s in self._expected_shards(params)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks weights for: {', '.join(m.split('#')[0] for m in missing[:8])}")

    def _target(self, name: str) -> tuple[str, int | None]:
        for part, (fused, shard) in self.packed_modules.items():
            if f".{part}." in name:
                return name.replace(part, fused), shard
        return name, None

    def _shard_range(self, fused_name: str, shard: int) -> tuple[int, int]:
        cfg = self.cfg
        if "qkv_proj" in fused_name:
            sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        return sum(sizes[:shard]), sizes[shard]

    def _expected_shards(self, params: dict) -> Iterable[tuple[str, int | None]]:
        for name in params:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if "qkv_proj" in name:
                yield from ((name, s) for s in range(3))
            elif "gate_up_proj" in name:
                yield from ((name, s) for s in range(2))
            else:
                yield name, None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)
