"""A history's schema: its version, the Alembic upgrade a writer runs, a newer or damaged schema
refused."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.engine import URL

from edo_monitor.errors import StoreError
from edo_monitor.store.dialect import _LOCK_CLASS, is_postgres
from edo_monitor.store.paths import _short
from edo_monitor.store.schema import (
    SCHEMA_VERSION,
    metadata,
)

logger = logging.getLogger(__name__)

#: Alembic runs a migration through module-level proxies (``alembic.context``, ``alembic.op``)
#: that one command sets and unsets: two threads migrating at once, even two different files,
#: met each other's (``KeyError: 'config'``, "table meta already exists"). One at a time.
_ALEMBIC_LOCK = threading.Lock()


_MIGRATIONS = Path(__file__).resolve().parent / "migrations"


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


def schema_version(
    conn: Connection, tables: set[str] | None = None, shown: str | None = None
) -> int | None:
    """The database's schema version (``meta.schema_version``); ``None`` for an empty database.

    The one place that reads the version: every command (and ``History``, ``watch()``) opens a
    history through it, so a value it cannot use is refused here, before anything else reads
    or writes the file.

    Args:
        tables: the database's table names when the caller has listed them already.
        shown: the database as messages name it (default: its file or URL).

    Raises:
        StoreError: tables exist but this is not an edo-monitor history database; or it is a
            damaged one: its version row holds no schema version (``'abc'``, ``''``, ``1.5``,
            ``0``, ``-1``: every edo-monitor writes a whole number from 1), or there is no
            version row and no Alembic revision either (nothing says which schema its tables
            have; read as version 1, a writer's upgrade failed on "table meta already exists").
            A missing row beside an Alembic revision is read as 1, which the revision then
            contradicts (:func:`_refuse_disagreeing` names both).
    """
    if tables is None:
        tables = set(inspect(conn).get_table_names())
    if not tables:
        return None
    if shown is None:
        shown = str(conn.engine.url.database or conn.engine.url)
    if "runs" not in tables or "meta" not in tables:
        raise StoreError(
            f"{shown!r} is a database but not an edo-monitor history database (tables: "
            f"{', '.join(sorted(tables)[:8])})"
        )
    row = conn.execute(text("SELECT value FROM meta WHERE key = 'schema_version'")).scalar()
    if row is None:
        if _alembic_revision(conn, tables) is None:
            raise StoreError(
                f"history database {shown!r} is damaged: its meta table has no schema_version "
                f"row and it has no Alembic revision, so nothing says which schema its tables "
                f"have; {_NEITHER}"
            )
        return 1
    value = str(row).strip()
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise StoreError(
            f"history database {shown!r} is damaged: its meta table's schema_version is "
            f"{_short(str(row), 40)!r}, not a schema version (a whole number from 1); {_NEITHER}"
        )
    return int(value)


#: The end of every damaged-history message.
_NEITHER = (
    "edo-monitor neither reads nor writes it (copy out what you need with sqlite3, or start a "
    "new database)"
)


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


def _refuse_disagreeing(version: int | None, revision: str | None, shown: str) -> None:
    """Refuse a database whose two version records disagree: every migration sets both in one
    transaction, so a ``meta`` row that says another version than Alembic's revision (or is
    missing: read as 1) was lost to damage (the warning "schema version 1, older than 8" came
    before the damaged-database error of the first query)."""
    if version is None or revision is None or not revision.isdigit() or int(revision) == version:
        return
    raise StoreError(
        f"history database {shown!r} is damaged: its meta table says schema version {version} "
        f"and its Alembic revision {revision!r}; {_NEITHER}"
    )


#: Tables every schema version has (a database without one of them is damaged).
_CORE_TABLES = frozenset({"meta", "runs", "samples", "events", "module_stats"})


def _refuse_unusable(engine: Engine, shown: str) -> tuple[int | None, set[str]]:
    """The schema version of ``engine``'s database and its tables, when edo-monitor can use it:
    the refusals every open makes, reading only (a writer checks a file that is not in WAL mode
    yet this way before its first connection changes it).

    Raises:
        StoreError: not an edo-monitor history, damaged (:func:`schema_version`, two version
            records that disagree, a table of its version missing), or from a newer
            edo-monitor.
    """
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())  # listed once for the three checks
        version = schema_version(conn, tables, shown)
        revision = _alembic_revision(conn, tables) if version is not None else None
    _refuse_newer(version, revision, shown)
    _refuse_disagreeing(version, revision, shown)
    if version is not None:
        # all of this version's tables when it is ours, the ones every version has otherwise
        wanted = set(metadata.tables) if version == SCHEMA_VERSION else _CORE_TABLES
        missing = sorted(wanted - tables)
        if missing:
            raise StoreError(
                f"history database {shown!r} is damaged: it has schema version {version} but "
                f"not the table{'s' if len(missing) > 1 else ''} {', '.join(missing)}; {_NEITHER}"
            )
    return version, tables


def _check_schema(engine: Engine, *, readonly: bool, shown: str) -> None:
    version, tables = _refuse_unusable(engine, shown)
    if version == SCHEMA_VERSION:
        return
    if readonly:
        if version is None and not tables:  # a PostgreSQL database no writer has used yet
            raise StoreError(
                f"no history in {shown!r}: the database has no tables (nothing has been "
                "recorded yet)"
            )
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

    with _ALEMBIC_LOCK, engine.begin() as conn:  # BEGIN IMMEDIATE on SQLite: one upgrader at a time
        if is_postgres(conn):  # PostgreSQL: a transaction-scoped advisory lock does the same
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(%(k)s, 0)", {"k": _LOCK_CLASS + 1})
        # again, under the lock: another writer may have done it
        tables = set(inspect(conn).get_table_names())
        version = schema_version(conn, tables, shown)
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
