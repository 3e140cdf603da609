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
* ``compress_embedding_int4`` / ``compress_embedding_int2``: frozen tables only, as
  :class:`edo_monitor.nn.lowbit.GroupwiseEmbedding` (group-wise affine codes, two int4 / four int2
  a byte, a float16 scale and zero-point per ``group_size`` columns).
* ``compress_embedding_2of8``: frozen tables only, as
  :class:`edo_monitor.nn.lowbit.Sparse2of8Embedding` (2 of every 8 values kept by magnitude, at
  2 bits, with 3-bit positions).
* ``compress_embedding_perrow``: frozen tables only, with lookup counts
  (``ActionContext.lookup_counter``): :class:`edo_monitor.nn.lowbit.PerRowPrecisionEmbedding`.
  ``per_row="hot"`` (the registered default): the ``share_hot_fraction`` most counted rows keep
  full precision, the others int4; ``per_row="cold"``: the rows counted fewer than ``cold_below``
  times keep full precision (the design source's "rare words keep FP32"), the others int4.
  Measured on MovieLens and MiniLM (docs/benchmarks.md): hot-full has the lower error for the
  bytes.
* ``compress_embedding``: bf16 for trainable tables, int8 for frozen ones.

The ``padding_idx`` row stays exact (int8/low-rank keep it in a buffer; fp16/bf16 refuse a padding
row that the dtype cannot hold exactly). Refused: DDP/FSDP models, tied weights, a weight read
outside its module's forward (``actions.tables.outside_use_blocker``; needs a recorded step), a
trainable weight no optimizer of the run steps or whose optimizer state is not per-element
(``actions.tables.optimizer_blocker``), ``sparse=True`` and ``max_norm`` (both not preserved),
``scale_grad_by_freq`` on a trainable low-rank table, tables already at 16 bits or less, and every
variant whose estimated saving is zero or less (int8 or int4 of a 1-column table: its per-row scale
or per-group scale and zero-point outweigh the float; ``perrow`` when every row keeps full
precision; a rank that is not smaller), the reason naming the bytes after and now. The rules that
need only what a run records (the variant ``compress_embedding`` picks, 16 bits or less, frozen
only, the rank, not smaller) are :mod:`edo_monitor.decide.compress_rules`, which ``replay`` calls
too.

**Bytes saved.** The plan's ``estimated_saving_bytes`` and the recorded ``saved_bytes`` are the
saving *after the next optimizer step*: the table's bytes now (weight, the dense gradient it has
at every step, its optimizer state) less :func:`bytes_after_next_step`, the count
``edo_monitor.estimate`` makes (:func:`edo_monitor.decide.estimate.table_bytes`), with the new
tensors' gradient and as many per-element state tensors as the old weight had. bf16/fp16 convert
gradient and state in place, so what is measured right after the swap is already that. The
trainable low-rank factors have no gradient and no state until their first step: measured right
after the swap, the old table's gradient and Adam moments counted as freed while the factors'
own came one step later (17.9 MB recorded for 10.2 MB saved on a 20,000 × 64 table with Adam at
rank 32). So this action's :meth:`~CompressEmbedding._measure` adds what the factors still lack
(their gradient, and the state the old weight had, per element and per tensor) to the bytes it
measures: the recorded saving is what stays saved for the rest of the run, which is what the
policy's ineffective check, the forecast's saved-bytes add-back and explain/replay read it as.
Before the table's first step (no optimizer state yet) neither side counts state: the saving is
then understated, never overstated.

The recorded error compares the table as the model now computes it with the table before:
``max_abs_error`` and the row cosine (mean, min), padding row excluded.

