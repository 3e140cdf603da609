"""A run's rows end up in the database file itself, not only in its write-ahead log, even while
another process reads the file (``edo-monitor metrics``, the dashboard): a copy of the ``.db``
alone is a whole history (README: "a copy from another machine is enough")."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import torch
from torch import nn

import edo_monitor
from edo_monitor.store.history import History


def test_a_copy_of_the_file_alone_holds_a_run_written_while_another_connection_read_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "h.db"
    with edo_monitor.watch(nn.Linear(4, 1), db=db):  # the file exists from here
        pass
    reader = sqlite3.connect(db)  # a reader between its reads: no transaction open
    try:
        assert reader.execute("SELECT count(*) FROM runs").fetchall() == [(1,)]
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with edo_monitor.watch(model, opt, db=db, interval_s=0.01) as mon:
            for _ in range(3):
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
        shutil.copyfile(db, tmp_path / "copy.db")  # the file alone, not its -wal
    finally:
        reader.close()
    with History(tmp_path / "copy.db") as history:
        run = history.run(mon.run_id)
        assert (run.status, run.steps) == ("finished", 3)
        assert history.samples(mon.run_id).rows()
