"""A step-time cost model fitted to measured steps, for the serving simulator (issue 16).

BLIS's black-box step model (inference-sim), with Vidur's attention terms:

    seconds = b0 + b1 x prefill tokens + b2 x decode tokens + b3 x sum of decode contexts
              [+ b4 x prefill attention pairs]

b0 is what every step pays (reading the weights once, launching, scheduling); b1 and b2
the per-token cost of prefill and decode rows (their GEMM rows, the LM head); b3 the KV
reads of decode attention, proportional to the tokens each decode row attends to; b4,
optional, the prefill's attention: the (query, key) pairs of its chunks, n x start +
n (n + 1) / 2 for a chunk of n tokens after `start` computed ones (Vidur's p^2 term).

Optionally (`decode_curve=True`), a step of decode rows only costs a measured curve of
its batch size instead of b0 + b2 x rows, interpolated linearly between the batch sizes
profiled (and extended past the last one along its last segment), plus b3 x contexts, as
Vidur keeps a profile per batch size. Runners switch kernels with the batch (tokenmill's
CPU plan runs pure decode steps of up to 16 rows through a fused decode layer, and more
rows as GEMMs), so pure decode steps are far from linear in their rows: measured on the
2-core CPU box, 1, 4, 8, 16 and 32 rows took 132, 194, 250, 303 and 354 ms.

The fit is non-negative least squares (Lawson-Hanson) on relative errors: a 2 ms step
weighs as much as a 2 s one.

For a device that was not measured, `RooflineStepModel` predicts a step from the
roofline instead (bytes over bandwidth, FLOPs over FLOP/s). Torch-free.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tokenmill.planner.roofline import (
    Deployment,
    StepTime,
    attention_flops,
    communication_seconds,
    kv_bytes_per_token,
    linear_flops_per_token,
    lm_head_flops,
    stage_layers,
    weights_read_per_step,
)

COEFFICIENTS = ("intercept_s", "per_prefill_token_s", "per_decode_token_s", "per_context_token_s")
PREFILL_ATTENTION = "per_prefill_pair_s"
# A batch size joins the decode curve when the samples have at least this many pure decode steps of it.
MIN_CURVE_SAMPLES = 3


@dataclass(frozen=True)
class StepFeatures:
    """What a step's time depends on in this model."""

    prefill_tokens: int  # uncached prompt tokens computed in the step (all chunks)
    decode_tokens: int  # decode rows (one token each)
    decode_context: int  # sum over decode rows of the tokens each attends to
    prefill_attention: int = 0  # (query, key) pairs of the prefill chunks: n x start + n (n + 1) / 2 each

    def vector(self, prefill_attention: bool = False) -> list[float]:
        head = [1.0, float(self.prefill_tokens), float(self.decode_tokens), float(self.decode_context)]
        return head + [float(self.prefill_attention)] if prefill_attention else head

    @property
    def is_pure_decode(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_tokens > 0


class StepTimeModel(Protocol):
    """Anything that predicts a step's seconds from its features (fitted or roofline)."""

    def predict(self, step: StepFeatures) -> float: ...


@dataclass(frozen=True)
class ScaledStepModel:
    """Another model's steps, `factor` times as long: the same machine in a slower or faster
    phase of its other jobs (`tokenmill tune` ranks settings over a few such phases)."""

    inner: StepTimeModel
    factor: float

    def predict(self, step: StepFeatures) -> float:
        return self.inner.predict(step) * self.factor


@dataclass(frozen=True)
class StepCostModel:
    intercept_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    per_prefill_pair_s: float = 0.0
    # A pure decode step's seconds at these batch sizes (contexts apart); empty: the linear terms.
    decode_rows: tuple[int, ...] = ()
    decode_seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.decode_rows) != len(self.decode_seconds):
            raise ValueError("decode_rows and decode_seconds must have the same length")
        if list(self.decode_rows) != sorted(set(self.decode_rows)) or any(r < 1 for r in self.decode_rows):
            raise ValueError(f"decode_rows must be increasing batch sizes >= 1, got {list(self.decode_rows)}")

    def predict(self, step: StepFeatures) -> float:
        """b0 + b1 x prefill tokens + b2 x decode tokens + b3 x sum of decode contexts
        + b4 x prefill attention pairs; a pure decode step with a decode curve: the curve at
        its rows + b3 x contexts."""
        context = self.per_context_token_s * step.decode_context
        if self.decode_rows and step.is_pure_decode:
            return decode_curve_value(self.decode_rows, self.decode_seconds, step.decode_tokens) + context
        return (self.intercept_s + self.per_prefill_token_s * step.prefill_tokens
                + self.per_decode_token_s * step.decode_tokens + context
                + self.per_prefill_pair_s * step.prefill_attention)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {name: getattr(self, name) for name in (*COEFFICIENTS, PREFILL_ATTENTION)}
        if self.decode_rows:
            data["decode_rows"], data["decode_seconds"] = list(self.decode_rows), list(self.decode_seconds)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCostModel:
        missing = [name for name in COEFFICIENTS if name not in data]
        if missing:
            raise ValueError(f"a step cost model needs {', '.join(COEFFICIENTS)}; missing {', '.join(missing)}")
        values = {name: float(data[name]) for name in COEFFICIENTS}
        values[PREFILL_ATTENTION] = float(data.get(PREFILL_ATTENTION, 0.0))
        rows, seconds = data.get("decode_rows") or [], data.get("decode_seconds") or []
        return cls(**values, decode_rows=tuple(int(r) for r in rows), decode_seconds=tuple(float(t) for t in seconds))


