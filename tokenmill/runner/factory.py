"""Builds the torch side of an engine from its config: device, model, KV cache."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.model.loader import load_model
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
    loaded = load_model(config.model, config.dtype, device, max_positions=config.max_model_len)
    max_model_len = config.max_model_len or loaded.context_len
    if config.max_model_len and config.max_model_len > loaded.context_len:
        logger.warning("max_model_len %d exceeds the model's context length %d", max_model_len, loaded.context_len)
    memory = config.kv_cache_memory or default_kv_cache_memory(device)
    per_block = kv_bytes_per_block(loaded.arch, config.block_size, loaded.model.embed_tokens.weight.dtype)
    num_blocks = memory // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {memory} bytes is less than one KV block ({per_block} bytes)")
    runner = ModelRunner(loaded.model, num_blocks, config.block_size, device, seed=config.seed)
    logger.info(
        "loaded %s on %s in %.1f s: %d KV blocks of %d tokens (%.2f GiB), max_model_len %d",
        loaded.name, device, time.perf_counter() - start, num_blocks, config.block_size,
        num_blocks * per_block / 2**30, max_model_len,
    )
    return BuiltRunner(runner, loaded.tokenizer, loaded.name, max_model_len, num_blocks)
