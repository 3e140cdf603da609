"""The job view (j): a multi-rank job's ranks side by side, the tightest one marked."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Static

from edo_monitor.hindsight.jobs import JobReport
from edo_monitor.tui.base import _PolledScreen, _while_shown
from edo_monitor.tui.data import Jobs, run_floor
from edo_monitor.tui.widgets import (
    STATUS_STYLES,
    format_fraction,
    format_time,
    plain,
)
from edo_monitor.units import format_bytes

_JOB_ACTION_STYLES = {"action": "green", "action_refused": "magenta", "action_failed": "red"}


def job_ranks_renderable(report: JobReport) -> Any:
    """The job view's body: the job's ranks side by side, one column each (the tightest rank's
    column highlighted), rows: run, host, status, steps, free now, min free, peak in use,
    actions (count, then each one with its step)."""
    from rich.table import Table

    table = Table(box=None, padding=(0, 2), pad_edge=False, show_edge=False, expand=False)
    table.add_column("", style="bold")
    for i, rank in enumerate(report.ranks):
        tight = i == report.tightest_index
        label = "rank -" if rank.run.rank is None else f"rank {rank.run.rank}"
        table.add_column(
            label + ("  ◀ tightest" if tight else ""),
            header_style="bold black on yellow" if tight else "bold",
            style="bold" if tight else "",
            max_width=48,
        )

    def free(value: float | None, rank: Any) -> Text:
        floor = run_floor(rank.run)  # None: no policy, no floor
        below = value is not None and floor is not None and value < floor
        return plain(format_fraction(value), "bold red" if below else "")

    rows: list[tuple[str, list[Text]]] = [
        ("run", [plain(f"#{r.run.id} {r.run.name}") for r in report.ranks]),
        ("host", [plain(r.run.host) for r in report.ranks]),
        (
            "status",
            [plain(r.run.status, STATUS_STYLES.get(r.run.status, "")) for r in report.ranks],
        ),
        ("steps", [plain(r.run.steps) for r in report.ranks]),
        ("free now", [free(r.free_now_fraction, r) for r in report.ranks]),
        ("min free", [free(r.run.min_free_fraction, r) for r in report.ranks]),
        ("peak in use", [plain(format_bytes(r.run.peak_in_use_bytes)) for r in report.ranks]),
        (
            "OOMs",
            [plain(r.run.oom_count, "bold red" if r.run.oom_count else "") for r in report.ranks],
        ),
    ]
    for label, cells in rows:
        table.add_row(label, *cells)
    actions = []
    for r in report.ranks:
        cell = Text(f"{len(r.actions)}")
        for e in r.actions:
            cell.append(f"\nstep {e.step} ", style="bold")
            cell.append(e.message, style=_JOB_ACTION_STYLES.get(e.kind, ""))
        actions.append(cell)
    table.add_row("actions", *actions)
    return table


JOB_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "job"),
    ("name", "name"),
    ("status", "status"),
    ("ranks", "ranks"),
    ("hosts", "hosts"),
    ("started", "started (UTC)"),
    ("steps", "steps"),
)


class JobScreen(_PolledScreen):
    """Multi-rank jobs (``j``): the jobs table (Enter or click chooses one) and the chosen job's
    ranks side by side — free fraction now and at its lowest, the tightest rank highlighted,
    the actions of each rank. Read in a worker every refresh; the UI thread only draws."""

    AUTO_FOCUS = "#jobs"

    def __init__(self) -> None:
        """Create the (empty) job view."""
        super().__init__("job-screen")
        #: the job shown (an id; ``None``: the newest)
        self.chosen: str | None = None
        self.data: Jobs | None = None
        self._rows: tuple[Any, ...] = ()
        #: the job the table's cursor was last put on for the user (``None``: not yet)
        self._cursor_job: str | None = None

    def compose(self) -> ComposeResult:
        """Lay out the view."""
        yield Static("jobs", id="jobs-header")
        yield DataTable(id="jobs", cursor_type="row", zebra_stripes=True)
        with VerticalScroll(id="job-box"):
            yield Static("reading…", id="job-body")
        yield Footer()

    def on_mount(self) -> None:
        """Set up the table and refresh every refresh interval while shown."""
        table = self.query_one("#jobs", DataTable)
        for key, label in JOB_COLUMNS:
            table.add_column(label, key=key)
        self.set_interval(self.tui.refresh_s, self.reload, name="job-refresh")
        self.reload()

    def choose(self, job_id: str | None) -> None:
        """Show job ``job_id`` (``None``: the newest) from the next read on."""
        self.chosen = job_id
        self.busy = False  # a read in flight for another job is superseded
        self.reload()

    def read_request(self) -> str | None:
        """The job chosen when the read starts."""
        return self.chosen

    def read(self, request: str | None) -> Jobs:
        """The jobs and the chosen job (worker thread)."""
        return self.tui.source.jobs(request)

    @_while_shown
    def _show_error(self, message: str, code: int) -> None:
        self.busy = False
        self.error_code = code
        self.query_one("#jobs-header", Static).update(Text("jobs", style="bold"))
        self.query_one("#job-body", Static).update(Text(message, style="bold red"))

    @_while_shown
    def _apply(self, chosen: str | None, data: Jobs) -> None:
        if chosen != self.chosen:  # the user chose another job meanwhile: read that one
            self.busy = False
            self.reload()
            return
        self.busy = False
        self.loads += 1
        self.error_code = None
        self.data = data
        header = self.query_one("#jobs-header", Static)
        body = self.query_one("#job-body", Static)
        table = self.query_one("#jobs", DataTable)
        rows = tuple(
            (j.id, j.name, j.status, len(set(j.ranks)), j.world_size, j.hosts, j.min_steps)
            for j in data.jobs
        )
        if rows != self._rows:  # refill only on a change, so the cursor stays put
            self._rows = rows
            at = None  # the job under the cursor, kept across the refill
            if 0 <= table.cursor_row < table.row_count:
                at = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
            table.clear()
            for j in data.jobs:
                table.add_row(
                    plain(j.id),
                    plain(j.name),
                    plain(j.status or "-", STATUS_STYLES.get(j.status or "", "")),
                    plain(f"{len(set(j.ranks))}/{j.world_size}"),
                    plain(", ".join(j.hosts)),
                    plain(format_time(j.started_at_s)),
                    plain("-" if j.min_steps is None else j.min_steps),
                    key=j.id,
                )
            if at in table.rows:
                table.move_cursor(row=table.get_row_index(at))
        report = data.report
        if report is None:
            header.update(Text(f"jobs in {self.tui.source.label}", style="bold"))
            body.update(
                Text(
                    f"No multi-rank jobs in {self.tui.source.label}. A job is the runs of the "
                    "ranks of one torch.distributed job (watch() inside an initialised process "
                    "group, e.g. under torchrun).",
                    style="bold",
                )
            )
            return
        # the cursor goes to the job shown when that job changes (first shown, or chosen), not
        # at every refresh: the user moves it to choose another (it snapped back within 0.3 s)
        if report.job.id != self._cursor_job and report.job.id in table.rows:
            self._cursor_job = report.job.id
            table.move_cursor(row=table.get_row_index(report.job.id))
        job = report.job
        text = Text(f"job {job.id}", style="bold")
        text.append(f" ({job.name}): ")
        text.append(job.status or "no runs", style=STATUS_STYLES.get(job.status or "", ""))
        text.append(
            f", {len(set(job.ranks))} of {job.world_size} rank(s), {job.backend or '?'} on "
            f"{', '.join(job.hosts) or '?'}"
        )
        tight = report.tightest
        if tight is not None:
            text.append(
                f"; tightest: rank {tight.run.rank} (min free "
                f"{format_fraction(tight.run.min_free_fraction)})",
                style="bold yellow",
            )
        text.append(f"   {len(data.jobs)} job(s) in {self.tui.source.label}")
        header.update(text)
        body.update(job_ranks_renderable(report))

    @on(DataTable.RowSelected, "#jobs")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None and event.row_key.value != self.chosen:
            self.choose(str(event.row_key.value))
