"""Tests of ``edo-tui`` (the Textual dashboard) on history databases seeded in ``tmp_path``.

The app runs headless with ``App.run_test``; a :class:`~textual.pilot.Pilot` presses keys and
clicks. Databases are written through the ORM, as the agent's writer does.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import fcntl
import itertools
import os
import pty
import select
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static

from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Event, Meta, ModuleStat, Run, Sample
from edo_monitor.tui.app import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EdoTui, main, parse_args
from edo_monitor.tui.data import DataSource, Series
from edo_monitor.tui.modals import HelpScreen
from edo_monitor.tui.run_screen import RunScreen
from edo_monitor.tui.runs_screen import RunsScreen
from edo_monitor.tui.widgets import FLOOR_RGB, OOM_RGB, Gauge, MemoryChart

GIB = 1 << 30
REFRESH_S = 0.2
SIZE = (140, 45)


# -- seeding ---------------------------------------------------------------------------------


#: Fixed run uuids (no chance in tests): prefixes a0000001, a0000002, … each unique, never digits
_UUIDS = (uuid.UUID(int=(0xA0000000 + n) << 96 | n) for n in itertools.count(1))


def make_run(
    session: Session,
    name: str,
    *,
    status: str = "finished",
    started: float | None = None,
    duration: float = 60.0,
    pid: int | None = None,
    device_kind: str = "cuda",
    device_name: str | None = "NVIDIA H100 80GB HBM3",
    budget: int = 8 * GIB,
    tags: list[str] | None = None,
) -> Run:
    """Add a run row (flushed, so it has an id)."""
    started = time.time() - 3600 if started is None else started
    run = Run(
        uuid=str(next(_UUIDS)),
        name=name,
        host=os.uname().nodename if pid is None else __import__("socket").gethostname(),
        pid=os.getpid() if pid is None else pid,
        started_at_s=started,
        ended_at_s=None if status == "running" else started + duration,
        heartbeat_at_s=time.time() if status == "running" else started + duration,
        status=status,
        error=None,
        device_kind=device_kind,
        device_name=device_name,
        device_uuid=None,
        device_total_bytes=80 * GIB,
        budget_bytes=budget,
        interval_s=0.5,
        torch_version="2.4.0",
        config={"floor": 0.2},
        tags=tags or [],
        steps=0,
        samples_dropped=0,
    )
    session.add(run)
    session.flush()
    return run


def sample(run: Run, t: float, step: int, in_use: int, **extra: Any) -> Sample:
    """A sample row with consistent derived fields."""
    budget = run.budget_bytes or 8 * GIB
    fields: dict[str, Any] = {
        "run_id": run.id,
        "time_s": t,
        "step": step,
        "device_kind": run.device_kind,
        "allocated_bytes": int(in_use * 0.9),
        "reserved_bytes": int(in_use * 1.1),
        "budget_bytes": budget,
        "in_use_bytes": in_use,
        "free_fraction": (budget - in_use) / budget,
        "fragmentation": 0.125,
    }
    fields.update(extra)
    return Sample(**fields)


def add_samples(session: Session, run: Run, n: int, *, start: float | None = None) -> None:
    """``n`` samples, one per second, rising from 1 GiB to about 7 GiB."""
    t0 = run.started_at_s if start is None else start
    for i in range(n):
        session.add(sample(run, t0 + i, i, GIB + (6 * GIB * i) // max(1, n)))


def add_event(session: Session, run: Run, t: float, kind: str, message: str, **data: Any) -> None:
    """An event row."""
    session.add(Event(run_id=run.id, time_s=t, step=1, kind=kind, message=message, data=data))


def add_table(session: Session, run: Run, module: str, rows: int, dim: int, **kw: Any) -> None:
    """An embedding table's module_stats row."""
    fields: dict[str, Any] = {
        "run_id": run.id,
        "time_s": run.started_at_s,
        "step": 0,
        "module": module,
        "kind": "Embedding",
        "num_embeddings": rows,
        "embedding_dim": dim,
        "dtype": "torch.float32",
        "device": "cuda:0",
        "placement": "device",
        "params_bytes": rows * dim * 4,
        "grads_bytes": rows * dim * 4,
        "optimizer_state_bytes": 2 * rows * dim * 4,
        "activations_bytes": 0,
    }
    fields.update(kw)
    session.add(ModuleStat(**fields))


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A database with two runs: ``old-finished`` (finished) and ``live-run`` (running)."""
    path = tmp_path / "history.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        old = make_run(session, "old-finished", started=time.time() - 7200, tags=["baseline"])
        add_samples(session, old, 50)
        add_event(
            session,
            old,
            old.started_at_s + 20,
            "threshold_crossed",
            "free below floor",
            direction="down",
            free_fraction=0.15,
            floor=0.2,
        )
        add_event(
            session,
            old,
            old.started_at_s + 21,
            "action",
            "offloaded table",
            action="offload",
            target="emb.big",
            saved_bytes=2 * GIB,
            bytes_before=7 * GIB,
            bytes_after=5 * GIB,
            duration_s=0.05,
        )
        add_event(session, old, old.started_at_s + 30, "oom", "CUDA out of memory")
        add_table(session, old, "emb.big", 1_000_000, 128, placement="host", device="cpu")
        live = make_run(
            session,
            "live-run",
            status="running",
            started=time.time() - 30,
            device_kind="cpu-budget",
            device_name=None,
            budget=512 << 20,
        )
        for i in range(20):
            session.add(sample(live, live.started_at_s + i, i, (100 + i) << 20))
        add_table(session, live, "encoder.tok_emb", 30522, 384)
        add_table(session, live, "encoder.ln", 0, 0, kind="LayerNorm", num_embeddings=None)
    engine.dispose()
    return path


def run_app(app: EdoTui, body: Callable[[Pilot[None]], Coroutine[Any, Any, None]]) -> None:
    """Run ``body(pilot)`` against the app headless."""

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await body(pilot)

    asyncio.run(go())


async def wait_for(pilot: Pilot[None], cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Let the app run until ``cond()`` holds (fails after ``timeout_s``: a hang guard, not a
    speed bound; bound what the app does in refresh ticks with :func:`within_refreshes`)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


async def within_refreshes(
    pilot: Pilot[None], screen: RunScreen, cond: Callable[[], bool], refreshes: int
) -> None:
    """Let the app run until ``cond()`` holds; fail if the run view completes more than
    ``refreshes`` reads first (the app's own clock, not the machine's speed)."""
    start = screen.refreshes + screen.loads
    await wait_for(pilot, lambda: cond() or screen.refreshes + screen.loads - start > refreshes)
    assert cond(), f"not reached within {refreshes} refreshes"


def text_of(widget: Static) -> str:
    """The plain text a Static shows."""
    content = widget.render()
    return str(getattr(content, "plain", content))


def run_view(app: EdoTui) -> RunScreen:
    """The run view (loaded)."""
    return app.run_screen


def loaded(app: EdoTui) -> bool:
    """True once the run view has shown a run or a message."""
    screen = app.run_screen
    return screen.loaded or screen.error is not None


def table_column(table: DataTable[Any], index: int) -> list[str]:
    """One column of a DataTable as plain strings."""
    return [
        str(getattr(c, "plain", c))
        for c in (table.get_row_at(r)[index] for r in range(table.row_count))
    ]


# -- live view -------------------------------------------------------------------------------


def test_opens_latest_running_run_with_everything(db: Path) -> None:
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        screen = run_view(app)
        header = text_of(screen.query_one("#run-header", Static))
        assert "live-run" in header
        assert "running" in header
        assert "cpu-budget" in header
        assert "step: 19" in header
        assert "elapsed: 0:00:" in header
        used = screen.query_one("#gauge-used", Gauge)
        assert used.text == "119 MiB / 512 MiB"
        assert used.mark == pytest.approx(0.8)
        free = screen.query_one("#gauge-free", Gauge)
        assert "floor 20.0 %" in free.text
        assert screen.query_one("#gauge-frag", Gauge).text == "12.5 %"
        chart = screen.query_one(MemoryChart)
        assert chart.points == 20
        modules = screen.query_one("#modules", DataTable)
        assert modules.row_count == 1  # the LayerNorm row is not an embedding table
        assert table_column(modules, 1) == ["30522×384"]

    run_app(app, body)


def test_finished_run_shows_events_actions_and_tables(db: Path) -> None:
    app = EdoTui(db, run="1", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        screen = run_view(app)
        header = text_of(screen.query_one("#run-header", Static))
        assert "old-finished" in header and "finished" in header
        assert "elapsed: 0:01:00" in header
        events = screen.query_one("#events", DataTable)
        assert table_column(events, 2) == ["threshold_crossed", "action", "oom"]
        assert table_column(events, 4) == ["", "2 GiB", ""]
        assert "offload → emb.big" in table_column(events, 3)[1]
        assert screen.query_one(MemoryChart).action_count == 1
        modules = screen.query_one("#modules", DataTable)
        assert table_column(modules, 3) == ["host"]
        # a finished run is not polled again
        before = screen.refreshes
        await pilot.pause(3 * REFRESH_S)
        assert screen.refreshes == before

    run_app(app, body)


def test_missing_fields_show_na(tmp_path: Path) -> None:
    path = tmp_path / "na.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        run = make_run(session, "sparse")
        session.add(
            sample(
                run,
                run.started_at_s,
                0,
                GIB,
                allocated_bytes=None,
                reserved_bytes=None,
                fragmentation=None,
            )
        )
    engine.dispose()
    app = EdoTui(path, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        screen = run_view(app)
        assert screen.query_one("#gauge-frag", Gauge).text == "N/A"
        assert screen.query_one("#gauge-frag", Gauge).fraction is None
        assert screen.query_one("#gauge-alloc", Gauge).text == "N/A / N/A"
        assert "sparse" in text_of(screen.query_one("#run-header", Static))

    run_app(app, body)


def test_crashed_run_is_shown_as_crashed(tmp_path: Path) -> None:
    path = tmp_path / "crash.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        run = make_run(session, "dead", status="running", pid=2**22 + 12345)
        run.host = __import__("socket").gethostname()
        run.heartbeat_at_s = time.time() - 3600
    engine.dispose()
    app = EdoTui(path, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        assert "crashed" in text_of(run_view(app).query_one("#run-header", Static))

    run_app(app, body)


def test_run_finishing_while_open_updates_status(db: Path) -> None:
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        header = run_view(app).query_one("#run-header", Static)
        assert " running " in text_of(header)
        engine = open_engine(db)
        with Session(engine) as session, session.begin():
            session.execute(
                update(Run)
                .where(Run.name == "live-run")
                .values(status="finished", ended_at_s=time.time(), steps=25)
            )
        engine.dispose()
        await within_refreshes(pilot, run_view(app), lambda: " finished " in text_of(header), 2)
        assert "step: 25" in text_of(header)

    run_app(app, body)


def test_rows_from_another_thread_appear_within_two_refreshes(db: Path) -> None:
    app = EdoTui(db, refresh_s=REFRESH_S)

    def writer(done: threading.Event) -> None:
        engine = open_engine(db)
        with Session(engine) as session, session.begin():
            run = session.query(Run).filter_by(name="live-run").one()
            t = run.started_at_s + 100
            session.add(sample(run, t, 99, 400 << 20))
            add_event(
                session,
                run,
                t,
                "action",
                "released cache",
                action="release_cache",
                target="allocator",
                saved_bytes=64 << 20,
                bytes_after=400 << 20,
            )
            add_table(session, run, "encoder.pos_emb", 512, 384)
        engine.dispose()
        done.set()

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        screen = run_view(app)
        events = screen.query_one("#events", DataTable)
        assert events.row_count == 0
        done = threading.Event()
        thread = threading.Thread(target=writer, args=(done,))
        thread.start()
        await wait_for(pilot, done.is_set)
        # a read in flight when the write ended may miss it; the next one cannot
        await within_refreshes(pilot, screen, lambda: events.row_count == 1, 2)
        await wait_for(
            pilot, lambda: screen.query_one("#gauge-used", Gauge).text.startswith("400 MiB")
        )
        assert "step: 99" in text_of(screen.query_one("#run-header", Static))
        assert screen.query_one(MemoryChart).points == 21
        assert screen.query_one(MemoryChart).action_count == 1
        assert screen.query_one("#modules", DataTable).row_count == 2
        thread.join()

    run_app(app, body)


# -- navigation ------------------------------------------------------------------------------


def test_keys_navigate(db: Path) -> None:
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


def test_enter_and_click_open_a_run(db: Path) -> None:
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


def test_runs_table_summary_sort_and_filter(db: Path) -> None:
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("r")
        runs = app.runs_screen
        await wait_for(pilot, lambda: runs.loads > 0)
        table = runs.query_one("#runs", DataTable)
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


def test_export_writes_the_open_runs_samples(db: Path, tmp_path: Path) -> None:
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


def test_export_defaults_to_current_folder(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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


# -- errors ----------------------------------------------------------------------------------


def _message_shown(app: EdoTui, db: str | Path | None, *, runs_view: bool = True) -> str:
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


def test_error_newer_schema(db: Path) -> None:
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


def test_unknown_run_reference(db: Path) -> None:
    text = _message_shown(EdoTui(db, run="zzzz", refresh_s=REFRESH_S), db, runs_view=False)
    assert "no run 'zzzz'" in text


def test_app_opens_read_only(db: Path) -> None:
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


# -- layout ----------------------------------------------------------------------------------


def test_layout_snapshot(db: Path, tmp_path: Path) -> None:
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


def test_resolve_by_uuid_prefix_and_latest(db: Path) -> None:
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


# -- exit codes (issue 10, item 10) ------------------------------------------------------------


def _exit_code_after_quit(app: EdoTui) -> int:
    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running)

    run_app(app, body)
    return app.exit_code


def test_exit_code_ok_after_showing_a_run(db: Path) -> None:
    assert _exit_code_after_quit(EdoTui(db, refresh_s=REFRESH_S)) == EXIT_OK == 0


def test_exit_code_ok_while_waiting_for_a_first_run(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    open_engine(path).dispose()
    assert _exit_code_after_quit(EdoTui(path, refresh_s=REFRESH_S)) == 0


def test_exit_code_1_after_an_error_panel(db: Path, tmp_path: Path) -> None:
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


def _edo_tui_in_a_terminal(db: Path, script: list[tuple[bytes | None, bytes]]) -> tuple[int, bytes]:
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
def test_keys_typed_before_the_first_frame_are_kept(db: Path) -> None:
    """Keys typed while edo-tui is still starting (a real terminal: a pty; the keys are written
    before the process has drawn anything). Before the fix the runs view's auto-focus put its
    hidden filter box in focus and the ``q`` after ``r`` was typed into it: the app never quit."""
    status, _ = _edo_tui_in_a_terminal(db, [(None, b"r q")])
    assert status == 0, "edo-tui did not quit on the q typed before its first frame"
    # the r alone: the runs view opens (its header is drawn), then q quits
    status, output = _edo_tui_in_a_terminal(db, [(None, b"r"), (b"runs in", b"q")])
    assert b"runs in" in output
    assert status == 0


# -- the chart and the panels (issue 10, item 14) -------------------------------------------------


def chart_rows_in(chart: MemoryChart, rgb: tuple[int, int, int]) -> list[int]:
    """Indices of the chart's lines holding a character drawn in colour ``rgb``."""
    rows = []
    for y, line in enumerate(chart.lines):
        for segment in line:
            color = segment.style.color if segment.style else None
            triplet = None if color is None else color.triplet
            if triplet is not None and tuple(triplet) == rgb and segment.text.strip():
                rows.append(y)
                break
    return rows


