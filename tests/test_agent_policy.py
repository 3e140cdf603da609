"""The policy inside watch(): modes, user hooks on the training thread, refusals as events."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.hindsight.replay import replay
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
    # left on the device tier at the last reading: the Linear(32, 4): weight and bias, their
    # gradients, Adam's two states and two step scalars; plus the last step's saved tensors at
    # their peak (a reading counts at least the last finished step's peak): the 64 int64 ids the
    # embedding saves, the Linear's 64 x 32 float input, and the 64 x 4 output pow(2) saves
    linear = (DIM * 4 + 4) * 4
    saved = 64 * 8 + 64 * DIM * 4 + 64 * 4 * 4
    in_use = linear + linear + 2 * linear + 2 * 4 + saved
    assert mon.latest is not None and mon.latest.in_use_bytes == in_use == 2_120 + 9_728
    assert mon.latest.free_fraction == pytest.approx((BUDGET - in_use) / BUDGET)
    with History(db_path) as history:
        kinds = [e.kind for e in history.events("latest")]
    # a crossing may be recorded between a decision and its action (the sampler keeps reading
    # while the decision waits for the step boundary)
    acting = [k for k in kinds if k != "threshold_crossed"]
    assert kinds[0] == "threshold_crossed" and acting[:2] == ["decision", "action"]


def test_a_crossing_is_recorded_at_the_time_of_the_reading_that_crossed(db_path: Path) -> None:
    """It was recorded when the policy had planned on it, later: an action the training thread
    applied meanwhile wrote its module rows before the crossing's time, and explain read the
    tables at the crossing as changed (a flaky 'shrink the row cache from 19,231' for 17,129)."""
    model, opt = model_and_opt()
    policy = edo_monitor.Policy(ladder=OFFLOAD_LADDER)
    with edo_monitor.watch(model, db=db_path, budget=BUDGET, policy=policy, interval_s=0.01):
        train(model, opt, 10)
    with History(db_path) as history:
        crossings = history.events("latest", kind="threshold_crossed")
        run_id = history.run("latest").id
    assert crossings
    with sqlite3.connect(db_path) as conn:
        for crossing in crossings:
            (free,) = conn.execute(
                "SELECT free_fraction FROM samples WHERE run_id = ? AND time_s = ?",
                (run_id, crossing.time_s),
            ).fetchone()
            assert free == crossing.data["free_fraction"]


def test_a_decision_the_run_ends_before_applying_is_recorded_as_expired(db_path: Path) -> None:
    """No reading comes during the loop (interval 1 h): the run's last reading, after its last
    step, is the first under the floor; its decision has no step boundary left to be applied at
    and is recorded as expired (it was left pending, with no outcome)."""
    model, opt = model_and_opt()
    train(model, opt, 1)  # Adam's state exists before the block
    policy = edo_monitor.Policy(ladder=OFFLOAD_LADDER)
    with edo_monitor.watch(model, db=db_path, budget=BUDGET, policy=policy, interval_s=3600) as mon:
        train(model, opt, 2)
    assert type(model[0]) is nn.Embedding  # nothing applied
    assert policy.pending is None
    summary = mon.summary()
    assert summary.events["decision"] == summary.events["decision_expired"] == 1
    assert "action" not in summary.events and summary.actions == ()
    with History(db_path) as history:
        (decision,) = history.events("latest", kind="decision")
        (expired,) = history.events("latest", kind="decision_expired")
    assert expired.id > decision.id
    assert (expired.data["action"], expired.data["target"]) == ("offload_embedding", "0")
    assert expired.data["decided_at_step"] == decision.step == 2
    assert expired.data["estimated_saving_bytes"] == decision.data["estimated_saving_bytes"]
    # the decision's step is its reading's; the run's last boundary is named beside it (a
    # decision read "step 6 ... the run ended before the next step boundary" in a run of 60)
    assert expired.message == (
        "offload_embedding on 0 not applied: decided from the reading of step 2 after the run's "
        "last step boundary (step 2): the run ended before it could be applied"
    )
    (recorded,) = replay(db_path, "latest").recorded
    assert recorded.status == "expired"


def test_advise_mode_records_without_changing_the_model(db_path: Path) -> None:
    model, opt = model_and_opt()
    twin, twin_opt = model_and_opt()
    policy = edo_monitor.Policy(mode="advise", ladder=OFFLOAD_LADDER)
    with edo_monitor.watch(model, db=db_path, budget=BUDGET, policy=policy, interval_s=0.01) as mon:
        losses = train(model, opt, 30)
    assert losses == train(twin, twin_opt, 30)  # nothing applied: bit-identical training
    assert type(model[0]) is nn.Embedding
    summary = mon.summary()
    # one episode under the floor (nothing applied, it never ends): offload advised once, then
    # nothing else on the lossless ladder applies (no block saves activations of its own); at the
    # end, the lookup counts and the sampled singular spectrum of the one table
    assert summary.events == {
        "threshold_crossed": 1,
        "decision": 1,
        "no_action": 1,
        "lookup_frequency": 1,
        "table_spectrum": 1,
    }
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
    # crossings, and the table's lookup counts and spectrum at the end; no decision, no action
    assert set(mon.summary().events) == {"threshold_crossed", "lookup_frequency", "table_spectrum"}


def test_nothing_to_do_is_recorded_once(db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(400, 400), nn.Linear(400, 4))  # no table, nothing to save
    opt = torch.optim.Adam(model.parameters())
    with (
        caplog.at_level("WARNING"),
        edo_monitor.watch(
            model, db=db_path, budget=2_600_000, policy=edo_monitor.Policy(), interval_s=0.01
        ) as mon,
    ):
        for _ in range(15):
            model(torch.randn(8, 400)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert mon.summary().events.get("no_action") == 1
    # said where the user looks, once (a new user saw a policy that did nothing, silently)
    (said,) = [r.getMessage() for r in caplog.records if "no action on the ladder" in r.message]
    assert "under pressure, but no action on the ladder applies: release_cache (" in said
    with History(db_path) as history:
        (event,) = history.events("latest", kind="no_action")
    reasons = {r["action"]: r["reason"] for r in event.data["refusals"]}
    assert "CPU-budget" in reasons["release_cache"]
    assert "no embedding table" in reasons["offload_embedding"]
    # the reasons in the message too: the events table and the dashboard show only it
    assert event.message.startswith("under pressure, but no action on the ladder applies: ")
    assert f"offload_embedding ({reasons['offload_embedding']})" in event.message


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


# ---------------------------------------------------- the rest of the ladder, inside watch()

HIDDEN = 256


class Block(nn.Module):
    """``x + fc2(relu(fc1(x)))``: saves its ReLU output (batch x HIDDEN floats) for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class TableAndBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids)))


