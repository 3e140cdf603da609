"""The live view of one run: memory chart, events table and the selected event's detail, polled
from the history while the run goes on (following a newer run when asked)."""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.strip import Strip
from textual.widgets import DataTable, Footer, Static

from edo_monitor.store.records import EventInfo, ModuleInfo, RunInfo
from edo_monitor.tui.data import TERMINAL_STATUSES, Latest, Poll, Series, elapsed_s, run_floor
from edo_monitor.tui.run_format import (
    _EVENT_STYLES,
    _chart_data,
    _Detail,
    _event_detail,
    _format_saved,
)
from edo_monitor.tui.widgets import (
    STATUS_STYLES,
    ChartData,
    Gauge,
    MemoryChart,
    build_chart,
    format_duration,
    format_fraction,
    plain,
    update_static,
)
from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    from edo_monitor.tui.base import Dashboard
from edo_monitor.tui.base import _call_ui, _guarded, _while_shown

logger = logging.getLogger(__name__)


#: Columns of the events table.
_EVENT_COLUMNS = ("time", "step", "kind", "detail", "saved")


#: Event kinds drawn on the chart.
_CHARTED = frozenset({"action", "oom"})


#: Events shown of a run (the newest).
_MAX_EVENT_ROWS = 1000


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

    @property
    def tui(self) -> Dashboard:
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
            yield Static("events", classes="box-title", id="events-title")
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
    ) -> tuple[
        Series,
        Latest | None,
        list[EventInfo],
        list[ModuleInfo],
        ChartData,
        list[Strip],
        tuple[EventInfo, ...],
        int,
    ]:
        """Everything the view shows of ``run`` (worker thread): the newest
        :data:`_MAX_EVENT_ROWS` events in the table, every OOM and action on the chart (an
        early one was lost with the rows left out), and how many events the run has."""
        source = self.tui.source
        series = source.series(run, max_points)
        latest = source.latest(run)
        every = source.events(run.id)
        charted = tuple(e for e in every if e.kind in _CHARTED)
        modules = source.modules(run.id)
        data = _chart_data(run, series, latest, charted)
        lines = build_chart(data, *size)
        return series, latest, every[-_MAX_EVENT_ROWS:], modules, data, lines, charted, len(every)

    @work(thread=True, group="run-read")
    def _load(
        self, generation: int, run_ref: str | None, max_points: int, size: tuple[int, int]
    ) -> None:
        source = self.tui.source

        def body() -> None:
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
            _call_ui(self, self._apply_load, generation, run, *read, size, None)

        _guarded(self, partial(self._show_error, generation), body)

    @work(thread=True, group="run-read")
    def _follow(
        self, generation: int, shown: RunInfo, size: tuple[int, int], max_points: int
    ) -> None:
        """The shown run is not running: open the newest running run if it is newer, else go
        on as :meth:`tick` would (poll a crashed run; nothing for a finished one)."""
        source = self.tui.source

        def body() -> None:
            run = source.resolve(None)
            if run is not None and run.status == "running" and run.id > shown.id:
                read = self._read_run(run, max_points, size)
                _call_ui(self, self._apply_load, generation, run, *read, size, shown)
            elif shown.status not in TERMINAL_STATUSES:
                self._poll_now(generation, shown.id, size)
            else:
                _call_ui(self, self._follow_idle, generation)

        _guarded(self, partial(self._show_error, generation), body)

    @work(thread=True, group="run-read")
    def _poll(self, generation: int, run_id: int, size: tuple[int, int]) -> None:
        _guarded(
            self,
            partial(self._show_error, generation),
            partial(self._poll_now, generation, run_id, size),
        )

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
        def body() -> None:
            lines = build_chart(data, *size)
            _call_ui(self, self._apply_chart, generation, data, lines, size)

        _guarded(self, partial(self._show_error, generation), body)

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
        charted: tuple[EventInfo, ...],
        total_events: int,
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
        self.chart_events = charted
        left_out = total_events - len(events)
        self.query_one("#events-title", Static).update(
            f"events (the newest {len(events):,} of {total_events:,}: edo-monitor events "
            f"{run.id} lists all)"
            if left_out > 0
            else "events"
        )
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
                plain(event.step_shown),
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
        update_static(box, text, layout=not box.display)
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
        update_static(self.query_one("#run-header", Static), header)

    def _update_gauges(self) -> None:
        run = self.run_info
        s = self.latest
        floor = run_floor(run) if run is not None else None  # None: no policy, no floor
        used = self.query_one("#gauge-used", Gauge)
        alloc = self.query_one("#gauge-alloc", Gauge)
        free = self.query_one("#gauge-free", Gauge)
        frag = self.query_one("#gauge-frag", Gauge)
        if s is None:
            for gauge in (used, alloc, free, frag):
                gauge.set(None, "N/A (no samples yet)")
            return
        low = floor is not None and s.free_fraction is not None and s.free_fraction < floor
        if s.in_use_bytes is not None and s.budget_bytes:
            used.set(
                s.in_use_bytes / s.budget_bytes,
                f"{format_bytes(s.in_use_bytes)} / {format_bytes(s.budget_bytes)}",
                mark=None if floor is None else 1.0 - floor,
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
        elif floor is None:  # no policy: no floor to mark or to colour by
            free.set(s.free_fraction, f"{format_fraction(s.free_fraction)} (no policy: no floor)")
        else:
            free.set(
                s.free_fraction,
                f"{format_fraction(s.free_fraction)} (floor {format_fraction(floor)})",
                mark=floor,
                warn=low,
            )
        frag.set(s.fragmentation, format_fraction(s.fragmentation))
