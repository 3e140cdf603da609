"""``offload_embedding``: move the largest device-tier table to host memory.

The table's weight (the same ``Parameter`` object), its gradient and its optimizer state move to
host memory (pinned on CUDA); the module is replaced by
:class:`edo_monitor.nn.OffloadedEmbedding`, which looks up on the host and sends the result to the
training device. Every ``nn.Embedding`` / ``nn.EmbeddingBag`` option is preserved, so this action
is lossless: in CPU-budget mode the next losses are bit-identical to an untouched run.

Refused for: DDP/FSDP-wrapped models; a weight tied to another module (the other module would then
compute with a host tensor, or the tie would break); a weight whose optimizer group is ``fused`` or
``capturable`` (those need device tensors); no device-tier table left.
"""

from __future__ import annotations

import logging
from typing import Any

from edo_monitor.actions.base import Action, ActionContext, Plan, Refusal, find_wrapped_parallel
from edo_monitor.actions.tables import (
    convert_optimizer_state,
    device_tables,
    optimizer_group_flags,
    outside_use_blocker,
    replace_module,
    sharing_users,
)
from edo_monitor.nn import EmbeddingOptions, OffloadedEmbedding
from edo_monitor.units import format_bytes

__all__ = ["OffloadEmbedding"]

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
            users = sharing_users(ctx.model, t.module, t.weight)
            if users:
                reasons.append(f"{t.name}: weight is tied to {', '.join(users)}")
                continue
            outside = outside_use_blocker(ctx.activation_profile, t.name)
            if outside:
                reasons.append(f"{t.name}: {outside}")
                continue
            flag = optimizer_group_flags(ctx.optimizers, t.weight)
            if flag:
                reasons.append(f"{t.name}: optimizer group uses {flag}=True (needs device tensors)")
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
                },
            )
        return self.refuse(tables[0].name, "; ".join(reasons))

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        module = ctx.model.get_submodule(plan.target)
        weight = module.weight
        output_device = weight.device
        options = EmbeddingOptions.from_module(module)
        OffloadedEmbedding.offload_parameter(weight)
        ctx.stage("weight_moved")
        convert_optimizer_state(ctx.optimizers, weight, device=weight.device)
        ctx.stage("optimizer_state_moved")
        new = OffloadedEmbedding(weight, options, output_device)
        new.train(module.training)
        places = replace_module(ctx.model, module, new)
        ctx.stage("module_replaced")
        return {"places": places, "pinned": bool(weight.is_pinned())}, None
