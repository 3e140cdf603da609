"""``edo-monitor sql``: one read-only, time-limited SQL statement on the history, its rows
printed as they are read (a table, CSV or JSON). On SQLite a read-only connection whose
authorizer denies every write, stopped by Ctrl-C or ``--timeout`` through the progress handler
and between rows (the deadline covers reading and printing alike); on a database server
(PostgreSQL, through psycopg 3) one query (``SELECT``, ``WITH``, ``VALUES``, ``TABLE``,
``EXPLAIN``, ``SHOW``; ``COPY``, ``DO``, ``CALL`` … are refused) as one prepared statement in a
read-only transaction with a ``statement_timeout``, run as the role ``pg_read_all_data`` where
the login can switch to it (no server files, programs or signals), rolled back; its values as
SQLite gives them (JSON as its text, ``numeric`` as a number), so a statement prints the same on
both.

A blob is ``<blob N bytes>`` in the table and hex in ``--csv`` and ``--json``; a text longer
than :data:`SQL_TABLE_MAX_CHARS` is cut in the table (the others print it whole): a 2 MB blob
took 4.4 s to lay out as a table, a 1 GB one 16 GB of memory."""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from decimal import Decimal
from typing import Annotated, Any

import typer
from rich.table import Table

from edo_monitor.errors import (
    ConfigError,
    StoreError,
)
from edo_monitor.surfaces.cli.common import (
    DbOpt,
    JsonOpt,
    RefusedError,
    _c,
    _handle_errors,
    _InterruptedError,
    app,
    json_text,
)
from edo_monitor.surfaces.cli.options import Number

logger = logging.getLogger(__name__)

_READ_PRAGMAS = {
    "table_info",
    "table_xinfo",
    "index_list",
    "index_info",
    "index_xinfo",
    "foreign_key_list",
    "integrity_check",
    "quick_check",
    "table_list",
    "function_list",
    "pragma_list",
    "collation_list",
    "database_list",
    "compile_options",
}


#: Pragmas that write without a value (``PRAGMA incremental_vacuum``): refused by name, not met
#: by the read-only file as a failure to open its '-shm' file.
_WRITE_PRAGMAS = {"incremental_vacuum"}

#: The schema table's names: the authorizer is asked to update it when a table-valued pragma
#: (``pragma_table_info('runs')``) is prepared.
_SCHEMA_TABLES = {"sqlite_master", "sqlite_schema", "sqlite_temp_master", "sqlite_temp_schema"}

_WRITE_ACTIONS = {
    getattr(sqlite3, name): name.removeprefix("SQLITE_")
    for name in dir(sqlite3)
    if name.startswith(("SQLITE_CREATE_", "SQLITE_DROP_", "SQLITE_ALTER"))
    or name
    in (
        "SQLITE_INSERT",
        "SQLITE_UPDATE",
        "SQLITE_DELETE",
        "SQLITE_ATTACH",
        "SQLITE_DETACH",
        "SQLITE_REINDEX",
        "SQLITE_ANALYZE",
    )
}


#: Rows the ``sql`` table shows (``--csv`` and ``--json`` stream every row).
SQL_TABLE_MAX_ROWS = 1000


#: Characters of a text value the ``sql`` table shows (the rest: ``… (N characters)``).
SQL_TABLE_MAX_CHARS = 200


#: ``sql --timeout`` default (seconds).
SQL_TIMEOUT_S = 60.0

#: ``sql --timeout``'s largest value (seconds, about 24.8 days): PostgreSQL's
#: ``statement_timeout`` is a 32-bit count of milliseconds (a larger one was an internal error,
#: "Value exceeds integer range"); SQLite is held to the same for one rule.
SQL_TIMEOUT_MAX_S = 2_147_483.0


_PROGRESS_STEPS = 10_000  # SQLite VM steps between checks for Ctrl-C and the time limit


