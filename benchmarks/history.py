"""History database benchmarks: writer throughput, downsampling speed, bytes per sample.

    .venv/bin/python benchmarks/history.py [--samples 10000000] [--writer-rows 200000]
        [--short-samples 159000] [--repeats 3] [--dir /tmp/edo-bench] [--keep]

1. Writer throughput: the agent's writer (``edo_monitor.store.writer.Writer``: its thread, its
   queue, batches of 1000 through :func:`edo_monitor.store.engine.write_samples`, on a writer
   engine that keeps ``sample_rollups`` current) against raw ``sqlite3.executemany`` of the same
   rows in the same batches into the same schema, with the same durability settings (WAL,
   synchronous=NORMAL, one transaction per batch). The Writer is timed from ``start()`` to the
   end of ``close()``, its producer's ``put_sample`` calls included. Also: the Writer on an
   engine that keeps no rollups (what the rollups cost), and the other insert paths (Core
   ``insert(Sample)`` and ``insert_samples()``, whose rollups the engine folds with SQL).
   The variants run interleaved, ``--repeats`` times; medians.
   Also the time per sample of each path (1 / its rate, in µs), which splits the Writer's time into
   what raw SQLite costs, what the Writer adds without rollups, and what the rollups add.
2. ``History.samples(run, max_points=1000)`` on one run of ``--samples`` samples (0.1 s apart),
   and the best hand-written SQL for the same answer (one ``GROUP BY`` over the samples with the
   same bucket expression, using the (run_id, time_s) index); the answers are compared. When the
   run is shorter than 1000 blocks of the smallest rollup level, ``samples()`` reads the samples
   themselves and the hand-written SQL uses its raw bucket expression instead. Also a
   short run (``--short-samples``, 0.1 s apart, shorter than 1000 blocks of the smallest level),
   whose buckets are narrower than the smallest rollup level and so are read raw.
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

from sqlalchemy import event, insert
from sqlalchemy.orm import Session

import edo_monitor.store.engine as engine_mod
from edo_monitor.probes.readings import SAMPLE_FIELDS, Reading
from edo_monitor.store.engine import insert_samples, open_engine
from edo_monitor.store.history import History
from edo_monitor.store.models import Run, Sample
from edo_monitor.store.rollups import roll_up
from edo_monitor.store.schema import ROLLUP_LEVEL_WIDTHS_S

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


def _writer_run(path: Path, readings: list[Reading], *, rollups: bool) -> float:
    """Samples/s of the agent's Writer thread, from start() to the end of close()."""
    from edo_monitor.store.writer import Writer

    _fresh(path)
    engine = open_engine(path)
    run_id = _new_run(engine)
    if not rollups:
        event.remove(engine, "after_cursor_execute", engine_mod._after_execute)
        assert not engine_mod.maintains_rollups(engine)
    n = len(readings)
    w = Writer(engine, run_id, queue_size=n + 10, batch_size=BATCH, flush_interval_s=5.0)
    t = time.perf_counter()
    w.start()
    for r in readings:
        w.put_sample(r)
    w.close(timeout_s=600)
    rate = n / (time.perf_counter() - t)
    assert w.dropped == 0 and w.written["samples"] == n
    if rollups:  # every sample is in the rollups
        with engine.connect() as conn:
            mark = conn.exec_driver_sql(
                "SELECT value FROM meta WHERE key = 'rollup_through_id'"
            ).scalar()
            top = conn.exec_driver_sql("SELECT max(id) FROM samples").scalar()
        assert int(mark) == top
    engine.dispose()
    return rate


def _engine_run(path: Path, readings: list[Reading], *, core: bool, rollups: bool) -> float:
    """Samples/s of batches written through a writer engine (Core insert or insert_samples);
    the engine folds the rollups with SQL once ROLLUP_MIN_ROWS samples wait."""
    _fresh(path)
    saved = engine_mod.ROLLUP_MIN_ROWS
    engine_mod.ROLLUP_MIN_ROWS = saved if rollups else 10**18
    try:
        engine = open_engine(path)
        run_id = _new_run(engine)
        dicts = [{**r.as_dict(), "run_id": run_id} for r in readings]
        t = time.perf_counter()
        for k in range(0, len(dicts), BATCH):
            with engine.begin() as conn:
                if core:
                    conn.execute(insert(Sample), dicts[k : k + BATCH])
                else:
                    insert_samples(conn, dicts[k : k + BATCH])
        rate = len(dicts) / (time.perf_counter() - t)
        engine.dispose()
    finally:
        engine_mod.ROLLUP_MIN_ROWS = saved
    return rate


