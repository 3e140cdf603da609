"""The history in PostgreSQL: the agent's writer, rollups, the CLI and eight concurrent ranks.

Every test here runs against the real server (``EDO_TEST_PG_URL``, default
``postgres@127.0.0.1:5432/test``), each in a fresh schema of a database made for this session
(``pg_url`` in conftest.py); they skip, with the reason, when psycopg or the server is missing.
The History API tests of ``test_history.py`` run on PostgreSQL too (its ``seeded`` fixture).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from history_seed import INTERVAL, N_SAMPLES, T0, sample_row, seed
from sqlalchemy import text
from test_cli import run
from test_watch import make_model, train

import edo_monitor
from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.engine import open_engine, write_samples
from edo_monitor.store.history import History
from edo_monitor.store.rollups import rebuild_rollups, run_mark
from edo_monitor.store.schema import SCHEMA_VERSION

pytestmark = pytest.mark.postgres


def _rollups(url: str) -> list[tuple[Any, ...]]:
    engine = open_engine(url, readonly=True)
    try:
        with engine.connect() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    text("SELECT * FROM sample_rollups ORDER BY run_id, level, block")
                )
            ]
    finally:
        engine.dispose()


@pytest.mark.slow
def test_watch_records_a_training_run(pg_url: str) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with edo_monitor.watch(model, db=pg_url, interval_s=0.02, budget="64MiB") as mon:
        train(model, opt, 30, sleep_s=0.01)
    summary = mon.summary()
    assert summary.status == summary.recorded_status == "finished"
    assert summary.samples_dropped == 0 and summary.store_problem is None
    with History(pg_url) as h:
        r = h.run(summary.run_id)
        assert (r.status, r.steps) == ("finished", 30)
        assert r.sample_count == summary.samples_written == summary.samples > 0
        assert r.peak_in_use_bytes == summary.peak_in_use_bytes
        assert r.min_free_fraction == pytest.approx(summary.min_free_fraction)
        top_module = h.modules(r.id)[0]  # the embedding, largest first
        assert (top_module.module, top_module.params_bytes) == ("0", 5_000 * 16 * 4)
        everything = h.samples(r.id, max_points=None, columns=["in_use_bytes"])
        assert len(everything) == summary.samples
        engine = open_engine(pg_url, readonly=True)
        with engine.connect() as conn:  # the writer rolled every sample up as it went
            top = conn.execute(text("SELECT max(id) FROM samples")).scalar()
            assert run_mark(conn, r.id) == top
            n = conn.execute(text("SELECT sum(n) FROM sample_rollups WHERE level = 0")).scalar()
            assert n == summary.samples
        engine.dispose()


def test_writer_rollups_equal_an_sql_fold(pg_url: str) -> None:
    """The writer's Python fold (batch by batch, out-of-order times and NULLs included) leaves
    exactly the rollups that folding every sample with SQL gives."""
    engine = open_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (uuid, name, host, pid, started_at_s, status, device_kind, "
                "interval_s, torch_version, config, tags, steps, samples_dropped) VALUES "
                "('00000000-0000-4000-8000-000000000001', 'r', 'h', 1, :t, 'running', 'cpu', 0.5, "
                "'x', '{}', '[]', 0, 0)"
            ),
            {"t": T0},
        )
    rng = random.Random(3)
    rows = [sample_row(1, i, rng) for i in range(3000)]
    rows[10]["time_s"], rows[11]["time_s"] = rows[11]["time_s"], rows[10]["time_s"]
    tuples = [tuple(r[f] for f in SAMPLE_FIELDS) for r in rows]
    for k in range(0, len(tuples), 250):
        with engine.begin() as conn:
            write_samples(conn, 1, tuples[k : k + 250])
    engine.dispose()
    by_writer = _rollups(pg_url)
    engine = open_engine(pg_url)
    with engine.begin() as conn:
        rebuild_rollups(conn, [1])
    engine.dispose()
    by_sql = _rollups(pg_url)
    assert len(by_writer) == len(by_sql) > 0
    for a, b in zip(by_writer, by_sql, strict=True):
        assert a[:4] == b[:4]
        for x, y in zip(a, b, strict=True):  # sums of floats: equal up to rounding
            assert x == y if x is None or y is None else x == pytest.approx(y, rel=1e-12)
    # the coarsest level holds every sample once; its max is the largest value written
    top = [r for r in by_sql if r[1] == 2]
    assert sum(r[3] for r in top) == 3000
    with History(pg_url) as h:
        assert h.peak(1).value == max(r["in_use_bytes"] or 0 for r in rows)


@pytest.fixture(scope="module")
def pg_seeded(pg_database: str) -> Any:
    """The CLI's seeded database (test_history.seed) in a schema of its own, for the module."""
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(pg_database)
    schema = f"cli_{uuid.uuid4().hex[:12]}"
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    full = url.update_query_dict({"options": f"-csearch_path={schema}"})
    shown = full.render_as_string(hide_password=False)
    seed(shown)
    yield shown
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_cli_reads_postgres(pg_seeded: str, tmp_path: Path) -> None:
    res = run("runs", "--json", db=pg_seeded)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    statuses = {"finished", "failed", "interrupted", "running", "crashed"}
    assert {r["status"] for r in data} == statuses
    big = next(r for r in data if r["name"] == "embed-big")
    assert big["sample_count"] == N_SAMPLES
    shown = json.loads(run("show", "1", "--json", db=pg_seeded).stdout)
    assert shown["run"]["name"] == "embed-big"
    ev = json.loads(run("events", "1", "--kind", "action", "--json", db=pg_seeded).stdout)
    assert [e["data"]["bytes_saved"] for e in ev] == [123456]
    assert run("compare", "1", "2", db=pg_seeded).exit_code == 0
    out = tmp_path / "r.json"
    assert run("export", "1", "--format", "json", "--out", str(out), db=pg_seeded).exit_code == 0
    doc = json.loads(out.read_text())
    assert len(doc["samples"]) == N_SAMPLES and len(doc["events"]) == 4
    doctor = run("doctor", "--json", db=pg_seeded)
    assert doctor.exit_code == 0, doctor.output
    report = json.loads(doctor.stdout)
    assert report["schema_version"] == SCHEMA_VERSION
    assert report["samples_not_rolled_up"] == 0
    assert report["rows"]["samples"] == N_SAMPLES + 300