class _Query:
    """One read-only statement on a SQLite history file, stoppable with Ctrl-C and by a time
    limit (SQLite's progress handler, checked every :data:`_PROGRESS_STEPS` VM steps), whose
    rows are read in pages as they are printed."""

    def __init__(self, path: str, query: str, timeout_s: float) -> None:
        from edo_monitor.store.paths import BUSY_TIMEOUT_S, readonly_uri

        self.denied: list[str] = []
        self.interrupted = False
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s if timeout_s > 0 else math.inf
        self.conn = sqlite3.connect(readonly_uri(path), uri=True, timeout=BUSY_TIMEOUT_S)
        self.path = path
        self.query = query

    def _authorizer(self, action: int, arg1: str | None, arg2: str | None, *_: Any) -> int:
        if action == sqlite3.SQLITE_UPDATE and (arg1 or "").lower() in _SCHEMA_TABLES:
            # asked when a table-valued pragma (pragma_table_info('runs')) is prepared; a real
            # UPDATE of the schema SQLite refuses itself ("may not be modified", read-only file)
            return sqlite3.SQLITE_OK
        if action in _WRITE_ACTIONS:
            self.denied.append(f"{_WRITE_ACTIONS[action]} {arg1 or ''}".strip())
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_PRAGMA:
            name = (arg1 or "").lower()
            if name in _WRITE_PRAGMAS or (arg2 is not None and name not in _READ_PRAGMAS):
                self.denied.append(f"PRAGMA {name}" + ("" if arg2 is None else f" = {arg2}"))
                return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def _progress(self) -> int:
        return 1 if self.interrupted or time.monotonic() > self.deadline else 0

    def _on_sigint(self, *_: Any) -> None:
        self.interrupted = True
        self.conn.interrupt()

    def rows(self) -> tuple[list[str], Iterator[tuple[Any, ...]]]:
        """Column names and an iterator over the rows, read one at a time (a row of large blobs
        is the most held at once) as they are printed; the time limit is checked before each.

        Raises:
            RefusedError: the statement would write, or it ran past the time limit.
            ConfigError: it is not valid SQL (or several statements).
            _InterruptedError: Ctrl-C.
            StoreError: the database cannot be read (the reason, never "a write").
        """
        self.conn.execute("PRAGMA query_only = ON")
        self.conn.set_authorizer(self._authorizer)
        self.conn.set_progress_handler(self._progress, _PROGRESS_STEPS)
        cur = self._call(lambda: self.conn.execute(self.query))
        names = [d[0] for d in cur.description or []]

        def each() -> Iterator[tuple[Any, ...]]:
            while True:
                # the printing of the rows before counts too: the deadline is the command's
                if self.interrupted:
                    raise _InterruptedError
                if time.monotonic() > self.deadline:
                    raise self._past_timeout()
                row = self._call(cur.fetchone)
                if row is None:
                    return
                yield row

        return names, each()

    def _past_timeout(self) -> RefusedError:
        return RefusedError(
            f"sql: the statement ran past --timeout {self.timeout_s:g} s and was stopped; "
            "give a larger --timeout (0 = no limit)"
        )

    def _call(self, fn: Callable[[], Any]) -> Any:
        from edo_monitor.store.paths import _readonly_error

        try:
            return fn()
        except sqlite3.Warning as exc:  # e.g. several statements
            raise ConfigError(f"sql: {exc}") from None
        except sqlite3.DatabaseError as exc:
            if self.interrupted:
                raise _InterruptedError from None
            if "interrupted" in str(exc) and time.monotonic() > self.deadline:
                raise self._past_timeout() from None
            if self.denied or any(w in str(exc) for w in ("not authorized", "may not be modified")):
                what = self.denied[0] if self.denied else "a write"
                raise RefusedError(
                    f"refused: the sql command is read-only ({what} would change the database)"
                ) from None
            err = _readonly_error(self.path, exc)
            if isinstance(err, StoreError):
                raise err from None
            if any(w in str(exc) for w in ("not a database", "malformed", "locked", "I/O")):
                raise StoreError(f"sql: cannot read {self.path!r}: {exc}") from None
            raise ConfigError(f"sql: {exc}") from None  # syntax, no such table or column …

    def __enter__(self) -> _Query:
        import signal
        import threading

        self._old_handler = None
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        if self._old_handler is not None:
            signal.signal(signal.SIGINT, self._old_handler)
        self.conn.close()


#: Statement kinds ``sql`` runs on a database server: queries. Anything else (``COPY``, ``DO``,
#: ``CALL``, ``LISTEN``/``NOTIFY``, ``SET``, DDL …) is refused before it is sent.
_SERVER_QUERY_KINDS = ("SELECT", "WITH", "VALUES", "TABLE", "EXPLAIN", "SHOW")

#: The PostgreSQL role ``sql`` runs a statement as (14+): reads every table and view, and holds
#: none of the rights to run server programs, read or write server files or signal backends.
_PG_READ_ROLE = "pg_read_all_data"

#: Predefined PostgreSQL roles whose rights a read-only transaction does not stop (with
#: superuser): a login holding one of them is warned about when it cannot switch roles.
_PG_SERVER_POWER_ROLES = (
    "pg_execute_server_program",
    "pg_write_server_files",
    "pg_read_server_files",
    "pg_signal_backend",
)

