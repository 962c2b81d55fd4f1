"""Choose the dense CPU matmul kernels by measuring them on this machine, once.

Which kernel multiplies the activations by a weight fastest depends on the CPU: on an
AVX2 EPYC tokenmill's skinny kernel beat oneDNN up to 16 rows and float32 oneDNN was the
GEMM to use; with AMX, oneDNN's bf16 GEMM wins from a few rows on and runs prefill 4-5x
faster than float32. So at the first load of a model shape the candidates are timed on
that model's own matrix shapes (several layers' worth of distinct weights, so they stream
from memory as in a real step), the fastest per row range is kept, and the decision is
cached on disk, keyed by what it depends on: the CPU's model and flags, torch's version,
the thread count, the tile dtype and the shapes. A cached decision is reused; one log line
says which. `decide()` is the pure choice, tested with injected timings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tokenmill import kernels
from tokenmill.hardware import cpu_info
from tokenmill.quantization.dense import GEMM_KINDS, PANELS, CPUMatmulChoice
from tokenmill.runner.plan import ROWS

logger = logging.getLogger(__name__)

DECODE_ROWS = (1, 2, 4, 8, 16)  # row counts where the skinny kernel competes
PREFILL_ROWS = 128  # stands for prefill: the GEMM is chosen here
SCHEMA = 3  # 2: choices cached under schema 1 may come from uniformly disturbed measurements; 3: the panel kernel

Shape = tuple[int, int]  # (out_features, in_features)


@dataclass(frozen=True)
class Timings:
    """Seconds per pass over the measured weights: skinny[M], gemm[kind][M] and panels[M]
    (empty: the build has no panel kernel for the dtype)."""

    skinny: dict[int, float]
    gemm: dict[str, dict[int, float]]
    weight_elements: int = 0  # elements of the weights a pass multiplies (0: not known)
    panels: dict[int, float] = field(default_factory=dict)


# The skinny kernel keeps a row count unless the GEMM is faster by more than this: up to
# its limit, a pure decode step runs as one fused native op per layer, which saves the
# per-op path's dispatch (measured on a 2-core AMX Xeon: batch-1 decode 54.9 tok/s fused on
# the skinny kernel, 44.6 op by op on the bf16 GEMM, whose matmuls alone timed a little faster).
FUSED_MARGIN = 1.15


# The panel kernel runs every row count with one arithmetic, so a row's outputs do not
# depend on what shares its step (issue 24: the same request, the same answer). It is
# taken unless the split (skinny kernel, then the GEMM) is faster by more than this at some
# measured row count: a wide margin, because a flip of the arithmetic between two starts
# (another thread count, a busy moment) is what the choice exists to avoid. On a Zen 4 EPYC
# (2 threads, quiet) it matched oneDNN (0.95-1.12x its time at 64-1024 rows) and beat the
# skinny kernel (0.43-0.95x at 1-16 rows, 1 or 2 threads), yet one measurement taken while
# another job ran timed it 1.18x the skinny kernel at 1 row; with AMX, oneDNN's bf16 tiles
# are several times faster at prompts and the split stays.
PANELS_MARGIN = 1.5


def decide(timings: Timings) -> CPUMatmulChoice:
    """The panel kernel at every row count where it is within PANELS_MARGIN of the split
    at each measured row count; else the GEMM that is fastest at PREFILL_ROWS, and the
    skinny kernel for every row count up to the first one where that GEMM beats it by more
    than FUSED_MARGIN."""
    gemm = min(timings.gemm, key=lambda kind: timings.gemm[kind][PREFILL_ROWS])
    skinny_max_rows = 0
    for rows in sorted(timings.skinny):
        if timings.skinny[rows] > FUSED_MARGIN * timings.gemm[gemm][rows]:
            break
        skinny_max_rows = rows
    split = CPUMatmulChoice(skinny_max_rows=skinny_max_rows, gemm=gemm)

    def split_time(rows: int) -> float:
        return timings.skinny[rows] if rows <= skinny_max_rows and rows in timings.skinny else timings.gemm[gemm][rows]

    if timings.panels and all(t <= PANELS_MARGIN * split_time(rows) for rows, t in timings.panels.items()):
        return CPUMatmulChoice(skinny_max_rows=ROWS.skinny_max_rows, gemm=PANELS)
    return split


# Attempts at a measurement that is not disturbed before falling back to the default split.
MEASURE_ATTEMPTS = 3
# At most this many bytes of float32 weights per measured pass (the candidates' copies of
# them, tiles, panels and oneDNN's packed forms, add about twice as much). A pass needs only
# weights beyond the caches; 8 layers of an 8B model's shapes were 7 GB of float32 plus
# their copies, and the first start of such a model took 18 GB to choose its kernels.
MEASURE_WEIGHT_BYTES = 512 << 20


def measured_layers(shapes: Sequence[Shape], at_most: int) -> int:
    """How many copies of a layer's shapes a measured pass streams: up to `at_most`, within
    MEASURE_WEIGHT_BYTES of float32 weights, at least one."""
    layer_bytes = 4 * sum(n * k for n, k in shapes)
    return max(1, min(at_most, MEASURE_WEIGHT_BYTES // max(1, layer_bytes)))
# A pass over the same weights with fewer rows cannot honestly take this much longer than
# one with more rows: such a timing is other work stealing a thread (an OpenMP region waits
# for its descheduled peer), not the kernel. On a 2-core box shared by several jobs the
# skinny kernel timed 100 ms at 1 row and 17 ms at 8, and the cached choice turned the
# fused decode layer off for good.
DISTURBED_RATIO = 2.0
# Nor can a pass of the fewest rows read its weights (at least 2 bytes an element) slower
# than this: every kernel streams them at 10-30 GB/s a thread. On the same box with 2
# threads and 3-5 other jobs, every pass of every kernel took ~100-250 ms (0.2-0.5 GB/s:
# each OpenMP region waited for a descheduled thread), uniformly, so no kernel looked
# slower at fewer rows; the bf16 GEMM, 1.9x float32 on that CPU, lost by the noise and
# float32 was cached for good.
MIN_READ_BYTES_PER_S = 2e9


def disturbed(timings: Timings) -> str | None:
    """Why `timings` cannot be trusted (a kernel slower at fewer rows by more than
    DISTURBED_RATIO, or reading its weights slower than MIN_READ_BYTES_PER_S at its fewest
    rows), or None."""
    series = {"skinny kernel": timings.skinny, **timings.gemm, "panel kernel": timings.panels}
    for name, times in series.items():
        rows = sorted(times)
        for i, fewer in enumerate(rows):
            for more in rows[i + 1:]:
                if times[fewer] > DISTURBED_RATIO * times[more]:
                    return (f"{name} {times[fewer] * 1e3:.2f} ms at {fewer} rows vs {times[more] * 1e3:.2f} ms at "
                            f"{more}")
        least = 2 * timings.weight_elements
        if least and rows and times[rows[0]] * MIN_READ_BYTES_PER_S > least:
            return (f"{name} {times[rows[0]] * 1e3:.2f} ms at {rows[0]} rows over {least / 1e6:.0f} MB of weights "
                    f"({least / times[rows[0]] / 1e9:.2f} GB/s)")
    return None


def fallback_choice(gemms: Sequence[str], tile_dtype: torch.dtype) -> CPUMatmulChoice:
    """The choice when the measurement cannot be trusted, by the CPU's features: the panel
    kernel where this build has it for the dtype, unless the weights are bf16 on an AMX CPU
    (whose bf16 tiles oneDNN uses); else the default row split with `fallback_gemm`."""
    amx_bf16 = tile_dtype == torch.bfloat16 and cpu_info().has("amx_bf16")
    if PANELS in gemms and kernels.panel_linear_built(tile_dtype) and not amx_bf16:
        return CPUMatmulChoice(ROWS.skinny_max_rows, PANELS)
    return CPUMatmulChoice(ROWS.skinny_max_rows, fallback_gemm([g for g in gemms if g != PANELS]))


def fallback_gemm(gemms: Sequence[str]) -> str:
    """The GEMM when its measurement cannot be trusted: by the CPU's features, bf16 where it
    computes bf16 natively (AVX-512 BF16, AMX: 1.9x float32 on a Zen 4 EPYC, 4-5x with AMX),
    float32 elsewhere (bf16 is emulated on AVX2 only)."""
    if "onednn_bf16" in gemms and cpu_info().native_bf16:
        return "onednn_bf16"
    return "onednn_f32" if "onednn_f32" in gemms else gemms[0]


def candidate_gemms(tile_dtype: torch.dtype) -> tuple[str, ...]:
    """bf16 inputs only when the weights are bf16 already (float32 stays exact); the panel
    kernel where this build has it for the dtype."""
    gemms = GEMM_KINDS if tile_dtype == torch.bfloat16 else ("onednn_f32",)
    return (*gemms, PANELS) if kernels.panel_linear_built(tile_dtype) else gemms


def choose(shapes: Sequence[Shape], tile_dtype: torch.dtype, *, allowed: Sequence[str] | None = None,
           cache_dir: Path | None = None, refresh: bool = False) -> tuple[CPUMatmulChoice, Timings | None, str]:
    """The choice for a model with these linear shapes (among the `allowed` GEMMs; default
    every candidate for the dtype): from the cache, or measured now (and cached).
    Returns (choice, timings if measured now, where it came from)."""
    gemms = tuple(allowed or candidate_gemms(tile_dtype))
    key = cache_key(shapes, tile_dtype, gemms)
    path = (cache_dir or default_cache_dir()) / f"dense-{key}.json"
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("schema") == SCHEMA:
                return CPUMatmulChoice(**data["choice"]), None, f"cached in {path}"
        except (OSError, ValueError, TypeError):
            pass  # a damaged cache file is measured over
    start = time.perf_counter()
    for _ in range(MEASURE_ATTEMPTS):
        timings = measure(shapes, tile_dtype, gemms)
        problem = disturbed(timings)
        if problem is None:
            break
    if problem is not None:  # a busy machine: the measured choice would be cached for good
        choice = fallback_choice(gemms, tile_dtype)
        logger.warning("the matmul measurement was disturbed by other work on this machine (%s, %d attempts): "
                       "using %s, not cached; it is measured again at the next start", problem, MEASURE_ATTEMPTS,
                       choice.describe())
        return choice, timings, "measurement disturbed, default row split, not cached"
    choice = decide(timings)
    _write(path, {"schema": SCHEMA, "choice": asdict(choice), "timings": _jsonable(timings),
                  "cpu": cpu_info().describe(), "torch": torch.__version__, "threads": torch.get_num_threads()})
    return choice, timings, f"measured in {time.perf_counter() - start:.1f} s, cached in {path}"


def measure(shapes: Sequence[Shape], tile_dtype: torch.dtype, gemms: Sequence[str] | None = None, layers: int = 8,
            reps: int = 5) -> Timings:
    """Time every candidate over `layers` copies of the model's per-layer shapes (distinct
    weights, several MB each, so a pass streams them as a real step does; fewer where they
    would pass MEASURE_WEIGHT_BYTES)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(measured_layers(shapes, layers)) for n, k in shapes]
    tiles = [kernels.tile_for_skinny(w, tile_dtype) for w in weights]
    out_features = [w.shape[0] for w in weights]
    skinny = {m: _pass_time(lambda x, i: kernels.skinny_linear(x, tiles[i], out_features[i]), weights, m, reps)
              for m in DECODE_ROWS}
    panels: dict[int, float] = {}
    gemms = gemms or candidate_gemms(tile_dtype)
    if PANELS in gemms:
        stored = [kernels.pack_panels(w, tile_dtype) for w in weights]
        panels = {m: _pass_time(lambda x, i: kernels.panel_linear(x, stored[i], out_features[i]), weights, m, reps)
                  for m in (*DECODE_ROWS, PREFILL_ROWS)}
        del stored
    gemm: dict[str, dict[int, float]] = {}
    for kind in (g for g in gemms if g != PANELS):
        dtype = torch.bfloat16 if kind == "onednn_bf16" else torch.float32
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.to(tile_dtype).to(dtype), None) for w in weights]

        def onednn(x: torch.Tensor, i: int, packed=packed, dtype=dtype) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed[i], None, "none", [], "").float()

        gemm[kind] = {m: _pass_time(onednn, weights, m, reps) for m in (*DECODE_ROWS, PREFILL_ROWS)}
    return Timings(skinny, gemm, sum(w.numel() for w in weights), panels)


