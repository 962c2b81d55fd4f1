"""The roofline of LLM serving: memory, bytes moved and FLOPs per step, as pure functions.

Every function states its formula. Units: bytes, seconds, FLOP (an int8 multiply-add
counts as two operations, like a float one). Torch-free.

The model behind the step times: a step reads the weights it uses once (however many
sequences it serves) plus each sequence's KV cache, and does 2 FLOPs per weight per token
plus the attention products; it takes max(bytes / bandwidth, FLOPs / FLOP/s), the slower of
the two, plus the time of its collective communication when a link is given. That is an
upper bound on speed: real kernels reach 50-90% of it.

Simplifications, stated once:
- MoE: a token uses `num_experts_per_tok` routed experts of each MoE layer; a step of t
  tokens reads the experts that at least one token picked, E x (1 - (1 - k/E)^t) of E under
  uniform, independent routing (real routers are skewed, so slightly fewer). TP shards
  every expert (no expert parallelism).
- MLA (DeepSeek-V2/V3): the cache holds the compressed latent, kv_lora_rank +
  qk_rope_head_dim values per token and layer for K and V together (as vLLM and SGLang
  store it), replicated on every TP rank; attention FLOPs are counted as for ordinary
  heads of qk_nope + qk_rope (scores) and v_head_dim (values), i.e. without absorbing the
  up-projections into the query.
- Sliding-window layers keep and read at most `sliding_window` tokens per sequence.
- Norms, biases, rotary embeddings, sampling and the embedding lookup are weights that are
  read but their FLOPs are not counted; activations are not counted in memory.
- Pipeline parallelism: every stage is timed as the slowest one (the last, which also holds
  the LM head); a token passes the stages one after another, so PP lowers no latency.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tokenmill.dtypes import KV_CACHE_DTYPES, KVCacheDtype, kv_cache_dtype_name
from tokenmill.planner.shape import ModelShape, TensorGroups

KIB, MIB, GIB = 2**10, 2**20, 2**30

# ----- devices ---------------------------------------------------------------------------------

COMPUTE_DTYPES = ("float32", "bfloat16", "fp8", "int8")
# A device without units for a dtype runs it at the next one's rate (weights dequantized
# in the kernel, as vLLM runs fp8 checkpoints on an A100).
_COMPUTE_FALLBACK = {"fp8": "bfloat16", "int8": "bfloat16", "bfloat16": "float32"}


@dataclass(frozen=True)
class Device:
    """What the roofline needs of one device (a GPU, or a CPU socket)."""

    name: str
    memory_bytes: int
    bandwidth: float  # memory read bandwidth, bytes/s
    flops: dict[str, float]  # dense FLOP/s by compute dtype (COMPUTE_DTYPES; int8: OP/s)
    kind: str = "gpu"  # "gpu" or "cpu"
    source: str = ""  # the datasheet, or how it was measured
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth <= 0:
            raise ValueError(f"device {self.name!r}: memory and bandwidth must be positive")
        unknown = set(self.flops) - set(COMPUTE_DTYPES)
        if unknown or not any(rate > 0 for rate in self.flops.values()):
            raise ValueError(f"device {self.name!r}: FLOP/s are needed for some of {COMPUTE_DTYPES}, "
                             f"got {sorted(self.flops)}")

    def compute_rate(self, dtype: str) -> tuple[float, str]:
        """FLOP/s for `dtype`, and the dtype whose rate that is (fp8 and int8 fall back to
        bfloat16, bfloat16 to float32, where the device has no figure for them)."""
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"unknown compute dtype {dtype!r}; choose from {', '.join(COMPUTE_DTYPES)}")
        while not self.flops.get(dtype):
            if dtype not in _COMPUTE_FALLBACK:
                raise ValueError(f"device {self.name!r} has no FLOP/s figure for {dtype} or a fallback")
            dtype = _COMPUTE_FALLBACK[dtype]
        return self.flops[dtype], dtype

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Device:
        try:
            return cls(name=str(data["name"]), memory_bytes=int(data["memory_bytes"]),
                       bandwidth=float(data["bandwidth"]), flops={k: float(v) for k, v in data["flops"].items()},
                       kind=data.get("kind", "gpu"), source=data.get("source", ""),
                       notes=tuple(data.get("notes", ())))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"a device record needs name, memory_bytes, bandwidth and flops: {exc!r}") from None


# ----- weight formats --------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFormat:
    """How weights are stored: bits per weight with their scales, and the dtype they are
    computed in (FLOP/s looked up in `Device.flops`)."""

    name: str
    bits_per_weight: float
    compute_dtype: str
    embedding_bits: float | None = None  # the embedding and LM head, where kept apart; None: the same
    description: str = ""

    @property
    def head_bits(self) -> float:
        return self.bits_per_weight if self.embedding_bits is None else self.embedding_bits


# llama.cpp block types: bytes per block x 8 / weights per block (ggml-common.h).
GGUF_BITS_PER_WEIGHT: dict[str, float] = {
    "Q8_0": 8.5,  # 32 int8 + an fp16 scale = 34 bytes / 32
    "Q4_0": 4.5,  # 32 x 4 bits + an fp16 scale = 18 bytes / 32
    "Q4_1": 5.0,  # 32 x 4 bits + fp16 scale and minimum = 20 bytes / 32
    "Q5_0": 5.5,  # 32 x 4 bits + 32 high bits + an fp16 scale = 22 bytes / 32
    "Q5_1": 6.0,  # as Q5_0 + an fp16 minimum = 24 bytes / 32
    "Q4_K": 4.5,  # 256 x 4 bits + 12 bytes of 6-bit sub-block scales/mins + fp16 d, dmin = 144 / 256
    "Q5_K": 5.5,  # Q4_K + 256 high bits = 176 / 256
    "Q6_K": 6.5625,  # 256 x 4 + 256 x 2 bits + 16 int8 scales + an fp16 d = 210 / 256
}
INT4_GROUP_SIZES = (32, 64, 128)

WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "float32": WeightFormat("float32", 32, "float32", description="dense float32"),
    "bfloat16": WeightFormat("bfloat16", 16, "bfloat16", description="dense bfloat16"),
    "float16": WeightFormat("float16", 16, "bfloat16", description="dense float16 (computed at the bf16 rate)"),
    "fp8": WeightFormat("fp8", 8, "fp8", embedding_bits=16,
                        description="fp8 e4m3, per-tensor or per-channel scales (W8A8 where the device has fp8, "
                                    "else dequantized to bf16); embedding and LM head in bf16"),
    "int8": WeightFormat("int8", 8, "int8", embedding_bits=16,
                         description="int8, one scale per output channel (< 0.1%, not counted), int8 GEMMs; "
                                     "embedding and LM head in bf16"),
    **{f"int4-g{g}": WeightFormat(f"int4-g{g}", 4 + 20 / g, "bfloat16", embedding_bits=16,
                                  description=f"int4 in groups of {g} with an fp16 scale and a 4-bit zero point "
                                              f"each (GPTQ/AWQ layout, {4 + 20 / g:g} bits), dequantized to bf16; "
                                              "embedding and LM head in bf16")
       for g in INT4_GROUP_SIZES},
    **{name.lower(): WeightFormat(name, bits, "int8",
                                  description=f"llama.cpp {name} blocks ({bits:g} bits/weight) on every matrix, "
                                              "activations quantized to 8 bits for integer dot products")
       for name, bits in GGUF_BITS_PER_WEIGHT.items()},
}
_FORMAT_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16",
                   "half": "float16", "int4": "int4-g128", "fp8_e4m3": "fp8", "w8a8": "int8"}


def weight_format(name: str) -> WeightFormat:
    """A format by name (case-insensitive): float32, bfloat16, float16, fp8, int8, int4[-gG],
    or a GGUF block type such as q4_k."""
    key = name.strip().lower()
    key = _FORMAT_ALIASES.get(key, key)
    if key in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[key]
    hint = ""
    if key.endswith(("_k_m", "_k_s", "_k_l")):
        hint = (f" ({name} is a llama.cpp file mix, mostly {key[:4].upper()} with some tensors in more bits: "
                f"pass the GGUF file itself for its exact bytes, or {key[:4]} for the base type)")
    raise ValueError(f"unknown weight format {name!r}{hint}; choose from {', '.join(WEIGHT_FORMATS)}")


def stored_format(stored_bytes: TensorGroups, params: TensorGroups, name: str) -> WeightFormat:
    """A checkpoint's own format (a GGUF's blocks as stored): its mean bits per weight,
    computed like the GGUF block types (int8 dot products)."""
    return WeightFormat(name, 8 * stored_bytes.total / params.total, "int8",
                        description=f"as stored in the file: {name}")


# ----- KV cache dtypes ---------------------------------------------------------------------------


def kv_cache_dtype(name: str, weights: WeightFormat) -> KVCacheDtype:
    """A --kv-cache-dtype of the engine's table (tokenmill/dtypes.py; bf16-style spellings
    of the weight formats work too). `auto` is the weights' compute dtype as vLLM's auto is
    the model's dtype: float32 for float32 weights, float16 for float16, else bfloat16."""
    key = kv_cache_dtype_name(_FORMAT_ALIASES.get(name.strip().lower(), name))
    if key == "auto":
        key = {"float32": "float32", "float16": "float16"}.get(weights.name, "bfloat16")
    return KV_CACHE_DTYPES[key]