@pytest.fixture
def failed_db(tmp_path: Path) -> Path:
    """A failed run (an out-of-memory error at 40 s) and a run without a budget."""
    path = tmp_path / "failed.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        run = make_run(session, "oom-run", status="failed", budget=1 * GIB)
        run.error = "OutOfMemoryError: CUDA out of memory"
        for i in range(41):
            session.add(sample(run, run.started_at_s + i, i, (500 + 10 * i) << 20))
        message = (
            "out of memory: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
            "capacity of 1.00 GiB of which 12.00 MiB is free. Including non-PyTorch memory, this "
            "process has 1012.00 MiB memory in use. Of the allocated memory 900.00 MiB is "
            "allocated by PyTorch, and 40.00 MiB is reserved by PyTorch but unallocated."
        )
        add_event(session, run, run.started_at_s + 40, "oom", message)
        add_table(
            session,
            run,
            "model.encoder.embeddings.word_embeddings",
            250_002,
            1024,
            activations_bytes=123_456_789,
        )
        add_table(session, run, "model.encoder.embeddings.position_embeddings", 514, 1024)
        free = make_run(session, "no-budget", budget=0, device_kind="cpu-budget")
        free.budget_bytes = None
        for i in range(10):
            session.add(
                sample(
                    free,
                    free.started_at_s + i,
                    i,
                    (100 + i) << 20,
                    budget_bytes=None,
                    free_fraction=None,
                )
            )
    engine.dispose()
    return path


