"""The daemon's writer: the run Writer's queue, batches and loss accounting over the device tables,
process rows linked to the watched runs in the writer's transaction."""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import Connection, Engine

from edo_monitor.store.models import (
    DeviceEvent,
    DeviceSample,
    ProcessSample,
)
from edo_monitor.store.writer import Writer, _reconnect_message


class DeviceWriter(Writer):
    """The daemon's background writer (``edo-monitor daemon``): rows of ``device_samples``,
    ``process_samples`` and ``device_events``, with the run writer's bounded queue, batches,
    retries, give-up and accounting (:attr:`written`, :attr:`not_written` by table); there is no
    run, so no heartbeat, and dropped rows are recorded as a ``samples_dropped`` device event.

    Process rows are linked to watched runs at the flush, inside its transaction: a row gets the
    id of the run with the same host and PID that was running at the row's ``time_s`` (started at
    or before it, not ended before it, and, while it has not ended, its heartbeat no staler than
    :func:`edo_monitor.store.status.stale_after_s`, so a crashed run's PID reused by another
    process is not linked); the latest started when several qualify.

    Args:
        engine: a read-write engine (:func:`edo_monitor.store.engine.open_engine`).
        host: the host the rows are from (``runs.host`` of the runs it links).
        **kwargs: ``queue_size``, ``flush_interval_s``, ``batch_size``, ``on_problem``
            (see :class:`Writer`).
    """

    ROW_TABLES = (
        ("device_samples", DeviceSample),
        ("process_samples", ProcessSample),
        ("device_events", DeviceEvent),
    )
    LABELS: ClassVar[dict[str, str]] = {
        "device_samples": "device row(s)",
        "process_samples": "process row(s)",
        "device_events": "device event(s)",
    }

    def __init__(self, engine: Engine, *, host: str, **kwargs: Any) -> None:
        super().__init__(engine, None, **kwargs)
        self.host = host
        self._thread.name = "edo-daemon-writer"

    def put_row(self, table: str, row: dict[str, Any]) -> bool:
        """Queue one row of ``table`` (its columns but ``id``; ``run_id`` of process rows is
        filled in at the flush); False (and counted) when the queue is full.

        Raises:
            ValueError: ``table`` is not one of the daemon's tables.
        """
        if table not in self.not_written or table == "samples":
            raise ValueError(
                f"table={table!r} is not a daemon table; expected one of "
                f"{[name for name, _ in self.ROW_TABLES]}"
            )
        return self._put((table, row))

    def _drop_row(self, now: float, new_drops: int, total: int) -> tuple[str, dict[str, Any]]:
        return "device_events", {
            "time_s": now,
            "host": self.host,
            "device_index": None,
            "device_uuid": None,
            "kind": "samples_dropped",
            "message": f"{new_drops} row(s) dropped (queue full or rows unwritable)",
            "data": {"count": new_drops, "total": total},
        }

    def _reconnect_row(self, now: float, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "device_events", {
            "time_s": now,
            "host": self.host,
            "device_index": None,
            "device_uuid": None,
            "kind": "store_reconnected",
            "message": _reconnect_message(data),
            "data": data,
        }

    def _prepare(self, conn: Connection, table: str, rows: list[dict[str, Any]]) -> None:
        if table == "process_samples":
            _link_runs(conn, self.host, rows)

    def _after_rows(self, conn: Connection, now: float, new_drops: int, total: int) -> None:
        return None


def _link_runs(conn: Connection, host: str, rows: list[dict[str, Any]]) -> None:
    """Set each process row's ``run_id`` (see :class:`DeviceWriter`); one indexed query."""
    from sqlalchemy import or_, select

    from edo_monitor.store.schema import runs_table as runs
    from edo_monitor.store.status import stale_after_s

    for r in rows:
        r["run_id"] = None
    if not rows:
        return
    pids = sorted({r["pid"] for r in rows})
    times = [r["time_s"] for r in rows]
    stmt = select(
        runs.c.id,
        runs.c.pid,
        runs.c.started_at_s,
        runs.c.ended_at_s,
        runs.c.heartbeat_at_s,
        runs.c.interval_s,
    ).where(
        runs.c.host == host,
        runs.c.pid.in_(pids),
        runs.c.started_at_s <= max(times),
        or_(runs.c.ended_at_s.is_(None), runs.c.ended_at_s >= min(times)),
    )
    by_pid: dict[int, list[Any]] = {}
    for run in conn.execute(stmt):
        by_pid.setdefault(int(run.pid), []).append(run)
    if not by_pid:
        return
    for r in rows:
        best = None
        t = r["time_s"]
        for run in by_pid.get(r["pid"], ()):
            if run.started_at_s > t:
                continue
            if run.ended_at_s is not None:
                if run.ended_at_s < t:
                    continue
            elif run.heartbeat_at_s is not None and t - run.heartbeat_at_s > stale_after_s(
                run.interval_s
            ):
                continue
            if best is None or run.started_at_s > best.started_at_s:
                best = run
        if best is not None:
            r["run_id"] = int(best.id)


#: How many of a host's latest ``daemon_started`` / ``daemon_stopped`` events are looked at.
_DAEMON_EVENTS_LOOKED_AT = 200


def claim_host(engine: Engine, host: str, pid: int, row: dict[str, Any]) -> None:
    """Write the daemon's ``daemon_started`` event ``row`` unless another daemon is recording
    ``host`` into this database now, in one write transaction (SQLite: ``BEGIN IMMEDIATE``;
    PostgreSQL: an advisory lock), so two daemons started at once cannot both pass.

    Another daemon is one whose ``daemon_started`` event for ``host`` has no later
    ``daemon_stopped`` of its PID and whose PID is alive here, a process created before that
    event (not a PID reused after a daemon killed without its last event). Daemons of other
    hosts (a PostgreSQL database shared by many machines) are not in the way: their rows carry
    their host.

    Raises:
        StoreError: naming the other daemon's PID, when it started, and what to do.
    """
    from datetime import datetime, timezone

    import psutil
    from sqlalchemy import insert, select

    from edo_monitor.errors import StoreError
    from edo_monitor.store.dialect import _LOCK_CLASS, is_postgres
    from edo_monitor.store.schema import device_events_table as ev

    with engine.begin() as conn:
        if is_postgres(conn):
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(%(k)s, 1)", {"k": _LOCK_CLASS + 2})
        latest = conn.execute(
            select(ev.c.kind, ev.c.time_s, ev.c.data)
            .where(ev.c.host == host, ev.c.kind.in_(("daemon_started", "daemon_stopped")))
            .order_by(ev.c.id.desc())
            .limit(_DAEMON_EVENTS_LOOKED_AT)
        ).all()
        stopped: set[int] = set()
        for kind, time_s, data in latest:  # newest first
            other = (data or {}).get("pid")
            if not isinstance(other, int) or other == pid:
                continue
            if kind == "daemon_stopped":
                stopped.add(other)
                continue
            if other in stopped:
                continue
            stopped.add(other)  # an older start of the same PID is not looked at again
            try:
                alive = psutil.Process(other).create_time() <= float(time_s) + 1.0
            except (psutil.Error, OSError):
                alive = False
            if alive:
                when = datetime.fromtimestamp(float(time_s), timezone.utc)
                raise StoreError(
                    f"another edo-monitor daemon (pid {other}, started "
                    f"{when:%Y-%m-%d %H:%M:%S} UTC) is recording the GPUs of host {host!r} into "
                    "this database; a second one would record every GPU and process twice, "
                    "with nothing to tell its rows apart; stop that one first, or give this one "
                    "another --db"
                )
        conn.execute(insert(ev).values(**row))