# ----- quantized weights: the many-row GEMM ------------------------------------------------

# Many-row step sizes where the whole-block integer GEMM competes with the bf16 GEMM on
# dequantized tiles (a batch of decodes / a chunk of prompt).
QUANT_ROWS = (32, PREFILL_ROWS)
QUANT_CANDIDATES = ("integer", "bf16 gemm")
QUANT_SCHEMA = 1


def decide_quant_gemm(timings: dict[str, dict[int, float]]) -> bool:
    """The integer GEMM where it was faster at every measured row count (the bf16 GEMM
    otherwise: with AMX oneDNN's bf16 tiles may beat VNNI integers)."""
    return all(timings["integer"][m] < timings["bf16 gemm"][m] for m in timings["integer"])


def choose_quant_gemm(shapes: Sequence[Shape], *, cache_dir: Path | None = None,
                      refresh: bool = False) -> tuple[bool, dict[str, dict[int, float]] | None, str]:
    """Whether quantized weights' many-row steps run the whole-block integer GEMM
    (kernels.quant_linear's `integer_gemm`) or the bf16 GEMM on dequantized tiles: measured on
    this machine on the model's layer shapes (4-bit, group 32, as Q4_1), cached as the dense
    choice is. Returns (integer, timings if measured now, where it came from)."""
    if not kernels.quant_integer_gemm_built():
        return False, None, f"no integer GEMM in this build ({kernels.quant_isa()}; it needs AVX512-VNNI)"
    key = cache_key(shapes, torch.uint8, QUANT_CANDIDATES)
    path = (cache_dir or default_cache_dir()) / f"quant-{key}.json"
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("schema") == QUANT_SCHEMA:
                return bool(data["integer_gemm"]), None, f"cached in {path}"
        except (OSError, ValueError, TypeError, KeyError):
            pass  # a damaged cache file is measured over
    start = time.perf_counter()
    for _ in range(MEASURE_ATTEMPTS):
        timings = measure_quant_gemm(shapes)
        # No bytes-per-second floor: both candidates are compute-bound at these rows.
        problem = disturbed(Timings({}, timings))
        if problem is None:
            break
    if problem is not None:
        logger.warning("the quantized GEMM measurement was disturbed by other work on this machine (%s): using the "
                       "bf16 GEMM, not cached; it is measured again at the next start", problem)
        return False, timings, "measurement disturbed, bf16 GEMM, not cached"
    integer = decide_quant_gemm(timings)
    _write(path, {"schema": QUANT_SCHEMA, "integer_gemm": integer,
                  "timings": {kind: {str(m): t for m, t in g.items()} for kind, g in timings.items()},
                  "cpu": cpu_info().describe(), "torch": torch.__version__, "threads": torch.get_num_threads()})
    return integer, timings, f"measured in {time.perf_counter() - start:.1f} s, cached in {path}"