#: The other words a PostgreSQL statement starts with (15): refused as not a query. A first word
#: in neither list is not a statement: a syntax error, sent to no server.
_SERVER_OTHER_KINDS = frozenset(
    [
        "ABORT",
        "ALTER",
        "ANALYSE",
        "ANALYZE",
        "BEGIN",
        "CALL",
        "CHECKPOINT",
        "CLOSE",
        "CLUSTER",
        "COMMENT",
        "COMMIT",
        "COPY",
        "CREATE",
        "DEALLOCATE",
        "DECLARE",
        "DELETE",
        "DISCARD",
        "DO",
        "DROP",
        "END",
        "EXECUTE",
        "FETCH",
        "GRANT",
        "IMPORT",
        "INSERT",
        "LISTEN",
        "LOAD",
        "LOCK",
        "MERGE",
        "MOVE",
        "NOTIFY",
        "PREPARE",
        "REASSIGN",
        "REFRESH",
        "REINDEX",
        "RELEASE",
        "RESET",
        "REVOKE",
        "ROLLBACK",
        "SAVEPOINT",
        "SECURITY",
        "SET",
        "START",
        "TRUNCATE",
        "UNLISTEN",
        "UPDATE",
        "VACUUM",
    ]
)

_SKIP = re.compile(r"(?:\s+|--[^\n]*|\()+")


def _statement_kind(query: str) -> str:
    """The first keyword of ``query`` in capitals, after white space, comments (``--``, nested
    ``/* */``) and opening parentheses; else its first character (``""`` when there is none)."""
    i = 0
    while i < len(query):
        m = _SKIP.match(query, i)
        if m:
            i = m.end()
            continue
        if query.startswith("/*", i):
            depth, i = 1, i + 2
            while i < len(query) and depth:
                if query.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif query.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            continue
        break
    word = re.match(r"[A-Za-z_]+", query[i:])
    return word.group(0).upper() if word else query[i : i + 1]


def _drop_server_rights(conn: Any) -> str | None:
    """Run the rest of ``conn``'s (PostgreSQL) transaction as :data:`_PG_READ_ROLE`, with the
    login's schema search path kept (a ``"$user"`` schema included); the role, or ``None``
    when the login cannot switch to it (PostgreSQL before 14, a login not granted it): the
    statement then runs with the login's own rights, logged as a warning when those include
    superuser or one of :data:`_PG_SERVER_POWER_ROLES`."""
    from sqlalchemy.exc import DBAPIError

    conn.exec_driver_sql(
        "SELECT set_config('search_path', array_to_string(ARRAY(SELECT quote_ident(s) "
        "FROM unnest(current_schemas(false)) AS s), ','), true)"
    )
    try:
        with conn.begin_nested():
            conn.exec_driver_sql(f"SET LOCAL ROLE {_PG_READ_ROLE}")
        return _PG_READ_ROLE
    except DBAPIError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
    names = ", ".join(f"'{r}'" for r in _PG_SERVER_POWER_ROLES)
    powers = conn.exec_driver_sql(
        "SELECT 'superuser' FROM pg_roles WHERE rolname = current_user AND rolsuper "
        f"UNION ALL SELECT rolname FROM pg_roles WHERE rolname IN ({names}) "
        "AND pg_has_role(current_user, oid, 'USAGE')"
    ).scalars()
    held = sorted(set(powers))
    log = logger.warning if held else logger.info
    log(
        "sql: cannot run as %s (%s); the statement runs as the login%s",
        _PG_READ_ROLE,
        reason,
        f", which keeps {', '.join(held)}" if held else "",
    )
    return None


def _plain(value: Any) -> Any:
    """A server's value as SQLite gives it, so that a statement prints the same on both: a
    ``json``/``jsonb`` value, a ``dict`` or a ``list`` (an array) as JSON text (``json.dumps``,
    as the history's JSON columns are stored), a ``Decimal`` (``numeric``: ``sum`` of integers,
    ``avg``) as an ``int`` when it has no fractional digits, else a ``float``, a ``bool`` as
    ``1``/``0`` and a ``memoryview`` (``bytea``) as ``bytes``."""
    if isinstance(value, Decimal):
        if not value.is_finite():
            return float(value)
        exponent = value.as_tuple().exponent
        return int(value) if isinstance(exponent, int) and exponent >= 0 else float(value)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=_json_scalar)
    return value


