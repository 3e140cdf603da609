"""Hindsight over a recorded run: what would have avoided each incident, and what another policy
would have done. Reads only the history database (a copy from another machine is enough) and
never imports torch.

:func:`explain` (``edo-monitor explain RUN``): for each ``oom`` event and each pressure crossing
(``threshold_crossed`` below the floor) the **shortfall** and a ranked table of **remedies**, each
with its estimated saving from the recorded attribution and whether it is enough:

* shortfall of an OOM: ``requested - free`` of the parsed message (the bytes the failing
  allocation lacked), for a CPU-budget error what its event says was alive with the request
  less the budget (its message's free bytes stop at 0); of a crossing: the bytes to free so
  that the episode's highest in-use
  (until free memory was back above the re-arm level, or the run ended) stays at the floor,
  ``max(in_use) - (1 - floor) * budget``;
* tables (latest ``module_stats`` row of each embedding table at the incident, on the device
  tier, each category raised to what the incident's own CPU-budget snapshot says was alive:
  :func:`edo_monitor.hindsight.recorded.tables_at_incident`): ``offload_embedding`` (params +
  grads + optimizer state), ``cache_embedding`` (all rows but a cache of the most distinct ids
  of one batch the run recorded, its largest: for an incident before the run's largest batch, at
  least what it needed; ``CACHE_FLOOR_ROWS`` when it recorded none, as the action sizes it; a
  table already a row cache: its cache shrunk to that floor), ``compress`` to bf16, int8
  (frozen), low-rank ``dim / 4`` and hashing to ``rows / 10`` buckets (saving = recorded bytes
  minus :func:`edo_monitor.decide.estimate.estimate` of the new table with the run's optimizer);
* ``checkpoint_activations`` of the ``MAX_CHECKPOINT_BLOCKS`` modules with the most recorded
  activation bytes, none inside another (a block's bytes include its layers'; an upper bound:
  each block's input stays saved);
* ``smaller_batch`` (activations scale with the batch: the largest batch fraction that is enough),
  ``mixed_precision`` (activations halved; bf16 autocast keeps float32 gradients),
  ``optimizer`` (Adam → Adagrad / SGD: the estimator's state tensors per element), all from the
  sample at the incident;
* ``expandable_segments`` (CUDA only, when fragmentation was above ``FRAGMENTATION_HIGH``): the
  reserved-but-unallocated bytes outside the largest free block.

:func:`replay` (``edo-monitor replay RUN --policy ...``): the run's samples, in order, through a
real :class:`edo_monitor.decide.policy.Policy`. Live actions are first taken out of the trace
(their measured saving is added back), then each replayed decision's modelled saving is taken off
the in-use bytes, both by one rule: an action is in force from the readings of a later step than
the one it was applied in (the agent applies at the step boundary and counts the step after it),
and from the moment it was done (its event's time plus its duration: the agent accounts the model
again right then, so a later reading of the same step sees it); a replayed decision is applied at
the safe point closing its step, done when the live action there was done. So a replay that
applies what the run applied reproduces the recorded readings. Modelled from the recorded
attribution, exactly as the actions estimate: ``cache_embedding`` (create and shrink),
``offload_embedding``, ``checkpoint_activations``, ``compress_embedding`` (bf16 / fp16 / int8 /
low-rank) and ``grow_cache``. Refused with a reason: ``release_cache`` (the allocator's slack
after the step is not in the trace) and ``share_embedding`` (needs the ids' frequencies per row).
The lossy plans carry the expected error the live action would estimate where the trace allows
it: bf16 / fp16 :func:`edo_monitor.decide.plans.rounding_expected_error` (it needs no row values);
int8 and low-rank ``None`` (they need the rows, which the trace does not hold), so the replayed
policy ranks them after a bf16 / fp16 plan (:func:`edo_monitor.decide.policy.rank_lossy_plans`).
With ``forecast_steps`` the replayed policy forecasts from the modelled in-use as it would live
(its forecast decisions sized for the in-use predicted ahead, through :meth:`_Model.at_in_use`);
each forecast and its outcome is in :attr:`ReplayResult.forecasts`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edo_monitor.decide.plans import TABLE_BLOCKERS
from edo_monitor.errors import ConfigError, EventNotFoundError
from edo_monitor.hindsight.recorded import (
    MAX_CHECKPOINT_BLOCKS,
    _activations_at,
    _est,
    _load,
    _open,
    _sample_at,
    _Table,
    peak_batch_ids,
    raise_through_episode,
    refused_live,
    tables_at_incident,
)
from edo_monitor.hindsight.run_config import DEFAULT_FLOOR, as_fraction, recorded_floor
from edo_monitor.measure.module_tree import MODEL_MODULE, largest_disjoint
from edo_monitor.units import format_bytes

__all__ = ["Explanation", "Incident", "Remedy", "explain", "is_incident"]

logger = logging.getLogger(__name__)

#: Fragmentation above which ``expandable_segments`` is suggested.
FRAGMENTATION_HIGH = 0.3


# -- the recorded run ---------------------------------------------------------------------------


# -- explain ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Remedy:
    """One thing that would have saved bytes at an incident.

    Attributes:
        action: ``offload_embedding``, ``cache_embedding``, ``compress_embedding_bf16`` /
            ``_int8`` / ``_lowrank``, ``share_embedding``, ``checkpoint_activations``,
            ``smaller_batch``, ``mixed_precision``, ``optimizer``, ``expandable_segments``.
        target: the module(s), or what changes (``"batch x 0.62"``, ``"adam -> sgd"``).
        saving_bytes: estimated bytes it frees at the incident (int).
        enough: whether ``saving_bytes >= shortfall_bytes``.
        lossy: whether it changes numerics (or the training recipe).
        detail: where the number comes from.
    """

    action: str
    target: str
    saving_bytes: int
    enough: bool
    lossy: bool
    detail: str


@dataclass(frozen=True)
class Incident:
    """An OOM or a pressure crossing and what would have avoided it.

    Attributes:
        event_id: the ``events`` row (``edo-monitor events RUN``).
        kind: ``"oom"`` or ``"below_floor"``.
        step, time_s: when (Unix seconds, UTC).
        in_use_bytes, budget_bytes: at the incident (the OOM's last reading, the crossing's
            sample); ``peak_in_use_bytes``: the episode's highest in-use (crossings).
        shortfall_bytes: bytes that had to go (see the module docstring).
        remedies: ranked, largest saving first.
        refused_live: remedies on a table the live agent refused to act on (tied to another
            layer, read outside its forward, ...): its reason is their ``detail``.
        snapshot: from the incident's memory snapshot, when it has one
            (:func:`edo_monitor.hindsight.snapshot.memory_at`): largest blocks by frame and the
            fragmentation then; else ``None``.
        staged_plan: :class:`edo_monitor.hindsight.staged.StagedPlan` (stages 1-3 with their bytes,
            a smaller embedding dimension from a recorded ``table_spectrum``).
    """

    event_id: int
    kind: str
    step: int
    time_s: float
    in_use_bytes: int | None
    budget_bytes: int | None
    peak_in_use_bytes: int | None
    shortfall_bytes: int
    message: str
    remedies: tuple[Remedy, ...]
    snapshot: dict[str, Any] | None = None
    refused_live: tuple[Remedy, ...] = ()
    staged_plan: Any = None  # edo_monitor.hindsight.staged.StagedPlan (stages 1-3, a dimension)


@dataclass(frozen=True)
class Explanation:
    """:func:`explain`'s answer for one run."""

    run_id: int
    run_name: str
    device_kind: str
    #: the run's policy's floor (``None``: the run had no policy)
    floor_fraction: float | None
    incidents: tuple[Incident, ...]
    #: the run's budget, highest in-use and lowest free fraction over all its samples (``None``
    #: without samples); with no incident, the text gives them as what the run did instead
    budget_bytes: int | None = None
    peak_in_use_bytes: int | None = None
    min_free_fraction: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready values."""
        return dataclasses.asdict(self)


def _run_extremes(history: Any, info: Any) -> tuple[int | None, int | None, float | None]:
    """The run's budget (the run's, else its samples' largest), highest in-use and lowest free
    fraction over its samples."""
    from sqlalchemy import text

    with history._read() as conn:
        budget, peak, low = conn.execute(
            text(
                "SELECT max(budget_bytes), max(in_use_bytes), min(free_fraction) FROM samples "
                "WHERE run_id = :r"
            ),
            {"r": info.id},
        ).one()
    budget = info.budget_bytes or budget
    return (int(budget) if budget else None), (int(peak) if peak is not None else None), low


def _peak_in_episode(history: Any, run_id: int, start_s: float, end_s: float | None) -> int | None:
    from sqlalchemy import text

    with history._read() as conn:
        return conn.execute(
            text(
                "SELECT max(in_use_bytes) FROM samples WHERE run_id = :r AND time_s >= :a"
                + ("" if end_s is None else " AND time_s < :b")
            ),
            {"r": run_id, "a": start_s, "b": end_s},
        ).scalar()


def _alive_total(alive: Mapping[str, Any]) -> int:
    """The bytes an ``oom`` event's ``in_use`` says were alive with the request: the sum of its
    categories (a gradient or saved tensor refused is in its category; a step boundary's
    optimizer-state growth is in the state already)."""
    return sum(int(alive.get(k) or 0) for k in _ALIVE_CATEGORIES)


_ALIVE_CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes")


def _split_refused(
    remedies: tuple[Remedy, ...], refused: dict[tuple[str, str], str]
) -> dict[str, tuple[Remedy, ...]]:
    """``remedies`` less those the live agent refused on their table, and those (with its
    reason as their ``detail``): an offload of a table tied to the output layer is not a remedy.
    A reason that is the table's own (:data:`TABLE_BLOCKERS`: tied, read outside its module)
    rules out every remedy on it: the lossy ones of a tied table were listed when only the
    lossless rungs had been tried live."""
    blocked = {t: why for (_, t), why in refused.items() if why.startswith(TABLE_BLOCKERS)}
    kept, out = [], []
    for r in remedies:
        live = "compress_embedding" if r.action.startswith("compress_embedding") else r.action
        why = refused.get((live, r.target)) or blocked.get(r.target)
        if why is None:
            kept.append(r)
        else:
            out.append(dataclasses.replace(r, enough=False, detail=f"refused live: {why}"))
    return {"remedies": tuple(kept), "refused_live": tuple(out)}


def _remedies(
    shortfall: int,
    sample: Mapping[str, Any] | None,
    tables: Mapping[str, _Table],
    activations: Mapping[str, int],
    in_use_bytes: int | None = None,
) -> list[Remedy]:
    out: list[Remedy] = []

    def add(action: str, target: str, saving: int, lossy: bool, detail: str) -> None:
        if saving > 0:
            out.append(Remedy(action, target, int(saving), saving >= shortfall, lossy, detail))

    for t in sorted(tables.values(), key=lambda t: -t.total_bytes):
        if not t.on_device or t.placement == "host" or t.total_bytes <= 0:
            continue
        add(
            "offload_embedding",
            t.module,
            t.total_bytes,
            False,
            f"params {format_bytes(t.params_bytes)} + grads {format_bytes(t.grads_bytes)} + "
            f"optimizer state {format_bytes(t.optimizer_state_bytes)} to host memory",
        )
        if t.placement == "cached":  # already a row cache: the action can only shrink it
            rows = t.params_bytes // max(1, t.embedding_dim * t.element_bytes)
            keep = min(rows, t.cache_floor_rows)
            add(
                "cache_embedding",
                t.module,
                (rows - keep) * t.cached_row_bytes,
                False,
                f"shrink the row cache from {rows:,} to {keep:,} of {t.num_embeddings:,} rows "
                f"({format_bytes(t.cached_row_bytes)} a row)",
            )
        else:
            keep = min(t.num_embeddings, t.cache_floor_rows)
            add(
                "cache_embedding",
                t.module,
                (t.num_embeddings - keep) * t.row_bytes,
                False,
                f"keep {keep:,} of {t.num_embeddings:,} rows on the device "
                f"({format_bytes(t.row_bytes)} a row); fewer rows freed with a larger cache",
            )
        if t.placement == "cached":  # compress and share take a resident table only
            continue
        current = t.total_bytes
        for action, comp, note in (
            ("compress_embedding_bf16", "bf16", "bf16 table, grads and state"),
            ("compress_embedding_int8", "int8", "int8 rows + a float32 scale a row; frozen"),
            (
                "compress_embedding_lowrank",
                f"lowrank:{max(1, t.embedding_dim // 4)}",
                f"rank {max(1, t.embedding_dim // 4)} factors",
            ),
            (
                "share_embedding",
                f"hash:{max(1, t.num_embeddings // 10)}",
                f"{max(1, t.num_embeddings // 10):,} hashed buckets",
            ),
        ):
            if comp == "int8" and t.trainable:  # refused live: an int8 table does not train
                continue
            try:
                after = _est(t, comp)
            except ConfigError:
                continue
            add(action, t.module, current - after, True, f"{note}: estimate {format_bytes(after)}")
    blocks = {
        m: b for m, b in activations.items() if m not in (MODEL_MODULE, "") and m not in tables
    }
    if blocks:
        top = largest_disjoint(blocks, MAX_CHECKPOINT_BLOCKS)  # a block holds its layers'
        add(
            "checkpoint_activations",
            ", ".join(m for m, _ in top),
            sum(b for _, b in top),
            False,
            "saved activations of the largest blocks (upper bound: each block's input stays)",
        )
    if sample is not None:
        act = int(sample.get("activations_bytes") or 0)
        grads = int(sample.get("grads_bytes") or 0)
        state = int(sample.get("optimizer_state_bytes") or 0)
        params = int(sample.get("params_bytes") or 0)
        if in_use_bytes is not None and sample.get("device_kind") != "cuda":
            # at an OOM recorded without what was alive (before the CPU-budget error said),
            # the failing request is taken for an activation: what is not static is
            act = max(act, in_use_bytes - params - grads - state)
        if act > 0:
            if act > shortfall:
                frac = (act - shortfall) / act
                add(
                    "smaller_batch",
                    f"batch x {frac:.2f}",
                    act - math.floor(act * frac),
                    True,
                    f"activations {format_bytes(act)} scale with the batch",
                )
            else:
                add(
                    "smaller_batch",
                    "batch x 0.50",
                    act // 2,
                    True,
                    f"activations {format_bytes(act)} scale with the batch; not enough alone",
                )
        add(  # autocast keeps parameters, and so gradients, float32: they were halved too
            "mixed_precision",
            "bf16 autocast",
            act // 2,
            True,
            f"activations {format_bytes(act)} halved (float32 parameters and gradients)",
        )
        states = round(state / params) if params else 0
        if states >= 2:
            from edo_monitor.decide.estimate import estimate

            for name in ("adagrad", "sgd"):
                per = estimate(1, 1, optimizer=name).optimizer_state_bytes // 4
                add(
                    "optimizer",
                    f"adam -> {name}",
                    state - state * per // states,
                    True,
                    f"{per} state tensor(s) a parameter instead of {states}, as edo-monitor "
                    f"estimate counts {name}",
                )
        frag = sample.get("fragmentation")
        slack = sample.get("reserved_unallocated_bytes")
        largest = sample.get("largest_inactive_block_bytes") or 0
        if sample.get("device_kind") == "cuda" and frag is not None and frag > FRAGMENTATION_HIGH:
            add(
                "expandable_segments",
                "PYTORCH_CUDA_ALLOC_CONF",
                int((slack or 0) - largest),
                False,
                f"fragmentation {frag:.0%}: cached slack outside the largest free block",
            )
    # enough first, lossless before lossy, then the larger saving
    out.sort(key=lambda r: (not r.enough, r.lossy, -r.saving_bytes))
    return out


def is_incident(kind: str, data: Mapping[str, Any] | None) -> bool:
    """Whether an event of ``kind`` with ``data`` is one :func:`explain` explains: an OOM, or a
    threshold crossing below the floor (not the crossing back above the re-arm level)."""
    return kind == "oom" or (
        kind == "threshold_crossed" and (data or {}).get("direction") == "below"
    )


def explain(db: Any, run: Any, *, event: int | None = None) -> Explanation:
    """What would have avoided each OOM and each pressure crossing of a recorded run.

    Args:
        db: a :class:`edo_monitor.History`, a path or an SQLAlchemy URL (read-only).
        run: run id, uuid prefix or ``"latest"``.
        event: only the incident of this event id.

    Returns:
        An :class:`Explanation` (no incidents when the run had none).

    Raises:
        RunNotFoundError: no such run. StoreError: no usable database. EventNotFoundError:
        ``event`` is not an OOM or below-floor crossing of the run.
    """
    history, owned = _open(db)
    try:
        info, module_rows, events = _load(history, run)
        # the live policy's floor (never a user's config value: an older history's may be any);
        # None: the run had no policy, so no floor (and no crossing to explain)
        floor = recorded_floor(info.config)
        cpu = info.device_kind != "cuda"
        incidents = []
        crossings = [e for e in events if e.kind == "threshold_crossed"]
        peaks = peak_batch_ids(events)
        for e in events:
            if event is not None and e.id != event:
                continue
            if e.kind == "oom":
                parsed = e.data.get("parsed") or {}
                last = e.data.get("last_reading") or {}
                requested, free = parsed.get("requested_bytes"), parsed.get("free_bytes")
                budget = parsed.get("total_bytes") or last.get("budget_bytes")
                if requested is not None:
                    shortfall = max(0, int(requested) - int(free or 0))
                else:
                    shortfall = max(0, int(last.get("in_use_bytes") or 0) - int(budget or 0))
                in_use = (int(budget) - int(free or 0) + int(requested or 0)) if budget else None
                sample, alive = oom_sample(history, info.id, e)
                if alive and budget:  # the message's free bytes stop at 0: count from the parts
                    # exact (the message rounds): the last reading's, else the run's (an error
                    # before the sampler's first reading has no last reading)
                    budget = last.get("budget_bytes") or info.budget_bytes or budget
                    in_use = _alive_total(alive)
                    shortfall = max(0, in_use - int(budget))
                incidents.append(
                    Incident(
                        e.id,
                        "oom",
                        e.step,
                        e.time_s,
                        in_use,
                        budget,
                        in_use,
                        shortfall,
                        e.message,
                        tuple(
                            _remedies(
                                shortfall,
                                sample,
                                tables_at_incident(
                                    history,
                                    info.id,
                                    e.id,
                                    module_rows,
                                    e.time_s,
                                    counts_step=cpu,
                                    peaks=peaks,
                                ),
                                _activations_at(module_rows, e.time_s),
                                None if alive else in_use,
                            )
                        ),
                    )
                )
            elif is_incident(e.kind, e.data):  # a crossing below the floor
                floor_e = as_fraction(e.data.get("floor"))  # the policy's, at the crossing
                if floor_e is None:
                    floor_e = as_fraction(e.data.get("threshold"))
                if floor_e is None:
                    floor_e = DEFAULT_FLOOR if floor is None else floor
                end = next(
                    (
                        c.time_s
                        for c in crossings
                        if c.time_s > e.time_s and c.data.get("direction") == "above"
                    ),
                    None,
                )
                peak = _peak_in_episode(history, info.id, e.time_s, end)
                budget = e.data.get("budget_bytes") or info.budget_bytes
                peak = max(int(peak or 0), int(e.data.get("in_use_bytes") or 0))
                shortfall = max(0, math.ceil(peak - (1 - floor_e) * int(budget or 0)))
                sample = _sample_at(history, info.id, e.time_s)
                tables = tables_at_incident(
                    history, info.id, e.id, module_rows, e.time_s, counts_step=cpu, peaks=peaks
                )
                raise_through_episode(tables, module_rows, e.time_s, end)  # as at the peak
                incidents.append(
                    Incident(
                        e.id,
                        "below_floor",
                        e.step,
                        e.time_s,
                        e.data.get("in_use_bytes"),
                        budget,
                        peak,
                        shortfall,
                        e.message,
                        tuple(
                            _remedies(
                                shortfall, sample, tables, _activations_at(module_rows, e.time_s)
                            )
                        ),
                    )
                )
        if event is not None and not any(e.id == event for e in events):
            raise EventNotFoundError(
                f"run {info.id} has no event {event}; see edo-monitor events {info.id}"
            )
        if event is not None and not incidents:
            raise EventNotFoundError(
                f"event {event} is not an OOM or a crossing below the floor of run {info.id}; "
                f"see edo-monitor events {info.id} --kind oom --kind threshold_crossed (the "
                "crossings 'below the floor')"
            )
        from edo_monitor.hindsight.snapshot import memory_at
        from edo_monitor.hindsight.staged import plan_for_incident

        table_names = {str(r["module"]) for r in module_rows if r.get("num_embeddings") is not None}
        refused = refused_live(events, table_names)
        incidents = [  # schema 8: what the incident's memory snapshot shows
            dataclasses.replace(
                i,
                **_split_refused(i.remedies, refused),
                snapshot=memory_at(history, info.id, i.event_id),
                staged_plan=plan_for_incident(history, info, module_rows, events, i),
            )
            for i in incidents
        ]
        return Explanation(
            info.id,
            info.name,
            info.device_kind,
            floor,
            tuple(incidents),
            *_run_extremes(history, info),
        )
    finally:
        if owned:
            history.close()


def oom_sample(
    history: Any, run_id: int, event: Any
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The attribution at an ``oom`` event, as its remedies and its staged plan both read it:
    its last reading (else the sample at its time), with what a CPU-budget error says was alive
    with the request (its ``in_use``: categories, the request in its own) laid over it; and
    that ``in_use`` (``None`` for an error without one, e.g. CUDA's)."""
    last = event.data.get("last_reading") or {}
    sample = {**last} if last else _sample_at(history, run_id, event.time_s)
    alive = event.data.get("in_use") or None
    if alive and sample is not None:
        sample = {**sample, **alive}
    return sample, alive


# -- replay -------------------------------------------------------------------------------------
