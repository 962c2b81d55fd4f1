"""One table of dtype names (tokenmill/dtypes.py): the engine's choices, the planner's KV
bytes and the torch dtypes all come from it."""

from __future__ import annotations

import pytest
import torch

from tokenmill import config, dtypes
from tokenmill.planner import roofline


def test_the_engine_and_the_planner_read_the_same_table() -> None:
    assert config.SUPPORTED_DTYPES == ("auto", "float32", "bfloat16", "float16")
    assert config.KV_CACHE_DTYPES == ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8")
    assert roofline.KV_CACHE_DTYPES is dtypes.KV_CACHE_DTYPES
    bf16 = roofline.weight_format("bf16")
    for name in config.KV_CACHE_DTYPES:  # every name the engine takes, the planner can size
        kv = roofline.kv_cache_dtype(name, bf16)
        assert kv.name == (dtypes.kv_cache_dtype_name(name) if name != "auto" else "bfloat16")
    assert roofline.kv_cache_dtype("fp8", bf16) == dtypes.KV_CACHE_DTYPES["fp8_e4m3"]


def test_bytes_and_torch_dtypes_agree() -> None:
    for name, size in dtypes.DTYPES.items():
        assert dtypes.torch_dtype(name).itemsize == size == dtypes.KV_CACHE_DTYPES[name].bytes_per_element
        assert dtypes.dtype_name(dtypes.torch_dtype(name)) == name
    assert dtypes.torch_dtype("int8") == torch.int8 and dtypes.dtype_name(torch.int8) == "int8"
    assert dtypes.dtype_name(getattr(torch, "float8_e4m3fn")) == "fp8_e4m3"
    assert dtypes.dtype_name(torch.int32) == "int32"


def test_unknown_names_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int3'; choose from auto, float32"):
        dtypes.kv_cache_dtype_name("int3")
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        dtypes.torch_dtype("float64")
