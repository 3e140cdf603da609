"""Faults of the store a tester found, one test (or a few) each, on real SQLite files and a real
PostgreSQL server: a relative history path and a changed working folder; the live reader's
cursor (``SampleSeries.last_id``); the end of a run on a dropped connection; the label of
``runs.samples_dropped``; writable opens in a read-only folder.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import text
from watch_helpers import make_model, run_row, train

import edo_monitor
from edo_monitor.errors import StoreError
from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.engine import open_engine, write_samples
from edo_monitor.store.history import History
from edo_monitor.store.paths import resolve_db_url, shown_database
from edo_monitor.store.prune import prune

# -- a relative path and os.chdir inside the block --------------------------------------------


def test_relative_db_survives_chdir_inside_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer statted (and reconnected to) the relative path from the new working folder:
    "history database 'h.db' was deleted during the run", no row written, the run left
    ``running`` (then ``crashed``)."""
    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db="h.db", interval_s=0.01, run_name="chdir") as mon:
        os.chdir(tmp_path / "outputs")  # an output folder per run, Hydra-style
        train(model, opt, 20)
    summary = mon.summary()
    assert summary.rows_not_written == {
        "samples": 0,
        "events": 0,
        "module_stats": 0,
        "snapshots": 0,
    }
    assert (summary.recorded_status, summary.store_problem) == ("finished", None)
    assert summary.samples_written == summary.samples > 0
    row = run_row(tmp_path / "h.db")
    assert (row["status"], row["steps"], row["samples_dropped"]) == ("finished", 20, 0)
    assert list((tmp_path / "outputs").iterdir()) == []  # nothing made in the new folder


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("sqlite:////tmp/%C3%BCn%C3%AF/a b.db", "/tmp/ünï/a b.db"),  # the path, not its URL
        ("sqlite://", "sqlite://"),
        ("sqlite:///:memory:", ":memory:"),
        ("postgresql+psycopg://u:secret@h/db", "postgresql+psycopg://u:***@h/db"),
        ("postgresql+psycopg://u@h/db?password=secret", "postgresql+psycopg://u@h/db?password=***"),
    ],
)
def test_a_history_is_shown_by_its_path_or_its_url_without_a_password(
    given: str, shown: str
) -> None:
    """One rule for the summary, the dashboard and the store's messages (three copies before:
    the dashboard showed a ``password=`` parameter)."""
    from sqlalchemy.engine import make_url

    from edo_monitor.tui.data import DataSource

    assert shown_database(make_url(given)) == shown
    if given.startswith("postgresql"):  # the dashboard's label (no file to resolve)
        assert DataSource(given).label == shown


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("h.db", "{cwd}/h.db"),
        ("sub/../h.db", "{cwd}/sub/../h.db"),  # not normalised: a symlinked sub/ keeps meaning
        ("sqlite:///h.db", "{cwd}/h.db"),
        ("sqlite:///file:h%20x.db?mode=rwc&uri=true", "file:{cwd}/h%20x.db"),
    ],
)
def test_resolve_db_url_makes_sqlite_paths_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, expected: str
) -> None:
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    url = resolve_db_url(given)
    assert url.database == expected.format(cwd=tmp_path)
    assert url.query.get("mode") == ("rwc" if "mode" in given else None)  # parameters kept
    # absolute paths, other databases and in-memory SQLite are left as they are
    assert resolve_db_url(str(tmp_path / "a.db")).database == str(tmp_path / "a.db")
    pg = "postgresql+psycopg://u@h/db"
    assert resolve_db_url(pg).render_as_string(hide_password=False) == pg


# -- the live reader's cursor: the run's own newest sample id ----------------------------------


