"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Gemma 3, and the
mixtures of experts Qwen3-MoE, Mixtral, OLMoE).

The families' differences are features of the config (ModelArchConfig): q/k norms,
GeGLU, Gemma's norm layout, embedding scaling and logit soft-capping, a sliding
window per layer with its own RoPE base, and a mixture of experts for the MLP
(model/moe.py).

`model(input_ids, positions)` takes the step's tokens flattened across requests;
attention reads its per-step metadata from the forward context, so the model
knows nothing of requests. Without a context it runs dense causal attention over
one sequence, which tests use as the reference.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.attention.backend import PagedDecode, get_forward_context
from tokenmill.attention.kv_cache import LayerKVCache
from tokenmill.engine.interrupt import StepInterrupt, StepInterrupted
from tokenmill.kernels.fused_layer import FusedLayerOperands, LayerFeatures
from tokenmill.kernels.ops import TorchOps
from tokenmill.model.layers import Experts, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from tokenmill.model.moe import SparseMoE
from tokenmill.model_arch import ModelArchConfig
from tokenmill.parallel.layout import ShardLayout
from tokenmill.parallel.model_parallel import ModelParallel
from tokenmill.quantization import LinearWeights, QuantizedTensor, WeightFormat


class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism); `o_proj` gives its
    partial sum, which the decoder layer all-reduces."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding, layout: ShardLayout) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = layout.q_heads.size, layout.kv_heads.size, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layout.layers.start + layer_idx)  # None: attends to the whole context
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        # Qwen3 / Gemma 3: RMSNorm over each head of q and of k, before RoPE; OLMoE: over the
        # whole q and k vectors (tensor parallelism is refused for it: a rank has some heads).
        self.norm_whole = cfg.qk_norm_whole
        q_dim, k_dim = (self.q_size, self.kv_size) if self.norm_whole else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip_qkv = cfg.clip_qkv
        self.rotary = rotary

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens, qk_size = qkv.shape[0], self.q_size + self.kv_size
        if self.norm_whole:
            q, k, v = self._normed_whole(qkv)
            q, k = self.rotary.rotate(q, *rope), self.rotary.rotate(k, *rope)
        else:
            qk = qkv[:, :qk_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.q_norm is None:  # Q and K heads side by side, rotated in one go
                qk = self.rotary.rotate(qk, *rope)
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            else:
                q = self.rotary.rotate(self.q_norm(qk[:, : self.num_heads]), *rope)
                k = self.rotary.rotate(self.k_norm(qk[:, self.num_heads :]), *rope)
            v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        if ctx is None:
            out = self._dense_causal(q, k, v)
        else:
            out = ctx.backend.forward(q, k, v, ctx.kv_cache[self.layer_idx], ctx.metadata_for(self.window),
                                      self.scale, window=self.window)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _normed_whole(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """OLMoE: q and k normed as whole vectors, then q, k, v clamped (`clip_qkv`), as heads."""
        qk_size = self.q_size + self.kv_size
        q, k, v = self.q_norm(qkv[:, : self.q_size]), self.k_norm(qkv[:, self.q_size : qk_size]), qkv[:, qk_size:]
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return (q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim),
                v.reshape(-1, self.num_kv_heads, self.head_dim))

    def _dense_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        mask = None
        if self.window is not None:  # key j is seen from query i iff i - window < j <= i
            pos = torch.arange(q.shape[2])
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                             enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding, parallel: ModelParallel) -> None:
        super().__init__()
        self.parallel = parallel  # sums the row-parallel outputs (o_proj, down_proj) across TP ranks
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, rotary, parallel.layout)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Gemma's sandwich: post_attention_layernorm normalises the attention output, and
        # these two the MLP's input and output (Llama's post_attention_layernorm is the
        # MLP's input norm).
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norms else None
        layout = parallel.layout
        self.mlp = SparseMoE(cfg, layout) if cfg.moe_layer(layout.layers.start + layer_idx) else \
            GatedMLP(cfg.hidden_size, layout.intermediate.size, cfg.hidden_act)
        # Row-parallel products as the reference split computes them (deterministic inference).
        self.self_attn.o_proj.column_cuts = parallel.column_cuts("o_proj.weight")
        if isinstance(self.mlp, GatedMLP):
            self.mlp.down_proj.column_cuts = parallel.column_cuts("down_proj.weight")

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, residual: torch.Tensor | None,
        activation_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output, not yet added into the residual stream
        (the first layer gets the embeddings and no residual). Each add is fused into the
        norm after it. `activation_dtype` (the plan's bf16 activation path, runner/plan.py):
        the norms write their output in it, so the linears, attention and the MLP run on it,
        while the residual stream keeps the model's dtype."""
        if residual is None:
            x, residual = self.input_layernorm(h, out_dtype=activation_dtype), h
        else:
            x, residual = self.input_layernorm(h, residual, out_dtype=activation_dtype)
        reduce = self.parallel.all_reduce
        if self.pre_feedforward_layernorm is not None:
            attn = self.post_attention_layernorm(reduce(self.self_attn(rope, x)))
            x, residual = self.pre_feedforward_layernorm(attn, residual, out_dtype=activation_dtype)
            return self.post_feedforward_layernorm(reduce(self.mlp(x))), residual
        x, residual = self.post_attention_layernorm(reduce(self.self_attn(rope, x)), residual,
                                                    out_dtype=activation_dtype)
        return reduce(self.mlp(x)), residual

    def _linears(self) -> tuple[Linear, ...]:
        attention = (self.self_attn.qkv_proj, self.self_attn.o_proj)
        return attention if isinstance(self.mlp, SparseMoE) else (*attention, self.mlp.gate_up_proj, self.mlp.down_proj)

    def features(self) -> LayerFeatures:
        """What this layer computes, for the native fused layer's coverage check
        (kernels/fused_layer.py): declared here, once, by the layer itself."""
        attn = self.self_attn
        operands = [lin.weights.fused_decode_operand() if lin.weights is not None else None
                    for lin in self._linears()]
        return LayerFeatures(
            qkv_bias=attn.qkv_proj.bias is not None,
            qk_norm=attn.q_norm is not None,
            sliding_window=attn.window,
            sandwich_norms=self.pre_feedforward_layernorm is not None,
            geglu_mlp=self.mlp.act != "silu",
            qk_norm_whole=attn.norm_whole,
            tensor_parallel=self.parallel.tp_size > 1,
            mixture_of_experts=isinstance(self.mlp, SparseMoE),
            weights=tuple(None if op is None else op.kind for op in operands),
        )

    def fused_operands(self) -> FusedLayerOperands:
        """What the native fused layer reads of this layer, gathered once at load (after
        the weight format is set; the plan checked `features()` first)."""
        attn = self.self_attn
        return FusedLayerOperands(
            self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
            tuple(lin.weights.fused_decode_operand() for lin in self._linears()),
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
        )

    def fused_decode(
        self, operands: FusedLayerOperands, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor,
        residual: torch.Tensor, kv_cache: LayerKVCache, decode: PagedDecode,
    ) -> torch.Tensor:
        """forward() for an all-decode step as one native op (same kernels, no Python
        between them); adds h into residual in place and returns the MLP output."""
        return kernels.llama_decode_layer(
            h, residual, operands, rope, (kv_cache.k, kv_cache.v), decode.slots, decode.block_tables,
            decode.context_lens, kv_cache.scales, kv_cache.rotation,
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

    def __init__(self, cfg: ModelArchConfig, max_positions: int | None = None,
                 parallel: ModelParallel | None = None, lm_head: bool = True) -> None:
        """`parallel`: this rank's part of a tensor/pipeline-parallel split (default: all of it).
        `lm_head=False`: no LM head (the pooling runner reads hidden states only), so a
        checkpoint without one (an embedding model's) loads, and a tied one's is not built."""
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel = parallel or ModelParallel.single(cfg)
        layout = parallel.layout
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.rotaries = nn.ModuleList(self._rotaries())
        # Vocabulary-parallel: this rank's rows of the embedding and the LM head.
        # Built on the meta device (loading), no random init: there torch's init imports
        # torch._dynamo, 1.6 s of every engine's start. Elsewhere (tests' tiny models) the usual init.
        on_meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(
            layout.vocab.size, cfg.hidden_size,
            _weight=torch.empty(layout.vocab.size, cfg.hidden_size) if on_meta else None,
        ) if layout.holds_embedding else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotaries[self._rope_kind(layout.layers.start + i)], parallel)
            for i in range(layout.layers.size)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, layout.vocab.size, bias=False, many_rows=False) \
            if layout.last_stage and lm_head else None
        # The embedding table in a weight format, serving the lookups by its `rows`: a tied table
        # on a stage without the head (release_tied_embedding), or an untied quantized table kept
        # as stored (_keep_table_quantized).
        self.table_rows: LinearWeights | None = None
        # Each layer's operands for the native fused layer, set at load when the plan runs it.
        self.fused_layers: list[FusedLayerOperands] | None = None
        self.tie_weights()

    def _rotaries(self) -> list[RotaryEmbedding]:
        """The RoPE tables: one, or (Gemma 3) a second for the sliding layers' own base."""
        cfg = self.cfg
        rotaries = [RotaryEmbedding(cfg.head_dim, self.max_positions, cfg.rope_theta, cfg.rope_scaling)]
        if cfg.rope_local_theta is not None:
            rotaries.append(RotaryEmbedding(cfg.head_dim, self.max_positions, cfg.rope_local_theta, None))
        return rotaries

    def _rope_kind(self, layer: int) -> int:
        """Index into self.rotaries of a (global) layer."""
        return int(self.cfg.rope_local_theta is not None and self.cfg.layer_window(layer) is not None)

    def rebuild_rotary(self, device: torch.device) -> None:
        """Compute the RoPE tables (float32) on `device`: after building on the meta device."""
        fresh = [r.to(device) for r in self._rotaries()]
        self.rotaries = nn.ModuleList(fresh)
        for layer in self.layers:
            layer.self_attn.rotary = fresh[self._rope_kind(self.parallel.layout.layers.start + layer.self_attn.layer_idx)]

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after moving devices, which
        may untie them)."""
        if self.cfg.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def release_tied_embedding(self, fmt: WeightFormat | None = None) -> None:
        """Once a tied head is in its weight format, it serves the embedding lookup (its
        `rows`): the table is not kept a second time. A pipeline stage that embeds but holds
        no head (the first of several) keeps its table in the head's format (`fmt`), so its
        rows are the values the whole model looks up (a format that quantizes at load, int8
        or int4, rounds them)."""
        if not self.cfg.tie_word_embeddings:
            return
        if self.lm_head is not None and self.lm_head.weights is not None:
            self.embed_tokens.weight = None
        elif (fmt is not None and not self.parallel.layout.last_stage and self.embed_tokens is not None
              and self.embed_tokens.weight is not None):
            self.table_rows = fmt.make(self.embed_tokens.weight.detach().float(), many_rows=False)
            self.embed_tokens.weight = None

    @property
    def dtype(self) -> torch.dtype:
        """What activations (and the KV cache) are computed in. Linear and embedding
        weights may be stored narrower (their weight formats)."""
        return self.norm.weight.dtype

    def layer_features(self) -> list[LayerFeatures]:
        """What each decoder layer computes, as the layers declare it."""
        return [layer.features() for layer in self.layers]

    def use_ops(self, ops: TorchOps) -> None:
        """Hand every module the element-wise ops the execution plan chose (once, at load)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, GatedMLP, SparseMoE)):
                module.ops = ops

    def use_fused_layers(self, enabled: bool) -> None:
        """Gather (or drop) every layer's operands for the native fused layer (at load)."""
        self.fused_layers = [layer.fused_operands() for layer in self.layers] if enabled else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Final hidden states of the step's tokens; None on a pipeline stage before the
        last, which sends its hidden states on instead."""
        parallel = self.parallel
        if parallel.layout.first_stage:
            h, residual = self._embed(input_ids), None
        else:
            h, residual = parallel.recv_hidden(input_ids.shape[0], self.cfg.hidden_size, self.dtype)
        tables = {id(r): r.table(positions) for r in self.rotaries}  # looked up once per step
        ctx = get_forward_context()
        interrupt = None if ctx is None else ctx.interrupt
        if ctx is not None and ctx.kind.fused:  # as the plan named this step (runner/plan.py)
            if residual is None:
                residual, h = h, torch.zeros_like(h)  # the first layer adds nothing to the embeddings
            for layer, operands, kv_cache in zip(self.layers, self.fused_layers, ctx.kv_cache, strict=True):
                _stop_if_interrupted(interrupt)
                rope = tables[id(layer.self_attn.rotary)]
                h = layer.fused_decode(operands, rope, h, residual, kv_cache, ctx.decode)
        else:
            activation_dtype = None if ctx is None else ctx.activation_dtype
            for layer in self.layers:
                _stop_if_interrupted(interrupt)
                h, residual = layer(tables[id(layer.self_attn.rotary)], h, residual, activation_dtype)
        if residual is not None and h.dtype != residual.dtype:  # the bf16 activation path's last MLP output
            if not parallel.layout.last_stage:  # a later stage receives the model's dtype
                h = h.to(residual.dtype)
            else:  # added into the float32 residual; the final norm writes float32 for the LM head
                return self.norm(h, residual, out_dtype=residual.dtype)[0]
        if not parallel.layout.last_stage:
            parallel.send_hidden(h, residual)
            return None
        return self.norm(h) if residual is None else self.norm(h, residual)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        vocab = self.parallel.layout.vocab
        if vocab.size == self.cfg.vocab_size:
            return self._scaled(self._lookup(input_ids))
        # Vocabulary-parallel: rows of other ranks' ids are zero here; the sum has them.
        local = input_ids - vocab.start
        inside = (local >= 0) & (local < vocab.size)
        h = self._lookup(torch.where(inside, local, 0))
        h.masked_fill_(~inside.unsqueeze(-1), 0.0)
        return self._scaled(self.parallel.all_reduce(h))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        """Gemma multiplies the embeddings by sqrt(hidden_size)."""
        return h if self.cfg.embedding_scale is None else h * self.cfg.embedding_scale

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows: from the table, the table in a weight format, or a tied head's own storage."""
        if self.embed_tokens.weight is None:
            table = self.table_rows if self.table_rows is not None else self.lm_head.weights
            return table.rows(ids).to(self.dtype)
        return self.embed_tokens(ids).to(self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (gathered from the TP ranks' parts)."""
        logits = self.parallel.gather_logits(self.lm_head(hidden).float())
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ----- weights -------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
                     fmt: WeightFormat | None = None) -> None:
        """Read checkpoint tensors (Hugging Face names; float, or quantized as stored) into
        the model (this rank's part of them), fusing q/k/v and gate/up. Raises if a
        parameter stays unset.

        A linear weight is assembled from its parts as they arrive and, once complete,
        handed to the linear as a whole (`Linear.load_weight`; with `fmt` it goes straight
        into that weight format), so the float weights of the whole model never live at
        once and linear weights need not be allocated before loading. Other parameters
        (norms, embeddings, biases) are copied into place."""
        params = dict(self.named_parameters())
        linears = {f"{name}.weight": m for name, m in self.named_modules() if isinstance(m, Linear)}
        expected = {f"{n}#{s}" for n, s in self._expected_shards(params, linears)}
        layout = self.parallel.layout
        parts: dict[str, dict[int | None, torch.Tensor | QuantizedTensor]] = {}
        expert_parts: dict[tuple[int, int], dict[int | None, torch.Tensor | QuantizedTensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and (self.cfg.tie_word_embeddings or self.lm_head is None):
                continue
            local_name = layout.local_name(name)
            if local_name is None:  # another pipeline stage's
                continue
            tensor = _rank_part(layout, name, tensor)
            local_name = local_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for its MoE MLP
            if ".mlp.experts." in local_name:
                loaded.update(self._load_experts(local_name, tensor, fmt, expert_parts))
                continue
            target, shard = self._target(local_name)
            if target == "embed_tokens.weight" and isinstance(tensor, QuantizedTensor) \
                    and self._keep_table_quantized(tensor, fmt):
                loaded.add(f"{target}#{shard}")
                continue
            if target.endswith(".bias") and target not in params and not _nonzero(tensor):
                continue  # AutoGPTQ writes a zero bias for every quantized linear, biased or not
            if target not in params and target not in linears:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.cfg.architecture} model")
            loaded.add(f"{target}#{shard}")
            if target in linears:
                parts.setdefault(target, {})[shard] = tensor
                if all(f"{target}#{k}" in loaded for k in self._shards_of(target)):
                    self._load_linear(target, linears[target], parts.pop(target), fmt)
                continue
            param = params[target].data  # a norm, an embedding, or a (fused) bias
            if shard is not None:
                param = param.narrow(0, *self._shard_range(target, shard))
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize()
            if target.endswith("norm.weight") and self.cfg.norm_weight_offset:
                tensor = tensor.float() + self.cfg.norm_weight_offset  # Gemma's (1 + w), folded in once
            with torch.no_grad():
                _copy(param, tensor, name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks weights for: {', '.join(m.split('#')[0] for m in missing[:8])}")

    def _load_experts(self, name: str, tensor: torch.Tensor | QuantizedTensor, fmt: WeightFormat | None,
                      pending: dict[tuple[int, int], dict[int | None, torch.Tensor | QuantizedTensor]]) -> list[str]:
        """Load one expert's matrix (`layers.L.mlp.experts.E.gate_proj.weight`, Mixtral's
        w1 / w3 / w2), or a layer's stacked ones as transformers >= 5 holds them in memory
        (`layers.L.mlp.experts.gate_up_proj` [E, 2I, H], `.down_proj` [E, H, I]); E and I
        already this rank's (the layout cut per-expert tensors, stacked ones are cut here).
        Without a format they are copied into the layer's float stacks. With one, each
        expert's matrices wait in `pending` until its gate, up and down are all here, then
        go into the format as they are (`_format_expert`): quantized as stored stays
        quantized, and no layer's float stacks are ever allocated. Returns what it loaded,
        as `loaded` counts it."""
        match = _EXPERT_NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.cfg.architecture} model")
        layer, expert, kind = int(match["layer"]), match["expert"], match["kind"] or match["stacked"]
        experts = self.layers[layer].mlp.experts if isinstance(self.layers[layer].mlp, SparseMoE) else None
        if experts is None:
            raise ValueError(f"checkpoint tensor {name!r}: layer {layer} of the model has a dense MLP, not experts")
        stack = "down_proj" if kind in ("down_proj", "w2") else "gate_up_proj"
        key = f"layers.{layer}.mlp.experts.{stack}"
        width = experts.intermediate
        halves = (0, 1) if stack == "gate_up_proj" else (None,)
        if expert is None:  # a whole stack: each expert's matrices (and halves of gate_up) in turn
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize()
            whole = self._rank_stack(tensor, stack)
            shape = (experts.num_experts, *((2 * width, experts.hidden) if stack == "gate_up_proj"
                                            else (experts.hidden, width)))
            if tuple(whole.shape) != shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(whole.shape)} (this rank's part), "
                                 f"the model expects {shape}")
            pieces = [(e, h, whole[e] if h is None else whole[e].narrow(0, h * width, width))
                      for e in range(experts.num_experts) for h in halves]
        else:
            e = int(expert)
            pieces = [(e, None if stack == "down_proj" else (0 if kind in ("gate_proj", "w1") else 1), tensor)]
        for e, half, piece in pieces:
            rows, cols = (experts.hidden, width) if half is None else (width, experts.hidden)
            if tuple(piece.shape) != (rows, cols):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(piece.shape)}, the model expects "
                                 f"{(rows, cols)}")
            if fmt is not None:
                parts = pending.setdefault((layer, e), {})
                parts[half] = piece
                if len(parts) == 3:
                    self._format_expert(experts, e, pending.pop((layer, e)), fmt)
                continue
            param = getattr(experts, stack)
            if param.is_meta:  # not allocated by the loader: only experts loaded without a format need the stacks
                param = nn.Parameter(torch.empty(param.shape, device=self.norm.weight.device,
                                                 dtype=self.norm.weight.dtype), requires_grad=False)
                setattr(experts, stack, param)
            target = param.data[e] if half is None else param.data[e].narrow(0, half * width, width)
            with torch.no_grad():
                target.copy_(piece.dequantize() if isinstance(piece, QuantizedTensor) else piece)
        return [f"{key}#{e}.{h}" for e, h, _ in pieces]

    @staticmethod
    def _format_expert(experts: Experts, e: int, parts: dict[int | None, torch.Tensor | QuantizedTensor],
                       fmt: WeightFormat) -> None:
        """An expert's gate and up fused (quantized blocks stay blocks when both halves share
        a storage form), then both matrices into `fmt`."""
        gate_up = _cat_rows([parts[0], parts[1]])
        down = parts[None]
        experts.set_expert(e, *(fmt.make(w if isinstance(w, QuantizedTensor) else w.detach().float())
                                for w in (gate_up, down)))

    def _rank_stack(self, tensor: torch.Tensor, stack: str) -> torch.Tensor:
        """This rank's experts and intermediate columns of a whole stacked expert tensor."""
        layout = self.parallel.layout
        if tensor.shape[0] != layout.experts.size:
            tensor = tensor.narrow(0, layout.experts.start, layout.experts.size)
        cols = layout.expert_intermediate
        if stack == "down_proj":
            return tensor if tensor.shape[2] == cols.size else tensor.narrow(2, cols.start, cols.size)
        full = tensor.shape[1] // 2
        if full == cols.size:
            return tensor
        return torch.cat([tensor.narrow(1, cols.start, cols.size), tensor.narrow(1, full + cols.start, cols.size)], 1)

    def _keep_table_quantized(self, table: QuantizedTensor, fmt: WeightFormat | None) -> bool:
        """A quantized embedding table (a GGUF token_embd as stored) stays quantized: tied to
        the LM head, it becomes the head's weight in `fmt` and the head serves the embedding
        lookups from it (its `rows`); untied, it is kept in `fmt` for the lookups alone (Llama-3.1-8B's
        table is 2.1 GB as float32, 0.3 GB as Q4_0). Without a format, or tied on a
        stage without the head, the table is read dequantized."""
        if fmt is None:
            return False
        if not self.cfg.tie_word_embeddings:
            self.embed_tokens.weight = None
            self.table_rows = fmt.make(table, many_rows=False)
            return True
        if self.lm_head is None:
            return False
        self.embed_tokens.weight = None
        self.lm_head.load_weight(table, fmt)
        return True

    def _load_linear(self, target: str, linear: Linear, parts: dict[int | None, torch.Tensor | QuantizedTensor],
                     fmt: WeightFormat | None) -> None:
        shards = self._shards_of(target)
        for shard in shards:
            if shard is not None:
                size = self._shard_range(target, shard)[1]
                if parts[shard].shape[0] != size:
                    raise ValueError(f"checkpoint tensor for {target} (part {shard}) has {parts[shard].shape[0]} rows, "
                                     f"the model expects {size}")
        full = parts[None] if shards == [None] else _cat_rows([parts[k] for k in shards])
        if tuple(full.shape) != (linear.out_features, linear.in_features):
            raise ValueError(f"checkpoint tensor {target!r} has shape {tuple(full.shape)}, the model expects "
                             f"{(linear.out_features, linear.in_features)}")
        if isinstance(full, QuantizedTensor) and fmt is None:
            full = full.dequantize()
        if fmt is None:  # unformatted, the weight lives as the model's other parameters do
            norm = self.norm.weight
            full = full.to(device=norm.device, dtype=norm.dtype)
        linear.load_weight(full, fmt)

    def _shards_of(self, target: str) -> list[int | None]:
        if "qkv_proj" in target:
            return [0, 1, 2]
        if "gate_up_proj" in target:
            return [0, 1]
        return [None]

    def _target(self, name: str) -> tuple[str, int | None]:
        for part, (fused, shard) in self.packed_modules.items():
            if f".{part}." in name:
                return name.replace(part, fused), shard
        return name, None

    def _shard_range(self, fused_name: str, shard: int) -> tuple[int, int]:
        layout, head_dim = self.parallel.layout, self.cfg.head_dim
        if "qkv_proj" in fused_name:
            q, kv = layout.q_heads.size * head_dim, layout.kv_heads.size * head_dim
            sizes = [q, kv, kv]
        else:
            sizes = [layout.intermediate.size, layout.intermediate.size]
        return sum(sizes[:shard]), sizes[shard]

    def _expected_shards(self, params: dict, linears: dict) -> Iterable[tuple[str, int | str | None]]:
        for name in [*params, *(n for n in linears if n not in params)]:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # each expert, each half of gate_up
                halves = (0, 1) if name.endswith("gate_up_proj") else (None,)
                yield from ((name, f"{e}.{h}") for e in range(params[name].shape[0]) for h in halves)
                continue
            for shard in self._shards_of(name):
                yield name, shard

