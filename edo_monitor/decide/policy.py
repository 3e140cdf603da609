"""The policy: from readings to threshold crossings and at most one pending decision.

:class:`Policy` is pure: it looks at a :class:`~edo_monitor.probes.readings.Reading` and at plans
for the actions on its ladder (given by the caller, see :func:`make_planner`), and returns events.
It never touches hardware, the model, or threads; the agent applies a :class:`Decision` at the next
step boundary and reports back with :meth:`Policy.resolve`.

Hysteresis: pressure starts when ``free_fraction`` drops below ``min_free_fraction`` (a
``"below_floor"`` crossing) and ends when it is back at or above ``rearm_free_fraction`` (an
``"above_rearm"`` crossing). While under pressure, and not within ``cooldown_steps`` of the last
applied decision, the policy decides the first applicable lossless action of its ladder, skipping
actions that refuse, ``(action, target)`` pairs that failed before, ``(action, target)`` pairs that
were *ineffective* in this pressure episode (applied, but the measured saving was below
:data:`INEFFECTIVE_BELOW_FRACTION` of the estimate; see :meth:`Policy.resolve`), ``release_cache``
in CPU-budget mode or when the reading's reserved-but-unallocated bytes are below
``release_cache_min_bytes``. Only when every lossless rung is skipped, and only with
``allow_lossy``, the lossy rungs: every one is planned, and among the plans that pass the same
filters the policy decides the one that saves the most bytes per unit of expected error
(:func:`rank_lossy_plans`: ``estimated_saving_bytes / max(expected_error,``
:data:`EXPECTED_ERROR_FLOOR` ``)``, plans without an expected error after those with one, ties in
ladder order). Only one decision is pending at a time.

Growing back: in ``"auto"`` mode, when not under pressure and ``free_fraction`` has stayed at or
above ``rearm_free_fraction + grow_margin_fraction`` for ``grow_after_readings`` readings in a row,
the policy decides ``grow_cache`` (a row cache takes rows back, up to the whole table) if it plans.

Forecasting (``forecast_steps=N``; off by default): each reading's in-use bytes, and each step's
peak where the agent measures it at the step boundary (:meth:`Policy.observe_step`), with the
savings of the actions applied so far added back (the workload's own growth, not the policy's
interventions), feed a :class:`~edo_monitor.decide.trend.StepSeries` (one value per step, the step's
highest; from step 1 on: step 0 has no gradients or optimizer state yet) over the last
``forecast_window_steps`` steps. When the least-squares line through it is
steady growth (:meth:`~edo_monitor.decide.trend.Trend.is_growth`: at least
:data:`FORECAST_MIN_STEPS` steps, a slope whose p-value is at most :data:`FORECAST_MAX_P_VALUE`, a
better fit than any single level shift) and
predicts free memory below ``min_free_fraction`` within ``N`` steps (and no farther ahead than the
steps it was fitted over), the policy, not under
pressure, emits a :class:`Forecast` (one open at a time) and decides as under pressure (same
ladder, filters, single pending decision and cooldown) with plans sized for the in-use predicted
``N`` steps ahead (a planner with an ``at_in_use(bytes)`` method is asked for such plans; see
:func:`make_planner`). While a forecast is open it does not grow a row cache back, and while the
trend is growth, growing back is judged (and sized) on the in-use predicted ``N`` steps ahead. The
open forecast is judged by a :class:`ForecastOutcome`: true as soon as free memory **without the
actions applied since the forecast** is below the floor (a real crossing included), false once a
reading's step is past the predicted step + :data:`FORECAST_GRACE_STEPS` without that (the series
then starts afresh, so the same misleading window cannot forecast again at once);
:meth:`Policy.end_forecast` closes one still open when the run ends (``came_true=None``).

Modes: ``"auto"`` decides and expects the agent to apply; ``"advise"`` emits decisions marked
advisory (each ``(action, target)`` once per pressure episode or forecast) that are recorded, not
applied; ``"observe"`` emits crossings (and forecasts) only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from edo_monitor.decide.plans import (
    ACTION_NAMES,
    DEFAULT_LOSSLESS_LADDER,
    DEFAULT_LOSSY_LADDER,
    LOSSY_ACTION_NAMES,
    Plan,
    Refusal,
)
from edo_monitor.decide.trend import StepSeries, Trend, fit_trend
from edo_monitor.errors import ConfigError
from edo_monitor.probes.readings import Reading
from edo_monitor.units import format_bytes, parse_bytes

if (
    TYPE_CHECKING
):  # the policy itself needs no torch (edo_monitor.hindsight.explain replays offline)
    from edo_monitor.actions.base import ActionContext, ActionResult

__all__ = [
    "EXPECTED_ERROR_FLOOR",
    "FORECAST_GRACE_STEPS",
    "FORECAST_MAX_P_VALUE",
    "FORECAST_MIN_STEPS",
    "INEFFECTIVE_BELOW_FRACTION",
    "MODES",
    "Decision",
    "Forecast",
    "ForecastOutcome",
    "NoActionAvailable",
    "Policy",
    "PolicyEvent",
    "ThresholdCrossing",
    "ineffective_reason",
    "lossy_score",
    "make_planner",
    "rank_lossy_plans",
]

logger = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("auto", "advise", "observe")

Planner = Callable[[str], Plan | Refusal] | Mapping[str, Plan | Refusal]

#: Steps with readings the forecast's window must hold before any forecast.
FORECAST_MIN_STEPS = 8
#: Largest one-sided p-value of the in-use trend's slope for a forecast (Student's t): the
#: chance a flat, noisy window shows such a slope, paid at every step of every run.
FORECAST_MAX_P_VALUE = 1e-6
#: A forecast is judged false once a reading's step is past its predicted step + this many.
FORECAST_GRACE_STEPS = 2
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
    applies; once per pressure episode (or forecast)."""

    step: int
    time_s: float
    free_fraction: float
    refusals: tuple[Refusal, ...]
    forecast: bool = False


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


