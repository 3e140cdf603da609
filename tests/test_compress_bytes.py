"""The bytes a lossy table action saves: planned, recorded and measured after the next step agree,
with one count shared with ``edo_monitor.estimate``; a compression that saves nothing is refused
by the action and never decided by the policy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder
from edo_monitor.actions.compress_embedding import CompressEmbedding
from edo_monitor.decide.estimate import estimate
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.decide.policy import Policy
from edo_monitor.decide.policy_events import Decision, NoActionAvailable
from edo_monitor.decide.ranking import make_planner
from edo_monitor.measure.accounting import account
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.probes.readings import Reading

N, D = 4000, 64


def _model(n: int = N, d: int = D, frozen: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(n, d), nn.Flatten(), nn.Linear(4 * d, 1))
    model[0].weight.requires_grad_(not frozen)
    return model


def _ctx(model: nn.Module, opt: torch.optim.Optimizer) -> ActionContext:
    with torch.no_grad(), ActivationRecorder(model) as rec:
        ids_per_sample = model[2].in_features // model[0].embedding_dim
        model(torch.zeros(1, ids_per_sample, dtype=torch.long))
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


def _frozen_column(n: int = 100_000) -> nn.Sequential:
    """A frozen 1-column table (a recommender's pretrained bias): int8 adds a 4-byte scale to
    each 4-byte row, int4 a 4-byte scale and zero-point a group."""
    model = nn.Sequential(nn.Embedding(n, 1), nn.Flatten(), nn.Linear(1, 1))
    model[0].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("variant", "after_bytes"),
    [
        ("int8", 100_000 * (1 + 4)),  # int8 value + float32 scale a row
        ("int4", 100_000 * (4 + 4)),  # 8 codes (one group of 8 columns) + scale + zero-point
        ("int2", 100_000 * (2 + 4)),
        ("2of8", 100_000 * (1 + 1 + 4)),
    ],
)
def test_a_compression_that_is_not_smaller_is_refused_naming_the_bytes(
    variant: str, after_bytes: int
) -> None:
    model = _frozen_column()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    plan = ACTIONS[f"compress_embedding_{variant}"].plan(_ctx(model, opt))
    assert isinstance(plan, Refusal), plan
    assert plan.reason == (
        f"0: {variant} would not be smaller: {after_bytes:,} bytes after the next step against "
        f"400,000 now (saves {400_000 - after_bytes:,})"
    )


def test_perrow_with_every_row_cold_is_refused() -> None:
    """Early in a run almost every row is counted fewer than ``cold_below`` times: every row
    keeps float32 and the int4 part is added to it."""
    model = _model(2000, 32, frozen=True)
    counter = LookupCounter()
    counter.watch("0", model[0])
    with torch.no_grad():
        for _ in range(5):
            model(torch.randint(0, 2000, (16, 4)))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    ctx = _ctx(model, opt)
    ctx = ActionContext(
        model,
        [opt],
        activation_profile=ctx.activation_profile,
        cuda_mode=False,
        lookup_counter=counter,
    )
    plan = CompressEmbedding("perrow", per_row="cold").plan(ctx)
    assert isinstance(plan, Refusal), plan
    # 2000 float32 rows and their int64 ids (no int4 rows: none is hot) against the table
    assert "perrow would not be smaller: 272,000 bytes after the next step against 256,000" in (
        plan.reason
    )
    assert isinstance(CompressEmbedding("perrow", per_row="hot").plan(ctx), Plan)


def _pressure(step: int) -> Reading:
    return Reading.of(
        float(step), step, "cpu-budget", in_use_bytes=900, budget_bytes=1000, free_fraction=0.1
    )


def test_the_policy_never_decides_a_plan_that_saves_nothing() -> None:
    """Whatever the action: a lossless rung saving 0 bytes is passed over for the next one; a
    lossy plan saving less than nothing is never decided, even as the only one."""
    plans = {
        "cache_embedding": Plan("cache_embedding", "emb", 0, "frees nothing"),
        "offload_embedding": Plan("offload_embedding", "emb", 4096, "moves the table"),
    }
    policy = Policy(ladder=["cache_embedding", "offload_embedding"])
    decision = policy.evaluate(_pressure(1), plans)[-1]
    assert isinstance(decision, Decision) and decision.action == "offload_embedding"

    lossy = {
        "compress_embedding_int8": Plan(
            "compress_embedding_int8", "emb", -100_000, "grows", expected_error=1e-6
        )
    }
    policy = Policy(allow_lossy=True, ladder=["compress_embedding_int8"])
    events = policy.evaluate(_pressure(1), lossy)
    assert not [e for e in events if isinstance(e, Decision)]
    (none,) = [e for e in events if isinstance(e, NoActionAvailable)]
    assert none.refusals[0].reason == "saves nothing: estimated saving -100,000 bytes (0 bytes)"


def test_the_policy_with_the_real_actions_decides_nothing_on_a_frozen_column() -> None:
    model = _frozen_column()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    ladder = ["compress_embedding_int8", "compress_embedding_int4", "compress_embedding"]
    policy = Policy(allow_lossy=True, ladder=ladder)
    events = policy.evaluate(_pressure(1), make_planner(_ctx(model, opt)))
    assert not [e for e in events if isinstance(e, Decision)]
    (none,) = [e for e in events if isinstance(e, NoActionAvailable)]
    assert all("would not be smaller" in r.reason for r in none.refusals), none.refusals
