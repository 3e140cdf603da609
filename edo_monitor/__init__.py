"""edo-monitor: a live GPU memory monitor and auto-tuner for PyTorch training.

``with edo_monitor.watch(model):`` samples memory from NVML, PyTorch's caching allocator and the
host, attributes it to modules and categories, records it in a history database, and (with a
:class:`Policy`) applies memory-saving actions to embedding tables at safe points.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import edo_monitor._checkout  # noqa: F401  (first: maps agent/ and tui/ in a checkout)

if TYPE_CHECKING:  # the names below are imported on first use (PEP 562), see __getattr__
    from edo_monitor.agent.monitor import Monitor
    from edo_monitor.agent.run import RunSummary
    from edo_monitor.agent.watch import watch
    from edo_monitor.decide.estimate import Estimate, estimate
    from edo_monitor.decide.policy import Policy
    from edo_monitor.errors import (
        AlreadyWatchedError,
        BudgetOutOfMemoryError,
        ConfigError,
        EdoMonitorError,
        RunNotFoundError,
        StoreError,
    )
    from edo_monitor.hindsight.explain import explain
    from edo_monitor.hindsight.replay import replay
    from edo_monitor.measure.oom import OomInfo, parse_oom_message
    from edo_monitor.probes.readings import Reading
    from edo_monitor.store.history import History

#: Public name -> the module that defines it. Importing ``edo_monitor`` imports none of them, so
#: ``edo-monitor`` commands that only read the history never import torch (it costs seconds);
#: ``edo_monitor.watch`` imports the agent (and torch) on first access.
_LAZY = {
    "Monitor": "edo_monitor.agent.monitor",
    "RunSummary": "edo_monitor.agent.monitor",
    "watch": "edo_monitor.agent.watch",
    "AlreadyWatchedError": "edo_monitor.errors",
    "BudgetOutOfMemoryError": "edo_monitor.errors",
    "ConfigError": "edo_monitor.errors",
    "EdoMonitorError": "edo_monitor.errors",
    "RunNotFoundError": "edo_monitor.errors",
    "StoreError": "edo_monitor.errors",
    "Estimate": "edo_monitor.decide.estimate",
    "estimate": "edo_monitor.decide.estimate",
    "explain": "edo_monitor.hindsight.explain",
    "replay": "edo_monitor.hindsight.replay",
    "OomInfo": "edo_monitor.measure.oom",
    "parse_oom_message": "edo_monitor.measure.oom",
    "Policy": "edo_monitor.decide.policy",
    "Reading": "edo_monitor.probes.readings",
    "History": "edo_monitor.store.history",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first access (PEP 562) and keep it as a module attribute."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'edo_monitor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "AlreadyWatchedError",
    "BudgetOutOfMemoryError",
    "ConfigError",
    "EdoMonitorError",
    "Estimate",
    "History",
    "Monitor",
    "OomInfo",
    "Policy",
    "Reading",
    "RunNotFoundError",
    "RunSummary",
    "StoreError",
    "__version__",
    "estimate",
    "explain",
    "parse_oom_message",
    "replay",
    "watch",
]
