"""Readers of a history written by an older edo-monitor (schema 2: before ``host_limit_bytes``;
schema 3: before the row-cache columns) read it as it is: ``export`` writes every column, the
ones the file lacks empty (not recorded), and an explicit request for such a column names it
and the file's schema instead of failing in SQL. The old files are real ones: the seeded history
rebuilt at the older schema by the project's own Alembic downgrade."""

from __future__ import annotations

import csv
import hashlib
import inspect
import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from history_seed import N_SAMPLES, seed
from typer.testing import CliRunner

from edo_monitor.errors import StoreError
from edo_monitor.exporters.samples_file import EXPORT_COLUMNS
from edo_monitor.store.history import History
from edo_monitor.store.migrate import alembic_config
from edo_monitor.surfaces.cli import app

runner = (
    CliRunner(mix_stderr=False)
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters
    else CliRunner()
)

#: revision -> (schema version, a sample column that version lacks)
OLD = {"0002": (2, "host_limit_bytes"), "0003": (3, "cache_rows")}


@pytest.fixture(scope="module", params=sorted(OLD))
def old_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"schema{request.param}") / "old.db"
    seed(path)
    command.downgrade(alembic_config(f"sqlite:///{path}"), request.param)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    cols = {r[1] for r in conn.execute("PRAGMA table_info(samples)")}
    conn.close()
    want_version, lacking = OLD[request.param]
    assert version == (str(want_version),) and lacking not in cols
    return path


def _schema(path: Path) -> tuple[int, str]:
    conn = sqlite3.connect(path)
    version = int(conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
    conn.close()
    return version, OLD[f"{version:04d}"][1]


def _in_use(path: Path) -> list[Any]:
    conn = sqlite3.connect(path)
    rows = [
        r[0] for r in conn.execute("SELECT in_use_bytes FROM samples WHERE run_id = 1 ORDER BY id")
    ]
    conn.close()
    return rows


def _cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


def test_export_csv_of_an_older_schema(old_db: Path) -> None:
    digest = hashlib.sha256(old_db.read_bytes()).hexdigest()
    _, lacking = _schema(old_db)
    res = _cli("--db", str(old_db), "export", "1", "--format", "csv")
    assert res.exit_code == 0, res.stderr
    assert "internal error" not in res.stderr
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert tuple(rows[0]) == EXPORT_COLUMNS  # every column, as for a current file
    assert len(rows) == N_SAMPLES
    assert {r[lacking] for r in rows} == {""}  # not recorded: an empty field
    assert {r["host_limit_bytes"] for r in rows} == {""}
    want = ["" if v is None else str(v) for v in _in_use(old_db)]
    assert [r["in_use_bytes"] for r in rows] == want
    assert hashlib.sha256(old_db.read_bytes()).hexdigest() == digest  # read, never upgraded


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_export_json_of_an_older_schema(old_db: Path, fmt: str) -> None:
    _, lacking = _schema(old_db)
    res = _cli("--db", str(old_db), "export", "1", "--format", fmt)
    assert res.exit_code == 0, res.stderr
    if fmt == "json":
        samples = json.loads(res.stdout)["samples"]
    else:
        lines = [json.loads(line) for line in res.stdout.splitlines()]
        samples = [d for d in lines if d["type"] == "sample"]
    assert len(samples) == N_SAMPLES
    assert all(s[lacking] is None and s["cache_rows"] is None for s in samples)
    assert [s["in_use_bytes"] for s in samples] == _in_use(old_db)


def test_history_names_a_column_the_file_lacks(old_db: Path) -> None:
    version, lacking = _schema(old_db)
    with History(old_db) as h:
        assert lacking not in h.sample_columns and "in_use_bytes" in h.sample_columns
        want = rf"no sample column {lacking}: it has schema version {version}\b"
        with pytest.raises(StoreError, match=want):
            h.samples(1, columns=[lacking])
        with pytest.raises(StoreError, match=want):
            h.samples(1, columns=["in_use_bytes", lacking], max_points=10)
        with pytest.raises(StoreError, match=want):
            h.samples_since(1, columns=[lacking])
        with pytest.raises(StoreError, match=want):
            h.peak(1, lacking)
        # the columns it has are read as before
        series = h.samples(1, columns=["in_use_bytes"], max_points=None)
        assert series.max["in_use_bytes"] == _in_use(old_db)
        assert len(h.samples_since(1, columns=h.sample_columns, limit=None)) == N_SAMPLES


def test_a_dry_run_prune_counts_what_the_prune_deletes(old_db: Path, tmp_path: Path) -> None:
    """Regression: a dry run reads an older file as it is (it is not upgraded) and its count
    of the downsampled samples read ``cache_rows``, which schema 3 lacks: exit 3, "internal
    error". It counts now, leaves the file as it was, and says what the prune (which upgrades
    the file first) then deletes."""
    digest = hashlib.sha256(old_db.read_bytes()).hexdigest()
    args = ("prune", "--downsample-older-than", "0s", "--bucket", "1s")
    dry = _cli("--db", str(old_db), *args, "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert hashlib.sha256(old_db.read_bytes()).hexdigest() == digest
    copy = tmp_path / "copy.db"
    copy.write_bytes(old_db.read_bytes())
    done = _cli("--db", str(copy), *args)
    assert done.exit_code == 0, done.stderr
    counted = [line for line in dry.stdout.splitlines() if "sample" in line]
    deleted = [line for line in done.stdout.splitlines() if "sample" in line]
    assert counted and deleted, (dry.stdout, done.stdout)
    assert [int(w) for w in counted[0].split() if w.isdigit()] == [
        int(w) for w in deleted[0].split() if w.isdigit()
    ], (dry.stdout, done.stdout)