def test_sql_is_read_only_and_time_limited_on_postgres(pg_seeded: str) -> None:
    res = run("sql", "SELECT count(*) AS n FROM samples", "--json", db=pg_seeded)
    assert res.exit_code == 0 and json.loads(res.stdout) == [{"n": N_SAMPLES + 300}]
    for stmt in (
        "INSERT INTO meta VALUES ('x', 'y')",
        "UPDATE runs SET name = 'x'",
        "DELETE FROM samples",
        "DROP TABLE samples",
        "CREATE TABLE t (x int)",
        "SELECT nextval('samples_id_seq')",
        "COMMIT; DELETE FROM samples",  # one statement only: no way out of the transaction
    ):
        res = run("sql", stmt, db=pg_seeded)
        assert res.exit_code in (1, 2), (stmt, res.output)
        assert "Traceback" not in res.output, stmt
        if res.exit_code == 1:
            assert "read-only" in res.stderr, (stmt, res.stderr)
    res = run("sql", "SELECT count(*) AS n FROM samples", "--json", db=pg_seeded)
    assert json.loads(res.stdout) == [{"n": N_SAMPLES + 300}]
    res = run("sql", "SELECT count(*) AS n FROM runs WHERE name = 'x'", "--json", db=pg_seeded)
    assert json.loads(res.stdout) == [{"n": 0}]
    slow = run("sql", "SELECT pg_sleep(5)", "--timeout", "0.2", db=pg_seeded)
    assert slow.exit_code == 1 and "--timeout 0.2 s" in slow.stderr
    bad = run("sql", "SELEC 1", db=pg_seeded)
    assert bad.exit_code == 2 and "syntax error" in bad.stderr


