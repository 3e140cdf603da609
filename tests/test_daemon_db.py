"""The database a daemon records into: one daemon a host and database, and a ``--db`` in a
folder that does not exist, on the fake NVML (only the hardware is faked).

Regressions: two daemons on one database both recorded the same GPU, every row twice with
nothing to tell them apart and no word said; ``daemon --db /nonexistent/x.db`` exited 2 while
the exit-code table listed a missing folder under 1 only (the readers' "no database").
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fakes.nvml import FakeGpu, FakeNvml
from sqlalchemy import insert
from test_daemon import _start as start_daemon

from edo_monitor.errors import StoreError
from edo_monitor.store.engine import open_engine
from edo_monitor.store.schema import device_events_table
from edo_monitor.surfaces.daemon import Daemon

README = Path(__file__).resolve().parent.parent / "README.md"
SPEC = json.dumps({"gpus": [{"uuid": "GPU-aaa"}]})


def _start(db: Path, *args: str) -> subprocess.Popen[str]:
    """The daemon on one fake GPU (``SPEC``), as test_daemon starts it."""
    return start_daemon(db, SPEC, *args)


def _device_rows(db: Path) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT count(*) FROM device_samples").fetchone()[0])
    finally:
        con.close()


def _wait_rows(db: Path, proc: subprocess.Popen[str], n: int = 3) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if db.exists() and _device_rows(db) >= n:
                return
        except sqlite3.OperationalError:
            pass
        time.sleep(0.05)
    raise AssertionError("the daemon wrote no rows in 90 s")


@pytest.mark.slow
def test_a_second_daemon_on_the_same_database_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "two.db"
    first = _start(db, "--interval", "0.05")
    try:
        _wait_rows(db, first)
        second = _start(db, "--interval", "0.05")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 1, err
        (line,) = err.splitlines()
        assert line.startswith(
            f"edo-monitor: error: another edo-monitor daemon (pid {first.pid}, started "
        )
        assert "would record every GPU and process twice" in line and "another --db" in line
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    con = sqlite3.connect(db)
    started = con.execute("SELECT data FROM device_events WHERE kind = 'daemon_started'").fetchall()
    times = con.execute("SELECT count(*), count(DISTINCT time_s) FROM device_samples").fetchone()
    con.close()
    assert [json.loads(d)["pid"] for (d,) in started] == [first.pid]  # the second wrote nothing
    assert times[0] == times[1]  # one row a sample: no GPU recorded twice
    # stopped, the first no longer holds the database: the next daemon starts
    third = _start(db, "--interval", "0.05")
    _wait_rows(db, third, _device_rows(db) + 3)
    third.send_signal(signal.SIGTERM)
    _, err = third.communicate(timeout=60)
    assert third.returncode == 0, err


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _started(db: Path, host: str, pid: int, time_s: float) -> None:
    engine = open_engine(db)
    with engine.begin() as conn:
        conn.execute(
            insert(device_events_table).values(
                time_s=time_s,
                host=host,
                kind="daemon_started",
                message="started",
                data={"pid": pid, "interval_s": 1.0},
            )
        )
    engine.dispose()


def _daemon(db: Path, **kw: Any) -> Daemon:
    return Daemon(db, nvml=FakeNvml([FakeGpu("GPU-aaa")]), interval_s=0.01, **kw)


def test_a_killed_daemon_other_hosts_and_reused_pids_do_not_block(db_path: Path) -> None:
    now = time.time()
    _started(db_path, "here", _dead_pid(), now - 60)  # killed without its daemon_stopped
    _started(db_path, "elsewhere", os.getppid(), now - 60)  # another host: its rows say so
    # a PID alive here, but a process that began after that start (the PID was reused)
    _started(db_path, "here", os.getpid(), now - 10**6)
    d = _daemon(db_path, host="here")
    d.start()
    d.sample()
    assert d.close().written["device_events"] >= 2  # its own start and stop
    # a live daemon of this host, started after its process began: refused, nothing written
    _started(db_path, "here", os.getppid(), now)
    with pytest.raises(StoreError, match=rf"another edo-monitor daemon \(pid {os.getppid()},"):
        _daemon(db_path, host="here").start()


def test_a_missing_folder_is_a_bad_value_as_the_exit_code_table_says(tmp_path: Path) -> None:
    """A writer's ``--db`` names the database it creates: a folder that does not exist is a bad
    value (exit 2, as for the examples' ``--db``), where a reader has no database (exit 1)."""
    db = tmp_path / "nonexistent" / "x.db"
    proc = _start(db)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.splitlines() == [
        f"edo-monitor: error: db={str(db)!r}: folder {str(db.parent)!r} does not exist"
    ]
    assert not db.parent.exists()
    rows = {
        line.split("|")[1].strip(): line
        for line in README.read_text(encoding="utf-8").splitlines()
        if line.startswith(("| 1 |", "| 2 |"))
    }
    assert "no database to read (missing file or missing folder)" in rows["1"]
    assert (
        "the `daemon`'s `--db` (the database it creates) in a folder that does not exist"
        in (rows["2"])
    )
    assert "another `daemon` recording this host into the database" in rows["1"]
