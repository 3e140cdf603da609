"""One multi-rank job as ``edo-monitor job`` and the dashboard's job view show it: every rank's
run with its free fraction now and at its lowest, its actions, and the tightest rank.

Read from a :class:`~edo_monitor.store.history.History` (read-only); nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    from rich.console import RenderableType

    from edo_monitor.store.history import History
    from edo_monitor.store.records import EventInfo, JobInfo, RunInfo

__all__ = ["ACTION_KINDS", "JobReport", "RankReport", "job_renderables", "job_report"]

#: Event kinds shown as a rank's actions: applied, refused (by this rank or, coordinated, because
#: another rank could not apply it) and failed.
ACTION_KINDS = ("action", "action_refused", "action_failed")


@dataclass(frozen=True)
class RankReport:
    """One run of a job (one rank; a rank restarted by an elastic launcher has one per start).

    Attributes:
        run: the run, with its sample and event summaries (``History.job_runs(stats=True)``).
        free_now_fraction: ``free_fraction`` of the run's newest sample (``None``: no sample, or
            the sample has none).
        actions: the run's events of :data:`ACTION_KINDS`, oldest first.
    """

    run: RunInfo
    free_now_fraction: float | None
    actions: tuple[EventInfo, ...]


@dataclass(frozen=True)
class JobReport:
    """A job and its ranks, as read at ``read_at_s`` (Unix seconds).

    Attributes:
        job: the job row and its summary.
        ranks: one :class:`RankReport` per run of the job, by rank.
        tightest_index: index into ``ranks`` of the tightest rank: the lowest minimum free
            fraction over its samples (the rank whose pressure drives the job's agreed
            decisions); ties go to the lower free fraction now, then the lower rank. ``None``
            when no rank has a free fraction (no samples, or no budget).
        read_at_s: when it was read.
    """

    job: JobInfo
    ranks: tuple[RankReport, ...]
    tightest_index: int | None
    read_at_s: float

    @property
    def tightest(self) -> RankReport | None:
        """The tightest rank's report (see ``tightest_index``)."""
        return None if self.tightest_index is None else self.ranks[self.tightest_index]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``job``, ``ranks`` (each run's fields plus ``free_now_fraction``,
        ``actions`` and ``tightest``), ``tightest_rank`` and ``read_at_s``."""
        ranks = []
        for i, r in enumerate(self.ranks):
            d = dataclasses.asdict(r.run)
            d["steps_per_s"] = r.run.steps_per_s
            d["free_now_fraction"] = r.free_now_fraction
            d["tightest"] = i == self.tightest_index
            d["actions"] = [dataclasses.asdict(e) for e in r.actions]
            ranks.append(d)
        tightest = self.tightest
        return {
            "job": dataclasses.asdict(self.job),
            "ranks": ranks,
            "tightest_rank": None if tightest is None else tightest.run.rank,
            "read_at_s": self.read_at_s,
        }


def _free_now(history: History, run: RunInfo) -> float | None:
    if run.last_sample_s is None:
        return None
    data = history.samples(
        run.id, start=run.last_sample_s, columns=("free_fraction",), max_points=None
    )
    if not len(data):
        return None
    value = data.min["free_fraction"][-1]
    return None if value is None else float(value)


def _tightest(ranks: list[RankReport]) -> int | None:
    scored = [
        (r.run.min_free_fraction, 2.0 if r.free_now_fraction is None else r.free_now_fraction, i)
        for i, r in enumerate(ranks)
        if r.run.min_free_fraction is not None
    ]
    return min(scored)[2] if scored else None


def job_report(history: History, ref: str) -> JobReport:
    """Read job ``ref`` (an id, a unique id prefix, or ``latest``) and its ranks.

    Raises:
        JobNotFoundError: no job matches ``ref``, or a prefix matches several.
    """
    job = history.job(ref)
    ranks = [
        RankReport(run, _free_now(history, run), tuple(history.events(run.id, kind=ACTION_KINDS)))
        for run in history.job_runs(job.id)
    ]
    return JobReport(job, tuple(ranks), _tightest(ranks), time.time())


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def job_renderables(report: JobReport) -> list[RenderableType]:
    """What ``edo-monitor job`` prints: a heading, one row per rank (the tightest marked) and
    the actions of every rank by step. Strings from the history go in as plain text."""
    from rich.text import Text

    from edo_monitor.list_table import Col, ListTable
    from edo_monitor.units import format_utc

    job = report.job
    started = "-" if job.started_at_s is None else f"{format_utc(job.started_at_s)} UTC"
    head = Text(f"job {job.id} ({job.name}): {job.status or 'no runs'}", style="bold")
    lines: list[RenderableType] = [
        head,
        Text(
            f"world size {job.world_size}, backend {job.backend or '-'}, id from {job.id_source}; "
            f"{job.run_count} run(s) on {', '.join(job.hosts) or '-'}; started {started}; "
            f"steps {'-' if job.min_steps is None else job.min_steps} (fewest of any rank)"
        ),
    ]
    table = ListTable(  # the rank and its run id name the row: never cut (ListTable)
        Col("rank", "right", key=True),
        Col("run", "right", key=True),
        Col("host"),
        Col("status"),
        Col("steps", "right"),
        Col("free now", "right"),
        Col("min free", "right"),
        Col("peak in use", "right"),
        Col("actions", "right"),
        Col("OOMs", "right"),
        Col(""),
        title="ranks (the tightest: lowest minimum free fraction)",
    )
    for i, r in enumerate(report.ranks):
        run = r.run
        tight = i == report.tightest_index
        table.add_row(
            "-" if run.rank is None else str(run.rank),
            str(run.id),
            Text(run.host),
            run.status,
            str(run.steps),
            _pct(r.free_now_fraction),
            _pct(run.min_free_fraction),
            format_bytes(run.peak_in_use_bytes),
            str(run.action_count),
            str(run.oom_count),
            "◀ tightest" if tight else "",
            style="bold" if tight else None,
        )
    lines.append(table)
    rows = sorted(
        (
            (e.step, r.run.rank if r.run.rank is not None else -1, e)
            for r in report.ranks
            for e in r.actions
        ),
        key=lambda t: (t[0], t[1], t[2].id),
    )
    if rows:
        actions = ListTable(  # the step, rank and kind name the row: never cut
            Col("step", "right", key=True),
            Col("rank", "right", key=True),
            Col("kind", key=True),
            Col("message"),
            title="actions (every rank)",
        )
        for step, rank, e in rows:
            actions.add_row(str(step), str(rank), e.kind, Text(e.message))
        lines.append(actions)
    else:
        lines.append(Text("no actions on any rank"))
    return lines
