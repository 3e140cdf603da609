"""Where readings come from: the only code that touches hardware (NVML, the CUDA caching
allocator, the host). Takes a device; hands on a Reading's raw numbers.

Each probe fails softly: a source that cannot be read is marked unavailable with its reason
(logged once and reported through the ``on_event`` callback), its fields read ``None``, and the
sampler goes on with the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

#: ``on_event(kind, message, data)`` — how probes report a source becoming unavailable.
EventCallback = Callable[[str, str, Mapping[str, Any]], None]


def ignore_event(kind: str, message: str, data: Mapping[str, Any]) -> None:
    """An :data:`EventCallback` that does nothing."""
