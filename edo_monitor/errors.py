"""Errors raised by edo-monitor.

Every error a user can trigger with bad input is an :class:`EdoMonitorError`; the ones about a bad
argument value are also :class:`ValueError`, so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

__all__ = [
    "AlreadyWatchedError",
    "BudgetOutOfMemoryError",
    "ConfigError",
    "EdoMonitorError",
    "EventNotFoundError",
    "JobNotFoundError",
    "MissingExtraError",
    "NvmlUnavailableError",
    "RunNotFoundError",
    "StoreError",
]


class EdoMonitorError(Exception):
    """Base class of every error edo-monitor raises on purpose."""


class ConfigError(EdoMonitorError, ValueError):
    """An argument or setting has a value that is not allowed; the message names both."""


class MissingExtraError(ConfigError, ImportError):
    """An optional package a feature needs is not installed; the message names the feature,
    the package and the ``pip install 'edo-monitor[EXTRA]'`` line. Exit code 1 in the CLI (the
    command line was right; this environment lacks a package), for every optional feature alike.
    A :class:`ConfigError` and an :class:`ImportError`, so either ``except`` catches it."""


def missing_extra(
    feature: str, package: str, extra: str, cause: BaseException | None = None
) -> MissingExtraError:
    """The one error for an optional package that is missing: ``feature`` (what needs it, e.g.
    ``"tensorboard="``), ``package`` (the import name), ``extra`` (the pyproject extra)."""
    detail = f" ({cause})" if cause is not None and str(cause) else ""
    return MissingExtraError(
        f"{feature} needs the {package} package, which is not installed: "
        f"pip install 'edo-monitor[{extra}]'{detail}"
    )


class AlreadyWatchedError(EdoMonitorError, RuntimeError):
    """``watch(model)`` was called for a model that an open ``watch()`` block already watches."""


class StoreError(EdoMonitorError):
    """The history database cannot be opened or used (wrong file, newer schema, unreachable)."""


class RunNotFoundError(EdoMonitorError, LookupError):
    """A run reference (id, uuid prefix or ``latest``) matched no run, or several."""


class EventNotFoundError(EdoMonitorError, LookupError):
    """An event id names no incident of the run (no such event, or not an OOM or a below-floor
    crossing): the data has no such thing, as a missing run (exit 1 in the CLI)."""


class JobNotFoundError(EdoMonitorError, LookupError):
    """A job reference (id, id prefix or ``latest``) matched no multi-rank job, or several."""


class NvmlUnavailableError(EdoMonitorError):
    """NVML cannot be used (``nvidia-ml-py`` missing, or ``nvmlInit`` failed: no driver or
    library, driver and library versions differ …); the message names the cause. Raised by the
    system-wide daemon, which has nothing to sample without it (the agent goes on without NVML)."""


if TYPE_CHECKING:  # for type checkers; at run time the class is made on first access
    import torch

    class BudgetOutOfMemoryError(torch.OutOfMemoryError):
        """See :func:`_budget_oom_error`."""


_MAKE_LOCK = threading.Lock()


def _budget_oom_error() -> type:
    import torch  # here, not at the top: readers of the history (the CLI) never import torch

    class BudgetOutOfMemoryError(torch.OutOfMemoryError):
        """Raised in CPU-budget mode with ``enforce=True`` when the accounted bytes exceed the
        budget.

        A subclass of :class:`torch.OutOfMemoryError`, so code that catches a real CUDA
        out-of-memory error catches this one too; its message follows PyTorch's wording
        (``"... out of memory. Tried to allocate ..."``) so that
        :func:`edo_monitor.parse_oom_message` reads it.
        """

    BudgetOutOfMemoryError.__module__ = __name__
    BudgetOutOfMemoryError.__qualname__ = "BudgetOutOfMemoryError"
    return BudgetOutOfMemoryError


def __getattr__(name: str) -> Any:
    """``BudgetOutOfMemoryError`` subclasses a torch class: made on first access (PEP 562), so
    importing this module does not import torch."""
    if name == "BudgetOutOfMemoryError":
        with _MAKE_LOCK:  # one class, even when two threads ask at once
            cls = globals().get(name)
            if cls is None:
                cls = globals()[name] = _budget_oom_error()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
