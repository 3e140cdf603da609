"""The dashboard's devices view (``d``) over a real SQLite file written by the daemon (its real
writer, fed by the fake NVML), with a watched run of this process: Textual's ``run_test`` Pilot."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import psutil
import torch
from fakes.nvml import FakeGpu, FakeNvml
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Static
from tui_helpers import REFRESH_S, run_app, text_of, wait_for

import edo_monitor
from edo_monitor.store.history import History
from edo_monitor.surfaces.daemon import Daemon
from edo_monitor.tui.app import EXIT_OK, EdoTui
from edo_monitor.tui.devices_screen import DevicesScreen, usage_bar
from edo_monitor.tui.run_screen import RunScreen
from edo_monitor.tui.runs_screen import RunsScreen
from edo_monitor.units import format_bytes

U0 = "GPU-11111111-aaaa-bbbb-cccc-000000000000"
U1 = "GPU-22222222-aaaa-bbbb-cccc-000000000001"
ME = os.getpid()


def shown(widget: Static) -> str:
    """The text a Static shows, rendered at its width (a Group of tables included)."""
    console = Console(width=max(40, widget.size.width), file=io.StringIO(), record=True)
    console.print(widget.content)
    return console.export_text()


def _daemon_db(path: Path) -> tuple[Daemon, list[FakeGpu], int]:
    """Two GPUs, this process on GPU 0 inside a watched run; one daemon sample written."""
    gpus = [
        FakeGpu(U0, used=12_000_000_000, reserved=0, processes=[(ME, 3_000_000_000)]),
        FakeGpu(U1, name="NVIDIA A100", total=80_000_000_000, used=0, reserved=0, mig=True),
    ]
    daemon = Daemon(path, nvml=FakeNvml(gpus), interval_s=1.0, flush_interval_s=0.05)
    daemon.start()
    model = torch.nn.Embedding(100, 4)
    with edo_monitor.watch(model, db=path, interval_s=0.05, run_name="bert-pretrain") as mon:
        daemon.sample()
        time.sleep(0.3)  # the daemon's writer links the process to the running run
    return daemon, gpus, mon.run_id  # type: ignore[return-value]


def test_devices_view_shows_gpus_processes_and_runs_live(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    daemon, gpus, run_id = _daemon_db(path)
    app = EdoTui(path, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: app.run_screen.loaded)
        await pilot.press("d")
        screen = app.devices_screen
        assert app.screen is screen and isinstance(screen, DevicesScreen)
        await wait_for(pilot, lambda: screen.loads >= 1)
        header = text_of(screen.query_one("#devices-header", Static))
        assert header.startswith("2 GPU(s) on ") and "s ago)" in header
        text = shown(screen.query_one("#devices-body", Static))
        assert "GPU 0  NVIDIA H200" in text and "GPU 1  NVIDIA A100" in text
        assert str(usage_bar(0.08)) in text  # 12 GB of 150 GB
        assert f"used {format_bytes(12_000_000_000)} of {format_bytes(150_000_000_000)}" in text
        assert "gpu 50.0 %  memory 20.0 %" in text
        proc_line = next(line for line in text.splitlines() if str(ME) in line)
        assert psutil.Process().name() in proc_line and format_bytes(3_000_000_000) in proc_line
        assert f"#{run_id} bert-pretrain" in proc_line
        # the MIG device: no utilisation, no process list (N/A, not zero)
        gpu1 = text[text.index("GPU 1") :]
        assert "gpu N/A  memory N/A" in gpu1 and "processes: N/A" in gpu1
        assert "device_appeared" in text  # the daemon's events
        # live: the daemon's next sample shows up without a key press
        gpus[0].used = 141_000_000_000
        gpus[0].processes = [(ME, 3_000_000_000), (1, 500)]
        daemon.sample()
        await wait_for(pilot, lambda: "94.0 %" in shown(screen.query_one("#devices-body", Static)))
        text = shown(screen.query_one("#devices-body", Static))
        assert format_bytes(141_000_000_000) in text
        assert next(line for line in text.splitlines() if str(ME) in line).count("#") == 0
        # the run has ended since: this sample's row of this PID is linked to nothing
        # from any view: runs, then devices again, then the live view
        await pilot.press("r")
        assert isinstance(app.screen, RunsScreen)
        await pilot.press("d")
        assert app.screen is screen
        await pilot.press("l")
        assert isinstance(app.screen, RunScreen)
        await pilot.press("d")
        await pilot.press("q")

    run_app(app, body)
    daemon.close()
    assert app.exit_code == EXIT_OK
    with History(path) as h:  # what the view read, through the API
        devices = h.devices()
        assert [(d.device_index, d.device_uuid, d.process_count) for d in devices] == [
            (0, U0, 2),
            (1, U1, None),
        ]
        assert [(p.pid, p.run_id) for p in devices[0].processes] == [(ME, None), (1, None)]
        linked = [e for e in h.device_events() if e.kind == "device_appeared"]
        assert [e.device_uuid for e in linked] == [U0, U1]


def test_devices_view_without_daemon_rows_says_how_to_get_them(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    model = torch.nn.Embedding(10, 2)
    with edo_monitor.watch(model, db=path, interval_s=0.05):
        pass
    app = EdoTui(path, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await pilot.press("d")
        screen = app.devices_screen
        await wait_for(pilot, lambda: screen.loads >= 1)
        text = shown(screen.query_one("#devices-body", Static))
        assert "No GPU samples in" in text and "edo-monitor daemon --db" in text

    run_app(app, body)
    assert app.exit_code == EXIT_OK
