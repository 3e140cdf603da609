"""edo-monitor: a live GPU memory monitor and auto-tuner for PyTorch training.

``with edo_monitor.watch(model):`` samples memory from NVML, PyTorch's caching allocator and the
host, attributes it to modules and categories, records it in a history database, and (with a
:class:`Policy`) applies memory-saving actions to embedding tables at safe points.
"""

from __future__ import annotations

import edo_monitor._checkout  # noqa: F401  (first: maps agent/ and tui/ in a checkout)
from edo_monitor.agent.monitor import Monitor, RunSummary, watch
from edo_monitor.errors import (
    AlreadyWatchedError,
    BudgetOutOfMemoryError,
    ConfigError,
    EdoMonitorError,
    RunNotFoundError,
    StoreError,
)
from edo_monitor.estimate import Estimate, estimate
from edo_monitor.oom import OomInfo, parse_oom_message
from edo_monitor.policy import Policy
from edo_monitor.readings import Reading
from edo_monitor.store.history import History

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
    "parse_oom_message",
    "watch",
]
