"""``edo-tui``: the terminal dashboard over the history database (live and past runs).

Usage::

    edo-tui [DB] [--run RUN] [--refresh-s S]

``DB`` is a file path or SQLAlchemy URL (default: ``EDO_DB``, else ``./edo-history.db``, as the
agent); ``RUN`` an id, a uuid prefix or ``latest`` (default: the latest running run, else the
latest run). The database is opened read-only; the dashboard never talks to a running agent.

Exit codes (the scheme of ``edo-monitor``), decided by what the dashboard shows when it quits:
    0  quit while showing a run, the runs table, or "waiting for a run"
    1  quit while an error panel says the database or run cannot be read (no such file, not a
       database, a newer schema, an unreachable server, no run matching ``--run``)
    2  usage: an unknown option, a bad value (``--run -1``: checked as ``edo-monitor show``
       checks its run), a database argument that is not a path or URL
    3  unexpected internal error: the app ended (Textual prints the traceback), or quit while a
       view's error line says ``internal error (…)`` (bad data in the history that a reader or
       the view tripped on; every view's background work shows its error instead of ending
       the app)
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from rich.console import RenderableType
from textual import work
from textual.app import App
from textual.binding import Binding
from textual.notifications import SeverityLevel

from edo_monitor.errors import ConfigError
from edo_monitor.store.paths import resolve_db_url
from edo_monitor.store.records import RunInfo
from edo_monitor.surfaces import scripting
from edo_monitor.tui.base import (
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    _call_ui,
    _guarded,
)
from edo_monitor.tui.data import DataSource
from edo_monitor.tui.devices_screen import DevicesScreen
from edo_monitor.tui.job_screen import JobScreen
from edo_monitor.tui.modals import ExplainScreen, HelpScreen
from edo_monitor.tui.run_screen import RunScreen
from edo_monitor.tui.runs_screen import RunsScreen

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "EdoTui",
    "main",
    "parse_args",
]

logger = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 1.0


class EdoTui(App[None]):
    """The dashboard app.

    Args:
        db: database path or URL (``None``: the agent's default).
        run: run to open first (id, uuid prefix, ``latest``; ``None``: running else latest).
        refresh_s: seconds between reads of what is new while a run is active.
        export_dir: folder the ``e`` key writes CSV files to (default: the current folder).
    """

    TITLE = "edo-tui"
    CSS_PATH = "styles.tcss"
    BINDINGS = [  # noqa: RUF012
        Binding("l", "live", "live"),
        Binding("r", "runs", "runs"),
        Binding("d", "devices", "devices"),
        Binding("j", "jobs", "jobs"),
        Binding("slash", "filter", "filter"),
        Binding("e", "export", "export CSV"),
        Binding("x", "explain", "explain"),
        Binding("m", "snapshot", "snapshot"),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(
        self,
        db: str | os.PathLike[str] | None = None,
        *,
        run: str | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        export_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """Create the app; nothing is read until it runs."""
        super().__init__()
        self.source = DataSource(db)
        self.initial_run = run
        self.refresh_s = refresh_s
        self.export_dir = Path(export_dir) if export_dir is not None else None
        self.last_export: Path | None = None
        self._final_error_code: int | None = None

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Show a notification; its text is shown as is (run names and paths are not markup)."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def on_mount(self) -> None:
        """Install both views and show the run view."""
        self.install_screen(RunScreen(self.initial_run), "live")
        self.install_screen(RunsScreen(), "runs")
        self.install_screen(DevicesScreen(), "devices")
        self.install_screen(JobScreen(), "jobs")
        self.push_screen("live")

    def exit(
        self,
        result: None = None,
        return_code: int = 0,
        message: RenderableType | None = None,
    ) -> None:
        """Exit the app (``q``), noting the exit code for what it shows (:attr:`exit_code`)."""
        if self._final_error_code is None:
            self._final_error_code = self._shown_error_code()
        super().exit(result, return_code, message)

    def on_unmount(self) -> None:
        """Release the database."""
        self.source.close()

    @property
    def exit_code(self) -> int:
        """The process exit code for what the app shows now (see the module docstring):
        :data:`EXIT_INTERNAL` after a crash, else the code of the error panel on the screen the
        user is looking at (or, on help, the run view's), else :data:`EXIT_OK`."""
        if self.return_code not in (None, 0):
            return EXIT_INTERNAL
        if self._final_error_code is not None:  # the app has exited: what it showed last
            return self._final_error_code
        return self._shown_error_code()

    def _shown_error_code(self) -> int:
        shown = [
            s
            for s in self.screen_stack
            if isinstance(s, (RunScreen, RunsScreen, DevicesScreen, JobScreen))
        ]
        for screen in reversed(shown):
            if screen.error_code is not None:
                return screen.error_code
        return EXIT_OK

    @property
    def run_screen(self) -> RunScreen:
        """The live / run view."""
        return self.get_screen("live")  # type: ignore[return-value]

    @property
    def runs_screen(self) -> RunsScreen:
        """The runs view."""
        return self.get_screen("runs")  # type: ignore[return-value]

    def _close_modal(self) -> None:
        from edo_monitor.tui.snapshot_screen import SnapshotScreen

        while isinstance(self.screen, (HelpScreen, ExplainScreen, SnapshotScreen)):
            self.pop_screen()

    def _show(self, name: str) -> None:
        self._close_modal()
        if self.screen is not self.get_screen(name):
            self.switch_screen(name)

    def open_run(self, run_ref: str | int | None) -> None:
        """Show the run ``run_ref`` in the run view (``None``: running else latest)."""
        self.run_screen.open_run(run_ref)
        self._show("live")

    def action_live(self) -> None:
        """``l``: the latest running run, else the latest run."""
        self.open_run(None)

    def action_runs(self) -> None:
        """``r``: the runs table."""
        self._show("runs")

    @property
    def devices_screen(self) -> DevicesScreen:
        """The devices view."""
        return self.get_screen("devices")  # type: ignore[return-value]

    def action_devices(self) -> None:
        """``d``: every GPU and process, from the daemon's latest sample."""
        self._show("devices")

    @property
    def job_screen(self) -> JobScreen:
        """The job view."""
        return self.get_screen("jobs")  # type: ignore[return-value]

    def action_jobs(self) -> None:
        """``j``: multi-rank jobs; the open run's job when it is a rank of one, else the job
        the view showed last (the newest at first)."""
        run = self.run_screen.run_info
        if self.screen is self.run_screen and run is not None and run.job_id is not None:
            self.job_screen.chosen = run.job_id
        self._show("jobs")

    async def action_filter(self) -> None:
        """``/``: filter the runs table (once the runs view is composed: pressed before the
        view had ever been shown, it looked the box up too early and the app exited)."""
        self._close_modal()
        if self.screen is not self.runs_screen:
            await self.switch_screen("runs")
        self.runs_screen.show_filter()

    def action_help(self) -> None:
        """``?``: the help screen."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_explain(self) -> None:
        """``x``: what would have avoided the open run's OOMs and crossings (the selected
        event's only, when it is one)."""
        run = self.run_screen.run_info
        if run is None:
            self.notify("no run is open to explain", severity="warning")
            return
        if isinstance(self.screen, ExplainScreen):
            return
        from edo_monitor.hindsight.explain import is_incident

        self._show("live")
        event = self.run_screen.selected_event
        # the selected event when explain explains it alone (an OOM, a crossing below the floor;
        # not the crossing back above), else every incident of the run
        chosen = event.id if event is not None and is_incident(event.kind, event.data) else None
        self.push_screen(ExplainScreen(run, chosen))

    def action_snapshot(self) -> None:
        """``m``: the selected event's memory snapshot by frame (the run's latest when no event
        is selected or the selected one has none: :class:`SnapshotScreen` says so)."""
        from edo_monitor.tui.snapshot_screen import SnapshotScreen

        run = self.run_screen.run_info
        if run is None:
            self.notify("no run is open", severity="warning")
            return
        if isinstance(self.screen, SnapshotScreen):
            return
        self._show("live")
        event = self.run_screen.selected_event
        self.push_screen(SnapshotScreen(run, event.id if event is not None else None))

    def action_export(self) -> None:
        """``e``: write the open run's samples to a CSV file (name shown in a notification)."""
        run = self.run_screen.run_info
        if run is None:
            self.notify("no run is open to export", severity="warning")
            return
        self.notify(f"exporting run #{run.id} ({run.name})…", timeout=2)
        self._export(run)

    @work(thread=True, group="export", exclusive=False)
    def _export(self, run: RunInfo) -> None:
        run_id = run.id
        directory = self.export_dir or Path.cwd()

        def body() -> None:
            path = self.source.export_csv(run, directory)
            self.last_export = path
            _call_ui(self, partial(self.notify, f"exported run #{run_id} to {path}", timeout=8))

        def failed(message: str, code: int) -> None:
            self.notify(f"export failed: {message}", severity="error")

        _guarded(self, failed, body)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if math.isnan(value) or math.isinf(value):
        what = "not a number (nan)" if math.isnan(value) else "infinite"
        raise argparse.ArgumentTypeError(f"{text!r} is {what}; expected a number of seconds > 0")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return value


def run_reference(text: str) -> str:
    """``--run``: a run reference checked as every ``edo-monitor`` command checks its ``RUN``
    (:func:`edo_monitor.surfaces.cli.options.check_run_reference`): a negative number is a bad
    value (exit 2, naming what is allowed), not a run the dashboard then fails to find."""
    from edo_monitor.surfaces.cli.options import check_run_reference

    try:
        return check_run_reference(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The database and run arguments of ``edo-tui`` and its screenshot tool."""
    from edo_monitor.surfaces.cli.options import RUN_HELP

    parser.add_argument(
        "db",
        nargs="?",
        default=None,
        help="database file or SQLAlchemy URL (default: $EDO_DB, else ./edo-history.db)",
    )
    parser.add_argument(
        "--db",
        dest="db_option",
        default=None,
        metavar="DB",
        help="the same, as edo-monitor's commands take it",
    )
    parser.add_argument(
        "--run",
        type=run_reference,
        default=None,
        help=f"{RUN_HELP[:1].lower()}{RUN_HELP[1:-1]} (default: running, else latest)",
    )


def parse_source_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``--db`` folded into ``db`` (one database: both given
    and different is a usage error)."""
    args = parser.parse_args(argv)
    if args.db_option is not None:
        if args.db is not None and args.db != args.db_option:
            parser.error(f"database {args.db!r} and --db {args.db_option!r}: give one")
        args.db = args.db_option
    del args.db_option
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``edo-tui``'s command line; a usage error exits 2 with one line on stderr."""
    parser = scripting.ArgumentParser(  # one-line errors, exit 2, as the scripts'
        prog="edo-tui",
        description="Terminal dashboard of edo-monitor's history database: runs live and past.",
        epilog=(
            "Exit codes: 0 quit on a run, the runs table or 'waiting for a run'; 1 quit while "
            "the database or run could not be read; 2 usage (bad option, unusable database "
            "argument, no terminal); 3 internal error."
        ),
    )
    add_source_arguments(parser)
    parser.add_argument(
        "--refresh-s",
        type=_positive_float,
        default=DEFAULT_REFRESH_S,
        help=f"seconds between refreshes of a live run (default {DEFAULT_REFRESH_S})",
    )
    return parse_source_args(parser, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``edo-tui``: returns the exit code (module docstring).

    The arguments are checked before the screen is taken over: a bad option, a database
    argument that is neither a path nor a usable URL, or a standard input or error that is not
    a terminal prints one line on stderr and returns :data:`EXIT_USAGE`.
    """
    args = parse_args(argv)  # argparse exits with 2 itself
    try:
        resolve_db_url(args.db)
    except ConfigError as exc:
        sys.stderr.write(f"edo-tui: error: {exc}\n")
        return EXIT_USAGE
    # Textual reads keys from stdin and draws on stderr: without a terminal there it spun on
    # end-of-file at full CPU, drawing into a file, and never exited
    for name, stream in (("standard input", sys.stdin), ("standard error", sys.__stderr__)):
        if stream is None or not stream.isatty():
            sys.stderr.write(
                f"edo-tui: error: {name} is not a terminal; the dashboard needs one "
                "(for a report on a file or a pipe use 'edo-monitor show')\n"
            )
            return EXIT_USAGE
    app = EdoTui(args.db, run=args.run, refresh_s=args.refresh_s)
    app.run()
    return app.exit_code


if __name__ == "__main__":
    sys.exit(main())
