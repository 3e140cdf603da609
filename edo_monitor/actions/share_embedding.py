"""``share_embedding``: turn the largest table into a hot/cold :class:`HybridEmbedding` (lossy).

The ``K`` most looked-up ids keep rows of their own; every other id shares one of ``B`` hashed
buckets (:mod:`edo_monitor.nn.sharing`). ``K = round(N × ActionContext.share_hot_fraction)`` (but
no more ids than were seen looking up) and ``B = max(1, round(N × share_bucket_fraction))``; the
defaults (5 % and 5 %) make a table about 10× smaller. The hot ids come from
``ActionContext.lookup_counter`` (an :class:`edo_monitor.measure.frequency.LookupCounter` watching
the table); without counts every id is cold (plain hashing).

Conversion keeps the model working and the optimizer consistent:

* hot rows are copied; each bucket starts as the mean of its members' rows;
* the old ``Parameter`` leaves every optimizer group holding it and ``hot_weight`` and
  ``cold_weight`` take its place (same group, same hyper-parameters); its per-element state
  (Adam's moments, momentum buffers, Adagrad's sums) is mapped the same way (hot rows copied,
  bucket means), scalar state (``step``) is copied to each new parameter, so bias correction and
  schedules go on where they were;
* a dense gradient is mapped by sum (the gradient of a shared row is the sum of its members');
  a sparse gradient is dropped (``None``: it is stale at a step boundary and its dense form could
  be as large as the table).

Refused: DDP/FSDP models, tied weights, a trainable weight no optimizer of the run steps or whose
optimizer state is not per-element (``actions.tables.optimizer_blocker``), ``max_norm``,
``scale_grad_by_freq``, non-float tables, and tables the sizes would not make smaller. The recorded
error compares the rows the model now computes with the rows before:
:func:`edo_monitor.nn.row_error` over every row, and ``lookup_relative_error`` = Σ p_i ‖w_i − w'_i‖²
/ Σ p_i ‖w_i‖² over every id, ``p`` the lookups' distribution
(:func:`~edo_monitor.actions.expected_error.table_distribution`: Good–Turing from the counts, ids
not counted yet sharing their estimated share; uniform without counts), which is what the next
batches will feel. (Over the counted lookups alone it read 0 whenever every counted id was hot,
where the next batches saw 0.57.) The plan's :attr:`~edo_monitor.decide.plans.Plan.expected_error`
estimates that same quantity before converting, from bounded samples of rows
(:func:`~edo_monitor.actions.expected_error.share_expected_error`: the cold lookups' share times the
error of replacing a row by its bucket's mean).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from edo_monitor.actions.base import Action, ActionContext, find_wrapped_parallel
from edo_monitor.actions.compress_embedding import bytes_after_next_step
from edo_monitor.actions.expected_error import (
    LookupDistribution,
    share_expected_error,
    table_distribution,
)
from edo_monitor.actions.tables import (
    TableCandidate,
    device_tables,
    optimizer_blocker,
    outside_use_blocker,
    replace_module,
    replace_param_in_optimizers,
    tied_blocker,
)
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.nn import EmbeddingOptions, row_error
from edo_monitor.nn.sharing import HybridEmbedding
from edo_monitor.units import format_bytes

__all__ = ["ShareEmbedding"]

logger = logging.getLogger(__name__)


class _Rows:
    """Rows ``[start:stop]`` of a module's table computed on demand (for :func:`row_error`)."""

    def __init__(self, module: HybridEmbedding, n: int) -> None:
        self.module, self.n = module, n

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(self.n)
        return self.module.rows(torch.arange(start, stop, device=self.module.hot_ids.device))


