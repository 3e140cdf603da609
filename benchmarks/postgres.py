"""PostgreSQL history benchmarks: the agent's writer against raw COPY / executemany, and a
1,000-point query on a 10,000,000-sample run.

    .venv/bin/python benchmarks/postgres.py [--url postgresql+psycopg://postgres@127.0.0.1:5432/test]
        [--writer-rows 50000] [--samples 10000000] [--repeats 3] [--keep]

1. Writer throughput: the agent's writer (``edo_monitor.store.writer.Writer``: its thread, its
   queue, batches of 1000 through :func:`edo_monitor.store.engine.write_samples`, which on
   PostgreSQL also folds each batch into ``sample_rollups`` and moves the run's mark) against
   raw psycopg of the same rows in the same batches, one transaction per batch: ``COPY samples
   FROM STDIN`` and ``executemany`` of ``INSERT``. Each variant writes into a fresh schema;
   the variants run interleaved, ``--repeats`` times; medians, and the writer's rate as a
   fraction of each raw path's.
2. ``History.samples(run, max_points=1000)`` on one run of ``--samples`` samples (0.1 s apart),
   generated on the server (``INSERT … SELECT … FROM generate_series``, not through the agent)
   and rolled up with :func:`edo_monitor.store.engine.roll_up` (timed too); best of 5, against
   one hand-written ``GROUP BY`` over the samples for the same buckets (the answers agree).
   ``--keep`` reuses the big run's schema when it is there.
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from history import BATCH, COLS, _new_run, _reading, machine, timed
from sqlalchemy import text
from sqlalchemy.engine import URL, make_url

from edo_monitor.probes.readings import SAMPLE_FIELDS, Reading
from edo_monitor.store.engine import open_engine
from edo_monitor.store.history import History
from edo_monitor.store.rollups import roll_up
from edo_monitor.store.schema import ROLLUP_LEVEL_WIDTHS_S

BIG_SCHEMA = "edo_bench_big"


def _dsn(url: URL) -> str:
    return url.set(drivername="postgresql").set(query={}).render_as_string(hide_password=False)


def _schema_url(url: URL, schema: str, *, fresh: bool = True) -> str:
    with psycopg.connect(_dsn(url), autocommit=True) as conn:
        if fresh:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    full = url.update_query_dict({"options": f"-csearch_path={schema}"})
    return full.render_as_string(hide_password=False)


def _drop(url: URL, schema: str) -> None:
    with psycopg.connect(_dsn(url), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _writer_run(url: URL, readings: list[Reading]) -> float:
    """Samples/s of the agent's Writer thread, from start() to the end of close()."""
    from edo_monitor.store.writer import Writer

    schema = f"edo_bench_{uuid.uuid4().hex[:8]}"
    engine = open_engine(_schema_url(url, schema))
    run_id = _new_run(engine)
    n = len(readings)
    w = Writer(engine, run_id, queue_size=n + 10, batch_size=BATCH, flush_interval_s=5.0)
    t = time.perf_counter()
    w.start()
    for r in readings:
        w.put_sample(r)
    w.close(timeout_s=600)
    rate = n / (time.perf_counter() - t)
    assert w.dropped == 0 and w.written["samples"] == n
    with engine.connect() as conn:  # every sample is in the rollups
        rolled = conn.execute(text("SELECT sum(n) FROM sample_rollups WHERE level = 0")).scalar()
    assert rolled == n, (rolled, n)
    engine.dispose()
    _drop(url, schema)
    return rate


