"""The one reader of this machine's CPU: model name, SIMD flags, core count.

The runner chooses kernels and dtypes from it, the benchmarks print it beside every
figure, and the native kernels key their build cache by it. Torch-free.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

# The flags that decide which CPU kernels run fast here (and which a build may use).
_SIMD_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


@dataclass(frozen=True)
class CPUInfo:
    model_name: str
    flags: frozenset[str]
    num_cores: int  # the cores this process may run on

    def has(self, *flags: str) -> bool:
        return all(flag in self.flags for flag in flags)

    @property
    def simd_flags(self) -> list[str]:
        """The SIMD extensions that decide matmul speed, sorted."""
        return sorted(f for f in self.flags if f.startswith(_SIMD_PREFIXES) or "vnni" in f)

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware (AVX-512 BF16 or AMX). Without it CPU bf16 matmuls
        are emulated and ran 10-20x slower than float32 on an AVX2-only EPYC."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def isa(self) -> str:
        """The widest vector ISA family the kernels use here."""
        if self.has("avx512f", "avx512bw", "avx512vl"):
            return "avx512_vnni" if self.has("avx512_vnni") else "avx512"
        if self.has("avx2", "fma"):
            return "avx2_vnni" if self.has("avx_vnni") else "avx2"
        return "scalar"

    def describe(self) -> str:
        """'<model> (<n> cores; <isa>; bf16 native|emulated)', for benchmark tables and logs."""
        extras = [name for name in ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if name in self.flags]
        return f"{self.model_name}, {self.num_cores} cores, {self.isa}" + (f" ({' '.join(extras)})" if extras else "")


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


@functools.cache
def cpu_info() -> CPUInfo:
    model, flags = _read_cpuinfo()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return CPUInfo(model, flags, cores)