class Policy:
    """When to act and what to do (see the module docstring).

    Args:
        min_free_fraction: the floor; pressure starts below it. In (0, 1).
        rearm_free_fraction: pressure ends at or above it. In (0, 1), above ``min_free_fraction``.
        cooldown_steps: optimizer steps between two applied decisions (int >= 0).
        mode: ``"auto"``, ``"advise"`` or ``"observe"``.
        allow_lossy: allow lossy actions (``compress_embedding*``, ``share_embedding``).
        ladder: action names in the order to try; default lossless
            (``release_cache``, ``cache_embedding``, ``offload_embedding``,
            ``checkpoint_activations``) then, with ``allow_lossy``, ``compress_embedding`` and
            ``share_embedding``. Lossless rungs are tried in this order; lossy rungs are ranked
            (see the module docstring), their order only breaks ties.
        on_pressure: called by the agent with each :class:`ThresholdCrossing` (see
            :meth:`call_on_pressure`).
        on_action: called by the agent with each :class:`~edo_monitor.actions.ActionResult`.
        release_cache_min_bytes: slack below which ``release_cache`` is skipped (int or size
            string such as ``"64MiB"``).
        grow_margin_fraction: free fraction above the re-arm level a row cache leaves when it
            grows back (in [0, 1)).
        grow_after_readings: consecutive readings above ``rearm + margin`` before it grows (>= 1).
        forecast_steps: act when the in-use trend predicts free memory below the floor within
            this many optimizer steps (int >= 1; see the module docstring); ``None`` (default):
            no forecasting, the policy acts only under pressure.
        forecast_window_steps: how many recent steps the trend is fitted over (int >=
            :data:`FORECAST_MIN_STEPS`; default 20).

    Raises:
        ConfigError: (a ``ValueError``) for any value out of its allowed set; the message names
            the value and what is allowed.
    """

    def __init__(
        self,
        min_free_fraction: float = 0.20,
        rearm_free_fraction: float = 0.25,
        cooldown_steps: int = 5,
        mode: str = "auto",
        allow_lossy: bool = False,
        ladder: Sequence[str] | None = None,
        on_pressure: Callable[[ThresholdCrossing], Any] | None = None,
        on_action: Callable[[ActionResult], Any] | None = None,
        release_cache_min_bytes: int | str = 64 * 1024 * 1024,
        grow_margin_fraction: float = 0.05,
        grow_after_readings: int = 3,
        forecast_steps: int | None = None,
        forecast_window_steps: int = 20,
    ) -> None:
        self.min_free_fraction = _fraction("min_free_fraction", min_free_fraction)
        self.rearm_free_fraction = _fraction("rearm_free_fraction", rearm_free_fraction)
        if self.rearm_free_fraction <= self.min_free_fraction:
            raise ConfigError(
                f"rearm_free_fraction={rearm_free_fraction!r} is not allowed; expected a value "
                f"above min_free_fraction={min_free_fraction!r}"
            )
        if (
            isinstance(cooldown_steps, bool)
            or not isinstance(cooldown_steps, int)
            or cooldown_steps < 0
        ):
            raise ConfigError(
                f"cooldown_steps={cooldown_steps!r} is not allowed; expected an int >= 0"
            )
        self.cooldown_steps = cooldown_steps
        if mode not in MODES:
            raise ConfigError(f"mode={mode!r} is not allowed; expected one of {', '.join(MODES)}")
        self.mode = mode
        if not isinstance(allow_lossy, bool):
            raise ConfigError(f"allow_lossy={allow_lossy!r} is not allowed; expected True or False")
        self.allow_lossy = allow_lossy
        self.ladder = self._check_ladder(ladder)
        for name, hook in (("on_pressure", on_pressure), ("on_action", on_action)):
            if hook is not None and not callable(hook):
                raise ConfigError(f"{name}={hook!r} is not allowed; expected a callable or None")
        self.on_pressure = on_pressure
        self.on_action = on_action
        self.release_cache_min_bytes = parse_bytes(
            release_cache_min_bytes, name="release_cache_min_bytes"
        )
        if (
            isinstance(grow_margin_fraction, bool)
            or not isinstance(grow_margin_fraction, (int, float))
            or not 0 <= grow_margin_fraction < 1
        ):
            raise ConfigError(
                f"grow_margin_fraction={grow_margin_fraction!r} is not allowed; expected a number "
                "in [0, 1)"
            )
        self.grow_margin_fraction = float(grow_margin_fraction)
        if (
            isinstance(grow_after_readings, bool)
            or not isinstance(grow_after_readings, int)
            or grow_after_readings < 1
        ):
            raise ConfigError(
                f"grow_after_readings={grow_after_readings!r} is not allowed; expected an int >= 1"
            )
        self.grow_after_readings = grow_after_readings
        if forecast_steps is not None and (
            isinstance(forecast_steps, bool)
            or not isinstance(forecast_steps, int)
            or forecast_steps < 1
        ):
            raise ConfigError(
                f"forecast_steps={forecast_steps!r} is not allowed; expected an int >= 1 or None"
            )
        self.forecast_steps = forecast_steps
        if (
            isinstance(forecast_window_steps, bool)
            or not isinstance(forecast_window_steps, int)
            or forecast_window_steps < FORECAST_MIN_STEPS
        ):
            raise ConfigError(
                f"forecast_window_steps={forecast_window_steps!r} is not allowed; expected an int "
                f">= {FORECAST_MIN_STEPS}"
            )
        self.forecast_window_steps = forecast_window_steps
        # forecasting state (used only with forecast_steps): the in-use series with savings added
        # back, per-category series, savings of applied decisions not yet / already in force
        self._series = StepSeries(forecast_window_steps)
        self._category_series = {c: StepSeries(forecast_window_steps) for c in FORECAST_CATEGORIES}
        self._trend: Trend | None = None
        self._trend_version = -1
        self._saved_pending: list[tuple[int, int]] = []  # (decision step, saving), in force later
        self._saved_in_force = 0
        self._forecast: Forecast | None = None  # the open forecast
        self._forecast_saved_from = 0  # _saved_in_force when it opened
        self._forecast_none_reported = False
        self._forecasts = 0
        self._calm_readings = 0
        self._lock = threading.Lock()
        self.under_pressure = False
        self.pending: Decision | None = None
        self.last_decision_step: int | None = None
        self._failed: set[tuple[str, str]] = set()
        #: (action, target) -> why it was ineffective; cleared when the pressure episode ends
        self._ineffective: dict[tuple[str, str], str] = {}
        self._advised: set[tuple[str, str]] = set()
        self._reported_none = False

    def _check_ladder(self, ladder: Sequence[str] | None) -> tuple[str, ...]:
        if ladder is None:
            return DEFAULT_LOSSLESS_LADDER + (DEFAULT_LOSSY_LADDER if self.allow_lossy else ())
        if isinstance(ladder, str) or not isinstance(ladder, Sequence):
            raise ConfigError(f"ladder={ladder!r} is not allowed; expected a list of action names")
        names, lossy = _known_actions()
        known = ", ".join(names)
        seen: set[str] = set()
        for name in ladder:
            if name not in names:
                raise ConfigError(f"ladder action {name!r} is not known; expected one of {known}")
            if name in seen:
                raise ConfigError(f"ladder action {name!r} appears twice")
            if name in lossy and not self.allow_lossy:
                raise ConfigError(
                    f"ladder action {name!r} is lossy; pass allow_lossy=True to use it"
                )
            seen.add(name)
        return tuple(ladder)

    def __repr__(self) -> str:
        forecast = (
            ""
            if self.forecast_steps is None
            else f", forecast_steps={self.forecast_steps}, "
            f"forecast_window_steps={self.forecast_window_steps}"
        )
        return (
            f"Policy(min_free_fraction={self.min_free_fraction}, "
            f"rearm_free_fraction={self.rearm_free_fraction}, "
            f"cooldown_steps={self.cooldown_steps}, "
            f"mode={self.mode!r}, allow_lossy={self.allow_lossy}, ladder={list(self.ladder)}"
            f"{forecast})"
        )

    def evaluate(self, reading: Reading, planner: Planner | None = None) -> list[PolicyEvent]:
        """Events for one reading: crossings first, then at most one decision (or a no-action).

        Args:
            reading: needs ``free_fraction`` (``None`` gives no events) and ``step``; uses
                ``device_kind`` and ``reserved_unallocated_bytes`` to skip ``release_cache``.
            planner: ``name -> Plan | Refusal`` (a callable, e.g. :func:`make_planner`, or a
                mapping; a name missing from a mapping counts as refused). Called only under
                pressure, in ladder order, until a lossless rung plans; when none does, once for
                every lossy rung. ``None`` = no decisions.

        Returns:
            A list of :class:`ThresholdCrossing`, :class:`ForecastOutcome`, :class:`Forecast`,
            :class:`Decision` and :class:`NoActionAvailable` events, in that order (the forecast
            kinds only with ``forecast_steps``; they also use ``in_use_bytes``,
            ``budget_bytes`` and the category fields).
        """
        free = reading.free_fraction
        if free is None:
            return []
        events: list[PolicyEvent] = []
        with self._lock:
            if not self.under_pressure and free < self.min_free_fraction:
                self.under_pressure = True
                self._advised.clear()
                self._reported_none = False
                events.append(
                    ThresholdCrossing(
                        "below_floor", reading.step, reading.time_s, free, self.min_free_fraction
                    )
                )
            elif self.under_pressure and free >= self.rearm_free_fraction:
                self.under_pressure = False
                self._ineffective.clear()
                events.append(
                    ThresholdCrossing(
                        "above_rearm", reading.step, reading.time_s, free, self.rearm_free_fraction
                    )
                )
            prediction = None
            if self.forecast_steps is not None:
                prediction = self._observe_trend(reading, events)
            if not self.under_pressure:
                if prediction is not None and self._crossing_soon(reading, prediction):
                    self._calm_readings = 0
                    events.extend(self._act_on_forecast(reading, planner, prediction))
                    return events
                if self._forecast is not None:  # never grow back into a forecast crossing
                    self._calm_readings = 0
                    return events
                grow = self._maybe_grow(reading, planner, prediction)
                if grow is not None:
                    events.append(grow)
                return events
            self._calm_readings = 0
            if self.mode == "observe" or planner is None:
                return events
            if self.pending is not None:
                return events
            if (
                self.mode == "auto"
                and self.last_decision_step is not None
                and reading.step - self.last_decision_step < self.cooldown_steps
            ):
                return events
            decision, refusals = self._choose(reading, planner)
            if decision is not None:
                events.append(decision)
                if self.mode == "auto":
                    self.pending = decision
                    self.last_decision_step = reading.step
                else:
                    self._advised.add((decision.action, decision.target))
            elif not self._reported_none:
                self._reported_none = True
                events.append(
                    NoActionAvailable(reading.step, reading.time_s, free, tuple(refusals))
                )
        return events

    # ------------------------------------------------------------------ forecasting
    def _observe_trend(self, reading: Reading, events: list[PolicyEvent]) -> _Prediction | None:
        """Feed the reading to the series, judge the open forecast (its outcome appended to
        ``events``) and predict; ``None`` when the trend is not steady growth (lock held)."""
        in_use, budget = reading.in_use_bytes, reading.budget_bytes
        step = reading.step
        # step 0 is before the first optimizer step: no gradients or optimizer state yet, a level
        # of its own that would only hide the trend
        if in_use is None or not budget or step < 1:
            return None
        self._feed(step, in_use, {name: getattr(reading, name) for name in FORECAST_CATEGORIES})
        if self._forecast is not None:
            saved = self._saved_in_force - self._forecast_saved_from
            if (budget - in_use - saved) / budget < self.min_free_fraction:
                events.append(self._close_forecast(True, reading, saved))
            elif step > self._forecast.predicted_step + FORECAST_GRACE_STEPS:
                events.append(self._close_forecast(False, reading, saved))
                # the window that misled it would forecast again at once: start afresh
                self._series.clear()
        if self._trend_version != self._series.version:
            self._trend_version = self._series.version
            self._trend = fit_trend(self._series.points())
        trend = self._trend
        if trend is None or not trend.is_growth(
            min_points=FORECAST_MIN_STEPS, max_p_value=FORECAST_MAX_P_VALUE
        ):
            return None
        # the series holds in-use + savings in force: so does the floor it is compared with
        floor_bytes = (1 - self.min_free_fraction) * budget + self._saved_in_force
        horizon = trend.at(step + (self.forecast_steps or 0)) - self._saved_in_force
        return _Prediction(
            trend, trend.first_step_above(floor_bytes, step), max(in_use, math.ceil(horizon))
        )

    def _feed(self, step: int, in_use_bytes: int, categories: Mapping[str, int | None]) -> None:
        """One value of ``step`` into the forecast's series, with the savings in force added back
        (lock held)."""
        pending = self._saved_pending
        while pending and pending[0][0] < step:  # applied at the boundary after its step
            self._saved_in_force += pending.pop(0)[1]
        self._series.add(step, in_use_bytes + self._saved_in_force)
        for name, series in self._category_series.items():
            value = categories.get(name)
            if value is not None:
                series.add(step, value)

    def observe_step(
        self, step: int, in_use_bytes: int, categories: Mapping[str, int | None] | None = None
    ) -> None:
        """A step's peak in-use bytes, measured at its boundary, for the forecast's trend.

        The agent calls it at every step boundary (training thread) where it can measure the
        step's peak there (CPU-budget mode: the accounting with gradients alive plus the step's
        peak of saved-tensor bytes, the same sum a reading's ``in_use_bytes`` is), so the trend
        has one value per step however many readings land in a step: with steps faster than the
        sampling interval the readings alone leave steps out, and a window of
        ``forecast_window_steps`` steps could hold fewer than :data:`FORECAST_MIN_STEPS` points.
        Nothing is evaluated here: forecasts and decisions come with the next reading
        (:meth:`evaluate`). Without ``forecast_steps``, and for step 0, it does nothing.

        Args:
            step: the reading's step numbering (steps completed before this boundary counts it).
            in_use_bytes: the step's peak in-use bytes.
            categories: per-category bytes of the step (keys of :data:`FORECAST_CATEGORIES`).
        """
        if self.forecast_steps is None or step < 1:
            return
        with self._lock:
            self._feed(step, in_use_bytes, categories or {})

    def _crossing_soon(self, reading: Reading, prediction: _Prediction) -> bool:
        """The predicted crossing is within ``forecast_steps``, and no farther ahead than the
        steps the trend was fitted over (a line is not extrapolated beyond what it saw)."""
        predicted = prediction.predicted_step
        if predicted is None:
            return False
        ahead = predicted - reading.step
        trend = prediction.trend
        return ahead <= min(self.forecast_steps or 0, trend.last_step - trend.first_step)

    def _close_forecast(
        self, came_true: bool, reading: Reading, saved_bytes: int
    ) -> ForecastOutcome:
        assert self._forecast is not None
        forecast, self._forecast = self._forecast, None
        return ForecastOutcome(
            forecast,
            came_true,
            reading.step,
            reading.time_s,
            reading.step if came_true else None,
            saved_bytes,
        )

    def _act_on_forecast(
        self, reading: Reading, planner: Planner | None, prediction: _Prediction
    ) -> list[PolicyEvent]:
        """The forecast (when none is open) and at most one decision for it (lock held)."""
        events: list[PolicyEvent] = []
        free = float(reading.free_fraction or 0.0)
        predicted = prediction.predicted_step
        assert predicted is not None
        forecast = self._forecast
        if forecast is None:
            self._forecasts += 1
            forecast = Forecast(
                index=self._forecasts,
                step=reading.step,
                time_s=reading.time_s,
                free_fraction=free,
                predicted_step=predicted,
                slope_bytes_per_step=prediction.trend.slope_per_step,
                in_use_bytes=int(reading.in_use_bytes or 0),
                budget_bytes=int(reading.budget_bytes or 0),
                floor_fraction=self.min_free_fraction,
                horizon_in_use_bytes=prediction.horizon_in_use_bytes,
                window_first_step=prediction.trend.first_step,
                window_points=prediction.trend.points,
                category_slopes=self._category_slopes(),
            )
            self._forecast = forecast
            self._forecast_saved_from = self._saved_in_force
            self._forecast_none_reported = False
            self._advised.clear()  # a forecast is an episode of its own for these filters
            self._ineffective.clear()
            events.append(forecast)
        if self.mode == "observe" or planner is None or self.pending is not None:
            return events
        if (
            self.mode == "auto"
            and self.last_decision_step is not None
            and reading.step - self.last_decision_step < self.cooldown_steps
        ):
            return events
        decision, refusals = self._choose(
            reading, _at_in_use(planner, prediction.horizon_in_use_bytes)
        )
        if decision is None:
            if not self._forecast_none_reported:
                self._forecast_none_reported = True
                events.append(
                    NoActionAvailable(
                        reading.step, reading.time_s, free, tuple(refusals), forecast=True
                    )
                )
            return events
        decision = dataclasses.replace(
            decision,
            reason=(
                f"free {free:.1%} now, predicted below the {self.min_free_fraction:.0%} floor in "
                f"{predicted - reading.step} steps (step {predicted}) at "
                f"+{format_bytes(round(prediction.trend.slope_per_step))}/step: "
                # what _decision wrote after its "free x below floor y: " (a lossy plan's
                # ranking included)
                f"{decision.reason.partition(': ')[2] or decision.plan.reason}"
            ),
            forecast=forecast,
            planning_in_use_bytes=prediction.horizon_in_use_bytes,
        )
        events.append(decision)
        if self.mode == "auto":
            self.pending = decision
            self.last_decision_step = reading.step
        else:
            self._advised.add((decision.action, decision.target))
        return events

    def _category_slopes(self) -> tuple[tuple[str, float], ...]:
        slopes = []
        for name, series in self._category_series.items():
            trend = fit_trend(series.points())
            if trend is not None:
                slopes.append((name, trend.slope_per_step))
        return tuple(sorted(slopes, key=lambda ns: -ns[1]))

    def end_forecast(self, step: int, time_s: float) -> ForecastOutcome | None:
        """Close the open forecast, if any, when the run ends before it could be judged.

        Returns:
            A :class:`ForecastOutcome` with ``came_true=None`` (the agent records it as a
            ``forecast_outcome`` event), or ``None`` when no forecast is open.
        """
        with self._lock:
            if self._forecast is None:
                return None
            forecast, self._forecast = self._forecast, None
            saved = self._saved_in_force - self._forecast_saved_from
        return ForecastOutcome(forecast, None, step, time_s, None, saved)

    # ------------------------------------------------------------------ growing back
    def _maybe_grow(
        self, reading: Reading, planner: Planner | None, prediction: _Prediction | None = None
    ) -> Decision | None:
        """A ``grow_cache`` decision after enough calm readings (auto mode, lock held).

        With a growth ``prediction`` (forecasting), the calm test and the plan use the in-use
        predicted ``forecast_steps`` ahead, so a cache shrunk ahead of a crossing is not grown
        back into it."""
        free = now = float(reading.free_fraction or 0.0)
        planning = None
        if prediction is not None and reading.budget_bytes:
            planning = prediction.horizon_in_use_bytes
            free = min(free, (reading.budget_bytes - planning) / reading.budget_bytes)
        if free < self.rearm_free_fraction + self.grow_margin_fraction:
            self._calm_readings = 0
            return None
        self._calm_readings += 1
        if (
            self.mode != "auto"
            or planner is None
            or self.pending is not None
            or self._calm_readings < self.grow_after_readings
            or (
                self.last_decision_step is not None
                and reading.step - self.last_decision_step < self.cooldown_steps
            )
        ):
            return None
        self._calm_readings = 0
        if planning is not None:
            planner = _at_in_use(planner, planning)
        if isinstance(planner, Mapping):
            plan = planner.get("grow_cache", Refusal("grow_cache", "", "not planned"))
        else:
            plan = planner("grow_cache")
        if isinstance(plan, Refusal) or (plan.action, plan.target) in self._failed:
            return None
        decision = Decision(
            action=plan.action,
            target=plan.target,
            estimated_saving_bytes=plan.estimated_saving_bytes,
            reason=(
                f"free {free:.1%}"
                + ("" if planning is None else f" in {self.forecast_steps} steps (trend)")
                + f" above re-arm {self.rearm_free_fraction:.0%} + margin "
                f"{self.grow_margin_fraction:.0%}: {plan.reason}"
            ),
            step=reading.step,
            time_s=reading.time_s,
            free_fraction=now,
            mode="auto",
            plan=plan,
            planning_in_use_bytes=planning,
        )
        self.pending = decision
        self.last_decision_step = reading.step
        return decision

    def _choose(self, reading: Reading, planner: Planner) -> tuple[Decision | None, list[Refusal]]:
        """The decision for a reading under pressure (lock held), or ``None`` and the refusals.

        Lossless rungs in ladder order: the first whose plan passes :meth:`_plan`'s filters wins
        (a lossy rung listed before a lossless one is not planned before it). Only when they are
        all skipped: every lossy rung is planned and the passing plans ranked by
        :func:`rank_lossy_plans`.
        """
        refusals: list[Refusal] = []
        _, lossy_names = _known_actions()
        for name in self.ladder:
            if name in lossy_names:
                continue
            plan = self._plan(name, reading, planner, refusals)
            if plan is not None:
                return self._decision(reading, plan, plan.reason), refusals
        lossy: list[Plan] = []
        for name in self.ladder:
            if name in lossy_names:
                plan = self._plan(name, reading, planner, refusals)
                if plan is not None:
                    lossy.append(plan)
        if not lossy:
            return None, refusals
        ranked = rank_lossy_plans(lossy)
        return self._decision(reading, ranked[0], _ranked_reason(ranked)), refusals

    def _plan(
        self, name: str, reading: Reading, planner: Planner, refusals: list[Refusal]
    ) -> Plan | None:
        """Rung ``name``'s plan when it passes the filters (lock held); else its refusal is
        appended to ``refusals`` and ``None`` returned. Filters: ``release_cache``'s skip rules,
        the planner's refusal, ``(action, target)`` pairs that failed before, that were
        ineffective in this episode, or (advise mode) already advised in it."""
        if name == "release_cache":
            skip = self._release_cache_skip(reading)
            if skip:
                refusals.append(Refusal(name, "allocator", skip))
                return None
        if isinstance(planner, Mapping):
            plan = planner.get(name, Refusal(name, "", "not planned"))
        else:
            plan = planner(name)
        if isinstance(plan, Refusal):
            refusals.append(plan)
            return None
        key = (plan.action, plan.target)
        if key in self._failed:
            refusals.append(Refusal(name, plan.target, "failed before on this target"))
            return None
        if key in self._ineffective:
            refusals.append(
                Refusal(
                    name,
                    plan.target,
                    f"ineffective before in this episode: {self._ineffective[key]}",
                )
            )
            return None
        if self.mode == "advise" and key in self._advised:
            refusals.append(Refusal(name, plan.target, "already advised in this episode"))
            return None
        return plan

    def _decision(self, reading: Reading, plan: Plan, why: str) -> Decision:
        mode: Literal["auto", "advise"] = "advise" if self.mode == "advise" else "auto"
        return Decision(
            action=plan.action,
            target=plan.target,
            estimated_saving_bytes=plan.estimated_saving_bytes,
            reason=(
                f"free {reading.free_fraction:.1%} below floor {self.min_free_fraction:.0%}: {why}"
            ),
            step=reading.step,
            time_s=reading.time_s,
            free_fraction=float(reading.free_fraction or 0.0),
            mode=mode,
            plan=plan,
        )

    def _release_cache_skip(self, reading: Reading) -> str | None:
        if reading.device_kind != "cuda":
            return "not applicable in CPU-budget mode (no allocator cache)"
        slack = reading.reserved_unallocated_bytes
        if slack is not None and slack < self.release_cache_min_bytes:
            return (
                f"reserved-but-unallocated {format_bytes(slack)} is below "
                f"{format_bytes(self.release_cache_min_bytes)}"
            )
        return None

    def resolve(self, decision: Decision, status: str | ActionResult) -> str | None:
        """Report what became of a pending decision (training thread, after ``apply``).

        Args:
            decision: the :class:`Decision` returned by :meth:`evaluate`.
            status: the :class:`~edo_monitor.actions.ActionResult` (or only its ``status``, when
                the estimate stands for the saving, as in a replay):
                ``"applied"`` (the cooldown starts at the decision's step), ``"refused"`` (no
                cooldown charged; the next reading may try the next rung) or ``"failed"`` (also
                never tried on the same target again). An applied result whose measured saving
                is below :data:`INEFFECTIVE_BELOW_FRACTION` of its estimate is *ineffective*:
                that ``(action, target)`` is skipped until the pressure episode ends, and no
                cooldown is charged, so the next reading climbs to the next rung.
                ``"expired"``: never applied, the run ended before a step boundary (no cooldown).

        Returns:
            For an ineffective result, one line saying why (the agent records it as an
            ``action_ineffective`` event); else ``None``.
        """
        result = None if isinstance(status, str) else status  # an ActionResult (torch-free check)
        state = result.status if result is not None else status
        why = None
        if result is not None and state == "applied":
            why = ineffective_reason(result)
        with self._lock:
            if self.pending is decision or self.pending == decision:
                self.pending = None
            if state != "applied" or why is not None:
                self.last_decision_step = None
            if state == "failed":
                self._failed.add((decision.action, decision.target))
            if why is not None:
                self._ineffective[(decision.action, decision.target)] = why
            if state == "applied" and self.forecast_steps is not None:
                # in force from the readings of the next step on (applied at the step boundary)
                saved = (
                    result.saved_bytes if result is not None else decision.estimated_saving_bytes
                )
                self._saved_pending.append((decision.step, int(saved)))
        if why is not None:
            logger.info("%s on %s was ineffective: %s", decision.action, decision.target, why)
        return why

    def call_on_pressure(self, crossing: ThresholdCrossing) -> BaseException | None:
        """Call the user's ``on_pressure`` hook; an exception is logged and returned, not raised."""
        return _call_hook("on_pressure", self.on_pressure, crossing)

    def call_on_action(self, result: ActionResult) -> BaseException | None:
        """Call the user's ``on_action`` hook; an exception is logged and returned, not raised."""
        return _call_hook("on_action", self.on_action, result)


