"""Widgets of the dashboard: gauges, the memory chart, and small formatting helpers."""

from __future__ import annotations

import inspect
import logging
import math
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from rich.ansi import AnsiDecoder
from rich.console import Console
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static
from textual_plotext import Plot

from edo_monitor.store.records import EventInfo
from edo_monitor.tui.data import Series
from edo_monitor.units import format_utc

__all__ = [
    "FLOOR_RGB",
    "OOM_RGB",
    "STATUS_STYLES",
    "ChartData",
    "Gauge",
    "MemoryChart",
    "build_chart",
    "chart_legend",
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


#: Whether ``Static.update`` takes ``layout=`` (later Textual releases; not the lowest allowed,
#: 0.86.2, where the keyword was a TypeError that broke the run view).
_UPDATE_TAKES_LAYOUT = "layout" in inspect.signature(Static.update).parameters


def update_static(widget: Static, content: Text, *, layout: bool = False) -> None:
    """``widget.update(content)``, asking for a layout pass (costly: the whole screen) only when
    the rows ``content`` takes, wrapped at the widget's width, differ from the last update's, or
    when ``layout``, where Textual lets the caller say so; elsewhere always (the old default).
    Counting newlines alone left a header whose text wrapped one row tall (its status, step
    and follow note cut off)."""
    width = widget.content_region.width or max(20, widget.app.size.width - 2)
    rows = len(content.wrap(widget.app.console, width))
    changed = rows != _ROWS.get(widget)
    _ROWS[widget] = rows
    if _UPDATE_TAKES_LAYOUT:
        widget.update(content, layout=layout or changed)
    else:
        widget.update(content)


#: The rows of each widget's last :func:`update_static`.
_ROWS: weakref.WeakKeyDictionary[Static, int] = weakref.WeakKeyDictionary()


def plain(value: object, style: str = "") -> Text:
    """``value`` as text that is shown exactly as is: never parsed as Rich markup.

    Every string the dashboard did not write itself (run names, tags, event messages, module
    names, paths, error messages) goes through this before it reaches a widget: a ``str`` cell of
    a ``DataTable`` is parsed as markup, so ``bert[lr=1e-4]`` would lose its brackets and
    ``sweep[/bs64]`` would raise ``MarkupError``.
    """
    return Text(str(value), style=style, no_wrap=True, overflow="ellipsis")


def format_duration(seconds: float | None) -> str:
    """``3725`` → ``"1:02:05"``, rounded to the nearest second (halves up: ``8.99`` →
    ``"0:00:09"``, where ``edo-monitor show`` prints ``t+9.0s``); ``None`` (or not finite) →
    ``"N/A"``."""
    if seconds is None or not math.isfinite(seconds):
        return "N/A"
    total = math.floor(max(0.0, seconds) + 0.5)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_fraction(value: float | None) -> str:
    """``0.234`` → ``"23.4 %"``; ``None`` → ``"N/A"``."""
    return "N/A" if value is None else f"{100.0 * value:.1f} %"


def format_time(time_s: float | None) -> str:
    """Unix seconds → ``YYYY-MM-DD HH:MM:SS`` in UTC, as the CLI shows times (local time put
    the same run's start hours apart from ``edo-monitor runs``); ``None`` → ``"N/A"``."""
    return format_utc(time_s, missing="N/A")


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
        """The label and text on one line, or, when they do not fit the gauge's width (80
        columns: four gauges of about 18), the label on one and the text on the next; then the
        bar."""
        width = max(4, self.size.width - 2)
        text_style = "bold red" if self.warn else ""
        out = Text(no_wrap=True)
        if len(self.label) + 2 + len(self.text) <= width + 2:
            out.append(f"{self.label}: ", style="bold")
            out.append(self.text, style=text_style)
        else:
            head = Text(f"{self.label}:", style="bold")
            head.truncate(width + 2, overflow="ellipsis")
            value = Text(self.text, style=text_style)
            value.truncate(width + 2, overflow="ellipsis")
            out.append_text(head)
            out.append("\n")
            out.append_text(value)
        out.append("\n")
        filled = 0 if self.fraction is None else round(self.fraction * width)
        mark_at = None if self.mark is None else min(width - 1, int(self.mark * width))
        bar_style = "red" if self.warn else "green"
        for i in range(width):
            if i == mark_at:
                out.append("┃", style=f"bold {_rich(FLOOR_RGB)}")
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


RGB = tuple[int, int, int]
#: Colours of the chart (24-bit, so every terminal shows the same colour the legend names).
IN_USE_RGB: RGB = (80, 220, 60)  # green
ALLOCATED_RGB: RGB = (0, 200, 220)  # cyan
RESERVED_RGB: RGB = (70, 110, 255)  # blue
FLOOR_RGB: RGB = (255, 215, 0)  # yellow
ACTION_RGB: RGB = (255, 95, 215)  # magenta
OOM_RGB: RGB = (255, 40, 40)  # red


def _rich(rgb: RGB) -> str:
    return f"rgb({rgb[0]},{rgb[1]},{rgb[2]})"


@dataclass(frozen=True)
class ChartData:
    """What the chart draws, as an immutable snapshot (handed to a worker thread).

    ``time_s`` are seconds since the run started; byte columns may hold ``None`` (not available).
    ``floor_bytes`` is the in-use level at the policy's floor (``None``: no budget or no policy,
    no floor);
    ``actions`` are (seconds, the action's ``bytes_after``) of actions, drawn as a line with an
    x at the top, ``ooms`` the seconds of out-of-memory errors.
    """

    time_s: tuple[float, ...] = ()
    in_use: tuple[int | None, ...] = ()
    allocated: tuple[int | None, ...] = ()
    reserved: tuple[int | None, ...] = ()
    floor_bytes: int | None = None
    floor_fraction: float | None = None
    actions: tuple[tuple[float, int | None], ...] = ()
    ooms: tuple[float, ...] = ()

    @classmethod
    def of(
        cls,
        series: Series | None,
        *,
        start_s: float,
        floor_bytes: int | None,
        floor_fraction: float | None,
        events: Sequence[EventInfo] = (),
    ) -> ChartData:
        """Snapshot ``series`` (thread-safe) and the action and OOM events among ``events``."""
        actions = tuple(
            (
                e.time_s - start_s,
                _int_or_none(e.data.get("bytes_after") or e.data.get("bytes_before")),
            )
            for e in events
            if e.kind == "action"
        )
        ooms = tuple(e.time_s - start_s for e in events if e.kind == "oom")
        if series is None:
            return cls(
                floor_bytes=floor_bytes,
                floor_fraction=floor_fraction,
                actions=actions,
                ooms=ooms,
            )
        time_s, in_use, allocated, reserved = series.snapshot()
        return cls(
            tuple(t - start_s for t in time_s),
            tuple(in_use),
            tuple(allocated),
            tuple(reserved),
            floor_bytes,
            floor_fraction,
            actions,
            ooms,
        )


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def chart_legend(data: ChartData) -> Text:
    """The legend line: one entry per thing drawn, in its colour (never drawn over the plot)."""
    legend = Text(no_wrap=True, overflow="ellipsis")
    legend.append(" device memory   ", style="bold")
    for name, rgb, column in (
        ("in use", IN_USE_RGB, data.in_use),
        ("allocated", ALLOCATED_RGB, data.allocated),
        ("reserved", RESERVED_RGB, data.reserved),
    ):
        if any(v is not None for v in column):
            legend.append("█ ", style=_rich(rgb))
            legend.append(f"{name}   ")
    if data.floor_bytes is not None and data.floor_fraction is not None:
        legend.append("── ", style=_rich(FLOOR_RGB))
        legend.append(f"floor ({data.floor_fraction:.0%} free)   ")
    if data.actions:
        legend.append("│x ", style=_rich(ACTION_RGB))
        legend.append("action   ")
    if data.ooms:
        legend.append("│ OOM ", style=f"bold {_rich(OOM_RGB)}")
        legend.append("out of memory")
    if not data.time_s:
        legend.append("(no samples yet)", style="italic")
    return legend


def _fit(xs: Sequence[float], ys: Sequence[int | None], columns: int) -> tuple[list, list]:
    """At most ``columns`` points: the maximum of the points that fall in each column."""
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    if len(pts) <= columns or columns < 2:
        return [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = pts[0][0], pts[-1][0]
    scale = (columns - 1) / ((x1 - x0) or 1.0)
    out_x: list[float] = []
    out_y: list[int] = []
    last = -1
    for x, y in pts:
        col = int((x - x0) * scale)
        if col == last:
            if y > out_y[-1]:
                out_y[-1] = y
        else:
            out_x.append(x)
            out_y.append(y)
            last = col
    return out_x, out_y


def build_chart(data: ChartData, width: int, height: int) -> list[Strip]:
    """Draw ``data`` into ``height`` lines of ``width`` cells: the legend, then the plot.

    Pure and thread-safe (its own plotext figure and Rich console), so it runs in a worker
    thread and the UI thread only shows the lines. Colours are 24-bit (:data:`FLOOR_RGB` …).
    """
    width, height = max(20, width), max(4, height)
    console = Console(
        width=width, height=height, color_system="truecolor", force_terminal=True, no_color=False
    )
    options = console.options.update(width=width, no_wrap=True, overflow="crop")
    lines = [Strip(console.render_lines(chart_legend(data), options, pad=True)[0], width)]
    if not data.time_s:
        return lines
    plt = Plot()
    plt.theme("clear")
    plt.plotsize(width, height - 1)
    plt._set_size(width, height - 1)  # as textual-plotext's own widget does (its issue #5)
    values = [v for v in (*data.in_use, *data.reserved) if v is not None]
    top = max([*values, data.floor_bytes or 0, 1])
    unit, size = _unit(top)
    plt.ylabel(unit)
    plt.xlabel("elapsed (s)")
    columns = max(2, width - 10)
    for column, rgb in (
        (data.reserved, RESERVED_RGB),
        (data.allocated, ALLOCATED_RGB),
        (data.in_use, IN_USE_RGB),
    ):
        xs, ys = _fit(data.time_s, column, columns)
        if xs:
            plt.plot(xs, [y / size for y in ys], color=rgb, marker="sd")
    if data.floor_bytes is not None:
        plt.hline(data.floor_bytes / size, FLOOR_RGB)
    for x, _ in data.actions:
        plt.vline(x, ACTION_RGB)
    if data.actions:  # an x at the top of each action's line
        plt.scatter(
            [x for x, _ in data.actions],
            [top / size] * len(data.actions),
            marker="x",
            color=ACTION_RGB,
        )
    for x in data.ooms:
        plt.vline(x, OOM_RGB)
        plt.text("OOM", x, top / size, color=OOM_RGB, alignment="right")
    x_end = max([*data.time_s, *(x for x, _ in data.actions), *data.ooms])
    plt.xlim(0.0, x_end * 1.02 or 1.0)  # a mark at the last sample stays inside the frame
    lines.extend(ansi_strips(plt.build(), width))
    return lines[:height]


_SGR = re.compile(r"\x1b\[([0-9;]*)m")
_SGR_CACHE: dict[tuple[Style, str], Style] = {}


def ansi_strips(ansi: str, width: int) -> list[Strip]:
    """The lines of ``ansi`` (text with SGR colour codes, as plotext's ``build()`` prints it) as
    strips of exactly ``width`` cells (cropped or padded).

    The same as ``console.render_lines(Text.from_ansi(ansi), …, pad=True)`` for plotext's output,
    which only uses SGR sequences, in about a third of the time: each ``(style, code)`` step is
    decoded once by Rich's own :class:`~rich.ansi.AnsiDecoder` and then looked up (a chart holds
    a few dozen distinct codes but thousands of them). Thread-safe (the cache only grows).
    """
    decoder = AnsiDecoder()
    null = Style.null()
    strips = []
    for line in ansi.splitlines():
        style = null
        segments = []
        pos = 0
        for m in _SGR.finditer(line):
            if m.start() > pos:
                segments.append(Segment(line[pos : m.start()], style or None))
            key = (style, m.group(1))
            nxt = _SGR_CACHE.get(key)
            if nxt is None:
                decoder.style = style
                decoder.decode_line(m.group(0))
                nxt = _SGR_CACHE[key] = decoder.style
            style = nxt
            pos = m.end()
        if pos < len(line):
            segments.append(Segment(line[pos:], style or None))
        strips.append(Strip(Segment.simplify(segments)).crop_extend(0, width, None))
    return strips


class MemoryChart(Widget):
    """In-use, allocated and reserved bytes over elapsed time, the floor line, actions and
    out-of-memory errors, with a legend line above the plot.

    The lines are built off the UI thread (:func:`build_chart`, by the screen's workers) and
    handed over with :meth:`set_lines`; :meth:`render_line` only returns them. When the widget's
    size no longer matches the lines, it asks for new ones (:attr:`wanted_size`).
    """

    DEFAULT_CSS = """
    MemoryChart { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        """Create an empty chart."""
        super().__init__(id=id)
        self.data = ChartData()
        self.lines: list[Strip] = []
        self.lines_size: tuple[int, int] = (0, 0)
        self.points = 0
        self.action_count = 0
        self.oom_count = 0
        self.builds = 0

    @property
    def wanted_size(self) -> tuple[int, int]:
        """The size to build lines for: the widget's content size now."""
        return self.size.width, self.size.height

    def set_lines(self, data: ChartData, lines: list[Strip], size: tuple[int, int]) -> None:
        """Show ``lines`` (built by :func:`build_chart` from ``data`` at ``size``)."""
        self.data = data
        self.lines = lines
        self.lines_size = size
        self.points = len(data.time_s)
        self.action_count = len(data.actions)
        self.oom_count = len(data.ooms)
        self.builds += 1
        self.refresh()
        if size != self.wanted_size and self.size.area:
            self.post_message(self.Stale(self))  # built for a size the widget no longer has

    def on_resize(self) -> None:
        """Ask the screen for lines of the new size."""
        if self.lines_size != self.wanted_size:
            self.post_message(self.Stale(self))

    class Stale(Message):
        """The chart's lines do not fit its size any more."""

        def __init__(self, chart: MemoryChart) -> None:
            """For ``chart``."""
            super().__init__()
            self.chart = chart

    def render_line(self, y: int) -> Strip:
        """Line ``y`` of the last lines built, on the widget's background."""
        if y < len(self.lines):
            return self.lines[y].crop_extend(0, self.size.width, None).apply_style(self.rich_style)
        return Strip.blank(self.size.width, self.rich_style)
