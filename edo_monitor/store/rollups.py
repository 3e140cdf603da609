"""Rollups of samples: per run, buckets of 10 s, 100 s and 1000 s folded from the raw samples past
a mark, in SQL (or Python where SQLite lacks what it needs)."""

from __future__ import annotations

import logging
import sqlite3
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import chain, pairwise
from typing import Any

from sqlalchemy import Connection, Engine, event, inspect, text

from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.dialect import _LOCK_CLASS, SqlDialect, is_postgres
from edo_monitor.store.schema import (
    ROLLUP_FIELDS,
    ROLLUP_LEVEL_WIDTHS_S,
)

logger = logging.getLogger(__name__)


#: A writer folds new samples into ``sample_rollups`` once this many are waiting.
ROLLUP_MIN_ROWS = 1024


def _after_execute(
    conn: Connection,
    cursor: Any,
    statement: str,
    parameters: Any,
    context: Any,
    executemany: bool,
) -> None:
    if not statement.startswith("INSERT INTO samples"):
        return
    dbapi = cursor.connection
    try:
        roll_up(dbapi, min_rows=ROLLUP_MIN_ROWS)
    except sqlite3.Error:  # rollups are an optimisation: readers fall back to raw samples
        logger.warning("could not update sample rollups", exc_info=True)


_TIME = SAMPLE_FIELDS.index("time_s")


def maintains_rollups(engine: Engine) -> bool:
    """Whether ``engine`` is a SQLite writer engine that keeps ``sample_rollups`` current.

    (PostgreSQL engines keep them current too, per run, in :func:`write_samples` and
    :func:`insert_samples`; see :func:`run_mark_key`.)
    """
    return event.contains(engine, "after_cursor_execute", _after_execute)


def run_mark_key(run_id: int) -> str:
    """The ``meta`` key of a run's rollup mark on PostgreSQL.

    On PostgreSQL several writers insert at once and sample ids are not committed in order, so
    one global ``rollup_through_id`` cannot say what the rollups hold. Each run has its own mark
    instead: every sample of run ``run_id`` with ``id <= int(meta[run_mark_key(run_id)])`` is in
    ``sample_rollups``. A run's inserts and folds are serialised by a transaction-scoped
    advisory lock on the run id (taken before the insert, so ids grow in commit order within a
    run).
    """
    return f"rollup_through_id:{int(run_id)}"


def run_mark(conn: Connection, run_id: int) -> int:
    """A run's rollup mark on PostgreSQL (0 when nothing of it is rolled up)."""
    row = conn.execute(
        text("SELECT value FROM meta WHERE key = :k"), {"k": run_mark_key(run_id)}
    ).first()
    return int(row[0]) if row else 0


def _pg_lock_run(conn: Connection, run_id: int) -> None:
    conn.exec_driver_sql(
        "SELECT pg_advisory_xact_lock(%(k)s, %(r)s)", {"k": _LOCK_CLASS, "r": int(run_id)}
    )


def _pg_set_run_mark(conn: Connection, run_id: int, value: int) -> None:
    conn.execute(
        text(
            "INSERT INTO meta (key, value) VALUES (:k, :v) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
        ),
        {"k": run_mark_key(run_id), "v": str(int(value))},
    )


def _pg_fold_run(conn: Connection, run_id: int) -> int:
    """Fold run ``run_id``'s samples above its mark into the rollups with SQL (PostgreSQL);
    the caller holds the run's advisory lock. Returns how many samples were folded."""
    lo = run_mark(conn, run_id)
    hi = conn.execute(text("SELECT max(id) FROM samples WHERE run_id = :r"), {"r": run_id}).scalar()
    if hi is None or int(hi) <= lo:
        return 0
    n = conn.execute(
        text("SELECT count(*) FROM samples WHERE run_id = :r AND id > :lo AND id <= :hi"),
        {"r": run_id, "lo": lo, "hi": int(hi)},
    ).scalar()
    _fold(
        conn,
        {"lo": lo, "hi": int(hi), "run": run_id},
        ROLLUP_FIELDS,
        ROLLUP_LEVEL_WIDTHS_S,
        one_run=True,
    )
    _pg_set_run_mark(conn, run_id, int(hi))
    return int(n or 0)


_MARK_AND_TOP = (
    "SELECT (SELECT value FROM meta WHERE key = 'rollup_through_id'), (SELECT max(id) FROM samples)"
)


def _check_widths(widths_s: Sequence[int]) -> None:
    """Level widths must be increasing powers of two (whole seconds): dividing a float time by
    a power of two is exact, so Python's ``int(t / w)`` and SQLite's ``CAST(t / w AS INTEGER)``
    put every sample in the same block, and a coarser block is exactly ``block // ratio``."""
    ok = all(isinstance(w, int) and w >= 1 and w & (w - 1) == 0 for w in widths_s) and all(
        a < b for a, b in pairwise(widths_s)
    )
    if not widths_s or not ok:
        raise ValueError(f"rollup widths {widths_s!r} must be increasing powers of two (seconds)")


