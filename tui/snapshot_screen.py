"""The memory snapshot of an event: its largest live blocks by frame (``m`` in the run view).

The selected event's snapshot (``edo-monitor snapshot RUN --event N --top 15``); when no event
is selected, or the selected one has none (a decision, a ``lookup_frequency`` …: only incidents
have one), the open run's latest (``edo-monitor snapshot RUN``), the view saying which event it is
of. Read and rendered in a worker thread (an error, bad data in the history among them, is the
view's one red line). Escape or ``m`` closes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from edo_monitor.store.records import RunInfo
from edo_monitor.tui.base import _call_ui, _guarded, _while_shown

if TYPE_CHECKING:
    from edo_monitor.tui.base import Dashboard

__all__ = ["TOP_FRAMES", "SnapshotScreen"]

#: frames shown
TOP_FRAMES = 15


class SnapshotScreen(ModalScreen[None]):
    """The largest live blocks by frame of one incident's memory snapshot.

    Attributes:
        rows: the :class:`~edo_monitor.measure.snapshots.FrameRow` rows shown (``None`` until read).
        shown_event_id: the event whose snapshot is shown (``None`` until read).
        note: why it is not the selected event's (``None``: it is, or none was selected).
        error: the one-line reason nothing is shown (no snapshot, damaged blob …).
    """

    DEFAULT_CSS = """
    SnapshotScreen { align: center middle; }
    #snapshot-box {
        width: 95%; height: 90%; border: round $accent; background: $surface; padding: 0 1;
    }
    """
    BINDINGS = [  # noqa: RUF012
        Binding("escape", "close", "close"),
        Binding("m", "close", "close", show=False),
        Binding("q", "app.quit", "quit", show=False),  # as the help says, from any view
    ]

    def __init__(self, run: RunInfo, event_id: int | None = None) -> None:
        """The snapshot of ``event_id`` of ``run`` (``None``: the run's latest)."""
        super().__init__(id="snapshot-screen")
        self.run = run
        self.event_id = event_id
        self.rows: list[Any] | None = None
        self.shown_event_id: int | None = None
        self.note: str | None = None
        self.error: str | None = None

    def _title(self, which: str) -> Text:
        return Text(
            f"memory snapshot of run #{self.run.id} ({self.run.name}), {which}   Esc closes",
            style="bold",
        )

    def compose(self) -> ComposeResult:
        """A title line and the (scrollable) table."""
        with VerticalScroll(id="snapshot-box"):
            which = f"event {self.event_id}" if self.event_id is not None else "the run's latest"
            yield Static(self._title(which), id="snapshot-title")
            yield Static(Text("reading…"), id="snapshot-text")

    def on_mount(self) -> None:
        """Start reading."""
        self._read()

    @work(thread=True, group="snapshot")
    def _read(self) -> None:
        from edo_monitor.measure.snapshots import SnapshotError, top_by_frame, totals
        from edo_monitor.store.snapshot_store import find_snapshot, load_snapshot
        from edo_monitor.surfaces.cli.snapshot import describe, top_table

        app: Dashboard = self.app  # type: ignore[assignment]

        def body() -> None:
            history = app.source.open()
            note = None
            try:
                info = find_snapshot(history, self.run.id, self.event_id)
            except SnapshotError:  # the event has none (the run none either: raised below)
                if self.event_id is None:
                    raise
                info = find_snapshot(history, self.run.id)  # the run's latest
                note = (
                    f"event {self.event_id} has no memory snapshot (only incidents have one); "
                    f"shown: the run's latest, of event {info.event_id} "
                    f"({info.event_kind or '?'}, step {info.step})"
                )
            snap = load_snapshot(history, info)
            rows = top_by_frame(snap, TOP_FRAMES)
            parts: list[Any] = [Text(note, style="yellow")] if note is not None else []
            parts += [Text(describe(info, snap)), top_table(rows, totals(snap).allocated_bytes)]
            _call_ui(self, self._show, rows, info.event_id, note, Group(*parts))

        _guarded(self, self._show_error, body)

    @_while_shown
    def _show(self, rows: list[Any], event_id: int | None, note: str | None, shown: Any) -> None:
        self.rows = rows
        self.shown_event_id = event_id
        self.note = note
        if event_id != self.event_id:  # the run's latest: the title says of which event
            self.query_one("#snapshot-title", Static).update(
                self._title(f"the run's latest (event {event_id})")
            )
        self.query_one("#snapshot-text", Static).update(shown)

    @_while_shown
    def _show_error(self, message: str, code: int) -> None:
        self.error = message
        self.query_one("#snapshot-text", Static).update(Text(message, style="bold red"))

    def action_close(self) -> None:
        """Close the view."""
        self.dismiss()
