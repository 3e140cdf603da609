"""The commands that look after the database itself: prune (old runs deleted, old samples
thinned) and doctor (integrity, schema version, size, row counts, rollup lag)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from edo_monitor.errors import ConfigError, StoreError
from edo_monitor.surfaces.cli.common import (
    EXIT_ERROR,
    DbOpt,
    JsonOpt,
    _bytes,
    _c,
    _handle_errors,
    _history,
    _parse_duration,
    _print_json,
    _require_database,
    app,
)
from edo_monitor.surfaces.cli.options import int64


@app.command("prune")
@_handle_errors
def prune_cmd(
    db: DbOpt = None,
    older_than: Annotated[
        str | None, typer.Option(help="Delete runs that started longer ago than this (30d).")
    ] = None,
    keep_last: Annotated[
        int | None,
        typer.Option(help="Keep only the N most recently started runs.", parser=int64(0)),
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
    """Delete old runs or thin old samples. Running runs are never touched (nor, for a day after
    its last heartbeat, a run another host recorded as running: a network partition looks like
    a crash from here). Downsampling keeps,
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
    unreadable: list[str] = []  # the checks a damaged page kept from being read
    try:
        with h.engine.connect() as conn:

            def read(what: str, fn: Callable[[], Any]) -> Any:
                """``fn()``; ``None`` where it met a damaged page (the damage is a finding)."""
                try:
                    return fn()
                except StoreError as exc:
                    if "is a damaged SQLite database" not in str(exc):
                        raise
                    unreadable.append(what)
                    if str(exc) not in problems:
                        problems.append(str(exc))
                    conn.rollback()  # the failed statement's transaction, not the next one's
                    return None

            tables = set(inspect(conn).get_table_names())
            report["schema_version"] = h.schema_version
            report["expected_schema_version"] = SCHEMA_VERSION
            if "alembic_version" in tables:
                report["alembic_revision"] = read(
                    "alembic_version",
                    lambda: conn.execute(text("SELECT version_num FROM alembic_version")).scalar(),
                )
            if h.engine.dialect.name == "sqlite":
                check = "integrity_check" if full else "quick_check"
                # one row per finding; some SQLite versions put several in one row, a line each
                res = read(
                    check,
                    lambda: [
                        line
                        for r in conn.exec_driver_sql(f"PRAGMA {check}")
                        for line in str(r[0]).splitlines()
                    ],
                )
                report[check] = res
                if res is not None and res != ["ok"]:
                    more = f"; … ({len(res)} lines in all)" if len(res) > 5 else ""
                    problems.insert(0, f"{check}: {'; '.join(res[:5])}{more}")
                mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
                # a file read in a folder this user cannot write is opened immutable, and
                # SQLite then says "delete"; the header's read/write versions (2, 2) say WAL
                report["journal_mode"] = "wal" if _header_says_wal(url.database) else mode
            counts = {}
            for t in ("runs", "samples", "events", "module_stats", "sample_rollups"):
                if t in tables:
                    counts[t] = read(
                        f"rows: {t}",
                        lambda t=t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar(),
                    )
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

                def lag() -> int:
                    mark = conn.execute(
                        text("SELECT value FROM meta WHERE key = 'rollup_through_id'")
                    ).scalar()
                    top = conn.execute(text("SELECT max(id) FROM samples")).scalar() or 0
                    return max(0, top - int(mark or 0))

                report["samples_not_rolled_up"] = read("samples not rolled up", lag)
    finally:
        h.close()
    report["unreadable"] = unreadable
    if url.get_backend_name() == "sqlite" and url.database:
        p = Path(url.database)
        size = sum(q.stat().st_size for q in (p, Path(f"{p}-wal"), Path(f"{p}-shm")) if q.exists())
        report["size_bytes"] = size
        n = report["rows"].get("samples") or 0
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
                res = report[key]
                table.add_row(key, "unreadable (damaged)" if res is None else "; ".join(res[:5]))
        if "journal_mode" in report:
            table.add_row("journal mode", str(report["journal_mode"]))
        if "size_bytes" in report:
            table.add_row("size", f"{_bytes(report['size_bytes'])} ({report['size_bytes']} B)")
            if report.get("bytes_per_sample"):
                table.add_row("bytes per sample", f"{report['bytes_per_sample']}")
        for t, n in report["rows"].items():
            table.add_row(f"rows: {t}", "unreadable (damaged)" if n is None else str(n))
        if "samples_not_rolled_up" in report:
            lag = report["samples_not_rolled_up"]
            shown = "unreadable (damaged)" if lag is None else str(lag)
            table.add_row("samples not rolled up yet", shown)
        for line in report["spill_leftovers"]:
            table.add_row("spill file", line)
        _c.out.print(table)
        for p in problems:  # an older schema: the table's row and the engine's warning say it
            if "older" not in p:
                _c.err.print(f"edo-monitor: problem: {p}")
    if not report["ok"]:
        raise typer.Exit(EXIT_ERROR)


def _header_says_wal(path: str | None) -> bool:
    """Whether an SQLite file's header marks it WAL (bytes 18 and 19: file format write and
    read versions, 2 for WAL; SQLite's file format, section 1.3)."""
    if not path:
        return False
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return False
    return (
        len(header) == 20 and header[:16] == b"SQLite format 3\x00" and header[18:20] == b"\x02\x02"
    )
