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