# ----- parameter counts and weight bytes -----------------------------------------------------------


def attention_params_per_layer(shape: ModelShape) -> int:
    """GQA: q h x H*d, k and v h x Hkv*d each, o H*d x h (+ q/k/v biases H*d + 2 Hkv*d,
    + q/k norms 2 d). MLA: q_a h x q_lora (+ its norm) and q_b q_lora x H*(nope + rope), or a
    full q h x H*(nope + rope); kv_a h x (kv_lora + rope) (+ its norm); kv_b kv_lora x
    H*(nope + v); o H*v x h."""
    h, heads = shape.hidden_size, shape.num_heads
    if shape.is_mla:
        qk = shape.qk_head_dim
        q = (h * shape.q_lora_rank + shape.q_lora_rank + shape.q_lora_rank * heads * qk
             if shape.q_lora_rank else h * heads * qk)
        kv = h * (shape.kv_lora_rank + shape.qk_rope_head_dim) + shape.kv_lora_rank
        kv += shape.kv_lora_rank * heads * (shape.qk_nope_head_dim + shape.v_head_dim)
        return q + kv + heads * shape.v_head_dim * h
    q_dim, kv_dim = heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    params = h * q_dim + 2 * h * kv_dim + q_dim * h
    params += q_dim + 2 * kv_dim if shape.attention_bias else 0
    params += 2 * shape.head_dim if shape.qk_norm else 0
    return params


