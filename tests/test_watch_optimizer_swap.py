"""The optimizer whose steps are counted, when training changes optimizers: a second phase's new
optimizer (the old one kept or dropped), two optimizers of one model stepping together. Real
training loops, real SQLite files."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch import nn
from watch_helpers import make_model, run_row, train

import edo_monitor


def _adam_state_bytes(model: nn.Module) -> int:
    """Adam's exp_avg and exp_avg_sq of every parameter, and its float32 step per parameter."""
    params = list(model.parameters())
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def test_a_second_phase_with_a_new_optimizer_is_counted_and_read(db_path: Path) -> None:
    """Regression: only the first optimizer found ran the step boundary. A new optimizer for a
    second phase (SGD, then Adam; the SGD still referenced) left the count at the first
    phase's 5 steps, every later event stamped step 5, the readings without Adam's state (no
    boundary accounted it) and no decision applied. The new one takes over at its second
    step: its first could have been one of a pair with the first's (two optimizers stepping
    together), so it is not counted."""
    model = make_model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        train(model, first, 5)
        second = torch.optim.Adam(model.parameters(), lr=0.01)
        train(model, second, 15, sleep_s=0.02)  # readings between boundaries: they account
    assert mon.steps == int(run_row(db_path)["steps"]) == 5 + 15 - 1
    assert mon.accounting.optimizer_state_bytes == _adam_state_bytes(model)


def test_a_dropped_optimizer_is_freed_and_the_next_one_counts_every_step(db_path: Path) -> None:
    """Regression: the monitor held every optimizer it found: a dropped one stayed alive, with
    its state, until the block ended. Held weakly now; its successor counts from its first
    step."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        train(model, opt, 5)
        old = weakref.ref(opt)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert old() is None
        train(model, opt, 7, sleep_s=0.02)
    assert mon.steps == 12
    assert mon.accounting.optimizer_state_bytes == 0  # SGD without momentum: no state


def test_two_optimizers_stepping_together_count_each_iteration_once(db_path: Path) -> None:
    """A generator's and a discriminator's optimizers, each over its own part, both stepping
    every iteration: one step an iteration (neither takes the other over)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"g": nn.Linear(8, 8), "d": nn.Linear(8, 1)})
    opt_g = torch.optim.Adam(model["g"].parameters(), lr=0.01)
    opt_d = torch.optim.SGD(model["d"].parameters(), lr=0.01)
    with edo_monitor.watch(model, db=db_path) as mon:
        for _ in range(9):
            for opt in (opt_d, opt_g):
                model["d"](model["g"](torch.randn(4, 8))).sum().backward()
                opt.step()
                opt.zero_grad()
    assert mon.steps == 9