The plan's :attr:`~edo_monitor.decide.plans.Plan.expected_error` (relative squared error of a
looked-up row): bf16/fp16 :func:`edo_monitor.decide.plans.rounding_expected_error` (``(2 ln 2 / 9)
u²``, no rows read); int8 :func:`~edo_monitor.actions.expected_error.int8_rowwise_expected_error`
and low-rank
:func:`~edo_monitor.actions.expected_error.lowrank_expected_error`, on at most a bounded sample of
rows, weighted by the lookup counts when ``ActionContext.lookup_counter`` has them; the low-bit
formats :func:`~edo_monitor.actions.expected_error.lowbit_expected_error` (the sampled rows
quantised as the action will, their error measured).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from edo_monitor.actions.base import Action, ActionContext, find_wrapped_parallel
from edo_monitor.actions.expected_error import (
    int8_rowwise_expected_error,
    lowbit_expected_error,
    lowrank_expected_error,
    table_distribution,
)
from edo_monitor.actions.tables import (
    TableCandidate,
    convert_optimizer_state,
    device_tables,
    grad_edit_blocker,
    optimizer_blocker,
    outside_use_blocker,
    replace_module,
    replace_param_in_optimizers,
    tied_blocker,
)
from edo_monitor.checks import int_choice, whole_number
from edo_monitor.decide.compress_rules import (
    chosen_variant,
    lowrank_rank,
    not_smaller_reason,
    variant_refusal,
)
from edo_monitor.decide.estimate import TableBytes, table_bytes
from edo_monitor.decide.plans import Plan, Refusal, rounding_expected_error
from edo_monitor.measure.accounting import tensor_bytes
from edo_monitor.nn import (
    EmbeddingOptions,
    Int8RowwiseEmbedding,
    LowPrecisionEmbedding,
    LowRankEmbedding,
    row_error,
)
from edo_monitor.nn.lowbit import (
    GroupwiseEmbedding,
    PerRowPrecisionEmbedding,
    Sparse2of8Embedding,
)
from edo_monitor.nn.table_checks import check_representable
from edo_monitor.units import format_bytes

__all__ = ["VARIANTS", "CompressEmbedding", "bytes_after_next_step", "state_layout"]

logger = logging.getLogger(__name__)

VARIANTS: tuple[str, ...] = (
    "auto",
    "bf16",
    "fp16",
    "int8",
    "lowrank",
    "int4",
    "int2",
    "2of8",
    "perrow",
)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_LOW_BITS = {"int4": 4, "int2": 2}
PER_ROW_MODES: tuple[str, ...] = ("hot", "cold")


def _group_values(ctx: ActionContext, param: nn.Parameter, key: str) -> list[Any]:
    """The ``key`` hyper-parameter of every optimizer group holding ``param``."""
    return [
        g[key]
        for opt in ctx.optimizers
        for g in opt.param_groups
        if key in g and any(p is param for p in g["params"])
    ]


def state_layout(ctx: ActionContext, param: nn.Parameter) -> tuple[int, int]:
    """What the optimizers keep for ``param`` now: ``(per-element state tensors, bytes of the
    other state tensors)``, summed over the optimizers holding it (Adam after a step: ``(2, 4)``
    on a CPU budget; ``(2, 0)`` on CUDA, whose ``step`` is a host scalar; ``(0, 0)`` before the
    first step). Only tensors of the device tier count, as ``TableCandidate`` counts them."""
    per_element = other_bytes = 0
    for opt in ctx.optimizers:
        for v in list((opt.state.get(param) or {}).values()):
            if not isinstance(v, torch.Tensor):
                continue
            if v.shape == param.shape:
                per_element += 1
            elif v.is_cuda or not ctx.cuda_mode:
                other_bytes += tensor_bytes(v)
    return per_element, other_bytes


