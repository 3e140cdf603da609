"""Benchmark of ``edo-tui``: refreshing the live view of a long run, and CPU use while idle.

Seeds a history database with one running run of ``--samples`` samples (default 1,000,000, one
per 0.1 s, written with ``write_samples`` on a writer engine, as the agent's writer writes them,
rollups included) and one finished run, then drives the app headless (``App.run_test``):

- **open**: first load of the live view (run, SQL-downsampled series, events, tables);
- **refresh**: 10 new samples (and, every other time, an event) are written, then one refresh is
  timed from the timer tick to the end of the next screen repaint (the read and the chart's
  lines in the worker thread, the widget updates on the UI thread, the compositor's render of
  what changed); also the read alone (``DataSource.poll``), the repaint alone, and the chart's
  build alone (``build_chart``, in the worker);
- **idle CPU**: process CPU time over ``--idle-s`` seconds with a finished run open;
- **first paint**: ``edo-tui DB`` (``python -m edo_monitor.tui.app``) started in a pseudo-terminal,
  timed from ``fork`` to the first output of a frame (the alternate screen) and to the first
  frame that shows the run's name (the live view painted with its data); beside it a bare
  ``python -c pass`` and ``python -c "import textual, sqlalchemy"``, interleaved, medians.

Prints a table. Usage:
``python benchmarks/tui.py [--samples N] [--repeats R] [--idle-s S] [--paint-repeats P]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.engine import open_engine, write_samples
from edo_monitor.store.models import Event, ModuleStat, Run
from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.data import DataSource
from edo_monitor.tui.widgets import MemoryChart

try:
    from edo_monitor.tui.widgets import build_chart
except ImportError:  # the dashboard before the chart was built off the UI thread
    build_chart = None  # type: ignore[assignment]

GIB = 1 << 30
BUDGET = 8 * GIB
SIZE = (160, 50)


def seed(path: Path, n: int) -> tuple[int, int, float]:
    """Write a running run of ``n`` samples and a finished run; returns their ids and the last
    sample time."""
    engine = open_engine(path)
    now = time.time()
    dt = 0.1
    t0 = now - n * dt
    with Session(engine) as session, session.begin():
        runs = []
        for name, status, start in (("bench-live", "running", t0), ("bench-done", "finished", t0)):
            run = Run(
                uuid=str(uuid.uuid4()),
                name=name,
                host=platform.node(),
                pid=os.getpid(),
                started_at_s=start,
                ended_at_s=None if status == "running" else start + 600,
                heartbeat_at_s=now,
                status=status,
                device_kind="cuda",
                device_name="bench device",
                device_total_bytes=BUDGET,
                budget_bytes=BUDGET,
                interval_s=dt,
                torch_version="bench",
                config={"floor": 0.2},
                tags=[],
                steps=0,
                samples_dropped=0,
            )
            session.add(run)
            session.flush()
            runs.append(run.id)
            for m in range(4):
                session.add(
                    ModuleStat(
                        run_id=run.id,
                        time_s=start,
                        step=0,
                        module=f"emb.table{m}",
                        kind="Embedding",
                        num_embeddings=100_000,
                        embedding_dim=128,
                        dtype="torch.float32",
                        device="cuda:0",
                        placement="device",
                        params_bytes=51_200_000,
                        grads_bytes=51_200_000,
                        optimizer_state_bytes=102_400_000,
                        activations_bytes=0,
                    )
                )
    live, done = runs
    batch = 1_000  # the agent writer's batch

    def rows(lo: int, hi: int, start: float) -> list[tuple[Any, ...]]:
        out = []
        for i in range(lo, hi):
            in_use = GIB + (i * 7919) % (5 * GIB)
            out.append(
                _values(
                    time_s=start + i * dt,
                    step=i,
                    allocated_bytes=int(in_use * 0.9),
                    reserved_bytes=int(in_use * 1.1),
                    in_use_bytes=in_use,
                    free_fraction=(BUDGET - in_use) / BUDGET,
                    fragmentation=0.1,
                )
            )
        return out

    with engine.begin() as conn:
        write_samples(conn, done, rows(0, 6000, t0))
    for lo in range(0, n, batch):
        with engine.begin() as conn:
            write_samples(conn, live, rows(lo, min(n, lo + batch), t0))
    engine.dispose()
    return live, done, t0 + (n - 1) * dt


def _seeded_ids(path: Path) -> tuple[int, int, float]:
    """The live and finished runs' ids and the live run's last sample time, of a seeded file."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        ids = dict(conn.execute("SELECT name, id FROM runs"))
        live, done = ids["bench-live"], ids["bench-done"]
        (t_last,) = conn.execute(
            "SELECT max(time_s) FROM samples WHERE run_id = ?", (live,)
        ).fetchone()
    finally:
        conn.close()
    return live, done, float(t_last)


def _sample_count(path: Path, run_id: int) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        (count,) = conn.execute(
            "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,)
        ).fetchone()
    finally:
        conn.close()
    return int(count)


