"""Tests of ``edo-tui`` as a program: the messages it shows for a database it cannot use, its
exit codes and arguments, keys typed in a real terminal before its first frame, and its data
layer (``DataSource``, ``Series``).

The app runs headless with ``App.run_test``; a :class:`~textual.pilot.Pilot` presses keys
(``tui_helpers``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import select
import signal
import sqlite3
import struct
import sys
import termios
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from textual.pilot import Pilot
from textual.widgets import Static
from tui_helpers import (
    GIB,
    REFRESH_S,
    add_samples,
    db,  # noqa: F401 (the fixture)
    loaded,
    make_run,
    run_app,
    text_of,
    wait_for,
    within_refreshes,
)

from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Meta
from edo_monitor.tui.app import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EdoTui, main, parse_args
from edo_monitor.tui.data import DataSource, Series

# -- errors ----------------------------------------------------------------------------------


def _message_shown(app: EdoTui, db: str | Path | None, *, runs_view: bool = True) -> str:  # noqa: F811
    holder: dict[str, str] = {}

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        box = app.run_screen.query_one("#run-message", Static)
        assert box.display
        holder["text"] = text_of(box)
        holder["runs"] = ""
        if not runs_view:
            return
        await pilot.press("r")
        await wait_for(pilot, lambda: app.runs_screen.query_one("#runs-message", Static).display)
        holder["runs"] = text_of(app.runs_screen.query_one("#runs-message", Static))

    run_app(app, body)
    return holder["text"] + "\n" + holder["runs"]


def test_error_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.db"
    text = _message_shown(EdoTui(path, refresh_s=REFRESH_S), path)
    assert "no history database at" in text and "nope.db" in text
    assert not path.exists()  # read-only: never created


def test_error_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    text = _message_shown(EdoTui(path, refresh_s=REFRESH_S), path)
    assert "cannot open history database" in text or "not a database" in text


def test_error_other_sqlite_database(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE things (x)")
    conn.close()
    text = _message_shown(EdoTui(path, refresh_s=REFRESH_S), path)
    assert "not an edo-monitor history database" in text


def test_error_newer_schema(db: Path) -> None:  # noqa: F811
    engine = open_engine(db)
    with Session(engine) as session, session.begin():
        session.merge(Meta(key="schema_version", value="999"))
    engine.dispose()
    text = _message_shown(EdoTui(db, refresh_s=REFRESH_S), db)
    assert "schema version 999" in text and "upgrade edo-monitor" in text


def test_error_unusable_url() -> None:
    url = "postgresql://nobody@127.0.0.1:1/edo"
    text = _message_shown(EdoTui(url, refresh_s=REFRESH_S), url)
    assert "postgresql://nobody@127.0.0.1:1/edo" in text


def test_error_unreachable_sqlite_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/no/such/folder/h.db"
    text = _message_shown(EdoTui(url, refresh_s=REFRESH_S), url)
    assert "does not exist" in text


def test_empty_database_waits_then_opens_the_first_run(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    open_engine(path).dispose()  # the agent creates the schema, no run yet
    app = EdoTui(path, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        box = app.run_screen.query_one("#run-message", Static)
        assert "No runs recorded yet" in text_of(box)
        engine = open_engine(path)
        with Session(engine) as session, session.begin():
            make_run(session, "first", status="running", started=time.time())
        engine.dispose()
        await within_refreshes(pilot, app.run_screen, lambda: app.run_screen.loaded, 2)
        assert not box.display
        assert "first" in text_of(app.run_screen.query_one("#run-header", Static))

    run_app(app, body)


def test_unknown_run_reference(db: Path) -> None:  # noqa: F811
    text = _message_shown(EdoTui(db, run="zzzz", refresh_s=REFRESH_S), db, runs_view=False)
    assert "no run 'zzzz'" in text


def test_app_opens_read_only(db: Path) -> None:  # noqa: F811
    # chmod does not stop root (CI runs as root): check what the app did, not the file's mode
    before = db.read_bytes()
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        assert app.run_screen.error is None
        assert app.run_screen.loaded
        with (
            pytest.raises(OperationalError, match="readonly database"),
            app.source.open().engine.begin() as conn,
        ):
            conn.execute(text("INSERT INTO meta (key, value) VALUES ('x', 'y')"))

    run_app(app, body)
    assert db.read_bytes() == before
    assert not Path(f"{db}-wal").exists() or Path(f"{db}-wal").stat().st_size == 0


# -- data layer ------------------------------------------------------------------------------


def test_series_is_downsampled_in_sql_and_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "long.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        run = make_run(session, "long", status="running")
        run_id = run.id
        add_samples(session, run, 5000)
    engine.dispose()
    source = DataSource(path)
    series = source.series(source.run(run_id), 100)
    assert 50 <= len(series) <= 100
    assert max(v for v in series.in_use if v is not None) == GIB + (6 * GIB * 4999) // 5000
    t = series.time_s[-1]
    series.extend((10_000 + i, t + i, GIB, GIB, GIB) for i in range(1, 20_000))
    assert len(series) <= 200
    assert series.last_id == 10_000 + 19_999
    source.close()


def test_series_coarsen_keeps_maxima() -> None:
    s = Series(0.0, 1.0, 4)
    s.extend((i + 1, float(i), i, None, 2 * i) for i in range(100))
    assert len(s) <= 8
    assert max(v for v in s.in_use if v is not None) == 99
    assert all(v is None for v in s.allocated)
    assert max(v for v in s.reserved if v is not None) == 198


def test_resolve_by_uuid_prefix_and_latest(db: Path) -> None:  # noqa: F811
    source = DataSource(db)
    first = source.resolve("1")
    assert first is not None and first.name == "old-finished"
    by_uuid = source.resolve(first.uuid[:8])
    assert by_uuid is not None and by_uuid.id == 1
    latest = source.resolve("latest")
    assert latest is not None and latest.name == "live-run"
    source.close()


def test_parse_args() -> None:
    args = parse_args(["runs.db", "--run", "latest", "--refresh-s", "0.5"])
    assert (args.db, args.run, args.refresh_s) == ("runs.db", "latest", 0.5)
    assert parse_args([]).db is None
    with pytest.raises(SystemExit):
        parse_args(["--refresh-s", "0"])
    # --db as every edo-monitor command takes it (it was "unrecognized arguments: --db")
    assert parse_args(["--db", "runs.db"]).db == "runs.db"
    assert parse_args(["runs.db", "--db", "runs.db"]).db == "runs.db"
    with pytest.raises(SystemExit):
        parse_args(["a.db", "--db", "b.db"])


# -- exit codes (issue 10, item 10) ------------------------------------------------------------


def _exit_code_after_quit(app: EdoTui) -> int:
    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running)

    run_app(app, body)
    return app.exit_code


def test_exit_code_ok_after_showing_a_run(db: Path) -> None:  # noqa: F811
    assert _exit_code_after_quit(EdoTui(db, refresh_s=REFRESH_S)) == EXIT_OK == 0


def test_exit_code_ok_while_waiting_for_a_first_run(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    open_engine(path).dispose()
    assert _exit_code_after_quit(EdoTui(path, refresh_s=REFRESH_S)) == 0


def test_exit_code_1_after_an_error_panel(db: Path, tmp_path: Path) -> None:  # noqa: F811
    assert _exit_code_after_quit(EdoTui(tmp_path / "nope.db", refresh_s=REFRESH_S)) == 1
    assert _exit_code_after_quit(EdoTui(db, run="zzzz", refresh_s=REFRESH_S)) == 1
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite" * 200)
    assert _exit_code_after_quit(EdoTui(junk, refresh_s=REFRESH_S)) == EXIT_REFUSED == 1


def test_exit_code_1_when_quitting_from_the_runs_view_with_an_error(tmp_path: Path) -> None:
    app = EdoTui(tmp_path / "nope.db", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("r")
        await wait_for(pilot, lambda: app.runs_screen.error_code is not None)
        await pilot.press("q")

    run_app(app, body)
    assert app.exit_code == 1


@pytest.mark.parametrize("view", ["x", "m"], ids=["explain", "snapshot"])
def test_q_quits_from_the_explain_and_snapshot_views(db: Path, view: str) -> None:  # noqa: F811
    """Regression: the help says "q quit", but with the explain (x) or snapshot (m) view open
    it did nothing."""
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press(view)
        await wait_for(
            pilot, lambda: type(app.screen).__name__ in {"ExplainScreen", "SnapshotScreen"}
        )
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running)

    run_app(app, body)
    assert app.exit_code == EXIT_OK


def test_exit_code_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--refresh-s", "0"])
    assert info.value.code == EXIT_USAGE == 2
    with pytest.raises(SystemExit) as info:
        main(["--no-such-option"])
    assert info.value.code == 2
    capsys.readouterr()
    assert main(["nosuchdialect://host/db"]) == 2  # refused before the screen is taken over
    err = capsys.readouterr().err
    assert err.startswith("edo-tui: error: db='nosuchdialect://host/db'")
    assert main([str(tmp_path)]) == 2  # a folder, not a database file
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "Exit codes: 0 quit on a run" in " ".join(capsys.readouterr().out.split())


# -- keys typed before the first frame (issue 10, item 14) -------------------------------------


def _edo_tui_in_a_terminal(db: Path, script: list[tuple[bytes | None, bytes]]) -> tuple[int, bytes]:  # noqa: F811
    """Run ``edo-tui DB`` in a 140x45 pty; for each ``(wait_for, keys)`` wait until the output
    holds ``wait_for`` (``None``: do not wait), then type ``keys``. Returns the exit status and
    the output, once the process has exited (a hang guard of 120 s kills it)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child
        os.execv(sys.executable, [sys.executable, "-m", "edo_monitor.tui.app", str(db)])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 45, 140, 0, 0))
    output = bytearray()
    status = None
    steps = list(script)
    deadline = time.monotonic() + 120  # a hang guard, not a speed bound
    while status is None and time.monotonic() < deadline:
        while steps and (steps[0][0] is None or steps[0][0] in output):
            os.write(fd, steps.pop(0)[1])
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            with contextlib.suppress(OSError):  # OSError: the child closed the terminal
                output += os.read(fd, 1 << 16)
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(wait_status)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status = -1
    os.close(fd)
    return status, bytes(output)


@pytest.mark.slow
def test_keys_typed_before_the_first_frame_are_kept(db: Path) -> None:  # noqa: F811
    """Keys typed while edo-tui is still starting (a real terminal: a pty; the keys are written
    before the process has drawn anything). Before the fix the runs view's auto-focus put its
    hidden filter box in focus and the ``q`` after ``r`` was typed into it: the app never quit."""
    status, _ = _edo_tui_in_a_terminal(db, [(None, b"r q")])
    assert status == 0, "edo-tui did not quit on the q typed before its first frame"
    # the r alone: the runs view opens (its header is drawn), then q quits
    status, output = _edo_tui_in_a_terminal(db, [(None, b"r"), (b"runs in", b"q")])
    assert b"runs in" in output
    assert status == 0
