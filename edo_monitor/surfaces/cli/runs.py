"""The commands that list and show recorded runs and jobs: runs, show, jobs, job, events,
compare."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from edo_monitor.errors import (
    ConfigError,
)
from edo_monitor.surfaces.cli.common import (
    Col,
    DbOpt,
    JsonOpt,
    ListTable,
    RunArg,
    _bytes,
    _c,
    _dur,
    _handle_errors,
    _history,
    _info_dict,
    _parse_duration,
    _pct,
    _print_json,
    _when,
    app,
    checked_run,
)
from edo_monitor.surfaces.cli.options import int64


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
        typer.Option(help="At most this many runs.", parser=int64()),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs, newest first. The id and the uuid column are references that open the run; a
    ``rank`` column (``-`` for a run outside a process group) tells apart the ranks of a
    ``torch.distributed`` job, shown when a listed run has one."""
    from edo_monitor.store.queries import STATUSES

    if status is not None and status not in STATUSES:
        raise ConfigError(
            f"--status {status!r} is not a run status; expected one of {', '.join(STATUSES)}"
        )
    since_s = None if since is None else time.time() - _parse_duration(since, "--since")
    with _history(db) as h:
        runs = h.runs(status=status, since=since_s, name=name, tag=tag, limit=limit)
        refs = h.uuid_references() if runs and not as_json else {}
        filters = {"--status": status, "--since": since, "--name": name, "--tag": tag}
        given = [f"{k} {v!r}" for k, v in filters.items() if v is not None]
        recorded = len(h.runs()) if given and not runs and not as_json else 0
    if as_json:
        _print_json([_info_dict(r) for r in runs])
        return
    if not runs:  # say whether the filters left none or there are none
        _c.out.print(
            f"no runs match {', '.join(given)} (the database holds {recorded} run(s))"
            if recorded
            else "no runs recorded"
        )
        return
    # the ranks of one job share its name: their rank tells them apart (no column without one)
    ranked = any(r.rank is not None for r in runs)
    table = ListTable(  # the id and the uuid prefix open the run: never cut (ListTable)
        Col("id", "right", key=True),
        Col("uuid", key=True),
        Col("name"),
        *((Col("rank", "right"),) if ranked else ()),
        Col("status"),
        Col("started (UTC)"),
        Col("duration", "right"),
        Col("steps", "right"),
        Col("device"),
        Col("peak in use", "right"),
        Col("min free", "right"),
        Col("actions", "right"),
        Col("OOMs", "right"),
    )
    for r in runs:
        table.add_row(
            str(r.id),
            refs.get(r.id, str(r.id)),
            r.name,
            *((("-" if r.rank is None else str(r.rank)),) if ranked else ()),
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


def _modules_title(mods: list[Any], info: Any) -> tuple[str, bool]:
    """The modules table's title, naming the step and time its figures are from, and whether
    the modules' rows are from different steps (then each row shows its own step).

    A module's row is its latest ``module_stats`` row, written when the agent's accounting (or
    an activation profile) changed one of its figures: it can be from the first steps while the
    run's peaks came much later, so the title says when, and of how many steps."""
    steps = sorted({m.step for m in mods})
    of = f" of {info.steps}" if info.steps is not None and info.steps > steps[-1] else ""
    first = min(m.time_s for m in mods) - info.started_at_s
    last = max(m.time_s for m in mods) - info.started_at_s
    when = f"t+{first:.1f}s" if f"{first:.1f}" == f"{last:.1f}" else f"t+{first:.1f}s-{last:.1f}s"
    if len(steps) == 1:
        head = f"modules at step {steps[0]}{of} ({when}, the latest accounting)"
    else:
        head = f"modules, each at its latest accounting (steps {steps[0]}-{steps[-1]}{of}, {when})"
    return f"{head}: bytes by category, largest first", len(steps) > 1


def _module_table(mods: list[Any], info: Any) -> ListTable:
    title, mixed = _modules_title(mods, info)
    table = ListTable(
        Col("module", key=True),
        *(Col(col) for col in ("kind", "shape", "dtype", "device", "placement")),
        *((Col("step", "right"),) if mixed else ()),
        *(
            Col(col, "right")
            for col in ("params", "grads", "optimizer state", "activations", "total")
        ),
        title=title,
    )
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
            *([str(m.step)] if mixed else []),
            _bytes(m.params_bytes),
            _bytes(m.grads_bytes),
            _bytes(m.optimizer_state_bytes),
            _bytes(m.activations_bytes),
            _bytes(m.total_bytes),
        )
    return table