def _record_two_runs(db: str) -> None:
    """Two short runs recorded by the real agent: run 1 ``live``, run 2 ``other`` (newer ids)."""
    for name in ("live", "other"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with edo_monitor.watch(model, db=db, interval_s=0.01, run_name=name):
            train(model, opt, 10, sleep_s=0.005)


def _sample(t: float, step: int) -> tuple[object, ...]:
    values = dict.fromkeys(SAMPLE_FIELDS)
    values.update(time_s=t, step=step, device_kind="cpu-budget", in_use_bytes=1000 + step)
    return tuple(values[f] for f in SAMPLE_FIELDS)


def test_last_id_is_the_runs_own_after_prune_frees_the_top_ids(db_path: Path) -> None:
    """SQLite gives ids freed by ``prune`` (the newer run deleted) to the live run's next
    samples; ``last_id`` was the table's largest id, above them, so ``samples_since`` never
    returned them (0 rows, expected 2)."""
    _record_two_runs(str(db_path))
    writer = open_engine(db_path)
    with writer.begin() as conn:  # run 1 live again: this process, a fresh heartbeat
        conn.execute(
            text(
                "UPDATE runs SET status = 'running', pid = :p, host = :h, heartbeat_at_s = :t, "
                "ended_at_s = NULL WHERE id = 1"
            ),
            {"p": os.getpid(), "h": socket.gethostname(), "t": time.time()},
        )
    history = History(db_path)
    series = history.samples(1, max_points=None)  # a live reader opens run 1
    with writer.connect() as conn:
        run_top, table_top = conn.execute(
            text("SELECT (SELECT max(id) FROM samples WHERE run_id = 1), max(id) FROM samples")
        ).one()
    assert run_top < table_top  # run 2's ids are above run 1's
    assert series.last_id == run_top
    pruner = History(db_path, readonly=False)
    assert prune(pruner, keep_last=0)["run_ids_deleted"] == [2]  # the running run stays
    pruner.close()
    now = time.time()
    with writer.begin() as conn:  # run 1's writer flushes two samples: run 2's freed ids
        write_samples(conn, 1, [_sample(now, 1000), _sample(now + 0.01, 1001)])
    new = history.samples_since(1, series.last_id)
    assert [r.step for r in new] == [1000, 1001]
    assert [r.id for r in new] == [run_top + 1, run_top + 2]  # below the table's old top
    assert history.samples_since(1, new[-1].id) == []
    history.close()
    writer.dispose()


def test_samples_since_zero_of_a_run_without_samples(db_path: Path) -> None:
    """A run with no sample yet hands out cursor 0 (not the table's top, which another run's
    open batch may be under); reading from 0 finds nothing and, once it has one, finds it."""
    _record_two_runs(str(db_path))
    writer = open_engine(db_path)
    with writer.begin() as conn:
        conn.execute(text("DELETE FROM samples WHERE run_id = 1"))
    history = History(db_path)
    series = history.samples(1, max_points=None)
    assert (len(series), series.last_id) == (0, 0)
    assert history.samples_since(1, 0) == []
    with writer.begin() as conn:
        write_samples(conn, 1, [_sample(time.time(), 7)])
    assert [r.step for r in history.samples_since(1, series.last_id)] == [7]
    history.close()
    writer.dispose()


@pytest.mark.postgres
def test_last_id_is_the_runs_own_with_another_run_committing_first(pg_url: str) -> None:
    """PostgreSQL: run 2's batch takes higher ids and commits while run 1's batch is still
    open; a reader between the two got ``last_id`` = the table's top and missed run 1's rows
    (``samples_since`` -> 0 rows, expected 2)."""
    _record_two_runs(pg_url)
    writer = open_engine(pg_url)
    history = History(pg_url)
    now = time.time()
    with writer.connect() as one, writer.connect() as two:
        one.begin()
        write_samples(one, 1, [_sample(now, 1000), _sample(now + 0.1, 1001)])  # in flight
        two.begin()
        write_samples(two, 2, [_sample(now, 5000)])
        two.commit()  # higher ids, committed first
        series = history.samples(1, max_points=None)  # the reader opens run 1 now
        one.commit()
    new = history.samples_since(1, series.last_id)
    assert [r.step for r in new] == [1000, 1001]
    with writer.connect() as conn:
        table_top = conn.execute(text("SELECT max(id) FROM samples")).scalar()
    assert max(r.id for r in new) < table_top  # below run 2's committed id
    history.close()
    writer.dispose()


# -- the run's own row on a dropped connection ---------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("when", "statement"),
    [
        ("BEFORE INSERT", "INSERT INTO runs%"),  # RunRecord.open
        ("BEFORE UPDATE", "UPDATE runs SET%status%"),  # RunRecord.record_end
    ],
)
def test_the_runs_row_survives_one_dropped_connection(
    pg_url: str, when: str, statement: str
) -> None:
    """One terminated backend (an administrator, a failover) while the run's row is inserted or
    its end recorded: the insert raised StoreError / the end stayed ``running`` (read
    ``crashed``) with a traceback; both are tried again now, as the writer's flushes are."""
    import psycopg
    from sqlalchemy.engine import make_url

    engine = open_engine(pg_url)  # the schema, and a trigger that makes the statement last 1 s
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE FUNCTION slow_row() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN PERFORM pg_sleep(1); RETURN NEW; END $$"
            )
        )
        only_end = " WHEN (NEW.status <> 'running')" if "UPDATE" in when else ""
        conn.execute(
            text(
                f"CREATE TRIGGER slow_row {when} ON runs FOR EACH ROW{only_end} "
                "EXECUTE FUNCTION slow_row()"
            )
        )
    engine.dispose()
    dsn = make_url(pg_url).set(drivername="postgresql", query={})
    terminated: list[int] = []
    stop = threading.Event()

    def administrator() -> None:  # terminates the statement's backend once
        with psycopg.connect(dsn.render_as_string(hide_password=False), autocommit=True) as c:
            while not stop.is_set() and not terminated:
                row = c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                    "current_database() AND state = 'active' AND query LIKE %s "
                    "AND pid <> pg_backend_pid()",
                    (statement,),
                ).fetchone()
                if row is not None and row[0]:
                    terminated.append(1)
                time.sleep(0.02)

    thread = threading.Thread(target=administrator, daemon=True)
    thread.start()
    try:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with edo_monitor.watch(model, db=pg_url, interval_s=0.05, run_name="victim") as mon:
            train(model, opt, 5)
    finally:
        stop.set()
        thread.join(10)
    assert terminated == [1]  # the fault did happen
    assert mon.summary().recorded_status == "finished"
    with History(pg_url) as history:
        runs = history.runs()
        assert [(r.id, r.name, r.stored_status, r.steps) for r in runs] == [
            (mon.run_id, "victim", "finished", 5)
        ]


