"""Schema evolution: version 1 → current on a real file, readers leave old files alone, newer and
foreign files are refused, and the migrations build exactly what ``schema.py`` declares."""

from __future__ import annotations

import hashlib
import importlib
import re
import sqlite3
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from edo_monitor.errors import StoreError
from edo_monitor.store.engine import open_engine
from edo_monitor.store.history import History
from edo_monitor.store.migrate import alembic_config
from edo_monitor.store.models import Base
from edo_monitor.store.schema import (
    CACHE_FIELDS,
    ROLLUP_FIELDS,
    ROLLUP_LEVEL_WIDTHS_S,
    SCHEMA_VERSION,
)

N = 3000


def _v1(path: Path, *, with_alembic_table: bool) -> None:
    """A version-1 database with one finished run of N samples, written by plain SQL."""
    command.upgrade(alembic_config(f"sqlite:///{path}"), "0001")
    conn = sqlite3.connect(path)
    if not with_alembic_table:  # as edo-monitor wrote it before migrations existed
        conn.execute("DROP TABLE alembic_version")
    conn.execute(
        "INSERT INTO runs (id, uuid, name, host, pid, started_at_s, ended_at_s, status, "
        "device_kind, interval_s, torch_version, config, tags, steps, samples_dropped) VALUES "
        "(1, 'abc', 'old', 'h', 1, 1.7e9, 1.7e9 + 3000, 'finished', 'cpu-budget', 1.0, '2', "
        "'{}', '[]', 5, 0)"
    )
    conn.executemany(
        "INSERT INTO samples (run_id, time_s, step, device_kind, in_use_bytes, free_fraction) "
        "VALUES (1, ?, ?, 'cpu-budget', ?, ?)",
        [(1.7e9 + i, i, (i * 7919) % 1000 * 1000, (i % 100) / 100) for i in range(N)],
    )
    conn.commit()
    conn.close()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("with_alembic_table", [False, True])
def test_reader_leaves_v1_alone_writer_upgrades(
    tmp_path: Path, with_alembic_table: bool, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "v1.db"
    _v1(path, with_alembic_table=with_alembic_table)
    before = _digest(path)
    with History(path) as h:
        assert h.schema_version == 1 and "older" in (h.outdated or "")
        assert h.run(1).sample_count == N and h.run(1).peak_in_use_bytes == 999_000
        s = h.samples(1, columns=["in_use_bytes"], max_points=100)
        assert sum(s.count) == N and max(s.max["in_use_bytes"]) == 999_000
    assert "older" in caplog.text
    assert _digest(path) == before  # untouched

    open_engine(path).dispose()  # a writer upgrades
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (
        str(SCHEMA_VERSION),
    )
    assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (
        f"{SCHEMA_VERSION:04d}",
    )
    per_level = conn.execute(
        "SELECT level, sum(n), max(in_use_bytes_max), count(*) FROM sample_rollups GROUP BY level"
    ).fetchall()
    times = [1.7e9 + i for i in range(N)]
    assert per_level == [
        (lvl, N, 999_000, len({int(t / w) for t in times}))
        for lvl, w in enumerate(ROLLUP_LEVEL_WIDTHS_S)
    ]
    assert conn.execute("SELECT count(*) FROM samples").fetchone() == (N,)
    # version 3's columns: old samples unmeasured, old rollup blocks summarise "no values"
    assert conn.execute(
        "SELECT count(*) FROM samples WHERE process_tree_bytes IS NULL AND host_limit_bytes IS NULL"
    ).fetchone() == (N,)
    assert conn.execute(
        "SELECT DISTINCT process_tree_bytes_min, process_tree_bytes_sum, process_tree_bytes_n, "
        "host_limit_bytes_sum, host_limit_bytes_n FROM sample_rollups"
    ).fetchall() == [(None, 0.0, 0, 0.0, 0)]
    conn.close()
    with History(path) as h:
        assert h.outdated is None and h.run(1).sample_count == N


def test_rollup_revision_matches_schema_py() -> None:
    """Revisions 0002–0004 keep frozen copies of the rollup columns and level widths; together
    they must be what ``schema.py`` (and so the writers and readers) use (no later revision
    changes the rollups)."""
    assert SCHEMA_VERSION == 8
    rev = importlib.import_module("edo_monitor.store.migrations.versions.0002_sample_rollups")
    rev3 = importlib.import_module("edo_monitor.store.migrations.versions.0003_host_tree_and_limit")
    rev4 = importlib.import_module("edo_monitor.store.migrations.versions.0004_row_cache_counters")
    assert rev.FIELDS + rev3.FIELDS + rev4.FIELDS == ROLLUP_FIELDS
    assert rev4.FIELDS == CACHE_FIELDS
    assert rev.WIDTHS_S == ROLLUP_LEVEL_WIDTHS_S == (16, 256, 4096)


def test_migrations_build_what_schema_py_declares(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    engine = open_engine(path)
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diffs == []


def test_downgrade_and_upgrade_again(tmp_path: Path) -> None:
    path = tmp_path / "d.db"
    open_engine(path).dispose()
    cfg = alembic_config(f"sqlite:///{path}")
    command.downgrade(cfg, "0001")
    with History(path) as h:
        assert h.schema_version == 1
    command.upgrade(cfg, "head")
    with History(path) as h:
        assert h.schema_version == SCHEMA_VERSION


def test_newer_database_refused_naming_both_versions(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    open_engine(path).dispose()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    for readonly in (True, False):
        with pytest.raises(StoreError, match=rf"schema version 99.*{SCHEMA_VERSION}"):
            open_engine(path, readonly=readonly)


def test_not_a_database_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"definitely not sqlite " * 200)
    for readonly in (True, False):
        with pytest.raises(StoreError, match="not an SQLite database"):
            open_engine(junk, readonly=readonly)
    assert junk.read_bytes() == b"definitely not sqlite " * 200
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE recipes (name TEXT)")
    conn.commit()
    conn.close()
    for readonly in (True, False):
        with pytest.raises(StoreError, match="not an edo-monitor history database"):
            open_engine(other, readonly=readonly)


def test_a_database_missing_a_table_is_refused_by_readers_and_writers(tmp_path: Path) -> None:
    """A history whose ``events`` table was dropped: every command failed with a multi-line
    SQLAlchemy error, ``doctor`` said ok, and a training run into it lost every event and still
    ended "finished". Now readers, writers and ``watch()`` refuse it, naming the table."""
    import torch

    import edo_monitor

    path = tmp_path / "damaged.db"
    open_engine(path).dispose()
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE events")
    conn.execute("DROP TABLE jobs")
    conn.commit()
    conn.close()
    message = (
        rf"history database '{re.escape(str(path))}' is damaged: it has schema version "
        rf"{SCHEMA_VERSION} but not the tables events, jobs;"
    )
    for readonly in (True, False):
        with pytest.raises(StoreError, match=f"^{message}"):
            open_engine(path, readonly=readonly)
    with pytest.raises(StoreError, match=message):
        History(path)
    with (
        pytest.raises(StoreError, match=message),
        edo_monitor.watch(torch.nn.Linear(2, 2), db=path),
    ):
        pass
    # an older schema is read as it is: only the tables every version has are required
    old = tmp_path / "old.db"
    open_engine(old).dispose()
    conn = sqlite3.connect(old)
    conn.execute("DROP TABLE jobs")
    conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.execute("UPDATE alembic_version SET version_num = '0004'")
    conn.commit()
    conn.close()
    open_engine(old, readonly=True).dispose()
