"""Building blocks of Llama-family models: linear layers, RMSNorm, rotary embeddings, gated
MLPs, and the stacked weights of a mixture of experts."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.kernels import huge_pages
from tokenmill.kernels.ops import REFERENCE_OPS, TorchOps, apply_rotary
from tokenmill.quantization import LinearWeights, WeightFormat, split_in_columns
from tokenmill.quantization.dense import CPUDenseWeights

__all__ = ["Experts", "GatedMLP", "Linear", "RMSNorm", "RotaryEmbedding", "SwiGLU", "apply_rotary", "rope_inv_freq",
           "set_weight_format"]


class Linear(nn.Module):
    """y = x W^T + b, with W in a storage format chosen once at load.

    While loading, W is a plain float parameter (`weight`) that checkpoint tensors are
    copied into; `set_format` then hands it to a `WeightFormat`, which returns the
    `LinearWeights` that compute the layer from then on (`weights`), and the plain
    parameter is dropped. Unformatted, the layer is a reference F.linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, many_rows: bool = True,
                 quantize: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.many_rows = many_rows  # False: an LM head (a row per sampling sequence), see WeightFormat.make
        self.quantize = quantize  # False: kept in the format's float form (WeightFormat.float_format)
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weights: LinearWeights | None = None
        # Input columns before which the weight is cut into parts whose products are added in
        # order (split_in_columns; deterministic inference's row-parallel linears). Empty: whole.
        self.column_cuts: tuple[int, ...] = ()
        # nn.Linear's initialisation (random test models; checkpoints overwrite it).
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def set_format(self, fmt: WeightFormat) -> None:
        self.weights = self._make(fmt, self.weight.detach())
        self.weight = None

    def load_weight(self, weight: torch.Tensor, fmt: WeightFormat | None = None) -> None:
        """Take a whole checkpoint weight: into `fmt` at once, or as the plain parameter."""
        if fmt is not None:
            if not self.quantize and not isinstance(weight, torch.Tensor):
                weight = weight.dequantize()
            self.weights = self._make(fmt, weight.detach() if isinstance(weight, torch.Tensor) else weight)
            self.weight = None
        else:
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)

    def _format(self, fmt: WeightFormat) -> WeightFormat:
        return fmt if self.quantize else fmt.float_format

    def _make(self, fmt: WeightFormat, weight) -> LinearWeights:
        if self.column_cuts:
            return split_in_columns(self._format(fmt), weight, self.column_cuts, self.many_rows)
        return self._format(fmt).make(weight, many_rows=self.many_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weights is None:
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        shape = x.shape
        y = self.weights.apply(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def set_weight_format(model: nn.Module, fmt: WeightFormat, embedding_dtype: torch.dtype | None = None) -> int:
    """Put every `Linear` of a loaded model into `fmt` (those not formatted while loading),
    and store embeddings in `embedding_dtype` (the model casts looked-up rows back); a model
    whose tied head now serves the embedding drops its own table. Returns how many linears
    this call formatted."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight is not None]
    for linear in linears:  # before the embeddings: a tied head reads the float32 weight here
        linear.set_format(fmt)
    for experts in model.modules():
        if isinstance(experts, Experts) and experts.expert_weights is None:
            experts.set_format(fmt)
    release = getattr(model, "release_tied_embedding", None)
    if release is not None:
        release(fmt)
    if embedding_dtype is not None:
        for module in model.modules():
            if isinstance(module, nn.Embedding) and module.weight is not None and module.weight.dtype != embedding_dtype:
                module.weight = nn.Parameter(module.weight.detach().to(embedding_dtype), requires_grad=False)
    return len(linears)


def linear_weights(model: nn.Module) -> list[LinearWeights]:
    """Every formatted linear weight of a model: its `Linear`s' and its experts'."""
    found = [m.weights for m in model.modules() if isinstance(m, Linear) and m.weights is not None]
    for experts in model.modules():
        if isinstance(experts, Experts) and experts.expert_weights is not None:
            found += [w for pair in experts.expert_weights if pair is not None for w in pair]
    return found


def place_weights_on_huge_pages(model: nn.Module) -> int:
    """Copy what decode steps stream of every linear weight into one huge-page arena
    (kernels/huge_pages.py: the default model's layers read 1.4x faster at one row on a Zen 4),
    after `set_weight_format` and before the fused layer gathers its operands. Returns the
    bytes placed (0 where the machine gives no huge pages)."""
    if not huge_pages.available():
        return 0
    weights = linear_weights(model)
    sizes: list[torch.Tensor] = []

    def measure(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t)
        return t

    for w in weights:
        w.move_streamed(measure)
    if not sizes or any(t.device.type != "cpu" for t in sizes):
        return 0
    arena = huge_pages.HugePageArena(huge_pages.HugePageArena.measure(sizes))
    for w in weights:
        w.move_streamed(arena.place)
    return arena.used


def unpack_gemm_panels(model: nn.Module, budget_bytes: int) -> tuple[int, int]:
    """Unpack every quantized weight's integer GEMM panels once (LinearWeights.unpack_gemm_panels)
    if together they take at most `budget_bytes`; none otherwise. Before the fused layer gathers
    its operands. Returns (bytes unpacked, bytes they would take)."""
    weights = linear_weights(model)
    needed = sum(w.gemm_panels_nbytes for w in weights)
    if not needed or needed > budget_bytes:
        return 0, needed
    for w in weights:
        w.unpack_gemm_panels()
    return needed, needed


class RMSNorm(nn.Module):
    """RMSNorm; given the residual stream too, it first adds x into it (vLLM's fused
    add + norm): `norm(x, residual)` returns (normed, residual + x). `out_dtype` bf16 is
    the bf16 activation path's (float32 residual, bf16 GEMM inputs)."""

    ops: TorchOps = REFERENCE_OPS  # the execution plan's element-wise ops, handed over at load

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`out_dtype`: the normed output's dtype (default x's); the residual keeps its own."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, out_dtype)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, out_dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "factors":  # explicit per-frequency divisors (GGUF rope_freqs)
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear")
    return inv_freq.float()


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent stretch: long wavelengths are divided by
    `factor`, short ones kept, the band between interpolated smoothly."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin table."""

    ops: TorchOps = REFERENCE_OPS  # the execution plan's element-wise ops, handed over at load

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        # On the CPU even while the model is built on the meta device: the first arange on
        # meta imports torch._dynamo, 1 s of every engine's start.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # [positions, head_dim / 2]
        self.register_buffer("sin", angles.sin(), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, [tokens, head_dim / 2]: looked up once
        per step and shared by every layer."""
        return self.cos[positions], self.sin[positions]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated by the step's table (in place by the native op)."""
        return self.ops.rotary(x, cos, sin)


class GatedMLP(nn.Module):
    """Gate and up projections fused into one matmul, then act(gate) * up, down: SwiGLU
    (silu, Llama/Qwen) or GeGLU (tanh-approximated gelu, Gemma)."""

    ops: TorchOps = REFERENCE_OPS  # the execution plan's element-wise ops, handed over at load

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.act = act
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x), self.act))


