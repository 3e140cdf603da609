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
in CPU-budget mode, when the reading's reserved-but-unallocated bytes are below
``release_cache_min_bytes``, or when it was the last action applied in this episode (the slack
it returns is then the training's own working set, reserved again by the next steps: on an H200
under a budget it was applied six times in a row while the pressure grew to an out-of-memory
error; another action has to free memory before releasing the cache helps again). Only when
every lossless rung is skipped, and only with ``allow_lossy``, the lossy rungs: every one is
planned, and among the plans that pass the same filters the policy decides the one that saves
the most bytes per unit of expected error (:func:`rank_lossy_plans`:
``estimated_saving_bytes / max(expected_error,`` :data:`EXPECTED_ERROR_FLOOR` ``)``, plans
without an expected error after those with one, ties in ladder order). Only one decision is
pending at a time.

Growing back: in ``"auto"`` mode, when not under pressure and ``free_fraction`` has stayed at or
above ``rearm_free_fraction + grow_margin_fraction`` for ``grow_after_readings`` readings in a row,
the policy decides ``grow_cache`` (a row cache takes rows back, up to the whole table) if it plans.
Calm is judged, and the growth sized, at the highest in-use of the last look-back steps since
the last applied decision, not at the reading alone: a workload whose batches alternate (small,
large) grew the cache back in each small phase, into the next large one's crossing (7
shrink-and-grow round trips in 80 steps of a recommender). The look-back starts at
:data:`GROW_LOOKBACK_STEPS` and doubles (up to :data:`MAX_GROW_LOOKBACK_STEPS`) each time a grow
is undone: pressure within :data:`GROW_UNDONE_WITHIN_LOOKBACKS` look-backs of an applied
``grow_cache``, or the grow refused at the safe point that was to apply it (planned again there,
it found no room: decided on the last calm reading before a heavy step). A load whose phases
outlast the look-back (30 light steps, 30 heavy) otherwise shrank, grew back and shrank again
every period (11 actions in 300 steps where 3 do now: ``benchmarks/policy_loads.py``).

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

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from edo_monitor.checks import whole_number, whole_number_or_none
from edo_monitor.decide.forecast import _Forecasting
from edo_monitor.decide.outcomes import _Outcomes
from edo_monitor.decide.plans import (
    DEFAULT_LOSSLESS_LADDER,
    DEFAULT_LOSSY_LADDER,
    Plan,
    Refusal,
)
from edo_monitor.decide.policy_events import (
    FORECAST_CATEGORIES,
    FORECAST_MIN_STEPS,
    GROW_LOOKBACK_STEPS,
    GROW_UNDONE_WITHIN_LOOKBACKS,
    MAX_GROW_LOOKBACK_STEPS,
    MODES,
    Decision,
    Forecast,
    NoActionAvailable,
    PolicyEvent,
    ThresholdCrossing,
    _fraction,
    _Prediction,
)
from edo_monitor.decide.ranking import (
    Planner,
    _at_in_use,
    _call_hook,
    _known_actions,
    _ranked_reason,
    rank_lossy_plans,
    skip_reason,
)
from edo_monitor.decide.trend import StepSeries, Trend
from edo_monitor.errors import ConfigError
from edo_monitor.probes.readings import Reading
from edo_monitor.units import format_bytes, format_percent_beside, parse_bytes

if (
    TYPE_CHECKING
):  # the policy itself needs no torch (edo_monitor.hindsight.explain replays offline)
    from edo_monitor.actions.base import ActionResult

__all__ = ["Policy"]

logger = logging.getLogger(__name__)

#: the default re-arm level's distance above the floor (free fraction)
REARM_ABOVE_FLOOR = 0.05


