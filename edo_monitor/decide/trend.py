"""Per-step trends of memory: the machinery shared by ``leak_suspected`` and the policy's forecast.

Pure arithmetic, no torch. Readings come at the sampler's pace, not the training loop's: a step
may have several readings (in-use bytes rise in forward and fall in backward: a sawtooth inside
the step) or none (steps faster than the sampling interval). :class:`StepSeries` keeps **one value
per step, the step's highest**, for the last ``window_steps`` steps, so a sawtooth inside a step
never shows as a trend and a step without readings is simply a gap.

:func:`fit_trend` fits a least-squares line through those points (x: step, y: value) and measures
what tells a trend from noise or from a one-off jump (:meth:`Trend.is_growth`):

* the slope's t statistic, ``slope / standard error`` (infinite for points exactly on a line),
  and its one-sided p-value under Student's t with ``points - 2`` degrees of freedom (the chance
  that noise around a flat level gives a slope this steep): a fixed t threshold lets short
  windows, whose t has heavy tails, through far more often than long ones;
* the residual sum of squares of the line against that of the best **level shift** (two flat
  levels with one change point between two steps). A jump followed by a flat stretch (optimizer
  state created on the first step, a bigger batch bucket, a row cache that grew once) is fitted
  exactly by a level shift and only roughly by a line; extrapolating it would forecast a crossing
  that never comes. Steady growth is fitted better by the line.

Why least squares and not Theil–Sen: the median of pairwise slopes is robust to a few wild points,
but one value per step (the step's highest) already removes the sawtooth, and the level-shift test
handles the one-off jump that least squares alone would extrapolate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from edo_monitor.checks import whole_number
from edo_monitor.errors import ConfigError

__all__ = ["StepSeries", "Trend", "fit_trend", "student_t_tail"]


class StepSeries:
    """One value per step (the highest seen for that step), over the last ``window_steps`` steps.

    Points whose step is more than ``window_steps`` before the newest are dropped, so the series
    holds at most ``window_steps + 1`` points (consecutive steps). A value for a step older than
    the newest is ignored (steps only go forward; a late reading of a finished step changes
    nothing).

    Raises:
        ConfigError: ``window_steps`` not an int >= 1.
    """

    def __init__(self, window_steps: int) -> None:
        self.window_steps = whole_number(window_steps, "window_steps", 1, error=ConfigError)
        self._points: deque[list[float]] = deque()
        #: bumped whenever the points change (callers cache fits on it)
        self.version = 0

    def add(self, step: int, value: float) -> bool:
        """Record ``value`` at ``step``; returns whether the series changed."""
        points = self._points
        if points and step < points[-1][0]:
            return False
        if points and step == points[-1][0]:
            if value <= points[-1][1]:
                return False
            points[-1][1] = value
        else:
            points.append([step, value])
            oldest = step - self.window_steps
            while points[0][0] < oldest:
                points.popleft()
        self.version += 1
        return True

    def points(self) -> list[tuple[int, float]]:
        """``(step, value)`` pairs, oldest first."""
        return [(int(s), v) for s, v in self._points]

    def clear(self) -> None:
        """Forget every point."""
        self._points.clear()
        self.version += 1

    def __len__(self) -> int:
        return len(self._points)


@dataclass(frozen=True)
class Trend:
    """A least-squares line through one value per step.

    Attributes:
        slope_per_step: units of the values (bytes) per step.
        intercept: the line's value at step 0: ``value(step) = intercept + slope_per_step * step``.
        slope_stderr: the slope's standard error (0 when the points lie on the line).
        points: how many points (steps) were fitted; ``first_step``, ``last_step``: their range.
        line_sse: residual sum of squares of the line.
        shift_sse: residual sum of squares of the best level shift (two flat levels, one change
            point between two consecutive points).
    """

    slope_per_step: float
    intercept: float
    slope_stderr: float
    points: int
    first_step: int
    last_step: int
    line_sse: float
    shift_sse: float

    def at(self, step: float) -> float:
        """The line's value at ``step``."""
        return self.intercept + self.slope_per_step * step

    @property
    def p_value(self) -> float:
        """One-sided p-value of the slope (Student's t, ``points - 2`` degrees of freedom):
        ``P(T >= t_statistic)``; 0 for points exactly on a rising line, 1 for a flat or falling
        one."""
        return student_t_tail(self.t_statistic, self.points - 2)

    @property
    def t_statistic(self) -> float:
        """``slope / standard error``; ``inf`` (or ``-inf``, ``0``) when the error is 0."""
        if self.slope_stderr > 0:
            return self.slope_per_step / self.slope_stderr
        if self.slope_per_step == 0:
            return 0.0
        return math.copysign(math.inf, self.slope_per_step)

    def is_growth(self, *, min_points: int, max_p_value: float) -> bool:
        """Steady growth worth extrapolating: at least ``min_points`` points, a positive slope
        with ``p_value <= max_p_value``, and a line that fits better than any level shift."""
        return (
            self.points >= min_points
            and self.slope_per_step > 0
            and self.line_sse < self.shift_sse
            and self.p_value <= max_p_value
        )

    def first_step_above(self, limit: float, after_step: int) -> int | None:
        """The first integer step ``> after_step`` at which the line is above ``limit``, or
        ``None`` when it never is (slope <= 0 and the line at ``after_step`` not above it)."""
        now = self.at(after_step)
        if now > limit:
            return after_step + 1
        if self.slope_per_step <= 0:
            return None
        return after_step + math.floor((limit - now) / self.slope_per_step) + 1