# A layer's expert tensor: one expert's (Qwen3-MoE / OLMoE gate_proj, up_proj, down_proj;
# Mixtral w1, w3, w2) or a whole stack (transformers >= 5 in memory).
_EXPERT_NAME = re.compile(r"layers\.(?P<layer>\d+)\.mlp\.experts\."
                          r"(?:(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
                          r"|(?P<stacked>gate_up_proj|down_proj))")


def _rank_part(layout: ShardLayout, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a checkpoint tensor, given whole (narrowed: a view) or already cut
    to it by the loader (which reads only that part where the file allows)."""
    part = layout.checkpoint_part(name)
    if part is None:
        return tensor
    dim, span = part
    if tensor.shape[dim] == span.size:
        return tensor
    if tensor.shape[dim] < span.stop:
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[dim]} entries along dimension {dim}; "
                         f"this rank's part is [{span.start}, {span.stop})")
    if isinstance(tensor, QuantizedTensor):  # cut in its blocks, never dequantized
        if dim == 0:
            return tensor.narrow_rows(span.start, span.size)
        try:
            return tensor.narrow_cols(span.start, span.size)
        except ValueError:  # a cut inside a block (e.g. an expert's 768 columns over 2 ranks in Q4_K's 256): float
            tensor = tensor.dequantize()
    return tensor.narrow(dim, span.start, span.size)


def _cat_rows(parts: list[torch.Tensor | QuantizedTensor]) -> torch.Tensor | QuantizedTensor:
    """The parts of a fused weight one after another; quantized parts stay quantized when
    they share a storage form, else everything is dequantized."""
    if all(isinstance(p, QuantizedTensor) for p in parts):
        try:
            return QuantizedTensor.cat_rows(parts)
        except ValueError:
            pass  # e.g. Q4_K q/k beside a Q6_K v (llama.cpp's *_K_M mixes): float, then the format
    return torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p.float() for p in parts])


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)


def _nonzero(tensor: torch.Tensor | QuantizedTensor) -> bool:
    return isinstance(tensor, QuantizedTensor) or bool(tensor.any())


def _stop_if_interrupted(interrupt: StepInterrupt | None) -> None:
    """Between two decoder layers: a better-ranked request arrived (--priority-interrupt),
    so the step stops here; the scheduler puts it back and it is computed again."""
    if interrupt is not None and interrupt.requested:
        raise StepInterrupted("a better-ranked request arrived during the step")