def param_counts(shape: ModelShape) -> TensorGroups:
    """Parameters by group. Embedding = LM head = vocab x h (one matrix when tied); a SwiGLU
    MLP of width m has 3 h m; a MoE layer has E routed experts of width m_e, shared experts
    of total width m_s and a router h x E; each layer has `norms_per_layer` norms of h."""
    h, layers = shape.hidden_size, shape.num_layers
    moe_layers = shape.num_moe_layers
    return TensorGroups(
        embedding=shape.vocab_size * h,
        lm_head=shape.vocab_size * h,
        tied=shape.tie_word_embeddings,
        attention=layers * attention_params_per_layer(shape),
        mlp=(layers - moe_layers) * 3 * h * shape.intermediate_size
        + moe_layers * 3 * h * shape.shared_expert_intermediate_size,
        experts=moe_layers * shape.num_experts * 3 * h * shape.moe_intermediate_size,
        router=moe_layers * h * shape.num_experts,
        layer_norms=layers * shape.norms_per_layer * h,
        final_norm=h,
    )


def active_params(params: TensorGroups, shape: ModelShape) -> int:
    """Parameters one token uses: all but the routed experts it does not pick,
    total - experts x (1 - k/E)."""
    return params.total - params.experts + active_expert_params(params, shape)


def active_expert_params(params: TensorGroups, shape: ModelShape) -> int:
    return params.experts * shape.num_experts_per_tok // shape.num_experts if shape.is_moe else 0