QUANT_LAYERS = 4  # distinct layers' weights per measured pass (4-bit: a few MB, streamed)


def measure_quant_gemm(shapes: Sequence[Shape], reps: int = 5) -> dict[str, dict[int, float]]:
    """Seconds per pass of each candidate over QUANT_LAYERS copies of the layer shapes (fewer
    where they would pass MEASURE_WEIGHT_BYTES): the integer GEMM on float32 rows, the bf16
    GEMM on bf16 rows (the bf16 activation path's)."""
    from tokenmill.quantization.rtn import quantize_int4

    gen = torch.Generator().manual_seed(0)
    floats = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(measured_layers(shapes, QUANT_LAYERS))
              for n, k in shapes]
    qts = [quantize_int4(w, 32) for w in floats]

    def integer(x: torch.Tensor, i: int) -> torch.Tensor:
        return kernels.quant_linear(x, qts[i].packed, qts[i].format, None, 0, -1, True)

    def gemm(x: torch.Tensor, i: int) -> torch.Tensor:
        return kernels.quant_linear(x.bfloat16(), qts[i].packed, qts[i].format, None, 0)

    return {"integer": {m: _pass_time(integer, floats, m, reps) for m in QUANT_ROWS},
            "bf16 gemm": {m: _pass_time(gemm, floats, m, reps) for m in QUANT_ROWS}}


