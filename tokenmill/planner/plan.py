"""A capacity plan: a model in a weight format on a device, by the roofline.

`make_plan` computes it as a JSON-ready dict (schema `tokenmill.plan/1`), `format_plan`
prints it as text, `plot_plan` draws it. `tokenmill plan` (cli.py) is their command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import SchedulingConfig, default_kv_cache_memory
from tokenmill.planner.roofline import (
    GIB,
    KIB,
    MIB,
    Deployment,
    Device,
    KVCacheDtype,
    Parallelism,
    WeightFormat,
    active_params,
    compute_bound_batch,
    decode_step,
    device_weight_bytes,
    kv_budget,
    kv_cache_dtype,
    kv_bytes_per_request,
    kv_bytes_per_token,
    max_concurrent_requests,
    param_counts,
    prefill_step,
    stored_format,
    weight_bytes,
)
from tokenmill.planner.model_spec import ModelSpec

SCHEMA = "tokenmill.plan/1"


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    device: Device
    weights: WeightFormat | None  # None: the checkpoint as stored (a GGUF's blocks)
    kv_cache_dtype: str = "auto"
    compute_dtype: str | None = None  # None: the weight format's
    parallel: Parallelism = field(default_factory=Parallelism)
    # The engine's settings, defaulting as the engine's do (config.py):
    context_len: int | None = None  # max_model_len; None: the model's context length
    input_len: int | None = None  # None: the context length
    max_batch: int = SchedulingConfig().max_num_seqs
    kv_cache_memory: int | None = None  # bytes per device; None: the engine's default (or memory_utilization)
    memory_utilization: float | None = None  # vLLM's rule when given: utilization x memory - weights


def batch_sizes(max_batch: int, extra: int = 0) -> list[int]:
    """1, 2, 4, ... up to max_batch, max_batch itself, and `extra` (the most that fits) below it."""
    sizes = {1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch}
    if 0 < extra < max_batch:
        sizes.add(extra)
    return sorted(sizes)


@dataclass(frozen=True)
class Resolved:
    """What a plan's inputs come to: the deployment every step formula reads, the weight
    format, the compute dtype wanted and the one the device's figures give, the weights and
    the KV budget per device."""

    deployment: Deployment
    weights: WeightFormat
    wanted_compute: str
    weights_per_device: float
    kv_budget: float
    kv_budget_source: str


def resolve(inputs: PlanInputs) -> Resolved:
    """The weight format (a GGUF as stored when none is given), the KV dtype, the compute
    rate and the KV budget (--kv-cache-memory; else utilization x memory - weights when a
    --gpu-memory-utilization is given; else the engine's default on that device)."""
    spec, shape, par, device = inputs.model, inputs.model.shape, inputs.parallel, inputs.device
    _check(inputs)
    stored = spec.stored
    params = stored.params if stored else param_counts(shape)
    if inputs.weights is None:
        if stored is None:
            raise ValueError("a weight format is needed for a model that is not a GGUF file")
        fmt, wbytes = stored_format(stored.bytes, params, stored.format_name), stored.bytes
    else:
        fmt, wbytes = inputs.weights, weight_bytes(params, inputs.weights)
    kv: KVCacheDtype = kv_cache_dtype(inputs.kv_cache_dtype, fmt)
    wanted_compute = inputs.compute_dtype or fmt.compute_dtype
    _, used_compute = device.compute_rate(wanted_compute)
    dep = Deployment(shape, params, wbytes, kv, device, used_compute, par)
    per_device_weights = device_weight_bytes(wbytes, shape, par)
    if inputs.kv_cache_memory is not None:
        budget, budget_source = float(inputs.kv_cache_memory), "--kv-cache-memory"
    elif inputs.memory_utilization is not None:
        budget = kv_budget(device, per_device_weights, inputs.memory_utilization)
        budget_source = f"{inputs.memory_utilization:g} x device memory - weights"
    else:
        on_gpu = device.kind == "gpu"
        budget = float(default_kv_cache_memory(on_gpu, device.memory_bytes,
                                               int(device.memory_bytes - per_device_weights)))
        budget_source = ("the engine's default: half the memory the weights leave" if on_gpu else
                         "the engine's default: 2 GiB, at most a fifth of the memory")
    return Resolved(dep, fmt, wanted_compute, per_device_weights, budget, budget_source)


def make_plan(inputs: PlanInputs) -> dict[str, Any]:
    spec, shape, par, device = inputs.model, inputs.model.shape, inputs.parallel, inputs.device
    resolved = resolve(inputs)
    dep, fmt, wanted_compute = resolved.deployment, resolved.weights, resolved.wanted_compute
    params, wbytes, kv, used_compute = dep.params, dep.weights, dep.kv, dep.compute_dtype
    rate = dep.flops_rate
    per_device_weights, budget, budget_source = resolved.weights_per_device, resolved.kv_budget, \
        resolved.kv_budget_source
    context = inputs.context_len or shape.max_position_embeddings
    prompt = inputs.input_len or context
    per_request = kv_bytes_per_request(shape, kv, context, par)
    fits = budget > 0 and per_device_weights < device.memory_bytes
    concurrent = max_concurrent_requests(budget, per_request) if fits else 0

    rows = []
    for batch in batch_sizes(inputs.max_batch, concurrent):
        decode, prefill = decode_step(dep, batch, context), prefill_step(dep, batch, prompt)
        rows.append({
            "batch": batch, "tpot_s": decode.seconds, "tokens_per_s": batch / decode.seconds,
            "ttft_s": prefill.seconds, "decode_bound": decode.bound, "kv_fits": batch <= concurrent,
            "decode": _step_dict(decode), "prefill": _step_dict(prefill),
        })
    notes = list(shape.notes)
    if used_compute != wanted_compute:
        notes.append(f"{device.name} has no {wanted_compute} figure: computed at its {used_compute} rate")
    if context > shape.max_position_embeddings:
        notes.append(f"the context ({context:,}) exceeds the model's {shape.max_position_embeddings:,} positions")
    if not fits:
        notes.append(f"the weights ({per_device_weights / GIB:.1f} GiB per device) leave no KV memory on "
                     f"{device.name} ({device.memory_bytes / GIB:.0f} GiB): quantize, or raise "
                     "--tensor-parallel-size / --pipeline-parallel-size")
    return {
        "schema": SCHEMA,
        "model": {
            "name": shape.name, "source": spec.source, "architecture": shape.architecture,
            "layers": shape.num_layers, "hidden_size": shape.hidden_size, "heads": shape.num_heads,
            "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab_size,
            "experts": shape.num_experts, "experts_per_token": shape.num_experts_per_tok,
            "kv_lora_rank": shape.kv_lora_rank, "sliding_window": shape.sliding_window,
            "sliding_layers": shape.num_sliding_layers,
            "max_position_embeddings": shape.max_position_embeddings,
            "params": params.total, "active_params": active_params(params, shape),
        },
        "device": {**device.to_dict(), "count": par.world_size},
        "settings": {
            "weights": fmt.name, "bits_per_weight": fmt.bits_per_weight, "weights_description": fmt.description,
            "compute_dtype": used_compute, "compute_flops": rate, "kv_cache_dtype": kv.name,
            "tensor_parallel_size": par.tensor_parallel_size, "pipeline_parallel_size": par.pipeline_parallel_size,
            "interconnect_bandwidth": par.link_bandwidth, "interconnect_latency_s": par.link_latency,
            "context_len": context, "input_len": prompt, "max_batch": inputs.max_batch,
            "kv_cache_memory": inputs.kv_cache_memory, "gpu_memory_utilization": inputs.memory_utilization,
        },
        "memory": {
            "weights_bytes": wbytes.total, "weights_bytes_per_device": per_device_weights,
            "device_memory_bytes": device.memory_bytes, "kv_budget_bytes_per_device": max(budget, 0.0),
            "kv_budget_source": budget_source, "weights_fit": fits,
        },
        "kv": {
            "bytes_per_token": kv_bytes_per_token(shape, kv),
            "bytes_per_token_per_device": kv_bytes_per_token(shape, kv, par),
            "bytes_per_request": kv_bytes_per_request(shape, kv, context),
            "bytes_per_request_per_device": per_request,
            "context_len": context, "max_concurrent_requests": concurrent,
        },
        "compute_bound_batch": {
            "at_context": compute_bound_batch(dep, context),
            "empty_cache": compute_bound_batch(dep, 0),
        },
        "batches": rows,
        "notes": notes,
    }


def _check(inputs: PlanInputs) -> None:
    shape = inputs.model.shape
    for name in ("context_len", "input_len"):
        value = getattr(inputs, name)
        if value is not None and value < 1:
            raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {value}")
    if inputs.max_batch < 1:
        raise ValueError(f"max-num-seqs must be at least 1, got {inputs.max_batch}")
    if inputs.parallel.pipeline_parallel_size > shape.num_layers:
        raise ValueError(f"pipeline-parallel-size ({inputs.parallel.pipeline_parallel_size}) exceeds the "
                         f"model's {shape.num_layers} layers")
    if inputs.memory_utilization is not None and not 0 < inputs.memory_utilization <= 1:
        raise ValueError(f"gpu-memory-utilization must be in (0, 1], got {inputs.memory_utilization}")
    if inputs.kv_cache_memory is not None and inputs.kv_cache_memory <= 0:
        raise ValueError(f"kv-cache-memory must be a positive number of bytes, got {inputs.kv_cache_memory}")


def _step_dict(step) -> dict[str, Any]:
    return {"bytes": step.bytes, "flops": step.flops, "memory_s": step.memory_s, "compute_s": step.compute_s,
            "comm_s": step.comm_s, "seconds": step.seconds}


# ----- text --------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """Binary units: 128 KiB, 1.25 GiB."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    return f"{n:,.0f} B"


def _decimal_bytes(n: float) -> str:
    """Decimal units, as datasheets and model cards print weights: 141 GB, 96.6 MB."""
    return f"{n / 1e9:,.3g} GB" if n >= 1e9 else f"{n / 1e6:,.3g} MB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def format_plan(plan: dict[str, Any]) -> str:
    m, d, s, mem, kv = plan["model"], plan["device"], plan["settings"], plan["memory"], plan["kv"]
    world = d["count"]
    split = []
    if s["tensor_parallel_size"] > 1:
        split.append(f"TP {s['tensor_parallel_size']}")
    if s["pipeline_parallel_size"] > 1:
        split.append(f"PP {s['pipeline_parallel_size']}")
    on = f"{world} x {d['name']}" + (f" ({', '.join(split)})" if split else "") if world > 1 else d["name"]
    moe = f", {m['experts']} experts ({m['experts_per_token']} per token)" if m["experts"] else ""
    attention = (f"MLA latent {m['kv_lora_rank']}" if m["kv_lora_rank"]
                 else f"{m['heads']} heads, {m['kv_heads']} KV heads x {m['head_dim']}")
    window = f", {m['sliding_layers']} sliding-window layers ({m['sliding_window']:,})" if m["sliding_layers"] else ""
    per_dev = world > 1
    lines = [
        f"{m['name']} on {on}: weights {s['weights']} ({s['bits_per_weight']:.4g} bits), "
        f"KV cache {s['kv_cache_dtype']}, context {kv['context_len']:,} tokens",
        f"  model      {_count(m['params'])} parameters ({_count(m['active_params'])} active per token); "
        f"{m['layers']} layers, {attention}{moe}{window}; vocab {m['vocab_size']:,}",
        f"  device     {d['name']}: {d['memory_bytes'] / GIB:,.0f} GiB, {d['bandwidth'] / 1e9:,.1f} GB/s, "
        f"{s['compute_flops'] / 1e12:,.4g} TFLOP/s {s['compute_dtype']} ({d['source']})",
        f"  weights    {_decimal_bytes(mem['weights_bytes'])} ({human_bytes(mem['weights_bytes'])})"
        + (f"; {human_bytes(mem['weights_bytes_per_device'])} per device" if per_dev else ""),
        f"  KV cache   {human_bytes(kv['bytes_per_token'])} per token"
        + (f" ({human_bytes(kv['bytes_per_token_per_device'])} per device)" if per_dev else "")
        + f"; {human_bytes(kv['bytes_per_request'])} per request of {kv['context_len']:,} tokens"
        + (f" ({human_bytes(kv['bytes_per_request_per_device'])} per device)" if per_dev else ""),
        f"  KV memory  {human_bytes(mem['kv_budget_bytes_per_device'])}{' per device' if per_dev else ''} "
        f"({mem['kv_budget_source']}): at most {kv['max_concurrent_requests']:,} concurrent requests "
        f"of {kv['context_len']:,} tokens",
        "  decode     " + _compute_bound_text(plan),
        "",
        f"  {'batch':>6} {'TPOT ms':>9} {'tok/s':>10} {'TTFT ms':>9}  {'decode bound':<13} KV fits",
    ]
    for row in plan["batches"]:
        lines.append(f"  {row['batch']:>6,} {_ms(row['tpot_s']):>9} {row['tokens_per_s']:>10,.1f} "
                     f"{_ms(row['ttft_s']):>9}  {row['decode_bound']:<13} {'yes' if row['kv_fits'] else 'no'}")
    lines += ["", f"  TPOT: a decode step with every sequence at {kv['context_len']:,} tokens of KV; tok/s = batch / "
              f"TPOT; TTFT: the prefill of `batch` prompts of {s['input_len']:,} tokens arriving together.",
              "  Roofline bounds: max(bytes / bandwidth, FLOPs / FLOP/s) per step; real kernels reach 50-90% of them."]
    lines += [f"  note: {note}" for note in plan["notes"]]
    return "\n".join(lines)


def _compute_bound_text(plan: dict[str, Any]) -> str:
    bound = plan["compute_bound_batch"]
    context = plan["kv"]["context_len"]
    at = (f"compute-bound from batch {bound['at_context']:,} at {context:,} tokens of context"
          if bound["at_context"] else f"memory-bound at every batch at {context:,} tokens of context "
          "(the KV reads outgrow the FLOPs)")
    empty = (f"from batch {bound['empty_cache']:,} with an empty KV cache (weights only)"
             if bound["empty_cache"] else "never, even with an empty KV cache")
    return f"{at}; {empty}"


# ----- plot --------------------------------------------------------------------------------------


def plot_plan(plan: dict[str, Any], path: str) -> None:
    """Tokens/s and TPOT against batch size, and the memory split of one device."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'tokenmill[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = plan["batches"]
    batches = [r["batch"] for r in rows]
    fits = [r["kv_fits"] for r in rows]
    fig, (rate_ax, tpot_ax, mem_ax) = plt.subplots(1, 3, figsize=(15, 4.5))
    settings = plan["settings"]
    split = "".join(f", {label} {settings[key]}" for label, key in (("TP", "tensor_parallel_size"),
                                                                   ("PP", "pipeline_parallel_size")) if settings[key] > 1)
    title = (f"{plan['model']['name']} on {plan['device']['count']} x {plan['device']['name']}{split}: "
             f"{plan['settings']['weights']} weights, {plan['settings']['kv_cache_dtype']} KV, "
             f"context {plan['kv']['context_len']:,}")
    fig.suptitle(title)
    for ax, key, scale, label in ((rate_ax, "tokens_per_s", 1.0, "decode tokens/s"),
                                  (tpot_ax, "tpot_s", 1e3, "TPOT (ms)")):
        values = [r[key] * scale for r in rows]
        ax.plot(batches, values, "-", color="tab:blue")
        ax.plot([b for b, f in zip(batches, fits) if f], [v for v, f in zip(values, fits) if f], "o",
                color="tab:blue", label="KV fits")
        ax.plot([b for b, f in zip(batches, fits) if not f], [v for v, f in zip(values, fits) if not f], "x",
                color="tab:red", label="KV does not fit")
        bound = plan["compute_bound_batch"]["at_context"]
        if bound and bound <= batches[-1]:
            ax.axvline(bound, color="gray", linestyle="--", label=f"compute-bound from {bound:,}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.set_xlabel("batch size (sequences per decode step)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    mem, kv = plan["memory"], plan["kv"]
    device_memory = mem["device_memory_bytes"]
    weights = mem["weights_bytes_per_device"]
    used_kv = kv["max_concurrent_requests"] * kv["bytes_per_request_per_device"]
    free = max(device_memory - weights - used_kv, 0)
    parts = [("weights", weights, "tab:blue"),
             (f"KV: {kv['max_concurrent_requests']:,} requests x {kv['context_len']:,} tokens", used_kv, "tab:orange"),
             ("other / free", free, "tab:gray")]
    left = 0.0
    for label, size, color in parts:
        mem_ax.barh([0], [size / GIB], left=[left], color=color, label=f"{label} ({human_bytes(size)})")
        left += size / GIB
    mem_ax.set_xlim(0, max(left, device_memory / GIB))
    mem_ax.set_yticks([])
    mem_ax.set_xlabel(f"GiB of one device ({device_memory / GIB:,.0f} GiB)")
    mem_ax.set_title("memory split")
    mem_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
