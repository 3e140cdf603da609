"""``edo-monitor sql``: one read-only, time-limited SQL statement on the history, its rows
printed as they are read (a table, CSV or JSON). On SQLite a read-only connection whose
authorizer denies every write, stopped by Ctrl-C or ``--timeout`` through the progress handler
and between rows (the deadline covers reading and printing alike); on a database server
(PostgreSQL) a read-only transaction with a ``statement_timeout``, rolled back.

A blob is ``<blob N bytes>`` in the table and hex in ``--csv`` and ``--json``; a text longer
than :data:`SQL_TABLE_MAX_CHARS` is cut in the table (the others print it whole): a 2 MB blob
took 4.4 s to lay out as a table, a 1 GB one 16 GB of memory."""

from __future__ import annotations

import csv
import math
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
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
        if action in _WRITE_ACTIONS:
            self.denied.append(f"{_WRITE_ACTIONS[action]} {arg1 or ''}".strip())
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_PRAGMA:
            name = (arg1 or "").lower()
            if arg2 is not None and name not in _READ_PRAGMAS:
                self.denied.append(f"PRAGMA {name} = {arg2}")
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
            if self.denied or "not authorized" in str(exc):
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


def _server_rows(
    url: Any, query: str, timeout_s: float = 0.0
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """One statement on a database server (PostgreSQL), read-only: the session's transactions
    are read-only (``default_transaction_read_only``, set by read-only engines) and so is this
    one (``SET TRANSACTION READ ONLY``); ``statement_timeout`` stops it after ``timeout_s``
    (0: no limit). The statement runs alone (one prepared statement: ``;``-joined statements
    are refused by the server), then the transaction is rolled back.

    Raises:
        RefusedError: the statement would write. StoreError: it ran past ``timeout_s``.
        ConfigError: the server refused it (syntax, unknown table or column …).
    """
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    from edo_monitor.store.engine import open_engine

    engine = open_engine(url, readonly=True)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")
            if engine.dialect.name == "postgresql":
                ms = math.ceil(timeout_s * 1000)
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
            try:
                result = conn.execute(text(query))
                names = list(result.keys()) if result.returns_rows else []
                rows = [tuple(r) for r in result] if result.returns_rows else []
            except DBAPIError as exc:
                state = getattr(exc.orig, "sqlstate", None) or ""
                reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
                if state == "25006":  # read_only_sql_transaction
                    raise RefusedError(
                        f"refused: the sql command is read-only ({reason})"
                    ) from None
                if state == "57014":  # query_canceled: statement_timeout
                    raise StoreError(
                        f"sql: the statement ran longer than --timeout {timeout_s:g} s and was "
                        "stopped; give a larger --timeout (0: no limit)"
                    ) from None
                if state.startswith(("42", "22", "0A")):  # syntax, names, data, unsupported
                    raise ConfigError(f"sql: {reason}") from None
                raise StoreError(f"sql: {reason}") from None
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
