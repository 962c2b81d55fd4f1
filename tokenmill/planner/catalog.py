"""Devices from their vendors' datasheets: memory, memory bandwidth, dense FLOP/s.

FLOP/s are dense (the datasheets' "with sparsity" figures halved) tensor/matrix-core
peaks; float32 is the plain (non-tensor) FP32 rate. Memory is the datasheet's capacity in
GiB (HBM/GDDR parts come in powers of two; the driver keeps a few hundred MiB), bandwidth
the datasheet's peak in decimal bytes/s. Kernels reach roughly 80-90% of the bandwidth and
60-80% of the FLOP/s; the roofline is an upper bound.

CPUs: one socket. AMD and Intel publish no FLOP/s for these parts, so those are derived:
cores x base clock x the per-core, per-cycle rate of the vector/matrix units (stated on each
entry); bandwidth is channels x DDR5 transfer rate x 8 bytes (STREAM reaches ~75-85% of it,
and a part with few cores cannot saturate all channels). `machine.py` measures this machine
instead.
"""

from __future__ import annotations

from tokenmill.planner.roofline import GIB, Device

TB, T = 1e12, 1e12


def _gpu(name: str, memory_gib: float, bandwidth_tb_s: float, fp32: float, bf16: float, fp8: float | None,
         int8: float, source: str, *notes: str) -> Device:
    flops = {"float32": fp32 * T, "bfloat16": bf16 * T, "int8": int8 * T}
    if fp8:
        flops["fp8"] = fp8 * T
    return Device(name, int(memory_gib * GIB), bandwidth_tb_s * TB, flops, "gpu", source, notes)


def _cpu(name: str, cores: int, base_ghz: float, channels: int, mt_s: int, memory_gib: int,
         per_cycle: dict[str, int], source: str, *notes: str) -> Device:
    """cores x base GHz x FLOP per cycle per core; bandwidth = channels x MT/s x 8 bytes."""
    flops = {dtype: cores * base_ghz * 1e9 * rate for dtype, rate in per_cycle.items()}
    rates = ", ".join(f"{dtype} {rate}" for dtype, rate in per_cycle.items())
    derived = f"FLOP/s derived: {cores} cores x {base_ghz} GHz base x per-cycle per-core ({rates})"
    return Device(name, memory_gib * GIB, channels * mt_s * 1e6 * 8, flops, "cpu", source, (derived, *notes))


# Zen 4: two 256-bit FMA pipes (512-bit ops take both): fp32 2 x 8 lanes x 2 = 32 FLOP/cycle;
# VDPBF16PS two bf16 products per fp32 lane: 64; VPDPBUSD four int8 products per lane: 128.
_ZEN4 = {"float32": 32, "bfloat16": 64, "int8": 128}
# Sapphire Rapids: AVX-512 two 512-bit FMA units: fp32 64 FLOP/cycle; AMX (one TMUL per core):
# 1024 bf16 FLOP and 2048 int8 OP per cycle (Intel's AMX overview).
_SPR_AMX = {"float32": 64, "bfloat16": 1024, "int8": 2048}
_GENOA = ("AMD EPYC 9004 product page: 12 channels DDR5-4800 (460.8 GB/s per socket), base clocks; "
          "12 x 64 GiB DIMMs assumed")
_GENOA_NOTE = "fewer than 8 CCDs (under 64 cores) cannot pull the full 460 GB/s"

DEVICES: dict[str, Device] = {
    device.name.lower(): device
    for device in (
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s; FP32 67 TFLOPS;
        # BF16 1,979 / FP8 3,958 TFLOPS and INT8 3,958 TOPS with sparsity; NVLink 900 GB/s.
        _gpu("H100-SXM", 80, 3.35, 67, 989.5, 1979, 1979, "NVIDIA H100 datasheet (SXM5)",
             "NVLink 900 GB/s per GPU (bidirectional): pass --interconnect-bandwidth 450e9 for its one-way rate"),
        # NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s; the H100's compute.
        _gpu("H200", 141, 4.8, 67, 989.5, 1979, 1979, "NVIDIA H200 datasheet (SXM)",
             "NVLink 900 GB/s per GPU (bidirectional)"),
        # NVIDIA A100 datasheet (SXM): 40 GB HBM2 1,555 GB/s, 80 GB HBM2e 2,039 GB/s;
        # FP32 19.5 TFLOPS, BF16 312 TFLOPS, INT8 624 TOPS dense; no FP8.
        _gpu("A100-40GB", 40, 1.555, 19.5, 312, None, 624, "NVIDIA A100 datasheet (SXM 40GB)",
             "no fp8 tensor cores: fp8 weights run at the bf16 rate", "NVLink 600 GB/s per GPU"),
        _gpu("A100-80GB", 80, 2.039, 19.5, 312, None, 624, "NVIDIA A100 datasheet (SXM 80GB)",
             "no fp8 tensor cores: fp8 weights run at the bf16 rate", "NVLink 600 GB/s per GPU"),
        # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s; FP32 30.3 TFLOPS; BF16 242, FP8 485
        # TFLOPS and INT8 485 TOPS with sparsity.
        _gpu("L4", 24, 0.300, 30.3, 121, 242.5, 242.5, "NVIDIA L4 datasheet", "PCIe Gen4 x16 (64 GB/s), no NVLink"),
        # AMD Instinct MI300X data sheet: 192 GB HBM3, 5.3 TB/s; FP32 (matrix) 163.4 TFLOPS;
        # FP16/BF16 1,307.4 TFLOPS, FP8 2,614.9 TFLOPS, INT8 2,614.9 TOPS dense.
        _gpu("MI300X", 192, 5.3, 163.4, 1307.4, 2614.9, 2614.9, "AMD Instinct MI300X data sheet",
             "Infinity Fabric 896 GB/s peer bandwidth per GPU"),
        # AMD EPYC 9004 (Zen 4, "Genoa"), one socket per core count.
        _cpu("EPYC-9654", 96, 2.4, 12, 4800, 768, _ZEN4, f"AMD EPYC 9654 (96 cores); {_GENOA}"),
        _cpu("EPYC-9554", 64, 3.1, 12, 4800, 768, _ZEN4, f"AMD EPYC 9554 (64 cores); {_GENOA}"),
        _cpu("EPYC-9354", 32, 3.25, 12, 4800, 768, _ZEN4, f"AMD EPYC 9354 (32 cores); {_GENOA}", _GENOA_NOTE),
        _cpu("EPYC-9124", 16, 3.0, 12, 4800, 768, _ZEN4, f"AMD EPYC 9124 (16 cores); {_GENOA}", _GENOA_NOTE),
        # Intel Xeon Platinum 8480+ (Sapphire Rapids, AMX): 56 cores, 2.0 GHz base, 8 channels
        # DDR5-4800 (307.2 GB/s), per Intel ARK.
        _cpu("Xeon-8480+", 56, 2.0, 8, 4800, 512, _SPR_AMX,
             "Intel Xeon Platinum 8480+ (56 cores, AMX), Intel ARK; 16 x 32 GiB DIMMs assumed",
             "AMX runs at a lower clock than the base under load; bf16/int8 rates are AMX tile peaks"),
    )
}


def device(name: str) -> Device:
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose from {', '.join(d.name for d in DEVICES.values())}, "
                         "'this' (measured here) or a device JSON file")
    return DEVICES[key]
