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
  tokenmill plan llama-3.1-70b --device a100-80gb --weights bf16 --context-len 4096
  tokenmill plan llama-3.1-70b --device h100-sxm --tensor-parallel-size 4 --max-batch 512 --json
  tokenmill plan qwen3-30b-a3b --device epyc-9654 --weights q4_k --kv-cache-dtype int8 --plot plan.png
  tokenmill plan ~/models/Qwen2.5-7B-Instruct --device l4 --weights int4-g128 --kv-cache-memory 8GiB
  tokenmill plan --list                                 # presets, devices, weight formats

The figures are upper bounds: kernels reach about 50-90% of a device's bandwidth and FLOP/s.
"""


def register(sub) -> None:
    parser = sub.add_parser("plan", help="capacity plan by the roofline: memory, KV capacity, TPOT/TTFT per batch",
                            description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(parser)
    parser.set_defaults(func=cmd_plan)


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="preset, GGUF file, Hugging Face directory or config.json")
    parser.add_argument("--model", dest="model_flag", default=None, help="same as MODEL")
    parser.add_argument("--device", default="this",
                        help="a catalog device (see --list), 'this' (measure this machine: ~30 s) or a device "
                             "JSON file (as --json prints under 'device'); default: this")
    parser.add_argument("--num-threads", type=int, default=None, help="threads to measure 'this' with (default: all)")
    parser.add_argument("--weights", default=None,
                        help="weight format: float32, bfloat16, float16, fp8, int8, int4-g32/64/128, or a GGUF "
                             "block type (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k); default: a GGUF as "
                             "stored, a config.json's dtype or quantization, else bfloat16")
    parser.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16", "fp8", "int8"],
                        help="the dtype whose FLOP/s the compute takes (default: the weight format's)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto, float32, bfloat16, float16, int8, fp8, fp8_e4m3, fp8_e5m2 (default: auto, "
                             "the weights' compute dtype)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--interconnect-bandwidth", type=float, default=None, metavar="GB_S",
                        help="GB/s each device sends over its link; adds all-reduce and stage hand-over times "
                             "(default: communication not counted)")
    parser.add_argument("--interconnect-latency", type=float, default=0.0, metavar="US",
                        help="microseconds per hop of a collective (with --interconnect-bandwidth)")
    parser.add_argument("--context-len", "--max-model-len", dest="context_len", type=int, default=None,
                        help="tokens each request holds in the KV cache (default: min(4096, the model's))")
    parser.add_argument("--input-len", type=int, default=None,
                        help="prompt tokens for TTFT (default: the context length)")
    parser.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=256,
                        help="largest batch in the table (default 256)")
    parser.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", default=None,
                        help="KV memory per device, bytes or e.g. 20GiB (default: --gpu-memory-utilization x "
                             "device memory - weights)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of device memory for weights and KV cache (default 0.9, as vLLM)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw tokens/s and TPOT per batch size and "
                                                                         "the memory split (matplotlib)")
    parser.add_argument("--list", action="store_true", help="list presets, devices and weight formats, and exit")


def cmd_plan(args: argparse.Namespace) -> int:
    from tokenmill.config import parse_memory
    from tokenmill.planner.plan import PlanInputs, format_plan, make_plan, plot_plan
    from tokenmill.planner.roofline import Parallelism, weight_format
    from tokenmill.planner.model_spec import read_model

    if args.list:
        print(list_choices())
        return 0
    if args.model_tag and args.model_flag and args.model_tag != args.model_flag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model_flag!r}")
    spec = read_model(args.model_tag or args.model_flag or _default_model())
    weights = args.weights or (None if spec.stored else spec.checkpoint_format or "bfloat16")
    fmt = weight_format(weights) if weights else None
    parallel = Parallelism(
        args.tensor_parallel_size, args.pipeline_parallel_size,
        link_bandwidth=args.interconnect_bandwidth * 1e9 if args.interconnect_bandwidth is not None else None,
        link_latency=args.interconnect_latency * 1e-6,
    )
    inputs = PlanInputs(
        model=spec, device=resolve_device(args.device, args.num_threads), weights=fmt,
        kv_cache_dtype=args.kv_cache_dtype, compute_dtype=args.compute_dtype, parallel=parallel,
        context_len=args.context_len, input_len=args.input_len, max_batch=args.max_batch,
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