def decode_curve_value(rows: Sequence[int], seconds: Sequence[float], batch: int) -> float:
    """Linear interpolation of (rows, seconds) at `batch`; outside the rows, the nearest
    segment extended (never below zero). One point: that value everywhere."""
    if len(rows) == 1:
        return seconds[0]
    i = min(max(bisect.bisect_right(rows, batch) - 1, 0), len(rows) - 2)
    r0, r1, t0, t1 = rows[i], rows[i + 1], seconds[i], seconds[i + 1]
    return max(t0 + (t1 - t0) * (batch - r0) / (r1 - r0), 0.0)


def _hat_weights(rows: Sequence[int], batch: int) -> list[float]:
    """The weights of each curve point in `decode_curve_value(rows, ., batch)` (it is linear
    in the points' seconds), so that the curve can be fitted by least squares."""
    weights = [0.0] * len(rows)
    if len(rows) == 1:
        return [1.0]
    i = min(max(bisect.bisect_right(rows, batch) - 1, 0), len(rows) - 2)
    u = (batch - rows[i]) / (rows[i + 1] - rows[i])
    weights[i], weights[i + 1] = 1.0 - u, u
    return weights


@dataclass(frozen=True)
class Fit:
    model: StepCostModel
    samples: int
    median_relative_error: float  # |predicted - measured| / measured
    max_relative_error: float
    names: tuple[str, ...] = field(default=())  # the fitted columns


