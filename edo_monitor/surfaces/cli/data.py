"""The commands over the database itself: export, sql (read-only, time-limited), prune, doctor."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from edo_monitor.errors import (
    ConfigError,
    StoreError,
)
from edo_monitor.surfaces.cli.common import (
    EXIT_ERROR,
    DbOpt,
    JsonOpt,
    RefusedError,
    RunArg,
    _bytes,
    _c,
    _handle_errors,
    _history,
    _info_dict,
    _InterruptedError,
    _json_default,
    _parse_duration,
    _print_json,
    _require_database,
    app,
)
from edo_monitor.surfaces.cli.options import INT64_MAX, Number


@app.command("export")
@_handle_errors
def export_cmd(
    run: RunArg,
    db: DbOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="csv, json or jsonl.")] = "csv",
    out_file: Annotated[
        Path | None, typer.Option("--out", help="Write here instead of standard output.")
    ] = None,
) -> None:
    """Export one run: csv = its samples; json = run, samples, events, modules in one object;
    jsonl = one object per line, each with a "type" (run, sample, event, module)."""
    import dataclasses

    from edo_monitor.store.queries import NUMERIC_SAMPLE_COLUMNS

    if fmt not in ("csv", "json", "jsonl"):
        raise ConfigError(f"--format {fmt!r} is not supported; expected csv, json or jsonl")
    target = None if out_file is None else _export_target(out_file, db)
    columns = ["id", "time_s", "device_kind", *NUMERIC_SAMPLE_COLUMNS]
    with _history(db) as h:
        info = h.run(run)
        kind = info.device_kind

        def samples() -> Iterator[dict[str, Any]]:
            after = 0
            while True:
                page = h.samples_since(info.id, after, limit=10_000)
                if not page:
                    return
                for s in page:  # a run's samples all have the run's device kind
                    yield {"id": s.id, "time_s": s.time_s, "device_kind": kind, **s.values}
                after = page[-1].id

        tmp: Path | None = None
        if target is not None:  # a temporary file beside the target, renamed into place
            import tempfile

            fd, tmp_name = tempfile.mkstemp(
                dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
            )
            tmp = Path(tmp_name)
            stream: Any = os.fdopen(fd, "w", newline="", encoding="utf-8")
        else:
            stream = sys.stdout
        done = False
        try:
            if fmt == "csv":
                writer = csv.DictWriter(stream, fieldnames=columns, extrasaction="ignore")
                writer.writeheader()
                for row in samples():
                    writer.writerow(row)
            elif fmt == "jsonl":
                stream.write(json.dumps({"type": "run", **_info_dict(info)}) + "\n")
                for row in samples():
                    stream.write(json.dumps({"type": "sample", **row}) + "\n")
                for e in h.events(info.id):
                    stream.write(json.dumps({"type": "event", **dataclasses.asdict(e)}) + "\n")
                for m in h.modules(info.id):
                    stream.write(json.dumps({"type": "module", **dataclasses.asdict(m)}) + "\n")
            else:
                doc = {
                    "run": _info_dict(info),
                    "samples": list(samples()),
                    "events": [dataclasses.asdict(e) for e in h.events(info.id)],
                    "modules": [dataclasses.asdict(m) for m in h.modules(info.id)],
                }
                json.dump(doc, stream, indent=2, default=_json_default)
                stream.write("\n")
            done = True
        finally:
            if tmp is not None and target is not None:
                stream.close()
                if done:
                    _publish(tmp, target)
                else:
                    tmp.unlink(missing_ok=True)
    if out_file is not None:
        _c.err.print(f"wrote run {info.id} as {fmt} to {out_file}")


def _export_target(out_file: Path, db: str | None) -> Path:
    """The file ``--out`` names, links resolved; refused when it is the history database or one
    of its companion files (``-wal``, ``-shm``, ``-journal``: overwriting the ``-wal`` of a
    database whose last transactions are still in it loses them), a folder, or in a missing
    folder."""
    from edo_monitor.store.paths import resolve_db_url

    target = Path(os.path.realpath(out_file))
    shown = str(out_file)
    if target.is_dir():
        raise ConfigError(f"--out {shown!r} is a directory; expected a file path")
    if not target.parent.is_dir():
        raise ConfigError(f"--out {shown!r}: folder {str(target.parent)!r} does not exist")
    url = resolve_db_url(db, readonly=True)
    database = url.database if url.get_backend_name() == "sqlite" else None
    if database and database != ":memory:":
        base = os.path.realpath(database)
        for suffix in ("", "-wal", "-shm", "-journal"):
            protected = base + suffix
            same = str(target) == protected
            if not same and target.exists() and os.path.exists(protected):
                same = os.path.samefile(target, protected)  # hard links
            if same:
                what = " itself" if not suffix else f"'s {suffix} file"
                raise ConfigError(
                    f"--out {shown!r} is the history database{what} ({protected}); choose "
                    "another file"
                )
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Give the finished temporary file the mode a new file would have and rename it over
    ``target`` (atomic: a reader sees the old file or the whole new one)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, target)


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


#: ``sql --timeout`` default (seconds).
SQL_TIMEOUT_S = 60.0


_FETCH_ROWS = 500


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
        """Column names and an iterator over the rows (read :data:`_FETCH_ROWS` at a time).

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

        def pages() -> Iterator[tuple[Any, ...]]:
            while True:
                page = self._call(lambda: cur.fetchmany(_FETCH_ROWS))
                if not page:
                    return
                yield from page
                if self.interrupted:
                    raise _InterruptedError

        return names, pages()

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
                raise RefusedError(
                    f"sql: the statement ran past --timeout {self.timeout_s:g} s and was stopped; "
                    "give a larger --timeout (0 = no limit)"
                ) from None
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


