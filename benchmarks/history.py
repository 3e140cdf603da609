"""History database benchmarks: writer throughput, downsampling speed, bytes per sample.

    .venv/bin/python benchmarks/history.py [--samples 10000000] [--writer-rows 200000]
        [--dir /tmp/edo-bench] [--keep]

1. Writer throughput: the agent's writer (``edo_monitor.store.writer.Writer``: bounded queue,
   batches of 1000, Core ``insert(Sample)`` executemany per flush, on a writer engine that also
   maintains ``sample_rollups``) against raw ``sqlite3.executemany`` of the same rows in the same
   batches into the same schema and pragmas (WAL, synchronous=NORMAL). Also the Core insert path
   with rollup maintenance switched off, to show what the rollups cost.
2. ``History.samples(run, max_points=1000)`` on one run of ``--samples`` samples (0.1 s apart),
   and the best hand-written SQL for the same answer (one ``GROUP BY`` over the samples with the
   same bucket expression, using the (run_id, time_s) index); the answers are compared.
3. Database bytes per sample (samples + indexes + rollups, after a checkpoint).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

import edo_monitor.store.engine as engine_mod
from edo_monitor.readings import SAMPLE_FIELDS, Reading
from edo_monitor.store.engine import insert_samples, open_engine, roll_up
from edo_monitor.store.history import History
from edo_monitor.store.schema import ROLLUP_LEVEL_WIDTHS_S, Run, Sample

BATCH = 1000
COLS = ["in_use_bytes", "free_fraction", "allocated_bytes"]


def _fresh(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _new_run(engine: Any, interval_s: float = 0.1) -> int:
    with Session(engine) as s, s.begin():
        run = Run(
            uuid=str(uuid.uuid4()),
            name="bench",
            host="bench",
            pid=0,
            started_at_s=1.7e9,
            ended_at_s=None,
            status="finished",
            device_kind="cuda",
            interval_s=interval_s,
            torch_version="bench",
            config={},
            tags=[],
            steps=0,
            samples_dropped=0,
        )
        s.add(run)
        s.flush()
        return run.id


def _reading(i: int, rng: random.Random, t0: float = 1.7e9, dt: float = 0.1) -> Reading:
    total = 80 * 2**30
    alloc = rng.randint(10, 70) * 2**30 + rng.randint(0, 2**20)
    return Reading(
        time_s=t0 + i * dt,
        step=i // 4,
        device_kind="cuda",
        device_total_bytes=total,
        device_used_bytes=alloc + 2**30,
        device_free_bytes=total - alloc - 2**30,
        process_device_bytes=alloc + 2**29,
        nvml_memory_info_version=2,
        allocated_bytes=alloc,
        reserved_bytes=alloc + 2**28,
        active_bytes=alloc,
        inactive_split_bytes=2**20,
        reserved_unallocated_bytes=2**28,
        peak_allocated_bytes=70 * 2**30,
        num_alloc_retries=0,
        num_ooms=0,
        fragmentation=rng.random() / 10,
        largest_inactive_block_bytes=2**20,
        segment_count=120,
        params_bytes=8 * 2**30,
        grads_bytes=8 * 2**30,
        optimizer_state_bytes=16 * 2**30,
        activations_bytes=rng.randint(1, 20) * 2**30,
        host_tier_bytes=0,
        budget_bytes=total,
        in_use_bytes=alloc,
        free_fraction=(total - alloc) / total,
        process_rss_bytes=12 * 2**30,
        host_available_bytes=100 * 2**30,
    )


def bench_writer(dirpath: Path, n: int, repeats: int = 3) -> dict[str, float]:
    rng = random.Random(0)
    readings = [_reading(i, rng) for i in range(n)]
    cols = ["run_id", *SAMPLE_FIELDS]
    results: dict[str, list[float]] = {
        "writer": [],
        "core_no_rollups": [],
        "fast": [],
        "fast_no_rollups": [],
        "raw": [],
    }
    for _ in range(repeats):
        # -- the agent's writer thread
        path = dirpath / "writer.db"
        _fresh(path)
        engine = open_engine(path)
        run_id = _new_run(engine)
        try:
            from edo_monitor.store.writer import Writer

            w = Writer(engine, run_id, queue_size=n + 10, batch_size=BATCH, flush_interval_s=5.0)
            t = time.perf_counter()
            w.start()
            for r in readings:
                w.put_sample(r)
            w.close(timeout_s=600)
            results["writer"].append(n / (time.perf_counter() - t))
            assert w.dropped == 0 and w.written["samples"] == n
        except ImportError:  # no writer module: its insert path, Core executemany per batch
            dicts = [{**r.as_dict(), "run_id": run_id} for r in readings]
            t = time.perf_counter()
            for k in range(0, n, BATCH):
                with engine.begin() as conn:
                    conn.execute(insert(Sample), dicts[k : k + BATCH])
            results["writer"].append(n / (time.perf_counter() - t))
        engine.dispose()
        # -- Core insert without rollup maintenance
        path = dirpath / "core.db"
        _fresh(path)
        saved = engine_mod.ROLLUP_MIN_ROWS
        engine_mod.ROLLUP_MIN_ROWS = 10**18
        engine = open_engine(path)
        run_id = _new_run(engine)
        dicts = [{**r.as_dict(), "run_id": run_id} for r in readings]
        t = time.perf_counter()
        for k in range(0, n, BATCH):
            with engine.begin() as conn:
                conn.execute(insert(Sample), dicts[k : k + BATCH])
        results["core_no_rollups"].append(n / (time.perf_counter() - t))
        engine.dispose()
        engine_mod.ROLLUP_MIN_ROWS = saved
        # -- insert_samples (positional executemany through the engine), with and without rollups
        for key, min_rows in (("fast", saved), ("fast_no_rollups", 10**18)):
            path = dirpath / f"{key}.db"
            _fresh(path)
            engine_mod.ROLLUP_MIN_ROWS = min_rows
            engine = open_engine(path)
            run_id = _new_run(engine)
            dicts = [{**r.as_dict(), "run_id": run_id} for r in readings]
            t = time.perf_counter()
            for k in range(0, n, BATCH):
                with engine.begin() as conn:
                    insert_samples(conn, dicts[k : k + BATCH])
            results[key].append(n / (time.perf_counter() - t))
            engine.dispose()
            engine_mod.ROLLUP_MIN_ROWS = saved
        # -- raw sqlite3.executemany, same rows, same batches, same pragmas
        path = dirpath / "raw.db"
        _fresh(path)
        engine = open_engine(path)
        run_id = _new_run(engine)
        engine.dispose()
        tuples = [(run_id, *(getattr(r, f) for f in SAMPLE_FIELDS)) for r in readings]
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        q = f"INSERT INTO samples ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        t = time.perf_counter()
        for k in range(0, n, BATCH):
            conn.execute("BEGIN")
            conn.executemany(q, tuples[k : k + BATCH])
            conn.execute("COMMIT")
        results["raw"].append(n / (time.perf_counter() - t))
        conn.close()
    return {k: statistics.median(v) for k, v in results.items()}


def build_big(path: Path, n: int) -> int:
    """One run of ``n`` samples 0.1 s apart, written with executemany, rolled up as it grows."""
    _fresh(path)
    engine = open_engine(path)
    run_id = _new_run(engine)
    engine.dispose()
    rng = random.Random(1)
    proto = [_reading(i, rng) for i in range(4096)]
    cols = ["run_id", *SAMPLE_FIELDS]
    q = f"INSERT INTO samples ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = OFF")
    chunk = 200_000
    for k in range(0, n, chunk):
        rows = []
        for i in range(k, min(n, k + chunk)):
            r = proto[(i * 2654435761) % 4096]
            vals = [getattr(r, f) for f in SAMPLE_FIELDS]
            vals[0] = 1.7e9 + i * 0.1
            vals[1] = i // 4
            # a slow trend plus the prototype's noise, so buckets differ
            vals[SAMPLE_FIELDS.index("in_use_bytes")] += (i % 1_000_003) * 1024
            rows.append((run_id, *vals))
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(q, rows)
        roll_up(conn)
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return run_id


def handwritten(path: Path, run_id: int, width: int, m: int, cols: list[str]) -> list[tuple]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    agg = ", ".join(f"min({c}), max({c}), avg({c})" for c in cols)
    q = (
        f"SELECT CAST(time_s / {width} AS INTEGER) / {m} AS b, count(*), min(time_s), "
        f"max(time_s), {agg} FROM samples WHERE run_id = ? GROUP BY b ORDER BY b"
    )
    rows = conn.execute(q, (run_id,)).fetchall()
    conn.close()
    return rows


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln), "?"
        )
    except OSError:
        model = platform.processor() or "?"
    py, lite = platform.python_version(), sqlite3.sqlite_version
    return f"{model}, {os.cpu_count()} cores, Python {py}, SQLite {lite}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--writer-rows", type=int, default=200_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/edo-bench"))
    ap.add_argument("--keep", action="store_true", help="reuse the big database if present")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)

    w = bench_writer(args.dir, args.writer_rows)
    big = args.dir / f"big-{args.samples}.db"
    t = time.perf_counter()
    if not (args.keep and big.exists()):
        build_big(big, args.samples)
    build_s = time.perf_counter() - t
    size = big.stat().st_size

    with History(big) as h:
        run_id = h.runs()[0].id
        h.samples(run_id, columns=COLS, max_points=1000)  # warm the page cache
        t_cols, s = timed(lambda: h.samples(run_id, columns=COLS, max_points=1000), 5)
        t_all, _ = timed(lambda: h.samples(run_id, max_points=1000), 5)
        t_run, info = timed(lambda: h.run(run_id), 5)
        t_peak, _ = timed(lambda: h.peak(run_id), 5)
    span = (args.samples - 1) * 0.1
    width = max(x for x in ROLLUP_LEVEL_WIDTHS_S if x <= span / 1000)
    m = round(s.bucket_s / width)
    t_hand, ref = timed(lambda: handwritten(big, run_id, width, m, COLS), 1)
    same = len(ref) == len(s) and all(
        r[1] == s.count[i]
        and r[4] == s.min[COLS[0]][i]
        and r[5] == s.max[COLS[0]][i]
        and abs(r[6] - s.mean[COLS[0]][i]) <= 1e-6 * abs(r[6])
        for i, r in enumerate(ref)
    )

    rows = [
        ("writer (Writer thread, batches of 1000) samples/s", f"{w['writer']:,.0f}"),
        ("Core insert(Sample), rollups off, samples/s", f"{w['core_no_rollups']:,.0f}"),
        ("insert_samples() + rollups, samples/s", f"{w['fast']:,.0f}"),
        ("insert_samples(), rollups off, samples/s", f"{w['fast_no_rollups']:,.0f}"),
        ("raw sqlite3.executemany samples/s", f"{w['raw']:,.0f}"),
        ("ratio to raw: Writer as is", f"{w['writer'] / w['raw']:.2f}"),
        ("ratio to raw: Core insert, rollups off", f"{w['core_no_rollups'] / w['raw']:.2f}"),
        ("ratio to raw: insert_samples() + rollups", f"{w['fast'] / w['raw']:.2f}"),
        ("ratio to raw: insert_samples(), rollups off", f"{w['fast_no_rollups'] / w['raw']:.2f}"),
        (f"samples(max_points=1000), 3 columns, {args.samples:,} samples", f"{t_cols:.3f} s"),
        ("samples(max_points=1000), all 26 columns", f"{t_all:.3f} s"),
        ("hand-written GROUP BY, same answer, 3 columns", f"{t_hand:.2f} s"),
        ("speed-up over hand-written SQL", f"{t_hand / t_cols:,.0f}x"),
        ("same answer as hand-written SQL", "yes" if same else "NO"),
        ("run(): summary incl. peaks", f"{t_run * 1000:.1f} ms"),
        ("peak() with its time", f"{t_peak * 1000:.1f} ms"),
        ("database bytes per sample (incl. indexes, rollups)", f"{size / args.samples:.0f}"),
        ("points returned / bucket width", f"{len(s)} / {s.bucket_s:g} s"),
        ("building the big database", f"{build_s:.0f} s"),
    ]
    width_l = max(len(a) for a, _ in rows)
    print(f"History database benchmark — {machine()}")
    print(f"{datetime.date.today().isoformat()}")
    for a, b in rows:
        print(f"  {a:<{width_l}}  {b}")
    assert info.sample_count == args.samples


if __name__ == "__main__":
    main()