#: An applied action whose measured saving is below this fraction of its estimate is
#: ineffective for its target (e.g. ``release_cache`` when ``empty_cache()`` freed next to nothing).
INEFFECTIVE_BELOW_FRACTION = 0.5


def ineffective_reason(result: ActionResult) -> str | None:
    """Why an applied ``result`` counts as ineffective, or ``None`` when it is not.

    Ineffective: a positive estimate and a measured saving (``bytes_before - bytes_after``) below
    :data:`INEFFECTIVE_BELOW_FRACTION` of it. A result whose ``bytes_after`` is itself an
    estimate (``details["after_is_estimate"]``) is never judged.
    """
    if result.status != "applied" or result.details.get("after_is_estimate"):
        return None
    estimate = result.estimated_saving_bytes
    if estimate <= 0 or result.saved_bytes >= INEFFECTIVE_BELOW_FRACTION * estimate:
        return None
    return (
        f"measured saving {format_bytes(max(result.saved_bytes, 0))} is below "
        f"{INEFFECTIVE_BELOW_FRACTION:.0%} of the estimated {format_bytes(estimate)}"
    )


#: Expected errors below this count as this in :func:`rank_lossy_plans`: a plan estimated exact
#: (``expected_error == 0``, e.g. sharing a table whose cold rows are all equal) does not divide by
#: zero, and errors this small (float32's own rounding of a row is about 1e-15) rank by saving
#: alone. It is far below the smallest lossy estimate in use (fp16: about 3.7e-8).
EXPECTED_ERROR_FLOOR = 1e-12


