"""CPU-budget enforcement: fail like a real out-of-memory error when the budget is exceeded.

With ``watch(..., budget=..., enforce=True)`` and no CUDA, the agent calls :func:`enforce_budget`
with the accounted device-tier bytes; going over the budget raises
:class:`edo_monitor.errors.BudgetOutOfMemoryError` (a ``torch.OutOfMemoryError``) whose message is
:func:`edo_monitor.measure.oom.format_cpu_budget_oom_message`'s, in PyTorch's wording.
"""

from __future__ import annotations

import logging

from edo_monitor.errors import BudgetOutOfMemoryError, ConfigError
from edo_monitor.measure.oom import format_cpu_budget_oom_message

__all__ = ["enforce_budget"]

logger = logging.getLogger(__name__)


def enforce_budget(
    budget_bytes: int,
    in_use_bytes: int,
    *,
    accounted_bytes: int | None = None,
    requested_bytes: int | None = None,
) -> None:
    """Raise when ``in_use_bytes`` exceeds ``budget_bytes``; return ``None`` otherwise.

    The message states what was in use before the request that failed, as PyTorch's does: "Tried
    to allocate ``requested``", "``accounted`` is accounted to the watched model" (in use before
    the request), and "``max(0, budget - accounted)`` is free". Neither number is bent to make
    the other fit: a model already over its budget says so (its true bytes, 0 free).

    Args:
        budget_bytes: the budget (> 0).
        in_use_bytes: device-tier bytes in use with the request (what counts against the budget).
        accounted_bytes: bytes accounted to the watched model before the request (default
            ``in_use_bytes - requested_bytes``).
        requested_bytes: the growth that crossed the budget, e.g. a new saved tensor's storage or
            the increase since the last check (at least 1 and at most ``in_use_bytes``); default
            the excess ``in_use_bytes - budget_bytes``.

    Raises:
        BudgetOutOfMemoryError: ``in_use_bytes > budget_bytes``.
        ConfigError: ``budget_bytes <= 0``.
    """
    if budget_bytes <= 0:
        raise ConfigError(f"budget_bytes={budget_bytes!r} must be a positive number of bytes")
    if in_use_bytes <= budget_bytes:
        return
    excess = in_use_bytes - budget_bytes
    requested = excess if requested_bytes is None else int(requested_bytes)
    requested = min(max(1, requested), in_use_bytes)
    accounted = in_use_bytes - requested if accounted_bytes is None else int(accounted_bytes)
    free = max(0, budget_bytes - accounted)
    message = format_cpu_budget_oom_message(requested, budget_bytes, free, accounted)
    logger.debug("%s", message)
    raise BudgetOutOfMemoryError(message)
