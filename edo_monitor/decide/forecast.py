"""The policy's forecasting: a trend over the steps' in-use bytes, a forecast crossing acted on
before it happens, and its outcome judged."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from edo_monitor.decide.policy_events import (
    FORECAST_CATEGORIES,
    FORECAST_GRACE_STEPS,
    FORECAST_MAX_P_VALUE,
    FORECAST_MIN_STEPS,
    Forecast,
    ForecastOutcome,
    NoActionAvailable,
    PolicyEvent,
    _Prediction,
)
from edo_monitor.decide.ranking import (
    Planner,
    _at_in_use,
)
from edo_monitor.decide.trend import fit_trend
from edo_monitor.probes.readings import Reading
from edo_monitor.units import format_bytes


class _Forecasting:
    """The policy's forecasting: a trend over the steps' in-use bytes, a forecast crossing acted
    on before it happens, and its outcome judged (mixed into
    :class:`~edo_monitor.decide.policy.Policy`, whose state it reads and changes under its lock)."""

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
            self._forecast_none_reported = None
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
            none = NoActionAvailable(
                reading.step, reading.time_s, free, tuple(refusals), forecast=True
            )
            if none.key() != self._forecast_none_reported:
                self._forecast_none_reported = none.key()
                events.append(none)
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
