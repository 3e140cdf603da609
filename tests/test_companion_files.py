"""A history path that names one of SQLite's companion files (``NAME-wal``, ``NAME-shm``,
``NAME-journal``) is refused by every writer and reader, whether or not ``NAME`` exists.

Regression: ``edo-monitor daemon --db w.db-wal`` (the ``-wal`` a reader of ``w.db`` leaves
behind) created a whole database inside that file; the next open of ``w.db`` took it for
``w.db``'s write-ahead log and replaced it, and every row the daemon had written was gone.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from history_seed import seed
from sqlalchemy.engine import URL

import edo_monitor
from edo_monitor.errors import ConfigError
from edo_monitor.store.engine import open_engine
from edo_monitor.store.history import History

LAUNCHER = Path(__file__).resolve().parent / "fakes" / "daemon_main.py"
SUFFIXES = ("-wal", "-shm", "-journal")
EXIT_USAGE = 2


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("EDO_DB", None)
    return subprocess.run(
        [str(Path(sys.executable).with_name("edo-monitor")), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _words(path: Path, suffix: str) -> str:
    base = str(path)[: -len(suffix)]
    return f"is the {suffix} file ({{}}) of SQLite database {base!r}, not a history database"


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("companions") / "h.db"
    seed(path)
    return path


@pytest.mark.parametrize("base_exists", [True, False], ids=["database", "no-database"])
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_every_writer_and_reader_refuses_a_companion(
    tmp_path: Path, seeded: Path, suffix: str, base_exists: bool
) -> None:
    if base_exists:
        shutil.copy(seeded, tmp_path / "h.db")
    companion = tmp_path / f"h.db{suffix}"
    companion.write_bytes(b"")  # what a reader of a WAL database leaves: an empty -wal
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    what = {"-wal": "write-ahead log", "-shm": "WAL shared-memory index"}.get(
        suffix, "rollback journal"
    )
    words = _words(companion, suffix).format(what)
    for opener in (
        lambda: open_engine(companion),  # writers: the agent's run, prune, the daemon
        lambda: open_engine(URL.create("sqlite", database=str(companion))),  # a URL made elsewhere
        lambda: open_engine(f"sqlite:///{companion}"),
        lambda: open_engine(companion, readonly=True),
        lambda: History(companion),
    ):
        with pytest.raises(ConfigError) as err:
            opener()
        assert words in str(err.value)
    # watch(): a bad db= is a ConfigError from watch() itself, before any run is started
    with pytest.raises(ConfigError, match="not a history database"):
        edo_monitor.watch(torch.nn.Linear(2, 2), db=companion)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written


def test_cli_writers_and_readers_refuse_it_in_one_line(tmp_path: Path, seeded: Path) -> None:
    shutil.copy(seeded, tmp_path / "h.db")
    wal = tmp_path / "h.db-wal"
    wal.write_bytes(b"")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for argv in (
        ["prune", "--keep-last", "1"],
        ["runs"],
        ["sql", "SELECT 1"],
        ["doctor"],
    ):
        done = _cli(*argv, "--db", str(wal))
        lines = done.stderr.splitlines()
        assert done.returncode == EXIT_USAGE and len(lines) == 1, (argv, done.stderr)
        assert (
            lines[0].startswith("edo-monitor: error: ")
            and _words(wal, "-wal").format("write-ahead log") in lines[0]
        ), (argv, lines[0])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_the_daemon_refuses_the_wal_a_reader_left(tmp_path: Path, seeded: Path) -> None:
    """The tester's case: the daemon given ``w.db-wal`` recorded into it, and a training that
    then opened ``w.db`` replaced it; now it refuses at once and writes nothing."""
    db = tmp_path / "w.db"
    shutil.copy(seeded, db)
    sqlite3.connect(f"file:{db}?mode=ro", uri=True).execute("SELECT 1 FROM runs").fetchall()
    wal = tmp_path / "w.db-wal"
    wal.write_bytes(b"")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("EDO_DB", None)
    spec = json.dumps({"gpus": [{"uuid": "GPU-aaa"}]})
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), spec, "daemon", "--db", str(wal), "--interval", "0.05"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.splitlines() == [
        f"edo-monitor: error: db={str(wal)!r} is the -wal file (write-ahead log) of SQLite "
        f"database {str(db)!r}, not a history database: SQLite keeps that file for 'w.db' "
        "(whether or not it exists now) and overwrites or deletes it when 'w.db' is opened; "
        f"give the database's own path (e.g. {str(db)!r}) or a name that does not end in -wal"
    ]
    assert wal.read_bytes() == b""
    assert not (tmp_path / "w.db-wal-wal").exists() and not (tmp_path / "w.db-wal-shm").exists()


def test_names_that_only_look_alike_are_databases(tmp_path: Path) -> None:
    for name in ("wal", "shm.db", "journal", "x-wal.db", "x.db-walk"):
        open_engine(tmp_path / name).dispose()
        with History(tmp_path / name) as h:
            assert h.runs() == []