def test_what_is_tried_again() -> None:
    """The writer's rule, shared by the run's row: a lock, I/O or a dropped connection passes;
    a value the database refuses does not."""
    import sqlite3

    from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

    from edo_monitor.store.retry import is_transient

    locked = OperationalError("UPDATE runs", {}, sqlite3.OperationalError("database is locked"))
    assert is_transient(locked)
    refused = IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE constraint failed"))
    assert not is_transient(refused)
    dropped = DBAPIError("UPDATE runs", {}, sqlite3.InterfaceError("closed"))
    dropped.connection_invalidated = True
    assert is_transient(dropped)
    assert not is_transient(ValueError("not a database error"))


# -- the label of runs.samples_dropped ---------------------------------------------------------


def test_show_labels_samples_dropped_as_rows_not_written(db_path: Path) -> None:
    """``show`` printed the column as "samples 1 (dropped: 18)", while it counts every row not
    written (12 samples, 2 events, 4 module rows in the tester's run)."""
    from test_cli import run

    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with edo_monitor.watch(model, db=db_path, interval_s=0.01, queue_size=2) as mon:
        train(model, opt, 100)
    lost = mon.summary().rows_not_written
    assert lost["samples"] < sum(lost.values())  # rows of other tables were lost too
    assert run_row(db_path)["samples_dropped"] == sum(lost.values())
    res = run("show", str(mon.run_id), db=db_path)
    assert res.exit_code == 0, res.output
    lines = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in _rows(res.output)}
    assert lines["not written"] == (
        f"{sum(lost.values())} row(s)  (samples, events, module rows, snapshots)"
    )
    assert "dropped" not in lines["samples"]


def _rows(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.count("│") >= 3]


# -- writable opens of a read-only history -----------------------------------------------------


@pytest.fixture
def readonly_history(tmp_path: Path) -> Iterator[Path]:
    """A history recorded by a real run, seen in a folder this process cannot write: the folder
    made read-only (chmod) for a user, a read-only bind mount of it for root (whom chmod does not
    stop); skipped where neither is possible."""
    source = tmp_path / "src"
    source.mkdir()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=source / "h.db", interval_s=0.01):
        train(model, opt, 3)
    if os.geteuid() != 0:
        source.chmod(0o555)
        try:
            yield source / "h.db"
        finally:
            source.chmod(0o755)
        return
    view = tmp_path / "ro"
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(source), str(view)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"root, and no read-only bind mount here: {mounted.stderr.decode().strip()}")
    try:
        remount = ["mount", "-o", "remount,ro,bind", str(view)]
        if subprocess.run(remount, capture_output=True).returncode != 0:
            pytest.skip("root, and the bind mount could not be made read-only")
        yield view / "h.db"
    finally:
        subprocess.run(["umount", str(view)], check=True)


def test_prune_on_a_read_only_history_says_so(readonly_history: Path) -> None:
    """``prune`` said SQLite's bare "unable to open database file" where ``watch()`` on the same
    file names the problem; every writable open now says it the same way."""
    from test_cli import run

    res = run("prune", "--keep-last", "0", db=readonly_history)
    assert res.exit_code == 1
    assert f"history database {str(readonly_history)!r} is read-only for this process" in " ".join(
        res.output.split()
    ), res.output
    assert "unable to open" not in res.output
    with pytest.raises(StoreError, match="is read-only for this process"):
        History(readonly_history, readonly=False)
    with pytest.raises(StoreError, match="is read-only for this process"):
        edo_monitor.watch(db=readonly_history)
    assert run("prune", "--keep-last", "0", "--dry-run", db=readonly_history).exit_code == 0
