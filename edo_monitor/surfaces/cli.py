"""``edo-monitor``: questions about recorded runs, from a terminal or a script.

Every command takes ``--db PATH|URL`` (default: ``$EDO_DB``, else ``./edo-history.db``). Listing
commands take ``--json`` for scripts. A run is named by its id, a uuid prefix of at least one
non-digit character (``runs`` prints prefixes that always open their run), or ``latest``.
A multi-rank job is named by its id (as ``jobs`` prints it), a unique prefix of it, or
``latest``: ``edo-monitor job JOB`` (a separate command, so a job id is never read as a run).

Exit codes (:data:`EXIT_CODES`, also in ``edo-monitor --help``):
    0    success
    1    runtime or data error: no such run or job, no database (missing file or folder), a database
         that cannot be used (not a database, newer schema, unreadable), a write refused by
         ``sql``, ``sql`` ran past its ``--timeout``, ``doctor`` found a problem, no NVML for
         ``daemon``, an optional package not installed (the message gives the install line)
    2    usage: unknown option, bad or out-of-range value (a size, a duration, a format, a column
         name, nan or an infinity), a db path that is not a regular file or is too long; one
         ``edo-monitor: error:`` line, checked before anything is opened
    3    unexpected internal error (reported in one line; set ``EDO_DEBUG=1`` for the traceback)
    130  interrupted (Ctrl-C)

No command creates a file it was not asked to write: readers open the database read-only (SQLite
itself adds the ``-wal``/``-shm`` companions of a WAL database whose folder is writable), and a
command that fails creates no database.
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import math
import os
import re
import signal
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from edo_monitor.errors import (
    ConfigError,
    EdoMonitorError,
    MissingExtraError,
    RunNotFoundError,
    StoreError,
)
from edo_monitor.surfaces.cli_options import INT64_MAX, CliGroup, Number

__all__ = ["app", "main"]

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
#: The exit codes of every command (``edo-monitor --help`` lists them).
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_ERROR: "runtime or data error (no such run, job or database, unusable database, refused "
    "write, sql timeout, doctor problem, no NVML for daemon)",
    EXIT_USAGE: "usage error (bad option or value; nothing was opened)",
    EXIT_INTERNAL: "internal error",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
_EXIT_HELP = "; ".join(f"{code} {what}" for code, what in EXIT_CODES.items())

app = typer.Typer(
    name="edo-monitor",
    help=(
        "Questions about recorded edo-monitor runs (history database). RUN is a run id, a uuid "
        "prefix as 'runs' prints it, or 'latest'. A multi-rank job (torch.distributed) is one run "
        "per rank: 'jobs' lists jobs, 'job JOB' shows one (JOB: a job id as 'jobs' prints it, a "
        f"unique prefix of it, or 'latest'). Exit codes: {_EXIT_HELP}."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    cls=CliGroup,
)


class _Consoles:
    """Rich consoles made on first use (so they see the current stdout/stderr, e.g. in tests);
    wide when the output is not a terminal, so piped tables are not squeezed."""

    # markup and emoji codes off: names, tags, messages and module names are the user's text
    # (``bert[lr=1e-4]``, ``sweep[/bs64]``, ``:fire:``) and are printed as they are

    @property
    def out(self) -> Console:
        width = None if sys.stdout.isatty() else 200
        return Console(highlight=False, soft_wrap=False, width=width, markup=False, emoji=False)

    @property
    def err(self) -> Console:
        return Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


_c = _Consoles()

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="EDO_DB",
        help="History database: a file path or an SQLAlchemy URL [default: ./edo-history.db]",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (for scripts).")]
RunArg = Annotated[
    str, typer.Argument(help="Run id, uuid prefix (as 'runs' prints it), or 'latest'.")
]

F = TypeVar("F", bound=Callable[..., Any])


class RefusedError(EdoMonitorError):
    """A request the CLI refuses (exit code 1)."""


class _InterruptedError(Exception):
    """Ctrl-C during ``sql`` (exit code 130)."""


def _fail(message: str, code: int) -> typer.Exit:
    _c.err.print(f"edo-monitor: error: {message}")
    return typer.Exit(code)


def _handle_errors(func: F) -> F:
    """Turn the errors a user can cause into one line on stderr and the documented exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except BrokenPipeError:  # the reader went away (`edo-monitor export 1 | head`)
            sys.stderr.close()
            raise typer.Exit(EXIT_OK) from None
        except (KeyboardInterrupt, _InterruptedError):
            raise _fail("interrupted", EXIT_INTERRUPTED) from None
        except MissingExtraError as exc:  # the command was right; a package is missing
            raise _fail(str(exc), EXIT_ERROR) from None
        except ConfigError as exc:
            raise _fail(str(exc), EXIT_USAGE) from None
        except (RunNotFoundError, StoreError, RefusedError) as exc:
            raise _fail(str(exc), EXIT_ERROR) from None
        except EdoMonitorError as exc:
            raise _fail(str(exc), EXIT_ERROR) from None
        except (OSError, sqlite3.Error) as exc:
            raise _fail(f"{type(exc).__name__}: {exc}", EXIT_ERROR) from None
        except Exception as exc:
            if os.environ.get("EDO_DEBUG"):
                raise
            raise _fail(
                f"internal error ({type(exc).__name__}: {exc}); rerun with EDO_DEBUG=1 for details",
                EXIT_INTERNAL,
            ) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def _global(ctx: typer.Context, db: DbOpt = None) -> None:
    """Questions about recorded edo-monitor runs (history database); exit codes: see --help."""
    if db is not None:  # `edo-monitor --db X cmd`: the command's own --db/EDO_DB default
        before = os.environ.get("EDO_DB")
        os.environ["EDO_DB"] = db
        ctx.call_on_close(functools.partial(_restore_env, "EDO_DB", before))


