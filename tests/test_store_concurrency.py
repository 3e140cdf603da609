"""Four writer processes and a reader on one SQLite file: no "database is locked", no lost rows.

The file does not exist when the writers start, so they also race to create it (and the schema
migration must run once). Then the agent's writer thread: producers on several threads, full
batches, rows SQLite refuses, and retries.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from edo_monitor.errors import StoreError
from edo_monitor.probes.readings import Reading
from edo_monitor.store.engine import open_engine
from edo_monitor.store.history import History
from edo_monitor.store.models import Run
from edo_monitor.store.rollups import roll_up
from edo_monitor.store.writer import Writer

WRITERS = 4
BATCHES = 60
BATCH = 50

CHILD = textwrap.dedent(
    """
    import socket, sys, time, uuid
    from sqlalchemy import insert
    from sqlalchemy.orm import Session
    from edo_monitor.probes.readings import SAMPLE_FIELDS, Reading
    from edo_monitor.store.engine import open_engine, write_samples
    from edo_monitor.store.models import Event, Run, Sample

    path, k, batches, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    engine = open_engine(path)
    with Session(engine) as s, s.begin():
        run = Run(uuid=str(uuid.uuid4()), name=f"w{k}", host=socket.gethostname(), pid=0,
                  started_at_s=time.time(), status="running", device_kind="cpu-budget",
                  interval_s=0.01, torch_version="x", config={}, tags=[], steps=0,
                  samples_dropped=0)
        s.add(run)
        s.flush()
        run_id = run.id
    t = time.time()
    for b in range(batches):
        rows = []
        for i in range(batch):
            r = Reading(time_s=t + (b * batch + i) * 0.01, step=b, device_kind="cpu-budget",
                        in_use_bytes=k * 10**6 + b * batch + i, free_fraction=0.5)
            rows.append({**r.as_dict(), "run_id": run_id})
        with engine.begin() as conn:
            if k % 2:  # the agent writer's path: tuples, rollups folded in from Python
                write_samples(conn, run_id, [tuple(r[f] for f in SAMPLE_FIELDS) for r in rows])
            else:  # Core insert: rollups folded by SQL once enough samples wait
                conn.execute(insert(Sample), rows)
            conn.execute(insert(Event), [{"run_id": run_id, "time_s": t, "step": b,
                                          "kind": "decision", "message": "m", "data": {}}])
    with engine.begin() as conn:
        from sqlalchemy import update
        conn.execute(update(Run).where(Run.id == run_id).values(status="finished",
                                                                 ended_at_s=time.time()))
    engine.dispose()
    print("done", run_id)
    """
)


@pytest.mark.slow
def test_four_writers_and_a_reader(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(path), str(k), str(BATCHES), str(BATCH)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(WRITERS)
    ]
    reads, errors = 0, []
    while any(p.poll() is None for p in procs):
        if path.exists():
            try:
                with History(path) as h:
                    for r in h.runs():
                        h.samples(r.id, columns=["in_use_bytes"], max_points=50)
                        h.samples_since(r.id, 0, limit=100)
                        h.events(r.id)
                    reads += 1
            except Exception as exc:  # every failure is a finding
                if "no history database" not in str(exc):
                    errors.append(repr(exc))
        time.sleep(0.01)
    outputs = [p.communicate() for p in procs]
    for p, (_out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        assert "locked" not in err
    assert errors == []
    assert reads > 0
    with History(path) as h:
        runs = h.runs()
        assert sorted(r.name for r in runs) == [f"w{k}" for k in range(WRITERS)]
        for r in runs:
            assert r.status == "finished"
            assert r.sample_count == BATCHES * BATCH
            assert r.event_count == BATCHES
            k = int(r.name[1:])
            assert r.peak_in_use_bytes == k * 10**6 + BATCHES * BATCH - 1
            s = h.samples(r.id, columns=["in_use_bytes"], max_points=None)
            assert s.min["in_use_bytes"] == list(range(k * 10**6, k * 10**6 + BATCHES * BATCH))
    # the rollups that two kinds of writers kept in turns are the ones SQL computes afresh
    engine = open_engine(path)
    with engine.begin() as conn:
        roll_up(conn)  # the Core writers' last samples may still wait
        kept = conn.exec_driver_sql(ROLLUPS).fetchall()
        conn.exec_driver_sql("DELETE FROM sample_rollups")
        conn.exec_driver_sql("UPDATE meta SET value = '0' WHERE key = 'rollup_through_id'")
        roll_up(conn)
        fresh = conn.exec_driver_sql(ROLLUPS).fetchall()
    engine.dispose()
    assert len(kept) == len(fresh) and {r[:4] for r in kept} == {r[:4] for r in fresh}
    for a, b in zip(kept, fresh, strict=True):
        assert a == pytest.approx(b, rel=1e-12)


ROLLUPS = (
    "SELECT run_id, level, block, n, time_min_s, time_max_s, in_use_bytes_min, in_use_bytes_max, "
    "in_use_bytes_sum, in_use_bytes_n, free_fraction_min, step_max, step_sum "
    "FROM sample_rollups ORDER BY run_id, level, block"
)


# -- the agent's writer thread -------------------------------------------------------------------


def _writer_db(tmp_path: Path) -> tuple[Any, int]:
    engine = open_engine(tmp_path / "w.db")
    with Session(engine) as s, s.begin():
        run = Run(
            uuid=str(uuid.uuid4()),
            name="w",
            host="h",
            pid=0,
            started_at_s=T0,
            status="running",
            device_kind="cpu-budget",
            interval_s=0.1,
            torch_version="x",
            config={},
            tags=[],
            steps=0,
            samples_dropped=0,
        )
        s.add(run)
        s.flush()
        return engine, run.id


T0 = 1.7e9


def _reading(i: int, **extra: Any) -> Reading:
    values: dict[str, Any] = {
        "time_s": T0 + i * 0.1,
        "step": i,
        "device_kind": "cpu-budget",
        "in_use_bytes": (i * 7919) % 10**6,
        "budget_bytes": 10**6,
        "free_fraction": 1 - ((i * 7919) % 10**6) / 10**6,
        **extra,
    }
    return Reading(**values)


def test_writer_thread_writes_every_row_and_keeps_the_rollups(tmp_path: Path) -> None:
    engine, run_id = _writer_db(tmp_path)
    writer = Writer(engine, run_id, queue_size=100_000, batch_size=500, flush_interval_s=0.05)
    writer.start()
    n_threads, per_thread = 2, 3000

    def produce(k: int) -> None:
        for i in range(k * per_thread, (k + 1) * per_thread):
            assert writer.put_sample(_reading(i))
            if i % 1000 == 0:
                writer.put_event("decision", f"d{i}", step=i)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    n = n_threads * per_thread
    assert writer.dropped == 0 and writer.written["samples"] == n and writer.written["events"] == 6
    con = sqlite3.connect(tmp_path / "w.db")
    got = con.execute("SELECT step, time_s, in_use_bytes, free_fraction FROM samples").fetchall()
    want = [_reading(i) for i in range(n)]
    assert sorted(got) == [(r.step, r.time_s, r.in_use_bytes, r.free_fraction) for r in want]
    mark = con.execute("SELECT value FROM meta WHERE key = 'rollup_through_id'").fetchone()[0]
    assert int(mark) == con.execute("SELECT max(id) FROM samples").fetchone()[0]
    per_level = con.execute(
        "SELECT level, sum(n), max(in_use_bytes_max) FROM sample_rollups GROUP BY level"
    ).fetchall()
    peak = max(r.in_use_bytes for r in want)
    assert per_level == [(lvl, n, peak) for lvl in range(3)]
    con.close()
    engine.dispose()


def test_writer_flushes_a_full_batch_without_waiting_for_the_interval(tmp_path: Path) -> None:
    engine, run_id = _writer_db(tmp_path)
    writer = Writer(engine, run_id, batch_size=10, flush_interval_s=60.0)
    writer.start()
    for i in range(25):
        writer.put_sample(_reading(i))
    deadline = time.monotonic() + 10
    while writer.written["samples"] < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.written["samples"] == 20  # two full batches; 5 wait for the interval
    writer.close()
    assert writer.written["samples"] == 25 and writer.flushes == 3
    engine.dispose()


def test_writer_drops_an_unwritable_batch_and_goes_on(tmp_path: Path) -> None:
    engine, run_id = _writer_db(tmp_path)
    writer = Writer(engine, run_id, batch_size=1, flush_interval_s=0.01)
    writer.put_sample(_reading(0))
    writer.put_sample(_reading(1, allocated_bytes=object()))  # SQLite cannot store it
    writer.put_sample(_reading(2))
    writer.start()
    writer.close()
    assert writer.dropped == 1 and writer.written["samples"] == 2
    con = sqlite3.connect(tmp_path / "w.db")
    assert con.execute("SELECT step FROM samples ORDER BY id").fetchall() == [(0,), (2,)]
    assert con.execute("SELECT samples_dropped FROM runs").fetchone() == (1,)
    (data,) = con.execute("SELECT data FROM events WHERE kind = 'samples_dropped'").fetchone()
    assert '"count": 1' in data
    con.close()
    engine.dispose()


def _short_busy_timeout(engine: Any, timeout_ms: int = 100) -> None:
    """Make the engine's new connections give up on a lock after ``timeout_ms`` instead of the
    store's 30 s (a listener after the store's own; SQLAlchemy's public event API)."""

    @event.listens_for(engine, "connect")
    def _busy(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        dbapi_conn.execute(f"PRAGMA busy_timeout = {timeout_ms}")

    engine.dispose()  # connections made before the listener keep their 30 s


@pytest.mark.parametrize("when", ["running", "closing"])
def test_writer_retries_after_an_operational_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """A real "database is locked": another connection holds the write lock (``BEGIN
    EXCLUSIVE``) past the writer's busy timeout. The writer keeps its batch, logs once, and
    writes it all once the lock is gone (while running, and when close() asks for the flush)."""
    engine, run_id = _writer_db(tmp_path)
    _short_busy_timeout(engine)
    locker = sqlite3.connect(tmp_path / "w.db", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    writer = Writer(engine, run_id, batch_size=100, flush_interval_s=0.01)
    for i in range(50):
        writer.put_sample(_reading(i))

    def refused() -> bool:
        return any("database is locked" in r.getMessage() for r in caplog.records)

    closing = None
    if when == "closing":
        writer.flush_interval_s = 60.0  # the first flush is the one close() asks for
        writer.start()
        closing = threading.Thread(target=writer.close)
        closing.start()  # close() flushes, is refused, and tries again a second later
    else:
        writer.start()
    try:
        deadline = time.monotonic() + 30
        while not refused() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refused(), "the writer never met the lock"
        assert writer.written["samples"] == 0 and writer.alive
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    if closing is not None:
        closing.join(60)
        assert not closing.is_alive()
    else:
        deadline = time.monotonic() + 30
        while writer.written["samples"] < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.written["samples"] == 50
    writer.close()
    assert writer.dropped == 0 and writer.written["samples"] == 50
    errors = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(errors) == 1 and "retrying" in errors[0].getMessage()  # logged once
    # recovered, nothing lost: one warning line, no traceback, and the event in the history
    assert errors[0].levelname == "WARNING" and errors[0].exc_info is None
    assert writer.reconnects == 1
    con = sqlite3.connect(tmp_path / "w.db")
    assert con.execute("SELECT count(*), max(step) FROM samples").fetchone() == (50, 49)
    (data,) = con.execute("SELECT data FROM events WHERE kind = 'store_reconnected'").fetchone()
    assert json.loads(data)["tries"] >= 1 and "database is locked" in json.loads(data)["error"]
    con.close()
    engine.dispose()


def test_the_reconnect_event_counts_the_outage_from_the_first_try(tmp_path: Path) -> None:
    """Regression: ``outage_s`` was counted from the first *failed* try, which SQLite fails only
    after its busy timeout: a 45 s lock read "0.0 s" (the timeout was most of it). Here a 1 s
    busy timeout and a lock held 1.5 s: the outage is the 1.5 s, not 0.5."""
    engine, run_id = _writer_db(tmp_path)
    _short_busy_timeout(engine, timeout_ms=1000)
    locker = sqlite3.connect(tmp_path / "w.db", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    writer = Writer(engine, run_id, batch_size=100, flush_interval_s=0.01)
    writer.put_sample(_reading(0))
    started = time.monotonic()
    writer.start()
    time.sleep(1.5)
    locker.execute("ROLLBACK")
    locker.close()
    writer.close()
    held_s = time.monotonic() - started
    con = sqlite3.connect(tmp_path / "w.db")
    (data,) = con.execute("SELECT data FROM events WHERE kind = 'store_reconnected'").fetchone()
    con.close()
    engine.dispose()
    assert 1.4 <= json.loads(data)["outage_s"] <= held_s


@pytest.mark.slow
def test_writers_opening_a_new_file_at_the_same_moment_all_start(tmp_path: Path) -> None:
    """The ranks of a job open one new SQLite file at the same instant. Switching it to WAL
    answered "database is locked" at once (no busy handler) to every writer but the first, and
    their runs failed to start (10 of 10 tries with six processes). Six real processes, released
    together once all have imported the store, three rounds on fresh files: every one opens it."""
    code = textwrap.dedent(
        """
        import sys, time
        from edo_monitor.store.engine import open_engine
        path, ready = sys.argv[1], sys.argv[2]
        open(ready + "." + sys.argv[3], "w").close()
        while len(__import__("glob").glob(ready + ".*")) < 6:
            time.sleep(0.001)
        open_engine(path).dispose()
        print("ok")
        """
    )
    for round_ in range(3):
        path = tmp_path / f"fresh-{round_}.db"
        ready = tmp_path / f"ready-{round_}"  # each process marks itself ready; all go at six
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(path), str(ready), str(i)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(6)
        ]
        results = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, [err[-500:] for _, err in results]
        assert [out.strip() for out, _ in results] == ["ok"] * 6
        assert not list(tmp_path.glob(f".{path.name}.*")), "a writer left its creating file"


def _open_at(path: Path, gate: threading.Barrier, errors: list[BaseException]) -> None:
    """A thread's part: wait for the others, then open (create) the history at ``path``."""
    gate.wait()
    try:
        open_engine(path).dispose()
    except BaseException as exc:  # reported by the test
        errors.append(exc)


@pytest.mark.parametrize("shared", [False, True])
def test_threads_of_one_process_creating_histories_at_once_all_start(
    tmp_path: Path, shared: bool
) -> None:
    """Regression: two threads of one process creating a history at once (each its own file, or
    one file) both failed: Alembic's module-level proxies are set and unset by each migration,
    and one thread's migration met the other's ("table meta already exists", a raw
    ``KeyError: 'config'``). Four threads released together, three rounds on new files: every
    one opens its history, and each file holds the current schema."""
    threads = 4
    for round_ in range(3):
        paths = [tmp_path / f"r{round_}-{0 if shared else k}.db" for k in range(threads)]
        gate = threading.Barrier(threads)
        errors: list[BaseException] = []

        workers = [threading.Thread(target=_open_at, args=(p, gate, errors)) for p in paths]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
        for path in set(paths):
            with History(path) as history:
                assert history.runs() == []


def test_a_reader_never_sees_a_history_file_a_writer_is_still_creating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite creates the file empty when a writer first connects and writes the schema after:
    a reader in between was told the file is "not an edo-monitor history database: it is an
    empty file" (CI, in the four-writers test). The writer's migration is held
    here after its tables are written, before it commits: the path must not exist yet (the reader
    is told nothing has been recorded), and then appear complete."""
    from alembic import command

    real_upgrade = command.upgrade
    written, release = threading.Event(), threading.Event()

    def held_upgrade(*args: Any, **kwargs: Any) -> None:
        real_upgrade(*args, **kwargs)
        written.set()
        assert release.wait(30)

    monkeypatch.setattr(command, "upgrade", held_upgrade)
    path = tmp_path / "new.db"
    opened: list[Any] = []
    writer = threading.Thread(target=lambda: opened.append(open_engine(path)))
    writer.start()
    try:
        assert written.wait(30)
        assert not path.exists()
        with pytest.raises(StoreError, match="nothing has been recorded yet"):
            History(path)
    finally:
        release.set()
        writer.join(30)
    monkeypatch.setattr(command, "upgrade", real_upgrade)
    assert len(opened) == 1
    opened[0].dispose()
    with History(path) as h:
        assert h.runs() == []
    assert not list(tmp_path.glob(".new.db.*")), "the writer left its creating file"


def test_a_history_is_created_in_place_where_the_filesystem_has_no_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some network and FUSE filesystems refuse hard links (EPERM): the file is then created in
    place, as before, and works."""

    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("os.link", no_links)
    path = tmp_path / "fuse.db"
    open_engine(path).dispose()
    with History(path) as h:
        assert h.runs() == []
    assert not list(tmp_path.glob(".fuse.db.*")), "the writer left its creating file"


def test_a_snapshot_written_again_after_a_rollback_links_to_its_event_as_written(
    tmp_path: Path,
) -> None:
    """A flush that inserted an event and its snapshot (linked to the event's new id) fails at
    its last statement and is rolled back; the retry inserts the event under another id (here a
    row another statement added first takes the old one). The snapshot must link to the event as
    written, not to the id of the rolled-back try. The failure is the driver's own
    ``OperationalError`` ("disk I/O error"), raised once at the flush's heartbeat."""
    from sqlalchemy.exc import OperationalError

    engine, run_id = _writer_db(tmp_path)
    tries = {"heartbeat": 0, "events": 0}

    @event.listens_for(engine, "before_cursor_execute")
    def fail_once(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("INSERT INTO events"):
            tries["events"] += 1
            if tries["events"] == 2:  # the retry: another row takes the id the first try had
                cursor.connection.execute(
                    "INSERT INTO events (run_id, time_s, step, kind, message, data) "
                    "VALUES (?, 0, -1, 'other', 'taken first', '{}')",
                    (run_id,),
                )
        if statement.startswith("UPDATE runs"):
            tries["heartbeat"] += 1
            if tries["heartbeat"] == 1:
                raise OperationalError(statement, None, sqlite3.OperationalError("disk I/O error"))

    writer = Writer(engine, run_id, batch_size=100, flush_interval_s=0.01)
    writer.put_event("floor_crossed", "below the floor", step=3, time_s=T0 + 3)
    row = {
        "time_s": T0 + 3,
        "step": 3,
        "phase": "incident",
        "source": "cpu-budget",
        "encoding": "pickle+zlib",
        "raw_bytes": 4,
        "stored_bytes": 4,
        "allocated_bytes": 1,
        "reserved_bytes": 1,
        "blob": b"snap",
    }
    writer.put_snapshot(row, event_kind="floor_crossed", event_time_s=T0 + 3)
    writer.start()
    writer.close()
    assert tries["heartbeat"] >= 2 and writer.reconnects == 1 and writer.dropped == 0
    con = sqlite3.connect(tmp_path / "w.db")
    (event_id,) = con.execute("SELECT id FROM events WHERE kind = 'floor_crossed'").fetchone()
    (taken,) = con.execute("SELECT id FROM events WHERE kind = 'other'").fetchone()
    assert taken < event_id  # the first try's id went to the other row
    assert con.execute("SELECT event_id, blob FROM snapshots").fetchall() == [(event_id, b"snap")]
    con.close()
    engine.dispose()