def test_failed_run_chart_marks_the_out_of_memory_error(failed_db: Path) -> None:
    app = EdoTui(failed_db, run="1", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        chart = app.run_screen.query_one(MemoryChart)
        await wait_for(pilot, lambda: chart.lines_size == chart.wanted_size)
        assert chart.oom_count == 1
        assert chart.data.ooms == (40.0,)
        oom_rows = chart_rows_in(chart, OOM_RGB)
        assert 0 in oom_rows  # the legend names it
        assert "out of memory" in chart.lines[0].text
        plot_rows = [y for y in oom_rows if y > 0]
        assert len(plot_rows) >= chart.size.height // 2  # a vertical line down the plot
        assert any("OOM" in chart.lines[y].text for y in plot_rows)

    run_app(app, body)


def test_floor_line_is_yellow_and_the_legend_is_not_on_it(failed_db: Path) -> None:
    app = EdoTui(failed_db, run="1", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        chart = app.run_screen.query_one(MemoryChart)
        await wait_for(pilot, lambda: chart.lines_size == chart.wanted_size)
        r, g, b = FLOOR_RGB
        assert r >= 200 and g >= 180 and b <= 80  # yellow, as README and help say
        assert chart.data.floor_bytes == int(GIB * 0.8)  # budget 1 GiB, floor 20 % free
        floor_rows = [y for y in chart_rows_in(chart, FLOOR_RGB) if y > 0]
        assert len(floor_rows) == 1  # one horizontal line
        assert "─" * 10 in chart.lines[floor_rows[0]].text
        legend = chart.lines[0].text
        assert "in use" in legend and "floor (20% free)" in legend
        for line in chart.lines[1:]:
            assert "in use" not in line.text and "floor" not in line.text

    run_app(app, body)


def test_run_without_a_budget_has_no_floor_marker(failed_db: Path) -> None:
    app = EdoTui(failed_db, run="2", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        screen = app.run_screen
        chart = screen.query_one(MemoryChart)
        await wait_for(pilot, lambda: chart.lines_size == chart.wanted_size)
        assert chart.points == 10
        assert chart.data.floor_bytes is None
        assert chart_rows_in(chart, FLOOR_RGB) == []
        assert "floor" not in chart.lines[0].text
        free = screen.query_one("#gauge-free", Gauge)
        assert free.mark is None and free.text == "N/A (no budget)"
        assert screen.query_one("#gauge-used", Gauge).mark is None

    run_app(app, body)


def test_at_160_columns_tables_fit_and_the_selected_event_is_shown_whole(failed_db: Path) -> None:
    app = EdoTui(failed_db, run="1", refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await pilot.resize_terminal(160, 50)
        await wait_for(pilot, lambda: loaded(app))
        await pilot.pause()
        screen = app.run_screen
        modules = screen.query_one("#modules", DataTable)
        events = screen.query_one("#events", DataTable)
        for table in (modules, events):  # every column inside the panel: nothing cut
            assert table.virtual_size.width <= table.scrollable_content_region.width
        assert table_column(modules, 0)[0] == "model.encoder.embeddings.word_embeddings"
        assert table_column(modules, 7)[0] == "117.74 MiB"  # activ, the second last column
        message = (
            "out of memory: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
            "capacity of 1.00 GiB of which 12.00 MiB is free. Including non-PyTorch memory, this "
            "process has 1012.00 MiB memory in use. Of the allocated memory 900.00 MiB is "
            "allocated by PyTorch, and 40.00 MiB is reserved by PyTorch but unallocated."
        )
        detail = screen.query_one("#event-detail", Static)
        assert detail.display and message in " ".join(text_of(detail).split())
        # in the table the detail is cut at a word boundary, marked with …
        cell = events.get_row_at(0)[3]
        width = events.columns[events.ordered_columns[3].key].get_render_width(events) - 2
        lines = app.console.render_lines(cell, app.console.options.update_width(width))
        shown = "".join(seg.text for seg in lines[0]).rstrip()
        assert shown.endswith("…")
        assert message.startswith(shown[:-1]) and message[len(shown) - 1] == " "

    run_app(app, body)


# -- following new runs (issue 10, item 13) ------------------------------------------------------

WATCHED_TRAINING = """
import pathlib, sys, time
import torch
from torch import nn
import edo_monitor

db, stop = sys.argv[1], pathlib.Path(sys.argv[2])
torch.manual_seed(0)
model = nn.Embedding(1000, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with edo_monitor.watch(model, opt, db=db, budget="64MiB", interval_s=0.05, run_name="second-run"):
    while not stop.exists():
        loss = model(torch.randint(0, 1000, (64,))).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)  # the workload's pace, not synchronisation
"""


def _run_status(db: Path, name: str) -> str | None:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT status FROM runs WHERE name = ?", (name,)).fetchone()
    except sqlite3.OperationalError:  # the agent is creating the schema
        row = None
    finally:
        conn.close()
    return None if row is None else str(row[0])


def _finished_run_db(tmp_path: Path) -> Path:
    path = tmp_path / "follow.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():
        run = make_run(session, "first-run", status="finished", started=time.time() - 600)
        add_samples(session, run, 30)
    engine.dispose()
    return path


@pytest.mark.slow
def test_live_view_follows_a_new_run_started_by_watch(tmp_path: Path) -> None:
    db = _finished_run_db(tmp_path)
    stop = tmp_path / "stop"
    app = EdoTui(db, refresh_s=REFRESH_S)
    header = ""

    async def body(pilot: Pilot[None]) -> None:
        nonlocal header
        await wait_for(pilot, lambda: loaded(app))
        screen = run_view(app)
        assert screen.run_info is not None and screen.run_info.name == "first-run"
        assert "following new runs" in text_of(screen.query_one("#run-header", Static))
        child = subprocess.Popen([sys.executable, "-c", WATCHED_TRAINING, str(db), str(stop)])
        try:
            # torch's import takes seconds: a hang guard, then the app's own clock
            await wait_for(pilot, lambda: _run_status(db, "second-run") == "running", 300)
            await within_refreshes(
                pilot,
                screen,
                lambda: screen.run_info is not None and screen.run_info.name == "second-run",
                2,
            )
            header = text_of(screen.query_one("#run-header", Static))
            assert screen.run_info.status == "running"
            await wait_for(pilot, lambda: screen.query_one(MemoryChart).points > 0)
            stop.touch()
            await wait_for(pilot, lambda: child.poll() is not None, 120)
            assert child.returncode == 0
            await within_refreshes(pilot, screen, lambda: screen.run_info.status == "finished", 2)
            assert screen.run_info.name == "second-run"  # stays on the run it follows
        finally:
            stop.touch()
            child.wait(120)

    run_app(app, body)
    assert "second-run" in header and " running " in header
    assert "following new runs (switched from #1)" in header


def test_following_is_turned_off_and_on_with_f(tmp_path: Path) -> None:
    db = _finished_run_db(tmp_path)
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        screen = run_view(app)
        header = screen.query_one("#run-header", Static)
        await pilot.press("f")
        assert not screen.follow
        assert "not following new runs" in text_of(header)
        engine = open_engine(db)
        with Session(engine) as session, session.begin():
            make_run(session, "new-run", status="running", started=time.time())
        engine.dispose()
        ticks = screen.ticks
        await wait_for(pilot, lambda: screen.ticks >= ticks + 3)
        assert screen.run_info is not None and screen.run_info.name == "first-run"
        await pilot.press("f")
        assert screen.follow
        await within_refreshes(
            pilot,
            screen,
            lambda: screen.run_info is not None and screen.run_info.name == "new-run",
            2,
        )
        assert "following new runs (switched from #1)" in text_of(header)

    run_app(app, body)


def test_a_run_asked_for_is_not_left(db: Path) -> None:
    app = EdoTui(db, run="1", refresh_s=REFRESH_S)  # old-finished, while live-run is running

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        screen = run_view(app)
        assert not screen.follow
        ticks = screen.ticks
        await wait_for(pilot, lambda: screen.ticks >= ticks + 3)
        assert screen.run_info is not None and screen.run_info.name == "old-finished"
        assert "not following new runs" in text_of(screen.query_one("#run-header", Static))
        await pilot.press("l")  # the live view follows again
        await wait_for(pilot, lambda: screen.loaded)
        assert screen.follow and screen.run_info.name == "live-run"

    run_app(app, body)


def test_chart_strips_equal_richs_ansi_decoding() -> None:
    """The chart's fast ANSI → strips path gives, cell by cell, the characters and colours that
    Rich's ``Text.from_ansi`` rendering gives for a real plotext figure (lines, floor, action,
    OOM label, scatter), cropped and padded to the width."""
    from rich.console import Console
    from rich.text import Text
    from textual.strip import Strip
    from textual_plotext import Plot

    from edo_monitor.tui.widgets import ACTION_RGB, IN_USE_RGB, ansi_strips

    width = 150
    plt = Plot()
    plt.theme("clear")
    plt.plotsize(width, 30)
    plt._set_size(width, 30)
    xs = list(range(130))
    plt.plot(xs, [(x * 7919) % 101 / 100 for x in xs], color=IN_USE_RGB, marker="sd")
    plt.hline(0.4, FLOOR_RGB)
    plt.vline(60, ACTION_RGB)
    plt.scatter([60], [1.0], marker="x", color=ACTION_RGB)
    plt.text("OOM", 90, 1.0, color=OOM_RGB, alignment="right")
    ansi = plt.build()
    console = Console(width=width, color_system="truecolor", force_terminal=True)
    options = console.options.update(width=width, no_wrap=True, overflow="crop")
    reference = [
        Strip(line, width)
        for line in console.render_lines(Text.from_ansi(ansi, no_wrap=True), options, pad=True)
    ]

    def cells(strip: Strip) -> list[tuple[str, Any, Any]]:
        return [
            (ch, seg.style.color if seg.style else None, seg.style.bgcolor if seg.style else None)
            for seg in strip
            for ch in seg.text
        ]

    fast = ansi_strips(ansi, width)
    assert len(fast) == 30  # plotsize's height; Rich renders the final newline as a blank 31st
    assert [cells(s) for s in fast] == [cells(s) for s in reference[:30]]
    assert all(s.cell_length == width for s in fast)
    colours = {c[1].triplet for s in fast for c in cells(s) if c[1] is not None}
    assert {IN_USE_RGB, FLOOR_RGB, ACTION_RGB, OOM_RGB} <= {tuple(c) for c in colours}
    assert [c[0] for c in cells(ansi_strips(ansi, 40)[0])] == [c[0] for c in cells(fast[0])][:40]