def describe(timings: Timings, choice: CPUMatmulChoice) -> str:
    """A table of the measured times (ms per pass) and the choice, for `tokenmill bench kernels`."""
    rows = sorted({*timings.skinny, *timings.panels, *(m for g in timings.gemm.values() for m in g)})
    header = ["rows", "skinny", *timings.gemm, *(["panels"] if timings.panels else [])]
    lines = ["  ".join(f"{h:>12}" for h in header)]
    for m in rows:
        cells = [str(m), _ms(timings.skinny.get(m)), *(_ms(g.get(m)) for g in timings.gemm.values()),
                 *([_ms(timings.panels.get(m))] if timings.panels else [])]
        lines.append("  ".join(f"{c:>12}" for c in cells))
    lines.append(f"choice: {choice.describe()}")
    return "\n".join(lines)


def cache_key(shapes: Sequence[Shape], tile_dtype: torch.dtype, gemms: Sequence[str]) -> str:
    cpu = cpu_info()
    text = json.dumps([SCHEMA, cpu.model_name, sorted(cpu.flags), torch.__version__, torch.get_num_threads(),
                       str(tile_dtype), sorted(set(shapes)), sorted(gemms)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(root) / "tune"


# ----- internals ------------------------------------------------------------------------


def _pass_time(multiply: Callable[[torch.Tensor, int], torch.Tensor], weights: list[torch.Tensor], rows: int,
               reps: int) -> float:
    """Seconds of one pass (the fastest of `reps`: other work on the machine only ever adds
    time): every weight i multiplied by an input of `rows` rows."""
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    order = [inputs[w.shape[1]] for w in weights]

    def one_pass() -> None:
        for i, x in enumerate(order):
            multiply(x, i)

    samples = []
    with torch.inference_mode():
        one_pass()  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            one_pass()
            samples.append(time.perf_counter() - t0)
    return min(samples)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _jsonable(timings: Timings) -> dict:
    return {"skinny": {str(m): t for m, t in timings.skinny.items()},
            "gemm": {kind: {str(m): t for m, t in g.items()} for kind, g in timings.gemm.items()},
            "weight_elements": timings.weight_elements,
            "panels": {str(m): t for m, t in timings.panels.items()}}


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only home must not stop the engine
        logger.warning("could not cache the kernel choice in %s: %s", path, exc)


__all__ = ["Timings", "choose", "choose_quant_gemm", "decide", "decide_quant_gemm", "describe", "fallback_choice",
           "fallback_gemm", "measure",
           "measure_quant_gemm"]
