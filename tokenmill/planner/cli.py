"""`tokenmill plan [MODEL]`: memory, KV capacity and roofline speed of a model on a device."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Plan a deployment by the roofline: the weights' memory, the KV cache per token and per
request, how many requests fit at a context length, and the TPOT, TTFT and tokens/s that
the device's bandwidth and FLOP/s allow per batch size, with the batch from which decode
is compute-bound. Nothing is loaded: MODEL is read for its shape only.

MODEL is a preset name (see --list), a GGUF file, a Hugging Face directory or its
config.json; default: the default model (SmolLM2-135M-Instruct Q4_1 GGUF). A GGUF is
planned as stored (its exact bytes) unless --weights is given.
"""

EPILOG = """\
examples:
  tokenmill plan                                        # the default model, measured on this machine
  tokenmill plan llama-3.1-70b --target-device a100-80gb --weights bf16 --max-model-len 4096
  tokenmill plan llama-3.1-70b --target-device h100-sxm --tensor-parallel-size 4 --max-num-seqs 512 --json
  tokenmill plan qwen3-30b-a3b --target-device epyc-9654 --weights q4_k --kv-cache-dtype int8 --plot plan.png
  tokenmill plan ~/models/Qwen2.5-7B-Instruct --target-device l4 --weights int4-g128 --kv-cache-memory 8GiB

The engine's settings default as `tokenmill serve`'s do: the model's whole context, 64
sequences, the engine's KV memory (2 GiB on a CPU; half of what the weights leave on a GPU).
  tokenmill plan --list                                 # presets, devices, weight formats

The figures are upper bounds: kernels reach about 50-90% of a device's bandwidth and FLOP/s.
"""


def register(sub) -> None:
    parser = sub.add_parser("plan", help="capacity plan by the roofline: memory, KV capacity, TPOT/TTFT per batch",
                            description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(parser)
    parser.set_defaults(func=cmd_plan)


# Flags that mean the engine's settings: declared by config.py (help, default, choices),
# with this command's older spellings kept as aliases.
ENGINE_SETTINGS = ("model", "num_threads", "kv_cache_dtype", "tensor_parallel_size", "pipeline_parallel_size",
                   "max_model_len", "max_num_seqs", "kv_cache_memory")
OLD_SPELLINGS = {"max_model_len": ("--context-len",), "max_num_seqs": ("--max-batch",),
                 "kv_cache_memory": ("--kv-cache-memory-bytes",)}


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.config import add_setting_args

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="preset, GGUF file, Hugging Face directory or config.json")
    add_target_args(parser)
    parser.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16", "fp8", "int8"],
                        help="the dtype whose FLOP/s the compute takes (default: the weight format's)")
    parser.add_argument("--interconnect-bandwidth", type=float, default=None, metavar="GB_S",
                        help="GB/s each device sends over its link; adds all-reduce and stage hand-over times "
                             "(default: communication not counted)")
    parser.add_argument("--interconnect-latency", type=float, default=0.0, metavar="US",
                        help="microseconds per hop of a collective (with --interconnect-bandwidth)")
    parser.add_argument("--input-len", type=int, default=None,
                        help="prompt tokens for TTFT (default: the context length)")
    engine = parser.add_argument_group(
        "engine settings (as `tokenmill serve` takes them; --max-model-len is the context each request holds, "
        "--max-num-seqs the largest batch planned)")
    add_setting_args(engine, ENGINE_SETTINGS, OLD_SPELLINGS)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw tokens/s and TPOT per batch size and "
                                                                         "the memory split (matplotlib)")
    parser.add_argument("--list", action="store_true", help="list presets, devices and weight formats, and exit")


