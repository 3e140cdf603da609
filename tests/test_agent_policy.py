"""The policy inside watch(): modes, user hooks on the training thread, refusals as events."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.store.history import History

ROWS, DIM = 20_000, 32
TABLE_BYTES = ROWS * DIM * 4
# these tests pin offload's numbers; the default ladder tries cache_embedding first
# (tests/test_cache_action.py)
OFFLOAD_LADDER = ["release_cache", "offload_embedding", "checkpoint_activations"]


def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(ROWS, DIM), nn.Linear(DIM, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (64,), generator=gen)
        loss = model(ids).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# params + grads + Adam's two states of the table ~ 4 x 2.56 MB = 10.24 MB: a 12 MB budget
# leaves ~15 % free after the first step, below the 20 % floor.
BUDGET = 12_000_000


def test_auto_mode_offloads_and_hooks_run_on_the_training_thread(db_path: Path) -> None:
    model, opt = model_and_opt()
    seen: list[tuple[str, str]] = []
    main = threading.current_thread().name

    def on_pressure(crossing: object) -> None:
        seen.append(("pressure", threading.current_thread().name))

    def on_action(result: object) -> None:
        seen.append(("action", threading.current_thread().name))

    policy = edo_monitor.Policy(on_pressure=on_pressure, on_action=on_action, ladder=OFFLOAD_LADDER)
    with edo_monitor.watch(model, db=db_path, budget=BUDGET, policy=policy, interval_s=0.01) as mon:
        train(model, opt, 40)
    assert ("pressure", main) in seen and ("action", main) in seen
    (action,) = mon.summary().actions
    assert action["action"] == "offload_embedding" and action["target"] == "0"
    assert action["saved_bytes"] == 4 * TABLE_BYTES + 4, action
    assert mon.latest is not None and mon.latest.free_fraction > 0.2
    with History(db_path) as history:
        kinds = [e.kind for e in history.events("latest")]
    assert kinds[:3] == ["threshold_crossed", "decision", "action"]


def test_advise_mode_records_without_changing_the_model(db_path: Path) -> None:
    model, opt = model_and_opt()
    twin, twin_opt = model_and_opt()
    policy = edo_monitor.Policy(mode="advise", ladder=OFFLOAD_LADDER)
    with edo_monitor.watch(model, db=db_path, budget=BUDGET, policy=policy, interval_s=0.01) as mon:
        losses = train(model, opt, 30)
    assert losses == train(twin, twin_opt, 30)  # nothing applied: bit-identical training
    assert type(model[0]) is nn.Embedding
    summary = mon.summary()
    assert summary.events.get("decision", 0) >= 1 and "action" not in summary.events
    with History(db_path) as history:
        (decision,) = history.events("latest", kind="decision")[:1]
    assert decision.data["mode"] == "advise"
    assert decision.data["action"] == "offload_embedding"
    assert decision.data["estimated_saving_bytes"] == 4 * TABLE_BYTES + 4


def test_observe_mode_records_crossings_only(db_path: Path) -> None:
    model, opt = model_and_opt()
    policy = edo_monitor.Policy(mode="observe")
    with edo_monitor.watch(model, db=db_path, budget=BUDGET, policy=policy, interval_s=0.01) as mon:
        train(model, opt, 20)
    # crossings, and the table's lookup counts at the end; no decision, no action
    assert set(mon.summary().events) == {"threshold_crossed", "lookup_frequency"}


def test_nothing_to_do_is_recorded_once(db_path: Path) -> None:
    model = nn.Sequential(nn.Linear(400, 400), nn.Linear(400, 4))  # no table, nothing to save
    opt = torch.optim.Adam(model.parameters())
    with edo_monitor.watch(
        model, db=db_path, budget=2_600_000, policy=edo_monitor.Policy(), interval_s=0.01
    ) as mon:
        for _ in range(15):
            model(torch.randn(8, 400)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert mon.summary().events.get("no_action") == 1
    with History(db_path) as history:
        (event,) = history.events("latest", kind="no_action")
    reasons = {r["action"]: r["reason"] for r in event.data["refusals"]}
    assert "CPU-budget" in reasons["release_cache"]
    assert "no embedding table" in reasons["offload_embedding"]


def test_policy_must_be_a_policy() -> None:
    with pytest.raises(ValueError, match="policy="):
        edo_monitor.watch(nn.Linear(2, 2), policy="auto")


def test_enforce_fails_in_forward_before_the_optimizer_step(db_path: Path) -> None:
    """Regression: the budget error came from the optimizer's post-hook, after the weights had
    already been updated, and a caught error left no ``oom`` event."""
    model, opt = model_and_opt()
    train(model, opt, 1)  # Adam's state exists: 4 x the table, ~10.24 MB
    with edo_monitor.watch(model, opt, db=db_path, budget=BUDGET, enforce=True) as mon:
        train(model, opt, 2)  # small batches fit
        before = [p.detach().clone() for p in model.parameters()]
        big = torch.randint(0, ROWS, (20_000,))  # saves a 20,000 x 32 float activation: 2.56 MB
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError) as caught:
            model(big).pow(2).mean().backward()
            opt.step()
        opt.zero_grad()
        after = [p.detach().clone() for p in model.parameters()]
        train(model, opt, 1)  # training goes on after a caught error
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert "CPU-budget out of memory. Tried to allocate 2.44 MiB" in str(caught.value)
    assert mon.summary().events.get("oom") == 1
    assert mon.status == "finished"
    with History(db_path) as history:
        (oom,) = history.events("latest", kind="oom")
    assert oom.data["parsed"]["requested_bytes"] == round(2.44 * 1024**2)
    # "accounted" is what was in use before the failed request: it fits, the request does not
    parsed = oom.data["parsed"]
    mib = 1024**2
    assert parsed["allocated_bytes"] <= BUDGET + 0.005 * mib
    assert parsed["allocated_bytes"] + parsed["requested_bytes"] > BUDGET - 0.01 * mib
    assert parsed["free_bytes"] == pytest.approx(BUDGET - parsed["allocated_bytes"], abs=0.01 * mib)
    # the message prints two decimals of MiB, as PyTorch's does: 11.44 MiB
    assert oom.data["parsed"]["total_bytes"] == round(11.44 * 1024**2)
