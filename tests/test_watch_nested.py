"""Two models trained together, each in its own ``watch()`` block, one inside the other (a GAN's
generator and discriminator): each run counts its own model's activations, and each budget is
enforced on its own model's forward, whichever block is outside.

Found by trying the product: only the top pair of a thread's saved-tensor hooks is called, so the
inner block's tracker got every saved tensor: with the discriminator's block inside, its enforced
1 MB budget never fired (the generator's run was charged its 2 MiB of activations instead).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.store.history import History

MIB = 1024 * 1024


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    d = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 1))
    return g, d


def _train(g: nn.Module, d: nn.Module, steps: int, rows: int) -> None:
    og, od = torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters())
    for _ in range(steps):
        z = torch.randn(rows, 16)
        d(g(z).detach()).mean().backward()
        od.step()
        od.zero_grad()
        (-d(g(z)).mean()).backward()
        og.step()
        og.zero_grad()
        od.zero_grad()


@pytest.mark.parametrize("d_inside", [True, False])
def test_each_run_counts_its_own_models_activations(tmp_path: Path, d_inside: bool) -> None:
    """D's forward at 512 rows saves 2 MiB (its 1,024-wide hidden layer), G's 128 KiB: D's run
    holds the 2 MiB, G's does not, in either nesting."""
    g, d = _models()
    db = tmp_path / "h.db"
    outer, inner = (g, d) if d_inside else (d, g)
    with edo_monitor.watch(outer, db=db, run_name="outer") as mon_outer:  # noqa: SIM117
        with edo_monitor.watch(inner, db=db, run_name="inner") as mon_inner:
            _train(g, d, 6, 512)
    peak = {
        "d": (mon_inner if d_inside else mon_outer).summary().peak_activations_bytes,
        "g": (mon_outer if d_inside else mon_inner).summary().peak_activations_bytes,
    }
    assert peak["d"] >= 2 * MIB, peak
    assert peak["g"] < MIB / 2, peak


@pytest.mark.parametrize("d_inside", [True, False])
def test_the_budget_of_each_model_is_enforced_on_its_own_forward(
    tmp_path: Path, d_inside: bool
) -> None:
    """D under 1 MB with ``enforce=True``, G under 64 MB: the out-of-memory error comes from D's
    forward when its batch grows, and the ``oom`` event is in D's run."""
    g, d = _models()
    db = tmp_path / "h.db"
    budgets = {"g": "64MB", "d": "1MB"}
    names = ("g", "d") if d_inside else ("d", "g")
    models = {"g": g, "d": d}
    monitors = {}
    with contextlib.ExitStack() as stack, pytest.raises(torch.OutOfMemoryError):
        for name in names:
            monitors[name] = stack.enter_context(
                edo_monitor.watch(
                    models[name], db=db, budget=budgets[name], enforce=True, run_name=name
                )
            )
        _train(g, d, 3, 16)
        _train(g, d, 1, 512)
    with History(db) as history:
        for name, mon in monitors.items():
            ooms = history.events(mon.summary().run_id, kind="oom")
            assert len(ooms) == (1 if name == "d" else 0), (name, [e.message for e in ooms])
