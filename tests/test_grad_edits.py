"""A training loop that changes a table's gradient itself (``clip_grad_norm_(model.emb.weight)``,
``model.emb.weight.grad.mul_(0.5)``) keeps the actions after which ``weight`` has no gradient off
that table: the row cache (its gradient is ``batch_rows.grad``) and a trainable low-rank table.

Found by trying the product: under ``watch(budget=...)`` the agent cached such a table, and the
loop's ``weight.grad.mul_`` failed on ``None`` two steps later (the run failed), or its clipping
silently stopped (the table drifted 4.5e-3 from its twin). The activation recorder notes each
parameter's gradient as the backward leaves it and, at the optimizer's step, which were changed
since; a table's counts when some other parameter's gradient was not (an operation over every
parameter, ``clip_grad_norm_(model.parameters())`` or a ``GradScaler``'s unscaling, changes a
cached table's ``batch_rows.grad`` as well, and is no reason).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import edo_monitor
from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder, Plan, Refusal
from edo_monitor.store.history import History

N, D = 600, 16
STEPS = 100  # of the watched loop: a crossing of the floor, then the action's steps


class Model(nn.Module):
    def __init__(self, n: int = N) -> None:
        super().__init__()
        self.emb = nn.Embedding(n, D)
        self.head = nn.Linear(D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1)).squeeze(-1)


def _clip_table(m: Model, opt: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(m.emb.weight, 0.05)


def _scale_table(m: Model, opt: torch.optim.Optimizer) -> None:
    m.emb.weight.grad.mul_(0.5)


def _replace_table_grad(m: Model, opt: torch.optim.Optimizer) -> None:
    m.emb.weight.grad = m.emb.weight.grad * 0.5


def _clip_all(m: Model, opt: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)


def _clip_all_foreach(m: Model, opt: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.05, foreach=True)


def _clip_head(m: Model, opt: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(m.head.parameters(), 0.05)


def _unscale(m: Model, opt: torch.optim.Optimizer) -> None:
    """As a ``GradScaler``'s ``unscale_(opt)``: every gradient of the optimizer, in place."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad.mul_(1 / 1024)


def _read_only(m: Model, opt: torch.optim.Optimizer) -> None:
    assert float(m.emb.weight.grad.norm()) >= 0.0


#: what the loop does between backward and step -> whether the table's gradient counts as edited
EDITS: dict[str, tuple[Callable[[Model, torch.optim.Optimizer], None], bool]] = {
    "nothing": (lambda m, opt: None, False),
    "clip_table": (_clip_table, True),
    "scale_table": (_scale_table, True),
    "replace_table_grad": (_replace_table_grad, True),
    "clip_all": (_clip_all, False),
    "clip_all_foreach": (_clip_all_foreach, False),
    "clip_head": (_clip_head, False),
    "unscale_all": (_unscale, False),
    "read_only": (_read_only, False),
}


def _batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, n, (64, 4), generator=gen), torch.randn(64, generator=gen)


def _step(
    model: Model, opt: torch.optim.Optimizer, edit: Callable, gen: torch.Generator, micro: int = 1
) -> None:
    """One step over ``micro`` batches (gradient accumulation), ``edit`` before the update."""
    for _ in range(micro):
        ids, y = _batch(model.emb.num_embeddings, gen)
        F.mse_loss(model(ids), y).backward()
    edit(model, opt)
    opt.step()
    opt.zero_grad()


def _recorded_profile(model: Model, opt: torch.optim.Optimizer, edit: Callable, accumulate: int):
    with ActivationRecorder(model) as rec:
        _step(model, opt, edit, torch.Generator().manual_seed(0), accumulate)
    assert not rec.errors
    return rec.profile()


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("how", list(EDITS))
def test_the_recorder_names_a_table_whose_gradient_the_loop_changes_alone(
    how: str, accumulate: int
) -> None:
    edit, edited = EDITS[how]
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    profile = _recorded_profile(model, opt, edit, accumulate)
    assert profile.grad_edits == (frozenset({"emb"}) if edited else frozenset())


@pytest.mark.parametrize("how", ["clip_table", "scale_table", "clip_all"])
def test_the_row_cache_refuses_a_table_whose_gradient_the_loop_changes_alone(how: str) -> None:
    edit, edited = EDITS[how]
    torch.manual_seed(0)
    model = Model(5000)  # larger than the peak ids a cache keeps at least (1,024 untold)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    profile = _recorded_profile(model, opt, edit, 1)
    ctx = ActionContext(model, [opt], activation_profile=profile, fail_at=None)
    plan = ACTIONS["cache_embedding"].plan(ctx)
    if edited:
        assert isinstance(plan, Refusal)
        assert "the training loop changes emb.weight.grad itself" in plan.reason
        assert isinstance(ACTIONS["offload_embedding"].plan(ctx), Plan)  # its weight has one
    else:
        assert isinstance(plan, Plan) and plan.target == "emb"


def _train(model: Model, opt: torch.optim.Optimizer, edit: Callable, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        _step(model, opt, edit, gen)


@pytest.mark.parametrize("how", ["clip_table", "scale_table"])
def test_a_watched_loop_changing_its_tables_gradient_trains_as_its_twin(
    tmp_path: Path, how: str
) -> None:
    """The found case: under pressure the agent takes another action on the table (offload), the
    loop runs to the end, and the table is its twin's exactly."""
    edit, _ = EDITS[how]
    torch.manual_seed(0)
    model = Model(60_000).double()  # 60,000 x 16 float64, its gradient and Adam: 29 MiB
    twin = copy.deepcopy(model)
    _train(twin, torch.optim.Adam(twin.parameters(), lr=0.01), edit, STEPS)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    db = tmp_path / "h.db"
    with edo_monitor.watch(
        model, opt, db=db, budget="34MiB", policy=edo_monitor.Policy(), interval_s=0.02
    ) as mon:
        _train(model, opt, edit, STEPS)
    assert mon.summary().status == "finished"
    with History(db) as history:
        applied = [e.message for e in history.events("latest", kind="action")]
    assert applied and not any("cache_embedding" in m for m in applied), applied
    assert any("offload_embedding on emb" in m for m in applied), applied
    assert torch.equal(model.emb.weight.detach(), twin.emb.weight.detach())
