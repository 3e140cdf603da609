"""``edo-monitor sql`` on PostgreSQL: queries only, with no server rights, printed as on SQLite.

Regressions: a read-only transaction does not stop ``COPY … TO PROGRAM`` (it ran the program),
``COPY runs TO '/file'``, ``pg_read_file``, ``lo_export`` or ``pg_terminate_backend``; and a
``;``-joined statement after ``SELECT 1`` ran, ``COMMIT`` included, outside the read-only
transaction (psycopg sent a statement without parameters through the simple protocol). Now the
statement kind is checked, it runs as one prepared statement as ``pg_read_all_data`` (no server
files, programs or signals). And values were printed as psycopg gave them: a JSON column as a
Python ``repr`` (``{'direction': 'below', …}``) in the table and ``--csv``, an object in
``--json``, ``numeric`` sums and averages as strings (``"80"``, ``"40.0000000000000000"``);
now as SQLite gives them: JSON as its text, numbers as numbers.
"""

from __future__ import annotations

import csv
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from history_seed import N_SAMPLES, seed
from test_cli import run

pytestmark = pytest.mark.postgres


def _dsn(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql", query={}).render_as_string(False)


@pytest.fixture(scope="module")
def pg_history(pg_database: str) -> Iterator[str]:
    """The seeded history (history_seed.seed) in a schema of its own, for the module."""
    import psycopg
    from sqlalchemy.engine import make_url

    schema = f"sqlpg_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_dsn(pg_database), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    url = make_url(pg_database).update_query_dict({"options": f"-csearch_path={schema}"})
    shown = url.render_as_string(hide_password=False)
    seed(shown)
    yield shown
    with psycopg.connect(_dsn(pg_database), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(scope="module")
def sqlite_history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlpg") / "h.db"
    seed(path)
    return path


@pytest.fixture
def made() -> Iterator[Path]:
    """A path the server's own user may create (when the server runs on this machine)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="edo-sql-"))
    folder.chmod(0o777)
    yield folder / "made"
    shutil.rmtree(folder, ignore_errors=True)


def _refused(res: Any) -> str:
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "read-only" in lines[0], res.stderr
    return lines[0]


def test_statements_that_are_not_queries_are_refused(pg_history: str, made: Path) -> None:
    for stmt, kind in (
        (f"COPY (SELECT 1) TO PROGRAM 'touch {made}'", "COPY"),
        (f"COPY runs TO '{made}'", "COPY"),
        (f"/* a comment */ (COPY runs TO '{made}')", "COPY"),
        ("DO $$ BEGIN PERFORM 1; END $$", "DO"),
        ("CALL p()", "CALL"),
        ("LISTEN edo", "LISTEN"),
        ("NOTIFY edo", "NOTIFY"),
        ("SET ROLE postgres", "SET"),
        ("COMMIT", "COMMIT"),
        ("DROP TABLE samples", "DROP"),
    ):
        line = _refused(run("sql", stmt, db=pg_history))
        assert f"({kind} is not one; give SELECT, WITH, VALUES, TABLE, EXPLAIN or SHOW)" in line
    assert not made.exists()
    bad = run("sql", "SELEC 1", db=pg_history)
    assert bad.exit_code == 2 and "syntax error" in bad.stderr
    # a statement that compiles and fails as it runs is a run-time error (it was a usage error)
    res = run("sql", "SELECT 1 / 0", db=pg_history)
    assert (res.exit_code, res.stderr) == (1, "edo-monitor: error: sql: division by zero\n")


def test_a_second_statement_does_not_run(pg_history: str, made: Path) -> None:
    stmt = (
        "SELECT 1; COMMIT; RESET ROLE; SET default_transaction_read_only = off; "
        f"COPY (SELECT 1) TO PROGRAM 'touch {made}'"
    )
    res = run("sql", stmt, db=pg_history)
    assert res.exit_code == 2 and "multiple commands" in res.stderr, res.output
    assert not made.exists()
    res = run("sql", "SELECT 1 AS a; SELECT 2 AS b", "--json", db=pg_history)
    assert res.exit_code == 2 and res.stdout == ""


def test_the_statement_has_no_server_rights(pg_history: str, made: Path) -> None:
    import psycopg

    with psycopg.connect(_dsn(pg_history), autocommit=True) as victim:
        pid = victim.info.backend_pid
        for stmt, reason in (
            ("SELECT pg_read_file('/etc/hostname')", "permission denied for function"),
            (f"SELECT lo_export(1, '{made}')", "permission denied for function lo_export"),
            (f"SELECT pg_terminate_backend({pid})", "terminate"),
            (f"SELECT pg_cancel_backend({pid})", "cancel"),
            ("SELECT nextval('samples_id_seq')", "samples_id_seq"),
        ):
            assert reason in _refused(run("sql", stmt, db=pg_history)), stmt
        assert victim.execute("SELECT 1").fetchone() == (1,)  # still connected
        # what the role may call ends with the command: the transaction is rolled back
        # (a notification is never sent) and the connection closed (locks and settings go)
        victim.execute("LISTEN edo_sql_test")
        for stmt in (
            "SELECT pg_notify('edo_sql_test', 'x')",
            "SELECT pg_advisory_lock(424242)",
            "SELECT set_config('work_mem', '1MB', false)",
        ):
            assert run("sql", stmt, db=pg_history).exit_code == 0, stmt
        assert list(victim.notifies(timeout=0.5)) == []
        assert victim.execute("SELECT pg_try_advisory_lock(424242)").fetchone() == (True,)
    assert not made.exists()
    who = run("sql", "SELECT current_user AS u", "--csv", db=pg_history)
    assert who.stdout.split() == ["u", "pg_read_all_data"]


def test_reads_work_as_documented(pg_history: str) -> None:
    res = run(
        "sql",
        "SELECT run_id, count(*) FROM samples GROUP BY run_id ORDER BY run_id",
        "--timeout",
        "5",
        "--json",
        db=pg_history,
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == [
        {"run_id": 1, "count": N_SAMPLES},
        {"run_id": 2, "count": 300},
    ]
    for stmt, want in (
        ("WITH r AS (SELECT id FROM runs) SELECT count(*) AS n FROM r", [{"n": 5}]),
        (" -- runs\n/* a /* nested */ one */ ( SELECT count(*) AS n FROM runs )", [{"n": 5}]),
        ("VALUES (1, 'a')", [{"column1": 1, "column2": "a"}]),
        ("TABLE meta LIMIT 0", []),
        ("SELECT '{\"b\":1}'::json AS j, 'a :b %s' AS t", [{"j": '{"b":1}', "t": "a :b %s"}]),
    ):
        res = run("sql", stmt, "--json", db=pg_history)
        assert res.exit_code == 0, (stmt, res.output)
        assert json.loads(res.stdout) == want, stmt
    plan = run("sql", "EXPLAIN SELECT * FROM samples WHERE run_id = 1", "--csv", db=pg_history)
    assert plan.exit_code == 0 and "QUERY PLAN" in plan.stdout, plan.output
    shown = run("sql", "SHOW statement_timeout", "--csv", db=pg_history)
    assert shown.stdout.split() == ["statement_timeout", "1min"]
    slow = run("sql", "SELECT pg_sleep(5)", "--timeout", "0.2", db=pg_history)
    assert slow.exit_code == 1 and "--timeout 0.2 s" in slow.stderr


#: Statements whose output must be the same on both backends, in every format.
SAME = (
    "SELECT id, kind, step, data FROM events ORDER BY id",
    "SELECT name, config, tags FROM runs ORDER BY id",
    "SELECT run_id, sum(step) AS s, avg(step) AS a, max(free_fraction) AS f, count(*) AS n "
    "FROM samples GROUP BY run_id ORDER BY run_id",
    "SELECT sum(step) AS s, avg(step * 2) AS a FROM samples WHERE run_id = 2 AND step < 2",
    "SELECT 1 = 1 AS t, 1 = 2 AS f, NULL AS z",
)


@pytest.mark.parametrize("fmt", ["--json", "--csv", "table"])
def test_a_statement_prints_the_same_on_both_backends(
    pg_history: str, sqlite_history: Path, fmt: str
) -> None:
    args = [] if fmt == "table" else [fmt]
    for stmt in SAME:
        on_pg = run("sql", stmt, *args, db=pg_history)
        on_sqlite = run("sql", stmt, *args, db=sqlite_history)
        assert on_pg.exit_code == on_sqlite.exit_code == 0, (stmt, on_pg.output)
        assert on_pg.stdout == on_sqlite.stdout, stmt


def test_json_columns_and_numbers_are_values_not_reprs(pg_history: str) -> None:
    stmt = "SELECT id, data FROM events WHERE kind = 'threshold_crossed'"
    as_json = json.loads(run("sql", stmt, "--json", db=pg_history).stdout)
    text = '{"direction": "below", "free_fraction": 0.1, "floor": 0.2}'
    assert as_json == [{"id": 1, "data": text}]
    rows = list(csv.reader(io.StringIO(run("sql", stmt, "--csv", db=pg_history).stdout)))
    assert rows == [["id", "data"], ["1", text]]
    assert text in run("sql", stmt, db=pg_history).stdout
    stmt = "SELECT sum(step) AS s, avg(step) AS a FROM samples WHERE run_id = 2 AND step < 2"
    assert run("sql", stmt, "--json", db=pg_history).stdout == '[\n  {"s": 2, "a": 0.5}\n]\n'
    assert run("sql", stmt, "--csv", db=pg_history).stdout.split() == ["s,a", "2,0.5"]
    stmt = "SELECT NULL::json AS n, 'null'::json AS j, '\\x00ff'::bytea AS b, ARRAY[1, 2] AS a"
    res = run("sql", stmt, "--json", db=pg_history)
    assert json.loads(res.stdout) == [{"n": None, "j": "null", "b": "00ff", "a": "[1, 2]"}]


@pytest.mark.slow
def test_a_recorded_run_reads_back_as_its_json(pg_url: str) -> None:
    """A run written by ``watch`` on a tiny model: its config, tags and events read through
    ``sql`` are the JSON text of what ``History`` gives."""
    import torch
    from test_watch import make_model, train

    import edo_monitor
    from edo_monitor.store.history import History

    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with edo_monitor.watch(model, db=pg_url, interval_s=0.02, budget="64MiB", tags=["t1"]) as m:
        train(model, opt, 5, sleep_s=0.01)
    run_id = m.summary().run_id
    res = run("sql", f"SELECT config, tags FROM runs WHERE id = {run_id}", "--json", db=pg_url)
    assert res.exit_code == 0, res.output
    [row] = json.loads(res.stdout)
    with History(pg_url) as h:
        recorded = h.run(run_id)
        events = h.events(run_id)
    assert isinstance(row["config"], str) and json.loads(row["config"]) == recorded.config
    assert json.loads(row["tags"]) == list(recorded.tags) == ["t1"]
    res = run(
        "sql", f"SELECT data FROM events WHERE run_id = {run_id} ORDER BY id", "--csv", db=pg_url
    )
    datas = [r[0] for r in csv.reader(io.StringIO(res.stdout))][1:]
    assert [json.loads(d) for d in datas] == [e.data for e in events]


def test_a_user_schema_stays_on_the_search_path(pg_database: str) -> None:
    """Tables found through ``"$user"`` (a schema named as the login) are still found when the
    statement runs as pg_read_all_data."""
    import psycopg
    from pg_admin import AdminConnection, fresh_database
    from sqlalchemy.engine import make_url

    server = make_url(pg_database)
    with fresh_database(AdminConnection(_dsn(pg_database))) as name:
        url = server.set(database=name).render_as_string(hide_password=False)
        with psycopg.connect(_dsn(url), autocommit=True) as conn:
            user = conn.execute("SELECT current_user").fetchone()[0]
            conn.execute(f'CREATE SCHEMA "{user}"')
        seed(url)  # into "$user", the first schema of the default search path
        res = run("sql", "SELECT count(*) AS n FROM runs", "--json", db=url)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout) == [{"n": 5}]
