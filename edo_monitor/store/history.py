"""Reading past (and live) runs: the ``History`` API behind the CLI and the TUI.

Everything returned is a plain frozen dataclass or a list of them; times are Unix seconds (UTC),
byte counts ints, fractions floats in [0, 1]. ``None`` means "not recorded".

Downsampling happens in SQL. ``samples(run, max_points=N)`` splits the time range into at most
``N`` buckets and returns, per bucket and column, min / max / mean and the sample count, so a peak
is never averaged away. On SQLite databases with schema version ≥ 2 the buckets are assembled from
``sample_rollups`` (pre-aggregated, epoch-aligned time blocks of 16, 256 and 4096 s): the bucket
width is a whole number of blocks of the coarsest level that fits, so whole blocks add up to
exactly the answer a ``GROUP BY`` over every sample would give, while reading a few thousand rows
instead of millions. Samples newer than the rollups (``id > meta.rollup_through_id``) and the
partial blocks at the edges of a ``start``/``end`` window are read raw and merged. Buckets
narrower than the smallest level (a window shorter than ``16 s × max_points``) are computed from
the samples themselves.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import operator
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, inspect, select, text
from sqlalchemy.engine import URL

from edo_monitor.errors import RunNotFoundError, StoreError
from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.dialect import is_postgres, sql_dialect
from edo_monitor.store.engine import open_engine
from edo_monitor.store.history_devices import _DeviceQueries
from edo_monitor.store.history_jobs import _JobQueries
from edo_monitor.store.history_samples import _SampleQueries
from edo_monitor.store.migrate import schema_version
from edo_monitor.store.paths import shown_url
from edo_monitor.store.queries import (
    _MAX_TAIL_ROWS,
    _PEAK_COLUMNS,
    RunRef,
    _count,
    _int_or_none,
    _merge,
    _statuses,
    _tail_stats_sql,
    _to_epoch,
)
from edo_monitor.store.records import (
    RunInfo,
)
from edo_monitor.store.rollups import run_mark
from edo_monitor.store.schema import (
    ROLLUP_FIELDS,
    ROLLUP_LEVEL_WIDTHS_S,
    SCHEMA_VERSION,
    runs_table,
)
from edo_monitor.store.status import effective_status

__all__ = ["UUID_REF_LEN", "History"]

logger = logging.getLogger(__name__)

_RUN_COLUMNS = [c.name for c in runs_table.columns]
#: The ``runs`` columns of schema 6 (a multi-rank job); a reader of an older file reads them NULL.
_RANK_COLUMNS = ("job_id", "rank", "world_size", "local_rank")
#: Shortest uuid prefix the CLI prints as a run reference (8 hex digits, the dash, 4 more).
UUID_REF_LEN = 13


# -- result types ------------------------------------------------------------------------------


# -- helpers -----------------------------------------------------------------------------------


class History(_JobQueries, _DeviceQueries, _SampleQueries):
    """Read access to the history database.

    Args:
        db: path, SQLAlchemy URL or ``None`` (``EDO_DB``, else ``./edo-history.db``); or an
            existing :class:`sqlalchemy.Engine`.
        readonly: open read-only (the default; a missing file is an error). ``False`` opens as a
            writer, which creates or upgrades the database (used by ``prune``).

    Raises:
        ConfigError: bad ``db``.
        StoreError: missing file (read-only), not an edo-monitor database, newer schema.
    """

    def __init__(
        self, db: str | os.PathLike[str] | URL | Engine | None = None, *, readonly: bool = True
    ) -> None:
        if isinstance(db, Engine):
            self.engine = db
            self._owns_engine = False
        else:
            self.engine = open_engine(db, readonly=readonly)
            self._owns_engine = True
        self.readonly = readonly
        self._closed = False
        self._file = self._file_identity()
        with self._read() as conn:
            self.schema_version: int | None = schema_version(conn)
            inspector = inspect(conn)
            tables = set(inspector.get_table_names())
            present = (
                {c["name"] for c in inspector.get_columns("samples")}
                if "samples" in tables
                else set(SAMPLE_FIELDS)
            )
            run_present = (
                {c["name"] for c in inspector.get_columns("runs")}
                if "runs" in tables
                else {c.name for c in runs_table.columns}
            )
        #: the ``runs`` columns this file has (a file of an older schema lacks the rank ones)
        self._run_cols = [c for c in runs_table.columns if c.name in run_present]
        self._has_jobs = "jobs" in tables
        #: the sample columns a default read returns: those of ROLLUP_FIELDS this file has (a
        #: file of an older schema lacks the newer ones)
        self._default_columns = tuple(f for f in ROLLUP_FIELDS if f in present)
        self._empty = "runs" not in tables
        self._has_rollups = "sample_rollups" in tables
        self._has_devices = "device_samples" in tables  # schema 7: the daemon's tables
        self._pg = is_postgres(self.engine)
        self._sql = sql_dialect(self.engine)

    # -- lifecycle ---------------------------------------------------------------------------
    @contextmanager
    def _read(self) -> Iterator[Connection]:
        """A connection reading one consistent snapshot (one transaction on SQLite).

        Raises:
            StoreError: this object was closed (its engine would quietly open connections again).
        """
        if self._closed:
            raise StoreError(
                f"this History of {shown_url(self.engine.url)} was "
                "closed; open a new one to read it"
            )
        if self.replaced():
            raise StoreError(
                f"history database {self.engine.url.database!r} was removed or replaced since "
                "it was opened (its connections still read the old file); open it again"
            )
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "sqlite":
                conn.exec_driver_sql("SELECT 1")  # autobegin (writer engines: BEGIN IMMEDIATE)
                if not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
                    conn.exec_driver_sql("BEGIN")
            elif self.engine.dialect.name == "postgresql":
                # one snapshot for every statement (rollups, mark and raw tail agree)
                conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            yield conn

    def _file_identity(self) -> tuple[int, int] | None:
        """``(device, inode)`` of the SQLite file this object reads (``None``: not a file, or
        gone)."""
        url = self.engine.url
        if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
            return None
        try:
            st = os.stat(url.database)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def replaced(self) -> bool:
        """Whether the SQLite file this object opened was removed or replaced since (a new
        history recorded at its path, ``rm`` and a new run): its open connections would go on
        reading the old file, so a long-lived reader (the dashboard, ``edo-monitor metrics``)
        opens the path again. ``False`` for a database server. One ``stat`` (about 1 us)."""
        return self._file is not None and self._file_identity() != self._file

    def close(self) -> None:
        """Release the database connections (when this object opened them); reading after
        it raises :class:`StoreError`."""
        self._closed = True
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def outdated(self) -> str | None:
        """A sentence saying the database's schema is older than this edo-monitor's, else None."""
        if self.schema_version is not None and self.schema_version < SCHEMA_VERSION:
            return (
                f"history database has schema version {self.schema_version}, older than "
                f"{SCHEMA_VERSION}; it is read as it is and upgraded when next written to"
            )
        return None

    # -- runs --------------------------------------------------------------------------------
    def runs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        since: float | datetime | None = None,
        name: str | None = None,
        tag: str | None = None,
        limit: int | None = None,
    ) -> list[RunInfo]:
        """Runs, newest first.

        Args:
            status: keep runs with this effective status (or any of these): ``running``,
                ``finished``, ``failed``, ``interrupted``, ``crashed``.
            since: keep runs started at or after this time (Unix seconds or datetime; a naive
                datetime is UTC, as the CLI prints times).
            name: keep runs whose name matches (``*`` and ``?`` wildcards, else a substring;
                letter case ignored, every other character literal).
            tag: keep runs carrying this tag.
            limit: at most this many runs (after filtering).

        Raises:
            ConfigError: an unknown status, a bad ``since``, ``limit`` not an int >= 0 or None.
        """
        wanted = _statuses(status, "run")
        since_s = _to_epoch(since, "since")
        limit = _count(limit, "limit", 0)
        if self._empty:
            return []
        stmt = select(*self._run_cols).order_by(
            runs_table.c.started_at_s.desc(), runs_table.c.id.desc()
        )
        if since_s is not None:
            stmt = stmt.where(runs_table.c.started_at_s >= since_s)
        with self._read() as conn:
            rows = [dict(r._mapping) for r in conn.execute(stmt)]
        if name:  # here, not SQL LIKE: "_" and "%" were wildcards, case differed by backend
            rows = [r for r in rows if _name_matches(r["name"], name)]
        if tag is not None:
            rows = [r for r in rows if tag in (r["tags"] or [])]
        infos = [self._base_info(r) for r in rows]
        if wanted:
            infos = [i for i in infos if i.status in wanted]
        if limit is not None:
            infos = infos[:limit]
        return self._with_stats(infos)

    def run(self, ref: RunRef, *, stats: bool = True) -> RunInfo:
        """One run by id (an integer of any type, e.g. out of ``to_pandas()``, or digits), uuid
        prefix, or ``"latest"`` (most recently started).

        Args:
            ref: the run reference (every method taking a run also takes the :class:`RunInfo`
                this returns, for its id).
            stats: also summarise its samples and events (count, first/last sample time, peaks,
                minimum free fraction, event/action/OOM counts). ``False`` returns the stored row
                only (status, steps, heartbeat, …; one indexed lookup), with those fields left at
                their defaults (0 / ``None``): what a live viewer polling the status needs.

        Raises:
            RunNotFoundError: no run matches, or a uuid prefix matches several.
        """
        info = self._base_info(self._find(ref))
        return self._with_stats([info])[0] if stats else info

    def uuid_references(self) -> dict[int, str]:
        """For every run id, a uuid prefix that opens exactly that run with :meth:`run`.

        A prefix is at least :data:`UUID_REF_LEN` characters (13: ``"90455722-7c1e"``, the dash
        included, so it is never all digits and never read as a run id) and longer where another
        run's uuid starts the same way. A uuid that is all digits cannot be told from a run id at
        any length, and one that is not hexadecimal or is a prefix of another is no prefix
        reference either: their reference is the run id.
        """
        if self._empty:
            return {}
        with self._read() as conn:
            rows = sorted(
                (
                    (str(u).lower(), i)
                    for i, u in conn.execute(select(runs_table.c.id, runs_table.c.uuid))
                ),
            )
        refs: dict[int, str] = {}
        for k, (u, run_id) in enumerate(rows):
            need = UUID_REF_LEN
            for j in (k - 1, k + 1):  # sorted: the longest shared prefix is with a neighbour
                if 0 <= j < len(rows):
                    other = rows[j][0]
                    common = next(
                        (n for n, (a, b) in enumerate(zip(u, other, strict=False)) if a != b),
                        min(len(u), len(other)),
                    )
                    need = max(need, common + 1)
            ref = u[:need]
            hexa = re.fullmatch(r"[0-9a-f-]{1,36}", ref) is not None
            usable = hexa and not ref.isdigit() and len(ref) == need
            refs[run_id] = ref if usable else str(run_id)
        return refs

    def _find(self, ref: RunRef) -> dict[str, Any]:
        if self._empty:
            raise RunNotFoundError(f"no run {ref!r}: the history database has no runs")
        cols = self._run_cols
        if isinstance(ref, RunInfo):  # what run() returned: its id
            ref = ref.id
        elif not isinstance(ref, bool | str) and hasattr(ref, "__index__"):
            ref = operator.index(ref)  # an id out of to_pandas() is a numpy.int64
        if isinstance(ref, bool) or not isinstance(ref, int | str):
            raise RunNotFoundError(
                f"a {type(ref).__name__} is not a run reference; expected a run id, a uuid prefix "
                "or 'latest'"
            )
        with self._read() as conn:
            # ASCII digits only: int() also reads other scripts' digits ("५" is 5)
            if isinstance(ref, int) or (
                isinstance(ref, str) and ref.strip().isascii() and ref.strip().isdigit()
            ):
                if not 0 <= int(ref) < 2**63:  # no row has it (ids are int64 in SQL)
                    raise RunNotFoundError(f"no run with id {int(ref)}")
                row = conn.execute(select(*cols).where(runs_table.c.id == int(ref))).first()
                if row is not None:
                    return dict(row._mapping)
                # all digits is an id, never a uuid prefix: "show 0" must not open the run whose
                # uuid starts with 0
                raise RunNotFoundError(f"no run with id {int(ref)}")
            ref_s = str(ref).strip()
            if ref_s.lower() == "latest":
                row = conn.execute(
                    select(*cols)
                    .order_by(runs_table.c.started_at_s.desc(), runs_table.c.id.desc())
                    .limit(1)
                ).first()
                if row is None:
                    raise RunNotFoundError("no run 'latest': the history database has no runs")
                return dict(row._mapping)
            if not re.fullmatch(r"[0-9a-fA-F-]{1,36}", ref_s):
                raise RunNotFoundError(
                    f"no run {ref_s!r}: expected a run id, a uuid prefix or 'latest'"
                )
            found = conn.execute(
                select(*cols).where(runs_table.c.uuid.like(ref_s.lower() + "%")).limit(6)
            ).all()
        if not found:
            raise RunNotFoundError(f"no run with id or uuid prefix {ref_s!r}")
        if len(found) > 1:
            refs = self.uuid_references()  # long enough to tell each from the others
            shown = ", ".join(f"{r.id} ({refs.get(r.id, r.uuid)})" for r in found[:5])
            raise RunNotFoundError(
                f"uuid prefix {ref_s!r} matches several runs: {shown}; give more characters"
            )
        return dict(found[0]._mapping)

    def _base_info(self, r: Mapping[str, Any]) -> RunInfo:
        status = effective_status(
            r["status"],
            host=r["host"],
            pid=r["pid"],
            heartbeat_at_s=r["heartbeat_at_s"],
            interval_s=r["interval_s"],
        )
        end = r["ended_at_s"]
        if end is None:
            end = r["heartbeat_at_s"] if status != "running" else time.time()
        duration = max(0.0, (end or r["started_at_s"]) - r["started_at_s"])
        return RunInfo(
            id=r["id"],
            uuid=r["uuid"],
            name=r["name"],
            host=r["host"],
            pid=r["pid"],
            status=status,
            stored_status=r["status"],
            started_at_s=r["started_at_s"],
            ended_at_s=r["ended_at_s"],
            heartbeat_at_s=r["heartbeat_at_s"],
            duration_s=duration,
            error=r["error"],
            device_kind=r["device_kind"],
            device_name=r["device_name"],
            device_uuid=r["device_uuid"],
            device_total_bytes=r["device_total_bytes"],
            budget_bytes=r["budget_bytes"],
            interval_s=r["interval_s"],
            torch_version=r["torch_version"],
            config=dict(r["config"] or {}),
            tags=list(r["tags"] or []),
            steps=r["steps"],
            samples_dropped=r["samples_dropped"],
            **{c: r.get(c) for c in _RANK_COLUMNS},
        )

    def _with_stats(self, infos: list[RunInfo]) -> list[RunInfo]:
        if not infos:
            return infos
        ids = [i.id for i in infos]
        stats = self._sample_stats(ids)
        placeholders = ", ".join(str(int(i)) for i in ids)
        with self._read() as conn:
            ev = conn.execute(
                text(
                    "SELECT run_id, count(*), sum(CASE WHEN kind = 'action' THEN 1 ELSE 0 END), "
                    "sum(CASE WHEN kind = 'oom' THEN 1 ELSE 0 END) "
                    f"FROM events WHERE run_id IN ({placeholders}) GROUP BY run_id"
                )
            ).all()
        events = {r[0]: (int(r[1]), int(r[2] or 0), int(r[3] or 0)) for r in ev}
        out = []
        for info in infos:
            s = stats.get(info.id, {})
            n_ev, n_act, n_oom = events.get(info.id, (0, 0, 0))
            out.append(
                dataclasses.replace(
                    info,
                    sample_count=int(s.get("n") or 0),
                    first_sample_s=s.get("tmin"),
                    last_sample_s=s.get("tmax"),
                    **{f"peak_{c}": _int_or_none(s.get(f"{c}_max")) for c in _PEAK_COLUMNS},
                    min_free_fraction=s.get("free_fraction_min"),
                    event_count=n_ev,
                    action_count=n_act,
                    oom_count=n_oom,
                )
            )
        return out

    def _sample_stats(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        cols = [*_PEAK_COLUMNS, "free_fraction"]
        placeholders = ", ".join(str(int(i)) for i in ids)
        d = self._sql
        agg = ", ".join(f"min({c}), max({c}), {d.total(c)}, count({c})" for c in cols)
        parts: dict[int, dict[int, list[Any]]] = {}
        with self._read() as conn:
            marks = self._pg_marks(conn, ids) if self._has_rollups and self._pg else None
            mark = self._mark(conn) if self._has_rollups and not self._pg else None
            if marks is not None:  # PostgreSQL: each run has its own mark
                top = len(ROLLUP_LEVEL_WIDTHS_S) - 1
                r_agg = ", ".join(
                    f"min({c}_min), max({c}_max), {d.total(f'{c}_sum')}, sum({c}_n)" for c in cols
                )
                in_rollups = ", ".join(str(int(i)) for i in marks) or "NULL"
                results = list(
                    conn.execute(
                        text(
                            f"SELECT run_id, sum(n), min(time_min_s), max(time_max_s), {r_agg} "
                            f"FROM sample_rollups WHERE level = {top} AND run_id IN "
                            f"({in_rollups}) GROUP BY run_id"
                        )
                    ).all()
                )
                for run_id in ids:
                    results += conn.execute(
                        text(
                            f"SELECT run_id, count(*), min(time_s), max(time_s), {agg} FROM "
                            f"{d.samples_above('m')}run_id = :r GROUP BY run_id"
                        ),
                        {"r": run_id, "m": marks.get(run_id, 0)},
                    ).all()
            elif mark is not None:
                top = len(ROLLUP_LEVEL_WIDTHS_S) - 1
                r_agg = ", ".join(
                    f"min({c}_min), max({c}_max), total({c}_sum), sum({c}_n)" for c in cols
                )
                q1 = (
                    f"SELECT run_id, sum(n), min(time_min_s), max(time_max_s), {r_agg} "
                    f"FROM sample_rollups WHERE level = {top} AND run_id IN ({placeholders}) "
                    "GROUP BY run_id"
                )
                q2 = _tail_stats_sql(agg, placeholders)
                results = [
                    *conn.execute(text(q1)).all(),
                    *conn.execute(text(q2), {"mark": mark}).all(),
                ]
            else:
                q = (
                    f"SELECT run_id, count(*), min(time_s), max(time_s), {agg} FROM samples "
                    f"WHERE run_id IN ({placeholders}) GROUP BY run_id"
                )
                results = list(conn.execute(text(q)).all())
        for row in results:
            _merge(parts.setdefault(row[0], {}), 0, [*row[1:]], len(cols))
        out: dict[int, dict[str, Any]] = {}
        for run_id, acc in parts.items():
            v = acc[0]
            d: dict[str, Any] = {"n": v[0], "tmin": v[1], "tmax": v[2]}
            for j, c in enumerate(cols):
                d[f"{c}_min"] = v[3 + 4 * j]
                d[f"{c}_max"] = v[4 + 4 * j]
            out[run_id] = d
        return out

    def _pg_marks(self, conn: Any, ids: Sequence[int]) -> dict[int, int]:
        """PostgreSQL: the rollup marks of those of ``ids`` whose rollups are usable (not more
        than ``_MAX_TAIL_ROWS`` samples behind)."""
        out = {}
        for run_id in ids:
            m = self._mark(conn, run_id)
            if m is not None:
                out[run_id] = m
        return out

    def _mark(self, conn: Any, run_id: int | None = None) -> int | None:
        """Samples with ``id`` up to the returned mark are in the rollups (on PostgreSQL: of run
        ``run_id``); ``None``: the rollups are too far behind, read the samples raw."""
        if self._pg:
            assert run_id is not None
            mark = run_mark(conn, run_id)
            behind = conn.execute(
                text(
                    f"SELECT count(*) FROM (SELECT 1 FROM {self._sql.samples_above('m')}"
                    f"run_id = :r LIMIT {_MAX_TAIL_ROWS + 1}) AS tail"
                ),
                {"r": run_id, "m": mark},
            ).scalar()
            return None if int(behind or 0) > _MAX_TAIL_ROWS else mark
        row = conn.execute(text("SELECT value FROM meta WHERE key = 'rollup_through_id'")).first()
        mark = int(row[0]) if row else 0
        top = conn.execute(text("SELECT max(id) FROM samples")).scalar() or 0
        if top - mark > _MAX_TAIL_ROWS:
            return None  # rollups far behind (e.g. rows written by another tool): read raw
        return mark


def _name_matches(run_name: str, wanted: str) -> bool:
    """``wanted`` (``*`` any characters, ``?`` one; without them a substring) in ``run_name``,
    letter case ignored (``casefold``: "Üb" matches "üb")."""
    text, pattern = run_name.casefold(), wanted.casefold()
    if not any(ch in pattern for ch in "*?"):
        return pattern in text
    return fnmatch.fnmatchcase(text, pattern.replace("[", "[[]"))
