"""Faults of the store a tester found, one test (or a few) each, on real SQLite files and a real
PostgreSQL server: a relative history path and a changed working folder; the live reader's
cursor (``SampleSeries.last_id``); the end of a run on a dropped connection; the label of
``runs.samples_dropped``; writable opens in a read-only folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from watch_helpers import make_model, run_row, train

import edo_monitor
from edo_monitor.store.paths import resolve_db_url

# -- a relative path and os.chdir inside the block --------------------------------------------


def test_relative_db_survives_chdir_inside_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer statted (and reconnected to) the relative path from the new working folder:
    "history database 'h.db' was deleted during the run", no row written, the run left
    ``running`` (then ``crashed``)."""
    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db="h.db", interval_s=0.01, run_name="chdir") as mon:
        os.chdir(tmp_path / "outputs")  # an output folder per run, Hydra-style
        train(model, opt, 20)
    summary = mon.summary()
    assert summary.rows_not_written == {
        "samples": 0,
        "events": 0,
        "module_stats": 0,
        "snapshots": 0,
    }
    assert (summary.recorded_status, summary.store_problem) == ("finished", None)
    assert summary.samples_written == summary.samples > 0
    row = run_row(tmp_path / "h.db")
    assert (row["status"], row["steps"], row["samples_dropped"]) == ("finished", 20, 0)
    assert list((tmp_path / "outputs").iterdir()) == []  # nothing made in the new folder


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("h.db", "{cwd}/h.db"),
        ("sub/../h.db", "{cwd}/sub/../h.db"),  # not normalised: a symlinked sub/ keeps meaning
        ("sqlite:///h.db", "{cwd}/h.db"),
        ("sqlite:///file:h%20x.db?mode=rwc&uri=true", "file:{cwd}/h%20x.db"),
    ],
)
def test_resolve_db_url_makes_sqlite_paths_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, expected: str
) -> None:
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    url = resolve_db_url(given)
    assert url.database == expected.format(cwd=tmp_path)
    assert url.query.get("mode") == ("rwc" if "mode" in given else None)  # parameters kept
    # absolute paths, other databases and in-memory SQLite are left as they are
    assert resolve_db_url(str(tmp_path / "a.db")).database == str(tmp_path / "a.db")
    pg = "postgresql+psycopg://u@h/db"
    assert resolve_db_url(pg).render_as_string(hide_password=False) == pg
