"""Host probe: this process's resident memory and the host's available memory (psutil)."""

from __future__ import annotations

import logging
from typing import Any

import psutil

from edo_monitor.probes import EventCallback, ignore_event

__all__ = ["HostProbe"]

logger = logging.getLogger(__name__)


class HostProbe:
    """``process_rss_bytes`` from ``psutil.Process().memory_info().rss`` and
    ``host_available_bytes`` from ``psutil.virtual_memory().available``."""

    def __init__(self, *, on_event: EventCallback = ignore_event) -> None:
        self._process = psutil.Process()
        self._on_event = on_event
        self._failed = False

    def read(self) -> dict[str, Any]:
        """One reading; ``None`` fields when psutil fails (reported once). Never raises."""
        if self._failed:
            return {"process_rss_bytes": None, "host_available_bytes": None}
        try:
            return {
                "process_rss_bytes": int(self._process.memory_info().rss),
                "host_available_bytes": int(psutil.virtual_memory().available),
            }
        except Exception as exc:
            self._failed = True
            logger.warning("host probe failed: %s", exc)
            self._on_event("probe_unavailable", f"host: {exc}", {"source": "host"})
            return {"process_rss_bytes": None, "host_available_bytes": None}