def lossy_score(plan: Plan) -> float | None:
    """``estimated_saving_bytes / max(expected_error, EXPECTED_ERROR_FLOOR)``: bytes saved per unit
    of expected relative squared error (see :attr:`edo_monitor.decide.plans.Plan.expected_error`);
    ``None`` when the plan has no expected error."""
    if plan.expected_error is None:
        return None
    return plan.estimated_saving_bytes / max(float(plan.expected_error), EXPECTED_ERROR_FLOOR)


def rank_lossy_plans(plans: Sequence[Plan]) -> list[Plan]:
    """Lossy plans best first: those with an expected error by :func:`lossy_score`, highest
    first, then those without one; ties (equal scores, or no score) keep the given (ladder)
    order. Deterministic: a stable sort of the given order.

    Args:
        plans: the plans, in ladder order.

    Returns:
        A new list of the same plans.
    """
    order = {id(p): i for i, p in enumerate(plans)}

    def key(plan: Plan) -> tuple[int, float, int]:
        score = lossy_score(plan)
        return (score is None, -(score or 0.0), order[id(plan)])

    return sorted(plans, key=key)


def _error_text(plan: Plan) -> str:
    return "unknown" if plan.expected_error is None else f"{plan.expected_error:.2g}"


def _ranked_reason(ranked: Sequence[Plan]) -> str:
    """Why the first of ``ranked`` won: its saving and expected error, and the runner-up's."""
    best = ranked[0]
    if len(ranked) == 1:
        return f"{best.reason}; the only lossy plan (expected error {_error_text(best)})"
    second = ranked[1]
    return (
        f"{best.reason}; best of {len(ranked)} lossy plans by saving per unit of expected "
        f"error: {format_bytes(best.estimated_saving_bytes)} at {_error_text(best)}, runner-up "
        f"{second.action} on {second.target or '-'} "
        f"{format_bytes(second.estimated_saving_bytes)} at {_error_text(second)}"
    )