def _json_scalar(value: Any) -> Any:
    plain = _plain(value)
    if isinstance(plain, bytes):
        return plain.hex()
    return str(plain) if plain is value else plain


def _prepared_rows(
    dbapi_conn: Any, query: str, timeout_s: float
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """``query`` run on a psycopg 3 connection as one prepared statement (the extended
    protocol: a second, ``;``-joined statement is refused by the server, where the simple one
    would run a ``COMMIT`` and what follows outside the read-only transaction); its column
    names and its rows as :func:`_plain` values. ``json``/``jsonb`` values are read as the
    server's text, not parsed: a ``json`` column's text is the ``json.dumps`` the history was
    written with, as SQLite stores it, and SQL ``NULL`` stays apart from JSON ``null``.

    Raises:
        RefusedError: it would write or needs a right the role lacks. StoreError: it ran past
            ``timeout_s``, or the server failed. ConfigError: the server refused it (syntax,
            several statements, unknown table or column …).
    """
    import psycopg
    from psycopg.types.string import TextLoader

    cur = dbapi_conn.cursor()
    for name in ("json", "jsonb"):
        cur.adapters.register_loader(name, TextLoader)
    try:
        cur.execute(query, prepare=True)
        if cur.description is None:
            return [], []
        return [d.name for d in cur.description], [tuple(_plain(v) for v in r) for r in cur]
    except psycopg.Error as exc:
        state = exc.sqlstate or ""
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        # read_only_sql_transaction; insufficient_privilege (the reading role's)
        if state in ("25006", "42501"):
            raise RefusedError(f"refused: the sql command is read-only ({reason})") from None
        if state == "57014":  # query_canceled: statement_timeout
            raise StoreError(
                f"sql: the statement ran longer than --timeout {timeout_s:g} s and was "
                "stopped; give a larger --timeout (0: no limit)"
            ) from None
        if state.startswith(("42", "0A")):  # syntax, names, unsupported: it does not compile
            raise ConfigError(f"sql: {reason}") from None
        raise StoreError(f"sql: {reason}") from None  # a run-time error (22: division by zero)
    finally:
        cur.close()


def _server_rows(
    url: Any, query: str, timeout_s: float = 0.0
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """One query on a database server (PostgreSQL), read-only, its values as SQLite gives
    them (:func:`_plain`).

    Only queries run (:data:`_SERVER_QUERY_KINDS`: a ``COPY``, ``DO``, ``CALL``, ``NOTIFY``,
    ``SET`` … is refused before it is sent). The session's transactions are read-only
    (``default_transaction_read_only``, set by read-only engines) and so is this one (``SET
    TRANSACTION READ ONLY``); on PostgreSQL it runs as :data:`_PG_READ_ROLE`
    (:func:`_drop_server_rights`), so that a function a read-only transaction allows but a
    reader must not call (``pg_terminate_backend``, ``pg_read_file``, ``lo_export`` …) is
    refused by the server's privileges, not by a list of names; ``statement_timeout`` stops
    it after ``timeout_s`` (0: no limit). The statement runs alone (one prepared statement:
    ``;``-joined statements are refused by the server), then the transaction is rolled back,
    and the connection closed (with any setting, advisory lock or notification it made).

    The role is a guard against mistakes, not a wall: a statement that deliberately switches
    back (``set_config('role', …)``) gets the login's rights; for untrusted statements use a
    login granted ``pg_read_all_data`` and nothing more.

    Raises:
        RefusedError: the statement is not a query, would write, or needs a right the role
            lacks. StoreError: it ran past ``timeout_s``.
        ConfigError: the server refused it (syntax, several statements, unknown table or
            column …), or the URL is not PostgreSQL through psycopg 3.
    """
    from edo_monitor.store.engine import open_engine

    kind = _statement_kind(query)
    kinds = f"{', '.join(_SERVER_QUERY_KINDS[:-1])} or {_SERVER_QUERY_KINDS[-1]}"
    if kind not in _SERVER_QUERY_KINDS and kind not in _SERVER_OTHER_KINDS:
        raise ConfigError(f'sql: syntax error at or near "{kind}": not a statement; give {kinds}')
    if kind not in _SERVER_QUERY_KINDS:
        raise RefusedError(
            f"refused: the sql command is read-only and runs queries only ({kind} is not one; "
            f"give {kinds})"
        )
    engine = open_engine(url, readonly=True)
    try:
        with engine.connect() as conn:
            dbapi_conn = conn.connection.dbapi_connection
            if engine.dialect.name != "postgresql" or not hasattr(dbapi_conn, "adapters"):
                raise ConfigError(
                    f"sql: on a database server the sql command needs PostgreSQL through psycopg "
                    f"3 (postgresql+psycopg://…), not {engine.dialect.name}+"
                    f"{engine.dialect.driver}: it runs the statement as one prepared statement"
                )
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")
            ms = math.ceil(timeout_s * 1000)
            conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
            _drop_server_rights(conn)
            try:
                names, rows = _prepared_rows(dbapi_conn, query, timeout_s)
            finally:
                conn.rollback()
    finally:
        engine.dispose()
    return names, rows


_BLOB_TYPES = (bytes, bytearray, memoryview)


def _cell(value: Any) -> str:
    """A value as the ``sql`` table shows it: ``NULL``, ``<blob N bytes>``, a text cut to
    :data:`SQL_TABLE_MAX_CHARS` characters with its length, else ``str(value)``."""
    if value is None:
        return "NULL"
    if isinstance(value, _BLOB_TYPES):
        return f"<blob {len(memoryview(value).cast('B')):,} bytes>"
    text = value if isinstance(value, str) else str(value)
    if len(text) > SQL_TABLE_MAX_CHARS:
        return f"{text[:SQL_TABLE_MAX_CHARS]}… ({len(text):,} characters)"
    return text


def _csv_value(value: Any) -> Any:
    """A blob as lowercase hex (as ``--json`` writes it), anything else as it is."""
    return bytes(value).hex() if isinstance(value, _BLOB_TYPES) else value


def _print_rows(
    names: list[str], rows: Iterable[tuple[Any, ...]], *, as_json: bool, as_csv: bool
) -> None:
    """Print rows as they come (CSV, JSON) or as one table of at most SQL_TABLE_MAX_ROWS."""
    out = sys.stdout
    if as_csv:
        w = csv.writer(out)
        w.writerow(names)
        for r in rows:
            w.writerow([_csv_value(v) for v in r])
        out.flush()
        return
    if as_json:
        out.write("[")
        first = True
        for r in rows:
            obj = json_text(dict(zip(names, r, strict=True)))
            out.write(("\n  " if first else ",\n  ") + obj)
            first = False
        out.write("\n]\n" if not first else "]\n")
        out.flush()
        return
    table = Table()
    for n in names:
        table.add_column(n)
    count = 0
    more = False
    for r in rows:
        if count == SQL_TABLE_MAX_ROWS:
            more = True
            break
        table.add_row(*(_cell(v) for v in r))
        count += 1
    _c.out.print(table)
    if more:
        _c.out.print(
            f"first {SQL_TABLE_MAX_ROWS} rows shown; --csv or --json print every row (streamed)"
        )
    else:
        _c.out.print(f"{count} row(s)")


@app.command("sql")
@_handle_errors
def sql_cmd(
    query: Annotated[str, typer.Argument(help='One read-only statement, e.g. "SELECT …".')],
    db: DbOpt = None,
    as_json: JsonOpt = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV.")] = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            help=f"Stop the statement after this many seconds (0: no limit) [default: "
            f"{SQL_TIMEOUT_S:g}]",
            show_default=False,
            parser=Number(float, 0.0, SQL_TIMEOUT_MAX_S, "s"),
        ),
    ] = SQL_TIMEOUT_S,
) -> None:
    """Run one read-only SQL statement; anything that would write is refused. Rows are printed
    as they are read (--csv, --json; the table shows the first 1000, a blob as <blob N bytes>
    and a text cut to 200 characters; --csv and --json give blobs as hex); Ctrl-C stops it, and
    so does --timeout, counted from the start: reading and printing the rows included."""
    from edo_monitor.store.paths import resolve_db_url

    if not math.isfinite(timeout) or timeout < 0:
        raise ConfigError(f"--timeout {timeout!r} must be a number of seconds ≥ 0 (0: no limit)")
    if as_json and as_csv:
        raise ConfigError("--json and --csv exclude each other; give one")
    if not query.strip().strip(";").strip():
        raise ConfigError(f'query {query!r} is empty; give one statement, e.g. "SELECT …"')
    if re.match(r"\s*vacuum\b", query, re.IGNORECASE):
        raise RefusedError("refused: the sql command is read-only (VACUUM writes)")
    url = resolve_db_url(db, readonly=True)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        with _Query(url.database, query, timeout) as q:
            names, rows = q.rows()
            _print_rows(names, rows, as_json=as_json, as_csv=as_csv)
        return
    names, server_rows = _server_rows(url, query, timeout)
    _print_rows(names, server_rows, as_json=as_json, as_csv=as_csv)
