"""Tests of ``edo-tui`` (the Textual dashboard): the run view (header, gauges, chart, events and
tables, live refresh, following new runs) on history databases seeded in ``tmp_path``.

The app runs headless with ``App.run_test``; a :class:`~textual.pilot.Pilot` presses keys and
clicks. Databases are written through the ORM, as the agent's writer does (``tui_helpers``).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session
from textual.pilot import Pilot
from textual.widgets import DataTable, Static
from tui_helpers import (
    GIB,
    REFRESH_S,
    add_event,
    add_samples,
    add_table,
    db,  # noqa: F401 (the fixture)
    loaded,
    make_run,
    run_app,
    run_view,
    sample,
    table_column,
    text_of,
    wait_for,
    within_refreshes,
)

from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Run
from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.widgets import FLOOR_RGB, OOM_RGB, Gauge, MemoryChart

# -- live view -------------------------------------------------------------------------------


def test_opens_latest_running_run_with_everything(db: Path) -> None:  # noqa: F811
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


def test_finished_run_shows_events_actions_and_tables(db: Path) -> None:  # noqa: F811
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


def test_run_finishing_while_open_updates_status(db: Path) -> None:  # noqa: F811
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


def test_rows_from_another_thread_appear_within_two_refreshes(db: Path) -> None:  # noqa: F811
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


def _run_status(db: Path, name: str) -> str | None:  # noqa: F811
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
    db = _finished_run_db(tmp_path)  # noqa: F811
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
    db = _finished_run_db(tmp_path)  # noqa: F811
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


def test_a_run_asked_for_is_not_left(db: Path) -> None:  # noqa: F811
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
