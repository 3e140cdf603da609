"""Bad data in a history never ends the dashboard: whatever a view's background work raises (not
only the read errors it expects: a ``ValueError`` or ``TypeError`` from a value of the wrong type
that a reader or the view trips on) is that view's error line, ``internal error (…)``, and the app
goes on (quitting then exits 3, as ``edo-monitor`` does for an internal error).

Real ``watch()`` runs write a real SQLite file; one value of it is then made wrong with SQL, as
a damaged or hand-edited history would have it. The app runs headless with ``App.run_test`` and
a :class:`~textual.pilot.Pilot` (``tui_helpers``)."""

from __future__ import annotations

import pickle
import shutil
import sqlite3
import zlib
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Static
from tui_helpers import REFRESH_S, run_app, text_of, wait_for
from watch_helpers import record_pressure_run

import edo_monitor
from edo_monitor.tui.app import EXIT_INTERNAL, EdoTui
from edo_monitor.tui.modals import ExplainScreen
from edo_monitor.tui.runs_screen import RunsScreen
from edo_monitor.tui.snapshot_screen import SnapshotScreen


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two real runs with a policy (a crossing below the floor, an action, incident snapshots)."""
    db = tmp_path_factory.mktemp("bad") / "h.db"
    for name in ("first", "second"):
        record_pressure_run(db, name, policy=edo_monitor.Policy())
    return db


def damaged(recorded: Path, tmp_path: Path, sql: str, *params: Any) -> Path:
    """A copy of the recorded history with ``sql`` applied."""
    db = tmp_path / "h.db"
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{recorded}{suffix}").exists():
            shutil.copy(f"{recorded}{suffix}", f"{db}{suffix}")
    con = sqlite3.connect(db)
    with con:
        con.execute(sql, params)
    con.close()
    return db


def first_crossing(db: Path) -> int:
    con = sqlite3.connect(db)
    try:
        return con.execute(
            "SELECT min(id) FROM events WHERE run_id = 1 AND kind = 'threshold_crossed'"
        ).fetchone()[0]
    finally:
        con.close()


def test_bad_samples_are_the_run_views_error_line(recorded: Path, tmp_path: Path) -> None:
    """Was ``WorkerFailed: ValueError("could not convert string to float: 'lots'")``."""
    db = damaged(
        recorded,
        tmp_path,
        "UPDATE samples SET in_use_bytes = 'lots' WHERE id = "
        "(SELECT max(id) FROM samples WHERE run_id = 1)",
    )
    app = EdoTui(db, run="1", refresh_s=REFRESH_S)
    seen: dict[str, Any] = {}

    async def body(pilot: Pilot[None]) -> None:
        screen = app.run_screen
        await wait_for(pilot, lambda: screen.error is not None)
        seen["message"] = text_of(screen.query_one("#run-message", Static))
        seen["code"] = app.exit_code
        await pilot.press("r")  # the app goes on
        await wait_for(pilot, lambda: app.runs_screen.loads > 0)
        seen["runs"] = app.runs_screen.query_one("#runs", DataTable).row_count

    run_app(app, body)
    assert seen["message"].startswith("internal error (ValueError: "), seen["message"]
    assert "'lots'" in seen["message"]
    assert seen["code"] == EXIT_INTERNAL
    assert seen["runs"] == 2


def test_a_bad_run_row_is_the_runs_views_error_line(recorded: Path, tmp_path: Path) -> None:
    """Was ``WorkerFailed: TypeError`` (the runs table's duration of a run with a text start)."""
    db = damaged(recorded, tmp_path, "UPDATE runs SET started_at_s = 'soon' WHERE id = 1")
    app = EdoTui(db, run="2", refresh_s=REFRESH_S)
    seen: dict[str, Any] = {}

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: app.run_screen.loaded)
        await pilot.press("r")
        runs = app.runs_screen
        await wait_for(pilot, lambda: runs.error_code is not None)
        seen["message"] = text_of(runs.query_one("#runs-message", Static))
        seen["code"] = app.exit_code
        await pilot.pause(3 * REFRESH_S)  # its refreshes go on showing the error
        seen["running"] = app.is_running and isinstance(app.screen, RunsScreen)
        seen["run"] = app.run_screen.run_info.name if app.run_screen.run_info else None

    run_app(app, body)
    assert seen["message"].startswith("internal error (TypeError: "), seen["message"]
    assert seen["code"] == EXIT_INTERNAL
    assert seen["running"] and seen["run"] == "second"


def test_a_bad_incident_is_the_explain_views_error_line(recorded: Path, tmp_path: Path) -> None:
    """Was ``WorkerFailed: ValueError("invalid literal for int() …")``: ``x`` ended the app."""
    crossing = first_crossing(recorded)
    db = damaged(
        recorded,
        tmp_path,
        "UPDATE events SET data = json_set(data, '$.in_use_bytes', 'lots') WHERE id = ?",
        crossing,
    )
    app = EdoTui(db, run="1", refresh_s=REFRESH_S)
    seen: dict[str, Any] = {}

    async def body(pilot: Pilot[None]) -> None:
        screen = app.run_screen
        await wait_for(pilot, lambda: screen.loaded)
        await pilot.press("x")
        shown = app.screen
        assert isinstance(shown, ExplainScreen)
        await wait_for(pilot, lambda: shown.error is not None or shown.result is not None)
        seen["error"] = shown.error
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen)
        seen["loaded"] = screen.loaded and screen.error is None

    run_app(app, body)
    assert (seen["error"] or "").startswith("internal error (ValueError: "), seen["error"]
    assert seen["loaded"]


def test_a_malformed_snapshot_is_the_snapshot_views_error_line(
    recorded: Path, tmp_path: Path
) -> None:
    """A blob that decodes to a snapshot whose sizes are text: ``m`` ended the app."""
    crossing = first_crossing(recorded)
    blob = zlib.compress(pickle.dumps({"segments": [{"total_size": "big", "blocks": []}]}))
    db = damaged(
        recorded, tmp_path, "UPDATE snapshots SET blob = ? WHERE event_id = ?", blob, crossing
    )
    app = EdoTui(db, run="1", refresh_s=REFRESH_S)
    seen: dict[str, Any] = {}

    async def body(pilot: Pilot[None]) -> None:
        screen = app.run_screen
        await wait_for(pilot, lambda: screen.loaded)
        row = next(i for i, e in enumerate(screen.event_rows) if e.id == crossing)
        screen.query_one("#events", DataTable).move_cursor(row=row, animate=False)
        await pilot.press("m")
        shown = app.screen
        assert isinstance(shown, SnapshotScreen)
        await wait_for(pilot, lambda: shown.error is not None or shown.rows is not None)
        seen["error"] = shown.error
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen)
        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, RunsScreen))

    run_app(app, body)
    assert (seen["error"] or "").startswith("internal error (ValueError: "), seen["error"]
