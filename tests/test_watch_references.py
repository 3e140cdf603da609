"""What a monitor holds of the user's objects: nothing of the model once its run has ended, and
no reference cycle that keeps an optimizer or the model until the garbage collector runs (a
monitor kept for its summary held the model and its memory after ``del model``). Real training
loops, real SQLite files; the collector is off inside each test, so only references count."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from watch_helpers import make_model, run_row, train

import edo_monitor


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The garbage collector off: an object is freed by its last reference or not at all."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])  # torch's first optimizer: lazy imports
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("budget", [None, 400_000])
def test_the_model_is_freed_when_dropped_while_the_monitor_is_kept(
    db_path: Path, budget: int | None, no_collector: None
) -> None:
    """Regression: after the block the monitor still held the model (its own attribute, the
    module rows', the activation tracker's window) and an ended activation recording held it
    in a reference cycle: ``del model`` freed nothing while ``mon`` lived. Freed now, with and
    without a CPU budget (which arms the recording and the tracker); the summary and the
    breakdown read as before."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with edo_monitor.watch(model, db=db_path, budget=budget, interval_s=0.01) as mon:
        train(model, opt, 12, sleep_s=0.005)
    breakdown = mon.breakdown()
    gone = weakref.ref(model)
    del model, opt
    assert gone() is None
    assert mon.summary().steps == int(run_row(db_path)["steps"]) == 12
    assert mon.breakdown() == breakdown
    assert {row["kind"] for row in breakdown} >= {"Embedding", "Linear"}


def test_a_dropped_optimizer_is_freed_inside_the_block(db_path: Path, no_collector: None) -> None:
    """Regression: each accounting of a step boundary made a class inside ``account()``, whose
    methods' closures held the run's optimizers: a reference cycle, so an optimizer the user
    dropped lived (with its state) until the garbage collector ran, and the new phase's
    optimizer was counted from its second step (19 steps of 20). Freed by the drop now; its
    successor counts every step."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        train(model, opt, 10)
        old = weakref.ref(opt)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert old() is None
        train(model, opt, 10, sleep_s=0.01)
    assert mon.steps == int(run_row(db_path)["steps"]) == 20
