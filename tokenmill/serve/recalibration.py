"""Online recalibration: the running server's recent steps, and the step cost model refit
from them (issue 29).

A calibration (`tokenmill simulate calibrate`) holds only for the load it was made at:
under other jobs' load the simulator missed by 17-55% (docs/planning.md). The server times
every step it runs anyway (`StepRecord`), with the features the cost model needs, so it
keeps the last `window` of them and refits on demand:

- **refit**: the linear model `b0 + b1 x prefill + b2 x decode rows + b3 x decode context`
  (planner/costmodel.py's fit: non-negative least squares on relative errors) on the
  recent steps alone, when they tell the terms apart (steps with prefill, with decode
  rows, of varied batch and context);
- **scaled calibration**: the base calibration (when the server found one for its model,
  dtype and threads) times the median of measured / predicted over the recent steps: the
  machine got uniformly slower or faster. Kept when the traffic cannot identify a refit
  (say, only single-stream decodes), or when it fits the recent steps about as well (it
  extrapolates to other batch sizes better than a refit made from narrow traffic).

`model()` answers which was used, on how many steps, and its median relative error on
them. The what-if endpoint (`POST /v1/plan`) simulates a proposed configuration with it.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import StepObserver, StepRecord
from tokenmill.outputs import RequestOutput
from tokenmill.planner.costmodel import StepCostModel, StepFeatures, fit_step_cost_model, relative_errors

WINDOW = 2048  # recent steps kept
MIN_STEPS = 32  # steps before anything is refit
# A refit must beat the scaled calibration's median relative error by this factor to be
# preferred: narrow traffic fits itself well and extrapolates badly.
REFIT_MARGIN = 0.8


class Planner(Protocol):
    """What `POST /v1/plan` runs (the simulator's `SimulatorPlanner`, handed to the server
    by the command line: the server's room does not import the simulator's)."""

    body_schema: dict[str, Any]  # the request body's JSON schema, for the OpenAPI document

    def base_model(self, config: EngineConfig) -> tuple[StepCostModel | None, str]:
        """This machine's stored calibration for the config's model, dtype and threads,
        and where it came from; (None, "") when there is none."""
        ...

    def what_if(self, config: EngineConfig, num_blocks: int, max_model_len: int, cost_model: StepCostModel,
                body: dict[str, Any], cost_source: str = "") -> dict[str, Any]:
        """Simulate the body's load and settings; ValueError for a bad body."""
        ...


@dataclass(frozen=True)
class OnlineModel:
    model: StepCostModel | None
    source: str  # "refit", "scaled calibration", "calibration", or "none"
    steps: int  # recent steps it was judged on
    median_relative_error: float | None  # on those steps
    scale: float | None = None  # scaled calibration: measured / predicted

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "steps": self.steps, "median_relative_error": self.median_relative_error,
                "scale": self.scale, "coefficients": self.model.to_dict() if self.model else None}


class OnlineCalibration(StepObserver):
    """Keeps the engine's recent steps (engine thread) and refits (any thread)."""

    def __init__(self, base: StepCostModel | None = None, window: int = WINDOW, min_steps: int = MIN_STEPS) -> None:
        self.base = base
        self.base_source = ""
        self.min_steps = min_steps
        self.steps: deque[tuple[StepFeatures, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        if record.num_prefill_tokens + record.num_decode_tokens <= 0 or record.duration_s <= 0:
            return
        features = StepFeatures(record.num_prefill_tokens, record.num_decode_tokens,
                                record.num_decode_context_tokens, record.num_prefill_attention_pairs)
        with self._lock:
            self.steps.append((features, record.duration_s))

    def samples(self) -> list[tuple[StepFeatures, float]]:
        with self._lock:
            return list(self.steps)

    def model(self) -> OnlineModel:
        """The step cost model that best explains the recent steps (see the module's doc)."""
        samples = self.samples()
        if len(samples) < self.min_steps:
            if self.base is None:
                return OnlineModel(None, "none", len(samples), None)
            return OnlineModel(self.base, "calibration", len(samples), _median_error(self.base, samples))
        scaled = self._scaled(samples)
        refit = _refit(samples)
        if refit is not None and (scaled is None or refit.median_relative_error
                                  < REFIT_MARGIN * scaled.median_relative_error):
            return refit
        if scaled is not None:
            return scaled
        return OnlineModel(None, "none", len(samples), None)

    def _scaled(self, samples: list[tuple[StepFeatures, float]]) -> OnlineModel | None:
        if self.base is None:
            return None
        scale = statistics.median(seconds / max(self.base.predict(f), 1e-12) for f, seconds in samples)
        model = scale_model(self.base, scale)
        return OnlineModel(model, "scaled calibration", len(samples), _median_error(model, samples), scale)


def scale_model(model: StepCostModel, scale: float) -> StepCostModel:
    """Every term of `model` times `scale` (a uniformly slower or faster machine)."""
    return dataclasses.replace(
        model, intercept_s=model.intercept_s * scale, per_prefill_token_s=model.per_prefill_token_s * scale,
        per_decode_token_s=model.per_decode_token_s * scale, per_context_token_s=model.per_context_token_s * scale,
        per_prefill_pair_s=model.per_prefill_pair_s * scale,
        decode_seconds=tuple(t * scale for t in model.decode_seconds))


def _refit(samples: list[tuple[StepFeatures, float]]) -> OnlineModel | None:
    """The linear model fitted to the samples alone, or None when they cannot tell its
    terms apart."""
    try:
        fit = fit_step_cost_model(samples)
    except ValueError:
        return None
    return OnlineModel(fit.model, "refit", fit.samples, fit.median_relative_error)


def _median_error(model: StepCostModel, samples: list[tuple[StepFeatures, float]]) -> float | None:
    return relative_errors(model, samples)[0] if samples else None
