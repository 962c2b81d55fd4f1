"""The names of dtypes, declared once: what `--dtype` and `--kv-cache-dtype` accept and
how many bytes an element of each takes.

The engine's config takes its choices from here, the builder its torch dtypes
(`torch_dtype`), and the planner and the simulator the bytes a KV cache holds per
element. Torch-free at import (torch is imported by `torch_dtype` only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Dtypes of weights, activations and a 16/32-bit KV cache: name -> bytes per element.
DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# --dtype: auto lets the builder choose for the device.
DTYPE_CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True)
class KVCacheDtype:
    """How a KV cache stores its elements."""

    name: str
    bytes_per_element: int
    scale_bytes: int = 0  # per token, layer, K or V, and KV head (an fp16 scale)


KV_CACHE_DTYPES: dict[str, KVCacheDtype] = {
    **{name: KVCacheDtype(name, size) for name, size in DTYPES.items()},
    # 8-bit caches as tokenmill stores them (issue 13): an fp16 scale per token and KV head.
    "int8": KVCacheDtype("int8", 1, 2),
    "fp8_e4m3": KVCacheDtype("fp8_e4m3", 1, 2),
}
# vLLM's --kv-cache-dtype spellings of the same caches.
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
# --kv-cache-dtype: auto follows --dtype.
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES)


def kv_cache_dtype_name(name: str) -> str:
    """The table's name of a --kv-cache-dtype value ('fp8' -> 'fp8_e4m3'; 'auto' stays)."""
    key = name.strip().lower()
    key = KV_CACHE_DTYPE_ALIASES.get(key, key)
    if key != "auto" and key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return key


def torch_dtype(name: str) -> Any:
    """The torch dtype of a name of DTYPES or KV_CACHE_DTYPES (fp8_e4m3 is float8_e4m3fn,
    None where this torch lacks it)."""
    import torch

    if name == "fp8_e4m3":
        return getattr(torch, "float8_e4m3fn", None)
    if name not in DTYPES and name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join([*DTYPES, *KV_CACHE_DTYPES])}")
    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """The table's name of a torch dtype (e.g. torch.float8_e4m3fn -> 'fp8_e4m3'); other
    dtypes by torch's name."""
    for name in (*DTYPES, *KV_CACHE_DTYPES):
        if torch_dtype(name) == dtype:
            return name
    return str(dtype).removeprefix("torch.")
