"""Opening the history database: resolving ``db=``, SQLite pragmas, schema checks.

``db`` is a filesystem path (SQLite) or an SQLAlchemy URL (``sqlite:///…``, ``postgresql://…``).
When it is ``None`` the ``EDO_DB`` environment variable is used, else ``./edo-history.db``.

SQLite files are opened in WAL mode with a busy timeout, so one writer and any number of readers
(and several writer processes, each waiting its turn) never see "database is locked".
Readers open the file read-only (``mode=ro``) and never create it.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.exc import DatabaseError as SADatabaseError
from sqlalchemy.orm import Session

from edo_monitor.errors import ConfigError, StoreError
from edo_monitor.store.schema import SCHEMA_VERSION, Base, Meta

__all__ = ["DEFAULT_DB", "BUSY_TIMEOUT_S", "open_engine", "resolve_db_url"]

logger = logging.getLogger(__name__)

DEFAULT_DB = "edo-history.db"
#: How long a SQLite connection waits for a lock before giving up (seconds).
BUSY_TIMEOUT_S = 30.0


def resolve_db_url(db: str | os.PathLike[str] | None = None) -> URL:
    """Turn ``db`` (path, URL or ``None``) into an SQLAlchemy URL.

    Raises:
        ConfigError: the URL's scheme names no installed SQLAlchemy dialect, the string is not a
            URL, or the path is a directory.
    """
    if db is None:
        db = os.environ.get("EDO_DB") or DEFAULT_DB
    text = os.fspath(db)
    if not text:
        raise ConfigError("db='' is empty; expected a file path or an SQLAlchemy URL")
    if "://" in text:
        try:
            url = make_url(text)
            url.get_dialect()
        except (ArgumentError, NoSuchModuleError, ValueError) as exc:
            raise ConfigError(
                f"db={text!r} is not a usable database URL ({exc}); expected a file path or an "
                "SQLAlchemy URL such as 'sqlite:///runs.db' or 'postgresql://host/db'"
            ) from None
        if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
            _check_file_path(Path(url.database), text)
        return url
    path = Path(text).expanduser()
    _check_file_path(path, text)
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
    _sqlite_pragmas(dbapi_conn, record)
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode = WAL")
    cur.execute("PRAGMA synchronous = NORMAL")
    cur.close()


def open_engine(db: str | os.PathLike[str] | URL | None = None, *, readonly: bool = False) -> Engine:
    """Create an engine for the history database and check (writers: create) its schema.

    Args:
        db: path, URL or ``None`` (see module docstring).
        readonly: open for reading only. A missing SQLite file is then an error instead of being
            created, and nothing in the file is changed.

    Raises:
        ConfigError: bad ``db`` value (see :func:`resolve_db_url`).
        StoreError: the file is missing (readers), is not a database, comes from a newer
            edo-monitor, or the server cannot be reached.
    """
    url = db if isinstance(db, URL) else resolve_db_url(db)
    is_sqlite = url.get_backend_name() == "sqlite"
    connect_args: dict[str, object] = {}
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
    try:
        _check_schema(engine, readonly=readonly)
    except StoreError:
        engine.dispose()
        raise
    except (OperationalError, SADatabaseError) as exc:
        engine.dispose()
        raise StoreError(f"cannot open history database {url!r}: {exc.orig}") from None
    return engine


def _check_schema(engine: Engine, *, readonly: bool) -> None:
    tables = set(inspect(engine).get_table_names())
    if "runs" not in tables:
        if readonly:
            if tables:
                raise StoreError(f"{engine.url!r} is not an edo-monitor history database")
            return  # an empty database: readers see no runs
        Base.metadata.create_all(engine)
        with Session(engine) as session, session.begin():
            session.merge(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
        return
    with Session(engine) as session:
        row = session.execute(select(Meta.value).where(Meta.key == "schema_version")).scalar()
    version = int(row) if row is not None else 0
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"history database {engine.url!r} has schema version {version}, newer than this "
            f"edo-monitor's {SCHEMA_VERSION}; upgrade edo-monitor to read it"
        )
