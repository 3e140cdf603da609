"""Opening the history database: resolving ``db=``, SQLite pragmas, schema versions, rollups.

``db`` is a filesystem path (SQLite) or an SQLAlchemy URL (``sqlite:///…``, ``postgresql://…``).
When it is ``None`` the ``EDO_DB`` environment variable is used, else ``./edo-history.db``.

SQLite files are opened in WAL mode with a busy timeout, so one writer and any number of readers
(and several writer processes, each waiting its turn) never see "database is locked". Writer
connections start every transaction with ``BEGIN IMMEDIATE``: a transaction takes the write lock
(waiting up to the busy timeout) before it reads, so it can never fail later on a lock upgrade —
the one "database is locked" that a busy timeout cannot prevent. Readers open the file read-only
(``mode=ro``) and never create it.

Schema versions are Alembic revisions (``edo_monitor/store/migrations``): schema version ``N`` is
revision ``"000N"``. A writer upgrades an older database when it opens it (holding the write lock,
so concurrent writers upgrade it once); a reader leaves it untouched and logs that it is older; a
database from a newer edo-monitor is refused, naming both versions.

Writer engines on SQLite also keep ``sample_rollups`` current (:func:`roll_up`): after an
``INSERT INTO samples`` batch, once at least :data:`ROLLUP_MIN_ROWS` samples are waiting, the new
samples are folded into the rollups inside the same transaction.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.exc import DatabaseError as SADatabaseError

from edo_monitor.errors import ConfigError, StoreError
from edo_monitor.store.schema import ROLLUP_FIELDS, ROLLUP_LEVEL_WIDTHS_S, SCHEMA_VERSION

__all__ = [
    "BUSY_TIMEOUT_S",
    "DEFAULT_DB",
    "ROLLUP_MIN_ROWS",
    "alembic_config",
    "insert_samples",
    "open_engine",
    "rebuild_rollups",
    "resolve_db_url",
    "roll_up",
    "schema_version",
]

logger = logging.getLogger(__name__)

DEFAULT_DB = "edo-history.db"
#: How long a SQLite connection waits for a lock before giving up (seconds).
BUSY_TIMEOUT_S = 30.0
#: A writer folds new samples into ``sample_rollups`` once this many are waiting.
ROLLUP_MIN_ROWS = 1024

_MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def resolve_db_url(db: str | os.PathLike[str] | None = None) -> URL:
    """Turn ``db`` (path, URL or ``None``) into an SQLAlchemy URL.

    Raises:
        ConfigError: the URL's scheme names no installed SQLAlchemy dialect, the string is not a
            URL, or the path is a directory.
    """
    if db is None:
        db = os.environ.get("EDO_DB") or DEFAULT_DB
    text_ = os.fspath(db)
    if not text_:
        raise ConfigError("db='' is empty; expected a file path or an SQLAlchemy URL")
    if "://" in text_:
        try:
            url = make_url(text_)
            url.get_dialect()
        except (ArgumentError, NoSuchModuleError, ValueError) as exc:
            raise ConfigError(
                f"db={text_!r} is not a usable database URL ({exc}); expected a file path or an "
                "SQLAlchemy URL such as 'sqlite:///runs.db' or 'postgresql://host/db'"
            ) from None
        if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
            _check_file_path(Path(url.database), text_)
        return url
    path = Path(text_).expanduser()
    _check_file_path(path, text_)
    return URL.create("sqlite", database=str(path))


def _check_file_path(path: Path, shown: str) -> None:
    if path.is_dir():
        raise ConfigError(f"db={shown!r} is a directory; expected a database file path")
    if not path.parent.exists():
        raise ConfigError(f"db={shown!r}: folder {str(path.parent)!r} does not exist")


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
    cur.execute("PRAGMA journal_mode = WAL")
    cur.execute("PRAGMA synchronous = NORMAL")
    cur.close()


def _begin_immediate(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


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


def alembic_config(url: URL | str | None = None, connection: Connection | None = None) -> Any:
    """An Alembic ``Config`` for the history migrations, built in code (no ``alembic.ini``).

    Args:
        url: database URL, used when no ``connection`` is given.
        connection: run the migrations on this connection (inside its transaction).
    """
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    if url is not None:
        shown = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
        cfg.set_main_option("sqlalchemy.url", shown.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


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
        StoreError: the file is missing (readers), is not a database or not an edo-monitor
            database, comes from a newer edo-monitor, or the server cannot be reached.
    """
    url = db if isinstance(db, URL) else resolve_db_url(db)
    is_sqlite = url.get_backend_name() == "sqlite"
    connect_args: dict[str, object] = {}
    shown = url.database if is_sqlite and url.database else repr(url)
    if is_sqlite:
        connect_args = {"timeout": BUSY_TIMEOUT_S, "check_same_thread": False}
        path = url.database
        if readonly and path and path != ":memory:":
            if not Path(path).exists():
                raise StoreError(f"no history database at {path!r} (nothing has been recorded yet)")
            url = URL.create(
                "sqlite", database=f"file:{Path(path).resolve()}?mode=ro", query={"uri": "true"}
            )
    engine = create_engine(url, connect_args=connect_args, pool_pre_ping=not is_sqlite)
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_pragmas if readonly else _sqlite_pragmas_rw)
        if not readonly:
            event.listen(engine, "begin", _begin_immediate)
            event.listen(engine, "after_cursor_execute", _after_execute)
    try:
        _check_schema(engine, readonly=readonly, shown=shown)
    except StoreError:
        engine.dispose()
        raise
    except (OperationalError, SADatabaseError) as exc:
        engine.dispose()
        reason = str(exc.orig)
        if "file is not a database" in reason or "malformed" in reason:
            raise StoreError(
                f"{shown!r} is not an SQLite database ({reason}); expected an edo-monitor history "
                "database file"
            ) from None
        raise StoreError(f"cannot open history database {shown!r}: {reason}") from None
    return engine


