"""The recorded attribution read back for hindsight: a run's tables and activations at a moment,
the saving of a remedy estimated from them, and the actions the live agent refused on them."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edo_monitor.decide.plans import NOT_YET_KNOWN

#: Rows a row cache keeps at least when the peak ids per batch are unknown (the action's own
#: fallback, ``min(rows, 1024)``).
CACHE_FLOOR_ROWS = 1024


#: Blocks ``checkpoint_activations`` wraps at most (its default ``max_checkpoint_blocks``).
MAX_CHECKPOINT_BLOCKS = 4


#: Bytes per element of the floating dtypes a table's weight is recorded in.
_FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass
class _Table:
    """An embedding table as recorded (module_stats), with its modelled state in a replay."""

    module: str
    kind: str
    num_embeddings: int
    embedding_dim: int
    dtype: str
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    placement: str | None = None
    cache_rows: int | None = None  # a modelled row cache
    on_device: bool = True
    counts_step: bool = False  # CPU-budget accounting counts the optimizer's step counters
    #: whether it trains: a gradient recorded for it at any time (a frozen table records 0 bytes)
    trainable: bool = False
    #: most distinct ids of one batch, as the run recorded them (:func:`peak_batch_ids`)
    peak_batch_ids: int | None = None

    @property
    def cache_floor_rows(self) -> int:
        """Rows a row cache of this table keeps at least, as the live action sizes it: the peak
        distinct ids of one batch, else ``min(rows, CACHE_FLOOR_ROWS)`` (unknown)."""
        if self.peak_batch_ids is not None:
            return max(1, self.peak_batch_ids)
        return max(1, min(self.num_embeddings, CACHE_FLOOR_ROWS))

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_state_bytes

    @property
    def element_bytes(self) -> int:
        """Bytes per element of the weight: its recorded floating dtype's (a row cache's
        ``params_bytes`` are its cached rows', fewer than ``num_embeddings``: a division by the
        whole table's elements read 3 bytes for a float32); for another dtype (a compressed
        table's), its bytes over the table's elements."""
        size = _FLOAT_BYTES.get(self.dtype)
        if size is not None:
            return size
        return max(1, self.params_bytes // max(1, self.num_embeddings * self.embedding_dim))

    @property
    def state_tensors(self) -> int:
        """Per-element optimizer state tensors (Adam 2, Adagrad 1, SGD 0)."""
        return round(self.optimizer_state_bytes / self.params_bytes) if self.params_bytes else 0

    @property
    def row_bytes(self) -> int:
        """Device bytes per row: weight, gradient and each per-element state tensor."""
        per = self.embedding_dim * self.element_bytes
        return per * (1 + int(self.grads_bytes > 0) + self.state_tensors)

    @property
    def cached_row_bytes(self) -> int:
        """Device bytes per row of a row cache: weight and state, no gradient (the cache's
        gradient is the touched rows' only: :mod:`edo_monitor.nn.cache_step`)."""
        return self.embedding_dim * self.element_bytes * (1 + self.state_tensors)

    @property
    def optimizer(self) -> str:
        return {0: "sgd", 1: "adagrad"}.get(self.state_tensors, "adam")


def peak_batch_ids(events: Sequence[Any]) -> dict[str, int]:
    """Per table, the most distinct ids of one batch the run recorded: in its
    ``cache_embedding`` actions' details and its ``lookup_frequency`` events (the largest)."""
    peaks: dict[str, int] = {}
    for e in events:
        data = e.data or {}
        if e.kind == "lookup_frequency":
            table, peak = data.get("table"), data.get("peak_unique_ids")
        elif e.kind == "action" and data.get("action") == "cache_embedding":
            table, peak = data.get("target"), (data.get("details") or {}).get("peak_batch_ids")
        else:
            continue
        if isinstance(table, str) and isinstance(peak, int) and peak > 0:
            peaks[table] = max(peak, peaks.get(table, 0))
    return peaks


def _tables_at(
    rows: Sequence[Mapping[str, Any]],
    time_s: float | None,
    *,
    before: bool = False,
    counts_step: bool = False,
    peaks: Mapping[str, int] | None = None,
) -> dict[str, _Table]:
    """Latest state of each embedding table at ``time_s`` (strictly before it with ``before``;
    all rows when ``None``); categories take their largest value so far (gradients and optimizer
    state appear after the first step). ``peaks``: :func:`peak_batch_ids`."""
    tables: dict[str, _Table] = {}
    for r in rows:
        if time_s is not None and (r["time_s"] >= time_s if before else r["time_s"] > time_s):
            break
        if r["num_embeddings"] is None or r["embedding_dim"] is None:
            continue
        t = tables.get(r["module"])
        values = {
            k: int(r[k] or 0) for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes")
        }
        dtype = (r["dtype"] or "float32").removeprefix("torch.")
        if t is None or values["params_bytes"] != t.params_bytes or dtype != t.dtype:
            tables[r["module"]] = _Table(
                r["module"],
                r["kind"],
                int(r["num_embeddings"]),
                int(r["embedding_dim"]),
                dtype,
                placement=r["placement"],
                counts_step=counts_step,
                peak_batch_ids=(peaks or {}).get(r["module"]),
                **values,
            )
        else:
            t.grads_bytes = max(t.grads_bytes, values["grads_bytes"])
            t.optimizer_state_bytes = max(t.optimizer_state_bytes, values["optimizer_state_bytes"])
            t.placement = r["placement"]
    for r in rows:  # every row, later ones too: before its first backward a table has no gradient
        t = tables.get(r["module"])
        if t is None or (r["dtype"] or "float32").removeprefix("torch.") != t.dtype:
            continue
        if (
            int(r["params_bytes"] or 0) == t.params_bytes
            or r["placement"] == t.placement == "cached"
        ):
            # it trains: a gradient, or optimizer state (a frozen weight gets none; a row cache
            # records no dense gradient, and its rows change with each resize)
            t.trainable |= (
                int(r["grads_bytes"] or 0) > 0 or int(r["optimizer_state_bytes"] or 0) > 0
            )
    return tables


def _activations_at(rows: Sequence[Mapping[str, Any]], time_s: float | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        if time_s is not None and r["time_s"] > time_s:
            break
        out[r["module"]] = int(r["activations_bytes"] or 0)
    return {m: b for m, b in out.items() if b > 0}


def _load(history: Any, run: Any) -> tuple[Any, list[dict[str, Any]], list[Any]]:
    from sqlalchemy import text

    info = history.run(run, stats=False)
    with history._read() as conn:
        rows = [
            dict(r)
            for r in conn.execute(
                text("SELECT * FROM module_stats WHERE run_id = :r ORDER BY time_s, id"),
                {"r": info.id},
            ).mappings()
        ]
    return info, rows, history.events(info.id)


def _open(db: Any) -> tuple[Any, bool]:
    from edo_monitor.store.history import History

    if isinstance(db, History):
        return db, False
    return History(db), True


def _est(t: _Table, compression: Any) -> int:
    """Bytes of recorded table ``t`` under ``compression`` after the next step
    (:func:`edo_monitor.decide.estimate.table_bytes`, as the live actions count): its optimizer
    by its recorded state (:attr:`_Table.optimizer`), the step counters where the run's
    accounting counts them; a frozen table (:attr:`_Table.trainable` false: no gradient
    recorded) with no gradient and no state, as it stays."""
    from edo_monitor.decide.estimate import _dtype, estimate, table_bytes

    dtype = t.dtype if t.dtype in ("float32", "float16", "bfloat16", "float64") else "float32"
    if t.trainable:
        est = estimate(
            t.num_embeddings,
            t.embedding_dim,
            dtype=dtype,
            optimizer=t.optimizer,
            compression=compression,
        )
        return est.total_with_step_bytes if t.counts_step else est.total_bytes
    frozen = table_bytes(
        t.num_embeddings,
        t.embedding_dim,
        compression,
        element_bytes=_dtype(dtype)[1],
        trainable=False,
    )
    return frozen.total_bytes


def _sample_at(history: Any, run_id: int, time_s: float) -> dict[str, Any] | None:
    from sqlalchemy import text

    with history._read() as conn:
        row = (
            conn.execute(
                text(
                    "SELECT * FROM samples WHERE run_id = :r AND time_s <= :t "
                    "ORDER BY time_s DESC, id DESC LIMIT 1"
                ),
                {"r": run_id, "t": time_s},
            )
            .mappings()
            .first()
        )
    return dict(row) if row else None


#: The categories of a CPU-budget snapshot's blocks that a table's row has.
_TABLE_CATEGORIES = ("params", "grads", "optimizer_state")


def alive_at(history: Any, run_id: int, event_id: int) -> dict[str, dict[str, int]]:
    """What the incident's own CPU-budget memory snapshot says was alive, by module: ``module ->
    {"params_bytes", "grads_bytes", "optimizer_state_bytes"}`` (its blocks' frames are module
    and category: :func:`edo_monitor.measure.snapshots.build_cpu_snapshot`). Empty without a
    readable CPU-budget snapshot (a CUDA one's frames are code lines, not modules)."""
    from edo_monitor.measure.snapshots import SnapshotError
    from edo_monitor.store.snapshot_store import find_snapshot, load_snapshot

    try:
        info = find_snapshot(history, run_id, event_id)
        if info.source != "cpu-budget":
            return {}
        snap = load_snapshot(history, info)
    except SnapshotError:
        return {}
    out: dict[str, dict[str, int]] = {}
    for seg in snap.get("segments") or []:
        for b in seg.get("blocks") or []:
            frames = b.get("frames") or []
            if b.get("state") != "active_allocated" or len(frames) != 1:
                continue
            category = str(frames[0].get("name", "")).split(" ")[0]  # "params [cached]"
            if category in _TABLE_CATEGORIES and not frames[0].get("line"):
                module = out.setdefault(str(frames[0].get("filename")), {})
                key = f"{category}_bytes"
                module[key] = module.get(key, 0) + int(b.get("size") or 0)
    return out


def raise_through_episode(
    tables: Mapping[str, _Table],
    rows: Sequence[Mapping[str, Any]],
    start_s: float,
    end_s: float | None,
) -> None:
    """Raise each table's gradient and optimizer state to their largest in ``rows`` recorded
    after ``start_s`` and up to ``end_s`` (``None``: the run's end) while the table was as at
    the start (the same bytes of weight, dtype and placement: no action had changed it).

    A crossing's shortfall is counted at its episode's peak; at a crossing in the first step
    the tables' rows had no gradient or optimizer state yet, which came before the peak: the
    remedies counted 64 bytes a row of a table Adam stepped with 192, none enough where the
    row cache the agent applied a step later was."""
    for r in rows:
        if r["time_s"] <= start_s:
            continue
        if end_s is not None and r["time_s"] > end_s:
            break
        t = tables.get(r["module"])
        if (
            t is None
            or int(r["params_bytes"] or 0) != t.params_bytes
            or (r["dtype"] or "float32").removeprefix("torch.") != t.dtype
            or r["placement"] != t.placement
        ):
            continue
        t.grads_bytes = max(t.grads_bytes, int(r["grads_bytes"] or 0))
        t.optimizer_state_bytes = max(t.optimizer_state_bytes, int(r["optimizer_state_bytes"] or 0))
        t.trainable |= t.grads_bytes > 0 or t.optimizer_state_bytes > 0


def tables_at_incident(
    history: Any,
    run_id: int,
    event_id: int,
    rows: Sequence[Mapping[str, Any]],
    time_s: float,
    *,
    counts_step: bool = False,
    peaks: Mapping[str, int] | None = None,
) -> dict[str, _Table]:
    """The tables at an incident (:func:`_tables_at` at its time), each category raised to what
    the incident's own snapshot says was alive (:func:`alive_at`) where that is more: a table's
    ``module_stats`` row is the last step boundary's, so at an out-of-memory error in the first
    step it has no gradient and no optimizer state yet while the error's snapshot has both."""
    tables = _tables_at(rows, time_s, counts_step=counts_step, peaks=peaks)
    for module, alive in alive_at(history, run_id, event_id).items():
        t = tables.get(module)
        if t is None:
            continue
        t.params_bytes = max(t.params_bytes, alive.get("params_bytes", 0))
        t.grads_bytes = max(t.grads_bytes, alive.get("grads_bytes", 0))
        t.optimizer_state_bytes = max(
            t.optimizer_state_bytes, alive.get("optimizer_state_bytes", 0)
        )
        t.trainable |= t.grads_bytes > 0
    return tables


def refused_live(events: list[Any], tables: Collection[str]) -> dict[tuple[str, str], str]:
    """``(action, table) -> reason`` for each table action the live agent refused on a table
    in the run (its ``no_action`` and ``action_refused`` events, and the rungs a ``decision``
    passed over) and never applied to it, for a
    reason other than one it could not know yet (:data:`NOT_YET_KNOWN`): refusals at the first
    step (no recorded step, no optimizer stepped yet) ruled out the remedy the agent applied a
    step later. A refusal names each table it
    refused, ``"<table>: <why>"``, joined by ``"; "``; split only where a table of ``tables``
    is named, as a reason may hold ``"; "`` itself."""
    applied = {
        (str(e.data.get("action") or ""), str(e.data.get("target") or ""))
        for e in events
        if e.kind == "action" and e.data.get("status") == "applied"
    }
    names = sorted((t for t in tables if t), key=len, reverse=True)
    starts = re.compile("(?:^|; )(" + "|".join(map(re.escape, names)) + "): ") if names else None
    out: dict[tuple[str, str], str] = {}
    for e in events:
        if e.kind == "no_action":
            items = e.data.get("refusals") or []
        elif e.kind == "decision":
            items = e.data.get("passed_over") or []
        elif e.kind == "action_refused":
            items = [e.data]
        else:
            continue
        for r in items:
            action = str(r.get("action") or "")
            reason = str(r.get("reason") or "")
            found = list(starts.finditer(reason)) if starts is not None else []
            for i, m in enumerate(found):
                end = found[i + 1].start() if i + 1 < len(found) else len(reason)
                why = reason[m.end() : end]
                if (action, m.group(1)) not in applied and not why.startswith(NOT_YET_KNOWN):
                    out[(action, m.group(1))] = why  # the latest reason stands
    return out