def _raw_run(url: URL, readings: list[Reading], *, copy: bool) -> float:
    """Samples/s of raw psycopg (COPY or executemany): same rows, same batches."""
    schema = f"edo_bench_{uuid.uuid4().hex[:8]}"
    full = _schema_url(url, schema)
    engine = open_engine(full)
    run_id = _new_run(engine)
    engine.dispose()
    cols = ["run_id", *SAMPLE_FIELDS]
    tuples = [(run_id, *(getattr(r, f) for f in SAMPLE_FIELDS)) for r in readings]
    q = f"INSERT INTO samples ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})"
    with psycopg.connect(_dsn(url), options=f"-csearch_path={schema}") as conn:
        t = time.perf_counter()
        for k in range(0, len(tuples), BATCH):
            with conn.transaction(), conn.cursor() as cur:
                if copy:
                    with cur.copy(f"COPY samples ({', '.join(cols)}) FROM STDIN") as cp:
                        for row in tuples[k : k + BATCH]:
                            cp.write_row(row)
                else:
                    cur.executemany(q, tuples[k : k + BATCH])
        rate = len(tuples) / (time.perf_counter() - t)
    _drop(url, schema)
    return rate


def bench_writer(url: URL, n: int, repeats: int) -> dict[str, list[float]]:
    rng = random.Random(0)
    readings = [_reading(i, rng) for i in range(n)]
    runs: dict[str, Any] = {
        "copy": lambda: _raw_run(url, readings, copy=True),
        "executemany": lambda: _raw_run(url, readings, copy=False),
        "writer": lambda: _writer_run(url, readings),
    }
    out: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            out[name].append(fn())
    return out


#: Per sample column, the SQL that generates it from ``i`` (0 … n-1) and ``r`` (a random()).
def _generated(run_id: int) -> dict[str, str]:
    gib = 2**30
    total = 80 * gib
    alloc = f"(10 + floor(r * 60))::bigint * {gib}"
    return {
        "run_id": str(run_id),
        "time_s": "1.7e9 + i * 0.1",
        "step": "i / 4",
        "device_kind": "'cuda'",
        "device_total_bytes": str(total),
        "device_used_bytes": f"{alloc} + {gib}",
        "allocated_bytes": alloc,
        "reserved_bytes": f"{alloc} + {2**28}",
        "in_use_bytes": alloc,
        "free_fraction": f"({total} - {alloc})::float8 / {total}",
        "fragmentation": "r / 10",
        "activations_bytes": f"(1 + floor(r * 20))::bigint * {gib}",
        "params_bytes": str(8 * gib),
        "budget_bytes": str(total),
        "process_rss_bytes": str(12 * gib),
        "host_available_bytes": str(100 * gib),
    }


def build_big(url: URL, n: int, keep: bool) -> tuple[str, int, dict[str, float]]:
    """The big run (generated on the server, then rolled up); its URL, id and build times."""
    full = _schema_url(url, BIG_SCHEMA, fresh=not keep)
    engine = open_engine(full)
    times: dict[str, float] = {}
    with engine.connect() as conn:
        have = conn.execute(text("SELECT count(*) FROM samples")).scalar()
        run_id = conn.execute(text("SELECT min(id) FROM runs")).scalar()
    if have == n and run_id is not None:
        with engine.begin() as conn:
            conn.execute(text("ANALYZE"))
        engine.dispose()
        return full, int(run_id), times
    engine.dispose()
    full = _schema_url(url, BIG_SCHEMA, fresh=True)
    engine = open_engine(full)
    run_id = _new_run(engine)
    gen = _generated(run_id)
    sql = (
        f"INSERT INTO samples ({', '.join(gen)}) SELECT {', '.join(gen.values())} FROM "
        f"(SELECT i, random() AS r FROM generate_series(0, {n - 1}) AS i) AS g"
    )
    t = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(text("SELECT setseed(0)"))
        conn.execute(text(sql))
    times["generate"] = time.perf_counter() - t
    t = time.perf_counter()
    with engine.begin() as conn:
        assert roll_up(conn) == n
    times["roll_up"] = time.perf_counter() - t
    with engine.begin() as conn:  # committed: a rolled-back ANALYZE leaves no statistics
        conn.execute(text("ANALYZE"))
    engine.dispose()
    return full, run_id, times