def student_t_tail(t: float, df: int) -> float:
    """``P(T >= t)`` for Student's t with ``df`` (>= 1) degrees of freedom.

    Through the regularized incomplete beta function, ``P(T >= t) = I_x(df/2, 1/2) / 2`` with
    ``x = df / (df + t^2)`` for ``t > 0`` (its continued fraction as in Numerical Recipes,
    ``betacf``). Exact to about 1e-14 relative for the degrees of freedom a window has.

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"df={df!r}: Student's t needs at least 1 degree of freedom")
    if math.isnan(t):
        return 1.0
    if t == math.inf:
        return 0.0
    if t <= 0:
        return 1.0 - student_t_tail(-t, df) if t < 0 else 0.5
    x = df / (df + t * t)
    return 0.5 * _incomplete_beta(df / 2, 0.5, x)


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``0 <= x <= 1``."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1) / (a + b + 2):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1 - x) / b


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for numerator in (
            m * (b - m) * x / ((a - 1 + m2) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + 1 + m2)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def fit_trend(points: Sequence[tuple[int, float]]) -> Trend | None:
    """Least-squares line and level-shift comparison through ``(step, value)`` points (steps
    increasing, e.g. :meth:`StepSeries.points`); ``None`` with fewer than 3 points.

    Values are centred on their mean before any sum of squares (byte counts of 10^10 squared
    would lose the small differences that matter).
    """
    n = len(points)
    if n < 3:
        return None
    xs = [float(s) for s, _ in points]
    mean_x = sum(xs) / n
    mean_y = sum(v for _, v in points) / n
    ys = [v - mean_y for _, v in points]
    dx = [x - mean_x for x in xs]
    sxx = sum(d * d for d in dx)
    if sxx == 0:
        return None
    slope = sum(d * y for d, y in zip(dx, ys, strict=True)) / sxx
    line_sse = sum((y - slope * d) ** 2 for d, y in zip(dx, ys, strict=True))
    stderr = math.sqrt(line_sse / (n - 2) / sxx)
    # best level shift: prefix sums of the centred values and their squares
    total = sum(ys)
    total_sq = sum(y * y for y in ys)
    shift_sse = math.inf
    left = left_sq = 0.0
    for k in range(1, n):
        left += ys[k - 1]
        left_sq += ys[k - 1] ** 2
        right, right_sq = total - left, total_sq - left_sq
        sse = (left_sq - left * left / k) + (right_sq - right * right / (n - k))
        shift_sse = min(shift_sse, max(0.0, sse))
    return Trend(
        slope_per_step=slope,
        intercept=mean_y - slope * mean_x,
        slope_stderr=stderr,
        points=n,
        first_step=int(points[0][0]),
        last_step=int(points[-1][0]),
        line_sse=line_sse,
        shift_sse=shift_sse,
    )
