"""Every ``edo-monitor`` option that takes an id or a count goes through one range check
(``options.int64``: a whole number up to SQL's 64-bit INTEGER), before anything is opened, and
names the option and the value when it is not a number.

Regression: ``snapshot --event 99999999999999999999`` was an internal error (exit 3: SQLite's
"Python int too large to convert to SQLite INTEGER", PostgreSQL's multi-line "bigint out of
range" with the SQL), ``--event -1`` and ``0`` were "not an event of this run" (exit 1) where
``explain --event`` said what is allowed (exit 2); ``snapshot --event abc``, ``--top abc`` and
``sql --timeout abc`` printed typer's "Input should be a valid integer"; ``sql --timeout
3000000`` on PostgreSQL was an internal error ("Value exceeds integer range").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_runner import runner
from history_seed import seed

from edo_monitor.measure.snapshots import SnapshotError
from edo_monitor.store.history import History
from edo_monitor.store.snapshot_store import find_snapshot
from edo_monitor.surfaces.cli import app

INT64_MAX = 2**63 - 1

#: (the command before the option, the option, its lowest value)
ID_OPTIONS = [
    (["snapshot", "1"], "--event", 1),
    (["explain", "1"], "--event", 1),
    (["snapshot", "1"], "--top", 1),
    (["runs"], "--limit", 1),
    (["jobs"], "--limit", 1),
    (["show", "1"], "--max-events", 0),
    (["prune"], "--keep-last", 0),
    (["estimate", "--embedding-dim", "8"], "--num-embeddings", 1),
    (["estimate", "--num-embeddings", "8"], "--embedding-dim", 1),
]


def _cli(db: str | Path, *args: str) -> Any:
    return runner.invoke(app, ["--db", str(db), *args])


@pytest.mark.parametrize(
    ("command", "option", "low"), ID_OPTIONS, ids=[f"{c[0]} {o}" for c, o, _ in ID_OPTIONS]
)
def test_every_id_and_count_option_has_the_one_range_check(
    tmp_path: Path, command: list[str], option: str, low: int
) -> None:
    """Refused before the database is opened (it does not exist here): exit 2, one line."""
    missing = tmp_path / "none.db"
    allowed = f"allowed: {low} to {INT64_MAX}"
    for value in (str(INT64_MAX + 1), "99999999999999999999", str(low - 1), "-1"):
        res = _cli(missing, *command, option, value)
        assert res.exit_code == 2, (value, res.stderr)
        assert res.stderr == (
            f"edo-monitor: error: Invalid value for '{option}': {value} is out of range; "
            f"{allowed}\n"
        )
    res = _cli(missing, *command, option, "abc")
    assert res.exit_code == 2
    assert (
        res.stderr == f"edo-monitor: error: Invalid value for '{option}': 'abc' is not an integer\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def seeded_db(history_db: str) -> str:
    seed(history_db)
    return history_db


def test_sql_timeout_is_checked_alike_on_both_backends(seeded_db: str) -> None:
    """The largest ``--timeout`` is what PostgreSQL's ``statement_timeout`` holds (2**31 - 1
    ms); a larger one, a word, a negative or a non-finite one are refused before anything is
    opened."""
    allowed = "allowed: 0 s to 2147483 s"
    for value, why in (
        ("3000000", "3000000 is out of range"),
        ("-1", "-1 is out of range"),
        ("inf", "'inf' is infinite"),
        ("nan", "'nan' is not a number (nan)"),
    ):
        res = _cli(seeded_db, "sql", "SELECT 1", "--timeout", value)
        assert res.exit_code == 2, (value, res.stderr)
        assert res.stderr == (
            f"edo-monitor: error: Invalid value for '--timeout': {why}; {allowed}\n"
        )
    res = _cli(seeded_db, "sql", "SELECT 1", "--timeout", "abc")
    assert res.exit_code == 2
    assert (
        res.stderr == "edo-monitor: error: Invalid value for '--timeout': 'abc' is not a number\n"
    )
    for value in ("2147483", "0", "0.5"):
        res = _cli(seeded_db, "sql", "SELECT 1", "--timeout", value, "--json")
        assert res.exit_code == 0, (value, res.stderr)


def test_an_event_id_beyond_int64_is_no_event_of_the_run(seeded_db: str) -> None:
    """``find_snapshot`` (the Python side of ``snapshot --event``) on both backends."""
    with History(seeded_db) as h:
        for event in (2**63, 10**20, -(2**63) - 1):
            with pytest.raises(SnapshotError, match=rf"^event {event} of run 1 has no memory"):
                find_snapshot(h, 1, event)
