"""CUDA caching-allocator probe: ``torch.cuda.memory_stats``, ``mem_get_info``, snapshots.

The agent is never the first to initialise CUDA in a process: reading allocator stats or
``mem_get_info`` creates a CUDA context, and a context made before a ``fork`` breaks the children
(DataLoader workers). Until ``torch.cuda.is_initialized()`` is true every field reads ``None``
("unavailable"), not zero.

``torch.cuda.memory_snapshot()`` walks every segment and costs more than the stats, so it is taken
only every ``snapshot_interval_s``; in between the last fragmentation numbers are repeated.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from edo_monitor.measure.fragmentation import allocator_fields, snapshot_fragmentation
from edo_monitor.probes import EventCallback, ignore_event

__all__ = ["AllocatorProbe", "device_waits"]

logger = logging.getLogger(__name__)

_FIELDS = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "reserved_unallocated_bytes",
    "peak_allocated_bytes",
    "num_alloc_retries",
    "num_ooms",
)
_SNAPSHOT_FIELDS = ("fragmentation", "largest_inactive_block_bytes", "segment_count")


class AllocatorProbe:
    """Reads PyTorch's caching allocator for one CUDA device.

    The four callables are the hardware boundary; tests pass recorded stats and snapshots.

    Args:
        device_index: torch CUDA device index.
        snapshot_interval_s: seconds between ``memory_snapshot()`` calls; ``0`` disables them.
        on_event: callback for ``probe_unavailable`` events.
    """

    def __init__(
        self,
        device_index: int = 0,
        *,
        snapshot_interval_s: float = 5.0,
        on_event: EventCallback = ignore_event,
        is_initialized: Callable[[], bool] = torch.cuda.is_initialized,
        memory_stats: Callable[[int], Mapping[str, Any]] = torch.cuda.memory_stats,
        memory_snapshot: Callable[[], list[dict[str, Any]]] = torch.cuda.memory_snapshot,
        mem_get_info: Callable[[int], tuple[int, int]] = torch.cuda.mem_get_info,
    ) -> None:
        self.device_index = device_index
        self.snapshot_interval_s = snapshot_interval_s
        self._on_event = on_event
        self._is_initialized = is_initialized
        self._memory_stats = memory_stats
        self._memory_snapshot = memory_snapshot
        self._mem_get_info = mem_get_info
        self._last_snapshot_s = -float("inf")
        self._snapshot: dict[str, Any] = dict.fromkeys(_SNAPSHOT_FIELDS)
        self._failed: set[str] = set()

    def _fail(self, what: str, exc: BaseException) -> None:
        if what in self._failed:
            return
        self._failed.add(what)
        logger.warning("CUDA allocator: %s failed: %s", what, exc)
        self._on_event(
            "probe_unavailable",
            f"CUDA allocator: {what} failed: {type(exc).__name__}: {exc}",
            {"source": "cuda", "field": what},
        )

    def read(self, *, with_device_info: bool = False, now_s: float | None = None) -> dict[str, Any]:
        """One reading; never raises, never initialises CUDA.

        Args:
            with_device_info: also read ``device_total/free/used_bytes`` from ``mem_get_info``
                (used when NVML is unavailable).
            now_s: monotonic time for the snapshot schedule (default ``time.monotonic()``).
        """
        out: dict[str, Any] = dict.fromkeys(_FIELDS + _SNAPSHOT_FIELDS)
        try:
            if not self._is_initialized():
                return out
        except Exception as exc:
            self._fail("is_initialized", exc)
            return out
        if "memory_stats" not in self._failed:
            try:
                out.update(allocator_fields(self._memory_stats(self.device_index)))
            except Exception as exc:
                self._fail("memory_stats", exc)
        if with_device_info and "mem_get_info" not in self._failed:
            try:
                free, total = self._mem_get_info(self.device_index)
                out.update(
                    device_total_bytes=int(total),
                    device_free_bytes=int(free),
                    device_used_bytes=int(total) - int(free),
                )
            except Exception as exc:
                self._fail("mem_get_info", exc)
        now = time.monotonic() if now_s is None else now_s
        due = now - self._last_snapshot_s >= self.snapshot_interval_s
        if self.snapshot_interval_s > 0 and due and "memory_snapshot" not in self._failed:
            self._last_snapshot_s = now
            try:
                # a snapshot covers every device: measure the watched one only
                frag = snapshot_fragmentation(self._memory_snapshot(), self.device_index)
                self._snapshot = {
                    "fragmentation": frag.fragmentation,
                    "largest_inactive_block_bytes": frag.largest_inactive_block_bytes,
                    "segment_count": frag.segment_count,
                }
            except Exception as exc:
                self._fail("memory_snapshot", exc)
        out.update(self._snapshot)
        return out


def device_waits(run: Callable[[], None]) -> int:
    """How many times ``run`` makes the host wait for the CUDA device: each synchronizing call
    that torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns about (a copy
    to the host, ``.item()``, a blocking copy from pageable memory, ``torch.unique``'s size, ...).
    The device is synchronized first; the mode is reset to 0 afterwards, also when ``run`` raises
    (which propagates). Needs CUDA (``torch.cuda.synchronize`` raises without it)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)
