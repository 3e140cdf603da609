"""The devices view (d): every GPU the daemon samples, its processes and the runs they belong to."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from edo_monitor.tui.base import _PolledScreen, _while_shown
from edo_monitor.tui.data import (
    Devices,
)
from edo_monitor.tui.widgets import (
    format_fraction,
    format_time,
    plain,
)
from edo_monitor.units import format_bytes

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
        parts.append(Text("daemon events (UTC)", style="bold"))
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
            f"{format_time(newest)} UTC ({age:.0f} s ago)",
            style="bold",
        )
        if age > STALE_AFTER_S:
            text.append("  stale: is edo-monitor daemon running?", style="bold yellow")
        header.update(text)
        body.update(devices_renderable(data))