def add_target_args(parser) -> None:
    """What a plan is for that the engine has no setting of (the simulator's roofline takes
    them too): the target device, the weight format, vLLM's memory share."""
    parser.add_argument("--target-device", "--device", dest="target_device", default="this",
                        help="the device planned for: a catalog device (see --list), 'this' (measure this machine: "
                             "~30 s) or a device JSON file (as --json prints under 'device'); default: this. "
                             "(--device is its old spelling; the engine's --device is cpu or cuda)")
    parser.add_argument("--weights", default=None,
                        help="weight format: float32, bfloat16, float16, fp8, int8, int4-g32/64/128, or a GGUF "
                             "block type (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k); default: a GGUF as "
                             "stored, a config.json's dtype or quantization, else bfloat16")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's rule for the KV memory: this share of device memory for weights and KV cache. "
                             "Default: the engine's kv_cache_memory default (2 GiB on a CPU, at most a fifth of "
                             "its RAM; half the memory the weights leave on a GPU)")


def cmd_plan(args: argparse.Namespace) -> int:
    from tokenmill.config import parse_memory
    from tokenmill.planner.plan import PlanInputs, format_plan, make_plan, plot_plan
    from tokenmill.planner.roofline import Parallelism, weight_format
    from tokenmill.planner.model_spec import read_model

    if args.list:
        print(list_choices())
        return 0
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    spec = read_model(args.model_tag or args.model or _default_model())
    weights = args.weights or (None if spec.stored else spec.checkpoint_format or "bfloat16")
    fmt = weight_format(weights) if weights else None
    parallel = Parallelism(
        args.tensor_parallel_size, args.pipeline_parallel_size,
        link_bandwidth=args.interconnect_bandwidth * 1e9 if args.interconnect_bandwidth is not None else None,
        link_latency=args.interconnect_latency * 1e-6,
    )
    inputs = PlanInputs(
        model=spec, device=resolve_device(args.target_device, args.num_threads), weights=fmt,
        kv_cache_dtype=args.kv_cache_dtype, compute_dtype=args.compute_dtype, parallel=parallel,
        context_len=args.max_model_len, input_len=args.input_len, max_batch=args.max_num_seqs,
        kv_cache_memory=parse_memory(args.kv_cache_memory), memory_utilization=args.gpu_memory_utilization,
    )
    plan = make_plan(inputs)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    if args.plot:
        plot_plan(plan, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def resolve_device(name: str, threads: int | None = None):
    """A catalog entry, 'this' (measured now) or a device JSON file."""
    from pathlib import Path

    from tokenmill.planner.catalog import DEVICES, device
    from tokenmill.planner.roofline import Device

    if name.strip().lower() == "this":
        from tokenmill.planner.machine import this_device

        return this_device(threads, log=lambda message: print(f"[plan] {message}", file=sys.stderr, flush=True))
    if name.strip().lower() not in DEVICES and Path(name).is_file():
        try:
            data = json.loads(Path(name).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{name!r} is not a device JSON file: {exc}") from None
        return Device.from_dict(data.get("device", data) if isinstance(data, dict) else {})
    return device(name)


def _default_model() -> str:
    from tokenmill.config import default_model_path

    return default_model_path()


def list_choices() -> str:
    from tokenmill.planner.catalog import DEVICES
    from tokenmill.planner.presets import PRESETS
    from tokenmill.planner.roofline import WEIGHT_FORMATS, param_counts

    lines = ["presets:"]
    for key, shape in PRESETS.items():
        lines.append(f"  {key:<18} {param_counts(shape).total / 1e9:7.2f}B params, {shape.num_layers} layers, "
                     f"{shape.num_kv_heads} KV heads x {shape.head_dim}"
                     + (f", {shape.num_experts} experts" if shape.is_moe else ""))
    lines.append("devices:")
    for key, dev in DEVICES.items():
        rates = ", ".join(f"{dtype} {rate / 1e12:,.4g}" for dtype, rate in dev.flops.items())
        lines.append(f"  {key:<18} {dev.memory_bytes / 2**30:5.0f} GiB, {dev.bandwidth / 1e9:6,.0f} GB/s, "
                     f"TFLOP/s: {rates}")
    lines.append("  this               measured here (--num-threads)")
    lines.append("weight formats:")
    lines += [f"  {key:<18} {fmt.bits_per_weight:.4g} bits: {fmt.description}" for key, fmt in WEIGHT_FORMATS.items()]
    return "\n".join(lines)
