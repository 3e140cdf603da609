"""The list of recorded runs: sortable, filterable, opened with enter."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Input, Static

from edo_monitor.store.records import RunInfo
from edo_monitor.tui.base import _PolledScreen, _while_shown
from edo_monitor.tui.data import elapsed_s
from edo_monitor.tui.widgets import (
    STATUS_STYLES,
    format_duration,
    format_fraction,
    format_time,
    plain,
)
from edo_monitor.units import format_bytes

#: Columns of the runs table: (key, label).
RUN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "id"),
    ("name", "name"),
    ("status", "status"),
    ("started", "started (UTC)"),
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
