"""The dashboard's screens: the live / run view, the runs table, devices, jobs, and help.

Every database read runs in a thread worker (``@work(thread=True)``) and hands its result back to
the UI thread with ``call_from_thread`` (through :func:`_call_ui`); the UI thread only draws.
Every refresh timer, resume/resize handler and hand-back goes through :func:`_while_shown`, which
skips it while the screen is being built, after it was popped, or while the app exits.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rich.measure import Measurement
from rich.text import Text
from sqlalchemy.exc import SQLAlchemyError
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen, Screen
from textual.strip import Strip
from textual.widgets import DataTable, Footer, Input, Static

from edo_monitor.errors import ConfigError, EdoMonitorError
from edo_monitor.units import format_bytes

from .data import (
    TERMINAL_STATUSES,
    Devices,
    EventInfo,
    JobReport,
    Jobs,
    Latest,
    ModuleInfo,
    Poll,
    RunInfo,
    Series,
    elapsed_s,
    run_floor,
)
from .widgets import (
    STATUS_STYLES,
    ChartData,
    Gauge,
    MemoryChart,
    build_chart,
    format_duration,
    format_fraction,
    format_time,
    plain,
)

if TYPE_CHECKING:
    from .app import EdoTui

__all__ = [
    "DevicesScreen",
    "ExplainScreen",
    "HelpScreen",
    "JobScreen",
    "RunScreen",
    "RunsScreen",
    "job_ranks_renderable",
]

logger = logging.getLogger(__name__)

#: Errors a read may raise that are shown on screen instead of a traceback.
READ_ERRORS = (EdoMonitorError, SQLAlchemyError, OSError, ImportError)

#: Event kinds shown in the events table (decisions are shown through their actions).
_EVENT_STYLES = {
    "threshold_crossed": "yellow",
    "action": "green",
    "action_refused": "magenta",
    "decision_expired": "grey62",
    "action_failed": "red",
    "oom": "bold red",
    "oom_recovered": "green",
    "oom_unrecovered": "bold red",
    "micro_batches_merged": "cyan",
    "leak_suspected": "yellow",
    "forecast": "yellow",
    "forecast_outcome": "cyan",
    "probe_unavailable": "grey62",
    "samples_dropped": "yellow",
    "agent_error": "red",
    "decision": "cyan",
}

HELP_TEXT = """\
[b]edo-tui[/b] — GPU memory of PyTorch runs, live and from history

  [b]l[/b]        live view: the latest running run (else the latest run); follows new runs
  [b]f[/b]        live view: follow new runs on/off (while following, a view left on a run
           that has ended switches to a newer running run as soon as one starts)
  [b]r[/b]        runs: every run in the database (Enter or click opens one)
  [b]d[/b]        devices: every GPU and process of the machine, from edo-monitor daemon's
           latest sample (used/total, utilisation, the watched run of each process)
  [b]j[/b]        jobs: multi-rank (torch.distributed) jobs, the open run's job first; its
           ranks side by side: free now and lowest, the tightest rank highlighted,
           each rank's actions (Enter or click on a job shows it)
  [b]/[/b]        filter the runs table (Esc clears, Enter goes to the table)
  [b]s[/b]        runs table: sort by the next column (or click a column header)
  [b]e[/b]        export the open run's samples to CSV in the current folder
  [b]x[/b]        explain: what would have avoided the open run's OOMs and pressure
           crossings (the selected event's only, when it is one); Esc closes
  [b]m[/b]        memory snapshot of the selected event (else the run's latest): its
           largest live blocks by frame (module); Esc closes
  [b]?[/b]        this help
  [b]q[/b]        quit

The chart shows in-use (green), allocated (cyan) and reserved (blue) bytes over
elapsed seconds; the yellow line is the floor (the in-use level at which free
memory falls below the policy's floor; none without a budget), magenta lines and
x are actions, red lines marked OOM are out-of-memory errors. The legend is the
line above the plot. Values not available from a source are shown as N/A, never
as zero. Events: the whole detail of the selected event is shown below the table.

Press any key to close."""


_F = TypeVar("_F", bound=Callable[..., None])


def _present(screen: Screen[Any]) -> bool:
    """``screen`` can be drawn on: mounted, still in the app's DOM (not popped or being
    removed), and the app running (not exiting)."""
    try:
        app = screen.app
    except Exception:  # no active app (it has exited)
        return False
    return (
        screen.is_mounted
        and screen.is_attached
        and not screen._closing  # popped: its widgets are being removed
        and not screen._closed
        and app.is_running
    )


def _while_shown(method: _F) -> _F:
    """The one guard of everything that reaches a screen from outside a key press: its refresh
    timers, its worker threads' hand-backs (:func:`_call_ui`), resize and resume messages.

    The call is skipped (quietly, at debug level) when the screen is not there to draw on — not
    yet mounted, popped or being torn down, or the app exiting — and a query that finds nothing
    (``NoMatches``: the screen's widgets being built or removed) ends it quietly instead of
    reaching Textual's crash handler."""

    @functools.wraps(method)
    def wrapper(self: Screen[None], *args: Any) -> None:
        if not _present(self):
            logger.debug("%s skipped: screen not shown", method.__name__)
            return
        try:
            method(self, *args)
        except NoMatches:  # the screen is being built or torn down
            logger.debug("%s skipped: screen closing", method.__name__)

    return wrapper  # type: ignore[return-value]


def _call_ui(screen: Screen[Any] | App[Any], callback: Callable[..., Any], *args: Any) -> None:
    """Hand a worker thread's result to the UI thread (``call_from_thread``); nothing when the
    app has stopped meanwhile (``call_from_thread`` raises ``RuntimeError`` then)."""
    app = screen if isinstance(screen, App) else screen.app
    try:
        app.call_from_thread(callback, *args)
    except RuntimeError:
        if app.is_running:  # raised by the callback itself: not ours to hide
            raise
        logger.debug("%s dropped: the app has stopped", getattr(callback, "__name__", callback))


def _code_for(exc: BaseException) -> int:
    """The exit code an error shown on screen stands for: 2 for a database argument that is not
    usable as given (:class:`ConfigError`), else 1 (the database or run cannot be read)."""
    return 2 if isinstance(exc, ConfigError) else 1


def _message_for(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ImportError):
        text = f"cannot open the history database: its driver is not installed ({exc})"
    elif isinstance(exc, SQLAlchemyError):
        text = f"cannot read the history database: {getattr(exc, 'orig', None) or exc}"
    return text


def _format_saved(event: EventInfo) -> str:
    saved = event.data.get("saved_bytes") if event.kind == "action" else None
    return format_bytes(saved) if isinstance(saved, (int, float)) else ""


#: Columns of the events table.
_EVENT_COLUMNS = ("time", "step", "kind", "detail", "saved")
#: Event kinds drawn on the chart.
_CHARTED = frozenset({"action", "oom"})
#: Events shown of a run (the newest).
_MAX_EVENT_ROWS = 1000


def _chart_data(
    run: RunInfo, series: Series | None, latest: Latest | None, events: tuple[EventInfo, ...]
) -> ChartData:
    """The chart's snapshot of ``run``: no floor line without a budget."""
    budget = latest.budget_bytes if latest is not None else run.budget_bytes
    floor = run_floor(run)
    return ChartData.of(
        series,
        start_s=run.started_at_s,
        floor_bytes=None if budget is None else int(budget * (1.0 - floor)),
        floor_fraction=None if budget is None else floor,
        events=events,
    )


class _Detail:
    """An event's detail in its table cell: cut at a word boundary, with ``…``, to the cell's
    width (the whole text is shown below the table for the selected event). Plain text, never
    markup."""

    def __init__(self, text: str, max_width: int = 72) -> None:
        self.text = " ".join(text.split())
        self.max_width = max_width

    def __rich_measure__(self, console: Any, options: Any) -> Measurement:
        return Measurement(1, min(len(self.text), self.max_width))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        width = max(1, options.max_width)
        yield Text(_cut_at_word(self.text, width), no_wrap=True, overflow="crop")

    def __str__(self) -> str:
        return self.text

    @property
    def plain(self) -> str:
        """The whole text (as ``Text.plain``)."""
        return self.text


def _cut_at_word(text: str, width: int) -> str:
    """``text`` if it fits ``width`` cells, else its longest prefix of whole words plus ``…``."""
    if len(text) <= width:
        return text
    head = text[: max(0, width - 1)]
    space = head.rfind(" ")
    if space > width // 3:
        head = head[:space]
    return head.rstrip() + "…"


def _event_detail(event: EventInfo) -> str:
    data = event.data
    if event.kind == "action" and data.get("action"):
        target = data.get("target")
        text = f"{data['action']}" + (f" → {target}" if target else "")
        if isinstance(data.get("duration_s"), (int, float)):
            text += f" ({data['duration_s'] * 1000:.0f} ms)"
        return f"{text}: {event.message}" if event.message else text
    return event.message


class RunScreen(Screen[None]):
    """The live / run view: header, gauges, chart, events and embedding tables of one run.

    While the run is active it polls every ``refresh_s`` for what is new (in a worker thread,
    which also builds the chart's lines, so the UI thread only shows them); once the run is
    finished, failed or interrupted it stops polling. While *following* (the default unless a
    particular run was asked for; ``f`` toggles), a view left on a run that is no longer running
    switches to a newer running run as soon as one starts, and the header says so.
    """

    BINDINGS = [  # noqa: RUF012
        Binding("f", "toggle_follow", "follow"),
    ]

    def __init__(self, run_ref: str | None = None) -> None:
        """Show the run ``run_ref`` (id, uuid prefix, ``latest``; ``None``: running else latest).

        Following is on unless ``run_ref`` names a particular run (not ``latest``).
        """
        super().__init__(id="run-screen")
        self.run_ref = run_ref
        self.follow = run_ref is None or run_ref.strip().lower() == "latest"
        #: the run the view switched away from when it last followed a new run
        self.followed_from: RunInfo | None = None
        self.run_info: RunInfo | None = None
        self.series: Series | None = None
        self.latest: Latest | None = None
        self.last_event_id = 0
        #: events drawn on the chart (actions, out-of-memory errors); replaced, never mutated
        self.chart_events: tuple[EventInfo, ...] = ()
        self.event_rows: list[EventInfo] = []
        self.module_ids: tuple[int, ...] = ()
        self.error: str | None = None
        #: exit code of the error shown (``None``: no error, or only "waiting for a run")
        self.error_code: int | None = None
        self.loaded = False
        self.busy = False
        self.generation = 0
        #: completed reads: ``refreshes`` of what is new in the open run, ``loads`` of a run
        #: (or of "no run yet" / an error)
        self.refreshes = 0
        self.loads = 0
        #: refresh timer ticks (and other calls of :meth:`tick`)
        self.ticks = 0
        self._header_lines = 1
        self._detail_lines = 0

    @property
    def tui(self) -> EdoTui:
        """The app, typed."""
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        """Lay out the view."""
        yield Static("edo-tui", id="run-header")
        yield Static("", id="run-message")
        with Horizontal(id="gauges"):
            yield Gauge("used/budget", id="gauge-used")
            yield Gauge("alloc/rsvd", id="gauge-alloc")
            yield Gauge("free", id="gauge-free")
            yield Gauge("frag", id="gauge-frag")
        yield MemoryChart(id="chart")
        with Vertical(id="events-box"):
            yield Static("events", classes="box-title")
            yield DataTable(id="events", cursor_type="row", zebra_stripes=True)
            yield Static("", id="event-detail")
        with Vertical(id="modules-box"):
            yield Static("embedding tables", classes="box-title")
            yield DataTable(id="modules", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        """Set up the tables and start polling."""
        events = self.query_one("#events", DataTable)
        for key in _EVENT_COLUMNS:
            events.add_column(key, key=key)
        modules = self.query_one("#modules", DataTable)
        modules.add_columns(
            "table",
            "shape",
            "dtype",
            "placement",
            "params",
            "grads",
            "optim",
            "activ",
            "total",
            "cache rows",
            "hits",
        )
        self.query_one("#run-message", Static).display = False
        self.set_interval(self.tui.refresh_s, self.tick, name="run-refresh")
        self.tick()

    @_while_shown
    def on_screen_resume(self) -> None:
        """Refresh at once when the view comes back."""
        self.tick()

    # -- following --------------------------------------------------------------------------

    def action_toggle_follow(self) -> None:
        """``f``: follow new runs, or stop following."""
        self.follow = not self.follow
        self.notify("following new runs" if self.follow else "not following new runs", timeout=3)
        self._update_header()
        self.tick()

    # -- loading ----------------------------------------------------------------------------

    def open_run(self, run_ref: str | int | None) -> None:
        """Switch to another run (``None``: the latest running run, else the latest).

        Asking for a particular run turns following off; ``None`` or ``latest`` turns it on.
        """
        self.run_ref = None if run_ref is None else str(run_ref)
        self.follow = self.run_ref is None or self.run_ref.strip().lower() == "latest"
        self.followed_from = None
        self.generation += 1
        self.loaded = False
        self.busy = False
        self.run_info = None
        self.tick()

    def _chart_request(self) -> tuple[tuple[int, int], int]:
        chart = self.query_one(MemoryChart)
        return chart.wanted_size, max(40, self.app.size.width - 10)

    @_while_shown
    def tick(self) -> None:
        """Start a read unless one is in flight, or the open run can no longer change (and no
        newer run is to be followed)."""
        self.ticks += 1
        if self.busy:
            return
        run = self.run_info
        if self.loaded and run is not None and run.status != "running" and self.follow:
            self.busy = True
            size, points = self._chart_request()
            self._follow(self.generation, run, size, points)
            return
        if self.loaded and run is not None and run.status in TERMINAL_STATUSES:
            self._update_header()  # nothing to read: a finished run never changes
            return
        self.busy = True
        size, points = self._chart_request()
        if self.loaded and run is not None:
            self._poll(self.generation, run.id, size)
        else:
            self._load(self.generation, self.run_ref, points, size)

    def _read_run(
        self, run: RunInfo, max_points: int, size: tuple[int, int]
    ) -> tuple[Series, Latest | None, list[EventInfo], list[ModuleInfo], ChartData, list[Strip]]:
        """Everything the view shows of ``run`` (worker thread)."""
        source = self.tui.source
        series = source.series(run, max_points)
        latest = source.latest(run)
        events = source.events(run.id)[-_MAX_EVENT_ROWS:]
        modules = source.modules(run.id)
        data = _chart_data(run, series, latest, tuple(e for e in events if e.kind in _CHARTED))
        return series, latest, events, modules, data, build_chart(data, *size)

    @work(thread=True, group="run-read")
    def _load(
        self, generation: int, run_ref: str | None, max_points: int, size: tuple[int, int]
    ) -> None:
        source = self.tui.source
        try:
            run = source.resolve(run_ref)
            if run is None:
                _call_ui(
                    self,
                    self._show_error,
                    generation,
                    f"No runs recorded yet in {source.label}. Waiting for a run to start…",
                    None,
                )
                return
            read = self._read_run(run, max_points, size)
        except READ_ERRORS as exc:
            logger.debug("load failed", exc_info=True)
            _call_ui(self, self._show_error, generation, _message_for(exc), _code_for(exc))
            return
        _call_ui(self, self._apply_load, generation, run, *read, size, None)

    @work(thread=True, group="run-read")
    def _follow(
        self, generation: int, shown: RunInfo, size: tuple[int, int], max_points: int
    ) -> None:
        """The shown run is not running: open the newest running run if it is newer, else go
        on as :meth:`tick` would (poll a crashed run; nothing for a finished one)."""
        source = self.tui.source
        try:
            run = source.resolve(None)
            if run is not None and run.status == "running" and run.id > shown.id:
                read = self._read_run(run, max_points, size)
                _call_ui(self, self._apply_load, generation, run, *read, size, shown)
                return
            if shown.status not in TERMINAL_STATUSES:
                self._poll_now(generation, shown.id, size)
                return
        except READ_ERRORS as exc:
            logger.debug("follow check failed", exc_info=True)
            _call_ui(self, self._show_error, generation, _message_for(exc), _code_for(exc))
            return
        _call_ui(self, self._follow_idle, generation)

    @work(thread=True, group="run-read")
    def _poll(self, generation: int, run_id: int, size: tuple[int, int]) -> None:
        try:
            self._poll_now(generation, run_id, size)
        except READ_ERRORS as exc:
            logger.debug("poll failed", exc_info=True)
            _call_ui(self, self._show_error, generation, _message_for(exc), _code_for(exc))

    def _poll_now(self, generation: int, run_id: int, size: tuple[int, int]) -> None:
        """Read what is new, fold it into the series and build the chart (worker thread)."""
        series = self.series
        poll = self.tui.source.poll(
            run_id, series.last_id if series is not None else 0, self.last_event_id
        )
        lines = data = None
        charted = tuple(e for e in poll.new_events if e.kind in _CHARTED)
        if series is not None and (poll.new_samples or charted):
            series.extend(poll.new_samples)
            latest = poll.latest or self.latest
            data = _chart_data(poll.run, series, latest, self.chart_events + charted)
            lines = build_chart(data, *size)
        _call_ui(self, self._apply_poll, generation, poll, data, lines, size)

    @work(thread=True, group="chart", exclusive=True)
    def _rebuild_chart(self, generation: int, data: ChartData, size: tuple[int, int]) -> None:
        lines = build_chart(data, *size)
        _call_ui(self, self._apply_chart, generation, data, lines, size)

    @_while_shown
    def on_memory_chart_stale(self, message: MemoryChart.Stale) -> None:
        """The chart was resized: build its lines again (off the UI thread)."""
        chart = message.chart
        self._rebuild_chart(self.generation, chart.data, chart.wanted_size)

    # -- applying (UI thread) ---------------------------------------------------------------

    @_while_shown
    def _show_error(self, generation: int, message: str, code: int | None) -> None:
        if generation != self.generation or not self.is_mounted:
            return
        self.busy = False
        self.loads += 1
        self.error = message
        self.error_code = code
        box = self.query_one("#run-message", Static)
        box.update(Text(message, style="bold"))
        box.display = True
        if self.run_info is None:
            self.query_one("#run-header", Static).update(Text("edo-tui", style="bold"))

    def _clear_error(self) -> None:
        if self.error is not None:
            self.error = None
            self.error_code = None
            self.query_one("#run-message", Static).display = False

    @_while_shown
    def _apply_chart(
        self, generation: int, data: ChartData, lines: list[Strip], size: tuple[int, int]
    ) -> None:
        chart = self.query_one(MemoryChart)
        if generation == self.generation and chart.data is data:  # not overtaken by new data
            chart.set_lines(data, lines, size)

    @_while_shown
    def _follow_idle(self, generation: int) -> None:
        if generation != self.generation:
            return
        self.busy = False
        self.refreshes += 1
        self._update_header()

    @_while_shown
    def _apply_load(
        self,
        generation: int,
        run: RunInfo,
        series: Series,
        latest: Latest | None,
        events: list[EventInfo],
        modules: list[ModuleInfo],
        data: ChartData,
        lines: list[Strip],
        size: tuple[int, int],
        followed_from: RunInfo | None,
    ) -> None:
        if generation != self.generation or not self.is_mounted:
            return
        self.busy = False
        self._clear_error()
        if followed_from is not None:
            self.followed_from = followed_from
            self.notify(
                f"run #{run.id} {run.name} started: following it "
                f"(was #{followed_from.id}, {followed_from.status}; f: stop following)",
                timeout=6,
            )
        self.run_info = run
        self.series = series
        self.latest = latest
        self.chart_events = tuple(e for e in events if e.kind in _CHARTED)
        self.module_ids = ()
        self.last_event_id = 0
        self.event_rows = []
        self.query_one("#events", DataTable).clear()
        self.query_one("#modules", DataTable).clear()
        self._add_events(events)
        self._add_modules(modules)
        self.loaded = True
        self.loads += 1
        self._update_header()
        self._update_gauges()
        self.query_one(MemoryChart).set_lines(data, lines, size)

    @_while_shown
    def _apply_poll(
        self,
        generation: int,
        poll: Poll,
        data: ChartData | None,
        lines: list[Strip] | None,
        size: tuple[int, int],
    ) -> None:
        if generation != self.generation or not self.is_mounted:
            return
        self.busy = False
        self._clear_error()
        self.run_info = poll.run
        if poll.latest is not None:
            self.latest = poll.latest
        if poll.new_events:
            self.chart_events += tuple(e for e in poll.new_events if e.kind in _CHARTED)
            self._add_events(poll.new_events)
        if poll.modules is not None:
            self._add_modules(poll.modules)
        self.refreshes += 1
        self._update_header()
        if poll.latest is not None:
            self._update_gauges()
        if data is not None and lines is not None:
            self.query_one(MemoryChart).set_lines(data, lines, size)

    def _add_events(self, events: list[EventInfo]) -> None:
        """Append rows for ``events`` (the rows already there are kept as they are)."""
        if not events:
            return
        table = self.query_one("#events", DataTable)
        start = self.run_info.started_at_s if self.run_info is not None else 0.0
        follow_cursor = table.row_count == 0 or table.cursor_row >= table.row_count - 1
        for event in events:
            self.last_event_id = max(self.last_event_id, event.id)
            self.event_rows.append(event)
            table.add_row(
                plain(format_duration(event.time_s - start)),
                plain(event.step),
                plain(event.kind, _EVENT_STYLES.get(event.kind, "")),
                _Detail(_event_detail(event)),
                plain(_format_saved(event)),
                key=str(event.id),
            )
        if follow_cursor:  # the cursor was on the newest event: keep it there
            table.move_cursor(row=table.row_count - 1, animate=False)
        self._show_event_detail()

    @on(DataTable.RowHighlighted, "#events")
    def _event_highlighted(self) -> None:
        self._show_event_detail()

    @property
    def selected_event(self) -> EventInfo | None:
        """The event under the events table's cursor (``None``: no event)."""
        try:
            row = self.query_one("#events", DataTable).cursor_row
        except NoMatches:
            return None
        return self.event_rows[row] if 0 <= row < len(self.event_rows) else None

    def _show_event_detail(self) -> None:
        """The whole detail of the event under the cursor, wrapped, below the table."""
        table = self.query_one("#events", DataTable)
        box = self.query_one("#event-detail", Static)
        row = table.cursor_row
        if not self.event_rows or not 0 <= row < len(self.event_rows):
            if box.display:
                box.display = False
            return
        event = self.event_rows[row]
        start = self.run_info.started_at_s if self.run_info is not None else 0.0
        text = Text()
        text.append(f"{format_duration(event.time_s - start)}  step {event.step}  ", "bold")
        text.append(event.kind, _EVENT_STYLES.get(event.kind, ""))
        text.append("  ")
        text.append(_event_detail(event))
        # a layout pass (costly: the whole screen) only when the box's height changes
        width = box.content_region.width or max(20, self.app.size.width - 2)
        lines = len(text.wrap(self.app.console, width))
        box.update(text, layout=lines != self._detail_lines or not box.display)
        self._detail_lines = lines
        if not box.display:
            box.display = True

    def _add_modules(self, modules: list[ModuleInfo]) -> None:
        ids = tuple(sorted(m.id for m in modules))
        if ids == self.module_ids:
            return  # nothing changed
        self.module_ids = ids
        table = self.query_one("#modules", DataTable)
        table.clear()
        for row in sorted(modules, key=lambda r: (-r.total_bytes, r.module)):
            if row.num_embeddings is None and "embedding" not in row.kind.lower():
                continue
            shape = (
                f"{row.num_embeddings}×{row.embedding_dim}"
                if row.num_embeddings is not None
                else "N/A"
            )
            table.add_row(
                plain(row.module),
                plain(shape),
                plain(row.dtype or "N/A"),
                plain(row.placement or "N/A"),
                plain(format_bytes(row.params_bytes)),
                plain(format_bytes(row.grads_bytes)),
                plain(format_bytes(row.optimizer_state_bytes)),
                plain(format_bytes(row.activations_bytes)),
                plain(format_bytes(row.total_bytes)),
                plain("-" if row.cache_rows is None else f"{row.cache_rows:,}"),
                plain("-" if row.cache_rows is None else format_fraction(row.cache_hit_fraction)),
                key=row.module,
            )

    def _update_header(self) -> None:
        run = self.run_info
        if run is None:
            return
        header = Text()
        header.append(f" {run.name} ", style="bold reverse")
        header.append(f"  #{run.id} {run.uuid[:8]}  ", style="grey62")
        header.append(f" {run.status} ", style=STATUS_STYLES.get(run.status, "bold"))
        device = run.device_name or "unknown device"
        header.append(f"   device: {device} ({run.device_kind})")
        step = max(run.steps, self.latest.step if self.latest else 0)
        header.append(f"   step: {step}")
        header.append(f"   elapsed: {format_duration(elapsed_s(run))}")
        if self.follow:  # the footer names the key (f)
            header.append("   following new runs", style="bold green")
            if self.followed_from is not None:
                header.append(f" (switched from #{self.followed_from.id})", style="green")
        else:
            header.append("   not following new runs", style="grey62")
        if run.error:
            header.append(f"\n error: {run.error}", style="red")
        lines = 1 + header.plain.count("\n")
        # a layout pass only when the header's height changes: it costs more than the rest
        self.query_one("#run-header", Static).update(header, layout=lines != self._header_lines)
        self._header_lines = lines

    def _update_gauges(self) -> None:
        run = self.run_info
        s = self.latest
        floor = run_floor(run) if run is not None else 0.2
        used = self.query_one("#gauge-used", Gauge)
        alloc = self.query_one("#gauge-alloc", Gauge)
        free = self.query_one("#gauge-free", Gauge)
        frag = self.query_one("#gauge-frag", Gauge)
        if s is None:
            for gauge in (used, alloc, free, frag):
                gauge.set(None, "N/A (no samples yet)")
            return
        low = s.free_fraction is not None and s.free_fraction < floor
        if s.in_use_bytes is not None and s.budget_bytes:
            used.set(
                s.in_use_bytes / s.budget_bytes,
                f"{format_bytes(s.in_use_bytes)} / {format_bytes(s.budget_bytes)}",
                mark=1.0 - floor,
                warn=low,
            )
        else:
            used.set(None, f"{format_bytes(s.in_use_bytes)} / {format_bytes(s.budget_bytes)}")
        if s.allocated_bytes is not None and s.reserved_bytes:
            alloc.set(
                s.allocated_bytes / s.reserved_bytes,
                f"{format_bytes(s.allocated_bytes)} / {format_bytes(s.reserved_bytes)}",
            )
        else:
            alloc.set(None, f"{format_bytes(s.allocated_bytes)} / {format_bytes(s.reserved_bytes)}")
        if s.budget_bytes is None:  # no budget: no free fraction, no floor to mark
            free.set(s.free_fraction, f"{format_fraction(s.free_fraction)} (no budget)")
        else:
            free.set(
                s.free_fraction,
                f"{format_fraction(s.free_fraction)} (floor {format_fraction(floor)})",
                mark=floor,
                warn=low,
            )
        frag.set(s.fragmentation, format_fraction(s.fragmentation))


#: Columns of the runs table: (key, label).
RUN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "id"),
    ("name", "name"),
    ("status", "status"),
    ("started", "started"),
    ("duration", "duration"),
    ("device", "device"),
    ("peak", "peak"),
    ("min_free", "min free"),
    ("ooms", "OOMs"),
    ("actions", "actions"),
)


def _sort_value(run: RunInfo, key: str) -> Any:
    values: dict[str, Any] = {
        "id": run.id,
        "name": run.name.lower(),
        "status": run.status,
        "started": run.started_at_s,
        "duration": elapsed_s(run),
        "device": f"{run.device_kind} {run.device_name or ''}",
        "peak": run.peak_in_use_bytes if run.peak_in_use_bytes is not None else -1,
        "min_free": run.min_free_fraction if run.min_free_fraction is not None else 2.0,
        "ooms": run.oom_count,
        "actions": run.action_count,
    }
    return values[key]


def _matches(run: RunInfo, needle: str) -> bool:
    haystack = " ".join(
        [
            str(run.id),
            run.uuid,
            run.name,
            run.status,
            run.host,
            run.device_kind,
            run.device_name or "",
            *map(str, run.tags),
        ]
    ).lower()
    return all(word in haystack for word in needle.lower().split())


class _PolledScreen(Screen[None]):
    """A view that reads the database in a worker thread when shown, when it comes back and on
    its refresh timer, and draws on the UI thread: subclasses give :meth:`read` (worker thread)
    and ``_apply(request, result)`` / ``_show_error(message, code)`` (UI thread), and may give
    :meth:`read_request` (what the next read needs, taken on the UI thread)."""

    def __init__(self, screen_id: str) -> None:
        super().__init__(id=screen_id)
        #: a read is in flight
        self.busy = False
        #: completed reads
        self.loads = 0
        #: exit code of the error shown (``None``: none)
        self.error_code: int | None = None

    @property
    def tui(self) -> EdoTui:
        """The app, typed."""
        return self.app  # type: ignore[return-value]

    @_while_shown
    def on_screen_resume(self) -> None:
        """Read again when the view comes back."""
        self.reload()

    @_while_shown
    def reload(self) -> None:
        """Read again (in a worker), unless a read is in flight or the view is hidden."""
        if self.busy or not self.is_current:
            return
        self.busy = True
        self._read(self.read_request())

    def read_request(self) -> Any:
        """What the next read needs (UI thread); ``None`` by default."""
        return None

    def read(self, request: Any) -> Any:
        """The read (worker thread); raises one of ``READ_ERRORS`` when it cannot be done."""
        raise NotImplementedError

    @work(thread=True, group="view-read", exclusive=True)
    def _read(self, request: Any) -> None:
        try:
            result = self.read(request)
        except READ_ERRORS as exc:
            _call_ui(self, self._show_error, _message_for(exc), _code_for(exc))
            return
        _call_ui(self, self._apply, request, result)

    def _show_error(self, message: str, code: int) -> None:
        raise NotImplementedError

    def _apply(self, request: Any, result: Any) -> None:
        raise NotImplementedError


class RunsScreen(_PolledScreen):
    """Every run in the database: sortable (click a header, or ``s``), filterable (``/``)."""

    #: the table, not the (hidden) filter box: a key typed before the view is shown must reach
    #: the app's bindings, not be typed into the filter
    AUTO_FOCUS = "#runs"
    BINDINGS = [  # noqa: RUF012
        Binding("s", "sort_next", "sort"),
        Binding("escape", "clear_filter", "clear filter", show=False),
    ]

    def __init__(self) -> None:
        """Create the (empty) runs view."""
        super().__init__("runs-screen")
        self.run_list: list[RunInfo] = []
        self.sort_key = "started"
        self.sort_reverse = True
        self.filter_text = ""

    def compose(self) -> ComposeResult:
        """Lay out the view."""
        yield Static("runs", id="runs-header")
        yield Static("", id="runs-message")
        filter_box = Input(
            placeholder="filter runs (name, status, device, host, tag)…", id="filter"
        )
        filter_box.display = False
        yield filter_box
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        """Set up the table and start loading."""
        table = self.query_one("#runs", DataTable)
        for key, label in RUN_COLUMNS:
            table.add_column(label, key=key)
        self.query_one("#runs-message", Static).display = False
        self.set_interval(max(2.0, 5 * self.tui.refresh_s), self.reload, name="runs-refresh")
        self.reload()

    @_while_shown
    def on_screen_resume(self) -> None:
        """Reload when the view comes back."""
        super().on_screen_resume()
        if not self.query_one("#filter", Input).display:
            self.query_one("#runs", DataTable).focus()

    def read(self, request: None) -> list[RunInfo]:
        """Every run (worker thread)."""
        return self.tui.source.runs()

    @_while_shown
    def _show_error(self, message: str, code: int) -> None:
        self.busy = False
        if not self.is_mounted:
            return
        self.error_code = code
        box = self.query_one("#runs-message", Static)
        box.update(Text(message, style="bold"))
        box.display = True

    @_while_shown
    def _apply(self, request: None, run_list: list[RunInfo]) -> None:
        self.busy = False
        if not self.is_mounted:
            return
        self.loads += 1
        self.error_code = None
        self.run_list = run_list
        box = self.query_one("#runs-message", Static)
        if not run_list:
            box.update(Text(f"No runs recorded yet in {self.tui.source.label}.", style="bold"))
            box.display = True
        else:
            box.display = False
        self.rebuild()

    def visible(self) -> list[RunInfo]:
        """The runs shown: filtered, then sorted."""
        rows = [s for s in self.run_list if _matches(s, self.filter_text)]
        rows.sort(key=lambda s: _sort_value(s, self.sort_key), reverse=self.sort_reverse)
        return rows

    def rebuild(self) -> None:
        """Refill the table from :meth:`visible`, keeping the cursor on the same run."""
        table = self.query_one("#runs", DataTable)
        keep = None
        if table.row_count:
            try:
                keep = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
            except Exception:
                keep = None
        table.clear()
        arrow = " ▼" if self.sort_reverse else " ▲"
        for key, label in RUN_COLUMNS:
            table.columns[key].label = Text(label + (arrow if key == self.sort_key else ""))
        for run in self.visible():
            table.add_row(
                plain(run.id),
                plain(run.name),
                plain(run.status, STATUS_STYLES.get(run.status, "")),
                plain(format_time(run.started_at_s)),
                plain(format_duration(elapsed_s(run))),
                plain(f"{run.device_name or '?'} ({run.device_kind})"),
                plain(format_bytes(run.peak_in_use_bytes)),
                plain(format_fraction(run.min_free_fraction)),
                plain(run.oom_count),
                plain(run.action_count),
                key=str(run.id),
            )
        if keep is not None and keep in table.rows:
            table.move_cursor(row=table.get_row_index(keep))
        header = f"runs in {self.tui.source.label}: {len(table.rows)} of {len(self.run_list)}"
        if self.filter_text:
            header += f"   filter: {self.filter_text!r}"
        self.query_one("#runs-header", Static).update(Text(header, style="bold"))

    def show_filter(self) -> None:
        """Show and focus the filter box."""
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.rebuild()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self) -> None:
        self.query_one("#runs", DataTable).focus()

    def action_clear_filter(self) -> None:
        """Clear and hide the filter."""
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.filter_text = ""
        self.rebuild()
        self.query_one("#runs", DataTable).focus()

    def sort_by(self, key: str) -> None:
        """Sort by column ``key``; the same key again reverses the order."""
        if key == self.sort_key:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_key = key
            self.sort_reverse = key in ("started", "peak", "ooms", "actions", "duration", "id")
        self.rebuild()

    def action_sort_next(self) -> None:
        """Sort by the next column."""
        keys = [k for k, _ in RUN_COLUMNS]
        self.sort_by(keys[(keys.index(self.sort_key) + 1) % len(keys)])

    @on(DataTable.HeaderSelected, "#runs")
    def _header_clicked(self, event: DataTable.HeaderSelected) -> None:
        self.sort_by(str(event.column_key.value))

    @on(DataTable.RowSelected, "#runs")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self.tui.open_run(event.row_key.value)


#: a daemon sample older than this is shown as stale (the daemon samples every second by default)
STALE_AFTER_S = 30.0
_BAR_WIDTH = 30


def usage_bar(fraction: float | None, width: int = _BAR_WIDTH) -> Text:
    """``fraction`` of ``width`` cells filled (green, yellow from 80 %, red from 95 %); an
    empty bar and ``N/A`` when unknown."""
    if fraction is None:
        return Text("░" * width + "  N/A", style="grey50")
    fraction = min(1.0, max(0.0, fraction))
    filled = round(fraction * width)
    style = "red" if fraction >= 0.95 else "yellow" if fraction >= 0.8 else "green"
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="grey35")
    bar.append(f" {100 * fraction:5.1f} %")
    return bar