class Policy(_Forecasting, _Outcomes):
    """When to act and what to do (see the module docstring).

    Args:
        min_free_fraction: the floor; pressure starts below it. In (0, 1).
        rearm_free_fraction: pressure ends at or above it. In (0, 1), above ``min_free_fraction``;
            ``None`` (default): :data:`REARM_ABOVE_FLOOR` above the floor (0.25 for the default
            floor), or halfway from the floor to 1 when that is nearer.
        cooldown_steps: optimizer steps between two applied decisions (int >= 0).
        mode: ``"auto"``, ``"advise"`` or ``"observe"``.
        allow_lossy: allow lossy actions (``compress_embedding*``, ``share_embedding``).
        ladder: action names in the order to try; default
            :data:`~edo_monitor.decide.plans.DEFAULT_LOSSLESS_LADDER` (``release_cache``,
            ``cache_embedding``, ``spill_embedding``, ``offload_embedding``,
            ``checkpoint_activations``) then, with ``allow_lossy``,
            :data:`~edo_monitor.decide.plans.DEFAULT_LOSSY_LADDER` (``compress_embedding``,
            ``share_embedding``). Lossless rungs are tried in this order; lossy rungs are ranked
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
        rearm_free_fraction: float | None = None,
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
        if rearm_free_fraction is None:  # follows the floor ("keep 30 % free" just works)
            floor = self.min_free_fraction
            rearm_free_fraction = min(floor + REARM_ABOVE_FLOOR, (floor + 1) / 2)
        self.rearm_free_fraction = _fraction("rearm_free_fraction", rearm_free_fraction)
        if self.rearm_free_fraction <= self.min_free_fraction:
            raise ConfigError(
                f"rearm_free_fraction={rearm_free_fraction!r} is not allowed; expected a value "
                f"above min_free_fraction={min_free_fraction!r}"
            )
        self.cooldown_steps = whole_number(cooldown_steps, "cooldown_steps", 0, error=ConfigError)
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
        self.grow_after_readings = whole_number(
            grow_after_readings, "grow_after_readings", 1, error=ConfigError
        )
        self.forecast_steps = whole_number_or_none(
            forecast_steps, "forecast_steps", 1, error=ConfigError
        )
        forecast_window_steps = whole_number(
            forecast_window_steps, "forecast_window_steps", FORECAST_MIN_STEPS, error=ConfigError
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
        self._forecast_none_reported: tuple[tuple[str, str, str], ...] | None = None
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
        #: release_cache was the last action applied in this pressure episode
        self._released_last = False
        #: step -> highest in-use of its readings, for the steps since the last applied
        #: decision within the last grow_lookback_steps
        self._recent_in_use: dict[int, int] = {}
        #: the steps whose highest in-use must leave room for a grow (doubled when one is undone)
        self.grow_lookback_steps = GROW_LOOKBACK_STEPS
        #: the step of the last applied grow_cache not yet undone (``None``: none)
        self._grown_step: int | None = None
        #: the key of the no-action last reported in this episode (``None``: none yet)
        self._reported_none: tuple[tuple[str, str, str], ...] | None = None

    def _check_ladder(self, ladder: Sequence[str] | None) -> tuple[str, ...]:
        if ladder is None:
            return DEFAULT_LOSSLESS_LADDER + (DEFAULT_LOSSY_LADDER if self.allow_lossy else ())
        if isinstance(ladder, str) or not isinstance(ladder, Sequence):
            raise ConfigError(f"ladder={ladder!r} is not allowed; expected a list of action names")
        if not ladder:  # a policy that never acts, silently
            raise ConfigError(
                f"ladder={ladder!r} holds no action; expected at least one action name (to "
                "record crossings without acting: mode='observe')"
            )
        names, lossy = _known_actions()
        known = ", ".join(n for n in names if n != "grow_cache")
        seen: set[str] = set()
        for name in ladder:
            if name == "grow_cache":  # a ladder of it alone was a policy that never saves
                raise ConfigError(
                    "ladder action 'grow_cache' gives memory back to a row cache when memory is "
                    f"calm (the policy decides it itself); expected actions that save: {known}"
                )
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

    def _note_in_use(self, reading: Reading) -> int:
        """Keep each recent step's highest in-use (lock held); returns the highest of the last
        ``grow_lookback_steps`` steps since the last applied decision (0: none known)."""
        if reading.in_use_bytes is None:
            return 0
        recent = self._recent_in_use
        recent[reading.step] = max(recent.get(reading.step, 0), int(reading.in_use_bytes))
        for step in [s for s in recent if s <= reading.step - self.grow_lookback_steps]:
            del recent[step]
        return max(recent.values())

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
            recent_peak = self._note_in_use(reading)
            if not self.under_pressure and free < self.min_free_fraction:
                self.under_pressure = True
                self._advised.clear()
                self._released_last = False
                self._reported_none = None
                self._learn_from_undone_grow(self._grown_step, reading.step)
                self._grown_step = None
                events.append(
                    ThresholdCrossing(
                        "below_floor", reading.step, reading.time_s, free, self.min_free_fraction
                    )
                )
            elif self.under_pressure and free >= self.rearm_free_fraction:
                self.under_pressure = False
                self._ineffective.clear()
                self._released_last = False
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
                grow = self._maybe_grow(reading, planner, prediction, recent_peak)
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
            else:
                none = NoActionAvailable(reading.step, reading.time_s, free, tuple(refusals))
                if none.key() != self._reported_none:
                    self._reported_none = none.key()
                    events.append(none)
        return events

    # ------------------------------------------------------------------ growing back
    def _learn_from_undone_grow(self, grown: int | None, step: int) -> None:
        """At a crossing below the floor at ``step``, or a ``grow_cache`` refused at its safe
        point (lock held): when it comes within :data:`GROW_UNDONE_WITHIN_LOOKBACKS` look-backs
        of the grow decided at step ``grown`` (applied; ``None``: none), the grow was undone by
        the load the look-back could not see: the look-back doubles (at most
        :data:`MAX_GROW_LOOKBACK_STEPS`), so the next grow waits for a calm that long."""
        lookback = self.grow_lookback_steps
        if grown is None or step - grown > GROW_UNDONE_WITHIN_LOOKBACKS * lookback:
            return
        self.grow_lookback_steps = min(2 * lookback, MAX_GROW_LOOKBACK_STEPS)
        if self.grow_lookback_steps != lookback:
            logger.info(
                "the row cache grow decided at step %d was undone at step %d (pressure, or no "
                "room at its safe point): a grow now waits for %d calm steps (was %d)",
                grown,
                step,
                self.grow_lookback_steps,
                lookback,
            )

    def _maybe_grow(
        self,
        reading: Reading,
        planner: Planner | None,
        prediction: _Prediction | None = None,
        recent_peak_bytes: int = 0,
    ) -> Decision | None:
        """A ``grow_cache`` decision after enough calm readings (auto mode, lock held).

        The calm test and the plan use the highest in-use of the recent steps
        (``recent_peak_bytes``) when it is above the reading's; with a growth ``prediction``
        (forecasting), the in-use predicted ``forecast_steps`` ahead when higher still, so a
        cache shrunk ahead of a crossing is not grown back into it."""
        free = now = float(reading.free_fraction or 0.0)
        planning = None
        budget = reading.budget_bytes
        if budget and recent_peak_bytes > (reading.in_use_bytes or 0):
            planning = recent_peak_bytes
        if prediction is not None and budget:
            planning = max(planning or 0, prediction.horizon_in_use_bytes)
        if planning is not None and budget:
            free = min(free, (budget - planning) / budget)
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
                "free "
                + format_percent_beside(free, self.rearm_free_fraction + self.grow_margin_fraction)
                + (
                    ""
                    if planning is None
                    else f" in {self.forecast_steps} steps (trend)"
                    if prediction is not None and planning == prediction.horizon_in_use_bytes
                    else f" at the highest in-use of the last {self.grow_lookback_steps} steps"
                )
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
                return self._decision(reading, plan, plan.reason, refusals), refusals
        lossy: list[Plan] = []
        for name in self.ladder:
            if name in lossy_names:
                plan = self._plan(name, reading, planner, refusals)
                if plan is not None:
                    lossy.append(plan)
        if not lossy:
            return None, refusals
        ranked = rank_lossy_plans(lossy)
        return self._decision(reading, ranked[0], _ranked_reason(ranked), refusals), refusals

    def _plan(
        self, name: str, reading: Reading, planner: Planner, refusals: list[Refusal]
    ) -> Plan | None:
        """Rung ``name``'s plan when it passes the filters (lock held); else its refusal is
        appended to ``refusals`` and ``None`` returned. Filters: ``release_cache``'s skip rules,
        the planner's refusal, then :func:`skip_reason` (a saving of 0 bytes or less, pairs that
        failed, were ineffective or, in advise mode, were advised)."""
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
        advised = self._advised if self.mode == "advise" else None
        why = skip_reason(plan, self._failed, self._ineffective, advised)
        if why is not None:
            refusals.append(Refusal(name, plan.target, why))
            return None
        return plan

    def _decision(
        self, reading: Reading, plan: Plan, why: str, passed_over: Sequence[Refusal] = ()
    ) -> Decision:
        mode: Literal["auto", "advise"] = "advise" if self.mode == "advise" else "auto"
        return Decision(
            action=plan.action,
            target=plan.target,
            estimated_saving_bytes=plan.estimated_saving_bytes,
            reason=(
                f"free {format_percent_beside(reading.free_fraction, self.min_free_fraction)} "
                f"below floor {self.min_free_fraction:.0%}: {why}"
            ),
            step=reading.step,
            time_s=reading.time_s,
            free_fraction=float(reading.free_fraction or 0.0),
            mode=mode,
            plan=plan,
            passed_over=tuple(passed_over),
        )

    def _release_cache_skip(self, reading: Reading) -> str | None:
        if reading.device_kind != "cuda":
            return "not applicable in CPU-budget mode (no allocator cache)"
        if self._released_last:
            return (
                "the last action of this episode already: what it frees now the training "
                "reserves again; another action has to free memory first"
            )
        slack = reading.reserved_unallocated_bytes
        if slack is not None and slack < self.release_cache_min_bytes:
            return (
                f"reserved-but-unallocated {format_bytes(slack)} is below "
                f"{format_bytes(self.release_cache_min_bytes)}"
            )
        return None

    def call_on_pressure(self, crossing: ThresholdCrossing) -> BaseException | None:
        """Call the user's ``on_pressure`` hook; an exception is logged and returned, not raised."""
        return _call_hook("on_pressure", self.on_pressure, crossing)

    def call_on_action(self, result: ActionResult) -> BaseException | None:
        """Call the user's ``on_action`` hook; an exception is logged and returned, not raised."""
        return _call_hook("on_action", self.on_action, result)