def fit_step_cost_model(samples: Sequence[tuple[StepFeatures, float]], prefill_attention: bool = False,
                        decode_curve: bool = False) -> Fit:
    """Fit the coefficients to (features, measured seconds) samples: minimize
    sum(((predicted - measured) / measured)^2) subject to every coefficient >= 0. Four
    coefficients, five with `prefill_attention`; with `decode_curve`, pure decode steps
    get a curve over the batch sizes that have at least MIN_CURVE_SAMPLES of them."""
    seconds = np.array([measured for _, measured in samples], dtype=np.float64)
    if len(samples) and (not np.all(np.isfinite(seconds)) or np.any(seconds <= 0)):
        raise ValueError("measured step times must be positive and finite")
    rows: tuple[int, ...] = ()
    if decode_curve:
        counts = Counter(step.decode_tokens for step, _ in samples if step.is_pure_decode)
        rows = tuple(sorted(b for b, n in counts.items() if n >= MIN_CURVE_SAMPLES))
        if not rows:
            raise ValueError(f"a decode curve needs at least {MIN_CURVE_SAMPLES} pure decode steps of one batch size")
    names = [*COEFFICIENTS, *([PREFILL_ATTENTION] if prefill_attention else []), *(f"decode_{b}" for b in rows)]
    if len(samples) < len(names):
        raise ValueError(f"fitting {len(names)} coefficients needs at least {len(names)} samples, got {len(samples)}")
    features = np.array([_design_row(step, prefill_attention, rows) for step, _ in samples], dtype=np.float64)
    _check_identifiable(features, names)
    # Relative errors: divide each row by its measured time; the target becomes all ones.
    coefficients = _nonnegative_least_squares(features / seconds[:, None], np.ones(len(samples)))
    values = dict(zip(names, (float(c) for c in coefficients)))
    model = StepCostModel(
        *(values[name] for name in COEFFICIENTS), values.get(PREFILL_ATTENTION, 0.0),
        decode_rows=rows, decode_seconds=tuple(values[f"decode_{b}"] for b in rows),
    )
    return Fit(model, len(samples), *relative_errors(model, samples), names=tuple(names))


def _design_row(step: StepFeatures, prefill_attention: bool, rows: tuple[int, ...]) -> list[float]:
    """The step's row of the least-squares problem. With a curve a pure decode step uses
    only its curve points and the context term; the others leave the curve out."""
    if rows and step.is_pure_decode:
        linear = [0.0, 0.0, 0.0, float(step.decode_context)] + ([0.0] if prefill_attention else [])
        return linear + _hat_weights(rows, step.decode_tokens)
    return step.vector(prefill_attention) + [0.0] * len(rows)


def relative_errors(model: StepTimeModel, samples: Sequence[tuple[StepFeatures, float]]) -> tuple[float, float]:
    """(median, max) of |predicted - measured| / measured over the samples."""
    errors = [abs(model.predict(step) - measured) / measured for step, measured in samples]
    return statistics.median(errors), max(errors)


def _check_identifiable(features: np.ndarray, names: Sequence[str]) -> None:
    """Every coefficient must be told apart from the others by the samples."""
    plain = {"per_prefill_token_s": "prefill tokens", "per_decode_token_s": "decode tokens",
             "per_context_token_s": "decode contexts", PREFILL_ATTENTION: "prefill attention pairs"}
    for column, name in enumerate(names):
        if column and not np.any(features[:, column]):
            raise ValueError(f"no sample has {plain.get(name, name)}: the samples cannot fit its coefficient")
    rank = np.linalg.matrix_rank(features)
    if rank < features.shape[1]:
        raise ValueError(f"the samples cannot tell the {features.shape[1]} coefficients apart (rank {rank}): "
                         "vary prefill tokens, decode rows and their contexts independently")


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (Lawson and Hanson's active-set method, as
    scipy.optimize.nnls): grow the set of free coefficients by the one whose gradient
    promises most, solve least squares on the set, and step back to the boundary when a
    free coefficient would turn negative. The columns are scaled to unit norm first, so that
    one tolerance fits coefficients of seconds per step and of seconds per attention pair."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    return _lawson_hanson(a / norms, b) / norms


def _lawson_hanson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    _, columns = a.shape
    x = np.zeros(columns)
    free = np.zeros(columns, dtype=bool)
    tolerance = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(a.shape)
    for _ in range(3 * columns + 10):
        gradient = a.T @ (b - a @ x)
        if free.all() or np.max(np.where(free, -np.inf, gradient)) <= tolerance:
            break
        free[int(np.argmax(np.where(free, -np.inf, gradient)))] = True
        while True:
            z = np.zeros(columns)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if np.all(z[free] > tolerance):
                x = z
                break
            blocking = free & (z <= tolerance)
            gap = x[blocking] - z[blocking]
            alpha = float(np.min(np.divide(x[blocking], gap, out=np.zeros_like(gap), where=gap > 0)))
            x = x + alpha * (z - x)
            free &= x > tolerance
            x[~free] = 0.0
    return x


