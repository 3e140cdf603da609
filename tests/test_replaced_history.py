"""A history file removed or replaced while a long-lived reader holds it open (``rm`` and a new
run at the same path): the dashboard's data source and ``edo-monitor metrics`` open the path
again; a ``History`` says so instead of reading the old file on (they served the old file's runs
for as long as they ran, and a run recorded into the new file never appeared)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.errors import StoreError
from edo_monitor.exporters.prometheus import HistoryCollector
from edo_monitor.store.history import History
from edo_monitor.tui.data import DataSource


def _record(path: Path, name: str) -> None:
    with edo_monitor.watch(nn.Linear(2, 1), db=path, run_name=name):
        pass


def _remove(path: Path) -> None:
    for f in path.parent.glob(path.name + "*"):  # the file and its -wal / -shm
        f.unlink()


def test_readers_open_a_replaced_history_file_again(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    _record(path, "old")
    history = History(path)
    source = DataSource(path)
    collector = HistoryCollector(None, opener=lambda: History(path))
    assert [r.name for r in source.runs()] == ["old"] and collector.entries() == []
    assert not history.replaced()

    _remove(path)
    _record(path, "new")  # a new history at the same path
    assert history.replaced()
    with pytest.raises(StoreError, match="was removed or replaced since it was opened"):
        history.runs()
    assert [r.name for r in source.runs()] == ["new"]

    model = nn.Linear(2, 1)
    with edo_monitor.watch(model, db=path, run_name="live", interval_s=0.01) as mon:
        deadline = time.monotonic() + 30
        while not collector.entries() and time.monotonic() < deadline:
            model(torch.randn(4, 2)).sum().backward()
            mon.step()
            time.sleep(0.02)
        (labels, _, _), *_ = collector.entries()
    assert "live" in labels

    _remove(path)  # gone: nothing served, no error
    assert collector.entries() == []
    with pytest.raises(StoreError, match="no history database"):
        source.runs()
    history.close()
    source.close()