def _rollup_cols(fields: Sequence[str]) -> list[str]:
    cols = ["run_id", "level", "block", "n", "time_min_s", "time_max_s"]
    for f in fields:
        cols += [f"{f}_min", f"{f}_max", f"{f}_sum", f"{f}_n"]
    return cols


def _upsert_set(fields: Sequence[str], postgres: bool = False) -> str:
    if postgres:  # least/greatest skip NULLs; the target table's columns must be qualified
        t = "sample_rollups."
        upd = [
            f"n = {t}n + excluded.n",
            f"time_min_s = least({t}time_min_s, excluded.time_min_s)",
            f"time_max_s = greatest({t}time_max_s, excluded.time_max_s)",
        ]
        for f in fields:
            upd += [
                f"{f}_min = least({t}{f}_min, excluded.{f}_min)",
                f"{f}_max = greatest({t}{f}_max, excluded.{f}_max)",
                f"{f}_sum = {t}{f}_sum + excluded.{f}_sum",
                f"{f}_n = {t}{f}_n + excluded.{f}_n",
            ]
        return f"ON CONFLICT (run_id, level, block) DO UPDATE SET {', '.join(upd)}"
    upd = [
        "n = n + excluded.n",
        "time_min_s = min(time_min_s, excluded.time_min_s)",
        "time_max_s = max(time_max_s, excluded.time_max_s)",
    ]
    for f in fields:
        upd += [
            f"{f}_min = coalesce(min({f}_min, excluded.{f}_min), {f}_min, excluded.{f}_min)",
            f"{f}_max = coalesce(max({f}_max, excluded.{f}_max), {f}_max, excluded.{f}_max)",
            f"{f}_sum = {f}_sum + excluded.{f}_sum",
            f"{f}_n = {f}_n + excluded.{f}_n",
        ]
    return f"ON CONFLICT (run_id, level, block) DO UPDATE SET {', '.join(upd)}"


def _agg_sql(
    fields: Sequence[str], width: int, *, one_run: bool = False, postgres: bool = False
) -> str:
    """Smallest-level aggregates of the samples with ``:lo < id <= :hi`` into the delta table."""
    d = SqlDialect(postgres)
    sel = [
        "run_id",
        "0",
        f"{d.trunc(f'time_s / {width}')} AS blk",
        "count(*)",
        "min(time_s)",
        "max(time_s)",
    ]
    for f in fields:
        sel += [f"min({f})", f"max({f})", d.total(f), f"count({f})"]
    return (
        f"INSERT INTO {'' if postgres else 'temp.'}edo_rollup_delta "
        f"({', '.join(_rollup_cols(fields))}) "
        f"SELECT {', '.join(sel)} FROM samples WHERE id > :lo AND id <= :hi "
        + ("AND run_id = :run " if one_run else "")
        + "GROUP BY run_id, blk"
    )


def _merge_sql(fields: Sequence[str], level: int, ratio: int, postgres: bool = False) -> str:
    """Fold the delta table (smallest-level blocks) into ``level`` (blocks ``ratio`` × wider)."""
    sel = [
        "run_id",
        str(level),
        f"block / {ratio} AS blk",
        "sum(n)",
        "min(time_min_s)",
        "max(time_max_s)",
    ]
    d = SqlDialect(postgres)
    for f in fields:
        sel += [f"min({f}_min)", f"max({f}_max)", d.total(f"{f}_sum"), f"sum({f}_n)"]
    return (
        f"INSERT INTO sample_rollups ({', '.join(_rollup_cols(fields))}) "
        f"SELECT {', '.join(sel)} FROM {'' if postgres else 'temp.'}edo_rollup_delta "
        "WHERE true GROUP BY run_id, blk " + _upsert_set(fields, postgres)
    )


def _upsert_sql(fields: Sequence[str], *, postgres: bool = False) -> str:
    """Merge one ready-made rollup row (``?``, PostgreSQL ``%s``, per column) into
    ``sample_rollups``."""
    key = (tuple(fields), "upsert-pg" if postgres else "upsert")
    sql = _UPSERT_CACHE.get(key)
    if sql is None:
        cols = _rollup_cols(fields)
        marks = ", ".join(["%s" if postgres else "?"] * len(cols))
        sql = _UPSERT_CACHE[key] = (
            f"INSERT INTO sample_rollups ({', '.join(cols)}) VALUES ({marks}) "
            + _upsert_set(fields, postgres)
        )
    return sql


_UPSERT_CACHE: dict[tuple[tuple[str, ...], str], str] = {}


