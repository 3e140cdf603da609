"""What became of the policy's decisions: a decision resolved once applied (or refused, failed,
expired), and an applied saving measured after the fact (an action whose result held an estimate,
``checkpoint_activations``, measured on the next recorded forward) corrected and judged."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from edo_monitor.decide.policy_events import Decision
from edo_monitor.decide.ranking import ineffective_reason, ineffective_saving

if TYPE_CHECKING:  # the policy itself needs no torch
    from edo_monitor.actions.base import ActionResult

logger = logging.getLogger(__name__)


class _Outcomes:
    """The policy's part that learns from what its decisions did (mixed into
    :class:`~edo_monitor.decide.policy.Policy`, whose state it reads and changes under its lock)."""

    def resolve(self, decision: Decision, status: str | ActionResult) -> str | None:
        """Report what became of a pending decision (training thread, after ``apply``).

        Args:
            decision: the :class:`Decision` returned by :meth:`evaluate`.
            status: the :class:`~edo_monitor.actions.ActionResult` (or only its ``status``, when
                the estimate stands for the saving, as in a replay):
                ``"applied"`` (the cooldown starts at the decision's step), ``"refused"`` (no
                cooldown charged; the next reading may try the next rung) or ``"failed"`` (also
                never tried on the same target again). An applied result whose measured saving
                is below :data:`~edo_monitor.decide.ranking.INEFFECTIVE_BELOW_FRACTION` of its
                estimate is *ineffective*:
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
            if state == "applied":
                self._released_last = decision.action == "release_cache"
                self._recent_in_use.clear()  # the memory is another from here on
                if decision.action == "grow_cache":  # undone if pressure comes back soon
                    self._grown_step = decision.step
            if state == "refused" and decision.action == "grow_cache":
                # planned again at the safe point, the grow found no room: a calm that misled,
                # learned from as a grow that pressure undid
                self._learn_from_undone_grow(decision.step, decision.step)
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

    def remeasured(
        self, decision: Decision, recorded_bytes: int, measured_bytes: int
    ) -> str | None:
        """An applied decision's saving, measured after it was resolved (training thread).

        ``checkpoint_activations`` frees nothing at once: its result's saving is the estimate until
        the agent records the next forward (``details["after_is_estimate"]``). With the measured
        figure the policy judges it as :meth:`resolve` judges the others: below
        :data:`~edo_monitor.decide.ranking.INEFFECTIVE_BELOW_FRACTION` of the estimate it is
        ineffective, and while the pressure episode (or forecast) that decided it lasts, that
        ``(action, target)`` is skipped and no cooldown is charged, so the next reading may climb
        to the next rung. The forecast's series adds back the measured saving from here on,
        instead of the estimate it was given.

        Args:
            decision: the applied :class:`Decision`.
            recorded_bytes: the saving the result recorded (what :meth:`resolve` was given).
            measured_bytes: the saving measured (may be negative: the recorded forward saved
                more than before).

        Returns:
            For an ineffective saving, one line saying why; else ``None``.
        """
        why = ineffective_saving(decision.estimated_saving_bytes, measured_bytes)
        with self._lock:
            if self.forecast_steps is not None:
                entry = (decision.step, int(recorded_bytes))
                if entry in self._saved_pending:  # not in force yet: in force as measured
                    self._saved_pending[self._saved_pending.index(entry)] = (
                        decision.step,
                        int(measured_bytes),
                    )
                else:
                    self._saved_in_force += int(measured_bytes) - int(recorded_bytes)
            if why is not None and (self.under_pressure or self._forecast is not None):
                self._ineffective[(decision.action, decision.target)] = why
                if self.last_decision_step == decision.step:
                    self.last_decision_step = None
        if why is not None:
            logger.info("%s on %s was ineffective: %s", decision.action, decision.target, why)
        return why
