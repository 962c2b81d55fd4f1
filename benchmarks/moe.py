"""A mixture-of-experts decode step against a dense model with the same active parameters.

    .venv/bin/python benchmarks/moe.py [--layers 4] [--experts 128] [--batch 1 4] [--rounds 15] [--quantization int4]
    .venv/bin/python benchmarks/moe.py --planner-configs DIR   # the two models for `tokenmill plan DIR/moe`

Random weights (no checkpoint): Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV
heads of 128, q/k norms, experts of width 768, 8 of them per token, renormalised), `--layers`
of them, a vocabulary of `--vocab` (the real 151,936-row LM head would add the same time to
both models). The dense model is the same with one MLP of 8 x 768 = 6,144 columns: what a
token reads at batch 1 in the MoE model. Both run the native CPU plan with bf16-tiled weights
(the skinny kernel for a few rows; no oneDNN copies, to keep memory down) and the paged
native attention over a context of `--context` tokens per sequence.

Each round times one decode step of each model in turn (so a change in the machine's load
hits both alike); printed: the median and the spread (min-max) of the per-step times, and
the MoE / dense ratio of the medians. Not part of CI; a shared machine gives noisy figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

import torch

from tokenmill.attention.backend import BatchLayout, ForwardContext, StepKind, forward_context
from tokenmill.attention.cpu_native import CPUNativeBackend
from tokenmill.attention.kv_cache import LayerKVCache
from tokenmill.kernels import cpu_kernels_available
from tokenmill.model.layers import Experts, Linear
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model_arch import ModelArchConfig
from tokenmill.runner.plan import ExecutionPlan, apply_plan, cpu_native_plan, quantized_plan

BLOCK = 16


def qwen3_30b_a3b_shapes(layers: int, experts: int, vocab: int) -> ModelArchConfig:
    return ModelArchConfig("qwen3_moe", vocab, 2048, 6144, layers, 32, 4, 128, rms_norm_eps=1e-6, rope_theta=1e6,
                           max_position_embeddings=4096, qk_norm=True, num_experts=experts, num_experts_per_tok=8,
                           moe_intermediate_size=768, norm_topk_prob=True)


def dense_active_twin(moe: ModelArchConfig) -> ModelArchConfig:
    """The same model with one MLP as wide as the experts a token runs."""
    return replace(moe, architecture="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                   intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size)


def build(arch: ModelArchConfig, plan: ExecutionPlan) -> LlamaForCausalLM:
    """A random model in `plan`'s weight format, built a layer at a time so the float
    weights of only one layer's experts live at once."""
    with torch.device("meta"):
        net = LlamaForCausalLM(arch)
    fmt = plan.weight_format
    for module in net.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if isinstance(module, Linear) and name == "weight":
                module.load_weight(torch.empty(param.shape).uniform_(-1, 1) * param.shape[1] ** -0.5, fmt)
            elif isinstance(module, Experts):
                continue
            else:
                value = torch.ones(param.shape) if "norm" in name else torch.randn(param.shape) * 0.02
                module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
        if isinstance(module, Experts):
            for name in ("gate_up_proj", "down_proj"):
                shape = module._parameters[name].shape
                stack = torch.empty(shape, dtype=torch.bfloat16).uniform_(-1, 1) * shape[2] ** -0.5
                module._parameters[name] = torch.nn.Parameter(stack, requires_grad=False)
            module.set_format(fmt)
    net.rebuild_rotary(torch.device("cpu"))
    net.eval()
    apply_plan(net, plan)
    return net


