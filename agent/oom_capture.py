"""Out-of-memory errors recorded as ``oom`` events: :func:`record_oom`.

Called when a ``with watch()`` block ends with an error, when ``run_step`` catches one, and when
the CPU budget is exceeded with ``enforce=True``. The error itself is never swallowed: the caller
re-raises it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from edo_monitor.measure.oom import parse_oom_message

if TYPE_CHECKING:
    from edo_monitor.agent.state import MonitorState

__all__ = ["record_oom"]


def record_oom(monitor: MonitorState, exc: BaseException) -> None:
    """Record an ``oom`` event for ``exc`` when it is an out-of-memory error.

    An error counts when its message parses as PyTorch's out-of-memory message
    (:func:`edo_monitor.measure.oom.parse_oom_message`) or it is a ``torch.OutOfMemoryError``. The
    event's data: ``exception`` (type name), ``parsed`` (the message's fields, ``None`` when it does
    not parse), ``raw`` (the message, first 4,000 characters), ``last_reading`` (the latest reading
    as a dict) and ``top_consumers`` (the five largest tables of the latest accounting: ``module``,
    ``total_bytes``, ``placement``); for a CPU-budget error also ``in_use`` (what was alive with
    the request, by category: :meth:`SafePoint.budget_exceeded`). Never raises: a failure is an
    ``agent_error``.
    """
    try:
        info = parse_oom_message(str(exc))
        if info is None and not isinstance(exc, torch.OutOfMemoryError):
            return
        tables = sorted(monitor.accounting.tables, key=lambda t: t.total_bytes, reverse=True)
        latest = monitor.latest
        data = {
            "exception": type(exc).__name__,
            "parsed": _oom_dict(info),
            "raw": str(exc)[:4000],
            "last_reading": latest.as_dict() if latest is not None else None,
            "top_consumers": [
                {"module": t.module, "total_bytes": t.total_bytes, "placement": t.placement}
                for t in tables[:5]
            ],
        }
        alive = getattr(exc, "_edo_in_use", None)
        if alive is not None:  # a CPU-budget error: what was alive with the request
            data["in_use"] = alive
        monitor._emit("oom", f"out of memory: {str(exc).splitlines()[0][:300]}", data)
    except Exception as err:
        monitor._agent_error("oom capture", err)


def _oom_dict(info: Any) -> dict[str, Any] | None:
    if info is None:
        return None
    d = dataclasses.asdict(info)
    d.pop("raw", None)
    return d
