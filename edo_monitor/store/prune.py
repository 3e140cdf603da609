"""Thinning a history: old runs dropped, old samples folded into rollups (edo-monitor prune)."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import text

from edo_monitor.errors import ConfigError
from edo_monitor.store.dialect import is_postgres
from edo_monitor.store.history import History
from edo_monitor.store.queries import (
    _PEAK_COLUMNS,
)
from edo_monitor.store.rollups import run_mark_key
from edo_monitor.store.schema import CACHE_FIELDS, RUNS_HIGH_ID_KEY
from edo_monitor.store.status import on_this_host, process_alive_here

logger = logging.getLogger(__name__)


_KEEP_MAX = (*_PEAK_COLUMNS,)


_KEEP_MIN = ("free_fraction",)


#: Sample columns that count since the previous sample (the row cache's): a thinned sample's
#: counts move to the next sample kept, so their sums over the run stay whole.
_DELTA_COLUMNS = tuple(c for c in CACHE_FIELDS if c != "cache_rows")


def _fold_counters(conn: Any, run_id: int, cut: float, kept: set[int]) -> None:
    """Add the counts of each sample about to be thinned (before ``cut``, not in ``kept``) to
    the next kept sample of the run in time order, so ``show``'s row-cache sums, the rollups and
    ``export`` keep every lookup. Each bucket's last sample is kept, so every thinned sample has
    a kept one after it."""
    rows = conn.execute(
        text(
            f"SELECT id, {', '.join(_DELTA_COLUMNS)} FROM samples "
            "WHERE run_id = :r AND time_s < :cut ORDER BY time_s, id"
        ),
        {"r": run_id, "cut": cut},
    ).fetchall()
    assign = ", ".join(f"{c} = :{c}" for c in _DELTA_COLUMNS)
    pending: list[int | None] = [None] * len(_DELTA_COLUMNS)
    for row in rows:
        values = [b if a is None else a + (b or 0) for a, b in zip(pending, row[1:], strict=True)]
        if int(row[0]) not in kept:
            pending = values
        elif pending != [None] * len(_DELTA_COLUMNS):
            conn.execute(
                text(f"UPDATE samples SET {assign} WHERE id = :id"),
                {"id": int(row[0]), **dict(zip(_DELTA_COLUMNS, values, strict=True))},
            )
            pending = [None] * len(_DELTA_COLUMNS)


def prune(
    history: History,
    *,
    older_than_s: float | None = None,
    keep_last: int | None = None,
    downsample_older_than_s: float | None = None,
    bucket_s: float = 60.0,
    dry_run: bool = False,
    vacuum: bool = False,
    now_s: float | None = None,
) -> dict[str, Any]:
    """Delete old runs and/or thin old samples; runs whose effective status is ``running``, or
    stored as running with a stale heartbeat while their process may live (alive on this host;
    on another host, a heartbeat within :data:`FOREIGN_RUN_GRACE_S`), are never touched.
    ``history`` must be writable (``readonly=False``) unless ``dry_run``.

    Args:
        older_than_s: delete runs started more than this many seconds ago.
        keep_last: keep only this many most recently started runs.
        downsample_older_than_s: in samples older than this (seconds), keep per run and
            ``bucket_s`` bucket only the first and last sample and the samples holding the
            bucket's maximum of each peak column (in use, allocated, reserved, process, device
            used, RSS) and its minimum free fraction. Peaks therefore survive.
        bucket_s: downsampling bucket width (seconds, > 0).
        dry_run: count only; change nothing.
        vacuum: run SQLite ``VACUUM`` afterwards to return freed pages to the disk.
        now_s: the present (Unix seconds), default ``time.time()``.

    Returns:
        ``{"runs_deleted", "run_ids_deleted", "samples_deleted", "runs_downsampled",
        "snapshots_deleted"}`` (snapshots thinned in downsampled runs: see
        :func:`edo_monitor.store.snapshot_store.thin_snapshots`).

    Raises:
        ConfigError: ``bucket_s <= 0`` or a negative ``keep_last``.
        StoreError: the history is read-only and ``dry_run`` is False.
    """
    from edo_monitor.errors import StoreError
    from edo_monitor.store.rollups import rebuild_rollups, roll_up
    from edo_monitor.store.snapshot_store import delete_runs_snapshots, thin_snapshots

    if bucket_s <= 0:
        raise ConfigError(f"bucket_s={bucket_s!r} must be > 0")
    if keep_last is not None and keep_last < 0:
        raise ConfigError(f"keep_last={keep_last!r} must be ≥ 0")
    if history.readonly and not dry_run:
        raise StoreError("prune needs a writable history (History(db, readonly=False))")
    now = time.time() if now_s is None else now_s
    runs = history.runs()  # newest first
    doomed: set[int] = set()
    if older_than_s is not None:
        doomed |= {r.id for r in runs if r.started_at_s < now - older_than_s}
    if keep_last is not None:
        doomed |= {r.id for r in runs[keep_last:]}
    doomed -= {r.id for r in runs if _may_be_running(r, now)}
    report: dict[str, Any] = {
        "runs_deleted": len(doomed),
        "run_ids_deleted": sorted(doomed),
        "samples_deleted": 0,
        "runs_downsampled": 0,
        "snapshots_deleted": 0,
    }
    thin = []
    if downsample_older_than_s is not None:
        cut = now - downsample_older_than_s
        thin = [
            r.id
            for r in runs
            if r.id not in doomed
            and not _may_be_running(r, now)
            and r.first_sample_s is not None
            and r.first_sample_s < cut
        ]
    ids = ", ".join(str(i) for i in sorted(doomed)) or "NULL"
    keeps = _keeps(history)  # reads the file's columns: not inside the transaction below
    with history._read() as conn:
        report["samples_deleted"] = int(
            conn.execute(text(f"SELECT count(*) FROM samples WHERE run_id IN ({ids})")).scalar()
            or 0
        )
        if dry_run:  # what would go: the same conditions, counted
            for run_id in thin:
                params = {"r": run_id, "cut": cut, "w": bucket_s}
                n = conn.execute(
                    text(f"SELECT count(*) {_THINNED.format(keeps=keeps)}"), params
                ).scalar()
                if n:
                    report["samples_deleted"] += int(n)
                    report["runs_downsampled"] += 1
            if thin:
                report["snapshots_deleted"] = thin_snapshots(conn, thin, cut, count_only=True)
            return report
        if doomed and not is_postgres(conn):  # SQLite would give their ids to new runs
            _remember_high_id(conn)
        delete_runs_snapshots(conn, ids)  # schema 8: before the events they link to
        conn.execute(text(f"DELETE FROM runs WHERE id IN ({ids})"))
        for table in ("samples", "events", "module_stats", "sample_rollups"):
            if table != "sample_rollups" or history._has_rollups:  # FK cascade, made explicit
                conn.execute(text(f"DELETE FROM {table} WHERE run_id IN ({ids})"))
        for run_id in thin:
            params = {"r": run_id, "cut": cut, "w": bucket_s}
            kept = {int(i) for (i,) in conn.execute(text(keeps), params).fetchall()}
            _fold_counters(conn, run_id, cut, kept)
            res = conn.execute(text(f"DELETE {_THINNED.format(keeps=keeps)}"), params)
            if res.rowcount:
                report["samples_deleted"] += res.rowcount
                report["runs_downsampled"] += 1
        if thin:  # schema 8: old snapshots thinned with the samples
            report["snapshots_deleted"] = thin_snapshots(conn, thin, cut)
        if doomed and history._has_jobs:  # jobs none of whose runs is left
            conn.execute(
                text(
                    "DELETE FROM jobs WHERE NOT EXISTS "
                    "(SELECT 1 FROM runs WHERE runs.job_id = jobs.id)"
                )
            )
        if history._pg:  # the deleted runs' rollup marks
            for run_id in sorted(doomed):
                conn.execute(text("DELETE FROM meta WHERE key = :k"), {"k": run_mark_key(run_id)})
        if history._has_rollups:
            roll_up(conn)  # fold in what is waiting; resets the mark if ids went down
            rebuild_rollups(conn, thin)
        conn.commit()
    if vacuum and history.engine.dialect.name == "sqlite":
        with history.engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            raw.execute("VACUUM")  # type: ignore[union-attr]
    logger.info("prune: %s", report)
    return report


#: the samples downsampling deletes from run ``:r`` (after ``SELECT count(*)`` or ``DELETE``)
_THINNED = "FROM samples WHERE run_id = :r AND time_s < :cut AND id NOT IN ({keeps})"


def _keeps(history: History) -> str:
    """The ids downsampling keeps of run ``:r`` before ``:cut`` (SQL): per ``:w``-second bucket
    the first and last sample and those holding a peak column's maximum or minimum, and the
    run's first sample with a row cache. Only the columns the file has: a dry run reads a file
    of an older schema as it is (its ``cache_rows`` missing, the count failed, exit 3)."""
    have = set(history.sample_columns)
    bucket = history._sql.trunc("time_s / :w")
    per_bucket = [
        f"SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY {bucket} "
        f"ORDER BY {order}) AS rn FROM samples WHERE run_id = :r AND time_s < :cut) "
        "AS k WHERE rn = 1"
        for order in (
            "time_s, id",
            "time_s DESC, id DESC",
            *(f"{c} DESC NULLS LAST, id" for c in _KEEP_MAX if c in have),
            *(f"{c} ASC NULLS LAST, id" for c in _KEEP_MIN if c in have),
        )
    ]
    if "cache_rows" not in have:
        return " UNION ".join(per_bucket)
    # and the first sample with a row cache: where show's row-cache steps begin (thinned, its
    # counts moved on, and "steps 2-300" read "steps 144-300", twice the bytes per step)
    first_cache = (  # no row without a cache (a NULL in "NOT IN" would keep every sample)
        "SELECT id FROM samples WHERE id = (SELECT min(id) FROM samples WHERE run_id = :r "
        "AND time_s < :cut AND cache_rows IS NOT NULL)"
    )
    return " UNION ".join([*per_bucket, first_cache])


def _remember_high_id(conn: Any) -> None:
    """Record the highest run id there ever was (:data:`RUNS_HIGH_ID_KEY`) before runs are
    deleted: a new run takes the id after it (:func:`~edo_monitor.store.schema.next_run_id`)."""
    top = conn.execute(text("SELECT max(id) FROM runs")).scalar()
    old = conn.execute(
        text("SELECT value FROM meta WHERE key = :k"), {"k": RUNS_HIGH_ID_KEY}
    ).scalar()
    high = max(int(top or 0), int(old or 0))
    conn.execute(text("DELETE FROM meta WHERE key = :k"), {"k": RUNS_HIGH_ID_KEY})
    row = {"k": RUNS_HIGH_ID_KEY, "v": str(high)}
    conn.execute(text("INSERT INTO meta (key, value) VALUES (:k, :v)"), row)


#: How long after its last heartbeat a run another host stored as ``running`` is kept by prune:
#: this host cannot ask whether its process lives (a network partition from a shared PostgreSQL
#: looks like a crash from here), and one deleted under it loses all it recorded.
FOREIGN_RUN_GRACE_S = 24 * 3600.0


def _may_be_running(run: Any, now_s: float) -> bool:
    """A run prune leaves alone: it reads ``running``, or ``crashed`` only for a stale heartbeat
    while its process may live: on this host, alive (stopped, swapping, in a debugger, waiting
    on a lock); on another host, a heartbeat within :data:`FOREIGN_RUN_GRACE_S`. It may write
    again, and a prune had deleted everything it recorded (its later rows then failed too)."""
    if run.status == "running":
        return True
    if run.stored_status != "running":
        return False
    if on_this_host(run.host):
        return process_alive_here(run.host, run.pid)
    beat = run.heartbeat_at_s if run.heartbeat_at_s is not None else run.started_at_s
    return now_s - beat < FOREIGN_RUN_GRACE_S
