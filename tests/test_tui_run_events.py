"""What the run view shows of a run's events and what its keys open from them: event times and
run durations rounded to the second, as ``edo-monitor show`` rounds them (not cut: 8.99 s was
``0:00:08`` beside show's ``t+9.0s``); ``m`` on an event without a memory snapshot (the cursor
starts on the newest event, which at a run's end is a ``lookup_frequency``) shows the run's
latest snapshot and says which event it is of.

Real ``watch()`` runs write a real SQLite file; the app runs headless with ``App.run_test`` and
a :class:`~textual.pilot.Pilot` (``tui_helpers``)."""

from __future__ import annotations

import math
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from textual.pilot import Pilot
from textual.widgets import DataTable, Static
from tui_helpers import REFRESH_S, run_app, screen_text, table_column, text_of, wait_for
from typer.testing import CliRunner
from watch_helpers import make_model, record_pressure_run, train

import edo_monitor
from edo_monitor.store.history import History
from edo_monitor.store.snapshot_store import snapshot_infos
from edo_monitor.surfaces.cli import app as cli
from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.snapshot_screen import SnapshotScreen


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run with a policy: a crossing, decisions and actions (snapshots at the crossing
    and before and after each action), and at its end ``lookup_frequency`` (none)."""
    db = tmp_path_factory.mktemp("events") / "h.db"
    record_pressure_run(db, "pressure", policy=edo_monitor.Policy())
    return db


def test_m_on_an_event_without_a_snapshot_shows_the_runs_latest(recorded: Path) -> None:
    """Was the error ``event 11 of run 1 has no memory snapshot (a lookup_frequency event)``
    where the help promises the run's latest."""
    with History(recorded) as h:
        newest = h.events(1)[-1]
        latest = snapshot_infos(h, 1)[-1]
    assert newest.kind == "lookup_frequency" and latest.event_id != newest.id
    app = EdoTui(recorded, run="1", refresh_s=REFRESH_S)
    seen: dict[str, Any] = {}

    async def body(pilot: Pilot[None]) -> None:
        screen = app.run_screen
        await wait_for(pilot, lambda: screen.loaded)
        assert screen.selected_event is not None and screen.selected_event.id == newest.id
        await pilot.press("m")
        shown = app.screen
        assert isinstance(shown, SnapshotScreen)
        await wait_for(pilot, lambda: shown.rows is not None or shown.error is not None)
        await pilot.pause()
        seen.update(error=shown.error, rows=shown.rows, text=screen_text(app))
        seen.update(event=getattr(shown, "shown_event_id", None), note=getattr(shown, "note", None))
        # an event with one: its own, no note
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen)
        row = next(i for i, e in enumerate(screen.event_rows) if e.kind == "threshold_crossed")
        screen.query_one("#events", DataTable).move_cursor(row=row, animate=False)
        crossing = screen.selected_event
        await pilot.press("m")
        own = app.screen
        assert isinstance(own, SnapshotScreen)
        await wait_for(pilot, lambda: own.rows is not None or own.error is not None)
        seen.update(own=(own.error, getattr(own, "shown_event_id", None), crossing.id))

    run_app(app, body)
    assert seen["error"] is None and seen["rows"]
    assert seen["event"] == latest.event_id
    assert seen["note"] == (
        f"event {newest.id} has no memory snapshot (only incidents have one); shown: the run's "
        f"latest, of event {latest.event_id} ({latest.event_kind}, step {latest.step})"
    )
    assert f"the run's latest (event {latest.event_id})" in seen["text"]
    assert f"snapshot {latest.id} of run 1, event {latest.event_id}" in seen["text"]
    error, event, crossing_id = seen["own"]
    assert error is None and event == crossing_id


def _started_at(db: Path) -> float:
    con = sqlite3.connect(db)
    try:
        return float(con.execute("SELECT started_at_s FROM runs").fetchone()[0])
    finally:
        con.close()