def _values(**values: Any) -> tuple[Any, ...]:
    """A samples row as ``write_samples`` takes it (``SAMPLE_FIELDS`` order; others NULL)."""
    values = {"device_kind": "cuda", "budget_bytes": BUDGET, **values}
    return tuple(values.get(f) for f in SAMPLE_FIELDS)


def append(path: Path, run_id: int, t: float, k: int, event: bool) -> float:
    """Write 10 new samples (and one event) to the live run (another connection, as the agent)."""
    with _writer(path).begin() as conn:
        write_samples(
            conn,
            run_id,
            [
                _values(
                    time_s=t + 0.1 * (j + 1),
                    step=10**7 + k * 10 + j,
                    in_use_bytes=6 * GIB,
                    allocated_bytes=5 * GIB,
                    reserved_bytes=7 * GIB,
                    free_fraction=0.25,
                )
                for j in range(10)
            ],
        )
        if not event:
            return t + 1.0
        conn.execute(
            insert(Event.__table__),
            [
                {
                    "run_id": run_id,
                    "time_s": t + 1.0,
                    "step": 10**7 + k * 10,
                    "kind": "action",
                    "message": "bench",
                    "data": {"action": "release_cache", "bytes_saved": 1 << 20},
                }
            ],
        )
    return t + 1.0


_WRITERS: dict[Path, Any] = {}


def _writer(path: Path) -> Any:
    if path not in _WRITERS:
        _WRITERS[path] = open_engine(path)
    return _WRITERS[path]


async def bench_live(path: Path, live: int, t_last: float, repeats: int) -> dict[str, Any]:
    """Open the live view, then time ``repeats`` refreshes after new rows."""
    app = EdoTui(path, run=str(live), refresh_s=3600.0)  # refreshes are driven by hand
    out: dict[str, Any] = {}
    async with app.run_test(size=SIZE) as pilot:
        screen = app.run_screen
        start = time.perf_counter()
        while not screen.loaded:
            await asyncio.sleep(0.001)
        await pilot.pause()
        out["open_s"] = time.perf_counter() - start
        out["points"] = screen.query_one(MemoryChart).points
        chart = screen.query_one(MemoryChart)
        paints: list[tuple[float, float]] = []
        compositor_refresh = screen._compositor_refresh

        def timed_paint() -> None:
            t0 = time.perf_counter()
            compositor_refresh()
            paints.append((t0, time.perf_counter()))

        screen._compositor_refresh = timed_paint  # type: ignore[method-assign]
        refresh, refresh_event, read, render, paint = [], [], [], [], []
        run_stats, run_row = [], []
        t = t_last
        source = DataSource(path)
        for k in range(repeats):
            with_event = k % 2 == 1
            t = append(path, live, t, k, with_event)
            await pilot.pause()
            before = screen.refreshes
            tick = time.perf_counter()
            screen.tick()
            while screen.refreshes == before:
                await asyncio.sleep(0.0002)
            applied = time.perf_counter()
            while not paints or paints[-1][0] < applied:
                await asyncio.sleep(0.0002)
            (refresh_event if with_event else refresh).append(paints[-1][1] - tick)
            paint.append(paints[-1][1] - paints[-1][0])
            series = screen.series
            assert series is not None
            t1 = time.perf_counter()
            source.poll(live, series.last_id, screen.last_event_id)
            read.append(time.perf_counter() - t1)
            history = source.open()
            t1 = time.perf_counter()
            history.run(live)  # what poll read before: the row plus sample/event statistics
            run_stats.append(time.perf_counter() - t1)
            t1 = time.perf_counter()
            history.run(live, stats=False)
            run_row.append(time.perf_counter() - t1)
            t2 = time.perf_counter()
            if build_chart is not None:
                build_chart(chart.data, *chart.wanted_size)
            else:  # the chart rendered on the UI thread (plotext, in render())
                chart.render()
            render.append(time.perf_counter() - t2)
        source.close()
        out["refresh_s"] = refresh
        out["refresh_event_s"] = refresh_event
        out["read_s"] = read
        out["run_stats_s"] = run_stats
        out["run_row_s"] = run_row
        out["render_s"] = render
        out["paint_s"] = paint
        out["events"] = screen.query_one("#events").row_count  # type: ignore[attr-defined]
    return out


async def bench_idle(path: Path, run_id: int, idle_s: float, refresh_s: float) -> float:
    """CPU use (fraction of one core) with run ``run_id`` open for ``idle_s`` seconds."""
    app = EdoTui(path, run=str(run_id), refresh_s=refresh_s)
    async with app.run_test(size=SIZE) as pilot:
        while not app.run_screen.loaded:
            await asyncio.sleep(0.01)
        await pilot.pause(0.5)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(idle_s)
        cpu1, wall1 = time.process_time(), time.perf_counter()
    return (cpu1 - cpu0) / (wall1 - wall0)


