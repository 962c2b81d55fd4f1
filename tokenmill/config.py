"""Engine configuration, built once from user arguments and passed one way.

Facts found at run time (the number of KV blocks, the EOS ids, the model's
context length) are returned by whoever computes them, not written back here.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpu_native", "torch_sdpa")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str = "auto"  # see runner.factory.resolve_dtype
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes; None: see default_kv_cache_memory()
    block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # CPU threads for torch; None: all cores
    attention_backend: str = "auto"  # auto: cpu_native on CPU when its kernel builds, else torch_sdpa

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")


def parse_memory(value: str | int | float | None) -> int | None:
    """'2GiB', '512MiB', '1.5G', 2**30 -> bytes."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    text = value.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "k": 2**10, "m": 2**20, "g": 2**30,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * units[suffix])
    return int(float(text))
