"""What the policy hands on: threshold crossings, decisions, forecasts and their outcomes (the
events the agent records), and the forecast's constants."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from edo_monitor.decide.plans import (
    Plan,
    Refusal,
)
from edo_monitor.decide.trend import Trend
from edo_monitor.errors import ConfigError

if (
    TYPE_CHECKING
):  # the policy itself needs no torch (edo_monitor.hindsight.explain replays offline)
    pass


MODES: tuple[str, ...] = ("auto", "advise", "observe")


#: Steps with readings the forecast's window must hold before any forecast.
FORECAST_MIN_STEPS = 8


#: Largest one-sided p-value of the in-use trend's slope for a forecast (Student's t): the
#: chance a flat, noisy window shows such a slope, paid at every step of every run.
FORECAST_MAX_P_VALUE = 1e-6


#: A forecast is judged false once a reading's step is past its predicted step + this many.
FORECAST_GRACE_STEPS = 2


#: A row cache grows back only when the highest in-use of this many recent steps (since the last
#: applied decision) leaves room for it (:meth:`Policy._maybe_grow`): the look-back a policy
#: starts with.
GROW_LOOKBACK_STEPS = 20

#: A grow undone: pressure (a crossing below the floor) within this many look-backs of an applied
#: ``grow_cache`` doubles the policy's look-back, up to :data:`MAX_GROW_LOOKBACK_STEPS`.
GROW_UNDONE_WITHIN_LOOKBACKS = 4

#: The longest look-back a policy learns (16 doublings' worth of a 20-step one: 320 steps).
MAX_GROW_LOOKBACK_STEPS = 16 * GROW_LOOKBACK_STEPS


#: Reading fields whose per-step trends a forecast reports (bytes per step), besides the total.
FORECAST_CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes")


@dataclass(frozen=True)
class ThresholdCrossing:
    """``free_fraction`` crossed a threshold.

    ``kind`` is ``"below_floor"`` (dropped below ``min_free_fraction``; pressure starts) or
    ``"above_rearm"`` (back at or above ``rearm_free_fraction``; pressure ends).
    """

    kind: Literal["below_floor", "above_rearm"]
    step: int
    time_s: float
    free_fraction: float
    threshold_fraction: float


@dataclass(frozen=True)
class Decision:
    """The action the policy chose. ``mode`` ``"advise"`` means record only, do not apply.

    ``plan`` is what :meth:`edo_monitor.actions.Action.apply` takes. ``reason`` says why: the
    pressure (or the forecast), the plan's reason, and for a lossy decision how it ranked against
    the other lossy plans. ``forecast``: the open :class:`Forecast` a forecast decision acts on
    (``None`` for one taken under pressure or to grow back). ``planning_in_use_bytes``: the in-use
    bytes the plan was sized for when that is not the reading's (the in-use predicted
    ``forecast_steps`` ahead); the agent sizes the action for the larger of it and the latest
    reading's when it applies it.
    """

    action: str
    target: str
    estimated_saving_bytes: int
    reason: str
    step: int
    time_s: float
    free_fraction: float
    mode: Literal["auto", "advise"]
    plan: Plan = field(compare=False, repr=False)
    forecast: Forecast | None = field(default=None, compare=False, repr=False)
    planning_in_use_bytes: int | None = field(default=None, compare=False)
    #: the rungs tried before this one, refused (the reason each gives; recorded with the
    #: decision, so hindsight knows what the live agent could not do)
    passed_over: tuple[Refusal, ...] = field(default=(), compare=False, repr=False)

    @property
    def advisory(self) -> bool:
        """True in ``advise`` mode."""
        return self.mode == "advise"

    @property
    def expected_error(self) -> float | None:
        """The plan's :attr:`~edo_monitor.decide.plans.Plan.expected_error` (``None`` for
        lossless)."""
        return self.plan.expected_error


@dataclass(frozen=True)
class NoActionAvailable:
    """Under pressure (or, with ``forecast=True``, a crossing forecast) but nothing on the ladder
    applies. Reported once per pressure episode (or forecast), and again whenever the refusals
    change other than in their figures (:meth:`key`): a first, passing reason ("no activation
    profile yet") does not stay the recorded one."""

    step: int
    time_s: float
    free_fraction: float
    refusals: tuple[Refusal, ...]
    forecast: bool = False

    def key(self) -> tuple[tuple[str, str, str], ...]:
        """The refusals with every figure (a number, with its byte unit if any) replaced by
        ``#``: equal keys say the same thing about other amounts."""
        return tuple((r.action, r.target, _FIGURE.sub("#", r.reason)) for r in self.refusals)


_FIGURE = re.compile(r"(?<![\w.])-?\d[\d.,]*(?:e[-+]?\d+)?(?:\s*(?:[KMGTP]i?B|B|bytes)\b)?%?")


@dataclass(frozen=True)
class Forecast:
    """Free memory is predicted below the floor within ``forecast_steps`` steps.

    Attributes:
        index: 1 for the policy's first forecast, 2 for the next...; its :class:`ForecastOutcome`
            carries the same forecast.
        step, time_s, free_fraction, in_use_bytes, budget_bytes: the reading it was made on.
        predicted_step: the first step at which the trend puts free memory below
            ``floor_fraction`` (``steps_ahead`` = ``predicted_step - step``, 1 at least).
        slope_bytes_per_step: the least-squares slope of the per-step highest in-use bytes
            (savings of applied actions added back) over the window.
        horizon_in_use_bytes: in-use bytes predicted ``forecast_steps`` ahead, net of the savings
            in force (decisions are sized for it; never below ``in_use_bytes``).
        window_first_step, window_points: the window's first step and how many steps it holds.
        category_slopes: ``(field, bytes per step)`` of each category with a trend over the same
            window (``params_bytes``, ``grads_bytes``, ``optimizer_state_bytes``,
            ``activations_bytes``, as recorded: an action's drop shows as a fall), largest first.
    """

    index: int
    step: int
    time_s: float
    free_fraction: float
    predicted_step: int
    slope_bytes_per_step: float
    in_use_bytes: int
    budget_bytes: int
    floor_fraction: float
    horizon_in_use_bytes: int
    window_first_step: int
    window_points: int
    category_slopes: tuple[tuple[str, float], ...] = ()

    @property
    def steps_ahead(self) -> int:
        """Steps from the reading to the predicted crossing."""
        return self.predicted_step - self.step

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready values (``category_slopes`` as a mapping, ``steps_ahead`` included)."""
        d = dataclasses.asdict(self)
        d["category_slopes"] = dict(self.category_slopes)
        d["steps_ahead"] = self.steps_ahead
        return d


@dataclass(frozen=True)
class ForecastOutcome:
    """Whether a :class:`Forecast` came true.

    Attributes:
        forecast: the forecast judged.
        came_true: ``True`` when free memory, without the actions applied since the forecast
            (``saved_bytes`` added back), went below the floor by the predicted step +
            :data:`FORECAST_GRACE_STEPS` (an earlier crossing counts); ``False`` when a reading
            past that step found it had not; ``None`` when the run ended first
            (:meth:`Policy.end_forecast`).
        step, time_s: the reading it was judged on.
        crossing_step: the step of the first reading with that free memory below the floor
            (``None`` unless it came true).
        saved_bytes: savings of the actions in force since the forecast (what was added back).
    """

    forecast: Forecast
    came_true: bool | None
    step: int
    time_s: float
    crossing_step: int | None
    saved_bytes: int

    @property
    def lead_steps(self) -> int | None:
        """Steps of warning: ``crossing_step - forecast.step`` (``None`` unless it came true)."""
        return None if self.crossing_step is None else self.crossing_step - self.forecast.step


PolicyEvent = ThresholdCrossing | Decision | NoActionAvailable | Forecast | ForecastOutcome


@dataclass
class _Prediction:
    """The forecast's view of one reading (lock held)."""

    trend: Trend
    predicted_step: int | None
    horizon_in_use_bytes: int


def _fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{name}={value!r} is not allowed; expected a number in (0, 1)")
    return float(value)
