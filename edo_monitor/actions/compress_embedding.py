"""``compress_embedding``: lossy compression of the largest device-tier table (opt-in).

Variants (each registered as its own action name):

* ``compress_embedding_bf16`` / ``compress_embedding_fp16``: the same ``Parameter`` object is
  re-stored as bf16/fp16, its gradient and per-element optimizer state (Adam's ``exp_avg``,
  ``exp_avg_sq`` ...) converted to the same dtype (``torch.optim`` needs state and parameter dtypes
  to match); the module becomes :class:`edo_monitor.nn.LowPrecisionEmbedding`, whose output is
  cast back to the old dtype. Trainable or frozen tables. bf16 keeps fp32's exponent range (Adam's
  ``eps`` and small squared gradients do not underflow), so it is the default for trainable tables;
  fp16 is refused for a trainable table whose optimizer ``eps`` (Adam's 1e-8) underflows in fp16
  (the state would divide by zero: NaN within a few steps).
* ``compress_embedding_int8``: frozen tables (``requires_grad=False``) only, as
  :class:`edo_monitor.nn.Int8RowwiseEmbedding` (int8 rows plus one fp32 scale per row, ≈ 4×
  smaller); the old parameter leaves the optimizer.
* ``compress_embedding_lowrank``: :class:`edo_monitor.nn.LowRankEmbedding` at rank
  ``round(embedding_dim * ActionContext.low_rank_fraction)``; for a trainable table the two factors
  take the old parameter's place in its optimizer group (same hyper-parameters, fresh state).
* ``compress_embedding``: bf16 for trainable tables, int8 for frozen ones.

The ``padding_idx`` row stays exact (int8/low-rank keep it in a buffer; fp16/bf16 refuse a padding
row that the dtype cannot hold exactly). Refused: DDP/FSDP models, tied weights, a weight read
outside its module's forward (``actions.tables.outside_use_blocker``; needs a recorded step),
``sparse=True`` and ``max_norm`` (both not preserved), ``scale_grad_by_freq`` on a trainable
low-rank table, tables already at 16 bits or less.

The recorded error compares the table as the model now computes it with the table before:
``max_abs_error`` and the row cosine (mean, min), padding row excluded.

The plan's :attr:`~edo_monitor.plans.Plan.expected_error` (relative squared error of a looked-up
row): bf16/fp16 :func:`edo_monitor.plans.rounding_expected_error` (``(2 ln 2 / 9) u²``, no rows
read); int8 :func:`~edo_monitor.actions.expected_error.int8_rowwise_expected_error` and low-rank
:func:`~edo_monitor.actions.expected_error.lowrank_expected_error`, on at most a bounded sample of
rows, weighted by the lookup counts when ``ActionContext.lookup_counter`` has them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from edo_monitor.accounting import tensor_bytes, tensor_bytes_as
from edo_monitor.actions.base import Action, ActionContext, Plan, Refusal, find_wrapped_parallel
from edo_monitor.actions.expected_error import (
    int8_rowwise_expected_error,
    lowrank_expected_error,
    table_distribution,
)
from edo_monitor.actions.tables import (
    TableCandidate,
    convert_optimizer_state,
    device_tables,
    outside_use_blocker,
    replace_module,
    replace_param_in_optimizers,
    sharing_users,
)
from edo_monitor.nn import (
    EmbeddingOptions,
    Int8RowwiseEmbedding,
    LowPrecisionEmbedding,
    LowRankEmbedding,
    row_error,
)
from edo_monitor.plans import rounding_expected_error
from edo_monitor.units import format_bytes

__all__ = ["VARIANTS", "CompressEmbedding"]

logger = logging.getLogger(__name__)

VARIANTS: tuple[str, ...] = ("auto", "bf16", "fp16", "int8", "lowrank")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _group_values(ctx: ActionContext, param: nn.Parameter, key: str) -> list[Any]:
    """The ``key`` hyper-parameter of every optimizer group holding ``param``."""
    return [
        g[key]
        for opt in ctx.optimizers
        for g in opt.param_groups
        if key in g and any(p is param for p in g["params"])
    ]


class CompressEmbedding(Action):
    """Compress the largest eligible table with ``variant`` (see the module docstring). Lossy."""

    lossy = True

    def __init__(self, variant: str = "auto") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}; expected one of {VARIANTS}")
        self.variant = variant
        self.name = "compress_embedding" if variant == "auto" else f"compress_embedding_{variant}"

    def _variant_for(self, t: TableCandidate) -> str:
        if self.variant != "auto":
            return self.variant
        return "bf16" if t.weight.requires_grad else "int8"

    def _blocker(self, ctx: ActionContext, t: TableCandidate, variant: str) -> str | None:
        opts = EmbeddingOptions.from_module(t.module)
        w = t.weight
        users = sharing_users(ctx.model, t.module, w)
        if users:
            return f"weight is tied to {', '.join(users)}"
        outside = outside_use_blocker(ctx.activation_profile, t.name)
        if outside:
            return outside
        if opts.sparse:
            return "sparse=True is not preserved by compression"
        if opts.max_norm is not None:
            return "max_norm is not preserved by compression (it rewrites rows in place)"
        if not w.is_floating_point() or w.element_size() <= 2:
            return f"weight is {w.dtype}, already 16 bits or less"
        if variant in _DTYPES:
            tiny = torch.finfo(_DTYPES[variant]).tiny
            for eps in _group_values(ctx, w, "eps"):
                if w.requires_grad and isinstance(eps, float) and eps < tiny:
                    return (
                        f"optimizer eps={eps:g} underflows in {variant} (its state would divide "
                        "by zero); use bf16"
                    )
            if opts.padding_idx is not None:
                row = w.detach()[opts.padding_idx]
                if not torch.equal(row.to(_DTYPES[variant]).to(w.dtype), row):
                    return f"padding row is not exactly representable in {variant}"
        elif variant == "int8":
            if w.requires_grad:
                return "int8 row-wise is for frozen tables (requires_grad=False)"
        elif variant == "lowrank":
            if w.requires_grad and opts.scale_grad_by_freq:
                return "scale_grad_by_freq is not preserved by a trainable low-rank table"
            if self._lowrank_bytes(ctx, t) >= t.params_bytes:
                return f"rank {self._rank(ctx, t)} would not be smaller than the table"
        return None

    @staticmethod
    def _rank(ctx: ActionContext, t: TableCandidate) -> int:
        d = int(t.module.embedding_dim)
        n = int(t.module.num_embeddings)
        return max(1, min(n, d, round(d * ctx.low_rank_fraction)))

    def _lowrank_bytes(self, ctx: ActionContext, t: TableCandidate) -> int:
        n, d = t.weight.shape
        k = self._rank(ctx, t)
        pad = d if t.module.padding_idx is not None else 0
        return (n * k + k * d + pad) * t.weight.element_size()

    def _estimate(self, ctx: ActionContext, t: TableCandidate, variant: str) -> int:
        w = t.weight
        n, d = w.shape
        if variant in _DTYPES:
            dtype = _DTYPES[variant]
            # the weight and its (dense, derived) gradient halve; so does per-element state
            saved = (t.params_bytes - tensor_bytes_as(w, dtype)) * (2 if t.grads_bytes else 1)
            for opt in ctx.optimizers:
                for v in list((opt.state.get(w) or {}).values()):
                    if isinstance(v, torch.Tensor) and v.shape == w.shape and v.is_floating_point():
                        saved += tensor_bytes(v) - tensor_bytes_as(v, dtype)
            return saved
        if variant == "int8":
            pad = d * w.element_size() if t.module.padding_idx is not None else 0
            return t.total_bytes - (n * d + n * 4 + pad)
        return t.total_bytes - self._lowrank_bytes(ctx, t)

    def _expected_error(self, ctx: ActionContext, t: TableCandidate, variant: str) -> float:
        """:attr:`Plan.expected_error` of ``variant`` on ``t`` (see the module docstring)."""
        if variant in _DTYPES:
            return rounding_expected_error(variant)
        dist = table_distribution(ctx.lookup_counter, t.name, int(t.module.num_embeddings))
        pad = t.module.padding_idx
        if variant == "int8":
            return int8_rowwise_expected_error(t.weight, dist, pad)
        return lowrank_expected_error(t.weight, self._rank(ctx, t), dist, pad)

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        """Pick the largest table this variant can compress; estimate = bytes saved right after;
        ``expected_error`` as the module docstring says (only the chosen table's rows are read)."""
        wrapper = find_wrapped_parallel(ctx.model)
        if wrapper:
            return self.refuse(
                "", f"model is wrapped in {wrapper}; compressing a shard is unsupported"
            )
        tables = device_tables(ctx.model, ctx.optimizers, ctx.cuda_mode)
        if not tables:
            return self.refuse("", "no uncompressed embedding table left on the device tier")
        reasons = []
        for t in tables:
            variant = self._variant_for(t)
            blocker = self._blocker(ctx, t, variant)
            if blocker:
                reasons.append(f"{t.name}: {blocker}")
                continue
            est = self._estimate(ctx, t, variant)
            details: dict[str, Any] = {
                "variant": variant,
                "trainable": bool(t.weight.requires_grad),
                "dtype_before": str(t.weight.dtype),
            }
            if variant == "lowrank":
                details["rank"] = self._rank(ctx, t)
            err = self._expected_error(ctx, t, variant)
            return Plan(
                self.name,
                t.name,
                est,
                f"{variant} compression of {t.name} saves {format_bytes(est)} "
                f"(expected error {err:.2g})",
                details,
                expected_error=err,
            )
        return self.refuse(tables[0].name, "; ".join(reasons))

    def _apply(
        self, ctx: ActionContext, plan: Plan
    ) -> tuple[dict[str, Any], dict[str, float] | None]:
        module = ctx.model.get_submodule(plan.target)
        weight: nn.Parameter = module.weight
        options = EmbeddingOptions.from_module(module)
        variant = plan.details["variant"]
        original = weight.detach()
        old_dtype = weight.dtype
        skip = (options.padding_idx,) if options.padding_idx is not None else ()
        new: nn.Module
        if variant in _DTYPES:
            dtype = _DTYPES[variant]
            weight.data = original.to(dtype)
            if weight.grad is not None:
                weight.grad = weight.grad.to(dtype)
            ctx.stage("weight_converted")
            convert_optimizer_state(ctx.optimizers, weight, dtype=dtype)
            ctx.stage("optimizer_state_converted")
            new = LowPrecisionEmbedding(weight, options, old_dtype)
            approx = weight.detach()
        elif variant == "int8":
            new = Int8RowwiseEmbedding(original, options, old_dtype)
            ctx.stage("quantized")
            replace_param_in_optimizers(ctx.optimizers, weight, [])
            approx = new.dequantized()
        else:
            rank = int(plan.details["rank"])
            new = LowRankEmbedding.from_weight(
                original, rank, options, requires_grad=weight.requires_grad
            )
            ctx.stage("factorized")
            replace_param_in_optimizers(
                ctx.optimizers, weight, [new.left, new.right] if weight.requires_grad else []
            )
            ctx.stage("optimizer_updated")
            approx = new.reconstructed()
        new.train(module.training)
        places = replace_module(ctx.model, module, new)
        ctx.stage("module_replaced")
        error = row_error(original, approx, skip)
        return {"places": places, "dtype_after": str(approx.dtype)}, error
