"""Issue 21 item 5: a conversion leaves nothing of the old weight in the optimizers.

For every converting action: after it, no param group or state key holds a parameter the model
no longer has, and no converted parameter keeps state of its old shape or dtype; a mutation that
leaves one (the old ``(N, D)`` weight kept in ``param_groups``, Adam's moments not converted) is
rolled back by the shared check, and the measured saving counts what the optimizer still holds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import edo_monitor.actions.base as base
import edo_monitor.actions.compress_embedding as compress_mod
import edo_monitor.actions.share_embedding as share_mod
import edo_monitor.nn.cached as cached_mod
from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder, Plan
from edo_monitor.actions.leftovers import optimizer_leftovers, record_params
from edo_monitor.measure.accounting import tensor_bytes
from edo_monitor.measure.frequency import LookupCounter

N, D = 800, 16

#: action name -> whether its table is frozen (int8 is for frozen tables)
CONVERTING = {
    "cache_embedding": False,
    "offload_embedding": False,
    "compress_embedding_bf16": False,
    "compress_embedding_lowrank": False,
    "compress_embedding_int8": True,
    "share_embedding": False,
}


class Model(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(N, D)
        self.emb.weight.requires_grad_(not frozen)
        self.head = nn.Linear(D, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(x)), x)


def _setup(name: str) -> tuple[Model, torch.optim.Optimizer, ActionContext]:
    torch.manual_seed(0)
    model = Model(frozen=CONVERTING[name])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # the frozen table is in its group too
    counter = LookupCounter()
    counter.watch_tables(model)
    gen = torch.Generator().manual_seed(0)
    with ActivationRecorder(model) as rec:
        for _ in range(2):
            model(torch.randint(0, N, (64,), generator=gen)).backward()
            opt.step()
            opt.zero_grad()
    model(torch.randint(0, N, (64,), generator=gen)).backward()  # gradients at the boundary
    ctx = ActionContext(
        model,
        [opt],
        activation_profile=rec.profile(),
        lookup_counter=counter,
        budget_bytes=10**9,
        in_use_bytes=10**9,
        rearm_free_fraction=0.25,
        grad_spent=lambda p: True,  # as after opt's step: the gradients spent, not carried
    )
    return model, opt, ctx


def _held(opt: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in opt.param_groups for p in g["params"]] + list(opt.state)


@pytest.mark.parametrize("name", list(CONVERTING))
def test_a_conversion_leaves_no_old_parameter_or_state_in_the_optimizer(name: str) -> None:
    model, opt, ctx = _setup(name)
    old = model.emb.weight
    before = record_params(model)
    plan = ACTIONS[name].plan(ctx)
    assert isinstance(plan, Plan), plan
    result = ACTIONS[name].apply(ctx, plan)
    assert result.status == "applied", result.reason
    in_model = {id(p) for p in model.parameters()}
    assert all(id(p) in in_model for p in _held(opt))
    if old not in set(model.parameters()):  # replaced: gone from every group and the state
        assert all(p is not old for p in _held(opt))
    assert optimizer_leftovers(before, model, [opt]) == []
    assert result.saved_bytes == result.estimated_saving_bytes > 0
    model(torch.arange(8)).backward()  # and it trains on
    opt.step()


def _keep_old_in_groups(real):  # the mutation: the old weight stays in param_groups
    def mutated(optimizers, old, new):
        changed = real(optimizers, old, new)
        for opt in optimizers:
            opt.param_groups[0]["params"] = [*opt.param_groups[0]["params"], old]
        return changed

    return mutated


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("compress_embedding_lowrank", compress_mod),
        ("compress_embedding_int8", compress_mod),
        ("share_embedding", share_mod),
    ],
)
def test_a_replaced_weight_left_in_a_param_group_is_rolled_back_and_saves_nothing(
    name: str, module: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt, ctx = _setup(name)
    old = model.emb.weight
    groups_before = [list(g["params"]) for g in opt.param_groups]
    monkeypatch.setattr(
        module,
        "replace_param_in_optimizers",
        _keep_old_in_groups(module.replace_param_in_optimizers),
    )
    result = ACTIONS[name].apply(ctx)
    assert result.status == "failed"
    assert "param group 0 still holds replaced parameter emb.weight (800, 16)" in result.reason
    assert type(model.emb) is nn.Embedding and model.emb.weight is old  # rolled back
    assert [list(g["params"]) for g in opt.param_groups] == groups_before
    # without the check, the measured saving counts the old weight the optimizer still holds
    monkeypatch.setattr(base, "optimizer_leftovers", lambda *a: [])
    model, opt, ctx = _setup(name)
    old = model.emb.weight
    result = ACTIONS[name].apply(ctx)
    assert result.status == "applied" and any(p is old for p in opt.param_groups[0]["params"])
    held = tensor_bytes(old) + (tensor_bytes(old.grad) if old.grad is not None else 0)
    assert result.estimated_saving_bytes - result.saved_bytes == held


def test_state_left_in_the_old_dtype_is_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, ctx = _setup("compress_embedding_bf16")
    weight = model.emb.weight
    monkeypatch.setattr(compress_mod, "convert_optimizer_state", lambda *a, **k: None)
    result = ACTIONS["compress_embedding_bf16"].apply(ctx)
    assert result.status == "failed"
    assert "state of emb.weight: 'exp_avg' is (800, 16) torch.float32" in result.reason
    assert weight.dtype == torch.float32 and opt.state[weight]["exp_avg"].dtype == torch.float32


def test_full_table_state_left_beside_a_row_cache_is_rolled_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, opt, ctx = _setup("cache_embedding")
    weight = model.emb.weight
    full = dict(opt.state[weight])
    real_attach = cached_mod.CachedTable.attach

    def attach_keeping_the_full_state(self, optimizer):  # mutation: (N, D) moments stay
        out = real_attach(self, optimizer)
        optimizer.state[self.weight].update(full)
        return out

    monkeypatch.setattr(cached_mod.CachedTable, "attach", attach_keeping_the_full_state)
    result = ACTIONS["cache_embedding"].apply(ctx)
    assert result.status == "failed"
    assert "state of emb.weight: 'exp_avg' is (800, 16)" in result.reason
    assert type(model.emb) is nn.Embedding and weight.shape == (N, D)
    assert opt.state[weight]["exp_avg"] is full["exp_avg"]