def devices_renderable(data: Devices) -> Any:
    """The devices view's body: per GPU its bar, bytes, utilisation and processes table."""
    from rich.console import Group
    from rich.padding import Padding
    from rich.table import Table

    parts: list[Any] = []
    for dev in data.devices:
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f"GPU {dev.device_index}  ", style="bold")
        head.append(plain(dev.device_name or "name unknown"))
        head.append(f"  {dev.device_uuid}  on {dev.host}", style="grey62")
        line = Text("  memory ")
        line.append_text(usage_bar(dev.used_fraction))
        line.append(
            f"   used {format_bytes(dev.device_used_bytes)} of "
            f"{format_bytes(dev.device_total_bytes)}, free {format_bytes(dev.device_free_bytes)}"
        )
        util = Text("  utilisation: gpu ")
        util.append(format_fraction(dev.utilization_gpu_fraction))
        util.append("  memory ")
        util.append(format_fraction(dev.utilization_memory_fraction))
        parts += [head, line, util]
        if dev.process_count is None:
            parts.append(Text("  processes: N/A (NVML did not list them)", style="grey62"))
        elif not dev.processes:
            parts.append(Text("  no processes", style="grey62"))
        else:
            table = Table(box=None, padding=(0, 2), pad_edge=False, show_edge=False)
            for name in ("PID", "process", "kind", "memory", "run"):
                right = name in ("PID", "memory")
                table.add_column(name, justify="right" if right else "left")
            for proc in dev.processes:
                run = "" if proc.run_id is None else f"#{proc.run_id} {proc.run_name or ''}"
                table.add_row(
                    plain(proc.pid),
                    plain(proc.process_name or "N/A"),
                    plain(proc.kind),
                    plain(format_bytes(proc.process_device_bytes)),
                    plain(run.strip(), "green"),
                )
            parts.append(Padding(table, (0, 0, 0, 2)))
        parts.append(Text(""))
    if data.events:
        parts.append(Text("daemon events", style="bold"))
        for ev in data.events:
            row = Text(f"  {format_time(ev.time_s)}  ")
            row.append(f"{ev.kind:<20}", style=_DEVICE_EVENT_STYLES.get(ev.kind, ""))
            row.append(plain(ev.message))
            parts.append(row)
    return Group(*parts)


