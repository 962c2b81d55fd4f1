"""Random-weight Llama models of real sizes, for speed (issue 23: SmolLM2-135M is so small that
per-step overhead hides the bandwidth limit users meet on the 1-8B models they run).

    .venv/bin/python benchmarks/real_shapes.py --shape llama-1b [--types Q4_0,Q4_1,Q8_0]
    .venv/bin/python benchmarks/compare.py run --gguf ~/.cache/tokenmill/peers/llama-1b.Q4_0.gguf \\
        --systems tokenmill,vllm,llamacpp-q4_1 ...

Llama-3.2-1B's layer shapes (16 layers, hidden 2,048, 32 query / 8 KV heads of 64, FFN 8,192,
tied embeddings) or Llama-3.1-8B's (32 layers, hidden 4,096, 32 / 8 heads of 128, FFN 14,336)
with the default model's vocabulary (49,152) and tokenizer, written once into the peers
directory (`compare.py`'s, default ~/.cache/tokenmill/peers) as

- `<shape>-hf/`: a bf16 Hugging Face directory (vLLM's input; sharded by layers), and
- `<shape>.<TYPE>.gguf`: the same weights quantized by gguf's Python package, every 2-D
  tensor in TYPE (the embedding too: "pure" files, no Q6_K head), Q/K rows reordered as
  llama.cpp's converter does,

named as `compare.py` names a GGUF's companions (`--gguf <shape>.Q4_0.gguf` finds `<shape>-hf`;
its llamacpp-q4_1 system runs the given GGUF). Weights are N(0, 0.02) from a fixed seed, norms 1:
speed does not depend on weight values, and the text they generate is noise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The repository in place of this script's directory, whose kernels.py would shadow a package
# transformers imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from tokenmill.config import default_model_path  # noqa: E402

DEFAULT_PEERS_DIR = Path("~/.cache/tokenmill/peers").expanduser()


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "llama-1b": Shape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, tied=True),  # Llama-3.2-1B
    "llama-8b": Shape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, tied=False),  # Llama-3.1-8B
}


def progress(message: str) -> None:
    print(f"[real_shapes] {message}", file=sys.stderr, flush=True)


def layer_tensors(shape: Shape, i: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes (out, in) of layer i."""
    q, kv, h = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    p = f"model.layers.{i}."
    return {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (shape.ffn, h), p + "mlp.up_proj.weight": (shape.ffn, h),
            p + "mlp.down_proj.weight": (h, shape.ffn),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def weights(shape: Shape, vocab: int, seed: int = 0):
    """(name, float32 array) of every tensor, each from its own seed, rounded to bf16 values
    so that the bf16 directory and the GGUFs hold the same weights before quantization."""
    import torch

    names = {"model.embed_tokens.weight": (vocab, shape.hidden)}
    for i in range(shape.layers):
        names.update(layer_tensors(shape, i))
    names["model.norm.weight"] = (shape.hidden,)
    if not shape.tied:
        names["lm_head.weight"] = (vocab, shape.hidden)
    for k, (name, dims) in enumerate(names.items()):
        if len(dims) == 1:
            yield name, np.ones(dims, dtype=np.float32)
            continue
        gen = torch.Generator().manual_seed(seed * 100003 + k)
        yield name, (torch.randn(dims, generator=gen) * 0.02).bfloat16().float().numpy()


def rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotate-half Q/K rows -> llama.cpp's interleaved pairs (its converter's
    permute; tokenmill's loader undoes it: model/loader.py unpermute_rope_rows)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf(shape: Shape, target: Path, vocab: int, layers_per_shard: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    gguf_path = default_model_path()
    AutoTokenizer.from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name).save_pretrained(tmp)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
              "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
              "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": shape.rope_theta, "tie_word_embeddings": shape.tied, "vocab_size": vocab,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files = 0

    def flush() -> None:
        nonlocal files, shard
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard = {}

    for name, w in weights(shape, vocab):
        shard[name] = torch.from_numpy(w).bfloat16()
        if name.endswith("post_attention_layernorm.weight") and int(name.split(".")[2]) % layers_per_shard == 0:
            flush()
            progress(f"hf: through {name.rsplit('.', 2)[0]}")
    flush()
    total = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}, indent=2))
    tmp.rename(target)


def write_gguf(shape: Shape, target: Path, qtype: str, vocab: int) -> None:
    import gguf

    source = gguf.GGUFReader(default_model_path())
    tmp = target.with_name(target.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"random {target.stem}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    for name, field in source.fields.items():  # the default model's tokenizer, as stored
        if name.startswith("tokenizer."):
            value = field.contents()
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, value, field.types[0], sub_type=sub)
    q = gguf.GGMLQuantizationType[qtype]
    for name, w in weights(shape, vocab):
        if ".q_proj." in name:
            w = rope_permute(w, shape.heads)
        elif ".k_proj." in name:
            w = rope_permute(w, shape.kv_heads)
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, q), raw_dtype=q)
    progress(f"gguf {qtype}: writing {target.name}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    tmp.rename(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-1b")
    parser.add_argument("--types", default="Q4_0,Q4_1,Q8_0", help="GGUF types to write (gguf's quantizers)")
    parser.add_argument("--peers-dir", default=str(DEFAULT_PEERS_DIR))
    parser.add_argument("--no-hf", action="store_true", help="skip the bf16 Hugging Face directory")
    args = parser.parse_args()
    shape, root = SHAPES[args.shape], Path(args.peers_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    import gguf

    vocab = len(gguf.GGUFReader(default_model_path()).fields["tokenizer.ggml.tokens"].data)
    hf = root / f"{args.shape}-hf"
    if not args.no_hf and not (hf / "config.json").is_file():
        start = time.perf_counter()
        progress(f"hf: writing {hf}")
        write_hf(shape, hf, vocab, layers_per_shard=4)
        progress(f"hf: done in {time.perf_counter() - start:.0f} s")
    for qtype in args.types.split(","):
        target = root / f"{args.shape}.{qtype}.gguf"
        if target.is_file():
            progress(f"{target} exists, skipped")
            continue
        start = time.perf_counter()
        progress(f"gguf {qtype}: quantizing into {target}")
        write_gguf(shape, target, qtype, vocab)
        progress(f"gguf {qtype}: done in {time.perf_counter() - start:.0f} s ({target.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