_FIELD_INDEX: dict[tuple[str, ...], tuple[int, ...]] = {}


def _summary(col: Sequence[Any]) -> tuple[Any, ...]:
    """``(min, max, sum, count)`` of the non-NULL values, as SQLite's aggregates give them."""
    try:
        s = sum(col)
    except TypeError:  # NULLs among the values
        col = [x for x in col if x is not None]
        s = sum(col)
    if s != s:  # NaN: SQLite stores NaN as NULL
        col = [x for x in col if x == x]
        s = sum(col)
    return (min(col), max(col), float(s), len(col)) if col else _NO_VALUES


def _python_rollup(
    run_id: int, values: Sequence[Sequence[Any]], fields: Sequence[str], widths_s: Sequence[int]
) -> list[tuple[Any, ...]] | None:
    """Rollup rows (every level) of one run's new samples, computed from the tuples in memory.

    Returns ``None`` when the Python aggregates might differ from SQLite's (times out of order or
    negative); the caller then folds with SQL. Raises ``TypeError`` / ``ValueError`` /
    ``OverflowError`` on values that are not numbers (the caller folds with SQL too).
    """
    key = tuple(fields)
    idx = _FIELD_INDEX.get(key)
    if idx is None:
        idx = _FIELD_INDEX[key] = tuple(SAMPLE_FIELDS.index(f) for f in fields)
    cols = list(zip(*values, strict=True))
    times = cols[_TIME]
    n = len(times)
    w0 = widths_s[0]
    if not 0 <= times[0] <= times[-1] or list(times) != sorted(times):
        return None
    # the smallest level's blocks are slices of the (sorted) batch
    cuts: list[tuple[int, int, int]] = []
    a = 0
    while a < n:
        blk = int(times[a] / w0)
        b = bisect_left(times, (blk + 1) * w0, a)
        if b <= a or int(times[b - 1] / w0) != blk:
            return None
        cuts.append((a, b, blk))
        a = b
    # per block, per field: (min, max, sum, non-null count)
    per_cut: list[list[tuple[Any, ...]]] = [[] for _ in cuts]
    for j in idx:
        col = cols[j]
        first = col[0]
        if first == col[-1] and col.count(first) == n and (first is None or type(first) is int):
            # one value throughout (or all NULL): no need to look at them one by one
            for pc, (a, b, _) in zip(per_cut, cuts, strict=True):
                pc.append(
                    _NO_VALUES if first is None else (first, first, float(first * (b - a)), b - a)
                )
        elif len(cuts) == 1:
            per_cut[0].append(_summary(col))
        else:
            for pc, (a, b, _) in zip(per_cut, cuts, strict=True):
                pc.append(_summary(col[a:b]))
    rows = [
        (run_id, 0, blk, b - a, times[a], times[b - 1], *chain.from_iterable(per_cut[k]))
        for k, (a, b, blk) in enumerate(cuts)
    ]
    # coarser levels: smallest-level blocks grouped by block // ratio
    for level in range(1, len(widths_s)):
        ratio = widths_s[level] // w0
        groups: dict[int, list[int]] = {}
        for k, (_, _, blk) in enumerate(cuts):
            groups.setdefault(blk // ratio, []).append(k)
        for blk, ks in groups.items():
            start, end = cuts[ks[0]][0], cuts[ks[-1]][1]
            head = (run_id, level, blk, end - start, times[start], times[end - 1])
            if len(ks) == 1:
                rows.append((*head, *chain.from_iterable(per_cut[ks[0]])))
                continue
            row: list[Any] = list(head)
            for same_field in zip(*(per_cut[k] for k in ks), strict=True):
                parts = [p for p in same_field if p[3]]
                if len(parts) == 1:
                    row += parts[0]
                elif not parts:
                    row += _NO_VALUES
                else:
                    mins, maxs, sums, counts = zip(*parts, strict=True)
                    row += (min(mins), max(maxs), sum(sums), sum(counts))
            rows.append(tuple(row))
    return rows


_NO_VALUES = (None, None, 0.0, 0)


def _fold(
    conn: Any,
    params: Mapping[str, Any],
    fields: Sequence[str],
    widths_s: Sequence[int],
    *,
    one_run: bool = False,
) -> None:
    _check_widths(widths_s)
    pg = isinstance(conn, Connection) and is_postgres(conn)
    key = (tuple(fields), tuple(widths_s), one_run, pg)
    sqls = _SQL_CACHE.get(key)
    if sqls is None:
        w0 = widths_s[0]
        sqls = _SQL_CACHE[key] = [
            _agg_sql(fields, w0, one_run=one_run, postgres=pg),
            *(_merge_sql(fields, lvl, w // w0, pg) for lvl, w in enumerate(widths_s)),
        ]
    if pg:
        _exec(
            conn,
            "CREATE TEMP TABLE IF NOT EXISTS edo_rollup_delta AS "
            "SELECT * FROM sample_rollups WHERE false",
        )
        _exec(conn, "DELETE FROM edo_rollup_delta")
    else:
        _exec(
            conn,
            "CREATE TEMP TABLE IF NOT EXISTS edo_rollup_delta AS "
            "SELECT * FROM main.sample_rollups WHERE 0",
        )
        _exec(conn, "DELETE FROM temp.edo_rollup_delta")
    for sql in sqls:
        _exec(conn, sql, params)


_SQL_CACHE: dict[tuple[tuple[str, ...], tuple[int, ...], bool, bool], list[str]] = {}


def _exec(conn: Any, sql: str, params: Mapping[str, Any] | None = None) -> Any:
    if isinstance(conn, Connection):
        if is_postgres(conn):  # psycopg's own parameter style is %(name)s
            return conn.execute(text(sql), dict(params or {}))
        return conn.exec_driver_sql(sql, dict(params or {}))
    return conn.execute(sql, dict(params or {}))


def _get_mark(conn: Any) -> int:
    row = _exec(conn, "SELECT value FROM meta WHERE key = 'rollup_through_id'").fetchone()
    return int(row[0]) if row else 0


def roll_up(
    conn: Connection | sqlite3.Connection,
    *,
    min_rows: int = 0,
    fields: Sequence[str] = ROLLUP_FIELDS,
    widths_s: Sequence[int] = ROLLUP_LEVEL_WIDTHS_S,
) -> int:
    """Fold the samples not yet summarised into ``sample_rollups`` (SQLite, schema version ≥ 2).

    Runs inside the caller's transaction (a write transaction: the caller must hold the write
    lock, as writer engines' ``BEGIN IMMEDIATE`` does). Samples with ``id`` above
    ``meta['rollup_through_id']`` are aggregated per run, level and time block and merged into
    existing blocks; the mark then moves to the largest sample id.

    Args:
        conn: an SQLAlchemy connection or a DBAPI ``sqlite3`` connection.
        min_rows: do nothing while fewer samples than this are waiting (by id).
        fields, widths_s: the rollup columns and level widths (migrations pass their own).

    Returns:
        How many samples were folded in (0 when nothing was done).

    Raises:
        ValueError: ``widths_s`` are not increasing powers of two.

    On PostgreSQL (an SQLAlchemy connection) every run's samples above its own mark are folded
    (:func:`run_mark_key`), each under its run's advisory lock; ``min_rows`` is ignored.
    """
    _check_widths(widths_s)
    if isinstance(conn, Connection) and is_postgres(conn):
        folded = 0
        for (run_id,) in conn.execute(text("SELECT id FROM runs ORDER BY id")).all():
            _pg_lock_run(conn, run_id)
            folded += _pg_fold_run(conn, run_id)
        return folded
    lo = _get_mark(conn)
    hi_row = _exec(conn, "SELECT max(id) FROM samples").fetchone()
    hi = int(hi_row[0]) if hi_row and hi_row[0] is not None else 0
    if hi <= lo or hi - lo < min_rows:
        if hi < lo:  # rows were deleted (prune): the mark must not hide reused ids
            _set_mark(conn, hi)
        return 0
    _fold(conn, {"lo": lo, "hi": hi}, fields, widths_s)
    _set_mark(conn, hi)
    return hi - lo


def rebuild_rollups(conn: Connection, run_ids: Sequence[int]) -> None:
    """Recompute the rollups of ``run_ids`` from their samples (after samples were deleted).

    Runs in the caller's write transaction; a database without ``sample_rollups`` is left alone.
    """
    if "sample_rollups" not in inspect(conn).get_table_names():
        return
    if is_postgres(conn):
        for run_id in sorted(run_ids):
            _pg_lock_run(conn, run_id)
            _exec(conn, "DELETE FROM sample_rollups WHERE run_id = :r", {"r": run_id})
            _exec(conn, "DELETE FROM meta WHERE key = :k", {"k": run_mark_key(run_id)})
            _pg_fold_run(conn, run_id)
        return
    mark = _get_mark(conn)
    for run_id in run_ids:
        _exec(conn, "DELETE FROM sample_rollups WHERE run_id = :r", {"r": run_id})
        _fold(
            conn,
            {"lo": 0, "hi": mark, "run": run_id},
            ROLLUP_FIELDS,
            ROLLUP_LEVEL_WIDTHS_S,
            one_run=True,
        )


def _set_mark(conn: Any, value: int) -> None:
    _exec(
        conn,
        "INSERT INTO meta (key, value) VALUES ('rollup_through_id', :v) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        {"v": str(value)},
    )