def _cache_table(mods: list[Any], summary: Any) -> ListTable | None:
    """Row caches: one row per cached table (totals since it was cached) and the run's total
    over its samples (with bytes moved per step); ``None`` when the run had no cache."""
    cached = [m for m in mods if m.cache_rows is not None]
    if not cached and summary is None:
        return None
    table = ListTable(
        Col("table", key=True),
        *(
            Col(col, "right")
            for col in ("cache rows", "hit rate", "rows loaded", "rows evicted", "moved")
        ),
        Col("moved/step", "right"),
        title="row caches (CachedEmbedding tables)",
    )
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


def _events_table(events: list[Any], start_s: float) -> ListTable:
    table = ListTable(  # the id is what explain --event and snapshot --event take
        Col("id", "right", key=True),
        Col("t+", "right"),
        Col("step", "right"),
        Col("kind"),
        Col("message"),
        title="events",
    )
    for e in events:
        table.add_row(str(e.id), f"{e.time_s - start_s:.1f}s", e.step_shown, e.kind, e.message)
    return table


@app.command("show")
@_handle_errors
def show_cmd(
    run: RunArg,
    db: DbOpt = None,
    modules: Annotated[
        bool,
        typer.Option(
            "--modules",
            help="Only the module tables: bytes by module and category, and the row caches.",
        ),
    ] = False,
    max_events: Annotated[
        int,
        typer.Option(help="Show at most this many events.", parser=int64(0)),
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
        _c.out.print(_module_table(mods, info))
        caches = _cache_table(mods, cache)
        if caches is not None:
            _c.out.print(caches)
        return
    summary = ListTable(
        Col("field", key=True), Col("value"), title=f"run {info.id}  {info.name}", show_header=False
    )
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
        ("samples", str(info.sample_count)),
        # runs.samples_dropped counts every row the writer did not write, of every table
        (
            "not written",
            f"{info.samples_dropped} row(s)  (samples, events, module rows, snapshots)",
        ),
        ("tags", ", ".join(info.tags) or "-"),
        ("torch", info.torch_version),
    ]
    for label, value in rows:
        summary.add_row(label, value)
    _c.out.print(summary)
    peaks = ListTable(Col("quantity", key=True), Col("peak", "right"), title="peaks")
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
        _c.out.print(_module_table(mods, info))
    caches = _cache_table(mods, cache)
    if caches is not None:
        _c.out.print(caches)


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
        typer.Option(help="At most this many jobs.", parser=int64()),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List multi-rank jobs (torch.distributed), newest first; 'job JOB' shows one."""
    from edo_monitor.store.queries import STATUSES

    if status is not None and status not in STATUSES:
        raise ConfigError(
            f"--status {status!r} is not a job status; expected one of {', '.join(STATUSES)}"
        )
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
    table = ListTable(  # the job id is what 'job' takes: never cut (ListTable)
        Col("job", key=True),
        Col("name"),
        Col("status"),
        Col("ranks", "right"),
        Col("backend"),
        Col("hosts"),
        Col("started (UTC)"),
        Col("duration", "right"),
        Col("steps", "right"),
        Col("min free (rank)", "right"),
        Col("actions", "right"),
        Col("OOMs", "right"),
    )
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
        all_events = h.events(info.id) if kind and not events else []
    if as_json:
        _print_json([dataclasses.asdict(e) for e in events])
        return
    if not events:
        kinds = sorted({e.kind for e in all_events})
        where = f" of kind {', '.join(map(repr, kind))}" if kind else ""
        has = f" (its events are of kind {', '.join(kinds)})" if kinds else ""
        _c.out.print(f"run {info.id}: no events{where}{has}")
        return
    _c.out.print(_events_table(events, info.started_at_s))


@app.command("compare")
@_handle_errors
def compare_cmd(
    run_a: Annotated[
        str,
        typer.Argument(
            help="First run: id (1 or more), uuid prefix, or 'latest'.", callback=checked_run
        ),
    ],
    run_b: Annotated[
        str,
        typer.Argument(
            help="Second run: id (1 or more), uuid prefix, or 'latest'.", callback=checked_run
        ),
    ],
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
    table = ListTable(
        Col("metric", key=True),
        Col(f"A: {c.a.id}", "right"),
        Col(f"B: {c.b.id}", "right"),
        Col("B - A", "right"),
        title=f"run {c.a.id} ({c.a.name}) vs run {c.b.id} ({c.b.name})",
    )

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
    acts = ListTable(
        Col("run", key=True),
        Col("t+", "right"),
        Col("action"),
        Col("target"),
        Col("saved", "right"),
        title="actions",
    )
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
