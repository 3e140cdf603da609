"""What the run view shows of a run's events and what its keys open from them: ``m`` on an event
without a memory snapshot (the cursor starts on the newest event, which at a run's end is a
``lookup_frequency``) shows the run's latest snapshot and says which event it is of.

Real ``watch()`` runs write a real SQLite file; the app runs headless with ``App.run_test`` and
a :class:`~textual.pilot.Pilot` (``tui_helpers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable
from tui_helpers import REFRESH_S, run_app, screen_text, wait_for
from watch_helpers import record_pressure_run

import edo_monitor
from edo_monitor.store.history import History
from edo_monitor.store.snapshot_store import snapshot_infos
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