@pytest.fixture(scope="module")
def late_half(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run that ends 2.7 s after it started: its end-of-run events (``lookup_frequency``,
    ``table_spectrum``) and its duration are at about 2.7 s, in the second half of a second."""
    db = tmp_path_factory.mktemp("times") / "h.db"
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, opt, db=db, interval_s=0.05, run_name="late-half"):
        train(model, opt, 5)
        start = _started_at(db)  # the run's row is written on entering
        time.sleep(max(0.0, start + 2.7 - time.time()))
    return db


def _rounded(seconds: float) -> str:
    total = math.floor(seconds + 0.5)
    return f"0:{total // 60:02d}:{total % 60:02d}"


def test_event_times_and_durations_are_rounded_as_show_rounds_them(late_half: Path) -> None:
    with History(late_half) as h:
        run = h.run(1)
        events = h.events(1)
    offsets = {e.id: e.time_s - run.started_at_s for e in events}
    assert any(t % 1 >= 0.5 for t in offsets.values()), offsets  # where cutting differs
    assert run.ended_at_s is not None and (run.ended_at_s - run.started_at_s) % 1 >= 0.5
    res = CliRunner().invoke(cli, ["show", "1", "--db", str(late_half)])
    assert res.exit_code == 0, res.output
    shown = {int(i): float(t) for i, t in re.findall(r"│\s*(\d+)\s*│\s*([0-9.]+)s\s*│", res.output)}
    assert set(shown) == set(offsets)
    app = EdoTui(late_half, run="1", refresh_s=REFRESH_S)
    seen: dict[str, Any] = {}

    async def body(pilot: Pilot[None]) -> None:
        screen = app.run_screen
        await wait_for(pilot, lambda: screen.loaded)
        table = screen.query_one("#events", DataTable)
        ids = [e.id for e in screen.event_rows]
        seen["times"] = dict(zip(ids, table_column(table, 0), strict=True))
        seen["detail"] = text_of(screen.query_one("#event-detail", Static))
        seen["header"] = text_of(screen.query_one("#run-header", Static))
        await pilot.press("r")
        runs = app.runs_screen
        await wait_for(pilot, lambda: runs.loads > 0)
        seen["duration"] = table_column(runs.query_one("#runs", DataTable), 4)

    run_app(app, body)
    for event_id, t in offsets.items():
        assert seen["times"][event_id] == _rounded(t), (event_id, t, seen["times"][event_id])
        whole = int(seen["times"][event_id].rsplit(":", 1)[1])
        assert abs(whole - shown[event_id]) <= 0.55, (whole, shown[event_id])  # show's t+
    assert seen["detail"].startswith(_rounded(offsets[events[-1].id]) + "  step ")
    duration = _rounded(run.ended_at_s - run.started_at_s)
    assert seen["duration"] == [duration]
    assert f"elapsed: {duration}" in seen["header"]


def test_a_run_of_many_events_keeps_its_early_actions_on_the_chart(
    recorded: Path, tmp_path: Path
) -> None:
    """Regression: the view read the newest 1,000 events and drew the chart's marks from them,
    so an action (or OOM) older than that was on neither, with nothing saying rows were left
    out. Every action and OOM is charted now, and the events box says what it holds."""
    db = tmp_path / "many.db"
    with sqlite3.connect(recorded) as src, sqlite3.connect(db) as dst:
        src.backup(dst)
    with History(db) as h:
        actions = [e.id for e in h.events(1) if e.kind in ("action", "oom")]
        last = h.events(1)[-1]
    assert actions
    with sqlite3.connect(db) as con:  # 1,100 later events (forecasts) push them out
        con.executemany(
            "INSERT INTO events (run_id, time_s, step, kind, message, data) "
            "VALUES (1, ?, ?, 'forecast', 'later', '{}')",
            [(last.time_s + 0.001 * i, last.step) for i in range(1100)],
        )
        total = con.execute("SELECT count(*) FROM events WHERE run_id = 1").fetchone()[0]
    app = EdoTui(db, run="1", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        screen = app.run_screen
        await wait_for(pilot, lambda: screen.loaded)
        assert [e.id for e in screen.chart_events] == actions
        assert screen.query_one("#events", DataTable).row_count == 1000
        title = text_of(screen.query_one("#events-title", Static))
        assert title == f"events (the newest 1,000 of {total:,}: edo-monitor events 1 lists all)"

    run_app(app, body)
