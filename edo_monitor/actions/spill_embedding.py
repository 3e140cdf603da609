"""``spill_embedding``: the row cache of ``cache_embedding`` over the disk tier (issue 24, item 4).

A subclass of :class:`~edo_monitor.actions.cache_embedding.CacheEmbedding`, not a ``tier=``
option of it, so that the ladder records it as its own action (its own name in decisions,
events and ``explain``) and each of the two plans under the opposite host condition
(:mod:`edo_monitor.actions.host_headroom`): ``cache_embedding`` when the host can hold the full
table and its optimizer state, ``spill_embedding`` only when it cannot. Everything else (which
table, how many cache rows, the exact optimizer catch-up, the undo) is the cache's: the host table
and its optimizer state are allocated in this run's spill file
(:func:`edo_monitor.nn.spill.run_spill_file` in ``ActionContext.spill_dir``), ordinary CPU
tensors whose pages the kernel writes back to the file, so the cache works over them unchanged.
It does not shrink caches (``cache_embedding`` shrinks any cache, spilled or not).

Refused as ``cache_embedding`` is, and when no spill folder is set (``spill_dir=None``) or the
host is not short.
"""

from __future__ import annotations

from typing import Any

from edo_monitor.actions.base import ActionContext
from edo_monitor.actions.cache_embedding import CacheEmbedding
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.nn.spill import run_spill_file

__all__ = ["SpillEmbedding"]


class SpillEmbedding(CacheEmbedding):
    """Cache the largest eligible table with its host table in a memory-mapped file. Lossless."""

    name = "spill_embedding"
    lossy = False
    tier_words = "in the disk tier's memory-mapped file"
    spill = True

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """As ``cache_embedding``'s conversion, only when the host is short (module docstring)."""
        if ctx.spill_dir is None:
            return self.refuse("", "no spill folder (watch(spill_dir=...))")
        return super().plan(ctx)

    def host_alloc(self, ctx: ActionContext) -> Any:
        """This run's spill file's allocator (the file is made on first use)."""
        assert ctx.spill_dir is not None
        return run_spill_file(ctx.spill_dir).alloc

    def tier_details(self, ctx: ActionContext) -> dict[str, Any]:
        """The file's path and size after the move."""
        assert ctx.spill_dir is not None
        sf = run_spill_file(ctx.spill_dir)
        return {"spill_file": str(sf.path), "spill_file_bytes": sf.size_bytes}