def _raw_run(path: Path, readings: list[Reading]) -> float:
    """Samples/s of raw sqlite3.executemany: same rows, same batches, same pragmas."""
    _fresh(path)
    engine = open_engine(path)
    run_id = _new_run(engine)
    engine.dispose()
    cols = ["run_id", *SAMPLE_FIELDS]
    tuples = [(run_id, *(getattr(r, f) for f in SAMPLE_FIELDS)) for r in readings]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    q = f"INSERT INTO samples ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    t = time.perf_counter()
    for k in range(0, len(tuples), BATCH):
        conn.execute("BEGIN")
        conn.executemany(q, tuples[k : k + BATCH])
        conn.execute("COMMIT")
    rate = len(tuples) / (time.perf_counter() - t)
    conn.close()
    return rate


def bench_writer(dirpath: Path, n: int, repeats: int = 3) -> dict[str, list[float]]:
    """Every insert path on the same ``n`` rows, interleaved ``repeats`` times."""
    rng = random.Random(0)
    readings = [_reading(i, rng) for i in range(n)]
    runs: dict[str, Any] = {
        "raw": lambda: _raw_run(dirpath / "raw.db", readings),
        "writer": lambda: _writer_run(dirpath / "writer.db", readings, rollups=True),
        "writer_no_rollups": lambda: _writer_run(dirpath / "writer0.db", readings, rollups=False),
        "fast": lambda: _engine_run(dirpath / "fast.db", readings, core=False, rollups=True),
        "fast_no_rollups": lambda: _engine_run(
            dirpath / "fast0.db", readings, core=False, rollups=False
        ),
        "core": lambda: _engine_run(dirpath / "core.db", readings, core=True, rollups=True),
    }
    results: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for key, fn in runs.items():
            results[key].append(fn())
    return results


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


def bucket_expression(span_s: float, lo_s: float, bucket_s: float) -> tuple[str, dict[str, Any]]:
    """The bucket of a sample as ``History.samples(max_points=1000)`` forms it (SQL, parameters).

    With a rollup level of width ``w`` that fits 1000 times in the span: blocks of ``w`` seconds
    aligned on the epoch, ``bucket_s / w`` of them a bucket. Without one (a run shorter than 1000
    blocks of the smallest level): ``bucket_s``-wide buckets counted from the first sample, the
    last sample joining the last bucket.
    """
    fits = [w for w in ROLLUP_LEVEL_WIDTHS_S if w <= span_s / 1000]
    if fits:
        width = max(fits)
        return "CAST(time_s / :w AS INTEGER) / :m", {"w": width, "m": round(bucket_s / width)}
    return "min(CAST((time_s - :lo) / :w AS INTEGER), 999)", {"lo": lo_s, "w": bucket_s}


