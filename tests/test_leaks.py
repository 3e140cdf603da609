"""Issue 14 item 2 (part): ``leak_suspected`` for saved tensors kept alive across steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.decide.leaks import GrowthDetector, LeakSuspicion
from edo_monitor.errors import ConfigError
from edo_monitor.store.history import History


def test_steady_growth_is_reported_once_and_a_fall_is_not_growth() -> None:
    det = GrowthDetector(4)
    got = [det.add(s, "a", 100 * s) for s in range(1, 8)]
    # steps 1..5 fill the window (5 values, 4 rises of 100): reported at step 5, then never again
    assert got[:4] == [None] * 4
    assert got[4] == LeakSuspicion("a", 100.0, 1, 5, 500)
    assert got[5:] == [None, None]
    det = GrowthDetector(4)
    assert [det.add(s, "b", v) for s, v in enumerate([0, 10, 20, 15, 30, 40], 1)] == [None] * 6
    # one flat step of four: 3/4 rising, average growth (40 - 0) / 4 = 10
    det = GrowthDetector(4, min_rising_fraction=0.75)
    results = [det.add(s, "c", v) for s, v in enumerate([0, 10, 10, 30, 40], 1)]
    assert results[-1] == LeakSuspicion("c", 10.0, 1, 5, 40)
    with pytest.raises(ConfigError, match="window_steps=1"):
        GrowthDetector(1)


def run_loop(db_path: Path, keep_graphs: bool) -> edo_monitor.Monitor:
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    kept: list[torch.Tensor] = []
    with edo_monitor.watch(model, opt, db=db_path, interval_s=0.05) as mon:
        for _ in range(25):
            loss = model(torch.randn(8, 100, generator=gen)).pow(2).mean()
            loss.backward(retain_graph=keep_graphs)
            if keep_graphs:
                kept.append(loss)  # the loss with its graph: its saved tensors stay alive
            opt.step()
            opt.zero_grad()
    return mon


def test_losses_kept_with_their_graphs_are_a_suspected_leak(db_path: Path) -> None:
    mon = run_loop(db_path, keep_graphs=True)
    assert mon.summary().events["leak_suspected"] == 1
    with History(db_path) as history:
        (event,) = history.events("latest", kind="leak_suspected")
    # each step keeps Linear's input [8, 100] floats (3,200 bytes) and pow's input [8, 100]
    # (the Linear's output, 3,200 bytes): 6,400 bytes per step; reported at step 21 (window 20)
    assert event.data == {
        "category": "activations",
        "growth_bytes_per_step": 6400.0,
        "first_step": 1,
        "last_step": 21,
        "bytes_now": 21 * 6400,
    }


def test_a_clean_loop_is_not_a_suspected_leak(db_path: Path) -> None:
    mon = run_loop(db_path, keep_graphs=False)
    assert "leak_suspected" not in mon.summary().events
