"""Builds the torch side of an engine from its config: device, model, KV cache."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.config import EngineConfig
from tokenmill.model.loader import load_model
from tokenmill.hardware import cpu_info
from tokenmill.runner.model_runner import ModelRunner, kv_bytes_per_block
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class BuiltRunner:
    runner: ModelRunner
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    num_blocks: int


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "torch_sdpa" or (name == "auto" and device.type != "cpu"):
        return TorchSDPABackend()
    if device.type != "cpu":
        raise ValueError(f"attention_backend {name!r} runs on the CPU only; use torch_sdpa on {device.type}")
    from tokenmill.kernels import cpu_kernels_available

    if cpu_kernels_available():
        from tokenmill.attention.cpu_native import CPUNativeBackend

        return CPUNativeBackend()
    if name == "cpu_native":
        raise ValueError("attention_backend 'cpu_native' needs the native CPU kernels, which failed to build "
                         "(see the warning above; `python -m tokenmill.kernels -v` shows the compiler output)")
    return TorchSDPABackend()


def default_kv_cache_memory(device: torch.device) -> int:
    """2 GiB on CPU, capped at a fifth of RAM; on a GPU half of its free memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(2 * 2**30, total // 5)


def build_runner(config: EngineConfig) -> BuiltRunner:
    device = resolve_device(config.device)
    if device.type == "cpu":
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
    start = time.perf_counter()
    dtype = resolve_dtype(config.dtype, device)
    loaded = load_model(config.model, dtype.compute, device, max_positions=config.max_model_len)
    max_model_len = config.max_model_len or loaded.context_len
    window = loaded.arch.sliding_window
    if window is not None and max_model_len > window:
        if config.max_model_len is not None:
            raise ValueError(
                f"this model uses sliding-window attention ({window} tokens), which tokenmill does not "
                f"implement; max_model_len {max_model_len} must be at most {window}"
            )
        max_model_len = window  # within the window, full attention is exact
    if config.max_model_len and config.max_model_len > loaded.context_len:
        logger.warning("max_model_len %d exceeds the model's context length %d", max_model_len, loaded.context_len)
    memory = config.kv_cache_memory or default_kv_cache_memory(device)
    kv_dtype = getattr(torch, dtype.kv_cache)
    per_block = kv_bytes_per_block(loaded.arch, config.block_size, kv_dtype)
    num_blocks = memory // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {memory} bytes is less than one KV block ({per_block} bytes)")
    if device.type == "cpu" and dtype.compute == "float32":
        from tokenmill.model.layers import prepare_for_cpu

        onednn = os.environ.get("TOKENMILL_PACK_WEIGHTS", "1") != "0"
        count = prepare_for_cpu(loaded.model, getattr(torch, dtype.weights), onednn=onednn)
        logger.info("laid out %d linear weights for the CPU (%s for decode%s)", count, dtype.weights,
                    ", float32 oneDNN copies for prefill" if onednn else "")
    backend = select_attention_backend(config.attention_backend, device)
    runner = ModelRunner(
        loaded.model, num_blocks, config.block_size, device, seed=config.seed, backend=backend, kv_dtype=kv_dtype
    )
    logger.info(
        "loaded %s (%s) on %s in %.1f s: %d KV blocks of %d tokens (%.2f GiB), max_model_len %d, attention %s",
        loaded.name, dtype, device, time.perf_counter() - start, num_blocks, config.block_size,
        num_blocks * per_block / 2**30, max_model_len, backend.name,
    )
    return BuiltRunner(runner, loaded.tokenizer, loaded.name, max_model_len, num_blocks)