def schema_version(conn: Connection) -> int | None:
    """The database's schema version (``meta.schema_version``); ``None`` for an empty database.

    Raises:
        StoreError: tables exist but this is not an edo-monitor history database.
    """
    tables = set(inspect(conn).get_table_names())
    if not tables:
        return None
    if "runs" not in tables or "meta" not in tables:
        raise StoreError(
            f"{conn.engine.url.database or conn.engine.url!r} is a database but not an "
            f"edo-monitor history database (tables: {', '.join(sorted(tables)[:8])})"
        )
    row = conn.execute(text("SELECT value FROM meta WHERE key = 'schema_version'")).scalar()
    return int(row) if row is not None else 1


def _check_schema(engine: Engine, *, readonly: bool, shown: str) -> None:
    with engine.connect() as conn:
        version = schema_version(conn)
    if version is not None and version > SCHEMA_VERSION:
        raise StoreError(
            f"history database {shown!r} has schema version {version}, newer than this "
            f"edo-monitor's schema version {SCHEMA_VERSION}; upgrade edo-monitor to read it"
        )
    if version == SCHEMA_VERSION:
        return
    if readonly:
        if version is not None:
            logger.warning(
                "history database %r has schema version %d, older than %d; reading it as it is "
                "(it is upgraded the next time edo-monitor writes to it)",
                shown,
                version,
                SCHEMA_VERSION,
            )
        return
    _upgrade(engine, shown)


def _upgrade(engine: Engine, shown: str) -> None:
    from alembic import command

    with engine.begin() as conn:  # BEGIN IMMEDIATE on SQLite: one upgrader at a time
        version = schema_version(conn)  # again, under the lock: another writer may have done it
        if version == SCHEMA_VERSION:
            return
        if version is not None and version > SCHEMA_VERSION:
            raise StoreError(
                f"history database {shown!r} has schema version {version}, newer than this "
                f"edo-monitor's schema version {SCHEMA_VERSION}; upgrade edo-monitor to read it"
            )
        cfg = alembic_config(connection=conn)
        tables = set(inspect(conn).get_table_names())
        if version is not None and "alembic_version" not in tables:
            # written before migrations existed: its schema is exactly revision 000<version>
            command.stamp(cfg, f"{version:04d}")
        if version is None:
            logger.info("creating history database %r (schema version %d)", shown, SCHEMA_VERSION)
        else:
            logger.info(
                "upgrading history database %r from schema version %d to %d",
                shown,
                version,
                SCHEMA_VERSION,
            )
        command.upgrade(cfg, "head")


_SAMPLE_INSERT: dict[str, str] = {}


