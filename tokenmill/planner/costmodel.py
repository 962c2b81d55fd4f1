"""A step-time cost model fitted to measured steps, for the serving simulator (issue 16).

BLIS's black-box step model (inference-sim), with Vidur's decode-attention term:

    seconds = b0 + b1 x prefill tokens + b2 x decode tokens + b3 x sum of decode contexts

b0 is what every step pays (reading the weights once, launching, scheduling); b1 and b2
the per-token cost of prefill and decode rows (their GEMM rows, the LM head); b3 the KV
reads of decode attention, proportional to the tokens each decode row attends to. On a
CPU a step is close to linear in these (weights are read once per step, compute grows with
tokens), so four coefficients go far; add Vidur's prefill term (sum of squared chunk
lengths) if the fit misses by more than the 15% the simulator is held to.

The fit is non-negative least squares on relative errors (a 2 ms step weighs as much as a
2 s one), solved exactly for four coefficients by trying every support. Torch-free.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

COEFFICIENTS = ("intercept_s", "per_prefill_token_s", "per_decode_token_s", "per_context_token_s")


@dataclass(frozen=True)
class StepFeatures:
    """What a step's time depends on in this model."""

    prefill_tokens: int  # uncached prompt tokens computed in the step (all chunks)
    decode_tokens: int  # decode rows (one token each)
    decode_context: int  # sum over decode rows of the tokens each attends to

    def vector(self) -> list[float]:
        return [1.0, float(self.prefill_tokens), float(self.decode_tokens), float(self.decode_context)]


@dataclass(frozen=True)
class StepCostModel:
    intercept_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float

    def predict(self, step: StepFeatures) -> float:
        """b0 + b1 x prefill tokens + b2 x decode tokens + b3 x sum of decode contexts."""
        return (self.intercept_s + self.per_prefill_token_s * step.prefill_tokens
                + self.per_decode_token_s * step.decode_tokens + self.per_context_token_s * step.decode_context)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> StepCostModel:
        missing = [name for name in COEFFICIENTS if name not in data]
        if missing:
            raise ValueError(f"a step cost model needs {', '.join(COEFFICIENTS)}; missing {', '.join(missing)}")
        return cls(**{name: float(data[name]) for name in COEFFICIENTS})


@dataclass(frozen=True)
class Fit:
    model: StepCostModel
    samples: int
    median_relative_error: float  # |predicted - measured| / measured
    max_relative_error: float


def fit_step_cost_model(samples: Sequence[tuple[StepFeatures, float]]) -> Fit:
    """Fit the four coefficients to (features, measured seconds) samples: minimize
    sum(((predicted - measured) / measured)^2) subject to every coefficient >= 0."""
    if len(samples) < len(COEFFICIENTS):
        raise ValueError(f"fitting {len(COEFFICIENTS)} coefficients needs at least {len(COEFFICIENTS)} samples, "
                         f"got {len(samples)}")
    seconds = np.array([measured for _, measured in samples], dtype=np.float64)
    if not np.all(np.isfinite(seconds)) or np.any(seconds <= 0):
        raise ValueError("measured step times must be positive and finite")
    features = np.array([step.vector() for step, _ in samples], dtype=np.float64)
    _check_identifiable(features)
    # Relative errors: divide each row by its measured time; the target becomes all ones.
    weighted, target = features / seconds[:, None], np.ones(len(samples))
    coefficients = _nonnegative_least_squares(weighted, target)
    model = StepCostModel(*(float(c) for c in coefficients))
    errors = [abs(model.predict(step) - measured) / measured for step, measured in samples]
    return Fit(model, len(samples), statistics.median(errors), max(errors))


def _check_identifiable(features: np.ndarray) -> None:
    """Every coefficient must be told apart from the others by the samples."""
    names = ("a constant", "prefill tokens", "decode tokens", "decode contexts")
    for column, name in enumerate(names[1:], start=1):
        if not np.any(features[:, column]):
            raise ValueError(f"no sample has {name}: the samples cannot fit its coefficient")
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
