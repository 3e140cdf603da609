"""Files a writer refuses are left as they were, and a history whose schema version cannot be
read is refused as damaged, by every command, on SQLite and PostgreSQL.

Regressions: ``edo-monitor --db other.db prune --keep-last 1`` on an SQLite file that is not a
history refused it (exit 1) but had already switched it to WAL mode (a writer's connections set
``PRAGMA journal_mode = WAL`` as they connect, before the schema was checked; so did
``watch(db=...)``). A ``meta.schema_version`` of ``'abc'`` made every command an internal error
(``ValueError: invalid literal for int()``, exit 3); with no version row and no Alembic
revision the file was read as schema version 1 and ``prune`` failed on "table meta already
exists".
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from cli_runner import runner
from history_seed import seed
from sqlalchemy import create_engine, text

from edo_monitor.errors import StoreError
from edo_monitor.store.engine import open_engine
from edo_monitor.store.history import History
from edo_monitor.surfaces.cli import app

FOREIGN = "is a database but not an edo-monitor history database (tables: x)"


def _cli(db: str | Path, *args: str) -> Any:
    return runner.invoke(app, ["--db", str(db), *args])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_foreign_sqlite_file_is_refused_unchanged_by_every_writer(tmp_path: Path) -> None:
    import torch

    import edo_monitor

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE x (a)")
        conn.execute("INSERT INTO x VALUES (1)")
    conn.close()
    before = _files(tmp_path)
    assert before[path.name][18:20] == b"\x01\x01"  # a rollback journal, not WAL

    res = _cli(path, "prune", "--keep-last", "1")
    assert res.exit_code == 1 and FOREIGN in res.stderr, res.stderr
    assert _files(tmp_path) == before, "prune changed the file it refused"

    with pytest.raises(StoreError, match=FOREIGN.replace("(", r"\(").replace(")", r"\)")):
        History(path, readonly=False)
    assert _files(tmp_path) == before
    with pytest.raises(StoreError, match="not an edo-monitor history database"):
        open_engine(path)
    assert _files(tmp_path) == before
    with (
        pytest.raises(StoreError, match="not an edo-monitor history database"),
        edo_monitor.watch(torch.nn.Linear(2, 2), db=path),
    ):
        pass
    assert _files(tmp_path) == before, "watch(db=...) changed the file it refused"
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    conn.close()


def test_a_history_still_opens_for_writing(tmp_path: Path) -> None:
    """The read-only check first is only for files not in WAL mode: a history is written as
    before (here one a tool switched back to a rollback journal: checked, then written)."""
    path = tmp_path / "h.db"
    seed(path)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()
    res = _cli(path, "prune", "--keep-last", "1")
    assert res.exit_code == 0, res.stderr
    with History(path) as h:
        assert len(h.runs()) == 2  # the running run is never pruned


def _set_meta(db: str, sql: str) -> None:
    """Run ``sql`` on ``db`` outside edo-monitor (which refuses a damaged history)."""
    engine = create_engine(db if "://" in db else f"sqlite:///{db}")
    try:
        with engine.begin() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


@pytest.fixture
def seeded_db(history_db: str) -> str:
    """A seeded history on SQLite, then on a fresh PostgreSQL schema."""
    seed(history_db)
    return history_db


COMMANDS = (["runs"], ["show", "1"], ["doctor"], ["prune", "--keep-last", "1"])


def test_a_schema_version_that_is_no_number_is_damage(seeded_db: str) -> None:
    for value in ("abc", "", "1.5", "0", "-1", "٣"):
        _set_meta(seeded_db, f"UPDATE meta SET value = '{value}' WHERE key = 'schema_version'")
        for command in COMMANDS:
            res = _cli(seeded_db, *command)
            assert res.exit_code == 1, (value, command, res.stderr)
            assert res.stderr.startswith("edo-monitor: error: history database "), res.stderr
            assert (
                f"is damaged: its meta table's schema_version is {value!r}, not a schema "
                "version (a whole number from 1); edo-monitor neither reads nor writes it"
            ) in res.stderr, res.stderr
            assert len(res.stderr.splitlines()) == 1
        with pytest.raises(StoreError, match="is damaged"):
            History(seeded_db)
    _set_meta(seeded_db, "UPDATE meta SET value = ' 8 ' WHERE key = 'schema_version'")
    assert _cli(seeded_db, "runs").exit_code == 0  # a number with spaces is still one


def test_no_version_row_and_no_alembic_revision_is_damage(seeded_db: str) -> None:
    """Read as schema version 1, the file was stamped 0001 and upgraded: "table meta already
    exists". Every edo-monitor wrote the version row with its tables; with Alembic's revision
    gone too, nothing says which schema the tables have."""
    _set_meta(seeded_db, "DELETE FROM meta WHERE key = 'schema_version'")
    _set_meta(seeded_db, "DROP TABLE alembic_version")
    for command in COMMANDS:
        res = _cli(seeded_db, *command)
        assert res.exit_code == 1, (command, res.stderr)
        assert (
            "is damaged: its meta table has no schema_version row and it has no Alembic "
            "revision, so nothing says which schema its tables have"
        ) in res.stderr, res.stderr
        assert "already exists" not in res.stderr