def _restore_env(name: str, value: str | None) -> None:
    """Put an environment variable back as it was (the global ``--db`` sets ``EDO_DB`` for one
    command only: an in-process caller, a test or a notebook, keeps its own environment)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# -- formatting helpers ------------------------------------------------------------------------


def _bytes(value: Any) -> str:
    from edo_monitor.units import format_bytes

    return format_bytes(value)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{sec:02d}s"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _parse_duration(value: str, name: str) -> float:
    """Seconds from ``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"2w"`` or a plain number."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", value or "")
    if not m:
        raise ConfigError(
            f"{name}={value!r} is not a duration; expected a number with a unit such as "
            "'45s', '90m', '12h', '30d' or '2w'"
        )
    scale = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[m.group(2)]
    return float(m.group(1)) * scale


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    return str(obj)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_json_default) + "\n")


def _info_dict(info: Any) -> dict[str, Any]:
    import dataclasses

    d = dataclasses.asdict(info)
    if hasattr(info, "steps_per_s"):
        d["steps_per_s"] = info.steps_per_s
    return d


def _require_database(db: str | None) -> None:
    """Raise StoreError (exit 1) unless ``db`` is an existing SQLite file (or a server URL)."""
    from edo_monitor.store.engine import readonly_uri, resolve_db_url

    url = resolve_db_url(db, readonly=True)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        readonly_uri(url.database)  # the same "no history database at …" as every reader


def _history(db: str | None, *, readonly: bool = True) -> Any:
    from edo_monitor.store.history import History

    # an older schema is said once, by the engine's warning (every reader's; it names the file)
    return History(db, readonly=readonly)


# -- commands ----------------------------------------------------------------------------------


