"""Doing it: the memory-saving actions, applied at a step boundary (DESIGN.md §6). Take a decision
and the live model; hand on a changed model and an ActionResult.

Build an :class:`ActionContext`, get a :class:`Plan` (or a :class:`Refusal`) from
``ACTIONS[name].plan(ctx)``, apply it on the training thread with ``ACTIONS[name].apply(ctx, plan)``
and record the :class:`ActionResult`.
"""

from __future__ import annotations

from edo_monitor.actions.base import (
    Action,
    ActionContext,
    ActionResult,
    InjectedFailureError,
    OptimizerLeftoverError,
    Transaction,
    find_wrapped_parallel,
)
from edo_monitor.actions.checkpoint_activations import (
    ActivationProfile,
    ActivationRecorder,
    undo_checkpointing,
)
from edo_monitor.actions.enforce import enforce_budget
from edo_monitor.actions.registry import ACTIONS, LOSSY_ACTIONS
from edo_monitor.decide.plans import DEFAULT_LOSSLESS_LADDER, DEFAULT_LOSSY_LADDER, Plan, Refusal

__all__ = [
    "ACTIONS",
    "DEFAULT_LOSSLESS_LADDER",
    "DEFAULT_LOSSY_LADDER",
    "LOSSY_ACTIONS",
    "Action",
    "ActionContext",
    "ActionResult",
    "ActivationProfile",
    "ActivationRecorder",
    "InjectedFailureError",
    "OptimizerLeftoverError",
    "Plan",
    "Refusal",
    "Transaction",
    "enforce_budget",
    "find_wrapped_parallel",
    "undo_checkpointing",
]
