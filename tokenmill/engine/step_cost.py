"""What a step costs, learned from the engine's own steps (SLO-aware scheduling).

seconds ~ b0 + b1 x prefill tokens + b2 x decode tokens: the first three terms of the
simulator's step cost model (`planner/costmodel.py`, which the engine may not import),
fitted by least squares with non-negative coefficients over the last `window` steps the
engine ran. It measures the step as the server's loop sees it (schedule, execute,
process), on whatever load the machine has now, so it follows the machine; the simulator
runs the same engine, so there it learns the simulated cost model. Pure Python.
"""

from __future__ import annotations

from collections import deque

FEATURES = 3  # 1, prefill tokens, decode tokens


class StepCostEstimator:
    def __init__(self, window: int = 512, min_samples: int = 8) -> None:
        self.window = window
        self.min_samples = min_samples
        self.samples: deque[tuple[tuple[float, float, float], float]] = deque()
        # The normal equations of the relative-error fit, summed over the window (kept
        # up to date as samples come and go, so a fit costs the same at any window).
        self._gram = [[0.0] * FEATURES for _ in range(FEATURES)]
        self._moment = [0.0] * FEATURES
        self._with = [0, 0]  # samples with prefill tokens, with decode tokens
        self._coefficients: tuple[float, float, float] | None = None
        self._stale = True

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        if seconds <= 0 or prefill_tokens + decode_tokens <= 0:
            return
        sample = ((1.0, float(prefill_tokens), float(decode_tokens)), seconds)
        self.samples.append(sample)
        self._account(sample, +1)
        if len(self.samples) > self.window:
            self._account(self.samples.popleft(), -1)
        self._stale = True

    def _account(self, sample: tuple[tuple[float, float, float], float], sign: int) -> None:
        x, seconds = sample
        row = [v / seconds for v in x]
        for r in range(FEATURES):
            self._moment[r] += sign * row[r]
            for c in range(FEATURES):
                self._gram[r][c] += sign * row[r] * row[c]
        self._with[0] += sign * (x[1] > 0)
        self._with[1] += sign * (x[2] > 0)

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(b0, b1, b2), or None until the samples determine them: enough steps, and both
        steps with prefill tokens and steps with decode tokens among them."""
        if self._stale:
            self._coefficients = self._fit()
            self._stale = False
        return self._coefficients

    @property
    def last_seconds(self) -> float | None:
        """The latest step's measured seconds."""
        return self.samples[-1][1] if self.samples else None

    def predict(self, prefill_tokens: int, decode_tokens: int) -> float | None:
        b = self.coefficients
        return None if b is None else b[0] + b[1] * prefill_tokens + b[2] * decode_tokens

    def max_prefill_tokens(self, decode_tokens: int, seconds: float) -> int | None:
        """The most prefill tokens a step with `decode_tokens` decode rows may compute and
        still take at most `seconds` (0 if even none would not); None: not known yet, or
        prefill tokens cost nothing measurable."""
        b = self.coefficients
        if b is None or b[1] <= 0:
            return None
        tokens = (seconds - b[0] - b[2] * decode_tokens) / b[1] + 1e-9
        if tokens != tokens or tokens == float("inf"):
            # a target so loose that the quotient overflows (slo_tpot_ms=1e308 was an
            # OverflowError on the engine thread: the server died): no limit
            return None
        return max(int(tokens), 0) if tokens > 0 else 0

    # ----- the fit ---------------------------------------------------------------------

    def _fit(self) -> tuple[float, float, float] | None:
        if len(self.samples) < self.min_samples or min(self._with) == 0:
            return None
        # Least squares on relative errors (a 2 ms step weighs as much as a 2 s one), with
        # the active set of non-negative least squares done by hand: a coefficient that
        # comes out negative is fixed at 0 and the rest refitted. When the samples cannot
        # tell terms apart (every step had the same decode rows), the decode term goes
        # first, then the prefill term: a cruder model beats none.
        active = list(range(FEATURES))
        while active:
            solution = self._solve(active)
            if solution is None:
                droppable = [i for i in (2, 1) if i in active]
                if not droppable:
                    return None
                active.remove(droppable[0])
                continue
            negative = [i for i, value in zip(active, solution) if value < 0]
            if not negative:
                b = [0.0] * FEATURES
                for i, value in zip(active, solution):
                    b[i] = value
                return (b[0], b[1], b[2])
            active.remove(min(negative, key=lambda i: solution[active.index(i)]))
        return None

    def _solve(self, active: list[int]) -> list[float] | None:
        a = [[self._gram[r][c] for c in active] for r in active]
        return _gauss(a, [self._moment[r] for r in active])


class ForecastError:
    """How far the waits SLO mode forecasts run over, learned from the requests it judged
    on time: each forecast (seconds until the first token, made when the request was
    first judged) against the wait it had. The scheduler stretches its forecasts by the
    `quantile` of actual / forecast over the last `window` of them, forgetting those older
    than `max_age` seconds. The step cost is fitted per step, but a queue's wait is many
    steps on a shared machine, plus what the forecast leaves out (slots freed later than
    predicted, the saved time the TPOT rule spends): a request forecast on time by a small
    margin then ends just past its target. Forgetting matters: a request judged late
    teaches nothing, so a stretch that judges every request late would never learn again."""

    def __init__(self, window: int = 64, quantile: float = 0.9, min_samples: int = 16,
                 max_age: float = 30.0, bounds: tuple[float, float] = (0.5, 2.0)) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)  # (when, actual / forecast)
        self.quantile = quantile
        self.min_samples = min_samples
        self.max_age = max_age
        self.bounds = bounds

    @property
    def ratios(self) -> list[float]:
        return [ratio for _, ratio in self.samples]

    def observe(self, forecast: float, actual: float, now: float) -> None:
        if forecast > 0 and actual >= 0:
            self.samples.append((now, actual / forecast))

    def factor(self, now: float) -> float:
        """What to multiply a forecast by (1 until enough recent forecasts are known)."""
        while self.samples and now - self.samples[0][0] > self.max_age:
            self.samples.popleft()
        if len(self.samples) < self.min_samples:
            return 1.0
        ordered = sorted(self.ratios)
        ratio = ordered[min(int(self.quantile * len(ordered)), len(ordered) - 1)]
        return min(max(ratio, self.bounds[0]), self.bounds[1])


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a x = b (a small symmetric system) by elimination with partial pivoting;
    None when it is singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, abs(m[col][col])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
