"""watch() and its history database, on real CPU training loops and real SQLite files: which
database it writes, files that are not one, readers beside the writer, a locked database, a full
queue.
"""

from __future__ import annotations

import sqlite3
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch
from watch_helpers import agent_threads, count, make_model, run_row, train, wait_for

import edo_monitor
from edo_monitor.errors import ConfigError, StoreError


def test_directory_as_db_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        edo_monitor.watch(make_model(), db=tmp_path)


def test_not_a_database_file(tmp_path: Path) -> None:
    bad = tmp_path / "notes.db"
    bad.write_text("these are my notes, not a database\n" * 200)
    with pytest.raises(StoreError, match="not a database"), edo_monitor.watch(db=bad):
        pass
    assert bad.read_text().startswith("these are my notes")  # never touched
    assert agent_threads() == []


def test_env_var_selects_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "from-env.db"
    monkeypatch.setenv("EDO_DB", str(target))
    with edo_monitor.watch():
        pass
    assert run_row(target)["status"] == "finished"


def test_reader_while_writing_never_sees_locked(db_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors: list[BaseException] = []
    seen: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
                seen.append(con.execute("SELECT count(*) FROM samples").fetchone()[0])
                con.close()
            except sqlite3.OperationalError as exc:
                if "no such table" not in str(exc) and "unable to open" not in str(exc):
                    errors.append(exc)
            time.sleep(0.002)

    with edo_monitor.watch(model, db=db_path, interval_s=0.005) as mon:
        thread = threading.Thread(target=reader)
        thread.start()
        train(model, opt, 60, sleep_s=0.005)
        # go on training until the reader has read rows the writer committed meanwhile
        deadline = time.monotonic() + 60
        while not any(seen) and time.monotonic() < deadline:
            train(model, opt, 1, sleep_s=0.005)
    stop.set()
    thread.join()
    assert errors == []
    assert any(seen), "the reader never saw a committed sample"
    assert count(db_path, "SELECT count(*) FROM samples") == mon.summary().samples


def test_full_queue_counts_and_records_drops(db_path: Path) -> None:
    from edo_monitor.probes.readings import Reading
    from edo_monitor.store.engine import open_engine
    from edo_monitor.store.writer import Writer

    with edo_monitor.watch(db=db_path) as mon:
        pass  # creates the run row 1, with the readings the watch itself took
    own = mon.summary().samples
    engine = open_engine(db_path)
    writer = Writer(engine, 1, queue_size=5)
    reading = Reading(time_s=time.time(), step=0, device_kind="cpu-budget")
    accepted = [writer.put_sample(reading) for _ in range(12)]
    assert accepted == [True] * 5 + [False] * 7
    assert writer.dropped == 7
    writer.start()
    writer.close()
    engine.dispose()
    con = sqlite3.connect(db_path)
    (data,) = con.execute("SELECT data FROM events WHERE kind='samples_dropped'").fetchone()
    assert '"count": 7' in data
    assert con.execute("SELECT samples_dropped FROM runs WHERE id=1").fetchone()[0] == 7
    # the watch's own readings and the 5 the full queue accepted
    assert con.execute("SELECT count(*) FROM samples WHERE run_id=1").fetchone()[0] == own + 5


def test_rows_with_different_columns_in_one_batch_are_all_written(db_path: Path) -> None:
    """Regression: one executemany over rows with different keys failed, and the writer then
    retried the same batch forever, losing every later row."""
    from edo_monitor.store.engine import open_engine
    from edo_monitor.store.writer import Writer

    with edo_monitor.watch(db=db_path):
        pass
    engine = open_engine(db_path)
    writer = Writer(engine, 1)
    table = {"time_s": 1.0, "step": 0, "module": "emb", "kind": "Embedding", "num_embeddings": 9}
    activations = {"time_s": 1.0, "step": 0, "module": "mlp", "kind": "activations"}
    writer.put_module_stat(table)
    writer.put_module_stat({**activations, "activations_bytes": 123})
    writer.put_event("decision", "x", step=0)
    writer.start()
    writer.close()
    engine.dispose()
    con = sqlite3.connect(db_path)
    rows = con.execute(
        "SELECT module, num_embeddings, activations_bytes FROM module_stats ORDER BY module"
    ).fetchall()
    assert rows == [("emb", 9, 0), ("mlp", None, 123)]
    assert writer.dropped == 0


def test_missing_database_driver_is_a_store_error() -> None:
    with (
        pytest.raises(StoreError, match="postgresql"),
        edo_monitor.watch(db="postgresql://user:secret@127.0.0.1:1/edo"),
    ):
        pass
    assert agent_threads() == []


# -- promises of the README and DESIGN.md, held by a test each ------------------------------------


def test_watch_takes_a_sqlite_url(tmp_path: Path) -> None:
    path = tmp_path / "by-url.db"
    url = f"sqlite:///{path}"
    with edo_monitor.watch(db=url) as mon:
        mon.step()
    assert path.is_file()
    run = run_row(path)
    assert (run["id"], run["status"], run["steps"]) == (mon.run_id, "finished", 1)
    assert mon.summary().db_url == url


def test_training_never_waits_on_a_locked_database(db_path: Path) -> None:
    """DESIGN.md §3 rule 2: while another connection holds the write lock, the writer cannot
    write (SQLite makes it wait up to its 30 s busy timeout), and the training thread goes on
    stepping at its own pace: readings pile up in the queue, none is lost."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_times(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            train(model, opt, 1)
            out.append(time.perf_counter() - t)
        return out

    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        train(model, opt, 3)
        wait_for(lambda: count(db_path, "SELECT count(*) FROM samples") > 0, "a first write")
        free = step_times(40)
        locker = sqlite3.connect(db_path, isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")  # a real write lock; WAL readers still read
        try:
            written = count(db_path, "SELECT count(*) FROM samples")
            taken = mon.summary().samples
            locked = step_times(40)
            # keep stepping until the sampler has queued readings the writer cannot write
            while mon.summary().samples < taken + 3:
                locked += step_times(1)
            steps_while_locked = len(locked)
            assert count(db_path, "SELECT count(*) FROM samples") == written  # none got through
        finally:
            locker.execute("ROLLBACK")
            locker.close()
    assert steps_while_locked >= 40 and mon.steps == 3 + 40 + steps_while_locked
    assert run_row(db_path)["status"] == "finished"
    assert count(db_path, "SELECT count(*) FROM samples") == mon.summary().samples  # none lost
    # a step that waited on the writer would take up to the 30 s busy timeout, ~10^4 times a
    # step here; steps under the lock are as fast as without it (generous margin: shared CPUs)
    ratio = statistics.median(locked) / statistics.median(free)
    assert ratio < 3.0, (ratio, statistics.median(locked), statistics.median(free))


def test_a_locked_database_at_the_end_does_not_stretch_the_runs_duration(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the run's end time was taken after the last flush, which waits for a locked
    database: a run of 8.7 s read 24 s (and its steps per second 20.83 for 57). The end is when
    the block ends; the flush after it still loses nothing."""
    import edo_monitor.store.engine as engine_module

    monkeypatch.setattr(engine_module, "BUSY_TIMEOUT_S", 5.0)  # the wait below is under it
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    locker = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        train(model, opt, 5)
        wait_for(lambda: count(db_path, "SELECT count(*) FROM samples") > 0, "a first write")
        locker.execute("BEGIN EXCLUSIVE")
        threading.Timer(2.0, lambda: (locker.execute("ROLLBACK"), locker.close())).start()
        ended = time.time()
    assert time.time() - ended > 1.5  # the exit waited for the lock
    row = run_row(db_path)
    assert row["status"] == "finished" and row["ended_at_s"] - ended < 0.5
    assert count(db_path, "SELECT count(*) FROM samples") == mon.summary().samples


def test_a_new_run_never_takes_a_pruned_runs_id(db_path: Path) -> None:
    """Regression: SQLite gives a new row the highest id + 1, so after the newest runs were
    pruned the next run was "run 1" again, and notes, ``compare`` commands and exported files
    naming the old id meant another run. Ids now go on from the highest the database held."""
    from edo_monitor.store.history import History
    from edo_monitor.store.prune import prune

    model = make_model()
    for _ in range(3):
        with edo_monitor.watch(model, db=db_path):
            pass
    with History(db_path, readonly=False) as h:
        assert prune(h, keep_last=0)["run_ids_deleted"] == [1, 2, 3]
    for expected in (4, 5):
        with edo_monitor.watch(model, db=db_path) as mon:
            pass
        assert mon.run_id == expected
    with History(db_path, readonly=False) as h:  # again, below the remembered id
        prune(h, keep_last=0)
    with edo_monitor.watch(model, db=db_path) as mon:
        pass
    assert mon.run_id == 6