def insert_samples(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``samples`` rows (dicts with ``run_id`` and the Reading fields; missing keys are
    NULL) with one DBAPI ``executemany`` of positional tuples.

    Same result as ``conn.execute(insert(Sample), rows)`` but without SQLAlchemy's per-row
    parameter processing, which costs about twice the SQLite insert itself for the 30-column
    sample rows (see ``benchmarks/history.py``). Rollup maintenance still runs.
    """
    from edo_monitor.readings import SAMPLE_FIELDS

    if not rows:
        return
    cols = ("run_id", *SAMPLE_FIELDS)
    style = conn.dialect.paramstyle
    sql = _SAMPLE_INSERT.get(style)
    if sql is None:
        mark = "?" if style == "qmark" else "%s"
        sql = _SAMPLE_INSERT[style] = (
            f"INSERT INTO samples ({', '.join(cols)}) VALUES ({', '.join([mark] * len(cols))})"
        )
    conn.exec_driver_sql(sql, [tuple(r.get(c) for c in cols) for r in rows])


# -- rollups -----------------------------------------------------------------------------------


def _agg_sql(fields: Sequence[str], *, one_run: bool = False) -> str:
    """Level-0 (1 s) aggregates of the samples with ``:lo < id <= :hi`` into the delta table."""
    sel = [
        "run_id",
        "0",
        "CAST(time_s AS INTEGER) AS blk",
        "count(*)",
        "min(time_s)",
        "max(time_s)",
    ]
    cols = ["run_id", "level", "block", "n", "time_min_s", "time_max_s"]
    for f in fields:
        cols += [f"{f}_min", f"{f}_max", f"{f}_sum", f"{f}_n"]
        sel += [f"min({f})", f"max({f})", f"total({f})", f"count({f})"]
    return (
        f"INSERT INTO temp.edo_rollup_delta ({', '.join(cols)}) SELECT {', '.join(sel)} "
        "FROM samples WHERE id > :lo AND id <= :hi "
        + ("AND run_id = :run " if one_run else "")
        + "GROUP BY run_id, blk"
    )


def _merge_sql(fields: Sequence[str], level: int, ratio: int) -> str:
    """Fold the delta table (1 s blocks) into ``level`` (blocks ``ratio`` times wider)."""
    cols = ["run_id", "level", "block", "n", "time_min_s", "time_max_s"]
    sel = [
        "run_id",
        str(level),
        f"block / {ratio} AS blk",
        "sum(n)",
        "min(time_min_s)",
        "max(time_max_s)",
    ]
    upd = [
        "n = n + excluded.n",
        "time_min_s = min(time_min_s, excluded.time_min_s)",
        "time_max_s = max(time_max_s, excluded.time_max_s)",
    ]
    for f in fields:
        cols += [f"{f}_min", f"{f}_max", f"{f}_sum", f"{f}_n"]
        sel += [f"min({f}_min)", f"max({f}_max)", f"total({f}_sum)", f"sum({f}_n)"]
        upd += [
            f"{f}_min = coalesce(min({f}_min, excluded.{f}_min), {f}_min, excluded.{f}_min)",
            f"{f}_max = coalesce(max({f}_max, excluded.{f}_max), {f}_max, excluded.{f}_max)",
            f"{f}_sum = {f}_sum + excluded.{f}_sum",
            f"{f}_n = {f}_n + excluded.{f}_n",
        ]
    return (
        f"INSERT INTO sample_rollups ({', '.join(cols)}) SELECT {', '.join(sel)} "
        "FROM temp.edo_rollup_delta WHERE true GROUP BY run_id, blk "
        f"ON CONFLICT (run_id, level, block) DO UPDATE SET {', '.join(upd)}"
    )


def _fold(
    conn: Any,
    params: Mapping[str, Any],
    fields: Sequence[str],
    widths_s: Sequence[int],
    *,
    one_run: bool = False,
) -> None:
    if widths_s[0] != 1 or any(w % widths_s[0] for w in widths_s):
        raise ValueError(f"rollup widths {widths_s!r} must start at 1 s and be whole seconds")
    key = (tuple(fields), tuple(widths_s), one_run)
    sqls = _SQL_CACHE.get(key)
    if sqls is None:
        sqls = _SQL_CACHE[key] = [
            _agg_sql(fields, one_run=one_run),
            *(_merge_sql(fields, lvl, w) for lvl, w in enumerate(widths_s)),
        ]
    _exec(
        conn,
        "CREATE TEMP TABLE IF NOT EXISTS edo_rollup_delta AS "
        "SELECT * FROM main.sample_rollups WHERE 0",
    )
    _exec(conn, "DELETE FROM temp.edo_rollup_delta")
    for sql in sqls:
        _exec(conn, sql, params)


_SQL_CACHE: dict[tuple[tuple[str, ...], tuple[int, ...], bool], list[str]] = {}


def _exec(conn: Any, sql: str, params: Mapping[str, Any] | None = None) -> Any:
    if isinstance(conn, Connection):
        return conn.exec_driver_sql(sql, dict(params or {}))
    return conn.execute(sql, dict(params or {}))


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
    """
    row = _exec(conn, "SELECT value FROM meta WHERE key = 'rollup_through_id'").fetchone()
    lo = int(row[0]) if row else 0
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
    row = _exec(conn, "SELECT value FROM meta WHERE key = 'rollup_through_id'").fetchone()
    mark = int(row[0]) if row else 0
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
