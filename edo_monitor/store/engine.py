"""Opening the history database: resolving ``db=``, SQLite pragmas, schema versions, rollups.

``db`` is a filesystem path (SQLite) or an SQLAlchemy URL (``sqlite:///…``, ``postgresql://…``).
When it is ``None`` the ``EDO_DB`` environment variable is used, else ``./edo-history.db``.

SQLite files are opened in WAL mode with a busy timeout, so one writer and any number of readers
(and several writer processes, each waiting its turn) never see "database is locked". Writer
connections start every transaction with ``BEGIN IMMEDIATE``: a transaction takes the write lock
(waiting up to the busy timeout) before it reads, so it can never fail later on a lock upgrade —
the one "database is locked" that a busy timeout cannot prevent. Readers open the file read-only
(``mode=ro``) and never create it. A writer creates a new SQLite file whole
(:func:`_create_history_file`): a reader finds no file or a complete history, never the empty
file of a writer that has only just opened it.

Schema versions are Alembic revisions (``edo_monitor/store/migrations``): schema version ``N`` is
revision ``"000N"``. A writer upgrades an older database when it opens it (holding the write lock,
so concurrent writers upgrade it once); a reader leaves it untouched and logs that it is older; a
database from a newer edo-monitor is refused, naming both versions.

Writer engines on SQLite also keep ``sample_rollups`` current. The agent's writer inserts with
:func:`write_samples`, which folds its new samples into the rollups in the same transaction,
aggregating them in Python from the tuples it already holds. Any other ``INSERT INTO samples``
on a writer engine (Core ``insert(Sample)``, :func:`insert_samples`) is followed, once at least
:data:`ROLLUP_MIN_ROWS` samples are waiting, by an SQL fold of the waiting samples
(:func:`roll_up`), also in the same transaction.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL, ExceptionContext
from sqlalchemy.exc import DatabaseError as SADatabaseError
from sqlalchemy.exc import DBAPIError as SADBAPIError
from sqlalchemy.exc import OperationalError

from edo_monitor.errors import StoreError, missing_extra
from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.dialect import is_postgres
from edo_monitor.store.migrate import _check_schema, _refuse_unusable
from edo_monitor.store.paths import (
    BUSY_TIMEOUT_S,
    _connect_readonly,
    _is_wal,
    _readonly_error,
    absolute_url,
    check_file_writable,
    database_file,
    readonly_uri,
    resolve_db_url,
    shown_database,
)
from edo_monitor.store.retry import CLOSE_TRIES, RETRY_PAUSE_S, is_transient
from edo_monitor.store.rollups import (
    _MARK_AND_TOP,
    _TIME,
    _after_execute,
    _pg_fold_run,
    _pg_lock_run,
    _pg_set_run_mark,
    _python_rollup,
    _set_mark,
    _upsert_sql,
    maintains_rollups,
    roll_up,
    run_mark,
)
from edo_monitor.store.schema import (
    ROLLUP_FIELDS,
    ROLLUP_LEVEL_WIDTHS_S,
)

__all__ = ["close_engine", "insert_job", "insert_samples", "open_engine", "write_samples"]

logger = logging.getLogger(__name__)


def _sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: object) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    cur.execute("PRAGMA foreign_keys = ON")
    cur.close()


def _sqlite_pragmas_rw(dbapi_conn: sqlite3.Connection, record: object) -> None:
    # autocommit at the driver level: SQLAlchemy's "begin" hook below emits BEGIN IMMEDIATE
    dbapi_conn.isolation_level = None
    _sqlite_pragmas(dbapi_conn, record)
    cur = dbapi_conn.cursor()
    _journal_mode_wal(cur)
    cur.execute("PRAGMA synchronous = NORMAL")
    cur.close()


def close_engine(engine: Engine) -> None:
    """Dispose of a writer's ``engine``; on SQLite first fold the write-ahead log into the
    database file (``PRAGMA wal_checkpoint(PASSIVE)``: every frame no open reader still needs,
    without waiting for one). SQLite folds it itself when its last connection closes, but not
    while another process reads the file (``edo-monitor metrics``, the dashboard): the runs
    written stayed in ``NAME-wal`` and a copy of ``NAME`` alone did not hold them. A failure
    is logged; the engine is disposed of anyway."""
    try:
        path = engine.url.database
        # a file deleted under the run is not made again by connecting to it
        if engine.dialect.name == "sqlite" and path and Path(path).is_file():
            # on the driver's connection, outside any transaction (a connection's "begin" hook
            # opens one, in which SQLite answers "database table is locked")
            raw = engine.raw_connection()
            try:
                raw.cursor().execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            finally:
                raw.close()
    except Exception:  # a lost file, a locked one: the log stays beside it, as before
        logger.debug("folding the write-ahead log into %s failed", engine.url, exc_info=True)
    finally:
        engine.dispose()


def _journal_mode_wal(cur: sqlite3.Cursor) -> None:
    """``PRAGMA journal_mode = WAL``, retried while the database is locked.

    Changing the journal mode needs the database to itself, and SQLite answers "database is
    locked" at once, without its busy handler, while another connection holds a lock: writers
    opening a new file at the same moment (the ranks of a job) failed to start, 10 of 10 times
    with six processes here. Retried with a growing pause for up to ``BUSY_TIMEOUT_S``, like any
    other lock wait; a file already in WAL mode answers at once.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    pause_s = 0.002
    while True:
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, 0.1)


