"""The dashboard's modal screens: the keys (?) and explain (x) for the shown run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from edo_monitor.errors import ConfigError
from edo_monitor.store.records import RunInfo

if TYPE_CHECKING:
    from edo_monitor.tui.base import Dashboard
from edo_monitor.tui.base import _call_ui, _guarded, _while_shown

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
  [b]m[/b]        memory snapshot of the selected event (of the run's latest when that
           event has none, the view naming its event): its largest live blocks by
           frame (module); Esc closes
  [b]?[/b]        this help
  [b]q[/b]        quit

The chart shows in-use (green), allocated (cyan) and reserved (blue) bytes over
elapsed seconds; the yellow line is the floor (the in-use level at which free
memory falls below the policy's floor; none without a budget or without a
policy, and then no gauge turns red either), magenta lines and x are actions,
red lines marked OOM are out-of-memory errors. The legend is the line above the
plot. Values not available from a source are shown as N/A, never as zero.
Events: the whole detail of the selected event is shown below the table.

Press any key to close."""


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
    else every incident of the run. Read and rendered in a worker thread (an error, bad data in
    the history among them, is the view's one red line); arrows and page keys scroll; Escape
    or ``x`` closes.
    """

    BINDINGS = [  # noqa: RUF012
        Binding("escape", "close", "close"),
        Binding("x", "close", "close", show=False),
        Binding("q", "app.quit", "quit", show=False),  # as the help says, from any view
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
        from rich.console import Group

        from edo_monitor.hindsight.explain import explain
        from edo_monitor.hindsight.view import explain_renderables

        app: Dashboard = self.app  # type: ignore[assignment]

        def body() -> None:
            history = app.source.open()
            result = None
            if self.event_id is not None:
                try:
                    result = explain(history, self.run.id, event=self.event_id)
                except ConfigError:  # the selected event is not an incident: explain them all
                    result = None
            if result is None:
                result = explain(history, self.run.id)
            _call_ui(self, self._show, result, Group(*explain_renderables(result)))

        _guarded(self, self._show_error, body)

    @_while_shown
    def _show(self, result: Any, shown: Any) -> None:
        self.result = result
        self.query_one("#explain-text", Static).update(shown)

    @_while_shown
    def _show_error(self, message: str, code: int) -> None:
        self.error = message
        self.query_one("#explain-text", Static).update(Text(message, style="bold red"))

    def action_close(self) -> None:
        """Close the view."""
        self.dismiss()
