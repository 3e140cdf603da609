"""What the run view shows of one event and of a run's chart: each event kind's colour, an
event's detail (its table cell cut at a word boundary, the whole line shown below the table), the
bytes an action saved, and the chart's snapshot of a run (its floor line from the run's budget).
Pure functions and one renderable; the screen itself is :mod:`edo_monitor.tui.run_screen`."""

from __future__ import annotations

from typing import Any

from rich.measure import Measurement
from rich.text import Text

from edo_monitor.store.records import EventInfo, RunInfo
from edo_monitor.tui.data import Latest, Series, run_floor
from edo_monitor.tui.widgets import ChartData
from edo_monitor.units import format_bytes

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


def _format_saved(event: EventInfo) -> str:
    saved = event.data.get("saved_bytes") if event.kind == "action" else None
    return format_bytes(saved) if isinstance(saved, (int, float)) else ""


def _chart_data(
    run: RunInfo, series: Series | None, latest: Latest | None, events: tuple[EventInfo, ...]
) -> ChartData:
    """The chart's snapshot of ``run``: no floor line without a budget or without a policy."""
    budget = latest.budget_bytes if latest is not None else run.budget_bytes
    floor = run_floor(run) if budget is not None else None
    return ChartData.of(
        series,
        start_s=run.started_at_s,
        floor_bytes=None if floor is None or budget is None else int(budget * (1.0 - floor)),
        floor_fraction=floor,
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
