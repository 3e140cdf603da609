"""``release_cache``: return the caching allocator's wholly free segments to the driver.

``torch.cuda.empty_cache()`` gives back only memory that no block uses: a segment (one
``cudaMalloc``) is released when all of it is free, and a segment with one live block stays whole
however much of it is cached. So the reserved-but-unallocated bytes (``reserved - allocated``) are
an upper bound of what it frees, not an estimate. The estimate is
:func:`edo_monitor.measure.fragmentation.releasable_bytes` of an allocator snapshot of the watched
device (``ActionContext.memory_snapshot``, by default ``torch.cuda.memory_snapshot()``; a snapshot
covers every device, so other devices' segments are left out).

Applicable only on CUDA, and only when that estimate is at least
``ActionContext.release_cache_min_bytes``; in CPU-budget mode there is no allocator cache, so it is
refused as not applicable. Measured bytes are the allocator's reserved bytes
(``torch.cuda.memory_reserved``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from edo_monitor.actions.base import Action, ActionContext
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.measure.fragmentation import releasable_bytes
from edo_monitor.units import format_bytes

__all__ = ["ReleaseCache"]

logger = logging.getLogger(__name__)


class ReleaseCache(Action):
    """``torch.cuda.empty_cache()`` when wholly free segments are large. Lossless."""

    name = "release_cache"
    lossy = False

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Estimate = bytes of the watched device's wholly free segments in a snapshot now."""
        if not ctx.cuda_mode:
            return self.refuse(
                "allocator", "not applicable in CPU-budget mode (no allocator cache)"
            )
        slack = ctx.reserved_unallocated_bytes
        snapshot = ctx.allocator_snapshot()
        if snapshot is None:
            return self.refuse("allocator", "no allocator snapshot (CUDA not initialised)")
        index = ctx.device.index if ctx.device is not None and ctx.device.type == "cuda" else None
        releasable = releasable_bytes(snapshot, index)
        if releasable < ctx.release_cache_min_bytes:
            held = "" if slack is None else f" (of {format_bytes(slack)} reserved but unallocated)"
            return self.refuse(
                "allocator",
                f"wholly free segments hold {format_bytes(releasable)}{held}, below "
                f"{format_bytes(ctx.release_cache_min_bytes)}; empty_cache() frees only those",
            )
        return Plan(
            self.name,
            "allocator",
            int(releasable),
            f"{format_bytes(releasable)} in wholly free segments",
            {"reserved_unallocated_bytes": slack, "releasable_bytes": int(releasable)},
        )

    def _measure(self, ctx: ActionContext) -> int:
        if ctx.cuda_mode and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.memory_reserved(ctx.device))
        return 0

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        ctx.stage("empty_cache")
        torch.cuda.empty_cache()
        return {}, None
