"""The modelled state of a run during a replay and the planner the replayed policy calls: each
action's effect modelled from the recorded attribution (for :mod:`replay`). Imports no torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from edo_monitor.decide.compress_rules import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_LOW_RANK_FRACTION,
    chosen_variant,
    lowrank_rank,
    not_smaller_reason,
    variant_refusal,
)
from edo_monitor.decide.plans import (
    ROOT_TABLE_REASON,
    Plan,
    Refusal,
    cache_rows_for,
    rounding_expected_error,
)
from edo_monitor.hindsight.recorded import MAX_CHECKPOINT_BLOCKS, _est, _Table
from edo_monitor.measure.module_tree import MODEL_MODULE
from edo_monitor.units import format_bytes

#: The compress actions replay models, by name → variant (``"auto"``: as the live action picks).
#: ``compress_embedding_perrow`` needs the lookup counts per row: not modelled.
_COMPRESS_VARIANTS = {
    "compress_embedding": "auto",
    "compress_embedding_bf16": "bf16",
    "compress_embedding_fp16": "fp16",
    "compress_embedding_int8": "int8",
    "compress_embedding_int4": "int4",
    "compress_embedding_int2": "int2",
    "compress_embedding_2of8": "2of8",
    "compress_embedding_lowrank": "lowrank",
}

#: The live plans' minimum resize (``actions.cache_embedding.MIN_RESIZE_BYTES``; this module
#: imports no torch).
MIN_RESIZE_BYTES = 64 * 1024


@dataclass
class _Model:
    """The modelled state of the run during a replay, and the planner the policy calls."""

    tables: dict[str, _Table]
    activations: dict[str, int]
    rearm_fraction: float
    grow_margin_fraction: float
    in_use_bytes: int = 0
    budget_bytes: int = 0
    checkpointed: set[str] = field(default_factory=set)
    #: ``(action, table) -> reason`` the live agent refused and never applied
    #: (:func:`~edo_monitor.hindsight.recorded.refused_live`): such a plan is refused here too
    refused: dict[tuple[str, str], str] = field(default_factory=dict)

    def need(self) -> int:
        return max(0, math.ceil(self.in_use_bytes - (1 - self.rearm_fraction) * self.budget_bytes))

    def device(self) -> list[_Table]:
        """The plain tables on the device, largest first (a table that is the model itself
        excepted: no table action takes it, :func:`_no_table`)."""
        plain = [
            t
            for t in self.tables.values()
            if t.on_device and t.cache_rows is None and t.module != MODEL_MODULE
        ]
        return sorted(plain, key=lambda t: -t.total_bytes)

    def _no_table(self, name: str) -> Refusal:
        """``name``'s refusal when :meth:`device` has no table: the live reason when the one left
        is the model itself (a bare table watched as the model), else none is left."""
        root = self.tables.get(MODEL_MODULE)
        if root is not None and root.on_device and root.cache_rows is None:
            return Refusal(name, MODEL_MODULE, f"{MODEL_MODULE}: {ROOT_TABLE_REASON}")
        return Refusal(name, "", "no embedding table left on the device tier")

    def __call__(self, name: str) -> Plan | Refusal:
        plan = self._planned(name)
        live = "compress_embedding" if name.startswith("compress_embedding") else name
        why = self.refused.get((live, plan.target)) if isinstance(plan, Plan) else None
        if why is not None:  # the optimizer, a hook, a tie: what the trace does not show
            return Refusal(name, plan.target, f"refused live: {why}")
        return plan

    def _planned(self, name: str) -> Plan | Refusal:
        if name == "release_cache":
            return Refusal(
                name,
                "allocator",
                "not modelled offline: the allocator's slack after the step is not in the trace",
            )
        if name == "share_embedding":
            return Refusal(name, "", "not modelled offline: needs the ids' frequency per row")
        if name == "cache_embedding":
            return self._cache()
        if name == "grow_cache":
            return self._grow()
        if name == "checkpoint_activations":
            return self._checkpoint()
        tables = self.device()
        if not tables:
            return self._no_table(name)
        t = tables[0]
        if name == "offload_embedding":
            return Plan(
                name,
                t.module,
                t.total_bytes,
                f"largest table {t.module} ({format_bytes(t.total_bytes)}) moves to host memory",
                {"model": "offload"},
            )
        variant = _COMPRESS_VARIANTS.get(name)
        if name == "spill_embedding":
            return Refusal(
                name,
                "",
                "not modelled offline: it applies only when host memory is too short for a row "
                "cache's host table, and the trace does not record the host's free memory",
            )
        if variant is None:
            return Refusal(name, "", f"not modelled offline: no model of {name} from the trace")
        return self._compress(name, variant, tables)

    def _compress(self, name: str, variant: str, tables: list[_Table]) -> Plan | Refusal:
        """``compress_embedding[_variant]`` as the live action plans it, from the recorded tables:
        the largest table the shared rules (:mod:`edo_monitor.decide.compress_rules`) allow and
        that the variant makes smaller, or the refusal of every one (reasons as the action's)."""
        reasons = []
        for t in tables:
            chosen = chosen_variant(variant, t.trainable)
            floating = t.dtype.startswith(("float", "bfloat"))
            rule = variant_refusal(
                chosen,
                trainable=t.trainable,
                dtype=f"torch.{t.dtype}",
                element_bytes=t.element_bytes,
                floating=floating,
            )
            if rule:
                reasons.append(f"{t.module}: {rule}")
                continue
            what = compression = chosen
            if chosen == "lowrank":
                k = lowrank_rank(t.num_embeddings, t.embedding_dim, DEFAULT_LOW_RANK_FRACTION)
                what, compression = f"rank {k}", f"lowrank:{k}"
            elif chosen in ("int4", "int2", "2of8"):
                compression = f"{chosen}:{DEFAULT_GROUP_SIZE}"
            saving = t.total_bytes - _est(t, compression)
            if saving <= 0:
                reasons.append(f"{t.module}: {not_smaller_reason(what, t.total_bytes, saving)}")
                continue
            expected = rounding_expected_error(chosen) if chosen in ("bf16", "fp16") else None
            return Plan(
                name,
                t.module,
                saving,
                f"{t.module} to {chosen} (the estimator)",
                {"model": "compress", "compression": compression, "variant": chosen},
                expected_error=expected,
            )
        return Refusal(name, tables[0].module if len(tables) == 1 else "", "; ".join(reasons))

    def _cache(self) -> Plan | Refusal:
        need = self.need()
        for t in self.tables.values():
            if t.cache_rows is None or not t.on_device:
                continue
            # as the live shrink: the peak ids of a batch and a block (one row) stay, a cached
            # row frees its own bytes (no dense gradient: a resident row's bytes gave 3 rows
            # for 4 under Adam), and a shrink under a tenth of the need or the minimum re-layout
            # is not worth it
            floor = t.cache_floor_rows + 1
            spare = t.cache_rows - floor
            row = t.cached_row_bytes
            if spare < 1 or spare * row * 10 < need:
                continue
            give = max(1, min(spare, -(-need // row)))
            if give * row < MIN_RESIZE_BYTES:
                continue
            return Plan(
                "cache_embedding",
                t.module,
                give * row,
                f"shrink the row cache of {t.module} from {t.cache_rows} to "
                f"{t.cache_rows - give} rows",
                {"model": "cache", "to_rows": t.cache_rows - give},
            )
        tables = self.device()
        if not tables:
            return self._no_table("cache_embedding")
        for t in tables:
            n = t.num_embeddings
            floor = t.cache_floor_rows
            rows = cache_rows_for(n, floor, need, t.row_bytes)
            if rows >= n:
                continue
            saving = n * t.row_bytes - rows * t.cached_row_bytes
            return Plan(
                "cache_embedding",
                t.module,
                saving,
                f"largest table {t.module}: keep {rows} of {n} rows on the device",
                {"model": "cache", "to_rows": rows},
            )
        return Refusal("cache_embedding", tables[0].module, "a cache would hold the whole table")

    def _grow(self) -> Plan | Refusal:
        caches = [t for t in self.tables.values() if t.cache_rows is not None and t.on_device]
        if not caches:
            return Refusal("grow_cache", "", "no row cache made by cache_embedding")
        keep_free = (self.rearm_fraction + self.grow_margin_fraction) * self.budget_bytes
        spare = self.budget_bytes - self.in_use_bytes - keep_free
        t = min(caches, key=lambda c: (c.cache_rows or 0) / c.num_embeddings)
        rows = int(spare // t.cached_row_bytes)
        if rows < 1:
            return Refusal("grow_cache", t.module, "spare bytes below one row")
        n, cached = t.num_embeddings, t.cache_rows or 0
        grad_bytes = n * (t.row_bytes - t.cached_row_bytes)  # a resident table's dense gradient
        to_rows = min(n, cached + rows)
        if to_rows >= n and (n - cached) * t.cached_row_bytes + grad_bytes > spare:
            to_rows = n - 1  # resident again would not fit with its gradient: stay a cache
        if to_rows < n and (to_rows - cached) * t.cached_row_bytes < MIN_RESIZE_BYTES:
            # as the live plan: a growth under the minimum is not worth a re-layout (one row
            # short of the table, because the gradient does not fit, grows nothing more)
            return Refusal("grow_cache", t.module, "growing is under the minimum")
        cost = (to_rows - cached) * t.cached_row_bytes + (grad_bytes if to_rows >= n else 0)
        return Plan(
            "grow_cache",
            t.module,
            -cost,
            f"grow the row cache of {t.module} to {to_rows} rows",
            {"model": "cache", "to_rows": to_rows},
        )

    def _checkpoint(self) -> Plan | Refusal:
        cands = [
            (m, b)
            for m, b in self.activations.items()
            if m not in (MODEL_MODULE, "") and m not in self.tables and m not in self.checkpointed
        ]
        cands.sort(key=lambda mb: -mb[1])
        chosen = cands[:MAX_CHECKPOINT_BLOCKS]
        if not chosen:
            return Refusal(
                "checkpoint_activations", "", "no block with recorded activations to checkpoint"
            )
        est = sum(b for _, b in chosen)
        return Plan(
            "checkpoint_activations",
            ",".join(m for m, _ in chosen),
            est,
            f"checkpoint {len(chosen)} block(s) saving {format_bytes(est)} of activations",
            {"model": "checkpoint", "blocks": [m for m, _ in chosen]},
        )

    def at_in_use(self, in_use_bytes: int) -> _Model:
        """The planner for another in-use (a forecast decision's); the state is shared, so a
        plan it makes is committed on this model."""
        return dataclasses.replace(self, in_use_bytes=in_use_bytes)

    def commit(self, plan: Plan) -> None:
        """Change the modelled state as the applied action would."""
        kind = plan.details.get("model")
        if kind == "checkpoint":
            self.checkpointed.update(plan.details["blocks"])
            return
        t = self.tables.get(plan.target)
        if t is None:
            return
        if kind == "offload":
            t.on_device = False
        elif kind == "cache":
            rows = int(plan.details["to_rows"])
            t.cache_rows = None if rows >= t.num_embeddings else rows
        elif kind == "compress":
            after = _est(t, plan.details["compression"])
            scale = after / t.total_bytes if t.total_bytes else 0.0
            t.params_bytes = int(t.params_bytes * scale)
            t.grads_bytes = int(t.grads_bytes * scale)
            t.optimizer_state_bytes = after - t.params_bytes - t.grads_bytes
            t.on_device = False  # compressed once: not planned again
