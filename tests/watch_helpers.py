"""What the watch() tests share: a small model, a training loop, polling, reading a history file."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn


def agent_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("edo-")]


def make_model(rows: int = 5_000, dim: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(rows, dim), nn.Linear(dim, 4))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, sleep_s: float = 0.0) -> None:
    for _ in range(steps):
        x = torch.randint(0, 5_000, (32,))
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sleep_s:
            time.sleep(sleep_s)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)


def run_row(db: Path) -> dict:
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    row = dict(con.execute("SELECT * FROM runs ORDER BY id DESC LIMIT 1").fetchone())
    con.close()
    return row


def count(db: Path, sql: str) -> int:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


#: ``record_pressure_run``'s table (20,000 × 32) with Adam after one step (params, grads, two
#: states) holds ~10.24 MB: below a 20 % (and a 30 %) floor of this budget from the first step
PRESSURE_BUDGET = 12_000_000


def record_pressure_run(db: Path, name: str, steps: int = 20, **watch_kw: object) -> int:
    """A real run of ``steps`` steps under watch() on a ``PRESSURE_BUDGET`` CPU budget (given a
    ``policy``: a crossing below its floor at the first step, an action, incident snapshots);
    returns its id."""
    import edo_monitor

    torch.manual_seed(0)
    rows, dim = 20_000, 32
    model = nn.Sequential(nn.Embedding(rows, dim), nn.Linear(dim, 1))
    opt = torch.optim.Adam(model.parameters())
    gen = torch.Generator().manual_seed(1)
    with edo_monitor.watch(
        model,
        opt,
        db=db,
        budget=PRESSURE_BUDGET,
        interval_s=0.02,
        run_name=name,
        **watch_kw,  # type: ignore[arg-type]
    ) as mon:
        for _ in range(steps):
            model(torch.randint(0, rows, (64,), generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return mon.run_id