def _first_paint_once(argv: list[str], marker: bytes | None) -> tuple[float, float | None]:
    """Start ``argv`` in a 160x50 pty; seconds to its first output, and to ``marker`` in the
    output (``None``: no marker; then the process is waited for). Quits the app with ``q``."""
    import fcntl
    import pty
    import select
    import signal
    import struct
    import termios

    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(argv[0], argv)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    out = bytearray()
    first = seen = None
    done = False
    deadline = t0 + 120
    while not done and time.perf_counter() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.01)
        if ready:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            if data and first is None:
                first = time.perf_counter() - t0
            out += data
            if marker is not None and seen is None and marker in out:
                seen = time.perf_counter() - t0
                os.write(fd, b"q")
        if os.waitpid(pid, os.WNOHANG)[0]:
            done = True
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    os.close(fd)
    if marker is None:
        return time.perf_counter() - t0, None
    return first if first is not None else float("nan"), seen


def bench_first_paint(path: Path, run_id: int, repeats: int) -> dict[str, list[float]]:
    """``edo-tui`` first paint against bare-interpreter baselines, interleaved."""
    python = sys.executable
    out: dict[str, list[float]] = {"python": [], "imports": [], "frame": [], "run": []}
    for _ in range(repeats):
        out["python"].append(_first_paint_once([python, "-c", "pass"], None)[0])
        out["imports"].append(
            _first_paint_once([python, "-c", "import textual.app, sqlalchemy"], None)[0]
        )
        frame, run = _first_paint_once(
            [python, "-m", "edo_monitor.tui.app", str(path), "--run", str(run_id)], b"bench-live"
        )
        out["frame"].append(frame)
        out["run"].append(run if run is not None else float("nan"))
    return out


def _p90(values: list[float]) -> str:
    return f"{1000 * sorted(values)[int(0.9 * len(values))]:.1f}"


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}"


def main() -> None:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--paint-repeats", type=int, default=7)
    parser.add_argument(
        "--seeded",
        type=Path,
        default=None,
        help="keep the seeded database here and reuse it on later runs (each run works on a "
        "copy), e.g. to compare two versions of the dashboard on the same data",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.db"
        t = time.perf_counter()
        if args.seeded is not None and args.seeded.exists():
            live, done, t_last = _seeded_ids(args.seeded)
            shutil.copyfile(args.seeded, path)
            args.samples = _sample_count(path, live)
        else:
            live, done, t_last = seed(path, args.samples)
            if args.seeded is not None:
                shutil.copyfile(path, args.seeded)
        seed_s = time.perf_counter() - t
        result = asyncio.run(bench_live(path, live, t_last, args.repeats))
        idle_done = asyncio.run(bench_idle(path, done, args.idle_s, 1.0))
        idle_live = asyncio.run(bench_idle(path, live, args.idle_s, 1.0))
        paint = bench_first_paint(path, live, args.paint_repeats)
        for engine in _WRITERS.values():
            engine.dispose()
    cpus = os.cpu_count()
    print(f"edo-tui benchmark: {args.samples:,} samples, {cpus} CPUs, {platform.python_version()}")
    print(
        f"(seeding {seed_s:.1f} s; terminal {SIZE[0]}x{SIZE[1]}; chart {result['points']} points)"
    )
    print()
    rows = [
        ("open live view (first load)", f"{1000 * result['open_s']:.1f} ms"),
        (
            f"refresh after 10 new samples (median of {len(result['refresh_s'])})",
            f"{_ms(result['refresh_s'])} ms",
        ),
        (
            f"refresh after 10 new samples + 1 event (median of {len(result['refresh_event_s'])})",
            f"{_ms(result['refresh_event_s'])} ms",
        ),
        ("  of which: read new rows (DataSource.poll, median)", f"{_ms(result['read_s'])} ms"),
        ("  of which: repaint of the screen (median)", f"{_ms(result['paint_s'])} ms"),
        ("History.run(live run) with statistics (median)", f"{_ms(result['run_stats_s'])} ms"),
        ("History.run(live run, stats=False), as poll reads it", f"{_ms(result['run_row_s'])} ms"),
        (
            "  chart built alone (build_chart in the worker; before: render())",
            f"{_ms(result['render_s'])} ms",
        ),
        ("refresh p90 (10 new samples)", f"{_p90(result['refresh_s'])} ms"),
        ("refresh p90 (10 new samples + 1 event)", f"{_p90(result['refresh_event_s'])} ms"),
        ("idle CPU, finished run open (refresh 1 s)", f"{100 * idle_done:.1f} % of one core"),
        (
            "idle CPU, live run open, no new rows (refresh 1 s)",
            f"{100 * idle_live:.1f} % of one core",
        ),
    ]
    n = len(paint["run"])
    rows += [
        (f"first paint: python -c pass (median of {n})", f"{_ms(paint['python'])} ms"),
        ('first paint: python -c "import textual.app, sqlalchemy"', f"{_ms(paint['imports'])} ms"),
        ("first paint: edo-tui, first frame", f"{_ms(paint['frame'])} ms"),
        ("first paint: edo-tui, live view with the run's data", f"{_ms(paint['run'])} ms"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"| {'measure'.ljust(width)} | result |")
    print(f"|{'-' * (width + 2)}|--------|")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value} |")


if __name__ == "__main__":
    main()