def bytes_after_next_step(
    ctx: ActionContext, t: TableCandidate, compression: str | tuple[Any, ...]
) -> TableBytes:
    """Bytes of table ``t`` under ``compression`` once the next optimizer step has run:
    :func:`edo_monitor.decide.estimate.table_bytes` (the count ``edo_monitor.estimate`` makes)
    with ``t``'s element size, whether it trains, the state the optimizers keep for it now
    (:func:`state_layout`: the new tensors get as many) and its padding row (kept in a buffer).

    Raises:
        edo_monitor.errors.ConfigError: a compression the table's sizes do not allow.
    """
    w = t.weight
    per_element, other_bytes = state_layout(ctx, w)
    return table_bytes(
        int(t.module.num_embeddings),
        int(t.module.embedding_dim),
        compression,
        element_bytes=w.element_size(),
        trainable=w.requires_grad,
        state_tensors=per_element,
        step_bytes_per_tensor=other_bytes,
        padding_row=t.module.padding_idx is not None,
    )


#: Attribute of a trainable low-rank factor made by this action: the optimizer state bytes it gets
#: at its first step, while it has none yet (the codebase marks parameters so, as ``_edo_host``).
#: Read by :meth:`CompressEmbedding._measure`; removed once the factor has a gradient and state.
FIRST_STEP_STATE_ATTR = "_edo_first_step_state_bytes"


def _first_step_bytes(ctx: ActionContext) -> int:
    """The gradient and optimizer state the low-rank factors of ``ctx.model`` made by this
    action still lack and get at their first step (training thread: reads ``.grad``)."""
    total = 0
    for p in ctx.model.parameters():
        state_bytes = getattr(p, FIRST_STEP_STATE_ATTR, None)
        if state_bytes is None:
            continue
        has_grad = p.grad is not None
        has_state = any(opt.state.get(p) for opt in ctx.optimizers)
        if has_grad and has_state:
            delattr(p, FIRST_STEP_STATE_ATTR)
            continue
        total += (0 if has_grad else tensor_bytes(p)) + (0 if has_state else state_bytes)
    return total