def weight_bytes(params: TensorGroups, fmt: WeightFormat) -> TensorGroups:
    """Bytes by group: ceil(parameters x bits / 8), the embedding and LM head at the
    format's `head_bits`."""

    def size(count: int, bits: float) -> int:
        return math.ceil(count * bits / 8)

    bits = fmt.bits_per_weight
    return replace(params, embedding=size(params.embedding, fmt.head_bits), lm_head=size(params.lm_head, fmt.head_bits),
                   attention=size(params.attention, bits), mlp=size(params.mlp, bits),
                   experts=size(params.experts, bits), router=size(params.router, bits),
                   layer_norms=size(params.layer_norms, bits), final_norm=size(params.final_norm, bits),
                   other=size(params.other, bits))


# ----- parallelism -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parallelism:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    link_bandwidth: float | None = None  # bytes/s each device sends over the link; None: no comm term
    link_latency: float = 0.0  # seconds per message hop
    activation_bytes: int = 2  # bytes per activation value sent (bf16)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor and pipeline parallel sizes must be at least 1")
        if self.link_bandwidth is not None and self.link_bandwidth <= 0:
            raise ValueError("the link bandwidth must be positive")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def stage_layers(shape: ModelShape, parallel: Parallelism) -> int:
    """Layers of the largest pipeline stage: ceil(layers / PP)."""
    return -(-shape.num_layers // parallel.pipeline_parallel_size)


def device_weight_bytes(weights: TensorGroups, shape: ModelShape, parallel: Parallelism) -> float:
    """Weights one device holds: [layers x ceil(L/PP)/L + the embedding and LM head
    (PP = 1: both, counted once when tied; PP > 1: the larger, as the first stage holds the
    embedding and the last the LM head) + final norm] / TP."""
    pp, tp = parallel.pipeline_parallel_size, parallel.tensor_parallel_size
    if pp == 1:
        return weights.total / tp
    ends = max(weights.embedding, weights.lm_head) + weights.final_norm + weights.other
    return (weights.layers * stage_layers(shape, parallel) / shape.num_layers + ends) / tp


# ----- KV cache ----------------------------------------------------------------------------------


def kv_bytes_per_token(shape: ModelShape, kv: KVCacheDtype, parallel: Parallelism | None = None) -> int:
    """KV bytes one token takes on one device: 2 x layers x KV heads x (head_dim x bytes +
    scale bytes). With TP each device holds ceil(KV heads / TP) heads (replicated when TP >
    KV heads), with PP the layers of one stage. MLA: layers x ((kv_lora_rank + qk_rope_head_dim)
    x bytes + scale bytes), on every TP rank. For sliding-window layers this is the rate
    below the window (see `kv_bytes_per_request`)."""
    parallel = parallel or Parallelism()
    return stage_layers(shape, parallel) * _kv_bytes_per_layer_token(shape, kv, parallel)


def _kv_bytes_per_layer_token(shape: ModelShape, kv: KVCacheDtype, parallel: Parallelism) -> int:
    if shape.is_mla:
        return (shape.kv_lora_rank + shape.qk_rope_head_dim) * kv.bytes_per_element + kv.scale_bytes
    heads = -(-shape.num_kv_heads // parallel.tensor_parallel_size)
    return 2 * heads * (shape.head_dim * kv.bytes_per_element + kv.scale_bytes)


def kv_layer_tokens(shape: ModelShape, context: int) -> int:
    """Token slots a sequence of `context` tokens keeps over all layers: global layers x
    context + sliding layers x min(context, window)."""
    sliding = shape.num_sliding_layers
    window = shape.sliding_window or context
    return (shape.num_layers - sliding) * context + sliding * min(context, window)


def kv_bytes_per_request(shape: ModelShape, kv: KVCacheDtype, context: int,
                         parallel: Parallelism | None = None) -> int:
    """KV bytes of one sequence of `context` tokens on one device: KV bytes per layer and
    token x `kv_layer_tokens` x (stage layers / layers). Without sliding windows and PP this
    is exactly kv_bytes_per_token x context."""
    parallel = parallel or Parallelism()
    slots = kv_layer_tokens(shape, context) * stage_layers(shape, parallel)
    return -(-slots * _kv_bytes_per_layer_token(shape, kv, parallel) // shape.num_layers)


def max_concurrent_requests(kv_budget_bytes: float, bytes_per_request: float) -> int:
    """Sequences whose whole KV cache fits at once: floor(budget / bytes per request)."""
    if bytes_per_request <= 0:
        raise ValueError("bytes per request must be positive")
    return max(0, int(kv_budget_bytes // bytes_per_request))


def kv_budget(device: Device, weights_per_device: float, memory_utilization: float) -> float:
    """KV memory per device when none is given: utilization x device memory - weights
    (vLLM's --gpu-memory-utilization; activations and the runtime's own memory not counted)."""
    return memory_utilization * device.memory_bytes - weights_per_device


# ----- FLOPs -------------------------------------------------------------------------------------


def linear_flops_per_token(params: TensorGroups, shape: ModelShape) -> int:
    """FLOPs of the layers' weights for one token: 2 x active layer parameters (the LM head
    and attention products apart)."""
    return 2 * (params.layers - params.experts + active_expert_params(params, shape))


def lm_head_flops(shape: ModelShape) -> int:
    """FLOPs of one row of logits: 2 x vocab x h."""
    return 2 * shape.vocab_size * shape.hidden_size


def _sum_min(lo: int, hi: int, cap: int) -> int:
    """sum of min(j, cap) for j in lo..hi."""
    if hi < lo:
        return 0
    below_hi = min(hi, cap)
    below = (lo + below_hi) * (below_hi - lo + 1) // 2 if below_hi >= lo else 0
    return below + cap * (hi - max(lo - 1, cap)) if hi > cap else below


def attention_flops(shape: ModelShape, new_tokens: int, cached_tokens: int = 0) -> int:
    """FLOPs of the attention products (scores and weighted values) for `new_tokens` tokens
    after `cached_tokens` ones: 2 x heads x (qk_dim + v_dim) x keys attended, summed over the
    layers, where the i-th new token attends to cached + i keys (at most the window in a
    sliding layer). A decode step at context c: 2 x H x (qk + v) x c per layer; a prefill of
    n tokens: n (n + 1) / 2 keys per layer."""
    per_key = 2 * shape.num_heads * (shape.qk_head_dim + shape.value_head_dim)
    lo, hi = cached_tokens + 1, cached_tokens + new_tokens
    keys = (shape.num_layers - shape.num_sliding_layers) * _sum_min(lo, hi, hi)
    if shape.num_sliding_layers:
        keys += shape.num_sliding_layers * _sum_min(lo, hi, shape.sliding_window or hi)
    return per_key * keys


def experts_touched(num_experts: int, experts_per_token: int, tokens: int) -> float:
    """Expected distinct experts a MoE layer runs for `tokens` tokens picking k of E each,
    uniformly and independently: E x (1 - (1 - k/E)^tokens)."""
    if num_experts == 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** tokens)


# ----- step times --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """A model in a weight format on devices: what every step-time formula reads."""

    shape: ModelShape
    params: TensorGroups  # parameter counts
    weights: TensorGroups  # bytes as stored
    kv: KVCacheDtype
    device: Device
    compute_dtype: str
    parallel: Parallelism = field(default_factory=Parallelism)

    @property
    def flops_rate(self) -> float:
        return self.device.compute_rate(self.compute_dtype)[0]


@dataclass(frozen=True)
class StepTime:
    """One step, per pipeline stage (the slowest): bytes and FLOPs per device and their times."""

    bytes: float
    flops: float
    memory_s: float
    compute_s: float
    comm_s: float = 0.0
    stages: int = 1

    @property
    def seconds(self) -> float:
        """stages x max(memory, compute) + communication."""
        return self.stages * max(self.memory_s, self.compute_s) + self.comm_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def weights_read_per_step(dep: Deployment, tokens: int) -> float:
    """Weight bytes one device reads in a step of `tokens` tokens: [(always-used layer weights
    + routed experts x touched/E) x stage layers / layers + LM head + final norm] / TP. A dense
    model's batch-1 decode reads everything but the (untied) embedding table."""
    w, shape, par = dep.weights, dep.shape, dep.parallel
    experts = w.experts * experts_touched(shape.num_experts, shape.num_experts_per_tok, tokens) / shape.num_experts \
        if shape.is_moe else 0.0
    stage = stage_layers(shape, par) / shape.num_layers
    return ((w.layers - w.experts + experts) * stage + w.lm_head + w.final_norm + w.other) / par.tensor_parallel_size


def communication_seconds(dep: Deployment, tokens: int) -> float:
    """2 all-reduces per layer of tokens x h activations under TP, and (PP - 1) hand-overs
    between stages, when a link bandwidth is given (see `allreduce_seconds`)."""
    par = dep.parallel
    if par.link_bandwidth is None:
        return 0.0
    message = tokens * dep.shape.hidden_size * par.activation_bytes
    seconds = 2 * dep.shape.num_layers * allreduce_seconds(message, par.tensor_parallel_size,
                                                           par.link_bandwidth, par.link_latency)
    return seconds + (par.pipeline_parallel_size - 1) * (par.link_latency + message / par.link_bandwidth)


def allreduce_seconds(message_bytes: float, devices: int, bandwidth: float, latency: float = 0.0) -> float:
    """A ring all-reduce: 2 (p - 1) hops of latency + 2 (p - 1)/p x message / bandwidth; 0 for p = 1."""
    if devices <= 1:
        return 0.0
    return 2 * (devices - 1) * latency + 2 * (devices - 1) / devices * message_bytes / bandwidth


def decode_step(dep: Deployment, batch: int, context: int) -> StepTime:
    """One decode step of `batch` sequences, each with `context` tokens in its KV cache:
    bytes = weights read (`weights_read_per_step`) + batch x KV bytes per request;
    FLOPs = batch x [(2 x active layer params + attention at context) x stage share
            + 2 x vocab x h] / TP;
    time = PP x max(bytes / bandwidth, FLOPs / FLOP/s) + communication."""
    shape, par = dep.shape, dep.parallel
    stage = stage_layers(shape, par) / shape.num_layers
    tp = par.tensor_parallel_size
    read = weights_read_per_step(dep, batch) + batch * kv_bytes_per_request(shape, dep.kv, context, par)
    per_sequence = (linear_flops_per_token(dep.params, shape) + attention_flops(shape, 1, context - 1)) * stage
    flops = batch * (per_sequence + lm_head_flops(shape)) / tp
    return StepTime(read, flops, read / dep.device.bandwidth, flops / dep.flops_rate,
                    communication_seconds(dep, batch), par.pipeline_parallel_size)


def prefill_step(dep: Deployment, batch: int, prompt_len: int) -> StepTime:
    """The prefill of `batch` prompts of `prompt_len` tokens each, in one step:
    FLOPs = [batch x (2 x active layer params x prompt_len + attention over the prompt)
             x stage share + batch x 2 x vocab x h (logits of each prompt's last token)] / TP;
    bytes = the weights used (MoE: the experts batch x prompt_len tokens touch);
    time = PP x max(bytes / bandwidth, FLOPs / FLOP/s) + communication. This is the TTFT
    of requests that arrive together and meet an idle engine."""
    shape, par = dep.shape, dep.parallel
    stage = stage_layers(shape, par) / shape.num_layers
    tokens = batch * prompt_len
    layer_flops = tokens * linear_flops_per_token(dep.params, shape) + batch * attention_flops(shape, prompt_len)
    flops = (layer_flops * stage + batch * lm_head_flops(shape)) / par.tensor_parallel_size
    read = weights_read_per_step(dep, tokens)
    return StepTime(read, flops, read / dep.device.bandwidth, flops / dep.flops_rate,
                    communication_seconds(dep, tokens), par.pipeline_parallel_size)


def compute_bound_batch(dep: Deployment, context: int, limit: int = 1 << 20) -> int | None:
    """The smallest batch whose decode step is compute-bound (FLOPs / FLOP/s >= bytes /
    bandwidth), None below `limit`. For a dense model, with W weight bytes, F FLOPs and K KV
    bytes per sequence: b* = ceil((W / B) / (F / C - K / B)), and never when F / C <= K / B
    (long contexts: attention reads 2 x bytes per KV value for ~2 x H/Hkv FLOPs). For a MoE
    model W grows with b; compute - memory stays convex in b, so a doubling search then a
    bisection finds b*."""

    def compute_bound(batch: int) -> bool:
        step = decode_step(dep, batch, context)
        return step.compute_s >= step.memory_s

    high = 1
    while not compute_bound(high):
        if high >= limit:
            return None
        high = min(2 * high, limit)
    low = high // 2  # not compute-bound (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle, high)
    return high
