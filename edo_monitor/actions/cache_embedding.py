"""``cache_embedding`` and ``grow_cache``: a resizable device row cache over a host table.

``cache_embedding`` (on the default ladder, before ``offload_embedding``):

* when a table is already cached and its cache can give rows back (more rows than the peak unique
  ids of one batch, and at least a tenth of the bytes needed), it **shrinks** that cache: renewed
  pressure;
* else it converts the largest eligible ``nn.Embedding`` / ``nn.EmbeddingBag`` to a
  :class:`edo_monitor.nn.CachedTable`. The same ``Parameter`` object becomes the cache (its data,
  gradient and optimizer state are rebound to ``(C, D)`` tensors), the full table and its optimizer
  state move to host memory, and the optimizer is attached for exact catch-up (lossless).

Cache size ``C`` (rows): the rows that stay on the device after freeing the bytes needed to get
``free_fraction`` back to the re-arm level, ``need = in_use - (1 - rearm) * budget``; at least the
peak unique ids of one batch (the agent's lookup counter, or the cache's own peak so far), at
most ``N - 1``. Per row the device holds the weight, its gradient (trainable tables) and each
per-element optimizer state tensor, so the estimate is ``(N - C) * D * element_size * (1 + grad
+ states)``: exactly what the accounting measures before and after.

``grow_cache`` (not on the ladder: the policy asks for it when ``free_fraction`` stays above the
re-arm level plus a margin): grows the most-shrunk cache by the rows that fit in the spare bytes
above ``rearm + margin``; when that reaches the whole table, the table becomes an ordinary resident
``nn.Embedding`` / ``nn.EmbeddingBag`` again (same ``Parameter``). Its estimate is negative (bytes
it will use).

Refused: DDP/FSDP-wrapped models, tied weights, ``sparse=True`` tables, optimizers or settings the
cache cannot catch up exactly (named by :mod:`edo_monitor.nn.cached`), fused/capturable groups.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from edo_monitor.actions.base import Action, ActionContext, find_wrapped_parallel
from edo_monitor.actions.host_headroom import host_headroom
from edo_monitor.actions.tables import (
    device_tables,
    grad_edit_blocker,
    optimizer_holders,
    outside_use_blocker,
    replace_module,
    tied_blocker,
)
from edo_monitor.decide.plans import NOT_YET_KNOWN, Plan, Refusal, cache_rows_for
from edo_monitor.nn import EmbeddingOptions
from edo_monitor.nn.cache_parts import rebind_data
from edo_monitor.nn.cached import CachedTable
from edo_monitor.nn.optimizers import _group_of, _make_rule
from edo_monitor.units import format_bytes

__all__ = ["CacheEmbedding", "GrowCache", "peak_batch_ids"]

logger = logging.getLogger(__name__)


def peak_batch_ids(ctx: ActionContext, name: str, module: nn.Module) -> int | None:
    """Peak distinct ids of one forward of table ``name``: a cache's own count, else the agent's
    :class:`~edo_monitor.measure.frequency.LookupCounter` (``ctx.lookup_counter``); ``None`` when
    unseen."""
    if isinstance(module, CachedTable):
        return module.peak_unique_ids or None
    counter = ctx.lookup_counter
    return counter.peak_unique_ids(name) if counter is not None else None


def _state_tensors(optimizers: Sequence[torch.optim.Optimizer], param: nn.Parameter) -> int:
    """How many per-element state tensors ``param`` has now."""
    count = 0
    for opt in optimizers:
        state = opt.state.get(param, {})
        count += sum(
            1
            for v in state.values()
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape)
        )
    return count


MIN_RESIZE_BYTES = 64 * 1024
"""A resize of a cache that saves (or costs) less than this is not planned: the demo's second
shrink saved 7.5 KiB for a full re-layout of the cache (issue 23, item 3)."""


def _row_bytes(
    param: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer], *, cached: bool = False
) -> int:
    """Device bytes per row: weight + gradient (a trainable resident table; a cache row has
    none: only the touched rows' gradient exists) + per-element optimizer state."""
    per = param.shape[1] * param.element_size()
    grad = int(param.requires_grad and not cached)
    return per * (1 + grad + _state_tensors(optimizers, param))


def _need_bytes(ctx: ActionContext) -> int | None:
    """Bytes to free to get back to the re-arm level, or ``None`` without a reading."""
    if ctx.budget_bytes is None or ctx.in_use_bytes is None or ctx.rearm_free_fraction is None:
        return None
    return max(0, math.ceil(ctx.in_use_bytes - (1 - ctx.rearm_free_fraction) * ctx.budget_bytes))


def _optimizer_refusal(
    optimizers: Sequence[torch.optim.Optimizer], param: nn.Parameter, steps_done: int | None
) -> str:
    holders = optimizer_holders(optimizers, param)
    if len(holders) > 1:
        return "stepped by more than one optimizer"
    if not holders and param.requires_grad:
        if not optimizers and steps_done == 0:  # one not given to watch(): known at its step
            return (
                f"{NOT_YET_KNOWN[1]} (the row cache steps its rows by the table's optimizer, "
                "known from its first step)"
            )
        return (
            "no optimizer of the run steps it (a loop without torch.optim updates the "
            "parameters itself, and the row cache steps its rows by the table's optimizer)"
        )
    for opt in holders:
        try:
            _make_rule(opt, _group_of(opt, param), 0, dtype=param.dtype)
        except ValueError as exc:
            return str(exc)
    return ""


class CacheEmbedding(Action):
    """Cache the largest eligible table on the device (or shrink an existing cache). Lossless."""

    name = "cache_embedding"
    lossy = False
    #: where the host table lives (``spill_embedding``: a memory-mapped file); see host_headroom
    tier_words = "in host memory"
    spill = False

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Shrink a cache that can give rows back, else convert the largest eligible table."""
        wrapper = find_wrapped_parallel(ctx.model)
        if wrapper:
            return self.refuse("", f"model is wrapped in {wrapper}; caching a shard is unsupported")
        need = _need_bytes(ctx)
        kept = []  # the caches this action made that give nothing back, and why
        for name, module in () if self.spill else ctx.model.named_modules():
            if not isinstance(module, CachedTable) or not getattr(module, "edo_action_made", False):
                continue  # a cache the user built is the user's to size
            floor_rows = max(1, module.peak_unique_ids) + module.block_rows
            row_bytes = _row_bytes(module.weight, ctx.optimizers, cached=True)
            spare_rows = module.cache_rows - floor_rows
            if spare_rows < module.block_rows:
                kept.append(f"{name}: no spare rows ({module.cache_rows} hold a batch's ids)")
                continue
            if need is not None and spare_rows * row_bytes * 10 < need:
                kept.append(f"{name}: its spare rows free under a tenth of what is needed")
                continue  # let the ladder move on
            give = spare_rows if need is None else min(spare_rows, -(-need // row_bytes))
            give = max(module.block_rows, give - give % module.block_rows)
            if give * row_bytes < MIN_RESIZE_BYTES:
                kept.append(
                    f"{name}: shrinking frees {format_bytes(give * row_bytes)}, under the "
                    f"{format_bytes(MIN_RESIZE_BYTES)} a re-layout is worth"
                )
                continue  # the ladder moves on
            to_rows = module.cache_rows - give
            return Plan(
                self.name,
                name,
                give * row_bytes,
                f"shrink the row cache of {name} from {module.cache_rows} to {to_rows} rows",
                {
                    "resize": "shrink",
                    "from_rows": module.cache_rows,
                    "to_rows": to_rows,
                    "num_embeddings": module.num_embeddings,
                },
            )
        tables = device_tables(ctx.model, ctx.optimizers, ctx.cuda_mode)
        if not tables:
            why = "no embedding table left on the device tier to cache"
            return self.refuse("", "; ".join([*kept, why]))
        reasons = list(kept)  # "<table>: <why>", each cache kept and each table not cached
        for t in tables:
            module, weight = t.module, t.weight
            tied = tied_blocker(ctx.model, module, weight)
            if tied:
                reasons.append(f"{t.name}: {tied}")
                continue
            if getattr(module, "sparse", False):
                reasons.append(f"{t.name}: sparse=True is not supported by the row cache")
                continue
            refusal = _optimizer_refusal(ctx.optimizers, weight, ctx.steps_done)
            if refusal:
                reasons.append(f"{t.name}: {refusal}")
                continue
            outside = outside_use_blocker(ctx.activation_profile, t.name) or grad_edit_blocker(
                ctx.activation_profile, t.name
            )
            if outside:  # the cache changes the weight's shape: a read elsewhere would break
                reasons.append(f"{t.name}: {outside}")
                continue
            headroom = host_headroom(ctx, weight, ctx.optimizers)
            if headroom.short != self.spill:  # short: the disk tier's; else the host's
                enough = "enough for a row cache (spill only when short)" if self.spill else "short"
                reasons.append(f"{t.name}: host memory is {enough}: {headroom.words()}")
                continue
            n = int(weight.shape[0])
            row_bytes = _row_bytes(weight, ctx.optimizers)
            cached_bytes = _row_bytes(weight, ctx.optimizers, cached=True)
            peak = peak_batch_ids(ctx, t.name, module)
            floor_rows = max(1, peak if peak is not None else min(n, 1024))
            if need is None:
                rows = max(floor_rows, n // 10)
            else:
                rows = cache_rows_for(n, floor_rows, need, row_bytes)
            if rows >= n:
                reasons.append(
                    f"{t.name}: a cache of the peak ids per batch ({floor_rows}) would hold the "
                    f"whole table ({n} rows)"
                )
                continue
            saving = n * row_bytes - rows * cached_bytes
            if saving < MIN_RESIZE_BYTES:
                reasons.append(
                    f"{t.name}: caching it would free {format_bytes(saving)}, under the minimum "
                    f"{format_bytes(MIN_RESIZE_BYTES)}"
                )
                continue
            return Plan(
                self.name,
                t.name,
                saving,
                f"largest table {t.name}: keep {rows} of {n} rows on the device, the table and its "
                f"optimizer state {self.tier_words} (frees {format_bytes(saving)})",
                {
                    "resize": "create",
                    "to_rows": rows,
                    "num_embeddings": n,
                    "peak_batch_ids": peak,
                    "kind": type(module).__name__,
                    "host_table_bytes": headroom.table_bytes,
                    "host_available_bytes": headroom.available_bytes,
                },
            )
        if kept:  # the reasons name more tables than the candidates
            return self.refuse("", "; ".join(reasons))
        return self.refuse_tables(tables, reasons)

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        module = ctx.model.get_submodule(plan.target)
        rows = int(plan.details["to_rows"])
        if isinstance(module, CachedTable):
            _resize(ctx, module, rows)
            return {"cache_rows": module.cache_rows, "host_bytes": module.host_bytes()}, None
        weight = module.weight
        options = EmbeddingOptions.from_module(module)
        device = weight.device
        table = CachedTable(
            options,
            weight.detach(),
            rows,
            device=device,
            requires_grad=weight.requires_grad,
            host_alloc=self.host_alloc(ctx),
        )
        table._cancel_auto_attach()  # attached below, to every optimizer holding the weight
        ctx.stage("host_table_made")
        cache = table._parameters["weight"]
        table._parameters["weight"] = weight  # the same Parameter object becomes the cache
        grad = weight.grad
        spent = grad is not None and ctx.grad_spent is not None and ctx.grad_spent(weight)
        weight.grad = None
        rebind_data(weight, cache.data)
        ctx.stage("weight_moved")
        holders = optimizer_holders(ctx.optimizers, weight)
        try:
            for opt in holders:
                table.attach(opt)
            if spent:
                # spent by the table's last step: a zero gradient from here on (as after
                # zero_grad(set_to_none=False)), as the cache's own steps leave it
                table.batch_rows.grad = torch.zeros_like(table.batch_rows)
            elif grad is not None:
                # waiting for the table's step (a safe point between the backward and it:
                # Monitor.step() there, another optimizer stepped first): it is the step's
                table.take_table_grad(grad)
            ctx.stage("optimizer_attached")
            table.train(module.training)
            table.edo_action_made = True
            table.edo_name = plan.target  # named in the cache's own log lines
            places = replace_module(ctx.model, module, table)
            ctx.stage("module_replaced")
        except BaseException:
            table._release_optimizer(hand_back=False)
            raise
        table._auto_attach()  # a new optimizer stepping the model later takes the table over
        return {
            **self.tier_details(ctx),
            "places": places,
            "cache_rows": table.cache_rows,
            "host_bytes": table.host_bytes(),
            "pinned": bool(table.host_weight.is_pinned()),
        }, None

    def host_alloc(self, ctx: ActionContext) -> Any:
        """The host table's allocator: ``None`` = host memory (``spill_embedding``: its file)."""
        return None

    def tier_details(self, ctx: ActionContext) -> dict[str, Any]:
        """Extra result details of the tier (``spill_embedding``: the file)."""
        return {}


def _resize(ctx: ActionContext, module: CachedTable, rows: int) -> None:
    """Resize with the module's bookkeeping rebound, not edited, so a Transaction can undo it."""
    module.block_to_slot = module.block_to_slot.clone()
    module.last_step = module.last_step.clone()
    module.slot_pinned = module.slot_pinned.clone()
    module.resize(rows)
    ctx.stage("cache_resized")


class GrowCache(Action):
    """Give a cache rows back when memory allows; the whole table makes it resident again."""

    name = "grow_cache"
    lossy = False

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Grow the smallest cache (relative to its table) into the spare bytes above the margin."""
        caches = [
            (name, m)
            for name, m in ctx.model.named_modules()
            if isinstance(m, CachedTable) and getattr(m, "edo_action_made", False)
        ]
        if not caches:
            return self.refuse("", "no row cache made by cache_embedding")
        if ctx.budget_bytes is None or ctx.in_use_bytes is None or ctx.rearm_free_fraction is None:
            return self.refuse("", "no reading to size the growth")
        keep_free = (ctx.rearm_free_fraction + ctx.grow_margin_fraction) * ctx.budget_bytes
        spare = ctx.budget_bytes - ctx.in_use_bytes - keep_free
        name, module = min(caches, key=lambda c: c[1].cache_rows / c[1].num_embeddings)
        row_bytes = _row_bytes(module.weight, ctx.optimizers, cached=True)
        rows = int(spare // row_bytes)
        rows -= rows % module.block_rows
        if rows < module.block_rows:
            return self.refuse(name, f"spare {format_bytes(max(0, int(spare)))} is below one block")
        n = module.num_embeddings
        # resident again, the table has its dense (N, D) gradient back: a cost a cache row has not
        grad_bytes = n * (_row_bytes(module.weight, ctx.optimizers) - row_bytes)
        to_rows = min(n, module.cache_rows + rows)
        if to_rows >= n and (n - module.cache_rows) * row_bytes + grad_bytes > spare:
            to_rows = (n - 1) // module.block_rows * module.block_rows  # stay a cache
        grow_rows = to_rows - module.cache_rows
        resident = to_rows >= n
        if not resident and grow_rows * row_bytes < MIN_RESIZE_BYTES:
            return self.refuse(
                name,
                f"growing by {format_bytes(max(0, grow_rows) * row_bytes)} is under the minimum",
            )
        cost = grow_rows * row_bytes + (grad_bytes if resident else 0)
        return Plan(
            self.name,
            name,
            -cost,
            f"grow the row cache of {name} from {module.cache_rows} to {to_rows} rows"
            + (" (the whole table: resident again)" if resident else ""),
            {
                "resize": "resident" if resident else "grow",
                "from_rows": module.cache_rows,
                "to_rows": to_rows,
                "num_embeddings": module.num_embeddings,
            },
        )

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        module = ctx.model.get_submodule(plan.target)
        assert isinstance(module, CachedTable)
        if plan.details["resize"] != "resident":
            _resize(ctx, module, int(plan.details["to_rows"]))
            return {"cache_rows": module.cache_rows}, None
        plain = _to_resident(ctx, module)
        return {"cache_rows": module.num_embeddings, "kind": type(plain).__name__}, None


def _to_resident(ctx: ActionContext, module: CachedTable) -> nn.Module:
    """Replace ``module`` by a plain table holding the same ``Parameter`` (full table again)."""
    module.last_step = module.last_step.clone()
    module.flush()  # host rows current (host values only become current: harmless to keep)
    weight = module.weight
    device = weight.device
    full = module.host_weight.to(device, copy=True)
    # the touched rows' pending gradient becomes the table's; without one (the step consumed it)
    # the resident table still gets its dense gradient, zero, as a resident table has it at the
    # step boundary: the bytes the grow plan counts are there from now on, not at the next
    # backward (a zero gradient adds nothing to what that backward accumulates)
    pending = module.dense_grad()
    new_grad = torch.zeros_like(full) if weight.requires_grad else None
    if pending is not None and new_grad is not None:
        new_grad[pending[0].to(device)] = pending[1].to(full.dtype)
    state = module._opt_state()
    new_state = {  # the keys in use and those a setting switched off, whole on the host
        k: module.host_state[k].to(device, copy=True) for k in module.host_state if k in state
    }
    weight.grad = None
    rebind_data(weight, full)
    weight.grad = new_grad
    for k, v in new_state.items():
        state[k] = v
    ctx.stage("weight_moved")
    o = module.options
    if o.bag_mode is None:
        plain: nn.Module = nn.Embedding(
            o.num_embeddings, o.embedding_dim, o.padding_idx, o.max_norm, o.norm_type,
            o.scale_grad_by_freq, o.sparse, device="meta",
        )  # fmt: skip
    else:
        plain = nn.EmbeddingBag(
            o.num_embeddings, o.embedding_dim, o.max_norm, o.norm_type, o.scale_grad_by_freq,
            o.bag_mode, o.sparse, include_last_offset=o.include_last_offset,
            padding_idx=o.padding_idx, device="meta",
        )  # fmt: skip
    plain._parameters["weight"] = weight
    plain.train(module.training)
    replace_module(ctx.model, module, plain)
    ctx.stage("module_replaced")
    module._cancel_auto_attach()  # the plain table holds the weight: the cache lets it go
    module._release_optimizer(hand_back=False)  # last: cannot fail
    return plain
