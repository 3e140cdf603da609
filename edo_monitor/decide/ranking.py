"""How plans are weighed: a planner over the live model, lossy plans ranked by saving per unit of
expected error, an action judged ineffective when its saving falls far short."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from edo_monitor.decide.plans import (
    ACTION_NAMES,
    LOSSY_ACTION_NAMES,
    Plan,
    Refusal,
)
from edo_monitor.units import format_bytes

if (
    TYPE_CHECKING
):  # the policy itself needs no torch (edo_monitor.hindsight.explain replays offline)
    from edo_monitor.actions.base import ActionContext, ActionResult

logger = logging.getLogger(__name__)


Planner = Callable[[str], Plan | Refusal] | Mapping[str, Plan | Refusal]


#: An applied action whose measured saving is below this fraction of its estimate is
#: ineffective for its target (e.g. ``release_cache`` when ``empty_cache()`` freed next to nothing).
INEFFECTIVE_BELOW_FRACTION = 0.5


def ineffective_reason(result: ActionResult) -> str | None:
    """Why an applied ``result`` counts as ineffective, or ``None`` when it is not.

    Ineffective: a positive estimate and a measured saving (``bytes_before - bytes_after``) below
    :data:`INEFFECTIVE_BELOW_FRACTION` of it. A result whose ``bytes_after`` is itself an
    estimate (``details["after_is_estimate"]``) is never judged, nor one measured where no
    gradient was alive (``details["measured_without_gradients"]``: between a failed attempt of
    ``run_step`` and its retry) against an estimate that counts the table's gradient.
    """
    details = result.details
    if (
        result.status != "applied"
        or details.get("after_is_estimate")
        or details.get("measured_without_gradients")
    ):
        return None
    return ineffective_saving(result.estimated_saving_bytes, result.saved_bytes)


def ineffective_saving(estimated_bytes: int, measured_bytes: int) -> str | None:
    """Why a measured saving of ``measured_bytes`` is ineffective against ``estimated_bytes``
    (below :data:`INEFFECTIVE_BELOW_FRACTION` of a positive estimate), or ``None``."""
    if estimated_bytes <= 0 or measured_bytes >= INEFFECTIVE_BELOW_FRACTION * estimated_bytes:
        return None
    return (
        f"measured saving {format_bytes(max(measured_bytes, 0))} is below "
        f"{INEFFECTIVE_BELOW_FRACTION:.0%} of the estimated {format_bytes(estimated_bytes)}"
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


def skip_reason(
    plan: Plan,
    failed: Container[tuple[str, str]],
    ineffective: Mapping[tuple[str, str], str],
    advised: Container[tuple[str, str]] | None = None,
) -> str | None:
    """Why the policy does not decide ``plan`` (a rung's plan under pressure or ahead of a
    forecast crossing), or ``None`` when it may.

    Skipped, in this order: a plan whose ``estimated_saving_bytes`` is 0 or less, whatever the
    action (memory is short: a remedy that frees nothing, or grows the memory, is none; a
    lossy one would also cost accuracy for it); an ``(action, target)`` pair in ``failed``
    (failed before), in ``ineffective`` (its saving fell short in this episode; the value says
    how) or in ``advised`` (advise mode: already advised in this episode; ``None`` otherwise).
    ``grow_cache``, whose saving is negative by design, is decided elsewhere (calm, not pressure).
    """
    if plan.estimated_saving_bytes <= 0:
        return (
            f"saves nothing: estimated saving {plan.estimated_saving_bytes:,} bytes "
            f"({format_bytes(max(plan.estimated_saving_bytes, 0))})"
        )
    key = (plan.action, plan.target)
    if key in failed:
        return "failed before on this target"
    if key in ineffective:
        return f"ineffective before in this episode: {ineffective[key]}"
    if advised is not None and key in advised:
        return "already advised in this episode"
    return None


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