_DEVICE_EVENT_STYLES = {
    "device_lost": "bold red",
    "device_unavailable": "red",
    "nvml_unavailable": "red",
    "device_appeared": "green",
    "probe_unavailable": "grey62",
    "samples_dropped": "yellow",
}


class DevicesScreen(_PolledScreen):
    """Every GPU of the machine(s) and every process on it, from the latest sample of
    ``edo-monitor daemon`` (``d``): used/total bar, utilisation, and per process its memory
    and, for watched runs, the run. Read in a worker every refresh; the UI thread only draws."""

    def __init__(self) -> None:
        """Create the (empty) devices view."""
        super().__init__("devices-screen")
        self.data: Devices | None = None

    def compose(self) -> ComposeResult:
        """Lay out the view."""
        yield Static("devices", id="devices-header")
        with VerticalScroll(id="devices-box"):
            yield Static("reading…", id="devices-body")
        yield Footer()

    def on_mount(self) -> None:
        """Refresh every refresh interval while shown."""
        self.set_interval(self.tui.refresh_s, self.reload, name="devices-refresh")
        self.reload()

    def read(self, request: None) -> Devices:
        """The daemon's latest rows (worker thread)."""
        return self.tui.source.devices()

    @_while_shown
    def _show_error(self, message: str, code: int) -> None:
        self.busy = False
        self.error_code = code
        self.query_one("#devices-header", Static).update(Text("devices", style="bold"))
        self.query_one("#devices-body", Static).update(Text(message, style="bold red"))

    @_while_shown
    def _apply(self, request: None, data: Devices) -> None:
        self.busy = False
        self.loads += 1
        self.error_code = None
        self.data = data
        header = self.query_one("#devices-header", Static)
        body = self.query_one("#devices-body", Static)
        if not data.devices:
            header.update(Text(f"devices in {self.tui.source.label}", style="bold"))
            body.update(
                Text(
                    f"No GPU samples in {self.tui.source.label}. `edo-monitor daemon --db "
                    f"{self.tui.source.label}` records every GPU of a machine and every process "
                    "on it (docs/edo-monitor-daemon.service runs it as a service).",
                    style="bold",
                )
            )
            return
        newest = max(d.time_s for d in data.devices)
        age = max(0.0, data.read_at_s - newest)
        hosts = sorted({d.host for d in data.devices})
        text = Text(
            f"{len(data.devices)} GPU(s) on {', '.join(hosts)}: daemon sample of "
            f"{format_time(newest)} ({age:.0f} s ago)",
            style="bold",
        )
        if age > STALE_AFTER_S:
            text.append("  stale: is edo-monitor daemon running?", style="bold yellow")
        header.update(text)
        body.update(devices_renderable(data))


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
        below = value is not None and value < run_floor(rank.run)
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
    ("started", "started"),
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