@pytest.mark.slow
def test_default_ladder_checkpoints_then_compresses_inside_watch(db_path: Path) -> None:
    """The default ladder with ``allow_lossy=True``, as watch() runs it: the table cannot be
    offloaded (its optimizer is fused: it needs device tensors), so under pressure the agent
    checkpoints the blocks, and, still under the floor after the cooldown, compresses the table to
    bf16. Weights + gradients + Adam state (10.78 MB) and the first steps' batches of 64 (0.16 MB
    of activations) leave 20.8 % of a 13.8 MB budget free; batches of 1024 (2.51 MB) leave 3.7 %,
    and 18.9 % once the blocks are checkpointed (0.42 MB)."""
    torch.manual_seed(0)
    model = TableAndBlocks()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    policy = edo_monitor.Policy(allow_lossy=True, cooldown_steps=2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    with edo_monitor.watch(
        model,
        db=db_path,
        budget=13_800_000,
        policy=policy,
        interval_s=0.01,
        profile_interval_s=1e-6,
    ) as mon:
        for step in range(200):
            ids = torch.randint(0, ROWS, (64 if step < 5 else 1024,), generator=gen)
            loss = model(ids).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if len(mon.summary().actions) == 2:
                break
        for _ in range(3):  # training goes on with both changes
            model(torch.randint(0, ROWS, (1024,), generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    checkpoint, compress = mon.summary().actions
    assert (checkpoint["action"], checkpoint["target"]) == (
        "checkpoint_activations",
        "blocks.0,blocks.1",
    )
    # the ReLU output of both blocks, from the last recorded profile (a batch of 1024, or of 64
    # when the sampler saw the pressure before the first big step's profile was taken)
    assert checkpoint["saved_bytes"] == checkpoint["estimated_saving_bytes"]
    assert checkpoint["saved_bytes"] in (2 * 1024 * HIDDEN * 4, 2 * 64 * HIDDEN * 4)
    assert (compress["action"], compress["target"]) == ("compress_embedding", "emb")
    assert compress["details"]["variant"] == "bf16" and compress["lossy"] is True
    # weight, gradient, exp_avg and exp_avg_sq of the table, each from 4 to 2 bytes an element
    assert compress["saved_bytes"] == compress["estimated_saving_bytes"] == 4 * ROWS * DIM * 2
    assert compress["error"]["mean_row_cosine"] > 0.999
    assert all("forward" in block.__dict__ for block in model.blocks)  # checkpointed
    assert model.emb.weight.dtype == torch.bfloat16
    assert mon.status == "finished" and all(x == x for x in losses)  # no NaN
    with History(db_path) as history:
        kinds = [e.kind for e in history.events("latest")]
    assert kinds[0] == "threshold_crossed"
    assert [k for k in kinds if k in ("decision", "action")] == ["decision", "action"] * 2


def test_an_action_event_is_stamped_when_the_action_began(db_path: Path) -> None:
    """A reading taken while an action is being measured can record the crossing back above the
    re-arm level before the action's result is: the action's event carries the time it began, so
    the timeline (ordered by time) shows the action before the crossing it caused (on a GPU the
    crossing came first)."""
    model, opt = model_and_opt()
    hook_s: list[float] = []
    policy = edo_monitor.Policy(
        on_action=lambda r: hook_s.append(time.time()), ladder=OFFLOAD_LADDER
    )
    with edo_monitor.watch(model, db=db_path, budget=BUDGET, policy=policy, interval_s=0.01):
        train(model, opt, 40)
    with History(db_path) as history:
        (event,) = history.events("latest", kind="action")
    duration_s = event.data["duration_s"]
    assert duration_s > 0
    # began, then took duration_s, then the on_action hook ran (after the event was recorded)
    assert event.time_s + duration_s <= hook_s[0]


class _SlowPlanningPolicy(edo_monitor.Policy):
    """Plans as slowly as a large model's estimates can: each estimate waits (30 s at most)
    until the training thread has taken two more steps (it counts them in ``steps_taken``) or
    has ``finished``."""

    steps_taken = 0
    finished = False

    def evaluate(self, reading, planner=None):  # type: ignore[no-untyped-def]
        def slow(name):  # type: ignore[no-untyped-def]
            until, deadline = self.steps_taken + 2, time.monotonic() + 30
            while self.steps_taken < until and not self.finished and time.monotonic() < deadline:
                time.sleep(0.005)
            return planner(name)

        return super().evaluate(reading, slow if planner is not None else None)


def test_the_events_of_a_reading_record_the_readings_step(db_path: Path) -> None:
    # regression: they recorded the step at which planning ended (a decision at step 40 whose
    # action and decision_expired said decided_at_step 24)
    model, opt = model_and_opt()
    policy = _SlowPlanningPolicy(ladder=OFFLOAD_LADDER)
    with edo_monitor.watch(model, db=db_path, budget=BUDGET, policy=policy, interval_s=0.01):
        for _ in range(60):
            train(model, opt, 1)
            policy.steps_taken += 1
            time.sleep(0.01)
        policy.finished = True
    with History(db_path) as history:
        events = history.events("latest")
    decision = next(e for e in events if e.kind == "decision")
    crossing = next(e for e in events if e.kind == "threshold_crossed")
    outcome = next(e for e in events if e.kind in ("action", "decision_expired"))
    assert outcome.data["decided_at_step"] == decision.step == crossing.step
    assert outcome.step > decision.step  # the steps planning took
