"""A simulation's setup: the engine settings, the KV cache's size and the step cost model.

Two sources of a step's cost:
- this machine: a calibration profile (`tokenmill simulate calibrate`), found by model,
  dtype and threads, or given as a file; the KV cache holds `--kv-cache-memory` (default:
  what the builder gives on this machine) over the model's KV bytes per token, as the
  builder counts blocks;
- a catalog device (`--target-device h100-sxm`, any `tokenmill plan` device): the roofline of
  the model on it (`RooflineStepModel`), with the KV budget `tokenmill plan` computes
  (--kv-cache-memory, else --gpu-memory-utilization x device memory - weights).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.planner.costmodel import RooflineStepModel
from tokenmill.planner.plan import PlanInputs, resolve
from tokenmill.planner.roofline import Device, Parallelism, kv_bytes_per_token, weight_format
from tokenmill.simulator.profile import Profile, find_profile, load_profile
from tokenmill.simulator.simulate import ServerOverheads, SimulationSetup


def num_blocks_for(memory: int, kv_bytes_per_token: int, block_size: int) -> int:
    """KV blocks in `memory` bytes (as `KVCacheSpec.num_blocks_for`)."""
    blocks = int(memory) // (kv_bytes_per_token * block_size)
    if blocks < 1:
        raise ValueError(f"a KV cache of {int(memory):,} bytes holds no block of {block_size} tokens "
                         f"({kv_bytes_per_token * block_size:,} bytes); raise --kv-cache-memory")
    return blocks


def resolve_profile(config: EngineConfig, profile_file: str | None = None) -> tuple[Profile, Path]:
    """The profile given, or the stored one for the config's model, dtype and threads."""
    if profile_file:
        return load_profile(profile_file), Path(profile_file)
    from tokenmill.hardware import cpu_info

    model_path = config.model.model or _default_model_path()
    threads = config.device.num_threads or cpu_info().num_cores
    found = find_profile(model_path, config.model.dtype, threads)
    if found is None:
        flags = " ".join(f for f in (f"--model {config.model.model}" if config.model.model else "",
                                     f"--dtype {config.model.dtype}", f"--num-threads {threads}") if f)
        raise FileNotFoundError(f"no calibration of {Path(model_path).name} ({flags}) on this machine: "
                                f"run `tokenmill simulate calibrate {flags}` first, or pass --profile FILE")
    return load_profile(found), found


def setup_from_profile(config: EngineConfig, profile: Profile, source: str = "",
                       overheads: ServerOverheads | None = None) -> SimulationSetup:
    memory = config.cache.kv_cache_memory or profile.default_kv_cache_memory
    return SimulationSetup(
        config=config,
        num_blocks=num_blocks_for(memory, profile.kv_bytes_per_token, config.cache.block_size),
        max_model_len=config.model.max_model_len or profile.model_max_len,
        cost_model=profile.cost_model,
        overheads=overheads or profile.overheads or ServerOverheads(),
        model_name=profile.model_name,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        cost_model_source=f"calibration {source or 'profile'} ({profile.describe()})",
    )


def setup_from_roofline(config: EngineConfig, model: str, device: Device, weights: str | None = None,
                        kv_cache_dtype: str = "auto", parallel: Parallelism | None = None,
                        memory_utilization: float | None = None, step_overhead_s: float = 0.0,
                        overheads: ServerOverheads | None = None) -> SimulationSetup:
    """The roofline of `model` (a preset, GGUF or config.json) on a catalog `device`."""
    from tokenmill.planner.model_spec import read_model

    spec = read_model(model)
    fmt = weight_format(weights) if weights else None
    if fmt is None and spec.stored is None:
        fmt = weight_format(spec.checkpoint_format or "bfloat16")
    parallel = parallel or Parallelism()
    resolved = resolve(PlanInputs(model=spec, device=device, weights=fmt, kv_cache_dtype=kv_cache_dtype,
                                  parallel=parallel, kv_cache_memory=config.cache.kv_cache_memory,
                                  memory_utilization=memory_utilization))
    dep = resolved.deployment
    if resolved.weights_per_device >= device.memory_bytes or resolved.kv_budget <= 0:
        raise ValueError(f"{spec.shape.name}'s weights ({resolved.weights_per_device / 2**30:.1f} GiB per device) "
                         f"leave no KV memory on {device.name}: quantize (--weights), or raise "
                         "--tensor-parallel-size / --pipeline-parallel-size")
    shape = spec.shape
    per_token = kv_bytes_per_token(shape, dep.kv, parallel)
    return SimulationSetup(
        config=config,
        num_blocks=num_blocks_for(resolved.kv_budget, per_token, config.cache.block_size),
        kv_bytes_per_token=per_token,
        max_model_len=config.model.max_model_len or shape.max_position_embeddings,
        cost_model=RooflineStepModel(dep, step_overhead_s),
        overheads=overheads or ServerOverheads(),
        model_name=shape.name,
        cost_model_source=(f"roofline of {shape.name} ({resolved.weights.name} weights, {dep.kv.name} KV) on "
                           f"{device.name}" + (f" x {parallel.world_size}" if parallel.world_size > 1 else "")
                           + f", {step_overhead_s * 1e3:g} ms per step added"),
    )


def with_settings(setup: SimulationSetup, **settings: object) -> SimulationSetup:
    """The setup with some engine settings changed (a point of a config grid). The KV cache
    keeps its bytes unless kv_cache_memory is among them; its blocks are counted again."""
    config = setup.config.replace(**settings)
    block_size = config.cache.block_size
    if not setup.kv_bytes_per_token:
        if "kv_cache_memory" in settings or block_size != setup.config.cache.block_size:
            raise ValueError("this setup does not know the KV bytes per token: kv_cache_memory and block_size "
                             "cannot change")
        num_blocks = setup.num_blocks
    else:
        memory = (config.cache.kv_cache_memory if "kv_cache_memory" in settings
                  else setup.num_blocks * setup.config.cache.block_size * setup.kv_bytes_per_token)
        num_blocks = num_blocks_for(memory, setup.kv_bytes_per_token, block_size)
    return replace(setup, config=config, num_blocks=num_blocks,
                   max_model_len=config.model.max_model_len or setup.max_model_len)


def _default_model_path() -> str:
    from tokenmill.config import default_model_path

    return default_model_path()
