"""Tests of ``edo-tui``: moving between views (keys, clicks), the runs view (summary, sort,
filter), the CSV export, the layout, and user strings shown as text, never markup.

The app runs headless with ``App.run_test``; a :class:`~textual.pilot.Pilot` presses keys and
clicks (``tui_helpers``).
"""

from __future__ import annotations

import csv
import io
import re
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy.orm import Session
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static
from tui_helpers import (
    GIB,
    REFRESH_S,
    add_event,
    add_table,
    db,  # noqa: F401 (the fixture)
    loaded,
    make_run,
    run_app,
    run_view,
    table_column,
    text_of,
    wait_for,
)
from typer.testing import CliRunner

from edo_monitor.store.engine import open_engine
from edo_monitor.surfaces.cli import app as cli
from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.data import DataSource
from edo_monitor.tui.modals import HelpScreen
from edo_monitor.tui.run_screen import RunScreen
from edo_monitor.tui.runs_screen import RunsScreen

# -- navigation ------------------------------------------------------------------------------


def test_keys_navigate(db: Path) -> None:  # noqa: F811
    app = EdoTui(db, run="1", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        assert isinstance(app.screen, RunScreen)
        await pilot.press("r")
        assert isinstance(app.screen, RunsScreen)
        runs = app.runs_screen
        await wait_for(pilot, lambda: runs.loads > 0)
        assert app.screen.query_one("#runs", DataTable).row_count == 2
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("x")  # any key closes help
        assert isinstance(app.screen, RunsScreen)
        await pilot.press("l")  # live: the running run, not run 1
        assert isinstance(app.screen, RunScreen)
        await wait_for(pilot, lambda: app.run_screen.loaded)
        assert app.run_screen.run_info is not None
        assert app.run_screen.run_info.name == "live-run"
        await pilot.press("slash")
        assert isinstance(app.screen, RunsScreen)
        assert app.screen.query_one("#filter", Input).has_focus
        await pilot.press("escape")
        assert not app.screen.query_one("#filter", Input).display
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running

    run_app(app, body)


def test_enter_and_click_open_a_run(db: Path) -> None:  # noqa: F811
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("r")
        await wait_for(pilot, lambda: app.runs_screen.loads > 0)
        table = app.screen.query_one("#runs", DataTable)
        # newest first: live-run (2), then old-finished (1)
        assert table_column(table, 1) == ["live-run", "old-finished"]
        await pilot.press("down", "enter")
        assert isinstance(app.screen, RunScreen)
        await wait_for(pilot, lambda: app.run_screen.loaded)
        assert app.run_screen.run_info is not None
        assert app.run_screen.run_info.name == "old-finished"
        # mouse: back to runs with a click on a row
        await pilot.press("r")
        await pilot.pause()
        table = app.screen.query_one("#runs", DataTable)
        await pilot.click(table, offset=(3, 1))  # first data row (live-run)
        await pilot.pause()
        if not isinstance(app.screen, RunScreen):  # first click highlights, second opens
            await pilot.click(table, offset=(3, 1))
        await wait_for(pilot, lambda: isinstance(app.screen, RunScreen))
        await wait_for(pilot, lambda: app.run_screen.loaded)
        assert app.run_screen.run_info is not None
        assert app.run_screen.run_info.name == "live-run"

    run_app(app, body)


def test_filter_key_before_the_runs_view_was_ever_shown(db: Path) -> None:  # noqa: F811
    """Regression: ``/`` from the first screen switched to the runs view and looked its filter
    box up before the view was composed: ``NoMatches``, and the app exited (code 3)."""
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        assert not isinstance(app.screen, RunsScreen)
        await pilot.press("slash")
        await pilot.press(*"baseline")
        runs = app.runs_screen
        await wait_for(pilot, lambda: runs.loads > 0 and runs.filter_text == "baseline")
        assert runs.query_one("#filter", Input).has_focus
        assert table_column(runs.query_one("#runs", DataTable), 1) == ["old-finished"]

    run_app(app, body)
    assert app.return_code in (None, 0)


async def _runs_table(pilot: Pilot[None], app: EdoTui) -> DataTable:
    """The runs view's table, once the app loaded and ``r`` showed the view."""
    await wait_for(pilot, lambda: loaded(app))
    await pilot.press("r")
    await wait_for(pilot, lambda: app.runs_screen.loads > 0)
    return app.runs_screen.query_one("#runs", DataTable)


def test_start_times_are_utc_as_the_cli_shows_them(
    db: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: the runs view showed local time unlabelled, ``edo-monitor runs`` UTC: off
    UTC the same run's start read 9 hours apart (TZ=Asia/Tokyo)."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        with sqlite3.connect(db) as con:
            (started,) = con.execute("SELECT started_at_s FROM runs WHERE id = 1").fetchone()
        utc = datetime.fromtimestamp(started, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        cli_line = next(
            line
            for line in CliRunner().invoke(cli, ["runs", "--db", str(db)]).output.splitlines()
            if "old-finished" in line
        )
        assert utc in cli_line
        app = EdoTui(db, refresh_s=REFRESH_S)

        async def body(pilot: Pilot[None]) -> None:
            table = await _runs_table(pilot, app)
            assert str(table.ordered_columns[3].label).startswith("started (UTC)")  # ▼: sorted
            assert str(getattr(c := table.get_row("1")[3], "plain", c)) == utc

        run_app(app, body)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_runs_table_summary_sort_and_filter(db: Path) -> None:  # noqa: F811
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        table = await _runs_table(pilot, app)
        runs = app.runs_screen
        row = [str(getattr(c, "plain", c)) for c in table.get_row(str(1))]
        assert row[1:3] == ["old-finished", "finished"]
        assert row[4] == "0:01:00"
        assert row[8:] == ["1", "1"]  # OOMs, actions
        assert row[7].endswith("%")
        # sort by name with a header click, then reverse with another; the click's x comes
        # from the columns as laid out (a fixed offset hit "status" once, in CI under load,
        # before the name column had widened to its rows)
        await pilot.pause()
        before = table.ordered_columns[: table.get_column_index("name")]
        await pilot.click("#runs", offset=(sum(c.get_render_width(table) for c in before) + 1, 0))
        await pilot.pause()
        assert runs.sort_key == "name"
        assert table_column(table, 1) == ["live-run", "old-finished"]
        runs.sort_by("name")
        assert table_column(table, 1) == ["old-finished", "live-run"]
        await pilot.press("s")
        assert runs.sort_key == "status"
        # filter
        await pilot.press("slash")
        await pilot.press(*"baseline")
        await pilot.pause()
        assert table_column(table, 1) == ["old-finished"]
        assert "1 of 2" in text_of(runs.query_one("#runs-header", Static))
        await pilot.press("enter")  # to the table
        assert table.has_focus
        await pilot.press("slash", "ctrl+a")
        app.runs_screen.query_one("#filter", Input).value = "cpu-budget running"
        await pilot.pause()
        assert table_column(table, 1) == ["live-run"]
        await pilot.press("escape")
        assert table.row_count == 2

    run_app(app, body)


# -- export ----------------------------------------------------------------------------------


def test_export_writes_the_open_runs_samples(db: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    app = EdoTui(db, run="1", refresh_s=REFRESH_S, export_dir=out)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("e")
        await wait_for(pilot, lambda: app.last_export is not None)
        await pilot.pause()
        messages = [n.message for n in app._notifications]
        assert any(str(app.last_export) in m for m in messages)

    run_app(app, body)
    path = out / "edo-run-1-old-finished.csv"
    assert app.last_export == path
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 50
    assert rows[0]["step"] == "0" and rows[-1]["step"] == "49"
    assert int(rows[0]["in_use_bytes"]) == GIB
    assert "run_id" not in rows[0]
    assert rows[0]["device_kind"] == "cuda"
    assert {"nvml_memory_info_version", "host_available_bytes", "free_fraction"} <= set(rows[0])
    conn = sqlite3.connect(db)
    expected = conn.execute("SELECT id FROM samples WHERE run_id = 1 ORDER BY id").fetchall()
    conn.close()
    assert [int(r["id"]) for r in rows] == [e[0] for e in expected]


def test_the_dashboards_export_is_the_export_commands(db: Path, tmp_path: Path) -> None:  # noqa: F811
    """Regression: the two wrote their own CSV: the columns in another order, and the command's
    left ``nvml_memory_info_version`` empty (it read the default columns under a header of all
    of them). Now one writer: the same rows, every recorded value."""
    from typer.testing import CliRunner

    from edo_monitor.surfaces.cli import app as cli

    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE samples SET nvml_memory_info_version = 2 WHERE run_id = 1")
    source = DataSource(str(db))
    try:
        path = source.export_csv(source.resolve("1"), tmp_path)
    finally:
        source.close()
    command = CliRunner().invoke(cli, ["export", "1", "--format", "csv", "--db", str(db)])
    assert command.exit_code == 0
    with path.open(newline="") as fh:
        written = list(csv.reader(fh))
    assert written == list(csv.reader(io.StringIO(command.stdout)))
    column = written[0].index("nvml_memory_info_version")
    assert {row[column] for row in written[1:]} == {"2"}


def test_export_of_a_run_with_a_long_name_cuts_the_file_name(db: Path, tmp_path: Path) -> None:  # noqa: F811
    """Regression: a 300-character run name (an older history's: watch() now refuses over 200)
    made "File name too long", and the export failed."""
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET name = ? WHERE id = 1", ("x" * 300,))
    app = EdoTui(db, run="1", refresh_s=REFRESH_S, export_dir=tmp_path)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("e")
        await wait_for(pilot, lambda: app.last_export is not None)

    run_app(app, body)
    assert app.last_export == tmp_path / f"edo-run-1-{'x' * 80}.csv"
    assert app.last_export.stat().st_size > 0


def test_export_defaults_to_current_folder(
    db: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("e")
        await wait_for(pilot, lambda: app.last_export is not None)

    run_app(app, body)
    assert app.last_export == tmp_path / "edo-run-2-live-run.csv"
    assert len(app.last_export.read_text().splitlines()) == 21


# -- layout ----------------------------------------------------------------------------------


def test_layout_snapshot(db: Path, tmp_path: Path) -> None:  # noqa: F811
    app = EdoTui(db, run="1", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.pause()
        screen = app.screen
        regions = {
            name: screen.query_one(name).region
            for name in ("#run-header", "#gauges", "#chart", "#events", "#modules")
        }
        assert all(r.width > 0 and r.height > 0 for r in regions.values())
        assert regions["#run-header"].y < regions["#gauges"].y < regions["#chart"].y
        assert regions["#chart"].y < regions["#events"].y < regions["#modules"].y
        assert regions["#chart"].height >= 10
        svg = Path(app.save_screenshot(path=str(tmp_path), filename="live.svg"))
        text = svg.read_text()
        for needle in ("old-finished", "device", "used", "events", "embedding", "emb.big"):
            assert needle in text
        await pilot.press("r")
        await wait_for(pilot, lambda: app.runs_screen.loads > 0)
        await pilot.pause()
        svg = Path(app.save_screenshot(path=str(tmp_path), filename="runs.svg"))
        assert "live-run" in svg.read_text() and "min" in svg.read_text()

    run_app(app, body)


# -- user strings are text, never markup (issue 10, item 8) ---------------------------------------

MARKUP_NAMES = ("sweep[/bs64]", "bert[lr=1e-4]", "[bold]loud[/bold]")


def test_user_strings_are_shown_as_is(tmp_path: Path) -> None:
    path = tmp_path / "markup.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        for name in MARKUP_NAMES:
            run = make_run(session, name, tags=["[/tag]", "lr=[1e-4]"])
        add_event(session, run, run.started_at_s + 1, "agent_error", "failed in [/emb] [red]x")
        add_table(session, run, "emb[/x].table[0]", 10, 4)
    engine.dispose()
    out = tmp_path / "out"
    out.mkdir()
    app = EdoTui(path, refresh_s=REFRESH_S, export_dir=out)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        screen = run_view(app)
        assert screen.error is None
        assert " [bold]loud[/bold] " in text_of(screen.query_one("#run-header", Static))
        events = screen.query_one("#events", DataTable)
        assert table_column(events, 3) == ["failed in [/emb] [red]x"]
        assert table_column(screen.query_one("#modules", DataTable), 0) == ["emb[/x].table[0]"]
        await pilot.press("e")  # the notification names the run (it shows for 2 s: look now)
        assert any("([bold]loud[/bold])" in n.message for n in app._notifications)
        await wait_for(pilot, lambda: app.last_export is not None)
        await pilot.press("r")
        await wait_for(pilot, lambda: app.runs_screen.loads > 0)
        table = app.runs_screen.query_one("#runs", DataTable)
        assert table_column(table, 1) == list(reversed(MARKUP_NAMES))
        await pilot.press("slash", *"[/tag]")
        await pilot.pause()
        assert table.row_count == 3
        assert "'[/tag]'" in text_of(app.runs_screen.query_one("#runs-header", Static))
        assert app.is_running

    run_app(app, body)


def test_the_screenshot_tool_names_itself() -> None:
    """Regression: its usage named ``python -m edo_monitor.tui.basehot``, a module that does not
    exist (a replace of "screens" gone wrong)."""
    out = subprocess.run(
        [sys.executable, "-m", "edo_monitor.tui.screenshot", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: python -m edo_monitor.tui.screenshot ")


def _svg_text(svg: str) -> str:
    """The words of a saved screenshot, for a failure message."""
    return " ".join(re.findall(r">([^<]*)</text>", svg)).replace("&#160;", " ")


def test_the_screenshot_tool_saves_the_settled_view_of_a_finished_run(
    db: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    """The README's image comes from this tool; it saves once two renders agree (under load a
    table was once saved before its columns were laid out)."""
    import asyncio

    from edo_monitor.tui.screenshot import screenshot

    out = asyncio.run(screenshot(str(db), tmp_path / "shot.svg", run="1", size=(120, 40)))
    svg = out.read_text(encoding="utf-8")
    assert out == tmp_path / "shot.svg" and svg.startswith("<svg")
    # the run's name in the header and the newest event's whole detail below its table (the
    # table's own cells: Textual's DataTable can keep a row drawn before its columns were
    # measured, cut to the headers' widths, until it is drawn again)
    assert "old-finished" in svg and "CUDA&#160;out&#160;of&#160;memory" in svg, _svg_text(svg)


def test_the_screenshot_tool_waits_out_a_read_that_failed_once(
    db: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    """Regression: the first read's error ended the wait, so a read that failed once (here: the
    file not there yet) was saved as the picture, where the dashboard itself reads again."""
    import asyncio
    import threading

    from edo_monitor.tui.screenshot import screenshot

    later = tmp_path / "later"  # the folder appears (a link to the database's) after 0.3 s
    arrive = threading.Timer(0.3, later.symlink_to, args=(db.parent,))
    arrive.start()
    try:
        out = asyncio.run(
            screenshot(str(later / db.name), tmp_path / "shot.svg", run="1", size=(120, 40))
        )
    finally:
        arrive.join()
    svg = out.read_text(encoding="utf-8")
    # the run's name in the header and the newest event's whole detail below its table (the
    # table's own cells: Textual's DataTable can keep a row drawn before its columns were
    # measured, cut to the headers' widths, until it is drawn again)
    assert "old-finished" in svg and "CUDA&#160;out&#160;of&#160;memory" in svg, _svg_text(svg)