class CompressEmbedding(Action):
    """Compress the largest eligible table with ``variant`` (see the module docstring). Lossy."""

    lossy = True

    def __init__(
        self,
        variant: str = "auto",
        *,
        group_size: int = 64,
        per_row: str = "hot",
        cold_below: int = 100,
        per_row_bits: int = 4,
    ) -> None:
        """Args: ``variant`` (one of :data:`VARIANTS`); for the low-bit variants ``group_size``
        (columns per scale and zero-point, a multiple of 8); for ``perrow`` ``per_row``
        (``"hot"`` or ``"cold"``, see the module docstring), ``cold_below`` (counted lookups)
        and ``per_row_bits`` (4 or 2, the low-bit rows).

        Raises:
            ValueError: naming the bad value and what is allowed.
        """
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}; expected one of {VARIANTS}")
        group_size = whole_number(group_size, "group_size", 8)
        if group_size % 8:
            raise ValueError(f"group_size={group_size}; expected a positive multiple of 8")
        if per_row not in PER_ROW_MODES:
            raise ValueError(f"per_row={per_row!r}; expected one of {PER_ROW_MODES}")
        per_row_bits = int_choice(per_row_bits, "per_row_bits", (4, 2))
        cold_below = whole_number(cold_below, "cold_below", 1)
        self.variant = variant
        self.group_size = group_size
        self.per_row = per_row
        self.cold_below = cold_below
        self.per_row_bits = per_row_bits
        self.name = "compress_embedding" if variant == "auto" else f"compress_embedding_{variant}"

    def _variant_for(self, t: TableCandidate) -> str:
        return chosen_variant(self.variant, t.weight.requires_grad)

    def _blocker(self, ctx: ActionContext, t: TableCandidate, variant: str) -> str | None:
        opts = EmbeddingOptions.from_module(t.module)
        w = t.weight
        tied = tied_blocker(ctx.model, t.module, w)
        if tied:
            return tied
        outside = outside_use_blocker(ctx.activation_profile, t.name)
        if outside:
            return outside
        held = optimizer_blocker(ctx.optimizers, w)
        if held:
            return held
        if opts.sparse:
            return "sparse=True is not preserved by compression"
        if opts.max_norm is not None:
            return "max_norm is not preserved by compression (it rewrites rows in place)"
        rule = variant_refusal(
            variant,
            trainable=w.requires_grad,
            dtype=str(w.dtype),
            element_bytes=w.element_size(),
            floating=w.is_floating_point(),
        )
        if rule:
            return rule
        if variant in _DTYPES:
            try:
                check_representable(w, _DTYPES[variant], variant)
            except ValueError as exc:
                return str(exc)
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
        elif variant == "perrow":
            counter = ctx.lookup_counter
            if counter is None or t.name not in counter.tables:
                return "per-row precision needs lookup counts (a LookupCounter on the table)"
            if int(counter.counts(t.name).sum()) == 0:
                return "per-row precision needs lookup counts (none counted yet)"
        elif variant == "lowrank" and w.requires_grad:
            if opts.scale_grad_by_freq:
                return "scale_grad_by_freq is not preserved by a trainable low-rank table"
            return grad_edit_blocker(ctx.activation_profile, t.name)  # the factors' gradients
        return None

    @staticmethod
    def _rank(ctx: ActionContext, t: TableCandidate) -> int:
        n, d = int(t.module.num_embeddings), int(t.module.embedding_dim)
        return lowrank_rank(n, d, ctx.low_rank_fraction)

    def _compression(self, ctx: ActionContext, t: TableCandidate, variant: str) -> Any:
        """``variant`` on ``t`` as a compression of :func:`~edo_monitor.decide.estimate.table_bytes`
        (``("lowrank", rank)``, ``("int4", group_size)``, ``("perrow", K, bits, group_size)`` …)."""
        if variant == "lowrank":
            return ("lowrank", self._rank(ctx, t))
        if variant in ("int4", "int2", "2of8"):
            return (variant, self.group_size)
        if variant == "perrow":
            k = int(self._full_ids(ctx, t.name).numel())
            return ("perrow", k, self.per_row_bits, self.group_size)
        return variant  # bf16, fp16, int8

    def _estimate(self, ctx: ActionContext, t: TableCandidate, variant: str) -> int:
        """Bytes saved once the next step has run: ``t``'s bytes now less
        :func:`bytes_after_next_step` (the new tensors' gradient and optimizer state counted)."""
        after = bytes_after_next_step(ctx, t, self._compression(ctx, t, variant))
        return t.total_bytes - after.total_with_step_bytes

    def _not_smaller(self, ctx: ActionContext, t: TableCandidate, variant: str, est: int) -> str:
        """The refusal of a ``variant`` that saves ``est <= 0`` bytes, naming the bytes."""
        what = f"rank {self._rank(ctx, t)}" if variant == "lowrank" else variant
        return not_smaller_reason(what, t.total_bytes, est)

    def _full_ids(self, ctx: ActionContext, table: str) -> torch.Tensor:
        """``perrow``: the ids that keep full precision, from the lookup counts (a pass over the
        ``(N,)`` host counts, never over the table): the ``share_hot_fraction`` most counted
        (``per_row="hot"``), or the ids counted fewer than ``cold_below`` times (``"cold"``)."""
        counts = ctx.lookup_counter.counts(table).detach().to("cpu", torch.long)
        n = int(counts.numel())
        if self.per_row == "hot":
            k = max(1, min(n, round(n * ctx.share_hot_fraction)))
            return torch.sort(torch.topk(counts, k, sorted=False).indices).values
        return torch.nonzero(counts < self.cold_below).flatten()

    def _expected_error(self, ctx: ActionContext, t: TableCandidate, variant: str) -> float:
        """:attr:`Plan.expected_error` of ``variant`` on ``t`` (see the module docstring)."""
        if variant in _DTYPES:
            return rounding_expected_error(variant)
        dist = table_distribution(ctx.lookup_counter, t.name, int(t.module.num_embeddings))
        pad = t.module.padding_idx
        if variant == "int8":
            return int8_rowwise_expected_error(t.weight, dist, pad)
        if variant in _LOW_BITS:
            return lowbit_expected_error(
                t.weight,
                dist,
                pad,
                fmt="groupwise",
                bits=_LOW_BITS[variant],
                group_size=self.group_size,
            )
        if variant == "2of8":
            return lowbit_expected_error(
                t.weight, dist, pad, fmt="2of8", group_size=self.group_size
            )
        if variant == "perrow":
            return lowbit_expected_error(
                t.weight,
                dist,
                pad,
                fmt="groupwise",
                bits=self.per_row_bits,
                group_size=self.group_size,
                full_ids=self._full_ids(ctx, t.name),
            )
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
            if est <= 0:  # e.g. int8 of a 1-column table, perrow with every row counted cold
                reasons.append(f"{t.name}: {self._not_smaller(ctx, t, variant, est)}")
                continue
            details: dict[str, Any] = {
                "variant": variant,
                "trainable": bool(t.weight.requires_grad),
                "dtype_before": str(t.weight.dtype),
            }
            if variant == "lowrank":
                details["rank"] = self._rank(ctx, t)
            if variant in ("int4", "int2", "2of8", "perrow"):
                details["group_size"] = self.group_size
            if variant == "perrow":
                details["per_row"] = self.per_row
                details["bits"] = self.per_row_bits
                details["full_rows"] = int(self._full_ids(ctx, t.name).numel())
                if self.per_row == "cold":
                    details["cold_below"] = self.cold_below
            try:
                err = self._expected_error(ctx, t, variant)
            except ValueError as exc:  # a sampled row the format cannot hold (beyond float16)
                reasons.append(f"{t.name}: {exc}")
                continue
            return Plan(
                self.name,
                t.name,
                est,
                f"{variant} compression of {t.name} saves {format_bytes(est)} "
                f"(expected error {err:.2g})",
                details,
                expected_error=err,
            )
        return self.refuse_tables(tables, reasons)

    def _measure(self, ctx: ActionContext) -> int:
        """The device-tier bytes (:meth:`Action._measure`) plus the gradient and optimizer state
        that trainable low-rank factors made by this action get at their first step and lack
        until then (:func:`_first_step_bytes`), so the recorded ``saved_bytes`` is the saving
        after the next step (module docstring)."""
        return super()._measure(ctx) + _first_step_bytes(ctx)

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
        elif variant in ("int4", "int2", "2of8", "perrow"):
            gs = int(plan.details["group_size"])
            if variant == "2of8":
                new = Sparse2of8Embedding(original, options, gs, old_dtype)
            elif variant == "perrow":
                full = self._full_ids(ctx, plan.target)
                new = PerRowPrecisionEmbedding(
                    original, full, options, int(plan.details["bits"]), gs, old_dtype
                )
            else:
                new = GroupwiseEmbedding(original, options, _LOW_BITS[variant], gs, old_dtype)
            ctx.stage("quantized")
            replace_param_in_optimizers(ctx.optimizers, weight, [])
            approx = new.dequantized()
        else:
            rank = int(plan.details["rank"])
            per_element, other_bytes = state_layout(ctx, weight)  # before it leaves the optimizer
            new = LowRankEmbedding.from_weight(
                original, rank, options, requires_grad=weight.requires_grad
            )
            ctx.stage("factorized")
            replace_param_in_optimizers(
                ctx.optimizers, weight, [new.left, new.right] if weight.requires_grad else []
            )
            if weight.requires_grad:  # what the factors get at their first step (see _measure)
                for factor in (new.left, new.right):
                    state_bytes = per_element * tensor_bytes(factor) + other_bytes
                    setattr(factor, FIRST_STEP_STATE_ATTR, state_bytes)
            ctx.stage("optimizer_updated")
            approx = new.reconstructed()
        new.train(module.training)
        places = replace_module(ctx.model, module, new)
        ctx.stage("module_replaced")
        error = row_error(original, approx, skip)
        return {"places": places, "dtype_after": str(approx.dtype)}, error
