"""The bytes a lossy table action saves: planned, recorded and measured after the next step agree,
with one count shared with ``edo_monitor.estimate``; a compression that saves nothing is refused
by the action and never decided by the policy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder
from edo_monitor.decide.estimate import estimate
from edo_monitor.decide.plans import Plan
from edo_monitor.measure.accounting import account

N, D = 4000, 64


def _model(n: int = N, d: int = D, frozen: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(n, d), nn.Flatten(), nn.Linear(4 * d, 1))
    model[0].weight.requires_grad_(not frozen)
    return model


def _ctx(model: nn.Module, opt: torch.optim.Optimizer) -> ActionContext:
    with torch.no_grad(), ActivationRecorder(model) as rec:
        model(torch.zeros(1, 4, dtype=torch.long))
    return ActionContext(model, [opt], activation_profile=rec.profile(), cuda_mode=False)


def _step(model: nn.Module, opt: torch.optim.Optimizer, n: int = N) -> None:
    x = torch.randint(0, n, (32, 4))
    opt.zero_grad(set_to_none=False)
    model(x).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize(
    ("optimizer", "expected_saving"),
    [
        # weight, gradient and Adam's two moments of 4000 × 64 float32 (+ a 4-byte step) less
        # those of the rank-32 factors 4000 × 32 and 32 × 64 (+ two steps): 4,096,004 - 2,080,776
        # (the factors' parameters alone made it 4,096,004 - 520,192 = 3,575,812)
        ("adam", 2_015_228),
        # SGD with momentum: weight, gradient, momentum_buffer; no step tensor
        ("sgd-momentum", 3 * 1_024_000 - 3 * 520_192),
    ],
)
def test_trainable_lowrank_saving_counts_the_factors_gradient_and_state(
    optimizer: str, expected_saving: int
) -> None:
    model = _model()
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    )
    _step(model, opt)
    _step(model, opt)
    ctx = _ctx(model, opt)
    before = account(model, [opt], cuda_mode=False).total_bytes
    action = ACTIONS["compress_embedding_lowrank"]
    plan = action.plan(ctx)
    assert isinstance(plan, Plan), plan
    rank = plan.details["rank"]
    assert rank == 32
    result = action.apply(ctx, plan)
    assert result.status == "applied", result.reason
    _step(model, opt)  # the factors get their gradient and optimizer state
    after_step = account(model, [opt], cuda_mode=False).total_bytes
    by_estimate = (
        estimate(N, D, optimizer=optimizer).total_with_step_bytes
        - estimate(N, D, optimizer=optimizer, compression=f"lowrank:{rank}").total_with_step_bytes
    )
    assert plan.estimated_saving_bytes == expected_saving
    assert result.saved_bytes == expected_saving
    assert before - after_step == expected_saving
    assert by_estimate == expected_saving
    _step(model, opt)  # steady from here on
    assert account(model, [opt], cuda_mode=False).total_bytes == after_step


def test_frozen_lowrank_and_bf16_savings_are_what_stays_saved() -> None:
    """No new gradient or state for a frozen low-rank table; bf16 converts them at once."""
    model = _model(frozen=True)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _step(model, opt)
    ctx = _ctx(model, opt)
    before = account(model, [opt], cuda_mode=False).total_bytes
    result = ACTIONS["compress_embedding_lowrank"].apply(ctx)
    assert result.status == "applied", result.reason
    _step(model, opt)
    saved = before - account(model, [opt], cuda_mode=False).total_bytes
    assert result.saved_bytes == result.estimated_saving_bytes == saved
    assert saved == N * D * 4 - (N * 32 + 32 * D) * 4  # the weight less the two factors

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, opt)
    ctx = _ctx(model, opt)
    before = account(model, [opt], cuda_mode=False).total_bytes
    result = ACTIONS["compress_embedding_bf16"].apply(ctx)
    assert result.status == "applied", result.reason
    _step(model, opt)
    saved = before - account(model, [opt], cuda_mode=False).total_bytes
    assert result.saved_bytes == result.estimated_saving_bytes == saved == 4 * N * D * 2