def _begin_immediate(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def open_engine(
    db: str | os.PathLike[str] | URL | None = None, *, readonly: bool = False
) -> Engine:
    """Create an engine for the history database and check (writers: create or upgrade) its schema.

    Args:
        db: path, URL or ``None`` (see module docstring).
        readonly: open for reading only. A missing SQLite file is then an error instead of being
            created, and nothing in the file is changed (an older schema is reported in the log
            and read as it is).

    Raises:
        ConfigError: bad ``db`` value (see :func:`resolve_db_url`).
        MissingExtraError: a PostgreSQL URL without psycopg installed (the message gives
            ``pip install 'edo-monitor[postgres]'``).
        StoreError: the file is missing (readers), is read-only or in a read-only folder
            (writers: :func:`check_file_writable`), is not a database or not an edo-monitor
            database, comes from a newer edo-monitor, the server cannot be reached (writers:
            after ``CLOSE_TRIES`` tries ``RETRY_PAUSE_S`` apart, as the run's row is written:
            a connection dropped while the schema was made ended the program), or another
            URL's driver is not installed.
    """
    # a URL made elsewhere: its relative SQLite path, too, fixed to the working folder now
    url = absolute_url(db) if isinstance(db, URL) else resolve_db_url(db, readonly=readonly)
    if not readonly:  # a read-only file or folder said as such, not "unable to open"
        check_file_writable(url)
    new_file = None if readonly else database_file(url)
    if new_file is not None and not new_file.exists():
        _create_history_file(new_file)
    for _ in range(CLOSE_TRIES - 1):
        try:
            return _engine_for(url, readonly=readonly)
        except _ServerUnavailableError as exc:  # a writer: the run-row insert is retried too
            logger.warning("%s; trying again in %.0f s", exc, RETRY_PAUSE_S)
            time.sleep(RETRY_PAUSE_S)
    return _engine_for(url, readonly=readonly)  # the last try: its StoreError is the answer


def _create_history_file(path: Path) -> None:
    """Create a new SQLite history at ``path`` whole, or leave the one another writer made.

    SQLite creates a database file empty when it opens it and writes the schema afterwards; a
    reader opening the file in between found a zero-byte file (refused as not a history) or one
    without the tables yet (CI: a reader beside four starting writers). The
    schema is written to a hidden file beside ``path`` (``.NAME.PID-HEX.creating``), closed
    (SQLite then copies its WAL into it and deletes the ``-wal`` file), and hard-linked to
    ``path``, which either fails because another writer linked its own first (theirs is used) or
    makes the complete file appear at once. A filesystem without hard links gets the file
    created in place, as before.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.creating")
    try:
        tmp_url = URL.create("sqlite", database=str(tmp))
        _engine_for(tmp_url, readonly=False, shown=str(path)).dispose()
        wal = Path(f"{tmp}-wal")
        if wal.exists() and wal.stat().st_size:  # not folded into the file: creating in place
            logger.warning("could not create %r whole: its schema stayed in %s", str(path), wal)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            logger.debug("history database %r was created by another writer", str(path))
        except OSError as exc:  # hard links not supported here
            logger.info("creating history database %r in place (%s)", str(path), exc)
    finally:
        for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            leftover.unlink(missing_ok=True)


def _engine_for(
    url: URL, *, readonly: bool, shown: str | None = None, checks_only: bool = False
) -> Engine:
    """The engine of :func:`open_engine` for a resolved ``url``, its schema checked (upgraded);
    ``shown`` names the database in messages (default: the file, or the URL).

    A writer's connections switch an SQLite file to WAL mode as they connect (bytes 18 and 19
    of its header), before its schema can be checked. Every history file is in WAL mode
    already; one that exists and is not (another program's SQLite file, a damaged history) is
    first checked through a read-only engine (``checks_only``: the refusals alone, the engine
    returned disposed), so that ``prune``, ``watch(db=...)`` or the daemon refusing it leave it
    as it was, byte for byte, as every reader does."""
    is_sqlite = url.get_backend_name() == "sqlite"
    connect_args: dict[str, object] = {}
    if shown is None:
        shown = shown_database(url)
    if not readonly and _not_wal_yet(url):
        file_url = URL.create("sqlite", database=str(database_file(url)))
        _engine_for(file_url, readonly=True, shown=shown, checks_only=True)
    creator = None
    if is_sqlite:
        connect_args = {"timeout": BUSY_TIMEOUT_S, "check_same_thread": False}
        path = url.database
        if readonly and path and path != ":memory:":
            reader_uri = readonly_uri(path)  # raises StoreError: missing, unreadable
            url = URL.create("sqlite", database=path)

            def creator() -> sqlite3.Connection:
                return _connect_readonly(reader_uri, path)

    if readonly and url.get_backend_name() == "postgresql":
        # readers never write: every transaction of their sessions is read-only
        own = url.query.get("options") or ""
        own = own if isinstance(own, str) else " ".join(own)
        connect_args["options"] = f"{own} -c default_transaction_read_only=on".strip()
    try:
        engine = create_engine(
            url,
            connect_args=connect_args,
            pool_pre_ping=not is_sqlite,
            **({"creator": creator} if creator is not None else {}),
        )
    except ImportError as exc:  # the dialect is known, its DBAPI driver is not installed
        driver = url.get_dialect().driver
        if url.get_backend_name() == "postgresql" and driver == "psycopg":  # our extra's
            feature = f"the history database {shown}"
            raise missing_extra(feature, "psycopg", "postgres", exc) from None
        raise StoreError(
            f"cannot open history database {shown}: its driver {driver!r} is not installed ({exc})"
        ) from None
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_pragmas if readonly else _sqlite_pragmas_rw)
        if not readonly:
            event.listen(engine, "begin", _begin_immediate)
            event.listen(engine, "after_cursor_execute", _after_execute)
        # a page damaged in the middle of the file shows only when a statement reads it
        event.listen(engine, "handle_error", functools.partial(_damaged_page, shown))
    try:
        if checks_only:
            _refuse_unusable(engine, shown)
            engine.dispose()
        else:
            _check_schema(engine, readonly=readonly, shown=shown)
    except StoreError:
        engine.dispose()
        raise
    except (OperationalError, SADatabaseError) as exc:
        engine.dispose()
        # one line: psycopg's "connection refused" has a hint on a second
        reason = " ".join(part.strip() for part in str(exc.orig).splitlines() if part.strip())
        if readonly and is_sqlite and isinstance(exc.orig, sqlite3.Error):
            err = _readonly_error(shown, exc.orig)
            if isinstance(err, StoreError):
                raise err from None
        if "malformed" in reason:  # an SQLite file, cut short or overwritten in part
            raise damaged_database_error(shown, reason) from None
        if "file is not a database" in reason:
            raise StoreError(
                f"{shown!r} is not an SQLite database ({reason}); expected an edo-monitor history "
                "database file"
            ) from None
        if not readonly and not is_sqlite and is_transient(exc):
            raise _ServerUnavailableError(
                f"cannot open history database {shown!r}: {reason}"
            ) from None
        raise StoreError(f"cannot open history database {shown!r}: {reason}") from None
    return engine


def _not_wal_yet(url: URL) -> bool:
    """Whether ``url`` is an SQLite file that exists, is not empty and is not in WAL mode (a
    writer's first connection would change it before its schema is checked)."""
    path = database_file(url)
    try:
        return path is not None and path.stat().st_size > 0 and not _is_wal(path)
    except OSError:  # missing (a new file), or SQLite says what is wrong with it
        return False


class _ServerUnavailableError(StoreError):
    """A writer's open of a database server failed with a transient error (the server gone,
    the connection dropped, the database not taking connections yet): tried again."""


def damaged_database_error(shown: str, reason: str) -> StoreError:
    """The error of an SQLite file that SQLite finds damaged (``reason``: its message)."""
    return StoreError(
        f"{shown!r} is a damaged SQLite database ({reason}); edo-monitor neither reads "
        "nor writes it (copy out what you need with sqlite3, or start a new database)"
    )


def _damaged_page(shown: str, ctx: ExceptionContext) -> None:
    """An SQLite engine's ``handle_error`` hook: a statement that met a damaged page (SQLite's
    "database disk image is malformed") raises :func:`damaged_database_error`, whatever ran it
    (a query, or a write: ``prune`` deleting rows on the page, a run's writer)."""
    _raise_if_damaged(shown, ctx.original_exception)


def _raise_if_damaged(shown: str, exc: BaseException) -> None:
    """Raise :func:`damaged_database_error` when ``exc`` is SQLite's "database disk image is
    malformed" (a statement met a damaged page)."""
    if isinstance(exc, sqlite3.DatabaseError) and "malformed" in str(exc):
        raise damaged_database_error(shown, str(exc)) from None


#: ``samples`` columns in the order of :func:`write_samples` tuples (after ``run_id``).
_SAMPLE_COLS = ("run_id", *SAMPLE_FIELDS)
_SAMPLE_INSERT: dict[tuple[str, int | None], str] = {}


def _sample_insert_sql(style: str, run_id: int | None) -> str:
    """``INSERT INTO samples`` with one marker per column (``run_id`` inlined when given)."""
    key = (style, run_id)
    sql = _SAMPLE_INSERT.get(key)
    if sql is None:
        mark = "?" if style == "qmark" else "%s"
        first = mark if run_id is None else str(int(run_id))
        marks = ", ".join([first] + [mark] * len(SAMPLE_FIELDS))
        sql = _SAMPLE_INSERT[key] = (
            f"INSERT INTO samples ({', '.join(_SAMPLE_COLS)}) VALUES ({marks})"
        )
        if len(_SAMPLE_INSERT) > 256:  # one entry per run id: keep it bounded
            _SAMPLE_INSERT.clear()
    return sql


def insert_samples(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``samples`` rows (dicts with ``run_id`` and the Reading fields; missing keys are
    NULL) with one DBAPI ``executemany`` of positional tuples.

    Same result as ``conn.execute(insert(Sample), rows)`` but without SQLAlchemy's per-row
    parameter processing, which costs about twice the SQLite insert itself for the 30-column
    sample rows (see ``benchmarks/history.py``). Rollup maintenance still runs (writer engines
    fold the waiting samples in once :data:`ROLLUP_MIN_ROWS` have accumulated).
    """
    if not rows:
        return
    sql = _sample_insert_sql(conn.dialect.paramstyle, None)
    if is_postgres(conn):
        run_ids = sorted({int(r["run_id"]) for r in rows})
        for run_id in run_ids:  # in id order: two writers never wait on each other in a cycle
            _pg_lock_run(conn, run_id)
        conn.exec_driver_sql(sql, [tuple(map(r.get, _SAMPLE_COLS)) for r in rows])
        for run_id in run_ids:
            _pg_fold_run(conn, run_id)
        return
    conn.exec_driver_sql(sql, [tuple(map(r.get, _SAMPLE_COLS)) for r in rows])


def insert_job(conn: Connection, values: Mapping[str, Any]) -> bool:
    """Insert a ``jobs`` row unless one with its ``id`` exists (every rank of a job calls this,
    at once: ``INSERT ... ON CONFLICT (id) DO NOTHING`` on SQLite and PostgreSQL).

    Args:
        values: the ``jobs`` columns (``id``, ``name``, ``world_size``, ``backend``,
            ``id_source``, ``created_at_s``).

    Returns:
        Whether this call inserted it (``False``: another rank was first).
    """
    from edo_monitor.store.schema import jobs_table

    if is_postgres(conn):
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    stmt = dialect_insert(jobs_table).values(**values).on_conflict_do_nothing(index_elements=["id"])
    return conn.execute(stmt).rowcount == 1


def _pg_write_samples(conn: Connection, run_id: int, values: Sequence[Sequence[Any]]) -> None:
    """:func:`write_samples` on PostgreSQL: insert, then fold the batch into the rollups from
    the tuples in memory (per-run mark, see :func:`run_mark_key`)."""
    _pg_lock_run(conn, run_id)
    mark = run_mark(conn, run_id)
    waiting = conn.execute(
        text("SELECT 1 FROM samples WHERE id > :m AND run_id = :r LIMIT 1"),
        {"m": mark, "r": run_id},
    ).first()
    if waiting is not None:  # samples inserted by other means: fold them first
        _pg_fold_run(conn, run_id)
    sql = _sample_insert_sql(conn.dialect.paramstyle, run_id)
    conn.exec_driver_sql(sql, list(values))
    rows = None
    try:
        ordered = sorted(values, key=lambda v: v[_TIME])
        rows = _python_rollup(run_id, ordered, ROLLUP_FIELDS, ROLLUP_LEVEL_WIDTHS_S)
    except (TypeError, ValueError, OverflowError):
        rows = None
    if rows is None:
        _pg_fold_run(conn, run_id)
        return
    conn.exec_driver_sql(_upsert_sql(ROLLUP_FIELDS, postgres=True), rows)
    top = conn.execute(text("SELECT max(id) FROM samples WHERE run_id = :r"), {"r": run_id})
    _pg_set_run_mark(conn, run_id, int(top.scalar() or 0))


def write_samples(conn: Connection, run_id: int, values: Sequence[Sequence[Any]]) -> None:
    """Insert one run's samples, given as tuples in ``SAMPLE_FIELDS`` order, and keep the
    rollups current in the same transaction.

    This is the agent writer's path. The rows are inserted with one positional DBAPI
    ``executemany`` (``run_id`` written into the statement). On a writer engine that maintains
    ``sample_rollups`` (:func:`maintains_rollups`) the new samples are folded in at once,
    aggregated in Python from the tuples already in memory (per smallest-level block: ``min``,
    ``max``, ``sum`` and ``len`` of each column, C loops) instead of re-reading them with SQL
    aggregates (about 100 aggregate steps per sample, as expensive as the insert itself).
    Samples that other connections left unsummarised are folded in first (SQL, :func:`roll_up`),
    so ``meta['rollup_through_id']`` keeps meaning "every sample up to here is in the rollups".
    What the Python path cannot summarise exactly as SQLite would (times out of order or
    negative, values that are not plain numbers) is left to the SQL fold.

    Must run inside a write transaction (writer engines' ``BEGIN IMMEDIATE``). DBAPI errors are
    raised as SQLAlchemy's (``OperationalError`` for "locked" or I/O, so callers can retry).
    """
    if not values:
        return
    if is_postgres(conn):
        _pg_write_samples(conn, run_id, values)
        return
    sql = _sample_insert_sql(conn.dialect.paramstyle, run_id)
    if not maintains_rollups(conn.engine):
        conn.exec_driver_sql(sql, values)
        return
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    cur = dbapi.cursor()
    try:
        mark, top = cur.execute(_MARK_AND_TOP).fetchone()
        if top is not None and int(mark or 0) != top:
            # samples of other writers are waiting (or ids went down): fold them first
            roll_up(dbapi)
            mark, top = cur.execute(_MARK_AND_TOP).fetchone()
        top = top or 0
        cur.executemany(sql, values)
        rows = None
        if cur.execute("SELECT max(id) FROM samples").fetchone()[0] == top + len(values):
            try:  # our rows are exactly ids top+1 … top+len(values)
                rows = _python_rollup(run_id, values, ROLLUP_FIELDS, ROLLUP_LEVEL_WIDTHS_S)
            except (TypeError, ValueError, OverflowError):
                rows = None
        if rows is None:
            roll_up(dbapi)
        else:
            cur.executemany(_upsert_sql(ROLLUP_FIELDS), rows)
            _set_mark(cur, top + len(values))
    except sqlite3.Error as exc:  # the raw cursor's: SQLAlchemy's handle_error hook is not run
        _raise_if_damaged(str(conn.engine.url.database), exc)
        raise SADBAPIError.instance(sql, None, exc, sqlite3.Error) from exc
    finally:
        cur.close()


# -- rollups -----------------------------------------------------------------------------------
