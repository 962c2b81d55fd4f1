"""A step-time cost model fitted to measured steps, for the serving simulator (issue 16).

BLIS's black-box step model (inference-sim), with Vidur's attention terms:

    seconds = b0 + b1 x prefill tokens + b2 x decode tokens + b3 x sum of decode contexts
              [+ b4 x prefill attention pairs]

b0 is what every step pays (reading the weights once, launching, scheduling); b1 and b2
the per-token cost of prefill and decode rows (their GEMM rows, the LM head); b3 the KV
reads of decode attention, proportional to the tokens each decode row attends to; b4,
optional, the prefill's attention: the (query, key) pairs of its chunks, n x start +
n (n + 1) / 2 for a chunk of n tokens after `start` computed ones (Vidur's p^2 term). On a
CPU a step is close to linear in these (weights are read once per step, compute grows with
tokens), so four coefficients go far; the fifth is fitted when asked
(`prefill_attention=True`), as `tokenmill simulate calibrate` does.

The fit is non-negative least squares on relative errors (a 2 ms step weighs as much as a
2 s one), solved exactly for four or five coefficients by trying every support.

For a device that was not measured, `RooflineStepModel` predicts a step from the
roofline instead (bytes over bandwidth, FLOPs over FLOP/s). Torch-free.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

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


class StepTimeModel(Protocol):
    """Anything that predicts a step's seconds from its features (fitted or roofline)."""

    def predict(self, step: StepFeatures) -> float: ...


@dataclass(frozen=True)
class StepCostModel:
    intercept_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    per_prefill_pair_s: float = 0.0

    def predict(self, step: StepFeatures) -> float:
        """b0 + b1 x prefill tokens + b2 x decode tokens + b3 x sum of decode contexts
        + b4 x prefill attention pairs."""
        return (self.intercept_s + self.per_prefill_token_s * step.prefill_tokens
                + self.per_decode_token_s * step.decode_tokens + self.per_context_token_s * step.decode_context
                + self.per_prefill_pair_s * step.prefill_attention)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> StepCostModel:
        missing = [name for name in COEFFICIENTS if name not in data]
        if missing:
            raise ValueError(f"a step cost model needs {', '.join(COEFFICIENTS)}; missing {', '.join(missing)}")
        names = (*COEFFICIENTS, PREFILL_ATTENTION) if PREFILL_ATTENTION in data else COEFFICIENTS
        return cls(**{name: float(data[name]) for name in names})


@dataclass(frozen=True)
class Fit:
    model: StepCostModel
    samples: int
    median_relative_error: float  # |predicted - measured| / measured
    max_relative_error: float


def fit_step_cost_model(samples: Sequence[tuple[StepFeatures, float]], prefill_attention: bool = False) -> Fit:
    """Fit the coefficients to (features, measured seconds) samples: minimize
    sum(((predicted - measured) / measured)^2) subject to every coefficient >= 0. Four
    coefficients, or five with `prefill_attention`."""
    names = (*COEFFICIENTS, PREFILL_ATTENTION) if prefill_attention else COEFFICIENTS
    if len(samples) < len(names):
        raise ValueError(f"fitting {len(names)} coefficients needs at least {len(names)} samples, got {len(samples)}")
    seconds = np.array([measured for _, measured in samples], dtype=np.float64)
    if not np.all(np.isfinite(seconds)) or np.any(seconds <= 0):
        raise ValueError("measured step times must be positive and finite")
    features = np.array([step.vector(prefill_attention) for step, _ in samples], dtype=np.float64)
    _check_identifiable(features)
    # Relative errors: divide each row by its measured time; the target becomes all ones.
    weighted, target = features / seconds[:, None], np.ones(len(samples))
    coefficients = _nonnegative_least_squares(weighted, target)
    model = StepCostModel(*(float(c) for c in coefficients))
    return Fit(model, len(samples), *relative_errors(model, samples))


def relative_errors(model: StepTimeModel, samples: Sequence[tuple[StepFeatures, float]]) -> tuple[float, float]:
    """(median, max) of |predicted - measured| / measured over the samples."""
    errors = [abs(model.predict(step) - measured) / measured for step, measured in samples]
    return statistics.median(errors), max(errors)


def _check_identifiable(features: np.ndarray) -> None:
    """Every coefficient must be told apart from the others by the samples."""
    names = ("a constant", "prefill tokens", "decode tokens", "decode contexts", "prefill attention pairs")
    for column in range(1, features.shape[1]):
        if not np.any(features[:, column]):
            raise ValueError(f"no sample has {names[column]}: the samples cannot fit its coefficient")
    rank = np.linalg.matrix_rank(features)
    if rank < features.shape[1]:
        raise ValueError(f"the samples cannot tell the {features.shape[1]} coefficients apart (rank {rank}): "
                         "vary prefill tokens, decode rows and their contexts independently")


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, exactly for few columns: the optimum is the
    unconstrained least-squares solution on its support, so try every support and keep the
    best non-negative solution."""
    columns = a.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(b**2))
    for size in range(1, columns + 1):
        for support in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(a[:, support], b, rcond=None)
            if np.any(solution < 0):
                continue
            x = np.zeros(columns)
            x[list(support)] = solution
            residual = float(np.sum((a @ x - b) ** 2))
            if residual < best_residual:
                best, best_residual = x, residual
    return best


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
