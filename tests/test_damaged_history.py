"""A history damaged in the middle of the file (pages overwritten: the schema page reads, the
tables' pages do not) is refused by every reader, and by ``prune``, as a truncated one is: one
line, "is a damaged SQLite database", exit code 1, never an internal error; ``doctor`` reports
the damage as a finding (exit code 1) instead of failing on it."""

from __future__ import annotations

import inspect
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from history_seed import seed
from typer.testing import CliRunner

from edo_monitor.errors import StoreError
from edo_monitor.store.history import History
from edo_monitor.surfaces.cli import app

runner = (
    CliRunner(mix_stderr=False)
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters
    else CliRunner()
)

DAMAGED = "is a damaged SQLite database (database disk image is malformed)"


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real seeded history (five runs, samples, events, modules), pages 6-12 overwritten."""
    folder = tmp_path_factory.mktemp("damaged")
    good = folder / "good.db"
    seed(good)
    conn = sqlite3.connect(good)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the main file
    conn.close()
    data = bytearray(good.read_bytes())
    assert len(data) > 4096 * 12
    data[4096 * 5 : 4096 * 12] = b"\xab" * (4096 * 7)
    path = folder / "damaged.db"
    path.write_bytes(bytes(data))
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA quick_check").fetchone()[0] != "ok"  # damaged indeed
    conn.close()
    return path


def _cli(*args: str) -> Any:
    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    "args",
    [
        ["runs"],
        ["runs", "--json"],
        ["show", "1"],
        ["events", "1"],
        ["compare", "1", "2"],
        ["export", "1", "--format", "csv"],
        ["export", "1", "--format", "json"],
    ],
    ids=" ".join,
)
def test_readers_refuse_a_damaged_file_in_one_line(damaged: Path, args: list[str]) -> None:
    res = _cli("--db", str(damaged), *args)
    assert res.exit_code == 1, (res.exit_code, res.stderr)
    assert res.stderr == f"edo-monitor: error: {str(damaged)!r} {DAMAGED}; edo-monitor " + (
        "neither reads nor writes it (copy out what you need with sqlite3, or start a new "
        "database)\n"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["prune", "--older-than", "0s"],
        ["prune", "--keep-last", "1"],
        ["prune", "--downsample-older-than", "0s", "--bucket", "1h"],
    ],
    ids=" ".join,
)
def test_writers_refuse_a_damaged_file_in_one_line(
    damaged: Path, tmp_path: Path, args: list[str]
) -> None:
    """A write that meets a damaged page is refused as a read is (it was an internal error,
    exit code 3, naming SQLAlchemy's DatabaseError), and changes nothing."""
    path = tmp_path / "damaged.db"
    path.write_bytes(damaged.read_bytes())
    res = _cli("--db", str(path), *args)
    assert res.exit_code == 1, (res.exit_code, res.stderr)
    assert res.stderr.startswith(f"edo-monitor: error: {str(path)!r} {DAMAGED}; ")
    assert path.read_bytes() == damaged.read_bytes()


def test_history_api_raises_store_error(damaged: Path) -> None:
    with History(damaged) as h, pytest.raises(StoreError, match=re.escape(DAMAGED)):
        h.runs()


@pytest.mark.parametrize("full", [False, True])
def test_doctor_reports_the_damage(damaged: Path, full: bool) -> None:
    check = "integrity_check" if full else "quick_check"
    extra = ["--full"] if full else []
    res = _cli("--db", str(damaged), "doctor", *extra)
    assert res.exit_code == 1, res.stderr  # "doctor found a problem"
    assert "internal error" not in res.stderr
    assert "unreadable (damaged)" in res.stdout and "rows: runs" in res.stdout
    problems = res.stderr.splitlines()
    assert problems[0].startswith(f"edo-monitor: problem: {check}: *** in database main ***")
    assert DAMAGED in problems[1] and len(problems) == 2

    res = _cli("--db", str(damaged), "doctor", "--json", *extra)
    assert res.exit_code == 1
    report = json.loads(res.stdout)
    assert report["ok"] is False and report[check] != ["ok"]
    assert report["rows"]["runs"] is None and "rows: runs" in report["unreadable"]
    assert any(DAMAGED in p for p in report["problems"])


def test_doctor_of_a_sound_file_is_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "good.db"
    seed(path)
    res = _cli("--db", str(path), "doctor", "--json")
    assert res.exit_code == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] and report["quick_check"] == ["ok"] and report["unreadable"] == []
    assert None not in report["rows"].values()


def test_a_lost_version_row_is_damage_not_an_older_schema(tmp_path: Path) -> None:
    """A damaged page that lost ``meta``'s version row read as schema version 1: every reader
    warned "has schema version 1, older than 8 ... reading it as it is" before the first query
    met the damage. Alembic's revision still says the schema's version: the two disagree."""
    from edo_monitor.store.schema import SCHEMA_VERSION

    path = tmp_path / "lost.db"
    seed(path)
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM meta WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    res = _cli("--db", str(path), "runs")
    assert res.exit_code == 1, (res.exit_code, res.stderr)
    assert res.stderr == (
        f"edo-monitor: error: history database {str(path)!r} is damaged: its meta table says "
        f"schema version 1 and its Alembic revision '{SCHEMA_VERSION:04d}'; edo-monitor neither "
        "reads nor writes it (copy out what you need with sqlite3, or start a new database)\n"
    )
    with pytest.raises(StoreError, match="is damaged: its meta table says"):
        History(path).__enter__()


def test_a_run_meeting_a_damaged_page_trains_on_and_says_so_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A history whose damage lies where the run's samples go (the last leaf page of
    ``samples``) opens for ``watch()``; its writer's samples met the page through the raw
    cursor of ``write_samples``, which SQLAlchemy's damaged-page hook does not see: an internal
    DatabaseError with two tracebacks. Now the damaged-file message, one line, no traceback."""
    import torch

    import edo_monitor

    good = tmp_path / "good.db"
    seed(good)
    with sqlite3.connect(good) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (page,) = conn.execute(
            "SELECT pageno FROM dbstat WHERE name = 'samples' AND pagetype = 'leaf' "
            "ORDER BY path DESC LIMIT 1"
        ).fetchone()
    conn.close()
    data = bytearray(good.read_bytes())
    data[4096 * (page - 1) : 4096 * page] = b"\xab" * 4096
    path = tmp_path / "damaged.db"
    path.write_bytes(bytes(data))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = caplog.at_level("ERROR", logger="edo_monitor.store.writer")
    with log, edo_monitor.watch(model, db=path, interval_s=0.01) as mon:
        for _ in range(20):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert errors[0].getMessage() == (
        f"history writer: {str(path)!r} {DAMAGED}; edo-monitor neither reads nor writes it "
        "(copy out what you need with sqlite3, or start a new database); dropping the batch"
    )
