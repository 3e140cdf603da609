"""Widgets of the dashboard: gauges, the memory chart, and small formatting helpers."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence

from rich.text import Text
from textual.widget import Widget
from textual_plotext import PlotextPlot

from .data import EventInfo, Series

__all__ = [
    "STATUS_STYLES",
    "Gauge",
    "MemoryChart",
    "format_duration",
    "format_fraction",
    "format_time",
    "plain",
]

logger = logging.getLogger(__name__)

#: Rich styles of each run status.
STATUS_STYLES = {
    "running": "bold green",
    "finished": "bold cyan",
    "failed": "bold red",
    "interrupted": "bold yellow",
    "crashed": "bold white on red",
}


def plain(value: object, style: str = "") -> Text:
    """``value`` as text that is shown exactly as is: never parsed as Rich markup.

    Every string the dashboard did not write itself (run names, tags, event messages, module
    names, paths, error messages) goes through this before it reaches a widget: a ``str`` cell of
    a ``DataTable`` is parsed as markup, so ``bert[lr=1e-4]`` would lose its brackets and
    ``sweep[/bs64]`` would raise ``MarkupError``.
    """
    return Text(str(value), style=style, no_wrap=True, overflow="ellipsis")


def format_duration(seconds: float | None) -> str:
    """``3725`` → ``"1:02:05"``; ``None`` → ``"N/A"``."""
    if seconds is None:
        return "N/A"
    total = int(max(0.0, seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_fraction(value: float | None) -> str:
    """``0.234`` → ``"23.4 %"``; ``None`` → ``"N/A"``."""
    return "N/A" if value is None else f"{100.0 * value:.1f} %"


def format_time(time_s: float | None) -> str:
    """Unix seconds → local ``YYYY-MM-DD HH:MM:SS``; ``None`` → ``"N/A"``."""
    if time_s is None:
        return "N/A"
    return dt.datetime.fromtimestamp(time_s).strftime("%Y-%m-%d %H:%M:%S")


class Gauge(Widget):
    """A labelled horizontal bar: a fraction, a text, and optionally a marker (the floor).

    ``fraction=None`` draws an empty bar and ``N/A``: a reading that is not available is shown as
    such, never as zero.
    """

    DEFAULT_CSS = """
    Gauge { height: 3; width: 1fr; padding: 0 1; }
    """

    def __init__(self, label: str, *, id: str | None = None) -> None:
        """Create an empty gauge called ``label``."""
        super().__init__(id=id)
        self.label = label
        self.fraction: float | None = None
        self.text = "N/A"
        self.mark: float | None = None
        self.warn = False

    def set(
        self,
        fraction: float | None,
        text: str,
        *,
        mark: float | None = None,
        warn: bool = False,
    ) -> None:
        """Show ``fraction`` (0..1, clipped) with ``text``; ``mark`` draws a ``│`` there."""
        self.fraction = None if fraction is None else min(1.0, max(0.0, fraction))
        self.text = text
        self.mark = mark
        self.warn = warn
        self.refresh()

    def render(self) -> Text:
        """Two lines: the label and text, then the bar."""
        width = max(4, self.size.width - 2)
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f"{self.label}: ", style="bold")
        head.append(self.text, style="bold red" if self.warn else "")
        head.truncate(width + 2, overflow="ellipsis")
        out = Text(no_wrap=True)
        out.append_text(head)
        out.append("\n")
        filled = 0 if self.fraction is None else round(self.fraction * width)
        mark_at = None if self.mark is None else min(width - 1, int(self.mark * width))
        bar_style = "red" if self.warn else "green"
        for i in range(width):
            if i == mark_at:
                out.append("┃", style="bold yellow")
            elif i < filled:
                out.append("█", style=bar_style)
            else:
                out.append("░", style="grey37")
        return out


def _unit(max_bytes: float) -> tuple[str, float]:
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if max_bytes >= size:
            return name, float(size)
    return "B", 1.0


class MemoryChart(PlotextPlot):
    """In-use, allocated and reserved bytes over elapsed time, the floor line and actions."""

    def __init__(self, *, id: str | None = None) -> None:
        """Create an empty chart."""
        super().__init__(id=id)
        self.points = 0
        self.action_count = 0
        #: plotext marker of the lines: "sd" (one character per cell) draws in half the time
        #: of plotext's default "hd" (2x2 per cell), which keeps a refresh under 50 ms.
        self.marker = "sd"

    def show(
        self,
        series: Series | None,
        *,
        start_s: float,
        floor_bytes: int | None,
        actions: Sequence[EventInfo] = (),
    ) -> None:
        """Redraw with ``series``; ``floor_bytes`` is the in-use level at the floor."""
        plt = self.plt
        plt.clear_figure()
        plt.title("device memory (yellow line: the floor; x: actions)")
        plt.xlabel("elapsed (s)")
        self.points = 0 if series is None else len(series)
        self.action_count = len(actions)
        if series is None or not len(series):
            plt.title("device memory (no samples yet)")
            self.refresh()
            return
        values = [v for v in (*series.in_use, *series.reserved) if v is not None]
        top = max([*values, floor_bytes or 0, 1])
        unit, size = _unit(top)
        plt.ylabel(unit)
        xs = [t - start_s for t in series.time_s]
        for label, data, color in (
            ("reserved", series.reserved, "blue"),
            ("allocated", series.allocated, "cyan"),
            ("in use", series.in_use, "green"),
        ):
            pts = [(x, v / size) for x, v in zip(xs, data, strict=True) if v is not None]
            if pts:
                plt.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    label=label,
                    color=color,
                    marker=self.marker,
                )
        if floor_bytes is not None:
            plt.hline(floor_bytes / size, "yellow")
        for event in actions:
            plt.vline(event.time_s - start_s, "red")
        if actions:
            ax = [e.time_s - start_s for e in actions]
            ay = [
                (e.data.get("bytes_after") or e.data.get("bytes_before") or 0) / size
                for e in actions
            ]
            plt.scatter(ax, ay, marker="x", color="red", label="action")
        self.refresh()
