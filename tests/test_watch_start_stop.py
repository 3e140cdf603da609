"""Monitor.start() / Monitor.stop(exc): the run's lifecycle without a ``with`` block (what the
framework callbacks use), on a real loop and a real SQLite file."""

from __future__ import annotations

import signal
import sqlite3
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor


def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randint(0, 100, (16,))).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def statuses(db: Path) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT status, error, steps FROM runs ORDER BY id").fetchall()
    finally:
        con.close()


def test_start_and_stop_record_a_finished_run_and_a_second_stop_is_a_no_op(db_path: Path) -> None:
    model, opt = model_and_opt()
    monitor = edo_monitor.watch(model, db=db_path, interval_s=0.05)
    monitor.stop()  # never started: nothing to end
    assert monitor.start() is monitor and monitor.status == "running"
    for _ in range(3):
        step(model, opt)
    monitor.stop()
    monitor.stop()  # a framework's second end hook
    assert statuses(db_path) == [("finished", None, 3)]
    with pytest.raises(RuntimeError, match="entered once"):
        monitor.start()


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ValueError("bad batch"), ("failed", "ValueError: bad batch", 1)),
        (KeyboardInterrupt(), ("interrupted", "KeyboardInterrupt", 1)),
    ],
)
def test_stop_with_an_exception_records_it(
    db_path: Path, exc: BaseException, expected: tuple
) -> None:
    model, opt = model_and_opt()
    monitor = edo_monitor.watch(model, db=db_path, interval_s=0.05).start()
    step(model, opt)
    monitor.stop(exc)  # recorded, not raised
    monitor.stop()  # already ended: the failure stays
    assert statuses(db_path) == [expected]
    assert monitor.summary().status == expected[0]


def test_a_start_that_fails_after_the_run_row_records_the_run_ended(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A Ctrl-C while the run starts (here: as the sampler thread starts, after the run's row
    was written) used to leave the row ``running`` with no error; the start now records how it
    ended, stops what it started and puts SIGTERM's default action back."""
    # the default action to begin with, whatever an earlier test in this process left (a run
    # handles SIGTERM only where nothing else does)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
    real_start = threading.Thread.start

    def ctrl_c_now(thread: threading.Thread) -> None:
        if thread.name == "edo-sampler":
            signal.raise_signal(signal.SIGINT)  # a real SIGINT: Python's handler raises
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", ctrl_c_now)
    model, opt = model_and_opt()
    monitor = edo_monitor.watch(model, db=db_path, interval_s=0.05)
    with pytest.raises(KeyboardInterrupt):
        monitor.start()
    monkeypatch.undo()
    assert statuses(db_path) == [("interrupted", "KeyboardInterrupt", 0)]
    assert monitor.status == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert not [t.name for t in threading.enumerate() if t.name.startswith("edo-")]
    monitor.stop()  # a framework's end hook after the failed start: a no-op
    assert statuses(db_path) == [("interrupted", "KeyboardInterrupt", 0)]
    step(model, opt)  # no hook of the failed run is left on the optimizer
    with edo_monitor.watch(model, db=db_path) as again:  # the model is free to watch again
        step(model, opt)
    assert again.steps == 1
