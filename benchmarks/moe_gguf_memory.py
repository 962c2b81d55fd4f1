"""Resident memory of a quantized GGUF mixture of experts, served as stored, against the file.

    .venv/bin/python benchmarks/moe_gguf_memory.py [--layers 2] [--experts 64] [--out /tmp/moe.gguf]

Writes a random-weight Qwen3-MoE GGUF in Qwen3-30B-A3B's layer shapes (hidden 2,048, 32/4
heads of 128, experts of width 768, 8 per token), `--layers` layers of `--experts` experts, a
vocabulary of 8,192, with llama.cpp's Q4_K_M choices for the big tensors: experts' gate/up
Q4_K and down Q6_K, attention Q4_K (v and output Q6_K), embeddings Q6_K; norms and the
router float32. Random blocks with small scales (gguf's Python package has no K-quant
quantizer; the values do not matter for memory). Then loads it in a fresh process per mode
(`LLM`, as stored by default; `--dtype float32`: dequantized) and prints the process's
anonymous resident memory (RssAnon: without the file's memory-mapped pages) after loading
and a 4-token generation, minus before (torch imported, kernels built), and the file size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np


def write(path: str, layers: int, experts: int, vocab: int = 8192) -> None:
    import gguf

    hidden, heads, kv_heads, head_dim, width = 2048, 32, 4, 128, 768
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(8)
    writer.add_expert_feed_forward_length(width)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"p{i}" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 259)])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def blocks(name: str, qtype: str, *shape: int) -> None:  # shape in PyTorch order, columns last
        q = gguf.GGMLQuantizationType[qtype]
        block, size = gguf.GGML_QUANT_SIZES[q]
        raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
        scale = rng.uniform(1e-5, 1e-4, (*raw.shape[:-1], 1)).astype(np.float16).view(np.uint8)
        if qtype == "Q4_K":
            raw[..., 0:2], raw[..., 2:4] = scale, scale
        else:  # Q6_K: d ends the block
            raw[..., -2:] = scale
        writer.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=q)

    def f32(name: str, *shape: int) -> None:
        writer.add_tensor(name, rng.uniform(0.5, 1.5, shape).astype(np.float32) if "norm" in name
                          else (rng.standard_normal(shape) * 0.02).astype(np.float32))

    blocks("token_embd.weight", "Q6_K", vocab, hidden)
    blocks("output.weight", "Q6_K", vocab, hidden)
    f32("output_norm.weight", hidden)
    for i in range(layers):
        p = f"blk.{i}."
        blocks(p + "attn_q.weight", "Q4_K", heads * head_dim, hidden)
        blocks(p + "attn_k.weight", "Q4_K", kv_heads * head_dim, hidden)
        blocks(p + "attn_v.weight", "Q6_K", kv_heads * head_dim, hidden)
        blocks(p + "attn_output.weight", "Q4_K", hidden, heads * head_dim)
        for name in ("attn_norm", "ffn_norm"):
            f32(p + name + ".weight", hidden)
        f32(p + "attn_q_norm.weight", head_dim)
        f32(p + "attn_k_norm.weight", head_dim)
        f32(p + "ffn_gate_inp.weight", experts, hidden)
        blocks(p + "ffn_gate_exps.weight", "Q4_K", experts, width, hidden)
        blocks(p + "ffn_up_exps.weight", "Q4_K", experts, width, hidden)
        blocks(p + "ffn_down_exps.weight", "Q6_K", experts, hidden, width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CHILD = """
import sys, torch
from tokenmill import kernels
kernels.cpu_kernels_available()
def rss():  # anonymous resident memory: the file's memory-mapped pages (RssFile) are the page cache's
    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon')).split()[1]) * 1024
before = rss()
from tokenmill.llm import LLM
kwargs = dict(model=sys.argv[1], max_model_len=512, kv_cache_memory=64 << 20)
if sys.argv[2] != 'stored':
    kwargs['dtype'] = sys.argv[2]
llm = LLM(**kwargs)
moe = [l.mlp.experts for l in llm.engine.executor.model.layers]
out = llm.generate([[5, 6, 7]], __import__('tokenmill').SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
print(rss() - before, sum(e.nbytes for e in moe), type(moe[0].expert_weights[0][0]).__name__)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--out", default="/tmp/moe-a3b-shapes-q4_k_m.gguf")
    parser.add_argument("--modes", nargs="+", default=["stored", "float32"])
    args = parser.parse_args()
    if not os.path.exists(args.out):
        write(args.out, args.layers, args.experts)
    size = os.path.getsize(args.out)
    print(f"file {args.out}: {size / 2**20:,.0f} MiB")
    for mode in args.modes:
        out = subprocess.run([sys.executable, "-c", CHILD, args.out, mode], capture_output=True, text=True, check=True)
        grown, experts, kind = out.stdout.split()[-3:]
        print(f"{mode:>8}: anonymous resident +{int(grown) / 2**20:,.0f} MiB ({int(grown) / size:.2f}x the file), "
              f"experts {int(experts) / 2**20:,.0f} MiB as {kind}")


if __name__ == "__main__":
    main()
