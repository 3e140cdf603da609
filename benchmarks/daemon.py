"""CPU cost of ``edo-monitor daemon`` at its default 1 Hz, on the fake NVML.

    .venv/bin/python benchmarks/daemon.py [--seconds 30] [--interval 1.0] [--pg URL]

After a short warm-up run (not shown), each configuration (GPUs × processes per GPU) runs the
real daemon (:func:`run_daemon`: the sampling loop on the main thread, the
:class:`DeviceWriter` thread writing to a fresh SQLite file, or PostgreSQL with ``--pg``) for
``--seconds`` at ``--interval``, and measures the process's
CPU time (user + system, every thread: ``resource.getrusage(RUSAGE_SELF)``).
The fake NVML answers at once, so the figure is the daemon's own cost (Python, psutil, SQLite),
not the driver's; a real driver adds its query time (docs/benchmarks.md). Processes are real
PIDs of this machine (``psutil.pids()``), so their names are real psutil reads (read once per
PID, while it stays on the GPU).

Columns: samples taken; CPU milliseconds per sample in the steady state (all threads, from the
first sample to the end of the close, the final flush included); of which ``Daemon.sample()``
(main thread's CPU time inside it: NVML reads, rows built, queued); % of one core at the
interval (CPU per sample / interval); the start's CPU seconds (database created and migrated,
device list read: once per daemon start); the database's growth per sample (SQLite: file + WAL
after a checkpoint, less a fresh empty database) and per day at that rate.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fakes.nvml import FakeGpu, FakeNvml

from edo_monitor.surfaces.daemon import Daemon, run_daemon


def _cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _gpus(n_gpus: int, per_gpu: int) -> list[FakeGpu]:
    pids = sorted(psutil_pids())[: n_gpus * per_gpu]
    while len(pids) < n_gpus * per_gpu:  # fewer processes here than asked: made-up PIDs
        pids.append(4_000_000 + len(pids))
    return [
        FakeGpu(
            f"GPU-{g:08x}-0000-0000-0000-000000000000",
            processes=[(pid, 100_000_000 + 4096 * k) for k, pid in enumerate(pids[g::n_gpus])],
        )
        for g in range(n_gpus)
    ]


def psutil_pids() -> list[int]:
    import psutil

    return psutil.pids()


class _Timed(Daemon):
    """A daemon that adds up the main thread's CPU time inside ``sample()``."""

    sample_cpu_s = 0.0

    def sample(self) -> int:
        t = time.thread_time()
        try:
            return super().sample()
        finally:
            self.sample_cpu_s += time.thread_time() - t


def measure(n_gpus: int, per_gpu: int, seconds: float, interval_s: float, db: str) -> dict:
    """One configuration; the figures of one row of the table."""
    nvml = FakeNvml(_gpus(n_gpus, per_gpu))
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    holder: dict[str, _Timed] = {}

    marks: dict[str, float] = {}

    def ready(d: Daemon) -> None:
        holder["d"] = d  # type: ignore[assignment]
        marks["ready"] = _cpu_s()
        timer.start()

    import edo_monitor.surfaces.daemon as module

    original = module.Daemon
    module.Daemon = _Timed  # type: ignore[misc]
    cpu0 = _cpu_s()
    try:
        result = run_daemon(db, interval_s=interval_s, nvml=nvml, stop=stop, on_ready=ready)
    finally:
        module.Daemon = original  # type: ignore[misc]
    cpu_end = _cpu_s()
    cpu = cpu_end - marks["ready"]  # steady state: from the first sample to the end of close()
    start_cpu = marks["ready"] - cpu0  # the database created, migrations, the device list
    assert sum(result.not_written.values()) == 0, result
    assert result.written["process_samples"] == result.samples * n_gpus * per_gpu, result
    size = None
    if "://" not in db:
        import sqlite3

        con = sqlite3.connect(db)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.close()
        size = _size(db) - _empty_size(Path(db).parent / "empty.db")
    per_sample = cpu / result.samples
    return {
        "config": f"{n_gpus} GPU x {per_gpu} proc",
        "samples": result.samples,
        "cpu_per_sample_ms": 1e3 * per_sample,
        "sample_ms": 1e3 * holder["d"].sample_cpu_s / result.samples,
        "core_pct": 100 * per_sample / interval_s,
        "bytes_per_sample": None if size is None else size / result.samples,
        "start_cpu_s": start_cpu,
        "interval_s": interval_s,
    }


def _size(db: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(db).parent.glob(Path(db).name + "*"))


def _empty_size(path: Path) -> int:
    """Bytes of a fresh history database (every table, no rows), checkpointed."""
    import sqlite3

    from edo_monitor.store.engine import open_engine

    if not path.exists():
        open_engine(path).dispose()
        con = sqlite3.connect(path)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.close()
    return _size(path)


def _fresh_schema(url_text: str) -> tuple[str, Any]:
    """A URL whose tables live in a new schema of the server's database, and what drops it."""
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(url_text)
    schema = f"edo_daemon_bench_{uuid.uuid4().hex[:8]}"
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    full = url.update_query_dict({"options": f"-csearch_path={schema}"})
    return full.render_as_string(hide_password=False), drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="per configuration")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument(
        "--pg", default=None, help="also on this PostgreSQL URL (in a fresh schema, dropped after)"
    )
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"# benchmarks/daemon.py --seconds {args.seconds:g} --interval {args.interval:g}; "
        f"{datetime.date.today()}; commit {commit or '?'}; {platform.processor() or '?'} "
        f"({os.cpu_count()} cores), Python {platform.python_version()}"
    )
    configs = [(1, 8), (8, 8)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        # warm-up, not shown: first imports, SQLAlchemy's statement compilation, psutil
        measure(1, 8, min(3.0, args.seconds), args.interval, str(Path(tmp) / "warm.db"))
        for n_gpus, per_gpu in configs:
            db = str(Path(tmp) / f"d{n_gpus}x{per_gpu}.db")
            out.append(("sqlite", measure(n_gpus, per_gpu, args.seconds, args.interval, db)))
        if args.pg:
            url, drop = _fresh_schema(args.pg)
            try:
                out.append(("postgres", measure(8, 8, args.seconds, args.interval, url)))
            finally:
                drop()
    print()
    print(
        "| database | config | samples | CPU / sample (ms) | of which sample() (ms) | "
        "% of one core | start (CPU s) | DB bytes / sample | MB / day |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for backend, r in out:
        per = r["bytes_per_sample"]
        day = "-" if per is None else f"{per * 86_400 / r['interval_s'] / 1e6:,.0f}"
        print(
            f"| {backend} | {r['config']} | {r['samples']} | {r['cpu_per_sample_ms']:.2f} | "
            f"{r['sample_ms']:.2f} | {r['core_pct']:.3f} | {r['start_cpu_s']:.2f} | "
            f"{'-' if per is None else f'{per:,.0f}'} | {day} |"
        )


if __name__ == "__main__":
    main()
