"""The tuner's bridge between the policy and the actions: :class:`Tuner`.

On the sampler thread each reading goes through :meth:`Policy.evaluate` with a planner over the
live model (:func:`edo_monitor.decide.policy.make_planner`); what comes back — threshold crossings,
forecasts and their outcomes, at most one pending :class:`Decision`, or "no action available" —
becomes events, and crossings wait for the training thread's ``on_pressure`` hooks. At the safe
point, on the training thread, the pending decision is applied (``Action.apply`` inside its
``Transaction``), resolved with the policy (``Policy.resolve``: ineffective actions are skipped
until the pressure episode ends) and recorded as ``action`` / ``action_refused`` /
``action_failed``; the model is accounted again right away, so the next readings see it as it is.
A decision the run ends before applying is recorded as ``decision_expired``.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from edo_monitor.actions.activation_profile import ActivationProfile
from edo_monitor.actions.base import ActionContext, ActionResult
from edo_monitor.actions.registry import ACTIONS
from edo_monitor.agent.ranks import uncoordinated_blocker
from edo_monitor.decide.policy import Policy
from edo_monitor.decide.policy_events import Decision, Forecast, ForecastOutcome, ThresholdCrossing
from edo_monitor.decide.ranking import make_planner
from edo_monitor.nn import CachedTable
from edo_monitor.nn.cache_grads import report_direct_grads
from edo_monitor.probes.readings import Reading
from edo_monitor.units import format_bytes, format_percent_beside

if TYPE_CHECKING:
    from edo_monitor.agent.state import MonitorState

__all__ = ["Tuner"]

logger = logging.getLogger(__name__)


class Tuner:
    """Policy evaluation (sampler thread) and decisions applied (training thread).

    Args:
        monitor: the run (read: model, optimizers, policy, latest reading, activation profile,
            lookup counter; after an applied action: the tracker and the safe point's
            accounting are refreshed).

    Attributes:
        pressure_queue: crossings waiting for the ``on_pressure`` hooks.
    """

    def __init__(self, monitor: MonitorState) -> None:
        self.m = monitor
        self.pressure_queue: list[ThresholdCrossing] = []
        #: the last decision whose event is recorded: the policy makes a decision pending inside
        #: ``evaluate`` (sampler thread), and the training thread applied it before its event
        #: was written, so the action came before its decision in the history
        self._announced: Decision | None = None
        #: applying between a failed attempt of ``run_step`` and its retry (no gradients alive)
        self.at_recovery_point = False

    @property
    def _policy(self) -> Policy:
        policy = self.m.policy
        assert policy is not None
        return policy

    def action_context(self, reading: Reading | None = None) -> ActionContext:
        """What actions plan and apply from: the model and optimizers, the policy's levels and
        ``reading``'s numbers (``None``: none known)."""
        m = self.m
        policy = self._policy
        assert m.model is not None
        return ActionContext(
            m.model,
            m.optimizers,
            cuda_mode=m.device_kind == "cuda",
            device=(
                torch.device("cuda", m.device_index or 0)
                if m.device_kind == "cuda"
                else torch.device("cpu")
            ),
            reserved_unallocated_bytes=reading.reserved_unallocated_bytes if reading else None,
            release_cache_min_bytes=policy.release_cache_min_bytes,
            activation_profile=m.activation_profile,
            lookup_counter=m._lookups,
            budget_bytes=reading.budget_bytes if reading else None,
            in_use_bytes=reading.in_use_bytes if reading else None,
            rearm_free_fraction=policy.rearm_free_fraction,
            grow_margin_fraction=policy.grow_margin_fraction,
            host_available_bytes=reading.host_available_bytes if reading else None,
            spill_dir=m.spill_dir,
            steps_done=m.steps,
        )

    def evaluate(self, reading: Reading) -> None:
        """Sampler thread: crossings and at most one decision per reading (applied later). Their
        events record the reading's step (planning may take steps: the decision event said a
        later step than its ``decided_at_step``)."""
        m = self.m
        policy = self._policy
        planner = make_planner(self.action_context(reading)) if m.model is not None else None
        for event in policy.evaluate(reading, planner):
            if isinstance(event, ThresholdCrossing):
                below = event.kind == "below_floor"
                self.m._emit(
                    "threshold_crossed",
                    f"free {format_percent_beside(event.free_fraction, event.threshold_fraction)} "
                    + ("below the floor" if below else "back above the re-arm level")
                    + f" {event.threshold_fraction:.0%}",
                    {
                        "direction": "below" if below else "above",
                        "free_fraction": event.free_fraction,
                        "floor": policy.min_free_fraction,
                        "threshold": event.threshold_fraction,
                        "in_use_bytes": reading.in_use_bytes,
                        "budget_bytes": reading.budget_bytes,
                    },
                    # the reading's time: planning can take long enough for the training thread
                    # to apply an action meanwhile, whose module rows explain read as the
                    # tables at the crossing (a row cache grown after the reading)
                    time_s=reading.time_s,
                    step=reading.step,
                )
                self.pressure_queue.append(event)
            elif isinstance(event, Decision):
                err = event.expected_error
                data = {
                    "action": event.action,
                    "target": event.target,
                    "estimated_saving_bytes": event.estimated_saving_bytes,
                    "expected_error": err,
                    "reason": event.reason,
                    "mode": event.mode,
                    "free_fraction": event.free_fraction,
                }
                if event.forecast is not None:
                    data["forecast"] = event.forecast.index
                if event.planning_in_use_bytes is not None:
                    data["planning_in_use_bytes"] = event.planning_in_use_bytes
                if event.passed_over:
                    data["passed_over"] = [
                        {"action": r.action, "target": r.target, "reason": r.reason}
                        for r in event.passed_over
                    ]
                self.m._emit(
                    "decision",
                    f"{'advise' if event.advisory else 'decide'}: {event.action} on "
                    f"{event.target or '-'} (est. {format_bytes(event.estimated_saving_bytes)}"
                    + (f", expected error {err:.2g})" if err is not None else ")")
                    + (" ahead of a forecast crossing" if event.forecast is not None else ""),
                    data,
                    step=reading.step,
                )
                self._announced = event
            elif isinstance(event, Forecast):
                self.emit_forecast(event)
            elif isinstance(event, ForecastOutcome):
                self.emit_forecast_outcome(event)
            else:
                why = "; ".join(f"{r.action} ({r.reason})" for r in event.refusals)
                message = (
                    ("a crossing is forecast" if event.forecast else "under pressure")
                    + ", but no action on the ladder applies"
                    + (f": {why}" if why else "")  # the reasons in every view, not only --json
                )
                if not event.forecast:  # the user sees why the tuner does nothing, not silence
                    logger.warning(
                        "step %d: free %.1f%% %s", reading.step, 100 * event.free_fraction, message
                    )
                self.m._emit(
                    "no_action",
                    message,
                    {
                        "free_fraction": event.free_fraction,
                        "refusals": [
                            {"action": r.action, "target": r.target, "reason": r.reason}
                            for r in event.refusals
                        ],
                        **({"forecast": True} if event.forecast else {}),
                    },
                    step=reading.step,
                )

    def emit_forecast(self, forecast: Forecast) -> None:
        """A ``forecast`` event: the prediction, as :meth:`Forecast.as_dict` gives it."""
        driver = next(iter(forecast.category_slopes), None)
        self.m._emit(
            "forecast",
            f"free {forecast.free_fraction:.1%} now, predicted below the "
            f"{forecast.floor_fraction:.0%} floor in {forecast.steps_ahead} steps (step "
            f"{forecast.predicted_step}) at +{format_bytes(round(forecast.slope_bytes_per_step))}"
            "/step"
            + (
                f", mostly {driver[0].removesuffix('_bytes')}"
                if driver is not None and driver[1] > 0
                else ""
            ),
            {**forecast.as_dict(), "forecast": forecast.index},
        )

    def emit_forecast_outcome(self, outcome: ForecastOutcome) -> None:
        """A ``forecast_outcome`` event: whether forecast ``forecast`` (its index) came true."""
        fc = outcome.forecast
        if outcome.came_true:
            verdict = (
                f"came true: free below the floor at step {outcome.crossing_step}"
                + (" without the actions taken since" if outcome.saved_bytes else "")
                + f", {outcome.lead_steps} steps after the warning"
            )
        elif outcome.came_true is None:
            verdict = f"not judged: the run ended at step {outcome.step}"
        else:
            verdict = f"did not come true: free stayed above the floor to step {outcome.step}"
        self.m._emit(
            "forecast_outcome",
            f"forecast {fc.index} (step {fc.step}, predicted step {fc.predicted_step}) {verdict}",
            {
                "forecast": fc.index,
                "forecast_step": fc.step,
                "predicted_step": fc.predicted_step,
                "came_true": outcome.came_true,
                "crossing_step": outcome.crossing_step,
                "lead_steps": outcome.lead_steps,
                "judged_at_step": outcome.step,
                "saved_bytes": outcome.saved_bytes,
            },
        )

    def record_measured(
        self,
        decision: Decision,
        result: ActionResult,
        before: ActivationProfile | None,
        after: ActivationProfile,
    ) -> None:
        """Training thread: the saving of an applied action whose result held an estimate
        (``checkpoint_activations``), measured on ``after``, the first forward recorded after it:
        the saved-activation bytes of ``before`` (the profile it was planned and applied from,
        ``result.bytes_before``) minus ``after``'s.

        Records an ``action_measured`` event. When the rest of the forward saved the same bytes in
        both (:meth:`ActivationProfile.outside`: the same batch shapes), the policy and its
        forecast take the measured figure and, below half the estimate, an ``action_ineffective``
        is recorded; otherwise (another batch) the difference is not the action's and is not
        judged: the estimate stands."""
        measured = result.bytes_before - after.total_bytes
        blocks = result.details.get("blocks", ())
        comparable = before is not None and before.outside(blocks) == after.outside(blocks)
        estimated = result.estimated_saving_bytes
        self.m._emit(
            "action_measured",
            f"{result.action} on {result.target}: measured saving {format_bytes(measured)} on "
            f"the next recorded forward (estimated {format_bytes(estimated)})"
            + ("" if comparable else "; not judged: the rest of that forward saved other bytes"),
            {
                "action": result.action,
                "target": result.target,
                "decided_at_step": decision.step,
                "estimated_saving_bytes": estimated,
                "saved_bytes": measured,
                "bytes_before": result.bytes_before,
                "bytes_after": after.total_bytes,
                "comparable": comparable,
            },
        )
        if not comparable:
            return
        why = self._policy.remeasured(decision, result.saved_bytes, measured)
        if why is not None:
            self._emit_ineffective(result, why)

    def _watch_cached_tables(self) -> None:
        """Ask each row cache the agent made to report a gradient on its weight itself (a loss
        term over the weight: an L2 penalty over the parameters, on steps the recorded profile
        did not see): an ``action_inexact`` event, once per table."""
        m = self.m
        assert m.model is not None
        for name, module in m.model.named_modules():
            if isinstance(module, CachedTable) and getattr(module, "edo_action_made", False):
                report_direct_grads(module, functools.partial(self._direct_grad, name))

    def _direct_grad(self, name: str, table: CachedTable) -> None:
        self.m._emit(
            "action_inexact",
            f"{name}: a gradient reached the row cache's weight directly at step {self.m.steps} "
            "(a loss term over the weight, such as an L2 penalty over the parameters): it stepped "
            "the cached rows it touched, not the rows on the host, so training is not the "
            "resident table's from here",
            {"table": name, "kind": type(table).__name__, "cache_rows": table.cache_rows},
        )

    def _emit_ineffective(self, result: ActionResult, why: str) -> None:
        """An ``action_ineffective`` event: the ladder moves on from ``result``'s target."""
        self.m._emit(
            "action_ineffective",
            f"{result.action} on {result.target} ineffective: {why}",
            {"action": result.action, "target": result.target, "reason": why},
        )

    def deliver_pressure_hooks(self) -> None:
        """Training thread: the policy's ``on_pressure`` hooks, one call per crossing seen."""
        while self.pressure_queue:
            crossing = self.pressure_queue.pop(0)
            err = self._policy.call_on_pressure(crossing)
            if err is not None:
                self.m._agent_error("on_pressure hook", err)

    def expire_pending_decision(self) -> None:
        """At the end of the run: a decision still pending (made by a reading after the last step
        boundary) can no longer be applied; resolve it as ``"expired"`` and record a
        ``decision_expired`` event, so no decision is left without an outcome."""
        policy = self.m.policy
        decision = policy.pending if policy is not None else None
        if decision is None or decision.advisory:
            return
        policy.resolve(decision, "expired")
        reason = (
            f"decided from the reading of step {decision.step} after the run's last step "
            f"boundary (step {self.m.steps}): the run ended before it could be applied"
        )
        self.m._emit(
            "decision_expired",
            f"{decision.action} on {decision.target or '-'} not applied: {reason}",
            {
                "action": decision.action,
                "target": decision.target,
                "status": "expired",
                "estimated_saving_bytes": decision.estimated_saving_bytes,
                "decided_at_step": decision.step,
                "reason": reason,
            },
        )

    def apply_pending_decision(self) -> None:
        """Training thread, at the safe point: apply the policy's pending decision (not an
        advisory one), resolve it, and record what happened.

        Raises:
            Exception: with ``strict=True``, the exception of an action that failed.
        """
        m = self.m
        policy = m.policy
        if policy is None or m.model is None:
            return
        decision = policy.pending
        if decision is None or decision.advisory or decision is not self._announced:
            return  # not recorded yet: applied at the next boundary
        alone = uncoordinated_blocker(decision.action)  # no agreement in a group of ranks
        refused = None
        if alone is not None:
            refused = ActionResult(
                decision.action,
                decision.target,
                "refused",
                estimated_saving_bytes=decision.estimated_saving_bytes,
                reason=alone,
            )
        self.apply_decision(decision, refused=refused)

    def decision_context(self, decision: Decision) -> ActionContext:
        """The context ``decision`` is planned and applied in: the latest reading's, sized for
        the decision's in-use forecast ahead when it has one."""
        ctx = self.action_context(self.m.latest)
        ctx.grad_spent = self.m._safe_point.grad_spent
        if decision.planning_in_use_bytes is not None:  # sized for the in-use forecast ahead
            ctx.in_use_bytes = max(ctx.in_use_bytes or 0, decision.planning_in_use_bytes)
        return ctx

    def apply_decision(
        self,
        decision: Decision,
        *,
        refused: ActionResult | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ActionResult:
        """Apply ``decision`` (training thread, at a safe point), resolve it with the policy and
        record an ``action`` / ``action_refused`` / ``action_failed`` event.

        Args:
            decision: the policy's pending decision, or (multi-rank) the one the ranks agreed on.
            refused: a refusal decided before applying (the ranks did not all agree): recorded
                as it is, nothing applied, and the policy told the decision failed (that
                ``(action, target)`` is not proposed again).
            extra: more event data (the ranks' agreement).

        Returns:
            The :class:`ActionResult` recorded.

        Raises:
            Exception: with ``strict=True``, the exception of an action that failed.
        """
        m = self.m
        if refused is not None and m.policy is None:
            # a rank of a job that watches without a policy refuses what the others agreed on:
            # recorded, nothing to plan or resolve (it raised AssertionError, which switched the
            # rank's agreement off and stalled the others at the next one)
            self._record(decision, refused, None, extra, time.time())
            return refused
        policy = self._policy
        ctx = self.decision_context(decision)
        if refused is None and m._log.snapshots is not None:
            m._log.snapshots.before_action()  # the "before" snapshot of the action's event
        started_s = time.time()
        result = refused if refused is not None else self._apply(ctx, decision)
        if result.status == "applied" and self.at_recovery_point:
            # no gradient is alive between a failed attempt and its retry: the measured saving
            # lacks the gradient the estimate counts (a table's), so it cannot judge it
            result.details["measured_without_gradients"] = True
        # resolved once: a failed decision is never retried on the same target
        ineffective = policy.resolve(decision, "failed" if refused is not None else result)
        self._record(decision, result, ineffective, extra, started_s)
        if result.status == "applied" and result.details.get("after_is_estimate"):
            m._safe_point.measure_after(decision, result)
        err = policy.call_on_action(result)
        if err is not None:
            m._agent_error("on_action hook", err)
        if result.status == "failed" and m.strict and result.exception is not None:
            raise result.exception
        return result

    def _apply(self, ctx: ActionContext, decision: Decision) -> ActionResult:
        try:
            return ACTIONS[decision.action].apply(ctx, decision.plan)
        except Exception as exc:  # Action.apply raised (e.g. its plan() at apply time): failed
            logger.warning("action %s raised at apply time: %r", decision.action, exc)
            return ActionResult(
                decision.action,
                decision.target,
                "failed",
                estimated_saving_bytes=decision.estimated_saving_bytes,
                reason=f"{type(exc).__name__}: {exc}",
                exception=exc,
            )

    def _record(
        self,
        decision: Decision,
        result: ActionResult,
        ineffective: str | None,
        extra: dict[str, Any] | None,
        started_s: float,
    ) -> None:
        """The result's event, stamped ``started_s`` (when the action began: a reading that
        sees its effect can record a threshold crossing before the result is measured, and the
        timeline orders by time), and an ``action_ineffective`` event when it saved too little."""
        m = self.m
        kind = {"applied": "action", "refused": "action_refused"}.get(
            result.status, "action_failed"
        )
        data = {
            "action": result.action,
            "target": result.target,
            "status": result.status,
            "estimated_saving_bytes": result.estimated_saving_bytes,
            "bytes_before": result.bytes_before,
            "bytes_after": result.bytes_after,
            "saved_bytes": result.saved_bytes if result.status == "applied" else 0,
            "duration_s": result.duration_s,
            "lossy": result.lossy,
            "expected_error": decision.expected_error,
            "error": result.error,
            "reason": result.reason,
            "details": result.details,
            "decided_at_step": decision.step,
            **(extra or {}),
        }
        if result.status == "applied":
            message = (
                f"{result.action} on {result.target}: saved {format_bytes(result.saved_bytes)} "
                f"in {result.duration_s:.3f} s"
            )
            if result.lossy:  # the event's line says it, not only its data
                message += (
                    " (lossy"
                    + (
                        ""
                        if decision.expected_error is None
                        else f": expected error {decision.expected_error:.2g}"
                    )
                    + ")"
                )
            if result.details.get("measured_without_gradients"):
                message += " (measured between a failed attempt and its retry: no gradients)"
            # the accounting after the action, taken here on the training thread at the step
            # boundary, gradients alive: the next readings see the model as it is now (without
            # it they fell back to an accounting without gradients until the next boundary, and
            # a brief jump of free memory could end a pressure episode falsely)
            acc = m._account()
            if m._tracker is not None:
                m._tracker.set_params(m._model_tensors())
                m._safe_point.rebase(acc, rehook=True)
            m._safe_point.step_accounting = acc
            if m._lookups is not None:  # the action may have swapped a table: count the new one
                m._lookups.watch_tables(m.model)
            self._watch_cached_tables()
        else:
            message = f"{result.action} on {result.target or '-'} {result.status}: {result.reason}"
        self.m._emit(kind, message, data, started_s)
        if ineffective is not None:
            self._emit_ineffective(result, ineffective)