def _call_hook(name: str, hook: Callable[[Any], Any] | None, arg: Any) -> BaseException | None:
    if hook is None:
        return None
    try:
        hook(arg)
    except Exception as exc:
        logger.exception("user hook %s raised; training goes on", name)
        return exc
    return None


def _known_actions() -> tuple[tuple[str, ...], frozenset[str]]:
    """(every action name, the lossy ones): the built-in actions, plus any registered in
    ``edo_monitor.actions.ACTIONS`` when that registry is loaded (it imports torch; a policy made
    for ``replay`` does not need it)."""
    registry = sys.modules.get("edo_monitor.actions.registry")
    if registry is None:
        return ACTION_NAMES, LOSSY_ACTION_NAMES
    extra = tuple(n for n in registry.ACTIONS if n not in ACTION_NAMES)
    lossy = LOSSY_ACTION_NAMES | {n for n in extra if registry.ACTIONS[n].lossy}
    return ACTION_NAMES + extra, frozenset(lossy)


def _at_in_use(planner: Planner, in_use_bytes: int) -> Planner:
    """``planner.at_in_use(in_use_bytes)`` when it has that method (plans sized for that in-use),
    else ``planner`` itself (a mapping's plans are what they are)."""
    at = getattr(planner, "at_in_use", None)
    return at(in_use_bytes) if callable(at) else planner


