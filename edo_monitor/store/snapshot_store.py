"""The ``snapshots`` table (schema 8): linking rows to their events, reading and thinning them.

Readers go through a :class:`~edo_monitor.store.history.History` (its engine and run lookup);
nothing here imports torch or ``sqlalchemy.orm``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, inspect, select, text

from edo_monitor.measure.snapshots import SnapshotError, decode  # SnapshotError: raised here
from edo_monitor.store.schema import events_table, snapshots_table

if TYPE_CHECKING:
    from edo_monitor.store.history import History

__all__ = [
    "SnapshotInfo",
    "delete_runs_snapshots",
    "find_snapshot",
    "link_events",
    "load_snapshot",
    "snapshot_infos",
    "thin_snapshots",
]


def link_events(conn: Connection, run_id: int | None, rows: list[dict[str, Any]]) -> None:
    """Writer side, inside the flush: replace each row of ``rows`` by a copy without its
    ``_event`` key (``(kind, time_s)`` of the event it was queued after) and with ``event_id``
    set to that event's id. The pending row keeps ``_event``, so a flush tried again after a
    rollback looks the event up again (its id may differ then). An event not found (its row was
    dropped) leaves ``event_id`` ``NULL``."""
    for i, r in enumerate(rows):
        row = {k: v for k, v in r.items() if k != "_event"}
        key = r.get("_event")
        row["event_id"] = None
        if key is not None:
            kind, time_s = key
            row["event_id"] = conn.execute(
                select(events_table.c.id)
                .where(
                    events_table.c.run_id == run_id,
                    events_table.c.kind == kind,
                    events_table.c.time_s == time_s,
                )
                .order_by(events_table.c.id.desc())
                .limit(1)
            ).scalar()
        rows[i] = row


@dataclass(frozen=True)
class SnapshotInfo:
    """One ``snapshots`` row without its blob, with its event's kind and message."""

    id: int
    run_id: int
    event_id: int | None
    time_s: float
    step: int
    phase: str
    source: str
    encoding: str
    raw_bytes: int
    stored_bytes: int
    allocated_bytes: int | None
    reserved_bytes: int | None
    event_kind: str | None
    event_message: str | None

    def as_dict(self) -> dict[str, Any]:
        """The row as a plain dict."""
        return dict(self.__dict__)


def _has_table(history: History) -> bool:
    with history._read() as conn:
        return "snapshots" in set(inspect(conn).get_table_names())


_INFO_COLS = [c for c in snapshots_table.columns if c.name != "blob"]


def snapshot_infos(
    history: History, run_id: int, *, event_ids: Sequence[int] | None = None
) -> list[SnapshotInfo]:
    """A run's snapshots in time order (only those of ``event_ids`` when given); ``[]`` for a
    database older than schema 8."""
    if not _has_table(history):
        return []
    s, e = snapshots_table, events_table
    stmt = (
        select(*_INFO_COLS, e.c.kind.label("event_kind"), e.c.message.label("event_message"))
        .select_from(s.outerjoin(e, e.c.id == s.c.event_id))
        .where(s.c.run_id == run_id)
        .order_by(s.c.time_s, s.c.id)
    )
    if event_ids is not None:
        stmt = stmt.where(s.c.event_id.in_(list(event_ids)))
    with history._read() as conn:
        return [SnapshotInfo(**r._asdict()) for r in conn.execute(stmt)]


_PHASE_ORDER = {"at": 0, "after": 1, "before": 2}


def find_snapshot(history: History, run: Any, event: int | None = None) -> SnapshotInfo:
    """The snapshot ``edo-monitor snapshot`` opens: of event ``event`` (an action's "after"
    one when it has two), else the run's latest.

    Raises:
        RunNotFoundError: no such run.
        SnapshotError: the run (or the event) has no snapshot; the message says so in one line.
    """
    info = history.run(run, stats=False)
    if event is None:
        rows = snapshot_infos(history, info.id)
        if not rows:
            raise SnapshotError(
                f"run {info.id} has no memory snapshot (none is taken without an incident; "
                "watch(snapshots=False) takes none)"
            )
        return rows[-1]
    # an id beyond SQL's int64 is no event's (the driver raised OverflowError, "bigint out of
    # range" on PostgreSQL)
    in_range = -(2**63) <= event < 2**63
    rows = snapshot_infos(history, info.id, event_ids=[event]) if in_range else []
    if not rows:
        kinds = {e.id: e.kind for e in history.events(info.id)}
        what = f"a {kinds[event]} event" if event in kinds else "not an event of this run"
        with_snaps = sorted({r.event_id for r in snapshot_infos(history, info.id) if r.event_id})
        raise SnapshotError(
            f"event {event} of run {info.id} has no memory snapshot ({what}); events with one: "
            + (", ".join(map(str, with_snaps)) or "none")
        )
    return min(rows, key=lambda r: (_PHASE_ORDER.get(r.phase, 9), -r.id))


def load_snapshot(history: History, snap: SnapshotInfo) -> dict[str, Any]:
    """The snapshot dict of ``snap``'s row.

    Raises:
        SnapshotError: the blob is damaged (names the event).
    """
    with history._read() as conn:
        blob = conn.execute(
            select(snapshots_table.c.blob).where(snapshots_table.c.id == snap.id)
        ).scalar()
    if blob is None:
        raise SnapshotError(f"the snapshot of event {snap.event_id} is gone (deleted meanwhile)")
    return decode(blob, snap.encoding, event=snap.event_id)


def thin_snapshots(
    conn: Connection, run_ids: Sequence[int], cut_s: float, *, count_only: bool = False
) -> int:
    """``prune --downsample-older-than``: in the runs ``run_ids``, of the snapshots older than
    ``cut_s`` keep those of ``oom`` events and the last one of each event kind; delete the
    rest. Returns the rows deleted (0 without the table); ``count_only``: those it would
    delete, deleting none (``prune --dry-run``)."""
    if not run_ids or "snapshots" not in set(inspect(conn).get_table_names()):
        return 0
    deleted = 0
    verb = "SELECT count(*)" if count_only else "DELETE"
    for run_id in run_ids:
        res = conn.execute(
            text(
                f"{verb} FROM snapshots WHERE run_id = :r AND time_s < :cut AND id NOT IN ("
                "SELECT s.id FROM snapshots s JOIN events e ON e.id = s.event_id "
                "WHERE s.run_id = :r AND e.kind = 'oom' "
                "UNION SELECT max(s.id) FROM snapshots s LEFT JOIN events e ON e.id = s.event_id "
                "WHERE s.run_id = :r GROUP BY e.kind)"
            ),
            {"r": run_id, "cut": cut_s},
        )
        deleted += int(res.scalar() or 0) if count_only else res.rowcount or 0
    return deleted


def delete_runs_snapshots(conn: Connection, ids_sql: str) -> None:
    """``prune``: the snapshots of the deleted runs (the foreign key's cascade, made explicit)."""
    if "snapshots" in set(inspect(conn).get_table_names()):
        conn.execute(text(f"DELETE FROM snapshots WHERE run_id IN ({ids_sql})"))
