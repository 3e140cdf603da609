"""Nothing lost without being counted (issue 9, item 14): a full disk (SQLite's own
``max_page_count`` limit, which raises the real SQLITE_FULL), a database file deleted or replaced
mid-run, in-memory URLs, a read-only file, integers SQLite cannot store, oversized budgets."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import Engine, event, text
from sqlalchemy.orm import Session
from torch import nn
from watch_helpers import count

import edo_monitor
from edo_monitor.errors import ConfigError, StoreError
from edo_monitor.probes.readings import Reading
from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Run
from edo_monitor.store.writer import Writer

T0 = 1.7e9


def _run_row(engine: Engine) -> int:
    with Session(engine) as s, s.begin():
        run = Run(
            uuid=str(uuid.UUID(int=7)),
            name="w",
            host="h",
            pid=0,
            started_at_s=T0,
            status="running",
            device_kind="cpu-budget",
            interval_s=0.1,
            torch_version="x",
            config={},
            tags=[],
            steps=0,
            samples_dropped=0,
        )
        s.add(run)
        s.flush()
        return run.id


def _reading(i: int, **extra: Any) -> Reading:
    return Reading(time_s=T0 + i * 0.1, step=i, device_kind="cpu-budget", in_use_bytes=i, **extra)


def _wait_for(condition: Any, what: str, polls: int = 3000) -> None:
    """Poll ``condition`` every 10 ms; the poll count is a hang guard, not a timing bound."""
    for _ in range(polls):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture
def page_limit() -> Iterator[dict[str, int]]:
    """SQLite's ``PRAGMA max_page_count`` on every new connection to a file named ``full.db``:
    the database cannot grow past it and writes fail with the real SQLITE_FULL ("database or
    disk is full"). ``limit["pages"]`` is read at connect time (0 = no limit)."""
    limit = {"pages": 0}

    def on_connect(dbapi: Any, _record: Any) -> None:
        row = dbapi.execute("PRAGMA database_list").fetchone()
        if limit["pages"] and row and str(row[2]).endswith("full.db"):
            dbapi.execute(f"PRAGMA max_page_count = {limit['pages']}")

    event.listen(Engine, "connect", on_connect)
    try:
        yield limit
    finally:
        event.remove(Engine, "connect", on_connect)


# -- the writer ------------------------------------------------------------------------------


def test_disk_full_counts_every_row_it_could_not_write(
    tmp_path: Path, page_limit: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "full.db"
    engine = open_engine(path)
    run_id = _run_row(engine)
    pages = count(path, "PRAGMA page_count")
    engine.dispose()
    page_limit["pages"] = pages  # full from the first new page on
    engine = open_engine(path)
    writer = Writer(engine, run_id, batch_size=1_000, flush_interval_s=0.01)
    for i in range(123):
        writer.put_sample(_reading(i))
    for i in range(4):
        writer.put_event("decision", f"d{i}", step=i)
    for i in range(3):
        writer.put_module_stat({"time_s": T0, "step": 0, "module": f"m{i}", "kind": "Embedding"})
    writer.start()
    with caplog.at_level(logging.WARNING):
        writer.close()
    assert writer.written == {"samples": 0, "events": 0, "module_stats": 0, "snapshots": 0}
    assert writer.not_written == {"samples": 123, "events": 4, "module_stats": 3, "snapshots": 0}
    assert count(path, "SELECT samples_dropped FROM runs") == 0  # the heartbeat never fit
    assert writer.dropped == 130
    assert "database or disk is full" in (writer.problem or "")
    assert "123 sample(s), 4 event(s), 3 module row(s), 0 snapshot(s) not written" in caplog.text
    assert count(path, "SELECT count(*) FROM samples") == 0
    engine.dispose()


def test_value_sqlite_cannot_store_is_nulled_not_the_batch(tmp_path: Path) -> None:
    engine = open_engine(tmp_path / "w.db")
    run_id = _run_row(engine)
    writer = Writer(engine, run_id, batch_size=100, flush_interval_s=0.01)
    writer.put_sample(_reading(0, process_device_bytes=2**64 - 1, allocated_bytes=5))
    writer.put_sample(_reading(1, process_device_bytes=2**63, reserved_bytes=-(2**63) - 1))
    writer.put_sample(_reading(2, process_device_bytes=2**63 - 1))
    writer.start()
    writer.close()
    assert writer.written["samples"] == 3 and writer.dropped == 0 and writer.values_nulled == 3
    con = sqlite3.connect(tmp_path / "w.db")
    rows = con.execute(
        "SELECT step, process_device_bytes, allocated_bytes, reserved_bytes FROM samples "
        "ORDER BY step"
    ).fetchall()
    con.close()
    assert rows == [(0, None, 5, None), (1, None, None, None), (2, 2**63 - 1, None, None)]
    engine.dispose()


def test_disk_filling_mid_run_writes_what_fits_and_counts_the_rest(
    tmp_path: Path, page_limit: dict[str, int]
) -> None:
    path = tmp_path / "full.db"
    engine = open_engine(path)
    run_id = _run_row(engine)
    page_limit["pages"] = count(path, "PRAGMA page_count") + 4
    engine.dispose()
    engine = open_engine(path)
    writer = Writer(engine, run_id, batch_size=20, flush_interval_s=0.01)
    writer.start()
    for i in range(20):
        writer.put_sample(_reading(i))
    _wait_for(lambda: writer.written["samples"] == 20, "the first batch")
    for i in range(20, 3_000):
        writer.put_sample(_reading(i))
    writer.close()
    held = count(path, "SELECT count(*) FROM samples")
    assert 20 <= held == writer.written["samples"] < 3_000
    assert writer.not_written["samples"] == 3_000 - held
    assert "database or disk is full" in (writer.problem or "")
    engine.dispose()


def test_close_out_of_time_counts_the_batch_and_never_commits_it_later(tmp_path: Path) -> None:
    """Another connection holds the write lock past ``close(timeout_s)``: the rows the thread
    was writing and those still queued are counted as not written when close() returns, and
    the thread, let through afterwards, does not commit them (they were lost uncounted)."""
    path = tmp_path / "w.db"
    engine = open_engine(path)
    run_id = _run_row(engine)
    writer = Writer(engine, run_id, batch_size=10, flush_interval_s=0.01)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the write lock, held past close()'s wait
    try:
        writer.start()
        for i in range(25):
            writer.put_sample(_reading(i))
        writer.close(timeout_s=0.5)
        assert writer.not_written["samples"] == 25 and writer.written["samples"] == 0
        assert writer.dropped == 25
        assert "did not take the run's last rows within 0.5 s" in (writer.problem or "")
    finally:
        other.execute("ROLLBACK")
        other.close()
    writer._thread.join(30)
    assert not writer._thread.is_alive()
    assert count(path, "SELECT count(*) FROM samples") == 0
    assert writer.written["samples"] == 0 and writer.not_written["samples"] == 25
    engine.dispose()


# -- watch() ---------------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(2_000, 16), nn.Flatten(), nn.Linear(16 * 4, 1))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        loss = model(torch.randint(0, 2_000, (8, 4))).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.slow
def test_watch_on_a_full_disk_counts_in_the_run_row_summary_and_log(
    tmp_path: Path, page_limit: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "full.db"
    open_engine(path).dispose()  # schema created: the run's own row still fits after this
    page_limit["pages"] = count(path, "PRAGMA page_count")  # the run's row fits, little more
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING):
        with edo_monitor.watch(model, db=path, interval_s=0.02) as mon:
            _steps(model, opt, 5)
            _wait_for(lambda: mon.summary().samples >= 60, "60 samples")
            _steps(model, opt, 5)
        summary = mon.summary()
    held = count(path, "SELECT count(*) FROM samples")
    assert summary.samples_written == held  # never more than the database holds
    assert summary.samples == held + summary.rows_not_written["samples"]
    assert summary.rows_not_written["samples"] > 0
    assert summary.samples_dropped == sum(summary.rows_not_written.values())
    assert "database or disk is full" in (summary.store_problem or "")
    assert "NOT WRITTEN" in str(summary)
    assert f"{summary.rows_not_written['samples']} sample(s)" in caplog.text
    status = count(path, "SELECT status FROM runs")
    assert summary.recorded_status == (status if status == "finished" else None)
    if status == "finished":  # the end fitted into the run's page: the count is in the row too
        assert count(path, "SELECT samples_dropped FROM runs") == summary.samples_dropped
    else:
        assert "still records this run as running" in str(summary)


@pytest.mark.parametrize("how", ["folder deleted", "file replaced"])
def test_database_deleted_or_replaced_mid_run_is_noticed_and_counted(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "runs"
    folder.mkdir()
    path = folder / "h.db"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING):
        with edo_monitor.watch(model, db=path, interval_s=0.02) as mon:
            _steps(model, opt, 3)
            _wait_for(lambda: mon.summary().samples_written > 0, "a first flush")
            if how == "folder deleted":
                shutil.rmtree(folder)
            else:
                shutil.copy(path, tmp_path / "copy.db")
                os.replace(tmp_path / "copy.db", path)
            _wait_for(lambda: mon.summary().store_problem is not None, "the writer to notice")
            _steps(model, opt, 3)
        summary = mon.summary()
    word = "deleted" if how == "folder deleted" else "replaced"
    assert word in (summary.store_problem or "")
    assert summary.events.get("store_error") == 1
    assert summary.rows_not_written["samples"] > 0
    assert summary.samples == summary.samples_written + summary.rows_not_written["samples"]
    assert summary.recorded_status is None
    assert "still records this run as running" in str(summary)
    assert f"was {word}" in caplog.text and "not written" in caplog.text


@pytest.mark.parametrize(
    "db",
    [
        "sqlite://",
        "sqlite:///:memory:",
        "sqlite:///file:edo?mode=memory&cache=shared&uri=true",
    ],
)
def test_in_memory_database_is_refused_at_watch(db: str) -> None:
    with pytest.raises(ConfigError, match="in-memory SQLite database"):
        edo_monitor.watch(_model(), db=db)


def _read_only(path: Path) -> Iterator[None]:
    """Make ``path`` unwritable for this process: permissions, or (as root, whom permissions do
    not stop) the immutable attribute."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: nothing makes a file read-only for root")
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"running as root and chattr +i is refused here: {done.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("what", ["file", "folder"])
def test_read_only_database_is_a_store_error_at_watch(tmp_path: Path, what: str) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    path = folder / "h.db"
    open_engine(path).dispose()
    for _ in _read_only(path if what == "file" else folder):
        with pytest.raises(StoreError, match="read-only"):
            edo_monitor.watch(_model(), db=path)


@pytest.mark.parametrize("budget", [2**63, 2**64, "8EiB", "9.3EB"])
def test_budget_beyond_64_bits_is_a_config_error_at_watch(budget: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="2\\*\\*63"):
        edo_monitor.watch(_model(), db=tmp_path / "h.db", budget=budget)


def test_largest_storable_budget_runs(tmp_path: Path) -> None:
    model = _model()
    with edo_monitor.watch(model, db=tmp_path / "h.db", budget=2**63 - 1) as mon:
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    assert mon.summary().budget_bytes == 2**63 - 1
    assert count(tmp_path / "h.db", "SELECT budget_bytes FROM runs") == 2**63 - 1


def test_text_longer_than_its_column_or_holding_nul_is_fitted_not_the_batch(
    history_db: str,
) -> None:
    """PostgreSQL refuses a string longer than its ``VARCHAR`` or holding a NUL character, and
    the refusal took the whole flush (samples too) with it; every backend now stores such a
    string fitted: NUL as U+FFFD, clipped to the column's length ending in an ellipsis (JSON
    keeps its NUL: both backends store it escaped)."""
    engine = open_engine(history_db)
    run_id = _run_row(engine)
    writer = Writer(engine, run_id, batch_size=100, flush_interval_s=0.01)
    writer.put_sample(_reading(0))
    name = "blocks." + "x" * 600
    row = {"time_s": T0, "step": 0, "module": name, "kind": "Bag\x00", "dtype": "d" * 40}
    writer.put_module_stat(row)
    writer.put_event("decision", "a\x00b", step=0, data={"why": "c\x00d"})
    # a lone surrogate (an os.fsdecode'd file name in an error): no UTF-8 holds it
    writer.put_event("oom", "file \udce9.bin", step=0, data={"file": "\udce9"})
    writer.start()
    writer.close()
    assert writer.not_written == {"samples": 0, "events": 0, "module_stats": 0, "snapshots": 0}
    assert writer.written == {"samples": 1, "events": 2, "module_stats": 1, "snapshots": 0}
    assert writer.values_fitted == 5
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT module, kind, dtype FROM module_stats")).one()
        event, escaped = conn.execute(text("SELECT message, data FROM events ORDER BY id")).all()
    assert tuple(stored) == (name[:499] + "…", "Bag\ufffd", "d" * 31 + "…")
    assert escaped[0] == "file \\udce9.bin"  # its escape, six characters
    message, data = event
    assert message == "a\ufffdb"
    assert (json.loads(data) if isinstance(data, str) else data) == {"why": "c\x00d"}  # kept
    engine.dispose()
