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

Writer engines on SQLite also keep ``sample_rollups`` current. The agent's writer inserts with
:func:`write_samples`, which folds its new samples into the rollups in the same transaction,
aggregating them in Python from the tuples it already holds. Any other ``INSERT INTO samples``
on a writer engine (Core ``insert(Sample)``, :func:`insert_samples`) is followed, once at least
:data:`ROLLUP_MIN_ROWS` samples are waiting, by an SQL fold of the waiting samples
(:func:`roll_up`), also in the same transaction.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import time
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import chain, pairwise
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.exc import DatabaseError as SADatabaseError
from sqlalchemy.exc import DBAPIError as SADBAPIError

from edo_monitor.errors import ConfigError, StoreError
from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.schema import (
    ROLLUP_FIELDS,
    ROLLUP_LEVEL_WIDTHS_S,
    SCHEMA_VERSION,
    metadata,
)

__all__ = [
    "BUSY_TIMEOUT_S",
    "DEFAULT_DB",
    "ROLLUP_MIN_ROWS",
    "SqlDialect",
    "alembic_config",
    "check_writable",
    "database_file",
    "insert_job",
    "insert_samples",
    "is_postgres",
    "maintains_rollups",
    "open_engine",
    "readonly_uri",
    "rebuild_rollups",
    "resolve_db_url",
    "roll_up",
    "run_mark",
    "run_mark_key",
    "schema_version",
    "sql_dialect",
    "write_samples",
]

logger = logging.getLogger(__name__)

DEFAULT_DB = "edo-history.db"
#: How long a SQLite connection waits for a lock before giving up (seconds).
BUSY_TIMEOUT_S = 30.0
#: A writer folds new samples into ``sample_rollups`` once this many are waiting.
ROLLUP_MIN_ROWS = 1024

_MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def resolve_db_url(db: str | os.PathLike[str] | None = None, *, readonly: bool = False) -> URL:
    """Turn ``db`` (path, URL or ``None``) into an SQLAlchemy URL.

    Args:
        db: a path, an SQLAlchemy URL, or ``None``.
        readonly: for a reader, whose missing folder is a missing database (``StoreError``, as
            a missing file) rather than a bad value.

    Raises:
        ConfigError: the URL's scheme names no installed SQLAlchemy dialect, the string is not a
            URL, the path is a directory, or (writers) its folder does not exist.
        StoreError: (readers) the path's folder does not exist.
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
            _check_file_path(Path(url.database), text_, readonly)
        return url
    path = Path(text_).expanduser()
    _check_file_path(path, text_, readonly)
    return URL.create("sqlite", database=str(path))


def database_file(url: URL) -> Path | None:
    """The file an SQLite URL writes to; ``None`` for other databases and in-memory ones."""
    if url.get_backend_name() != "sqlite" or _is_memory(url):
        return None
    database = url.database or ""
    if database.startswith("file:"):  # a URI filename (``?uri=true``)
        database = database[5:].partition("?")[0]
    return Path(database).expanduser()


def _is_memory(url: URL) -> bool:
    if url.get_backend_name() != "sqlite":
        return False
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file::memory:"):
        return True
    return "mode=memory" in database or url.query.get("mode") == "memory"


def check_writable(url: URL) -> None:
    """Check, before a run starts, that a writer can record into ``url``.

    An in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``, ``mode=memory``) is
    refused: every connection (the agent's writer thread has its own) sees a different, empty
    database, and nothing could read it after the run. A file must be writable, and so must its
    folder (SQLite creates its ``-wal``, ``-shm`` and journal files there). Other databases are
    checked when the run starts.

    Raises:
        ConfigError: an in-memory SQLite URL.
        StoreError: the file or its folder is read-only (permissions or a read-only mount).
    """
    if _is_memory(url):
        raise ConfigError(
            f"db={url.render_as_string(hide_password=True)!r} is an in-memory SQLite database: "
            "the agent's writer thread would see a different, empty database and nothing could "
            "read it after the run; give a file path (e.g. db='runs.db')"
        )
    path = database_file(url)
    if path is None:
        return
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise StoreError(
            f"history database {str(path)!r} is read-only for this process; make it writable "
            "or give another db= path"
        )
    folder = path.parent if str(path.parent) else Path(".")
    if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise StoreError(
            f"folder {str(folder)!r} of history database {str(path)!r} is read-only for this "
            "process (SQLite writes its -wal and -shm files next to the database); give a db= "
            "path in a writable folder"
        )


#: Fallbacks of the path limits where the system does not say (Linux's PATH_MAX, NAME_MAX).
_PATH_MAX, _NAME_MAX = 4096, 255


def _short(shown: str, keep: int = 60) -> str:
    """``shown`` for a message: a path of 10,000 characters is cut in the middle."""
    return shown if len(shown) <= keep else f"{shown[: keep // 2]}…{shown[-keep // 2 :]}"


def _path_limits(path: Path) -> tuple[int, int]:
    """(PATH_MAX, NAME_MAX) of the nearest existing folder above ``path``."""
    for folder in (*path.parents, Path(".")):
        try:
            return (
                int(os.pathconf(folder, "PC_PATH_MAX")),
                int(os.pathconf(folder, "PC_NAME_MAX")),
            )
        except (OSError, ValueError):
            continue
    return _PATH_MAX, _NAME_MAX


def _check_file_path(path: Path, shown: str, readonly: bool = False) -> None:
    """The one check of a history path, for readers and writers alike, before SQLite sees it.

    Raises:
        ConfigError: the path (or a name in it) is longer than the system allows, or it names
            a directory, a FIFO, a socket or a device (SQLite would block forever on a FIFO).
        StoreError: (readers) its folder does not exist.
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        path_max, name_max = _path_limits(path)
        longest = max((len(part) for part in path.parts), default=0)
        what = (
            f"a name in it has {longest} characters, more than the {name_max} this file "
            "system allows"
            if longest > name_max
            else f"it has {len(os.fspath(path))} characters, more than the {path_max} this "
            "system allows"
        )
        raise ConfigError(f"db={_short(shown)!r}: the path is too long ({what})") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ConfigError(f"db={shown!r} is a directory; expected a database file path")
    if mode is not None and not stat.S_ISREG(mode):
        kind = (
            "a FIFO (named pipe)"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file"
        )
        raise ConfigError(
            f"db={shown!r} is {kind}, not a regular file; expected a database file path"
        )
    if not path.parent.exists():
        if readonly:
            raise StoreError(
                f"no history database at {shown!r}: folder {str(path.parent)!r} does not exist"
            )
        raise ConfigError(f"db={shown!r}: folder {str(path.parent)!r} does not exist")


def readonly_uri(path: str | os.PathLike[str]) -> str:
    """The SQLite URI that opens the history file ``path`` for reading only.

    The absolute path is percent-encoded (``#``, ``?``, ``%``, spaces and non-ASCII characters
    round-trip exactly; ``mode=ro`` never creates the file). A database in WAL mode whose folder
    this process cannot write, and whose ``-shm`` file is missing, cannot be opened the usual way
    (SQLite must create the ``-shm`` file to read it): when it has no ``-wal`` data either (a
    finished run: everything is in the main file) it is opened ``immutable=1``, which needs
    neither file.

    Raises:
        StoreError: the file is missing or not readable, or it is a WAL database whose ``-wal``
            file holds data but whose ``-shm`` file is missing in a folder this process cannot
            write (the message names the folder and the file).
    """
    p = Path(os.path.abspath(os.fspath(path)))
    if not p.exists():
        if not p.parent.is_dir():
            raise StoreError(
                f"no history database at {str(path)!r}: folder {str(p.parent)!r} does not exist"
            )
        raise StoreError(f"no history database at {str(path)!r} (nothing has been recorded yet)")
    if not os.access(p, os.R_OK):
        raise StoreError(f"cannot read history database {str(path)!r}: permission denied")
    if p.stat().st_size == 0:  # SQLite reads an empty file as an empty database: not a history
        raise StoreError(
            f"{str(path)!r} is not an edo-monitor history database: it is an empty file "
            "(0 bytes), with none of the history's tables"
        )
    uri = f"file:{quote(str(p))}?mode=ro"
    wal, shm = Path(f"{p}-wal"), Path(f"{p}-shm")
    if _is_wal(p) and not shm.exists() and not os.access(p.parent, os.W_OK | os.X_OK):
        wal_bytes = wal.stat().st_size if wal.exists() else 0
        if wal_bytes:
            raise StoreError(
                f"cannot read history database {str(path)!r}: {wal_bytes} bytes of its data are "
                f"still in {wal.name!r} (a run that did not close it), and SQLite must create "
                f"{shm.name!r} to read them, but folder {str(p.parent)!r} is not writable by this "
                "user; ask its owner to open it once (any edo-monitor command does), or copy the "
                "database with its -wal file to a folder you can write"
            )
        uri += "&immutable=1"  # finished: every page is in the main file, nothing can change it
        logger.info("reading %r immutably: its folder is not writable", str(path))
    return uri


def _is_wal(path: Path) -> bool:
    """Whether the SQLite file's header says WAL mode (read and write versions 2)."""
    try:
        with path.open("rb") as f:
            header = f.read(20)
    except OSError:
        return False
    return header[:16] == b"SQLite format 3\x00" and header[18:20] == b"\x02\x02"


def _connect_readonly(uri: str, shown: str) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # reads the schema now
    except sqlite3.OperationalError as exc:
        raise _readonly_error(shown, exc) from None
    return conn


def _readonly_error(shown: str, exc: sqlite3.Error) -> Exception:
    """An error a read-only open ran into, said as what it is (never "a write")."""
    reason = str(exc)
    if "readonly" in reason or "unable to open" in reason or "disk I/O" in reason:
        folder = os.path.dirname(os.path.abspath(shown))
        return StoreError(
            f"cannot read history database {shown!r}: SQLite needs to create or update its "
            f"'-shm' (shared memory) file beside it, and cannot ({reason}); is folder "
            f"{folder!r} writable by this user? Copy the database with its -wal file to a "
            "folder you can write, or ask its owner to open it once"
        )
    return exc


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
    url = db if isinstance(db, URL) else resolve_db_url(db, readonly=readonly)
    is_sqlite = url.get_backend_name() == "sqlite"
    connect_args: dict[str, object] = {}
    shown = url.database if is_sqlite and url.database else repr(url)
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
        raise StoreError(
            f"cannot open history database {shown}: its driver is not installed ({exc})"
        ) from None
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
        if readonly and is_sqlite and isinstance(exc.orig, sqlite3.Error):
            err = _readonly_error(shown, exc.orig)
            if isinstance(err, StoreError):
                raise err from None
        if "file is not a database" in reason or "malformed" in reason:
            raise StoreError(
                f"{shown!r} is not an SQLite database ({reason}); expected an edo-monitor history "
                "database file"
            ) from None
        raise StoreError(f"cannot open history database {shown!r}: {reason}") from None
    return engine


def schema_version(conn: Connection, tables: set[str] | None = None) -> int | None:
    """The database's schema version (``meta.schema_version``); ``None`` for an empty database.

    Args:
        tables: the database's table names when the caller has listed them already.

    Raises:
        StoreError: tables exist but this is not an edo-monitor history database.
    """
    if tables is None:
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


def _alembic_revision(conn: Connection, tables: set[str]) -> str | None:
    """``alembic_version.version_num`` (``None`` when the table or its row is missing)."""
    if "alembic_version" not in tables:
        return None
    row = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    return None if row is None else str(row)


def _refuse_newer(version: int | None, revision: str | None, shown: str) -> None:
    """Refuse a database from a newer edo-monitor, by either of its two version records: the
    ``meta`` row and Alembic's revision (``"000N"`` is schema version N; a revision this
    edo-monitor does not know is newer)."""
    rev_version = int(revision) if revision is not None and revision.isdigit() else None
    newer_meta = version is not None and version > SCHEMA_VERSION
    newer_rev = revision is not None and (rev_version is None or rev_version > SCHEMA_VERSION)
    if newer_meta or newer_rev:
        raise StoreError(
            f"history database {shown!r} comes from a newer edo-monitor: it has schema version "
            f"{version} (meta table) and Alembic revision {revision!r}, while this "
            f"edo-monitor's schema version is {SCHEMA_VERSION} (revision {SCHEMA_VERSION:04d}); "
            "upgrade edo-monitor to use it"
        )


#: Tables every schema version has (a database without one of them is damaged).
_CORE_TABLES = frozenset({"meta", "runs", "samples", "events", "module_stats"})


def _check_schema(engine: Engine, *, readonly: bool, shown: str) -> None:
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())  # listed once for the three checks
        version = schema_version(conn, tables)
        revision = _alembic_revision(conn, tables) if version is not None else None
    _refuse_newer(version, revision, shown)
    if version is not None:
        # all of this version's tables when it is ours, the ones every version has otherwise
        wanted = set(metadata.tables) if version == SCHEMA_VERSION else _CORE_TABLES
        missing = sorted(wanted - tables)
        if missing:
            raise StoreError(
                f"history database {shown!r} is damaged: it has schema version {version} but "
                f"not the table{'s' if len(missing) > 1 else ''} {', '.join(missing)}; "
                "edo-monitor neither reads nor writes it (copy out what you need with sqlite3, "
                "or start a new database)"
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
        if is_postgres(conn):  # PostgreSQL: a transaction-scoped advisory lock does the same
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(%(k)s, 0)", {"k": _LOCK_CLASS + 1})
        # again, under the lock: another writer may have done it
        tables = set(inspect(conn).get_table_names())
        version = schema_version(conn, tables)
        revision = _alembic_revision(conn, tables) if version is not None else None
        _refuse_newer(version, revision, shown)
        if version == SCHEMA_VERSION:
            return
        cfg = alembic_config(connection=conn)
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


#: ``samples`` columns in the order of :func:`write_samples` tuples (after ``run_id``).
_SAMPLE_COLS = ("run_id", *SAMPLE_FIELDS)
_TIME = SAMPLE_FIELDS.index("time_s")
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


def maintains_rollups(engine: Engine) -> bool:
    """Whether ``engine`` is a SQLite writer engine that keeps ``sample_rollups`` current.

    (PostgreSQL engines keep them current too, per run, in :func:`write_samples` and
    :func:`insert_samples`; see :func:`run_mark_key`.)
    """
    return event.contains(engine, "after_cursor_execute", _after_execute)


def is_postgres(conn: Connection | Engine) -> bool:
    """Whether ``conn`` talks to PostgreSQL (rather than SQLite)."""
    return conn.dialect.name == "postgresql"


class SqlDialect:
    """The few SQL idioms that differ between SQLite and PostgreSQL, as text to format in.

    SQLite's ``total()`` (a float sum, ``0.0`` over no values) is ``coalesce(sum()::float8, 0)``
    on PostgreSQL (whose ``sum`` of integers is ``numeric``); SQLite's ``CAST(x AS INTEGER)``
    truncates toward zero, PostgreSQL's rounds, hence ``trunc()``; SQLite's two-argument
    ``min``/``max`` are ``least``/``greatest``; SQLite's planner hints (``NOT INDEXED``, a unary
    ``+`` on a column) are dropped on PostgreSQL.
    """

    def __init__(self, postgres: bool) -> None:
        self.postgres = postgres
        self.not_indexed = "" if postgres else " NOT INDEXED"
        self.plus = "" if postgres else "+"

    def samples_above(self, param: str) -> str:
        """``FROM`` source and ``WHERE`` start for the samples with ``id > :param``, walked by
        id (the samples newer than a rollup mark): SQLite's ``NOT INDEXED``; on PostgreSQL a
        subquery fenced by ``OFFSET 0``, planned alone, so its only predicate picks the primary
        key range (never the ``(run_id, time_s)`` index over a whole run). Follow it with
        ``self.plus + "run_id = …"``."""
        if self.postgres:
            return f"(SELECT * FROM samples WHERE id > :{param} OFFSET 0) AS samples WHERE "
        return f"samples NOT INDEXED WHERE id > :{param} AND "

    def total(self, expr: str) -> str:
        """Float sum of the non-NULL values of ``expr`` (``0.0`` when there are none)."""
        return f"coalesce(sum({expr})::float8, 0)" if self.postgres else f"total({expr})"

    def trunc(self, expr: str) -> str:
        """``expr`` truncated toward zero, as an integer."""
        return f"trunc({expr})::bigint" if self.postgres else f"CAST({expr} AS INTEGER)"

    def least(self, a: str, b: str) -> str:
        """The smaller of two values."""
        return f"least({a}, {b})" if self.postgres else f"min({a}, {b})"


def sql_dialect(conn: Connection | Engine) -> SqlDialect:
    """The :class:`SqlDialect` of ``conn``'s database."""
    return SqlDialect(is_postgres(conn))


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


#: First key of the advisory locks that serialise one run's inserts on PostgreSQL ("edo1").
_LOCK_CLASS = 0x65646F31


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
    except sqlite3.Error as exc:
        raise SADBAPIError.instance(sql, None, exc, sqlite3.Error) from exc
    finally:
        cur.close()


_MARK_AND_TOP = (
    "SELECT (SELECT value FROM meta WHERE key = 'rollup_through_id'), (SELECT max(id) FROM samples)"
)


# -- rollups -----------------------------------------------------------------------------------


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
