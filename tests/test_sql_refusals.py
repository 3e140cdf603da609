"""``edo-monitor sql`` on an SQLite history: one read-only statement; every kind of write is
refused in one line (exit code 1), the file unchanged, and reads run (pragmas included)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from cli_runner import runner
from history_seed import N_SAMPLES, seed

from edo_monitor.surfaces.cli import app


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sql") / "h.db"
    seed(path)
    return path


def run(*args: str, db: Path) -> Any:
    return runner.invoke(app, [*args, "--db", str(db)])


def test_sql_reads_and_refuses_writes(db: Path) -> None:
    res = run("sql", "SELECT count(*) AS n FROM samples", "--json", db=db)
    assert res.exit_code == 0 and json.loads(res.stdout) == [{"n": N_SAMPLES + 300}]
    before = db.read_bytes()
    for stmt in (
        "INSERT INTO meta VALUES ('x', 'y')",
        "UPDATE runs SET name = 'x'",
        "DELETE FROM samples",
        "DROP TABLE samples",
        "ATTACH DATABASE 'other.db' AS o",
        "PRAGMA journal_mode = DELETE",
        "PRAGMA user_version = 5",
        "CREATE TABLE t (x)",
        "VACUUM",
        "PRAGMA incremental_vacuum",  # was blamed on the folder's '-shm' file
        "UPDATE sqlite_master SET name = 'x'",
    ):
        res = run("sql", stmt, db=db)
        assert res.exit_code == 1, stmt
        assert "read-only" in res.stderr and "Traceback" not in res.output, stmt
        assert "would change the database" in res.stderr or "VACUUM writes" in res.stderr, stmt
    assert db.read_bytes() == before
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM samples").fetchone()[0] == N_SAMPLES + 300
    assert run("sql", "PRAGMA table_info(runs)", db=db).exit_code == 0
    # table-valued pragmas are reads too (refused as "UPDATE sqlite_master would change ...")
    res = run("sql", "SELECT name FROM pragma_table_info('runs') WHERE cid = 0", "--json", db=db)
    assert res.exit_code == 0 and json.loads(res.stdout) == [{"name": "id"}], res.stderr
    res = run("sql", "SELECT count(*) AS n FROM pragma_index_list('samples')", "--json", db=db)
    assert res.exit_code == 0 and json.loads(res.stdout)[0]["n"] >= 1, res.stderr
    bad = run("sql", "SELEC 1", db=db)
    assert bad.exit_code == 2 and "syntax error" in bad.stderr
    for empty in ("", "  ", " ; "):  # printed a blank table and "0 row(s)", exit 0
        res = run("sql", empty, db=db)
        assert res.exit_code == 2 and "is empty; give one statement" in res.stderr, empty
