"""The rollups kept by the agent's writer path (``write_samples``): each batch folded in Python
or by SQL, and the result equal to SQLite's GROUP BY over every sample (on the database seeded in
test_history.py)."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest
from history_seed import INTERVAL, N_SAMPLES, T0, sample_row, seed
from sqlalchemy import insert
from sqlalchemy.exc import OperationalError

from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.engine import open_engine, write_samples
from edo_monitor.store.history import History
from edo_monitor.store.models import Sample
from edo_monitor.store.rollups import roll_up
from edo_monitor.store.schema import ROLLUP_LEVEL_WIDTHS_S


def _rollup_table(path: Path) -> tuple[list[str], list[tuple]]:
    con = sqlite3.connect(path)
    cur = con.execute("SELECT * FROM sample_rollups ORDER BY run_id, level, block")
    names = [d[0] for d in cur.description]
    rows = cur.fetchall()
    con.close()
    return names, rows


def _assert_same_rollups(a: tuple[list[str], list[tuple]], b: tuple[list[str], list[tuple]]):
    names, rows_a = a
    assert names == b[0] and len(rows_a) == len(b[1])
    for ra, rb in zip(rows_a, b[1], strict=True):
        for name, x, y in zip(names, ra, rb, strict=True):
            if name.endswith("_sum"):  # float sums: same values, maybe added in another order
                assert x == pytest.approx(y, rel=1e-12), (name, ra[:3])
            else:
                assert x == y and type(x) is type(y), (name, ra[:3], x, y)


def _values(run_id: int, i: int, t: float, rng: random.Random) -> tuple:
    row = sample_row(run_id, i, rng)
    row["time_s"] = t
    row["device_total_bytes"] = 8 * 10**9  # one value throughout
    row["fragmentation"] = float("nan") if i % 13 == 0 else rng.random()  # NaN is stored NULL
    row["allocated_bytes"] = rng.randint(0, 10**9)
    row["num_ooms"] = 3.0 if i % 2 else 3  # a float in an integer column, as SQLite keeps it
    return tuple(row[f] for f in SAMPLE_FIELDS)


def test_writer_rollups_equal_the_sql_fold(tmp_path: Path) -> None:
    """The rollups folded in from the writer's tuples are the ones SQLite's GROUP BY gives.

    Which path each batch took is read from the statements SQLite ran (``sqlite3``'s trace
    callback): the Python fold writes ready-made rows (``INSERT INTO sample_rollups … VALUES``),
    the SQL fold aggregates the samples (``INSERT INTO sample_rollups … SELECT``; it also runs
    first when samples of other writers wait, as before the first and the sixth batch)."""
    folded: list[bool] = []  # per batch: summarised in Python (True) or left to SQL (False)
    statements: list[str] = []
    path = tmp_path / "w.db"
    seed(path)  # run 1 and 2 samples, rolled up by SQL
    engine = open_engine(path)
    rng = random.Random(3)
    t = T0 + N_SAMPLES * INTERVAL
    i = 0
    for size in (1, 7, 500, 1000, 3, 250, 2000):  # batch ends fall inside blocks
        values = []
        for _ in range(size):
            t += rng.choice((0.05, 0.1) if size >= 500 else (0.05, 0.5, 3.0, 40.0))
            values.append(_values(1, i, t, rng))
            i += 1
        if size == 250:  # the clock stepped back: SQL fold for this batch
            values[100], values[101] = values[101], values[100]
        statements.clear()
        with engine.begin() as conn:
            conn.connection.dbapi_connection.set_trace_callback(statements.append)
            write_samples(conn, 1, values)
            conn.connection.dbapi_connection.set_trace_callback(None)
        upserts = [q for q in statements if q.lstrip().startswith("INSERT INTO sample_rollups")]
        python_fold = any(" VALUES (" in q for q in upserts)
        sql_fold = any("SELECT" in q for q in upserts)
        assert python_fold or sql_fold, size  # every batch is folded in, one way or the other
        folded.append(python_fold)
        if size == 3:  # another connection's samples, not rolled up yet (< ROLLUP_MIN_ROWS)
            with engine.begin() as conn:
                conn.execute(insert(Sample), [sample_row(2, k, rng) for k in range(5)])
    engine.dispose()
    assert folded == [True, True, True, True, True, False, True]
    con = sqlite3.connect(path)
    top = con.execute("SELECT max(id) FROM samples").fetchone()[0]
    mark = con.execute("SELECT value FROM meta WHERE key = 'rollup_through_id'").fetchone()[0]
    assert int(mark) == top  # every sample is in the rollups
    con.close()
    incremental = _rollup_table(path)
    # the reference: every sample folded again from scratch by SQL
    engine = open_engine(path)
    with engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM sample_rollups")
        conn.exec_driver_sql("UPDATE meta SET value = '0' WHERE key = 'rollup_through_id'")
        roll_up(conn)
    engine.dispose()
    _assert_same_rollups(incremental, _rollup_table(path))
    with History(path) as h:
        n1 = h.run(1).sample_count
        assert n1 == N_SAMPLES + i
        s = h.samples(1, columns=["allocated_bytes"], max_points=20)
        assert sum(s.count) == n1


def test_rollup_levels_are_powers_of_two_from_16_s(tmp_path: Path) -> None:
    assert ROLLUP_LEVEL_WIDTHS_S == (16, 256, 4096)
    path = tmp_path / "w.db"
    open_engine(path).dispose()
    con = sqlite3.connect(path)
    with pytest.raises(ValueError, match="powers of two"):
        roll_up(con, widths_s=(10, 100))
    con.close()


def test_write_samples_raises_sqlalchemy_operational_error(tmp_path: Path) -> None:
    """DBAPI errors inside the writer path come out as SQLAlchemy's, so the Writer retries an
    OperationalError (locked, I/O) instead of dropping the batch as bad data."""
    path = tmp_path / "w.db"
    seed(path)
    engine = open_engine(path)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE sample_rollups")
    rng = random.Random(0)
    with pytest.raises(OperationalError), engine.begin() as conn:
        write_samples(conn, 1, [_values(1, 0, T0 + 10**5, rng)])
    engine.dispose()