class HelpScreen(ModalScreen[None]):
    """The keys, and what the chart shows. Any key closes it."""

    def compose(self) -> ComposeResult:
        """The help text in a box."""
        with VerticalScroll(id="help-box"):
            yield Static(HELP_TEXT, id="help-text")

    def on_key(self, event: Any) -> None:
        """Close on any key."""
        event.stop()
        event.prevent_default()
        self.dismiss()

    def on_click(self) -> None:
        """Close on a click."""
        self.dismiss()


class ExplainScreen(ModalScreen[None]):
    """What would have avoided the open run's OOMs and pressure crossings
    (:func:`edo_monitor.hindsight.explain`, rendered as ``edo-monitor explain`` prints it).

    Only the incident of ``event_id`` when it names one (the event selected in the run view),
    else every incident of the run. Read in a worker thread; arrows and page keys scroll; Escape
    or ``x`` closes.
    """

    BINDINGS = [  # noqa: RUF012
        Binding("escape", "close", "close"),
        Binding("x", "close", "close", show=False),
    ]

    def __init__(self, run: RunInfo, event_id: int | None = None) -> None:
        """Explain ``run`` (only the incident of ``event_id`` when given)."""
        super().__init__(id="explain-screen")
        self.run = run
        self.event_id = event_id
        #: the explanation shown (``None`` until read)
        self.result: Any = None
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        """A title line and the (scrollable) explanation."""
        with VerticalScroll(id="explain-box"):
            yield Static(
                Text(
                    f"what would have avoided each OOM and pressure crossing of run "
                    f"#{self.run.id} ({self.run.name})   Esc closes",
                    style="bold",
                ),
                id="explain-title",
            )
            yield Static(Text("reading…"), id="explain-text")

    def on_mount(self) -> None:
        """Start reading."""
        self._read()

    @work(thread=True, group="explain")
    def _read(self) -> None:
        from edo_monitor.hindsight.explain import explain

        app: EdoTui = self.app  # type: ignore[assignment]
        try:
            history = app.source.open()
            result = None
            if self.event_id is not None:
                try:
                    result = explain(history, self.run.id, event=self.event_id)
                except ConfigError:  # the selected event is not an incident: explain them all
                    result = None
            if result is None:
                result = explain(history, self.run.id)
        except READ_ERRORS as exc:
            _call_ui(self, self._show_error, _message_for(exc))
            return
        _call_ui(self, self._show, result)

    @_while_shown
    def _show(self, result: Any) -> None:
        from rich.console import Group

        from edo_monitor.hindsight.view import explain_renderables

        self.result = result
        self.query_one("#explain-text", Static).update(Group(*explain_renderables(result)))

    @_while_shown
    def _show_error(self, message: str) -> None:
        self.error = message
        self.query_one("#explain-text", Static).update(Text(message, style="bold red"))

    def action_close(self) -> None:
        """Close the view."""
        self.dismiss()
