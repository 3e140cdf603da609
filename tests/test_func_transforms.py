"""``torch.func``'s transforms inside ``watch()``: per-sample gradients (``vmap(grad(...))``, as
in DP-SGD), ``jacrev`` and ``vjp`` train as without the agent.

Found by trying the product: ``torch.func`` refuses to run while saved-tensor hooks are set, and
the agent keeps its activation tracker's (and a recorded step's) set for the whole block, so
the user's step failed inside ``watch()`` with torch's "don't yet support saved tensor hooks"
(``track_activations=False`` was the only way out). The agent's hooks are now taken off while a
transform runs and put back after.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.autograd.graph as autograd_graph
from torch import nn

import edo_monitor

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _per_sample_step(model: nn.Module, opt: torch.optim.Optimizer, how: str, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return (torch.func.functional_call(model, p, (xi[None],)) - yi).pow(2).sum()

    if how == "grad":
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    elif how == "jacrev":
        grads = torch.func.vmap(torch.func.jacrev(loss), in_dims=(None, 0, 0))(params, x, y)
    else:  # vjp of the whole batch's loss: one gradient, as a batch of one
        _, pull = torch.func.vjp(lambda p: sum(loss(p, x[i], y[i]) for i in range(16)), params)
        grads = {n: g[None] for n, g in pull(torch.tensor(1.0))[0].items()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clamp(-1, 1).mean(0)  # clipped per sample, then averaged
    opt.step()
    opt.zero_grad()


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    gen = torch.Generator().manual_seed(100 + k)
    model(torch.randn(64, 8, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _train(model: nn.Module, how: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(STEPS):
        _per_sample_step(model, opt, how, k)
        _plain_step(model, opt, k)


@pytest.mark.parametrize("how", ["grad", "jacrev", "vjp"])
def test_torch_func_transforms_train_inside_watch_as_outside(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    twin = _model()
    _train(twin, how)
    model = _model()
    with (
        caplog.at_level(logging.WARNING, logger="edo_monitor"),
        edo_monitor.watch(model, db=tmp_path / "h.db", budget="64MiB") as mon,
    ):
        _train(model, how)
    assert mon.summary().status == "finished"
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
    # the plain steps' activations are still measured (the hooks were put back)
    assert mon.summary().peak_activations_bytes > 0
    assert autograd_graph.disable_saved_tensors_hooks.__name__ == "disable_saved_tensors_hooks"


def test_a_users_own_hook_still_keeps_torch_func_off_and_the_agents_stay(tmp_path: Path) -> None:
    """Only the agent's hooks are taken off: with a hook of the user's on top, ``torch.func``
    refuses as it does without the agent, and the agent's hooks are in place after."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=tmp_path / "h.db") as mon:
        with (
            torch.autograd.graph.save_on_cpu(),
            pytest.raises(RuntimeError, match="saved tensor hooks"),
        ):
            _per_sample_step(model, opt, "grad", 0)
        _plain_step(model, opt, 0)
        _per_sample_step(model, opt, "grad", 1)
        _plain_step(model, opt, 1)
    assert mon.summary().status == "finished"
    assert mon.summary().peak_activations_bytes > 0
