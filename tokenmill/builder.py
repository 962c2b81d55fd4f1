"""The composition root: an EngineConfig in, a running engine out.

`build_executor` resolves the device and dtypes, loads the model, chooses the execution
plan and the attention backend, allocates the KV cache and builds the runner; it returns
them with the tokenizer and the `EngineFacts` found on the way. `build_engine` wraps
that in an `LLMEngine`. `LLM`, `tokenmill serve` and the bench all start here.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.config import EngineConfig, EngineFacts
from tokenmill.engine.engine import LLMEngine
from tokenmill.hardware import cpu_info
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.plan import ExecutionPlan, apply_plan, cpu_native_plan, reference_plan
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltExecutor:
    executor: ModelRunner  # or anything with execute(SchedulerOutput) -> RunnerOutput
    tokenizer: Tokenizer
    facts: EngineFacts


# A rank of a tensor/pipeline-parallel split: its ModelParallel from the model's shape and
# the checkpoint's block width, and the KV bytes per token of the rank that needs most
# (every rank allocates as many blocks: the scheduler's block ids are global).
@dataclass
class RankSetup:
    parallel: Callable[[object, int], object]  # (ModelArchConfig, column unit) -> ModelParallel
    max_kv_bytes_per_token: Callable[[int], int]  # element size -> bytes
    num_threads: int | None = None
    runner_class: type = ModelRunner


def build_engine(config: EngineConfig) -> LLMEngine:
    built = build_executor(config)
    return LLMEngine(config, built.executor, built.tokenizer, built.facts)


def build_executor(config: EngineConfig) -> BuiltExecutor:
    """The model in this process, or split over worker processes (and hosts) when the
    config asks for tensor or pipeline parallelism."""
    if config.parallel.world_size > 1:
        from tokenmill.distributed.executor import build_parallel_executor

        return build_parallel_executor(config)
    return build_rank(config)


def build_rank(config: EngineConfig, rank: RankSetup | None = None) -> BuiltExecutor:
    """Load the model (one rank's part of it, given `rank`), its plan, KV cache and runner."""
    start = time.perf_counter()
    device = resolve_device(config.device.device)
    threads = set_compute_threads(config, device, rank.num_threads if rank else None)
    dtype = resolve_dtype(config.model.dtype, device)
    kernels_ok = device.type == "cpu" and config.device.native_kernels and _cpu_kernels_build()
    backend = select_attention_backend(config.device.attention_backend, device, kernels_ok)
    chosen = choose_plan(config, device, dtype, kernels_ok, backend)
    parallel = None
    if rank is not None:
        alignment = chosen.weight_format.shard_alignment
        parallel = lambda arch, unit: rank.parallel(arch, math.lcm(unit, alignment))
    loaded = load_model(config.model.model, dtype.compute, device, max_positions=config.model.max_model_len,
                        parallel=parallel)
    max_model_len = resolve_max_model_len(config, loaded)
    plan = apply_plan(loaded.model, chosen)
    layout = loaded.model.parallel.layout
    spec = KVCacheSpec(layout.layers.size, layout.kv_heads.size, loaded.arch.head_dim,
                       config.cache.block_size, _DTYPES[dtype.kv_cache])
    memory = config.cache.kv_cache_memory or default_kv_cache_memory(device)
    bytes_per_block = spec.bytes_per_block
    if rank is not None:  # as many blocks as the rank holding most KV per token can have
        bytes_per_block = rank.max_kv_bytes_per_token(spec.element_size) * spec.block_size
    num_blocks = memory // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {memory} bytes is less than one KV block ({bytes_per_block} bytes)")
    kv_cache = PagedKVCache(spec, num_blocks, device)
    runner_class = rank.runner_class if rank is not None else ModelRunner
    runner = runner_class(loaded.model, kv_cache, backend, plan, device, seed=config.model.seed)
    facts = EngineFacts(
        model_name=loaded.name, model_path=loaded.path, architecture=loaded.arch.architecture,
        vocab_size=loaded.arch.vocab_size, max_model_len=max_model_len, device=str(device),
        compute_dtype=dtype.compute, weight_format=plan.weight_format.name, kv_cache_dtype=dtype.kv_cache,
        num_blocks=num_blocks, block_size=config.cache.block_size, kv_bytes_per_token=spec.bytes_per_token,
        attention_backend=backend.name, execution_plan=plan.describe(), num_threads=threads,
        load_seconds=time.perf_counter() - start,
    )
    logger.info(
        "loaded %s (%s) on %s in %.1f s: %d KV blocks of %d tokens (%.2f GiB, %d bytes per token), "
        "max_model_len %d, attention %s", loaded.name, dtype, device, facts.load_seconds, num_blocks,
        spec.block_size, kv_cache.nbytes / 2**30, spec.bytes_per_token, max_model_len, backend.name,
    )
    logger.info("execution plan (%s): %s", plan.tier, plan.describe())
    return BuiltExecutor(runner, loaded.tokenizer, facts)


# ----- what the config leaves to the machine ----------------------------------------------


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def set_compute_threads(config: EngineConfig, device: torch.device, num_threads: int | None = None) -> int:
    """`num_threads` (a rank's share) over the config's, over all cores."""
    if device.type == "cpu":
        torch.set_num_threads(num_threads or config.device.num_threads or cpu_info().num_cores)
    return torch.get_num_threads()


def cpu_has_native_bf16() -> bool:
    return cpu_info().native_bf16


@dataclass(frozen=True)
class DtypePlan:
    compute: str  # activations
    weights: str  # how linear and embedding weights are stored
    kv: str = ""  # the KV cache; "" = compute

    @property
    def kv_cache(self) -> str:
        return self.kv or self.compute

    def __str__(self) -> str:
        if self.compute == self.weights == self.kv_cache:
            return self.compute
        stored = "weights and KV cache" if self.weights == self.kv_cache else f"weights, {self.kv_cache} KV cache"
        return f"{self.weights} {stored}, {self.compute} compute"


def resolve_dtype(dtype: str, device: torch.device) -> DtypePlan:
    """`auto`: bfloat16 on GPUs and on CPUs with bf16 arithmetic, float32 elsewhere.
    `bfloat16` on a CPU without bf16 arithmetic stores the weights in bfloat16 (half the
    bytes each decode step streams) and computes in float32, as llama.cpp does with a
    BF16 file there: bf16 matmuls would be emulated, several times slower. The KV cache is
    then bfloat16 too (as vLLM keeps it): batched decode attention streams half the bytes."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" or cpu_has_native_bf16() else "float32"
    if dtype == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
        return DtypePlan(compute="float32", weights="bfloat16", kv="bfloat16")
    return DtypePlan(compute=dtype, weights=dtype)


def choose_plan(config: EngineConfig, device: torch.device, dtype: DtypePlan, kernels_ok: bool,
                backend: AttentionBackend) -> ExecutionPlan:
    """On a float32-computing CPU with the native kernels: weights tiled for the decode
    kernels (plus oneDNN copies for many rows unless `pack_weights` is off), the native
    element-wise ops, and the fused decode layer when attention reads the cache natively.
    Elsewhere plain weights and PyTorch ops."""
    weights = _DTYPES[dtype.weights]
    if device.type == "cpu" and dtype.compute == "float32" and kernels_ok:
        return cpu_native_plan(weights, onednn=config.device.pack_weights, fused_decode=backend.name == "cpu_native")
    return reference_plan(weights)


def select_attention_backend(name: str, device: torch.device, kernels_ok: bool) -> AttentionBackend:
    if name == "torch_sdpa" or (name == "auto" and device.type != "cpu"):
        return TorchSDPABackend()
    if device.type != "cpu":
        raise ValueError(f"attention_backend {name!r} runs on the CPU only; use torch_sdpa on {device.type}")
    if kernels_ok:
        from tokenmill.attention.cpu_native import CPUNativeBackend

        return CPUNativeBackend()
    if name == "cpu_native":
        raise ValueError("attention_backend 'cpu_native' needs the native CPU kernels, which are turned off or failed "
                         "to build (see the warning above; `python -m tokenmill.kernels -v` shows the compiler output)")
    return TorchSDPABackend()


def default_kv_cache_memory(device: torch.device) -> int:
    """2 GiB on CPU, capped at a fifth of RAM; on a GPU half of its free memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(2 * 2**30, total // 5)


def resolve_max_model_len(config: EngineConfig, loaded: LoadedModel) -> int:
    requested = config.model.max_model_len
    max_model_len = requested or loaded.context_len
    window = loaded.arch.sliding_window
    if window is not None and max_model_len > window:
        if requested is not None:
            raise ValueError(
                f"this model uses sliding-window attention ({window} tokens), which tokenmill does not "
                f"implement; max_model_len {max_model_len} must be at most {window}"
            )
        max_model_len = window  # within the window, full attention is exact
    if requested and requested > loaded.context_len:
        logger.warning("max_model_len %d exceeds the model's context length %d", requested, loaded.context_len)
    return max_model_len


def _cpu_kernels_build() -> bool:
    from tokenmill.kernels import cpu_kernels_available

    return cpu_kernels_available()
