"""Errors raised by edo-monitor.

Every error a user can trigger with bad input is an :class:`EdoMonitorError`; the ones about a bad
argument value are also :class:`ValueError`, so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import torch

__all__ = [
    "AlreadyWatchedError",
    "BudgetOutOfMemoryError",
    "ConfigError",
    "EdoMonitorError",
    "RunNotFoundError",
    "StoreError",
]


class EdoMonitorError(Exception):
    """Base class of every error edo-monitor raises on purpose."""


class ConfigError(EdoMonitorError, ValueError):
    """An argument or setting has a value that is not allowed; the message names both."""


class AlreadyWatchedError(EdoMonitorError, RuntimeError):
    """``watch(model)`` was called for a model that an open ``watch()`` block already watches."""


class StoreError(EdoMonitorError):
    """The history database cannot be opened or used (wrong file, newer schema, unreachable)."""


class RunNotFoundError(EdoMonitorError, LookupError):
    """A run reference (id, uuid prefix or ``latest``) matched no run, or several."""


class BudgetOutOfMemoryError(torch.OutOfMemoryError):
    """Raised in CPU-budget mode with ``enforce=True`` when the accounted bytes exceed the budget.

    A subclass of :class:`torch.OutOfMemoryError`, so code that catches a real CUDA out-of-memory
    error catches this one too; its message follows PyTorch's wording
    (``"... out of memory. Tried to allocate ..."``) so that
    :func:`edo_monitor.parse_oom_message` reads it.
    """
