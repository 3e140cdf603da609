"""cache_embedding at a safe point where the table's gradient is not spent: the conversion takes
it to the table's step (it was dropped: the table ended 6.4 % off its twin), and a table no
``torch.optim`` optimizer steps is refused (a hand-written update stopped training it)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from test_cache_action import _batches, _ctx, _full, _pair
from torch import nn

import edo_monitor
from edo_monitor.actions import ACTIONS, Refusal
from edo_monitor.measure.accounting import account
from edo_monitor.nn import CachedTable


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    users, items, target = batch
    return ((model(users, items) - target) ** 2).mean()


def _convert(model: nn.Module, opt: torch.optim.Optimizer, grad_spent: object) -> None:
    in_use = account(model, [opt]).total_bytes
    ctx = _ctx(model, opt, budget_bytes=int(in_use / 1.5), rearm_free_fraction=0.25)
    ctx.grad_spent = grad_spent
    result = ACTIONS["cache_embedding"].apply(ctx, ACTIONS["cache_embedding"].plan(ctx))
    assert result.status == "applied", result.reason
    assert isinstance(model.items, CachedTable)


def test_a_gradient_waiting_for_its_step_is_the_steps() -> None:
    """Converted between the backward and the table's step (``Monitor.step()`` there, or
    another optimizer's step first; not known spent, or known not): the step takes the
    gradient, as the twin's does."""
    for grad_spent in (None, lambda p: False):
        model, opt, twin, twin_opt = _pair()
        batches = _batches(30)
        for i, batch in enumerate(batches):
            for m, o in ((model, opt), (twin, twin_opt)):
                o.zero_grad()
                _loss(m, batch).backward()
            if i == 10:
                _convert(model, opt, grad_spent)
            opt.step()
            twin_opt.step()
        assert torch.allclose(_full(model), _full(twin), rtol=0, atol=1e-12)


def test_a_table_no_optimizer_steps_is_not_cached() -> None:
    """A loop without ``torch.optim`` (``p -= lr * p.grad``): the cache steps its rows by the
    table's optimizer, so it would have stopped training the table (255 rows changed where
    the twin changed 6,362). Refused by name; a frozen table needs none."""
    model, opt, _, _ = _pair()
    ctx = _ctx(model, opt)
    ctx.optimizers = ()
    refusal = ACTIONS["cache_embedding"].plan(ctx)
    assert isinstance(refusal, Refusal)
    assert "items: no optimizer of the run steps it" in refusal.reason
    model.items.weight.requires_grad_(False)
    model.users.weight.requires_grad_(False)
    ctx = _ctx(model, opt)
    ctx.optimizers = ()
    assert not isinstance(ACTIONS["cache_embedding"].plan(ctx), Refusal)


def test_two_optimizers_the_tables_stepped_second_under_watch(db_path: Path) -> None:
    """``dense.step(); table_opt.step()``: the dense optimizer's step is the safe point, the
    table's gradient still waiting; the run goes on as its twin's."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
        model = _pair()[0]
        return (
            model,
            torch.optim.Adam([model.users.weight], lr=0.01),
            torch.optim.Adagrad([model.items.weight], lr=0.1),
        )

    def train(model: nn.Module, dense: torch.optim.Optimizer, table: torch.optim.Optimizer,
              batches: list, mon: object = None) -> None:  # fmt: skip
        for batch in batches:
            _loss(model, batch).backward()
            dense.step()
            table.step()
            dense.zero_grad()
            table.zero_grad()
            if mon is not None:
                time.sleep(0.002)

    twin = make()
    model, dense, table = make()
    budget = int(account(model, [dense, table]).total_bytes * 1.05)
    batches = _batches(120)
    with edo_monitor.watch(
        model, [dense, table], budget=budget, policy=edo_monitor.Policy(), db=db_path,
        interval_s=0.01,
    ) as mon:  # fmt: skip
        train(model, dense, table, batches, mon)
    train(*twin, batches)
    assert "cache_embedding" in [a["action"] for a in mon.summary().actions]
    assert torch.allclose(_full(model), _full(twin[0]), rtol=0, atol=1e-12)


def test_mon_step_between_the_backward_and_the_step_under_watch(db_path: Path) -> None:
    """``backward(); mon.step(); opt.step()``: the conversion at ``mon.step()`` keeps the
    waiting gradient (it was dropped: the batch's rows missed that step), while a conversion
    after ``opt.step(); mon.step()`` finds it spent (measured saving = estimate)."""
    for between in (True, False):
        model, opt, twin, twin_opt = _pair()
        budget = int(account(model, [opt]).total_bytes * 1.05)
        batches = _batches(400)
        with edo_monitor.watch(
            model, opt, budget=budget, policy=edo_monitor.Policy(), db=db_path, interval_s=0.01
        ) as mon:
            for batch in batches:
                for m, o in ((model, opt), (twin, twin_opt)):
                    o.zero_grad()
                    _loss(m, batch).backward()
                if between:
                    mon.step()
                opt.step()
                twin_opt.step()
                if not between:
                    mon.step()
                if isinstance(model.items, CachedTable):
                    break
                time.sleep(0.002)
        assert isinstance(model.items, CachedTable), between
        (action,) = [a for a in mon.summary().actions if a["action"] == "cache_embedding"]
        if not between:
            assert action["saved_bytes"] == action["estimated_saving_bytes"], action
        assert torch.allclose(_full(model), _full(twin), rtol=0, atol=1e-12)
