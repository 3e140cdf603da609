"""replay against what the run recorded: the live actions taken out of the trace by the same rule
as the replayed ones are put in, and every live action listed at the step it was applied. Real
watch() runs on a CPU budget into real SQLite files (one of them a real two-rank gloo job)."""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_explain_recorded import BUDGET, _train
from test_ranks import run_ranks
from torch import nn

import edo_monitor
from edo_monitor.store.history import History


def _cache_run(db: Path) -> int:
    """mini.py's run: a table under a 9 MiB budget, below the floor from step 1 (the first step
    makes Adam's state), the default policy: ``cache_embedding`` at step 1, readings every 5 ms."""
    return _train(db, edo_monitor.Policy(), [64 * (1 + i // 5) for i in range(12)], 0.005)


@pytest.mark.timeout(180)
def test_a_replay_that_applies_what_the_run_applied_reproduces_its_readings(
    tmp_path: Path,
) -> None:
    """Regression: a live action's saving was added back to every sample from its event's time
    on, a replayed one's taken off only from the next step: the readings of the action's step
    taken while it ran (they still count the model before it) got the live saving added and no
    replayed saving taken, a minimum free fraction that never happened (mini.py: replay -61.3 %
    against the recorded -8.8 %). One rule now: a later step, or once the action was done."""
    db = tmp_path / "cache.db"
    run = _cache_run(db)
    with History(db) as h:
        (action, *_) = h.events(run, kind="action")
    done_s = action.time_s + action.data["duration_s"]
    # what the old rule miscounted: a reading of the action's step taken while the action ran,
    # still without it. The sampler lands one there only sometimes (the action holds the GIL):
    # one is added, a copy of the step's reading before the action, half-way through it
    with sqlite3.connect(db) as con:
        con.row_factory = sqlite3.Row
        (last,) = con.execute(
            "SELECT * FROM samples WHERE run_id = ? AND step = ? AND time_s < ? "
            "ORDER BY time_s DESC LIMIT 1",
            (run, action.step, action.time_s),
        ).fetchall()
        row = {k: last[k] for k in last.keys() if k != "id"}  # noqa: SIM118 (a Row iterates values)
        row["time_s"] = action.time_s + action.data["duration_s"] / 2
        con.execute(
            f"INSERT INTO samples ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            tuple(row.values()),
        )
    with History(db) as h:
        actions = h.events(run, kind="action")
        rows = list(h.samples(run, columns=["step", "in_use_bytes"], max_points=None).rows())
    saved = action.data["saved_bytes"]
    assert action.data["action"] == "cache_embedding" and saved > 0
    in_step = [r for r in rows if r["step"] == action.step]
    before = row["in_use_bytes"]
    assert [r for r in in_step if action.time_s <= r["time_s"] < done_s]
    # the step's highest reading before the action was done: the latest one before it. (Earlier
    # ones may be lower: on a loaded machine the sampler can miss the first step boundary, and a
    # reading without a boundary's accounting counts no gradients or optimizer state.)
    assert max(r["in_use_bytes"] for r in in_step if r["time_s"] < done_s) == before

    result = edo_monitor.replay(str(db), run)
    first = result.decisions[0]
    assert (first.action, first.step, first.saving_bytes) == (
        "cache_embedding",
        action.data["decided_at_step"],
        saved,
    )
    recorded_min = min((BUDGET - r["in_use_bytes"]) / BUDGET for r in rows)
    assert result.recorded_min_free_fraction == pytest.approx(recorded_min)
    assert (
        result.min_free_fraction
        == pytest.approx(recorded_min)
        == pytest.approx((BUDGET - before) / BUDGET)
    )

    # a replay that acts on nothing sees the run without its actions: below the floor from
    # step 1 (every live saving added back where the readings show it, and only there); its
    # crossings are those of the readings so restored. (Not always one: on a loaded machine a
    # reading of step 1 without a boundary's accounting, no gradients or optimizer state, can
    # read back above the re-arm level.)
    observed = edo_monitor.replay(str(db), run, {"mode": "observe"})
    assert observed.decisions == ()
    restored = [
        (r["step"], (BUDGET - r["in_use_bytes"] - _back(actions, r)) / BUDGET) for r in rows
    ]
    assert [(step, kind) for step, kind, _ in observed.crossings] == _crossings(restored)
    # below the floor by step 1 (at step 0 where a reading of the first step landed after its
    # backward: its gradients count, as on a loaded machine under `pytest -n 2`)
    assert observed.crossings[0][1] == "below_floor" and observed.crossings[0][0] <= 1
    assert observed.min_free_fraction == pytest.approx(
        min((BUDGET - r["in_use_bytes"] - _back(actions, r)) / BUDGET for r in rows)
    )


@pytest.mark.timeout(120)
def test_a_reading_is_stamped_after_the_step_it_names_began(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (a CI flake of the test above): the sampler stamped a reading's time first and
    read the step after its probes; a reading held back there (a slow host read, the training
    thread holding the GIL through an action) carried the next step's number at a time before
    that step, before an action done at the boundary too, and replay counted the action's saving
    in force at a reading of the step before it (the observe replay's minimum -61.3 %, the
    readings' -9.4 %). A reading of step k is now stamped after k began."""
    from edo_monitor.probes.host import HostProbe

    real = HostProbe.read

    def held_back(self: HostProbe, **kw: Any) -> Any:  # a host reading on a loaded machine
        time.sleep(0.02)
        return real(self, **kw)

    monkeypatch.setattr(HostProbe, "read", held_back)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    began = {0: 0.0}  # step k began no earlier than began[k]
    db = tmp_path / "stamps.db"
    with edo_monitor.watch(model, db=str(db), interval_s=0.005) as mon:
        for k in range(1, 40):
            model(torch.randn(4, 8)).sum().backward()
            began[k] = time.time()
            opt.step()
            opt.zero_grad()
            assert mon.steps == k
            time.sleep(0.002)
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT step, time_s FROM samples").fetchall()
    assert len({step for step, _ in rows}) > 5, "too few readings: nothing to test"
    assert [(step, t) for step, t in rows if t < began[step]] == []


def _crossings(free: list[tuple[int, float]]) -> list[tuple[int, str]]:
    """The default policy's hysteresis over ``(step, free fraction)`` readings: below the floor
    starts pressure, at or above the re-arm level ends it."""
    policy = edo_monitor.Policy()
    out, pressed = [], False
    for step, fraction in free:
        if not pressed and fraction < policy.min_free_fraction:
            out.append((step, "below_floor"))
            pressed = True
        elif pressed and fraction >= policy.rearm_free_fraction:
            out.append((step, "above_rearm"))
            pressed = False
    return out


def _back(actions: list, row: dict) -> int:
    """The live savings in force at a reading (a later step, or once the action was done)."""
    return sum(
        a.data["saved_bytes"]
        for a in actions
        if row["step"] > a.step or row["time_s"] >= a.time_s + a.data["duration_s"]
    )


@pytest.mark.timeout(300)
def test_replay_lists_every_action_of_a_rank_at_the_step_it_was_applied(tmp_path: Path) -> None:
    """Regression: the recorded rows were the run's decisions only, each at its own step. On a
    rank of a job an action the ranks agreed on is applied at a sync step: rank 0 never crossed
    its floor but applied rank 1's ``cache_embedding`` (no decision on rank 0: left out), and
    its own ``grow_cache`` decided at step 5 was listed at 5, not at 7 where it was applied."""
    db = str(tmp_path / "job.db")
    results = run_ranks("pressure", db, 2, tmp_path, "ladder=cache_embedding", "sync=4", "steps=24")
    for res in results:
        with History(db) as h:
            events = h.events(res["run_id"])
        acted = [e for e in events if e.kind in ("action", "action_refused", "action_failed")]
        decided = {e.step: e for e in events if e.kind == "decision"}
        assert acted, f"rank run {res['run_id']} did nothing: nothing to test"
        recorded = edo_monitor.replay(db, res["run_id"]).recorded
        outcomes = [r for r in recorded if r.status in ("applied", "refused", "failed")]
        assert [(r.step, r.action, r.target) for r in outcomes] == [
            (e.step, e.data["action"], e.data["target"]) for e in acted
        ]
        for r, e in zip(outcomes, acted, strict=True):
            own = decided.get(e.data["decided_at_step"])
            if own is not None and own.data["action"] == e.data["action"]:
                assert r.decided_step == own.step
                assert r.free_fraction == own.data["free_fraction"]
            else:  # an agreed action this rank's policy did not decide
                assert r.decided_step is None and r.free_fraction is None
                assert r.reason.startswith("agreed by the ranks")
            if e.kind == "action":
                assert r.saving_bytes == e.data["saved_bytes"]
        # no decision listed twice, none left out
        assert sorted(r.decided_step for r in recorded if r.decided_step is not None) == sorted(
            decided
        )
    # rank 0 stayed above its floor: it decided no cache_embedding, yet applied the agreed one
    with History(db) as h:
        rank0 = h.events(results[0]["run_id"])
    assert not [e for e in rank0 if e.kind == "decision" and e.data["action"] == "cache_embedding"]
    assert [e for e in rank0 if e.kind == "action" and e.data["action"] == "cache_embedding"]


@pytest.mark.timeout(120)
def _small_table_run(db: Path, optimizer: type, budget: int) -> int:
    """A 1,000-row table (16 columns) and a head stepped by ``optimizer``, 30 batches of 32 ids
    under a CPU ``budget`` with the default policy; the run's id."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 16), nn.Linear(16, 4))
    opt = optimizer(model.parameters(), lr=0.01)
    with edo_monitor.watch(
        model, db=str(db), interval_s=0.05, budget=budget, policy=edo_monitor.Policy()
    ) as mon:
        for _ in range(30):
            model(torch.randint(0, 1000, (32,))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)
    return mon.run_id


def test_replay_with_the_live_policy_grows_the_cache_when_the_run_did(tmp_path: Path) -> None:
    """Regression: replay told the policy a decision was applied when it was made, where the live
    agent tells it at the safe point that applies it; the readings between them (without the
    saving yet) filled the policy's recent in-use again, and every ``grow_cache`` after a
    conversion came 20 steps late (the look-back): live 1 and 6, replayed 1 and 21."""
    db = tmp_path / "grow.db"
    batches = [64 * (1 + i // 5) for i in range(12)] + [64] * 18
    run = _train(db, edo_monitor.Policy(), batches, 0.005)
    result = edo_monitor.replay(str(db), run)
    # the steps decided on (a decision on a reading late in step 0 is applied at step 1's
    # safe point: the recorded ``step`` is the action's)
    live = [(d.decided_step, d.action) for d in result.recorded]
    assert [a for _, a in live][:2] == ["cache_embedding", "grow_cache"], live
    assert [(d.step, d.action) for d in result.decisions] == live


def test_hindsight_sizes_a_row_cache_by_the_peak_ids_the_run_recorded(tmp_path: Path) -> None:
    """Regression: replay and explain sized a row cache at least 1,024 rows (the action's floor
    when the peak ids per batch are unknown) while the run knew its peak (32 ids a batch): on a
    1,000-row table the live default policy cached it (keeping 863 rows), its replay found a
    cache of 1,024 would hold the whole table and offloaded it instead, and explain left the
    one remedy that worked out. Both read the peak the run recorded now (its action's details,
    its ``lookup_frequency`` events)."""
    db = tmp_path / "small.db"
    run = _small_table_run(db, torch.optim.Adam, 300_000)
    with History(db) as h:
        (action, *_) = h.events(run, kind="action")
        (counted,) = h.events(run, kind="lookup_frequency")
    assert action.data["action"] == "cache_embedding"
    result = edo_monitor.replay(str(db), run)
    first = result.decisions[0]
    assert (first.action, first.saving_bytes) == ("cache_embedding", action.data["saved_bytes"])
    (incident, *_) = edo_monitor.explain(str(db), run).incidents
    cache = next(r for r in incident.remedies if r.action == "cache_embedding")
    # the run's peak (its action saw the peak so far: at most that)
    peak = counted.data["peak_unique_ids"]
    assert 0 < action.data["details"]["peak_batch_ids"] <= peak <= 32
    row = 16 * 4 * 4  # float32 weight, its gradient and Adam's two moments: resident
    assert cache.saving_bytes == (1000 - peak) * row


def test_hindsight_refuses_what_the_live_agent_refused_before_its_decision(tmp_path: Path) -> None:
    """Regression (a new user's run): the live default policy could not cache a table stepped by
    RMSprop (the row cache refuses it) and offloaded it; replay, which cannot see the optimizer
    in the trace, modelled ``cache_embedding`` as its decision, and explain listed the cache as
    a lossless remedy. The decision records the rungs it passed over now, and both refuse
    what the live agent refused on that table."""
    db = tmp_path / "rmsprop.db"
    run = _small_table_run(db, torch.optim.RMSprop, 215_000)
    with History(db) as h:
        (decision, *_) = h.events(run, kind="decision")
        (action, *_) = h.events(run, kind="action")
    assert (action.data["action"], action.data["status"]) == ("offload_embedding", "applied")
    passed = {(r["action"], r["target"]): r["reason"] for r in decision.data["passed_over"]}
    assert "RMSprop is not supported by the row cache" in passed["cache_embedding", "0"]
    result = edo_monitor.replay(str(db), run)
    assert [d.action for d in result.decisions[:1]] == ["offload_embedding"]
    (incident, *_) = edo_monitor.explain(str(db), run).incidents
    assert "cache_embedding" not in {r.action for r in incident.remedies}
    (refused,) = [r for r in incident.refused_live if r.action == "cache_embedding"]
    assert refused.detail.startswith("refused live: optimizer RMSprop is not supported")


class _FixedLookBack(edo_monitor.Policy):
    """The default policy keeping its 20-step grow look-back (a grow undone teaches it nothing)."""

    def _learn_from_undone_grow(self, grown: int | None, step: int) -> None:
        pass


def _phased_run(
    db: Path, policy: edo_monitor.Policy, heavy: Callable[[int], bool], steps: int
) -> int:
    """A 40,000 x 32 ``EmbeddingBag`` (Adam) and a 32 -> 512 -> 2 head under a 24 MiB CPU budget,
    64 bags a step, 2,048 where ``heavy(step)``; the run's id."""
    torch.manual_seed(0)
    rows = 40_000
    model = nn.Sequential(
        nn.EmbeddingBag(rows, 32), nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    with edo_monitor.watch(
        model, db=str(db), budget=24 * 2**20, policy=policy, interval_s=0.005
    ) as mon:
        for step in range(steps):
            bags = 2048 if heavy(step) else 64
            ids = torch.randint(0, rows, (bags, 8), generator=gen)
            target = torch.randint(0, 2, (bags,), generator=gen)
            nn.functional.cross_entropy(model(ids), target).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
    return mon.run_id


def _live_actions(db: Path, run: int) -> list[str]:
    """The reasons of the run's applied actions (the plan each was applied by)."""
    with History(db) as h:
        return [e.data["reason"] for e in h.events(run, kind="action")]


def test_replay_shrinks_a_row_cache_by_cached_rows_as_the_live_shrink(tmp_path: Path) -> None:
    """Regression: replay sized a shrink of a row cache in resident rows (weight, gradient and
    Adam's moments: 512 bytes a row of 32) where the live shrink frees cached rows (no dense
    gradient: 384 bytes), and without the live shrink's minimum: here it freed 1,540,096 bytes
    for the live 1,572,864 and shrank again by 32 KiB five steps later (in a 300-step run every
    grow after a shrink was 1,024 rows short, and a crossing the live run met was not
    replayed)."""
    db = tmp_path / "shrink.db"
    run = _phased_run(db, edo_monitor.Policy(), lambda step: step >= 40, 50)
    result = edo_monitor.replay(str(db), run)
    live = [(d.decided_step, d.action, d.saving_bytes) for d in result.recorded]
    assert [a for _, a, _ in live] == ["cache_embedding", "grow_cache", "cache_embedding"]
    assert [(d.step, d.action, d.saving_bytes) for d in result.decisions] == live
    shrink = _live_actions(db, run)[2]
    assert shrink.startswith("shrink the row cache")
    assert result.decisions[2].reason.endswith(shrink)  # to the same rows

    # a later reading of the shrink's step, 100,000 bytes higher: the replay plans the shrink
    # again on it at the safe point, as the live agent plans on its accounting there, and lists
    # the saving of that plan (it listed the decision's estimate)
    with History(db) as h:
        decided = h.events(run, kind="decision")[2]
        acted = h.events(run, kind="action")[2]
    with sqlite3.connect(db) as con:
        con.row_factory = sqlite3.Row
        (reading,) = con.execute(  # the reading decided on: the latest by the decision
            "SELECT * FROM samples WHERE run_id = ? AND time_s <= ? ORDER BY time_s DESC LIMIT 1",
            (run, decided.time_s),
        ).fetchall()
        row = {k: reading[k] for k in reading.keys() if k != "id"}  # noqa: SIM118 (a Row)
        row["in_use_bytes"] += 100_000
        row["time_s"] = (decided.time_s + acted.time_s) / 2
        con.execute(
            f"INSERT INTO samples ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            tuple(row.values()),
        )
    need = row["in_use_bytes"] - 0.75 * row["budget_bytes"]  # down to the re-arm level, 25 %
    cached_row_bytes = 32 * 4 * 3  # a cached row: its weight and Adam's two moments
    replayed = edo_monitor.replay(str(db), run).decisions[2]
    assert replayed.saving_bytes == math.ceil(need / cached_row_bytes) * cached_row_bytes
    assert replayed.saving_bytes > decided.data["estimated_saving_bytes"]
    assert "; applied as: shrink the row cache" in replayed.reason


def test_replay_plans_a_decision_again_at_its_safe_point_as_the_live_agent(
    tmp_path: Path,
) -> None:
    """Regression: replay applied a decision as planned on its reading; the live agent plans it
    again at the safe point that applies it, on its accounting there (the step's gradients
    alive). A grow decided on the first reading of a heavy step (20-step phases, a policy
    keeping a 20-step look-back) was refused live ("spare 0 bytes") and modelled as applied in
    the replay, which then ran on a cache the run never had; a decision planned on a reading
    early in its step (a shrink, a grow) was modelled and listed at its own size, the live
    action at another (a grow of 18,558 rows live 8,647)."""
    db = tmp_path / "phases.db"
    run = _phased_run(db, _FixedLookBack(), lambda step: (step // 20) % 2 == 1, 65)
    result = edo_monitor.replay(str(db), run, policy=_FixedLookBack())
    # a replayed decision is "modelled" where the live one was applied (or expired at the end)
    as_replayed = {"applied": "modelled", "refused": "refused", "expired": "modelled"}
    live = [(d.decided_step, d.action, as_replayed[d.status]) for d in result.recorded]
    assert [(d.step, d.action, d.status) for d in result.decisions] == live
    assert any(status == "refused" for *_, status in live)  # a grow at a heavy phase's start
    for replayed, recorded in zip(result.decisions, result.recorded, strict=True):
        if recorded.status == "applied":  # the saving of the plan applied at the safe point
            assert replayed.saving_bytes == recorded.saving_bytes, (replayed, recorded)