@dataclass(frozen=True)
class RooflineStepModel:
    """A step by the roofline, for devices that were not measured: max(bytes / bandwidth,
    FLOPs / FLOP/s) + `overhead_s` (the scheduler's and the runner's own time, which the
    roofline leaves out). Bytes: the weights the step's tokens use, once, and the KV of
    every decode row's context (prefill chunks read their own context, not counted: at
    most a chunk's length of keys, small beside the weights). FLOPs: 2 x active
    parameters per token, the attention products (per (query, key) pair, as
    `attention_flops`), and one row of logits per decode row and per step with prefill
    (the chunks that finish a prompt sample one token; counted as one)."""

    deployment: Deployment
    overhead_s: float = 0.0

    def predict(self, step: StepFeatures) -> float:
        """PP x max(bytes / bandwidth, FLOPs / FLOP/s) per stage + communication + overhead."""
        dep = self.deployment
        shape, parallel = dep.shape, dep.parallel
        tokens = step.prefill_tokens + step.decode_tokens
        if tokens == 0:
            return self.overhead_s
        stage = stage_layers(shape, parallel) / shape.num_layers
        per_pair = attention_flops(shape, 1)  # one query attending one key, in every layer
        read = weights_read_per_step(dep, tokens) + step.decode_context * kv_bytes_per_token(shape, dep.kv, parallel)
        logits_rows = step.decode_tokens + (1 if step.prefill_tokens else 0)
        layer_flops = tokens * linear_flops_per_token(dep.params, shape) \
            + per_pair * (step.decode_context + step.prefill_attention)
        flops = (layer_flops * stage + logits_rows * lm_head_flops(shape)) / parallel.tensor_parallel_size
        time = StepTime(read, flops, read / dep.device.bandwidth, flops / dep.flops_rate,
                        communication_seconds(dep, tokens), parallel.pipeline_parallel_size)
        return time.seconds + self.overhead_s


# What moving a request's KV costs in prefill-decode disaggregation (docs/disaggregation.md).
# The default link of a catalog device: one 400 Gb/s NIC per device (RDMA), as H100/H200 nodes have.
DEVICE_KV_TRANSFER_BANDWIDTH = 50e9
# This machine: the transfer measured by benchmarks/disaggregation.py on one host, where the
# decode instance copies from the prefill instance's shared memory (docs/disaggregation.md, 2026-11-28:
# 128 blocks, 47.2 MB of bfloat16 KV in 32 ms median, on a core decoding meanwhile): ~1.5 GB/s.
# Over TCP (`"shared_memory": false`) the same took 66 ms + a 32 ms copy-in: ~0.48 GB/s.
MEASURED_KV_TRANSFER_BANDWIDTH = 47.2e6 / 0.032


@dataclass(frozen=True)
class KVTransferCost:
    """A decode instance pulling a request's KV from a prefill instance: `latency_s` per
    pull (the request and the answer's round trip) plus its bytes over `bandwidth`
    (bytes/s; one pull at a time per decode instance, as its puller thread runs them).
    `copy_in_bandwidth` (bytes/s; 0: not counted): the decode instance copying the pulled
    bytes into its KV pool, on its engine thread before the step that schedules the request.
    Bytes are the KV cache's own: blocks x block_size x KV bytes per token."""

    bandwidth: float
    latency_s: float = 0.0
    copy_in_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.bandwidth < float("inf")):
            raise ValueError(f"the KV transfer bandwidth must be a positive number of bytes/s, got {self.bandwidth}")
        if not (self.latency_s >= 0 and self.copy_in_bandwidth >= 0):
            raise ValueError("the KV transfer latency and copy-in bandwidth must be >= 0")

    def pull_seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def copy_in_seconds(self, nbytes: float) -> float:
        return nbytes / self.copy_in_bandwidth if self.copy_in_bandwidth else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth_bytes_per_s": self.bandwidth, "latency_s": self.latency_s,
                "copy_in_bandwidth_bytes_per_s": self.copy_in_bandwidth}