def handwritten(full: str, run_id: int, width: float, m: int, cols: list[str]) -> list[tuple]:
    """One GROUP BY over the samples for the same buckets (blocks of ``width`` s, ``m`` per
    bucket)."""
    agg = ", ".join(f"min({c}), max({c}), avg({c}), count({c})" for c in cols)
    q = (
        f"SELECT trunc(time_s / {width})::bigint / {m} AS b, count(*), {agg} FROM samples "
        "WHERE run_id = :r GROUP BY b ORDER BY b"
    )
    engine = open_engine(full, readonly=True)
    with engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(text(q), {"r": run_id})]
    engine.dispose()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    ap.add_argument("--writer-rows", type=int, default=50_000)
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="reuse the big run if present")
    args = ap.parse_args()
    url = make_url(args.url)
    with psycopg.connect(_dsn(url)) as conn:
        server = conn.execute("SHOW server_version").fetchone()[0]

    w = bench_writer(url, args.writer_rows, args.repeats)
    med = {k: statistics.median(v) for k, v in w.items()}
    full, run_id, build = build_big(url, args.samples, args.keep)
    with History(full) as h:
        h.samples(run_id, columns=COLS, max_points=1000)  # warm the cache
        t_cols, series = timed(lambda: h.samples(run_id, columns=COLS, max_points=1000), 5)
        t_all, _ = timed(lambda: h.samples(run_id, max_points=1000), 5)
        t_run, info = timed(lambda: h.run(run_id), 5)
        t_peak, _ = timed(lambda: h.peak(run_id), 5)
    span_s = (args.samples - 1) * 0.1
    width = max(w for w in ROLLUP_LEVEL_WIDTHS_S if w <= span_s / 1000)  # the level samples() used
    m = round(series.bucket_s / width)
    t = time.perf_counter()
    ref = handwritten(full, run_id, width, m, COLS)
    t_hand = time.perf_counter() - t
    assert info.sample_count == args.samples
    assert [r[1] for r in ref] == series.count, "rollup buckets differ from the GROUP BY"
    assert [r[3] for r in ref] == series.max[COLS[0]]

    print(f"PostgreSQL history benchmark — {machine()}, PostgreSQL {server}")
    print(f"{datetime.date.today().isoformat()}; rollup levels {ROLLUP_LEVEL_WIDTHS_S} s")
    print()
    print(
        f"1. writer throughput, {args.writer_rows} samples, batches of {BATCH}, "
        f"{args.repeats} interleaved repeats (median, samples/s)"
    )
    print(f"  {'path':<40} {'median':>10} {'range':>21}")
    for name, label in (
        ("copy", "raw psycopg COPY FROM STDIN"),
        ("executemany", "raw psycopg executemany(INSERT)"),
        ("writer", "agent Writer (write_samples + rollups)"),
    ):
        v = w[name]
        print(f"  {label:<40} {med[name]:>10,.0f} {min(v):>10,.0f}–{max(v):<10,.0f}")
    print(f"  writer / COPY:        {med['writer'] / med['copy']:.2f}")
    print(f"  writer / executemany: {med['writer'] / med['executemany']:.2f}")
    print()
    print(f"2. one run of {args.samples:,} samples (0.1 s apart), {len(series)} buckets")
    for k, v in build.items():
        print(f"  build: {k:<38} {v:8.1f} s")
    print(f"  History.samples(max_points=1000), 3 cols   {t_cols:8.3f} s (best of 5)")
    print(f"  History.samples(max_points=1000), all cols {t_all:8.3f} s")
    print(f"  History.run(id) (with statistics)          {t_run:8.3f} s")
    print(f"  History.peak(id)                           {t_peak:8.3f} s")
    print(f"  hand-written GROUP BY over the samples     {t_hand:8.3f} s (once)")
    print(f"  GROUP BY / samples(3 cols)                 {t_hand / t_cols:8.0f} x")


if __name__ == "__main__":
    main()
