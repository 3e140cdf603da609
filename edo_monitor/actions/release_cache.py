"""``release_cache``: return the caching allocator's unused blocks to the driver.

Applicable only on CUDA and only when the reserved-but-unallocated bytes (``reserved -
allocated``) are at least ``ActionContext.release_cache_min_bytes``; in CPU-budget mode there is no
allocator cache, so it is refused as not applicable. Measured bytes are the allocator's reserved
bytes (``torch.cuda.memory_reserved``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from edo_monitor.actions.base import Action, ActionContext, Plan, Refusal
from edo_monitor.units import format_bytes

__all__ = ["ReleaseCache"]

logger = logging.getLogger(__name__)


class ReleaseCache(Action):
    """``torch.cuda.empty_cache()`` when the cached slack is large. Lossless."""

    name = "release_cache"
    lossy = False

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Estimate = the reserved-but-unallocated bytes now."""
        if not ctx.cuda_mode:
            return self.refuse(
                "allocator", "not applicable in CPU-budget mode (no allocator cache)"
            )
        slack = ctx.reserved_unallocated_bytes
        if slack is None and torch.cuda.is_available():
            slack = torch.cuda.memory_reserved(ctx.device) - torch.cuda.memory_allocated(ctx.device)
        if slack is None or slack < ctx.release_cache_min_bytes:
            return self.refuse(
                "allocator",
                f"reserved-but-unallocated {format_bytes(slack)} is below "
                f"{format_bytes(ctx.release_cache_min_bytes)}",
            )
        return Plan(
            self.name,
            "allocator",
            int(slack),
            f"{format_bytes(slack)} reserved but unallocated",
        )

    def _measure(self, ctx: ActionContext) -> int:
        if ctx.cuda_mode and torch.cuda.is_available():
            return int(torch.cuda.memory_reserved(ctx.device))
        return 0

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        ctx.stage("empty_cache")
        torch.cuda.empty_cache()
        return {}, None