def _print_rows(
    names: list[str], rows: Iterable[tuple[Any, ...]], *, as_json: bool, as_csv: bool
) -> None:
    """Print rows as they come (CSV, JSON) or as one table of at most SQL_TABLE_MAX_ROWS."""
    out = sys.stdout
    if as_csv:
        w = csv.writer(out)
        w.writerow(names)
        for r in rows:
            w.writerow(r)
        out.flush()
        return
    if as_json:
        out.write("[")
        first = True
        for r in rows:
            obj = json.dumps(dict(zip(names, r, strict=True)), default=_json_default)
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
        table.add_row(*("NULL" if v is None else str(v) for v in r))
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
    as they are read (--csv, --json; the table shows the first 1000); Ctrl-C stops it."""
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


@app.command("prune")
@_handle_errors
def prune_cmd(
    db: DbOpt = None,
    older_than: Annotated[
        str | None, typer.Option(help="Delete runs that started longer ago than this (30d).")
    ] = None,
    keep_last: Annotated[
        int | None,
        typer.Option(
            help="Keep only the N most recently started runs.", parser=Number(int, 0, INT64_MAX)
        ),
    ] = None,
    downsample_older_than: Annotated[
        str | None,
        typer.Option(
            help="Thin samples older than this (7d) to the peak rows of each --bucket interval."
        ),
    ] = None,
    bucket: Annotated[str, typer.Option(help="Downsampling interval (e.g. 60s, 5m).")] = "60s",
    dry_run: Annotated[bool, typer.Option(help="Say what would go, change nothing.")] = False,
    vacuum: Annotated[bool, typer.Option(help="Give freed space back to the disk.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Delete old runs or thin old samples. Running runs are never touched. Downsampling keeps,
    per run and bucket, the first and last sample and every sample that holds a bucket's
    peak (in use, allocated, reserved, process, device used, RSS) or its lowest free fraction."""
    from edo_monitor.store.history import History
    from edo_monitor.store.prune import prune

    if older_than is None and keep_last is None and downsample_older_than is None:
        raise ConfigError(
            "prune needs --older-than DURATION, --keep-last N or --downsample-older-than DURATION"
        )
    if keep_last is not None and keep_last < 0:
        raise ConfigError(f"--keep-last {keep_last} must be ≥ 0")
    # every value checked before the database is opened
    older_than_s = None if older_than is None else _parse_duration(older_than, "--older-than")
    downsample_s = (
        None
        if downsample_older_than is None
        else _parse_duration(downsample_older_than, "--downsample-older-than")
    )
    bucket_s = _parse_duration(bucket, "--bucket")
    if bucket_s <= 0:
        raise ConfigError(f"--bucket {bucket!r} must be longer than 0 s")
    _require_database(db)  # prune writes, but never creates a database
    now = time.time()
    with History(db, readonly=dry_run) as history:
        report = prune(
            history,
            older_than_s=older_than_s,
            keep_last=keep_last,
            downsample_older_than_s=downsample_s,
            bucket_s=bucket_s,
            dry_run=dry_run,
            vacuum=vacuum,
            now_s=now,
        )
    if as_json:
        _print_json(report)
        return
    verb = "would delete" if dry_run else "deleted"
    _c.out.print(
        f"{verb} {report['runs_deleted']} run(s), {report['samples_deleted']} sample(s); "
        f"{'would thin' if dry_run else 'thinned'} {report['runs_downsampled']} run(s)",
        markup=False,
    )