class Experts(nn.Module):
    """One layer's routed experts held by this rank, each a gated MLP without its own
    module: stacked as Hugging Face (transformers >= 5) holds them, `gate_up_proj`
    [experts, 2 * intermediate, hidden] (each expert's gate rows, then its up rows) and
    `down_proj` [experts, hidden, intermediate], which checkpoints are copied into.

    `set_format` then hands each expert's two matrices to the plan's `WeightFormat` (the
    skinny-kernel tiles, int8, int4, ... as for any linear) and drops the stacks: an expert
    multiplies its group of the step's tokens (SparseMoE) with the same kernels as a dense
    MLP of its width. A checkpoint loaded straight into a format never fills the stacks:
    each expert's matrices go into it as they arrive (`set_expert`), float or quantized as
    stored (a GGUF's blocks, one QuantizedTensor per expert and matrix)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj: nn.Parameter | None = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.expert_weights: list[tuple[LinearWeights, LinearWeights]] | None = None  # (gate_up, down) per expert
        # nn.Linear's scale (random test models; checkpoints overwrite it).
        nn.init.uniform_(self.gate_up_proj, -hidden**-0.5, hidden**-0.5)
        nn.init.uniform_(self.down_proj, -intermediate**-0.5, intermediate**-0.5)

    def set_format(self, fmt: WeightFormat) -> None:
        self.expert_weights = [(fmt.make(self.gate_up_proj[e].detach()), fmt.make(self.down_proj[e].detach()))
                        for e in range(self.num_experts)]
        self.gate_up_proj = None
        self.down_proj = None

    def set_expert(self, expert: int, gate_up: LinearWeights, down: LinearWeights) -> None:
        """One expert's matrices already in their format (loading into a format); the float
        stacks, never filled then, are dropped once every expert has its own."""
        if self.expert_weights is None:
            self.expert_weights = [None] * self.num_experts
        self.expert_weights[expert] = (gate_up, down)
        if all(w is not None for w in self.expert_weights):
            self.gate_up_proj = None
            self.down_proj = None

    @property
    def nbytes(self) -> int:
        """Bytes the experts' weights occupy in their format (the float stacks before it)."""
        if self.expert_weights is None:
            return sum(p.numel() * p.element_size() for p in (self.gate_up_proj, self.down_proj) if p is not None)
        return sum(w.nbytes for pair in self.expert_weights if pair is not None for w in pair)

    def grouped_mlp(self, rows: torch.Tensor, active: list[tuple[int, int]],
                    act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """Every active expert's MLP on its run of `rows` (`active`: (expert, rows) in the
        rows' order) with one native call per matrix (kernels.grouped_skinny_linear), when
        the experts are skinny-kernel tiles and no run is past the rows that kernel takes;
        None otherwise (the caller then runs expert by expert)."""
        if self.expert_weights is None or rows.dtype != torch.float32:
            return None
        pairs = [self.expert_weights[e] for e, _ in active]
        if not all(isinstance(w, CPUDenseWeights) and w.tiled is not None for pair in pairs for w in pair) \
                or max(n for _, n in active) > pairs[0][0].choice.skinny_max_rows:
            return None
        offsets = [0, *itertools.accumulate(n for _, n in active)]
        h = kernels.grouped_skinny_linear(rows.contiguous(), offsets, [g.tiled for g, _ in pairs], 2 * self.intermediate)
        return kernels.grouped_skinny_linear(act_and_mul(h).contiguous(), offsets, [d.tiled for _, d in pairs],
                                             self.hidden)

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.expert_weights is None:
            return F.linear(x, self.gate_up_proj[expert].to(x.dtype))
        return self.expert_weights[expert][0].apply(x)

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.expert_weights is None:
            return F.linear(x, self.down_proj[expert].to(x.dtype))
        return self.expert_weights[expert][1].apply(x)


SwiGLU = GatedMLP  # the name it had while SiLU was the only activation