def _is_sparse(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.layout != torch.strided


class ShareEmbedding(Action):
    """Convert the largest eligible table into a hot/cold hybrid (see the module docstring)."""

    name = "share_embedding"
    lossy = True

    @staticmethod
    def _sizes(ctx: ActionContext, t: TableCandidate) -> tuple[int, int]:
        n = int(t.module.num_embeddings)
        k = round(n * ctx.share_hot_fraction)
        counter = ctx.lookup_counter
        if counter is not None and t.name in counter.tables:
            k = min(k, int((counter.counts(t.name) > 0).sum()))
        else:
            k = 0
        return k, max(1, round(n * ctx.share_bucket_fraction))

    @staticmethod
    def _blocker(ctx: ActionContext, t: TableCandidate, k: int, b: int) -> str | None:
        opts = EmbeddingOptions.from_module(t.module)
        tied = tied_blocker(ctx.model, t.module, t.weight)
        if tied:
            return tied
        outside = outside_use_blocker(ctx.activation_profile, t.name)
        if outside:
            return outside
        held = optimizer_blocker(ctx.optimizers, t.weight)
        if held:
            return held
        for opt in ctx.optimizers:
            sparse = [k for k, v in opt.state.get(t.weight, {}).items() if _is_sparse(v)]
            if sparse:  # SGD's momentum of a sparse=True table: no rows to split
                return f"{type(opt).__name__}'s state {sparse[0]!r} is a sparse tensor"
        if opts.max_norm is not None:
            return "max_norm is not preserved by sharing (it rewrites shared rows in place)"
        if opts.scale_grad_by_freq:
            return "scale_grad_by_freq is not preserved by sharing"
        if not t.weight.is_floating_point():
            return f"weight is {t.weight.dtype}"
        if k + b >= opts.num_embeddings:
            return f"{k} hot rows + {b} buckets would not be fewer than {opts.num_embeddings} rows"
        return None

    @staticmethod
    def _new_bytes(ctx: ActionContext, t: TableCandidate, k: int, b: int) -> int:
        """Device bytes of the hybrid after the next step: rows, hot ids, padding row, gradient,
        optimizer state (:func:`~edo_monitor.actions.compress_embedding.bytes_after_next_step`,
        the count ``edo_monitor.estimate`` makes for ``"hybrid:K:B"``)."""
        return bytes_after_next_step(ctx, t, ("hybrid", k, b)).total_with_step_bytes

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Pick the largest table that sharing makes smaller; estimate = bytes saved right after;
        ``expected_error`` from :func:`~edo_monitor.actions.expected_error.share_expected_error`
        (only the chosen table's rows are read, a bounded sample of them)."""
        wrapper = find_wrapped_parallel(ctx.model)
        if wrapper:
            return self.refuse("", f"model is wrapped in {wrapper}; sharing a shard is unsupported")
        tables = device_tables(ctx.model, ctx.optimizers, ctx.cuda_mode)
        if not tables:
            return self.refuse("", "no plain embedding table left on the device tier")
        reasons = []
        for t in tables:
            k, b = self._sizes(ctx, t)
            blocker = self._blocker(ctx, t, k, b)
            if blocker:
                reasons.append(f"{t.name}: {blocker}")
                continue
            est = t.total_bytes - self._new_bytes(ctx, t, k, b)
            details: dict[str, Any] = {"hot_ids": k, "buckets": b, "seed": 0}
            hot = torch.zeros(0, dtype=torch.long)
            if ctx.lookup_counter is not None and t.name in ctx.lookup_counter.tables:
                freq = ctx.lookup_counter.frequency(t.name, k)
                details["hot_share_fraction"] = freq.top_share_fraction
                hot = torch.tensor(freq.top_ids, dtype=torch.long)
            dist = table_distribution(ctx.lookup_counter, t.name, int(t.module.num_embeddings))
            err = share_expected_error(t.weight, hot, b, dist, t.module.padding_idx)
            return Plan(
                self.name,
                t.name,
                est,
                f"sharing {t.name} ({k} hot rows, {b} buckets) saves {format_bytes(est)} "
                f"(expected error {err:.2g})",
                details,
                expected_error=err,
            )
        return self.refuse_tables(tables, reasons)

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        module = ctx.model.get_submodule(plan.target)
        weight: nn.Parameter = module.weight
        options = EmbeddingOptions.from_module(module)
        k, b, seed = plan.details["hot_ids"], plan.details["buckets"], plan.details["seed"]
        counter = ctx.lookup_counter
        hot = counter.hot_ids(plan.target, k) if k else torch.zeros(0, dtype=torch.long)
        new = HybridEmbedding.from_weight(weight, options, hot, b, seed=seed)
        new.train(module.training)
        ctx.stage("converted")
        # with no hot ids, hot_weight is an empty (0, D) parameter: it stays out of the optimizer
        new_params = [new.hot_weight, new.cold_weight] if k else [new.cold_weight]

        def split(tensor: torch.Tensor, reduce: str) -> list[torch.Tensor]:
            hot_part, cold_part = new.split_rows(tensor, reduce=reduce)
            return [hot_part, cold_part] if k else [cold_part]

        if weight.grad is not None and not weight.grad.is_sparse:
            for p, g in zip(new_params, split(weight.grad, "sum"), strict=True):
                p.grad = g
        old_states = [(opt, opt.state.get(weight)) for opt in ctx.optimizers]
        trainable = new_params if weight.requires_grad else []
        replace_param_in_optimizers(ctx.optimizers, weight, trainable)
        for opt, state in old_states:
            if not state or not trainable:
                continue
            converted: list[dict[str, Any]] = [{} for _ in trainable]
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.shape == weight.shape:
                    parts = split(v, "mean")
                else:  # scalars such as Adam's step: each new parameter goes on from there
                    parts = [v.clone() if isinstance(v, torch.Tensor) else v for _ in trainable]
                for target, part in zip(converted, parts, strict=True):
                    target[key] = part
            for p, st in zip(trainable, converted, strict=True):
                opt.state[p] = st
        ctx.stage("optimizer_updated")
        places = replace_module(ctx.model, module, new)
        ctx.stage("module_replaced")
        n = options.num_embeddings
        skip = (options.padding_idx,) if options.padding_idx is not None else ()
        error = row_error(weight.detach(), _Rows(new, n), skip)
        dist = table_distribution(counter, plan.target, n)
        error["lookup_relative_error"] = self._lookup_error(weight.detach(), new, dist)
        return {"places": places, "hot_ids": k, "buckets": b}, error

    @staticmethod
    def _lookup_error(
        original: torch.Tensor, new: HybridEmbedding, dist: LookupDistribution
    ) -> float:
        """Σ p_i ‖w_i − w'_i‖² / Σ p_i ‖w_i‖² over every id, ``p`` from ``dist`` (the ids not
        counted share ``dist.p0`` evenly). One pass over the table, in chunks."""
        n = original.shape[0]
        probs = torch.full((n,), dist.p0 / max(1, n - dist.seen_ids.numel()), dtype=torch.float64)
        probs[dist.seen_ids] = dist.seen_probs
        num = den = 0.0
        chunk = 65536
        for start in range(0, n, chunk):
            part = torch.arange(start, min(n, start + chunk), device=original.device)
            ref = original[part].double()
            got = new.rows(part).detach().double()
            p = probs[start : start + chunk].to(ref.device)
            num += float((p * (ref - got).pow(2).sum(1)).sum())
            den += float((p * ref.pow(2).sum(1)).sum())
        return num / den if den else 0.0