@app.command("runs")
@_handle_errors
def runs_cmd(
    db: DbOpt = None,
    status: Annotated[
        str | None,
        typer.Option(
            help="Only runs with this status (running/finished/failed/interrupted/crashed)."
        ),
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Only runs started within this long ago, e.g. 7d, 12h.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Only runs whose name matches (* ?).")] = None,
    tag: Annotated[str | None, typer.Option(help="Only runs with this tag.")] = None,
    limit: Annotated[
        int | None,
        typer.Option(help="At most this many runs.", parser=Number(int, 1, INT64_MAX)),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs, newest first. The id and the uuid column are references that open the run."""
    from edo_monitor.store.queries import STATUSES

    if status is not None and status not in STATUSES:
        raise ConfigError(f"--status {status!r} is not a run status; expected one of {STATUSES}")
    since_s = None if since is None else time.time() - _parse_duration(since, "--since")
    with _history(db) as h:
        runs = h.runs(status=status, since=since_s, name=name, tag=tag, limit=limit)
        refs = h.uuid_references() if runs and not as_json else {}
    if as_json:
        _print_json([_info_dict(r) for r in runs])
        return
    if not runs:
        _c.out.print("no runs recorded")
        return
    table = Table(title=None, show_lines=False)
    for col, just in (
        ("id", "right"),
        ("uuid", "left"),
        ("name", "left"),
        ("status", "left"),
        ("started (UTC)", "left"),
        ("duration", "right"),
        ("steps", "right"),
        ("device", "left"),
        ("peak in use", "right"),
        ("min free", "right"),
        ("actions", "right"),
        ("OOMs", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in runs:
        table.add_row(
            str(r.id),
            refs.get(r.id, str(r.id)),
            r.name,
            r.status,
            _when(r.started_at_s),
            _dur(r.duration_s),
            str(r.steps),
            r.device_kind,
            _bytes(r.peak_in_use_bytes),
            _pct(r.min_free_fraction),
            str(r.action_count),
            str(r.oom_count),
        )
    _c.out.print(table)


def _module_table(mods: list[Any]) -> Table:
    table = Table(title="modules (bytes by category, largest first)")
    for col in ("module", "kind", "shape", "dtype", "device", "placement"):
        table.add_column(col)
    for col in ("params", "grads", "optimizer state", "activations", "total"):
        table.add_column(col, justify="right")
    for m in mods:
        shape = (
            f"{m.num_embeddings}x{m.embedding_dim}"
            if m.num_embeddings is not None and m.embedding_dim is not None
            else "-"
        )
        table.add_row(
            m.module,
            m.kind,
            shape,
            m.dtype or "-",
            m.device or "-",
            m.placement or "-",
            _bytes(m.params_bytes),
            _bytes(m.grads_bytes),
            _bytes(m.optimizer_state_bytes),
            _bytes(m.activations_bytes),
            _bytes(m.total_bytes),
        )
    return table


def _cache_table(mods: list[Any], summary: Any) -> Table | None:
    """Row caches: one row per cached table (totals since it was cached) and the run's total
    over its samples (with bytes moved per step); ``None`` when the run had no cache."""
    cached = [m for m in mods if m.cache_rows is not None]
    if not cached and summary is None:
        return None
    table = Table(title="row caches (CachedEmbedding tables)")
    table.add_column("table")
    for col in ("cache rows", "hit rate", "rows loaded", "rows evicted", "moved", "moved/step"):
        table.add_column(col, justify="right")
    for m in cached:
        rows = f"{m.cache_rows:,}" + (f" of {m.num_embeddings:,}" if m.num_embeddings else "")
        table.add_row(
            m.module,
            rows,
            _pct(m.cache_hit_fraction),
            f"{m.cache_rows_loaded or 0:,}",
            f"{m.cache_rows_evicted or 0:,}",
            _bytes(m.cache_moved_bytes or 0),
            "-",
        )
    if summary is not None:
        per_step = summary.moved_bytes_per_step
        table.add_row(
            f"run (steps {summary.first_step}-{summary.last_step})",
            f"{summary.rows_now:,}",
            _pct(summary.hit_fraction),
            f"{summary.rows_loaded:,}",
            f"{summary.rows_evicted:,}",
            _bytes(summary.moved_bytes),
            "-" if per_step is None else _bytes(round(per_step)),
        )
    return table


def _events_table(events: list[Any], start_s: float) -> Table:
    table = Table(title="events")
    table.add_column("id", justify="right")
    table.add_column("t+", justify="right")
    table.add_column("step", justify="right")
    table.add_column("kind")
    table.add_column("message")
    for e in events:
        table.add_row(str(e.id), f"{e.time_s - start_s:.1f}s", str(e.step), e.kind, e.message)
    return table


@app.command("show")
@_handle_errors
def show_cmd(
    run: RunArg,
    db: DbOpt = None,
    modules: Annotated[
        bool, typer.Option("--modules", help="Only the module x category bytes table.")
    ] = False,
    max_events: Annotated[
        int,
        typer.Option(help="Show at most this many events.", parser=Number(int, 0, INT64_MAX)),
    ] = 50,
    as_json: JsonOpt = False,
) -> None:
    """Summary of one run: status, peaks, events, modules."""
    with _history(db) as h:
        info = h.run(run)
        mods = h.modules(info.id)
        events = [] if modules else h.events(info.id)
        peak = None if modules else h.peak(info.id)
        cache = h.cache_summary(info.id)
    if as_json:
        import dataclasses

        _print_json(
            {
                "run": _info_dict(info),
                "peak": None if peak is None else dataclasses.asdict(peak),
                "events": [dataclasses.asdict(e) for e in events],
                "modules": [{**dataclasses.asdict(m), "total_bytes": m.total_bytes} for m in mods],
                "row_cache": None
                if cache is None
                else {
                    **dataclasses.asdict(cache),
                    "hit_fraction": cache.hit_fraction,
                    "moved_bytes_per_step": cache.moved_bytes_per_step,
                },
            }
        )
        return
    if modules:
        if not mods:
            _c.out.print(f"run {info.id} recorded no module statistics")
            return
        _c.out.print(_module_table(mods))
        caches = _cache_table(mods, cache)
        if caches is not None:
            _c.out.print(caches)
        return
    summary = Table(title=f"run {info.id}  {info.name}", show_header=False)
    summary.add_column("field")
    summary.add_column("value")
    rows = [
        ("uuid", info.uuid),
        (
            "status",
            info.status
            + (f" (stored: {info.stored_status})" if info.status != info.stored_status else ""),
        ),
        ("error", info.error or "-"),
        ("host / pid", f"{info.host} / {info.pid}"),
        (
            "job",
            "-"
            if info.job_id is None
            else f"{info.job_id} (rank {info.rank} of {info.world_size}; edo-monitor job "
            f"{info.job_id})",
        ),
        ("started", _when(info.started_at_s)),
        ("ended", _when(info.ended_at_s)),
        ("duration", _dur(info.duration_s)),
        ("steps", f"{info.steps}  ({info.steps_per_s or 0:.2f} steps/s)"),
        ("device", f"{info.device_kind}  {info.device_name or ''}".rstrip()),
        ("device total", _bytes(info.device_total_bytes)),
        ("budget", _bytes(info.budget_bytes)),
        ("interval", f"{info.interval_s:g} s"),
        ("samples", f"{info.sample_count}  (dropped: {info.samples_dropped})"),
        ("tags", ", ".join(info.tags) or "-"),
        ("torch", info.torch_version),
    ]
    for label, value in rows:
        summary.add_row(label, value)
    _c.out.print(summary)
    peaks = Table(title="peaks")
    peaks.add_column("quantity")
    peaks.add_column("peak", justify="right")
    for label, value in (
        ("in use", _bytes(info.peak_in_use_bytes)),
        ("allocated", _bytes(info.peak_allocated_bytes)),
        ("reserved", _bytes(info.peak_reserved_bytes)),
        ("process on device", _bytes(info.peak_process_device_bytes)),
        ("device used", _bytes(info.peak_device_used_bytes)),
        ("process RSS", _bytes(info.peak_process_rss_bytes)),
        ("min free fraction", _pct(info.min_free_fraction)),
    ):
        peaks.add_row(label, value)
    if peak is not None and peak.time_s is not None:
        peaks.add_row(
            "in use peak at", f"t+{peak.time_s - info.started_at_s:.1f}s, step {peak.step}"
        )
    _c.out.print(peaks)
    if events:
        shown = events[:max_events]
        _c.out.print(_events_table(shown, info.started_at_s))
        if len(events) > len(shown):
            _c.out.print(f"… {len(events) - len(shown)} more (edo-monitor events {info.id})")
    else:
        _c.out.print("no events")
    if mods:
        _c.out.print(_module_table(mods))
    caches = _cache_table(mods, cache)
    if caches is not None:
        _c.out.print(caches)


# -- multi-rank jobs ---------------------------------------------------------------------------

JobArg = Annotated[
    str,
    typer.Argument(
        help="Job id (as 'jobs' prints it: torchrun's run id or a uuid), a prefix of it that "
        "matches one job, or 'latest'."
    ),
]


@app.command("jobs")
@_handle_errors
def jobs_cmd(
    db: DbOpt = None,
    status: Annotated[
        str | None,
        typer.Option(
            help="Only jobs with this status (running/finished/failed/interrupted/crashed: "
            "running while any rank runs, else the worst rank's)."
        ),
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Only jobs created within this long ago, e.g. 7d, 12h.")
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(help="At most this many jobs.", parser=Number(int, 1, INT64_MAX)),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List multi-rank jobs (torch.distributed), newest first; 'job JOB' shows one."""
    from edo_monitor.store.queries import STATUSES

    if status is not None and status not in STATUSES:
        raise ConfigError(f"--status {status!r} is not a job status; expected one of {STATUSES}")
    since_s = None if since is None else time.time() - _parse_duration(since, "--since")
    with _history(db) as h:
        jobs = h.jobs(status=status, since=since_s, limit=limit)
        members = {j.id: h.job_runs(j.id) for j in jobs}
    rows = []
    for j in jobs:
        runs = members[j.id]
        frees = [(r.min_free_fraction, r.rank) for r in runs if r.min_free_fraction is not None]
        lowest = min(frees, key=_first) if frees else None
        rows.append(
            {
                **_info_dict(j),
                "min_free_fraction": None if lowest is None else lowest[0],
                "min_free_rank": None if lowest is None else lowest[1],
                "action_count": sum(r.action_count for r in runs),
                "oom_count": sum(r.oom_count for r in runs),
            }
        )
    if as_json:
        _print_json(rows)
        return
    if not rows:
        _c.out.print(
            "no jobs recorded (a job is the runs of the ranks of one torch.distributed job)"
        )
        return
    table = Table()
    for col, just in (
        ("job", "left"),
        ("name", "left"),
        ("status", "left"),
        ("ranks", "right"),
        ("backend", "left"),
        ("hosts", "left"),
        ("started (UTC)", "left"),
        ("duration", "right"),
        ("steps", "right"),
        ("min free (rank)", "right"),
        ("actions", "right"),
        ("OOMs", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for j, row in zip(jobs, rows, strict=True):
        end = j.ended_at_s if j.ended_at_s is not None else time.time()
        duration = None if j.started_at_s is None else max(0.0, end - j.started_at_s)
        lowest = (
            "-"
            if row["min_free_fraction"] is None
            else f"{_pct(row['min_free_fraction'])} ({row['min_free_rank']})"
        )
        table.add_row(
            j.id,
            j.name,
            j.status or "-",
            f"{len(set(j.ranks))}/{j.world_size}",
            j.backend or "-",
            ", ".join(j.hosts) or "-",
            _when(j.started_at_s),
            _dur(duration),
            "-" if j.min_steps is None else str(j.min_steps),
            lowest,
            str(row["action_count"]),
            str(row["oom_count"]),
        )
    _c.out.print(table)


def _first(item: tuple[Any, Any]) -> Any:
    return item[0]


@app.command("job")
@_handle_errors
def job_cmd(job: JobArg, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """One multi-rank job: its ranks (free fraction now and at its lowest, the tightest rank
    marked) and every rank's actions by step. ('show' is for one run: 'show RUN'.)"""
    from edo_monitor.hindsight.jobs import job_renderables, job_report

    with _history(db) as h:
        report = job_report(h, job)
    if as_json:
        _print_json(report.as_dict())
        return
    for renderable in job_renderables(report):
        _c.out.print(renderable)


@app.command("events")
@_handle_errors
def events_cmd(
    run: RunArg,
    db: DbOpt = None,
    kind: Annotated[
        list[str] | None, typer.Option(help="Only events of this kind (repeatable).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Events of one run (thresholds, decisions, actions, OOMs …) in time order."""
    import dataclasses

    with _history(db) as h:
        info = h.run(run)
        events = h.events(info.id, kind=kind or None)
    if as_json:
        _print_json([dataclasses.asdict(e) for e in events])
        return
    if not events:
        _c.out.print(f"run {info.id}: no events")
        return
    _c.out.print(_events_table(events, info.started_at_s))


@app.command("compare")
@_handle_errors
def compare_cmd(
    run_a: Annotated[str, typer.Argument(help="First run (id, uuid prefix, latest).")],
    run_b: Annotated[str, typer.Argument(help="Second run.")],
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Two runs side by side: peaks, minimum free fraction, steps/s, actions."""
    import dataclasses

    with _history(db) as h:
        c = h.compare(run_a, run_b)
    if as_json:
        _print_json(
            {
                "a": _info_dict(c.a),
                "b": _info_dict(c.b),
                "metrics": [{**dataclasses.asdict(m), "delta": m.delta} for m in c.metrics],
                "actions_a": [dataclasses.asdict(e) for e in c.actions_a],
                "actions_b": [dataclasses.asdict(e) for e in c.actions_b],
            }
        )
        return
    table = Table(title=f"run {c.a.id} ({c.a.name}) vs run {c.b.id} ({c.b.name})")
    table.add_column("metric")
    table.add_column(f"A: {c.a.id}", justify="right")
    table.add_column(f"B: {c.b.id}", justify="right")
    table.add_column("B - A", justify="right")

    def fmt(unit: str, v: Any) -> str:
        if v is None:
            return "-"
        if unit == "bytes":
            return ("-" if v < 0 else "") + _bytes(abs(v))
        if unit == "fraction":
            return _pct(v)
        if unit == "s":
            return _dur(abs(v)) if v >= 0 else "-" + _dur(-v)
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    for m in c.metrics:
        delta = m.delta
        d = "-" if delta is None else fmt(m.unit, delta)
        if m.unit == "fraction" and delta is not None:
            d = f"{100 * delta:+.1f} pp"
        table.add_row(m.name, fmt(m.unit, m.a), fmt(m.unit, m.b), d)
    _c.out.print(table)
    acts = Table(title="actions")
    acts.add_column("run")
    acts.add_column("t+", justify="right")
    acts.add_column("action")
    acts.add_column("target")
    acts.add_column("saved", justify="right")
    for label, info, events in (("A", c.a, c.actions_a), ("B", c.b, c.actions_b)):
        for e in events:
            acts.add_row(
                f"{label}: {info.id}",
                f"{e.time_s - info.started_at_s:.1f}s",
                str(e.data.get("action", e.message)),
                str(e.data.get("target", "-")),
                _bytes(e.data.get("saved_bytes")),
            )
    if c.actions_a or c.actions_b:
        _c.out.print(acts)
    else:
        _c.out.print("no actions in either run")


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
    from edo_monitor.store.engine import resolve_db_url

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


# -- sql ---------------------------------------------------------------------------------------

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
        from edo_monitor.store.engine import BUSY_TIMEOUT_S, readonly_uri

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
        from edo_monitor.store.engine import _readonly_error

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
    from edo_monitor.store.engine import resolve_db_url

    if not math.isfinite(timeout) or timeout < 0:
        raise ConfigError(f"--timeout {timeout!r} must be a number of seconds ≥ 0 (0: no limit)")
    if as_json and as_csv:
        raise ConfigError("--json and --csv exclude each other; give one")
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


# -- prune -------------------------------------------------------------------------------------


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


# -- doctor ------------------------------------------------------------------------------------


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

    from edo_monitor.store.engine import resolve_db_url
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


# -- estimate ----------------------------------------------------------------------------------


@app.command("explain")
@_handle_errors
def explain_cmd(
    run: RunArg,
    db: DbOpt = None,
    event: Annotated[
        int | None,
        typer.Option(
            "--event",
            help="Only the incident of this event id.",
            parser=Number(int, 1, INT64_MAX),
        ),
    ] = None,
    top: Annotated[
        int, typer.Option(help="Remedies shown per incident.", parser=Number(int, 1, 10_000))
    ] = 12,
    as_json: JsonOpt = False,
) -> None:
    """What would have avoided each OOM and pressure crossing: shortfall and ranked remedies."""
    from edo_monitor.hindsight.explain import explain

    _require_database(db)
    with _history(db) as h:
        result = explain(h, run, event=event)
    if as_json:
        _print_json(result.as_dict())
        return
    from edo_monitor.hindsight.view import explain_renderables

    for renderable in explain_renderables(result, top=top):
        _c.out.print(renderable)


@app.command("snapshot")
@_handle_errors
def snapshot_cmd(
    run: RunArg,
    db: DbOpt = None,
    event: Annotated[
        int | None, typer.Option("--event", help="The event id (default: the latest snapshot).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the pickle PyTorch's memory viewer opens.")
    ] = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write torch.cuda._memory_viz's page.")
    ] = None,
    html_kind: Annotated[str, typer.Option(help="trace (trace_plot) or segments.")] = "trace",
    top: Annotated[
        int | None, typer.Option(help="Print the K largest live blocks by frame (module).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """An incident's memory snapshot (OOM, crossing, action) for PyTorch's memory viewer."""
    from edo_monitor.surfaces.cli_snapshot import snapshot_command

    _require_database(db)
    with _history(db) as h:
        printed = snapshot_command(
            h, run, event=event, out=out, html=html, html_kind=html_kind, top=top, as_json=as_json
        )
    for renderable in printed:
        _c.out.print(renderable)


def _signed_bytes(value: int | None) -> str:
    """``-14.75 MiB`` for a negative count (a cache growing back uses bytes)."""
    if value is not None and value < 0:
        return "-" + _bytes(-value)
    return _bytes(value)


@app.command("replay")
@_handle_errors
def replay_cmd(
    run: RunArg,
    db: DbOpt = None,
    policy: Annotated[
        str,
        typer.Option(
            help="Policy settings KEY=VALUE,... (min_free_fraction, rearm_free_fraction, "
            "cooldown_steps, mode, allow_lossy, ladder=a+b, release_cache_min_bytes, "
            "grow_margin_fraction, grow_after_readings, forecast_steps, "
            "forecast_window_steps); default: the default policy."
        ),
    ] = "",
    as_json: JsonOpt = False,
) -> None:
    """Re-run a recorded run through a policy offline: when it would have acted, what, and the
    resulting minimum free fraction, beside what happened."""
    from edo_monitor.hindsight.replay import parse_policy, replay

    settings = parse_policy(policy)  # usage errors before anything is opened
    from edo_monitor.decide.policy import Policy

    pol = Policy(**settings)
    _require_database(db)
    with _history(db) as h:
        result = replay(h, run, pol)
    if as_json:
        _print_json(result.as_dict())
        return
    _c.out.print(f"run {result.run_id} {result.run_name}: {result.samples:,} samples through")
    _c.out.print(f"  {result.policy}")
    table = Table(show_edge=False)
    for col, justify in (
        ("", "left"),
        ("step", "right"),
        ("action", "left"),
        ("target", "left"),
        ("saving", "right"),
        ("free at decision", "right"),
        ("status", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for label, rows in (("replay", result.decisions), ("recorded", result.recorded)):
        for d in rows:
            table.add_row(
                label,
                str(d.step),
                d.action,
                d.target or "-",
                _signed_bytes(d.saving_bytes),
                _pct(d.free_fraction),
                d.status,
            )
        if not rows:
            table.add_row(label, "-", "(no decision)", "", "", "", "")
    _c.out.print(table)
    for f in result.forecasts:
        verdict = {
            True: f"came true at step {f.crossing_step}",
            False: "did not come true",
            None: "not judged (the run ended first)",
        }[f.came_true]
        _c.out.print(
            f"replay: forecast at step {f.step} (free {_pct(f.free_fraction)}, "
            f"+{_bytes(round(f.slope_bytes_per_step))}/step): below the floor at step "
            f"{f.predicted_step}; {verdict}"
        )
    for step, refused in result.refusals:
        _c.out.print(f"replay: step {step}: no action applies")
        for action, reason in refused:
            _c.out.print(f"  {action}: {reason}")
    _c.out.print(
        f"min free fraction: replay {_pct(result.min_free_fraction)}, "
        f"recorded {_pct(result.recorded_min_free_fraction)}"
    )
    for step, avoided in zip(result.oom_steps, result.oom_avoided, strict=True):
        _c.out.print(
            f"recorded OOM at step {step}: "
            + ("the replayed actions free more than its shortfall" if avoided else "not avoided")
        )


@app.command("estimate")
@_handle_errors
def estimate_cmd(
    num_embeddings: Annotated[
        int, typer.Option(help="Rows of the embedding table.", parser=Number(int, 1, INT64_MAX))
    ],
    embedding_dim: Annotated[
        int,
        typer.Option(help="Columns of the embedding table.", parser=Number(int, 1, INT64_MAX)),
    ],
    dtype: Annotated[str, typer.Option(help="Parameter dtype (float32, float16, bfloat16 …).")] = (
        "float32"
    ),
    optimizer: Annotated[str, typer.Option(help="sgd, momentum, adam, adamw, adagrad …")] = "adam",
    compression: Annotated[
        str | None,
        typer.Option(
            help="fp16, bf16, int8, int4[:G], int2[:G], 2of8[:G] (2 of 8 kept at 2 bits), "
            "perrow:K[:BITS] (K full rows, the rest int4/int2), lowrank:R, hash:B, hash2:B, "
            "qr:R, hybrid:K:B (G: group size, default 64)"
        ),
    ] = None,
    master_weights: Annotated[
        bool, typer.Option(help="Keep fp32 master weights for a low-precision table.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Estimate the training memory of one embedding table (no database needed)."""
    from edo_monitor.surfaces.cli_estimate import estimate_command

    try:
        text_ = estimate_command(
            num_embeddings, embedding_dim, dtype, optimizer, compression, master_weights, as_json
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    sys.stdout.write(text_ + "\n")


@app.command("metrics")
@_handle_errors
def metrics_cmd(
    db: DbOpt = None,
    port: Annotated[
        int,
        typer.Option(
            help="TCP port to serve /metrics on (0 = any free port).",
            parser=Number(int, 0, 65535),
        ),
    ] = 9400,
    host: Annotated[
        str, typer.Option(help="Address to bind (default loopback; 0.0.0.0 = every interface).")
    ] = "127.0.0.1",
) -> None:
    """Serve Prometheus metrics of every running run of the database on /metrics, until Ctrl-C.

    One central scrape for many runs: each scrape reads the latest sample of each running run
    (read-only). Labels: job, rank, device, run_id, run_name. Needs the [prometheus] extra.
    A database file that does not exist yet is waited for (never created), so it can start
    before the runs. Prints the URL it serves on one line; Ctrl-C stops it (exit code 130)."""
    from edo_monitor.exporters.prometheus import require_prometheus, serve_history

    require_prometheus()  # exit 1 with the install line before anything is opened

    def ready(server: Any) -> None:
        _c.out.print(f"serving {server.url}")
        sys.stdout.flush()

    serve_history(db, host, port, on_ready=ready)


@app.command("daemon")
@_handle_errors
def daemon_cmd(
    db: DbOpt = None,
    interval: Annotated[
        float,
        typer.Option(
            "--interval",
            help="Seconds between samples.",
            parser=Number(float, 0.01, 3600.0, "s"),
        ),
    ] = 1.0,
) -> None:
    """Record every GPU and every process on it (NVML) into the history, until SIGTERM/Ctrl-C.

    Each sample writes one row per GPU (used/total/free bytes, utilisation) and one per process
    on it (PID, name, bytes, and the run id when it is a watched run of this host); GPUs that
    appear or are lost are device events. Runs in the foreground (for a service manager: see
    docs/edo-monitor-daemon.service). SIGTERM stops it after writing everything (exit 0),
    Ctrl-C too (exit 130). No NVML: one line and exit code 1, nothing created."""
    from edo_monitor.surfaces.daemon import run_daemon

    def ready(daemon: Any) -> None:
        devices = ", ".join(f"{i}:{u}" for u, i in sorted(daemon.devices.items(), key=_second))
        _c.err.print(
            f"edo-monitor daemon: recording {len(daemon.devices)} GPU(s) [{devices}] every "
            f"{daemon.interval_s:g} s into {_shown_db(db)}"
        )

    result = run_daemon(db, interval_s=interval, on_ready=ready)
    _c.err.print(f"edo-monitor daemon: stopped; {result.summary()}")
    if result.signal == signal.SIGINT:
        raise KeyboardInterrupt


def _second(item: tuple[Any, Any]) -> Any:
    return item[1]


def _shown_db(db: str | None) -> str:
    from edo_monitor.store.engine import resolve_db_url

    url = resolve_db_url(db)
    if url.get_backend_name() == "sqlite" and url.database:
        return url.database
    return url.render_as_string(hide_password=True)


def main() -> None:
    """Console-script entry point (``edo-monitor``)."""
    logging.basicConfig(level=logging.WARNING, format="edo-monitor: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from edo_monitor.surfaces.cli_dispatch import app_for

    app_for(app, sys.argv[1:])()  # only the command asked for is built (start-up)


if __name__ == "__main__":  # pragma: no cover
    main()
