"""Whether the host can hold a row cache's host table: the rule between ``cache_embedding`` and
``spill_embedding`` (issue 24, item 4).

A row cache keeps the full table and its per-element optimizer state on the host: ``N * D *
element_size * (1 + states)`` bytes, ``states`` the optimizer's per-row state keys (Adam: 2, SGD
with momentum: 1; counted from the optimizer's settings, so before its first step too). The host
is *short* when its available memory (``ActionContext.host_available_bytes``, the reading's, else
:func:`edo_monitor.probes.host.host_memory` read now: the smaller of the machine's and the
cgroup's) minus :data:`HOST_MARGIN_BYTES` cannot hold them. ``cache_embedding`` refuses then and
``spill_embedding`` (the same cache over a memory-mapped file) plans only then; an unreadable host
is not short (the cache plans as before the disk tier existed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from edo_monitor.actions.base import ActionContext
from edo_monitor.nn.optimizers import ROW_STATE_KEYS, _group_of, optimizer_row_state_keys

__all__ = ["HOST_MARGIN_BYTES", "HostHeadroom", "host_headroom"]

logger = logging.getLogger(__name__)

HOST_MARGIN_BYTES = 256 * 1024 * 1024
"""Host bytes kept free beyond a row cache's host table (the process and the kernel need some)."""


@dataclass(frozen=True)
class HostHeadroom:
    """``table_bytes``: host table + its optimizer state; ``available_bytes``: the host's
    available memory (``None`` unreadable); ``short``: ``available - margin < table_bytes``."""

    table_bytes: int
    available_bytes: int | None
    short: bool

    def words(self) -> str:
        """``"needs 1.2 GiB on the host, 800 MiB available (256 MiB kept free)"``."""
        from edo_monitor.units import format_bytes

        avail = "unknown" if self.available_bytes is None else format_bytes(self.available_bytes)
        return (
            f"needs {format_bytes(self.table_bytes)} on the host, {avail} available "
            f"({format_bytes(HOST_MARGIN_BYTES)} kept free)"
        )


def _available_bytes(ctx: ActionContext) -> int | None:
    if ctx.host_available_bytes is not None:
        return int(ctx.host_available_bytes)
    from edo_monitor.probes import host as host_probe  # looked up now: tests fake it there

    try:
        return int(host_probe.host_memory()[0])
    except Exception:
        logger.debug("host memory unreadable", exc_info=True)
        return None


def host_headroom(
    ctx: ActionContext, weight: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer]
) -> HostHeadroom:
    """The host bytes a row cache of ``weight`` ``(N, D)`` keeps and whether the host is short."""
    states = 0
    for opt in optimizers:
        if any(p is weight for g in opt.param_groups for p in g["params"]):
            held = opt.state.get(weight, {})  # and a key a setting switched off, kept
            keys = set(optimizer_row_state_keys(opt, _group_of(opt, weight)))
            states += len(keys | {k for k in ROW_STATE_KEYS if held.get(k) is not None})
    table_bytes = weight.numel() * weight.element_size() * (1 + states)
    available = _available_bytes(ctx)
    short = available is not None and available - HOST_MARGIN_BYTES < table_bytes
    return HostHeadroom(table_bytes, available, short)