def test_prune_on_postgres(pg_url: str) -> None:
    facts = seed(pg_url)
    res = run("prune", "--downsample-older-than", "0s", "--bucket", "60s", db=pg_url)
    assert res.exit_code == 0, res.output
    with History(pg_url) as h:
        after = h.run(1)
        assert 0 < after.sample_count < N_SAMPLES
        assert after.peak_in_use_bytes == facts["peak"]
        s = h.samples(1, columns=["in_use_bytes"], max_points=10)
        assert sum(s.count) == after.sample_count and max(s.max["in_use_bytes"]) == facts["peak"]
    # the rollups were rebuilt from what is left
    level0 = [r for r in _rollups(pg_url) if r[0] == 1 and r[1] == 0]
    assert sum(r[3] for r in level0) == after.sample_count
    assert INTERVAL > 0


RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    from torch import nn
    import edo_monitor

    url, rank, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Embedding(2_000, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (folder / f"ready-{rank}").touch()
    deadline = time.monotonic() + 120
    while not (folder / "go").exists():  # every rank starts writing at the same moment
        if time.monotonic() > deadline:
            sys.exit("no go signal")
        time.sleep(0.01)
    with edo_monitor.watch(model, db=url, interval_s=0.005, run_name=f"rank{rank}",
                           strict=True) as mon:
        for _ in range(20):
            x = torch.randint(0, 2_000, (64,))
            model(x).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.005)
    s = mon.summary()
    print(json.dumps({"run_id": s.run_id, "samples": s.samples, "written": s.samples_written,
                      "dropped": s.samples_dropped, "not_written": s.rows_not_written,
                      "problem": s.store_problem, "status": s.recorded_status,
                      "events": sum(s.events.values()), "errors": s.agent_errors}))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eight_ranks_write_into_one_database_at_once(pg_url: str, tmp_path: Path) -> None:
    """Eight processes, each a real watch() training loop, write into one fresh database at
    the same time (creating its schema concurrently): no row lost, no error."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), pg_url, str(rank), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(8)
    ]
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"ready-{r}").exists() for r in range(8)):
            assert time.monotonic() < deadline, "ranks did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        (tmp_path / "go").touch()
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * 8, [err[-2000:] for _, err in outs]
    summaries = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert len({s["run_id"] for s in summaries}) == 8
    for s in summaries:
        assert s["status"] == "finished" and s["problem"] is None and s["errors"] == {}, s
        assert s["dropped"] == 0 and not any(s["not_written"].values()), s
        assert s["written"] == s["samples"] > 0, s
    engine = open_engine(pg_url, readonly=True)
    with engine.connect() as conn:
        per_run = dict(
            conn.execute(text("SELECT run_id, count(*) FROM samples GROUP BY run_id")).all()
        )
        events = dict(
            conn.execute(text("SELECT run_id, count(*) FROM events GROUP BY run_id")).all()
        )
        rolled = dict(
            conn.execute(
                text("SELECT run_id, sum(n) FROM sample_rollups WHERE level = 2 GROUP BY run_id")
            ).all()
        )
    engine.dispose()
    for s in summaries:  # each run's rows against its own summary
        assert per_run[s["run_id"]] == s["samples"], s
        assert events.get(s["run_id"], 0) == s["events"], s
        assert rolled[s["run_id"]] == s["samples"], s


def test_replay_reads_postgres_as_sqlite(pg_seeded: str, tmp_path: Path) -> None:
    """``replay`` reads its samples through the DBAPI cursor (``%s`` on psycopg, ``?`` on
    SQLite): the same run replayed from PostgreSQL and from an SQLite copy of the same seed gives
    the same samples, minimum free fraction and crossings."""
    from edo_monitor.hindsight.replay import REPLAY_COLUMNS, replay, replay_samples
    from edo_monitor.store.history import History

    lite = tmp_path / "same.db"
    seed(lite)
    results = []
    for db in (pg_seeded, str(lite)):
        with History(db) as h, h._read() as conn:
            rows = [r for chunk in replay_samples(conn, 1, chunk_rows=1000) for r in chunk]
        results.append((rows, replay(db, 1, "min_free_fraction=0.5,rearm_free_fraction=0.6")))
    (pg_rows, pg), (lite_rows, lt) = results
    assert len(pg_rows) == N_SAMPLES and len(pg_rows[0]) == len(REPLAY_COLUMNS)
    assert [tuple(r) for r in pg_rows] == [tuple(r) for r in lite_rows]
    assert [r[0] for r in pg_rows] == sorted(r[0] for r in pg_rows)  # time order
    assert pg.samples == lt.samples == N_SAMPLES
    assert pg.min_free_fraction == lt.min_free_fraction and pg.crossings == lt.crossings


def _terminate(dsn: str, where: str, *args: Any) -> int:
    """``pg_terminate_backend`` every server process matching ``where`` (never this one's)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            f"WHERE pid <> pg_backend_pid() AND {where}",
            args,
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_terminated_writer_connection_is_one_warning_and_an_event(
    pg_url: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """An administrator terminates the run's connections mid-run (``pg_terminate_backend``):
    the writer reconnects and loses nothing, says so in one warning line (no traceback, from
    the writer, SQLAlchemy or psycopg) and records a ``store_reconnected`` event."""
    import logging

    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    dsn = url.set(drivername="postgresql", query={}).render_as_string(hide_password=False)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    terminated, flushes_then = 0, 0
    with caplog.at_level(logging.INFO), edo_monitor.watch(model, db=pg_url, interval_s=0.02) as mon:
        writer = mon._run.writer
        assert writer is not None
        deadline = time.monotonic() + 30  # two flushes after the cut (1 s apart)
        while time.monotonic() < deadline and writer.flushes < flushes_then + 2:
            train(model, opt, 2, sleep_s=0.01)
            if not terminated and writer.flushes >= 1:
                terminated = _terminate(dsn, "datname = %s", url.database)
                flushes_then = writer.flushes
    assert terminated >= 1 and writer.flushes >= flushes_then + 2
    summary = mon.summary()
    assert summary.samples_dropped == 0 and not any(summary.rows_not_written.values())
    assert summary.samples_written == summary.samples > 0 and summary.store_problem is None
    ours = [
        r
        for r in caplog.records
        if r.name.split(".")[0] in ("edo_monitor", "sqlalchemy", "psycopg")
        and r.levelno >= logging.WARNING
    ]
    assert len(ours) == 1, [r.getMessage() for r in ours]
    assert ours[0].levelname == "WARNING" and "AdminShutdown" in ours[0].getMessage()
    assert all(r.exc_info is None and not r.exc_text for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err
    with History(pg_url) as h:
        (event,) = h.events(summary.run_id, kind="store_reconnected")
        assert event.data["tries"] >= 1 and "AdminShutdown" in event.data["error"]
        assert h.run(summary.run_id).sample_count == summary.samples
        stored = Counter(e.kind for e in h.events(summary.run_id))
    # the summary counts the writer's own event too (it was missing there)
    assert summary.events == dict(stored) and summary.events["store_reconnected"] == 1
    # the writer's own event has no step: "-", not -1
    assert event.step == -1 and event.step_shown == "-"
    (line,) = [
        x
        for x in run("events", str(summary.run_id), "--db", pg_url).stdout.splitlines()
        if "store_reconnected" in x
    ]
    assert [c.strip() for c in line.split("│")][3] == "-"


def test_the_session_database_is_dropped_after_its_admin_connection_was_terminated(
    pg_database: str,
) -> None:
    """The fixture's idle admin connection is terminated by an administrator: it is re-made
    and ``DROP DATABASE`` still runs (the suite ended with an ERROR and left the database)."""
    import psycopg
    from pg_admin import AdminConnection, fresh_database, server_url
    from sqlalchemy.engine import make_url

    dsn = make_url(server_url()).set(drivername="postgresql").render_as_string(False)
    admin = AdminConnection(dsn)
    with fresh_database(admin) as name:
        assert _terminate(dsn, "pid = %s", admin.backend_pid) == 1
    assert admin.reconnects == 1
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (name,))
        assert left.fetchone() == (0,)


def _allow_connections(pg_url: str, allowed: bool) -> None:
    """Let ``pg_url``'s database take connections, or not (``ALLOW_CONNECTIONS``; its open ones
    terminated), through the server's own ``postgres`` database."""
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    dsn = url.set(drivername="postgresql", database="postgres", query={}).render_as_string(
        hide_password=False
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{url.database}" ALLOW_CONNECTIONS {str(allowed).lower()}')
    if not allowed:
        _terminate(dsn, "datname = %s", url.database)


def test_a_database_gone_past_the_end_of_the_run_is_one_warning_line(
    pg_url: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """The database takes no connection from the end of the run on (``ALLOW_CONNECTIONS false``
    and the run's connections terminated): training ends normally and the summary says the row
    is not written; the end of the run that could not be recorded is one warning line. It was
    ``logger.exception``: about 60 lines of SQLAlchemy and psycopg traceback."""
    import logging

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING):
        try:
            with edo_monitor.watch(model, db=pg_url, interval_s=0.02) as mon:
                train(model, opt, 3, sleep_s=0.01)
                _allow_connections(pg_url, False)
        finally:
            _allow_connections(pg_url, True)
    summary = mon.summary()
    assert summary.recorded_status is None and "still records this run as running" in str(summary)
    ends = [r for r in caplog.records if "could not record the end of run" in r.getMessage()]
    assert len(ends) == 1 and ends[0].levelname == "WARNING" and ends[0].exc_info is None
    assert "Traceback" not in capfd.readouterr().err


def test_a_postgres_database_no_writer_used_yet_is_no_history(pg_url: str) -> None:
    """Regression: a database without tables read as an empty history (``runs``: "No runs
    recorded", ``doctor``: "schema version None", both exit 0), where an SQLite file without
    them is refused: it is "nothing recorded yet", exit 1, in every reader."""
    from edo_monitor.errors import StoreError

    with pytest.raises(StoreError, match=r"the database has no tables \(nothing has been recorded"):
        History(pg_url)
    for command in ("runs", "doctor"):
        done = run(command, "--db", pg_url)
        assert done.exit_code == 1, done.output
        assert "nothing has been recorded yet" in done.output


def test_a_database_not_taking_connections_at_the_start_is_tried_again(pg_url: str) -> None:
    """Regression: a connection the server dropped while ``watch()`` made the schema ended the
    program (``StoreError``, no training), where the run's row, written next, is tried again.
    The database takes no connection at the start, and again once the start has said (one
    warning line) that it tries again: the run is recorded."""
    import logging

    class Reopen(logging.Handler):
        """Lets connections in again at the first "trying again" line."""

        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            if "trying again in" in record.getMessage():
                self.lines.append(record.getMessage())
                _allow_connections(pg_url, True)

    reopen = Reopen()
    logger = logging.getLogger("edo_monitor.store.engine")
    logger.addHandler(reopen)
    _allow_connections(pg_url, False)
    try:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with edo_monitor.watch(model, db=pg_url) as mon:
            train(model, opt, 2)
    finally:
        logger.removeHandler(reopen)
        _allow_connections(pg_url, True)
    assert len(reopen.lines) == 1 and "not currently accepting connections" in reopen.lines[0]
    with History(pg_url) as h:
        assert h.run(mon.run_id).status == "finished"