def handwritten(
    path: Path, run_id: int, bucket: str, params: dict[str, Any], cols: list[str]
) -> list[tuple]:
    """One ``GROUP BY`` over the samples: count, first/last time, min/max/avg of ``cols``."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    agg = ", ".join(f"min({c}), max({c}), avg({c})" for c in cols)
    q = (
        f"SELECT {bucket} AS b, count(*), min(time_s), max(time_s), {agg} FROM samples "
        "WHERE run_id = :run_id GROUP BY b ORDER BY b"
    )
    rows = conn.execute(q, {**params, "run_id": run_id}).fetchall()
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


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}"


def bench_reads(path: Path, n: int, repeats: int = 5) -> dict[str, Any]:
    """``samples()`` (3 and all columns), ``run()`` with and without statistics, ``peak()``."""
    out: dict[str, Any] = {}
    with History(path) as h:
        run_id = out["run_id"] = h.runs()[0].id
        h.samples(run_id, columns=COLS, max_points=1000)  # warm the page cache
        out["cols"], out["series"] = timed(
            lambda: h.samples(run_id, columns=COLS, max_points=1000), repeats
        )
        out["all"], _ = timed(lambda: h.samples(run_id, max_points=1000), repeats)
        out["run"], out["info"] = timed(lambda: h.run(run_id), repeats)
        out["run_row"], _ = timed(lambda: h.run(run_id, stats=False), repeats)
        out["peak"], _ = timed(lambda: h.peak(run_id), repeats)
    assert out["info"].sample_count == n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--writer-rows", type=int, default=200_000)
    ap.add_argument("--short-samples", type=int, default=159_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/edo-bench"))
    ap.add_argument("--keep", action="store_true", help="reuse the big database if present")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)

    w = bench_writer(args.dir, args.writer_rows, args.repeats)
    ratio = {k: [a / b for a, b in zip(v, w["raw"], strict=True)] for k, v in w.items()}
    # rollup upkeep per sample: the Writer with and without rollups, against one raw insert
    upkeep = [
        (1 / a - 1 / b) * c
        for a, b, c in zip(w["writer"], w["writer_no_rollups"], w["raw"], strict=True)
    ]
    big = args.dir / f"big-{args.samples}.db"
    t = time.perf_counter()
    if not (args.keep and big.exists()):
        build_big(big, args.samples)
    build_s = time.perf_counter() - t
    size = big.stat().st_size
    r = bench_reads(big, args.samples)
    s = r["series"]
    span = (args.samples - 1) * 0.1
    big_raw = span / 1000 < ROLLUP_LEVEL_WIDTHS_S[0]
    t_hand, ref = float("nan"), []
    if s.downsampled:
        bucket, params = bucket_expression(span, 1.7e9, s.bucket_s)
        t_hand, ref = timed(lambda: handwritten(big, r["run_id"], bucket, params, COLS), 1)
    same = (
        s.downsampled
        and len(ref) == len(s)
        and all(
            r_[1] == s.count[i]
            and r_[4] == s.min[COLS[0]][i]
            and r_[5] == s.max[COLS[0]][i]
            and abs(r_[6] - s.mean[COLS[0]][i]) <= 1e-6 * abs(r_[6])
            for i, r_ in enumerate(ref)
        )
    )
    short = args.dir / f"short-{args.short_samples}.db"
    if not (args.keep and short.exists()):
        build_big(short, args.short_samples)
    rs = bench_reads(short, args.short_samples)
    short_span = (args.short_samples - 1) * 0.1
    raw_path = short_span / 1000 < ROLLUP_LEVEL_WIDTHS_S[0]

    rows = [
        ("Writer thread (write_samples + Python rollups), samples/s", _med(w["writer"])),
        ("Writer thread, engine keeping no rollups, samples/s", _med(w["writer_no_rollups"])),
        ("insert_samples() + SQL rollup fold, samples/s", _med(w["fast"])),
        ("insert_samples(), rollups off, samples/s", _med(w["fast_no_rollups"])),
        ("Core insert(Sample) + SQL rollup fold, samples/s", _med(w["core"])),
        ("raw sqlite3.executemany samples/s", _med(w["raw"])),
    ]
    ratios = [
        ("ratio to raw: Writer (rollups on)", "writer"),
        ("ratio to raw: Writer, no rollups", "writer_no_rollups"),
        ("ratio to raw: insert_samples() + SQL rollups", "fast"),
        ("ratio to raw: insert_samples(), rollups off", "fast_no_rollups"),
        ("ratio to raw: Core insert + SQL rollups", "core"),
    ]
    per_sample = [
        ("raw sqlite3.executemany, µs per sample", "raw"),
        ("Writer thread, no rollups, µs per sample", "writer_no_rollups"),
        ("Writer thread, rollups on, µs per sample", "writer"),
    ]
    table = [(a, f"{b:,.0f}") for a, b in rows]
    table += [(a, f"{_med(ratio[k]):.2f} (runs {_span(ratio[k])})") for a, k in ratios]
    table += [(a, f"{1e6 / _med(w[k]):.2f}") for a, k in per_sample]
    table += [
        ("rollup upkeep per sample / raw insert per sample", f"{_med(upkeep):.2f}"),
        (
            f"samples(max_points=1000), 3 columns, {args.samples:,} samples "
            f"({'raw' if big_raw else 'rollups'})",
            f"{r['cols']:.3f} s",
        ),
        ("samples(max_points=1000), all 26 columns", f"{r['all']:.3f} s"),
        (
            "hand-written GROUP BY, same answer, 3 columns",
            f"{t_hand:.3f} s" if s.downsampled else "-",
        ),
        (
            "hand-written SQL time / samples() time",
            f"{t_hand / r['cols']:,.1f}x" if s.downsampled else "-",
        ),
        (
            "same answer as hand-written SQL",
            ("yes" if same else "NO") if s.downsampled else "n/a (<= 1000 samples: returned raw)",
        ),
        ("run(): summary incl. peaks", f"{r['run'] * 1000:.1f} ms"),
        ("run(stats=False): the row only", f"{r['run_row'] * 1000:.2f} ms"),
        ("peak() with its time", f"{r['peak'] * 1000:.1f} ms"),
        ("database bytes per sample (incl. indexes, rollups)", f"{size / args.samples:.0f}"),
        (
            "points returned / bucket width",
            f"{len(s)} / {s.bucket_s:g} s" if s.downsampled else f"{len(s)} / raw samples",
        ),
        (
            f"short run, {args.short_samples:,} samples ({short_span:,.0f} s, "
            f"{'raw' if raw_path else 'rollups'}): samples(max_points=1000), 3 / 26 columns",
            f"{rs['cols']:.3f} s / {rs['all']:.3f} s",
        ),
        (
            "short run: run() / run(stats=False)",
            f"{rs['run'] * 1000:.1f} / {rs['run_row'] * 1000:.2f} ms",
        ),
        ("building the big database", f"{build_s:.0f} s"),
    ]
    width_l = max(len(a) for a, _ in table)
    print(f"History database benchmark — {machine()}")
    print(f"{datetime.date.today().isoformat()}; rollup levels {ROLLUP_LEVEL_WIDTHS_S} s")
    for a, b in table:
        print(f"  {a:<{width_l}}  {b}")


if __name__ == "__main__":
    main()
