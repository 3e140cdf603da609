"""watch() entered on one thread, the model trained on another (real training loops, real
SQLite files): PyTorch keeps saved-tensor hooks per thread, and what the agent pushed on one
thread must come off that thread, and nothing of it act after the block."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.store.history import History


def test_training_on_another_thread_is_warned_once_and_leaves_no_hooks(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the recording armed when watch() began (on the main thread) was popped at
    the first step boundary on the training thread: torch's assertion failed there (an
    ``agent_error`` with its traceback), and the main thread kept the recording's hooks and,
    under them, the tracker's (its exit popped the recording's), so training the model after
    the block, with no watch open, failed with the run's CPU-budget out-of-memory error. Each
    hook now comes off the thread that pushed it; the other thread's activations are not
    measured, and a warning says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: int) -> None:
        model(torch.randn(batch, 64)).mean().backward()
        opt.step()
        opt.zero_grad()

    with (
        caplog.at_level(logging.WARNING, logger="edo_monitor"),
        edo_monitor.watch(model, db=db_path, budget="2MiB", enforce=True) as mon,
    ):
        worker = threading.Thread(target=lambda: [step(32) for _ in range(5)])
        worker.start()
        worker.join()
    assert mon.steps == 5 and mon.status == "finished"
    with History(db_path) as h:
        assert h.events(mon.run_id, kind="agent_error") == []
    warned = [r for r in caplog.records if "another thread than the one" in r.getMessage()]
    assert len(warned) == 1
    # after the block: 4 MiB of activations a step, over the run's 2 MiB budget, and no watch
    for _ in range(2):
        step(4096)