class ContextPlanner:
    """A planner for :meth:`Policy.evaluate` that asks ``ACTIONS[name].plan(ctx)`` (see
    :func:`make_planner`)."""

    def __init__(self, ctx: ActionContext) -> None:
        self.ctx = ctx

    def __call__(self, name: str) -> Plan | Refusal:
        """The action's plan, or a :class:`Refusal` (an exception while planning included)."""
        from edo_monitor.actions.registry import ACTIONS

        try:
            return ACTIONS[name].plan(self.ctx)
        except Exception as exc:
            logger.exception("planning %s failed", name)
            return Refusal(name, "", f"planning failed: {type(exc).__name__}: {exc}")

    def at_in_use(self, in_use_bytes: int) -> ContextPlanner:
        """The same planner with the context's ``in_use_bytes`` replaced (forecast decisions are
        sized for the in-use predicted ``forecast_steps`` ahead)."""
        return ContextPlanner(dataclasses.replace(self.ctx, in_use_bytes=in_use_bytes))


def make_planner(ctx: ActionContext) -> ContextPlanner:
    """A planner for :meth:`Policy.evaluate` that asks ``ACTIONS[name].plan(ctx)``.

    An exception while planning becomes a :class:`~edo_monitor.actions.Refusal` whose reason names
    it (the agent must never fail training because of a plan). Its ``at_in_use(bytes)`` gives the
    same planner for another in-use (what a forecast decision is sized for).
    """
    return ContextPlanner(ctx)