@app.command("doctor")
@_handle_errors
def doctor_cmd(
    db: DbOpt = None,
    full: Annotated[
        bool, typer.Option(help="Full integrity_check instead of the faster quick_check.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check the database: integrity, schema version, size, row counts, rollup lag."""
    from sqlalchemy import inspect, text

    from edo_monitor.store.paths import resolve_db_url
    from edo_monitor.store.schema import SCHEMA_VERSION

    url = resolve_db_url(db, readonly=True)
    h = _history(db)
    report: dict[str, Any] = {"database": url.database or str(url)}
    problems: list[str] = []
    try:
        with h.engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            report["schema_version"] = h.schema_version
            report["expected_schema_version"] = SCHEMA_VERSION
            if "alembic_version" in tables:
                report["alembic_revision"] = conn.execute(
                    text("SELECT version_num FROM alembic_version")
                ).scalar()
            if h.engine.dialect.name == "sqlite":
                check = "integrity_check" if full else "quick_check"
                res = [r[0] for r in conn.exec_driver_sql(f"PRAGMA {check}")]
                report[check] = res
                if res != ["ok"]:
                    problems.append(f"{check}: {'; '.join(res[:5])}")
                report["journal_mode"] = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
            counts = {}
            for t in ("runs", "samples", "events", "module_stats", "sample_rollups"):
                if t in tables:
                    counts[t] = conn.execute(text(f"SELECT count(*) FROM {t}")).scalar()
            report["rows"] = counts
            if "sample_rollups" in tables and h.engine.dialect.name == "postgresql":
                report["samples_not_rolled_up"] = conn.execute(  # each run has its own mark
                    text(
                        "SELECT count(*) FROM samples s LEFT JOIN meta m ON m.key = "
                        "'rollup_through_id:' || s.run_id WHERE s.id > coalesce(CAST(m.value "
                        "AS BIGINT), 0)"
                    )
                ).scalar()
            elif "sample_rollups" in tables:
                mark = conn.execute(
                    text("SELECT value FROM meta WHERE key = 'rollup_through_id'")
                ).scalar()
                top = conn.execute(text("SELECT max(id) FROM samples")).scalar() or 0
                report["samples_not_rolled_up"] = max(0, top - int(mark or 0))
    finally:
        h.close()
    if url.get_backend_name() == "sqlite" and url.database:
        p = Path(url.database)
        size = sum(q.stat().st_size for q in (p, Path(f"{p}-wal"), Path(f"{p}-shm")) if q.exists())
        report["size_bytes"] = size
        n = report["rows"].get("samples", 0)
        report["bytes_per_sample"] = round(size / n, 1) if n else None
    version = report.get("schema_version")
    if version is not None and version < SCHEMA_VERSION:
        problems.append(
            f"schema version {version} is older than {SCHEMA_VERSION} (upgraded on next write)"
        )
    from edo_monitor.store.spill_files import doctor_spill_lines

    report["spill_leftovers"] = doctor_spill_lines(url)  # a crashed run's disk-tier file: a note
    report["problems"] = problems
    report["ok"] = not [p for p in problems if "older" not in p]
    if as_json:
        _print_json(report)
    else:
        table = Table(title="edo-monitor doctor", show_header=False)
        table.add_column("check")
        table.add_column("result")
        table.add_row("database", str(report["database"]))
        table.add_row(
            "schema version",
            f"{version} (this edo-monitor: {SCHEMA_VERSION})"
            + (f", alembic {report['alembic_revision']}" if "alembic_revision" in report else ""),
        )
        for key in ("quick_check", "integrity_check"):
            if key in report:
                table.add_row(key, "; ".join(report[key][:5]))
        if "journal_mode" in report:
            table.add_row("journal mode", str(report["journal_mode"]))
        if "size_bytes" in report:
            table.add_row("size", f"{_bytes(report['size_bytes'])} ({report['size_bytes']} B)")
            if report.get("bytes_per_sample"):
                table.add_row("bytes per sample", f"{report['bytes_per_sample']}")
        for t, n in report["rows"].items():
            table.add_row(f"rows: {t}", str(n))
        if "samples_not_rolled_up" in report:
            table.add_row("samples not rolled up yet", str(report["samples_not_rolled_up"]))
        for line in report["spill_leftovers"]:
            table.add_row("spill file", line)
        _c.out.print(table)
        for p in problems:  # an older schema: the table's row and the engine's warning say it
            if "older" not in p:
                _c.err.print(f"edo-monitor: problem: {p}")
    if not report["ok"]:
        raise typer.Exit(EXIT_ERROR)
