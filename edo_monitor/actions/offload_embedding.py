"""``offload_embedding``: move the largest device-tier table to host memory.

The table's weight (the same ``Parameter`` object), its gradient and its optimizer state move to
host memory (pinned on CUDA); the module is replaced by
:class:`edo_monitor.nn.OffloadedEmbedding`, which looks up on the host and sends the result to the
training device. Every ``nn.Embedding`` / ``nn.EmbeddingBag`` option is preserved, so this action
is lossless: in CPU-budget mode the next losses are bit-identical to an untouched run.

Host memory: on CUDA the weight is copied once, straight into a pinned buffer (``torch.empty(...,
pin_memory=True)`` then ``copy_``; no pageable copy first), pageable only when pinning fails. The
caching host allocator rounds a pinned block up to a power of two, so the bytes actually pinned are
read from ``torch.cuda.host_memory_stats()`` (``active_bytes.current`` before and after) and
recorded as ``details["pinned_bytes"]``. Before anything moves, the host bytes the move allocates
(the weight rounded up as pinned, its gradient, its optimizer state: whatever is not in host memory
yet; nothing in CPU-budget mode, where the table already is) are checked against the host's
available bytes (``ActionContext.host_available_bytes``: the host probe's reading, the smaller of
the machine's and the cgroup's); the action refuses when they do not fit.

Refused for: DDP/FSDP-wrapped models; a weight tied to another module (the other module would then
compute with a host tensor, or the tie would break); a weight read outside its module's forward (an
output layer tied by use); a trainable weight no optimizer of the run steps, or whose optimizer
state is not per-element (``actions.tables.optimizer_blocker``); a weight whose optimizer group is
``fused`` or ``capturable`` (those need device tensors); no device-tier table left; not enough host
memory.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from edo_monitor.actions.base import Action, ActionContext, find_wrapped_parallel
from edo_monitor.actions.tables import (
    TableCandidate,
    convert_optimizer_state,
    device_tables,
    optimizer_blocker,
    optimizer_group_flags,
    outside_use_blocker,
    replace_module,
    tied_blocker,
)
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.measure.accounting import tensor_bytes
from edo_monitor.nn import EmbeddingOptions, OffloadedEmbedding
from edo_monitor.probes.host import host_memory
from edo_monitor.units import format_bytes

__all__ = ["OffloadEmbedding", "host_available_bytes", "host_bytes_needed"]

logger = logging.getLogger(__name__)


class OffloadEmbedding(Action):
    """Move the largest eligible table (weight, grad, optimizer state) to the host tier. Lossless.

    Estimate = the table's device-tier params + grads + optimizer-state bytes.
    """

    name = "offload_embedding"
    lossy = False

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Pick the largest table that can be offloaded; refusals name the first blocker."""
        wrapper = find_wrapped_parallel(ctx.model)
        if wrapper:
            return self.refuse(
                "", f"model is wrapped in {wrapper}; offloading a shard is unsupported"
            )
        tables = device_tables(ctx.model, ctx.optimizers, ctx.cuda_mode)
        if not tables:
            return self.refuse("", "no embedding table left on the device tier")
        reasons = []
        for t in tables:
            tied = tied_blocker(ctx.model, t.module, t.weight)
            if tied:
                reasons.append(f"{t.name}: {tied}")
                continue
            outside = outside_use_blocker(ctx.activation_profile, t.name)
            if outside:
                reasons.append(f"{t.name}: {outside}")
                continue
            held = optimizer_blocker(ctx.optimizers, t.weight)
            if held:
                reasons.append(f"{t.name}: {held}")
                continue
            flag = optimizer_group_flags(ctx.optimizers, t.weight)
            if flag:
                reasons.append(f"{t.name}: optimizer group uses {flag}=True (needs device tensors)")
                continue
            need = host_bytes_needed(ctx, t)
            available = ctx.host_available_bytes
            if need > 0 and available is None:
                available = host_available_bytes()
            if need > 0 and available is not None and need > available:
                reasons.append(
                    f"{t.name}: needs {format_bytes(need)} of host memory, "
                    f"{format_bytes(available)} available"
                )
                continue
            return Plan(
                self.name,
                t.name,
                t.total_bytes,
                f"largest table {t.name} ({format_bytes(t.total_bytes)} with grad and optimizer "
                "state) moves to host memory",
                {
                    "kind": type(t.module).__name__,
                    "params_bytes": t.params_bytes,
                    "grads_bytes": t.grads_bytes,
                    "optimizer_state_bytes": t.optimizer_state_bytes,
                    "host_bytes_needed": need,
                    "host_available_bytes": available,
                },
            )
        return self.refuse_tables(tables, reasons)

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        module = ctx.model.get_submodule(plan.target)
        weight = module.weight
        output_device = weight.device
        options = EmbeddingOptions.from_module(module)
        pinned_bytes = None
        if not weight.data.is_cpu:
            before = _pinned_active_bytes()
            weight.data = _host_copy(weight.detach())
            after = _pinned_active_bytes()
            if weight.is_pinned():
                pinned_bytes = after - before if None not in (before, after) else None
            if weight.grad is not None:
                weight.grad = weight.grad.to("cpu")
        OffloadedEmbedding.offload_parameter(weight)  # marks the tier (data is on the host)
        ctx.stage("weight_moved")
        convert_optimizer_state(ctx.optimizers, weight, device=weight.device)
        ctx.stage("optimizer_state_moved")
        new = OffloadedEmbedding(weight, options, output_device)
        new.train(module.training)
        places = replace_module(ctx.model, module, new)
        ctx.stage("module_replaced")
        return {
            "places": places,
            "pinned": bool(weight.is_pinned()),
            "pinned_bytes": pinned_bytes,
        }, None


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def host_bytes_needed(ctx: ActionContext, t: TableCandidate) -> int:
    """Host bytes offloading ``t`` allocates: every tensor of it not in host memory yet.

    The weight counts as the caching host allocator pins it (rounded up to a power of two) when
    CUDA is available; its gradient (derived: a dense trainable weight's own size) and optimizer
    state as :func:`~edo_monitor.measure.accounting.tensor_bytes` sizes them. 0 in CPU-budget mode.
    """
    w = t.weight
    if w.is_cpu:
        return 0
    need = _next_power_of_two(t.params_bytes) if torch.cuda.is_available() else t.params_bytes
    need += t.grads_bytes
    for opt in ctx.optimizers:
        for v in list((opt.state.get(w) or {}).values()):
            if isinstance(v, torch.Tensor) and not v.is_cpu:
                need += tensor_bytes(v)
    return need


def host_available_bytes() -> int | None:
    """Host bytes this process may still use now: :func:`edo_monitor.probes.host.host_memory`'s
    available bytes (the smaller of the machine's and the cgroup's); ``None`` if unreadable."""
    try:
        return int(host_memory()[0])
    except Exception:
        logger.debug("host memory unreadable", exc_info=True)
        return None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """One host copy of device tensor ``t``: pinned (allocated pinned, then filled), or pageable
    when pinned memory cannot be had."""
    if torch.cuda.is_available():
        try:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        except RuntimeError as exc:  # pinned memory can run out; pageable still works
            logger.warning("could not pin %d bytes (%s); using pageable", tensor_bytes(t), exc)
        else:
            host.copy_(t)
            return host
    return t.to("cpu")


def _pinned_active_bytes() -> int | None:
    """``active_bytes.current`` of the caching host (pinned) allocator, ``None`` if unknown."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is None or not torch.cuda.is_available():
        return None
    try:
        value = stats_fn().get("active_bytes.current")
    except Exception:
        return None
    return int(value) if isinstance(value, int) else None