class DecodeLoop:
    """`batch` sequences prefilled to `context` tokens in a paged KV cache; `step()` decodes
    one token of each."""

    def __init__(self, model: LlamaForCausalLM, batch: int, context: int, steps: int) -> None:
        cfg = model.cfg
        self.model, self.backend = model, CPUNativeBackend()
        blocks_per_seq = -(-(context + steps + 1) // BLOCK)
        self.caches = [LayerKVCache.allocate(batch * blocks_per_seq + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                                             torch.float32) for _ in range(cfg.num_layers)]
        self.tables = [[1 + s * blocks_per_seq + b for b in range(blocks_per_seq)] for s in range(batch)]
        self.lens = [0] * batch
        gen = torch.Generator().manual_seed(0)
        for s in range(batch):  # one sequence per prefill step
            self._run([s], [context], torch.randint(0, cfg.vocab_size, (context,), generator=gen))

    def _run(self, seqs: list[int], counts: list[int], ids: torch.Tensor) -> None:
        pos, slots = [], []
        for s, n in zip(seqs, counts):
            for p in range(self.lens[s], self.lens[s] + n):
                pos.append(p)
                slots.append(self.tables[s][p // BLOCK] * BLOCK + p % BLOCK)
        layout = BatchLayout(query_lens=counts, context_lens=[self.lens[s] + n for s, n in zip(seqs, counts)],
                             block_tables=[self.tables[s] for s in seqs], slot_mapping=slots, block_size=BLOCK)
        ctx = ForwardContext.for_step(StepKind.PER_OP, self.backend, layout, self.caches, torch.device("cpu"))
        with forward_context(ctx), torch.inference_mode():
            self.model.compute_logits(self.model(ids, torch.tensor(pos)))
        for s, n in zip(seqs, counts):
            self.lens[s] += n

    def step(self) -> None:
        seqs = list(range(len(self.lens)))
        self._run(seqs, [1] * len(seqs), torch.randint(0, self.model.cfg.vocab_size, (len(seqs),)))


def write_planner_configs(directory: str, moe: ModelArchConfig) -> None:
    """Both models as config.json files: what `tokenmill plan` prices against this benchmark."""
    common = dict(vocab_size=moe.vocab_size, hidden_size=moe.hidden_size, intermediate_size=moe.intermediate_size,
                  num_hidden_layers=moe.num_layers, num_attention_heads=moe.num_heads,
                  num_key_value_heads=moe.num_kv_heads, head_dim=moe.head_dim, rms_norm_eps=moe.rms_norm_eps,
                  rope_theta=moe.rope_theta, max_position_embeddings=moe.max_position_embeddings,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
    configs = {
        "moe": dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=moe.num_experts,
                    num_experts_per_tok=moe.num_experts_per_tok, moe_intermediate_size=moe.moe_intermediate_size,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
        "dense": dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                      intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size),
    }
    for name, config in configs.items():
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        with open(os.path.join(directory, name, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        print(os.path.join(directory, name, "config.json"))


def cpu_description() -> str:
    with open("/proc/cpuinfo") as f:
        info = f.read()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{name}; {' '.join(wanted)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--planner-configs", metavar="DIR", default=None,
                        help="write the two models as Hugging Face config.json files (DIR/moe, DIR/dense) for "
                             "`tokenmill plan`, and exit")
    parser.add_argument("--quantization", choices=["int4", "int8"], default=None,
                        help="both models' linears and experts in this format (the quantized kernels; an expert at "
                             "a time, as a GGUF's experts served as stored run) instead of bf16 tiles")
    args = parser.parse_args()
    if args.planner_configs:
        write_planner_configs(args.planner_configs, qwen3_30b_a3b_shapes(args.layers, args.experts, args.vocab))
        return
    if not cpu_kernels_available():
        raise SystemExit("the native CPU kernels did not build: python -m tokenmill.kernels -v shows why")
    torch.set_num_threads(args.threads)
    plan = cpu_native_plan(torch.bfloat16, onednn=False, fused_decode=False)
    if args.quantization:
        plan = quantized_plan(plan, args.quantization, 32)
    moe_arch = qwen3_30b_a3b_shapes(args.layers, args.experts, args.vocab)
    started = time.perf_counter()
    models = {"moe": build(moe_arch, plan), "dense": build(dense_active_twin(moe_arch), plan)}
    print(f"CPU: {cpu_description()}; threads {args.threads}; load average {os.getloadavg()}")
    print(f"{args.layers} layers of Qwen3-30B-A3B's shapes, {args.experts} experts (8 active, width 768), vocabulary "
          f"{args.vocab}; dense twin MLP {8 * 768}; weights {args.quantization or 'bf16 tiles'}; built in {time.perf_counter() - started:.0f} s")
    for batch in args.batch:
        loops = {name: DecodeLoop(model, batch, args.context, args.rounds + 1) for name, model in models.items()}
        times: dict[str, list[float]] = {name: [] for name in loops}
        for r in range(args.rounds + 1):
            for name, loop in loops.items():
                t0 = time.perf_counter()
                loop.step()
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) for name, t in times.items()}
        spread = ", ".join(f"{name} {med[name] * 1e3:.1f} ms (min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f})"
                           for name, t in times.items())
        print(f"batch {batch}, context {args.context}: {spread}; MoE / dense {med['moe'] / med['dense']:.2f}x; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
