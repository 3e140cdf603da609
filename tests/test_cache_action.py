"""The cache_embedding / grow_cache actions on real CPU training loops.

A recommender-like model (an item table that dominates memory, a small user table) trained with
Adam; twins are trained on the same batches without the action.
"""

from __future__ import annotations

import copy
import math
import re
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from action_helpers import Recommender
from torch import nn

import edo_monitor
from edo_monitor.actions import (
    ACTIONS,
    ActionContext,
    ActivationRecorder,
    InjectedFailureError,
    Refusal,
)
from edo_monitor.actions.host_headroom import host_headroom
from edo_monitor.measure.accounting import account
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.nn import CachedTable
from edo_monitor.store.history import History

ITEMS, USERS, DIM = 4000, 50, 16
ROW_BYTES = DIM * 8 * 4  # float64 weight + grad + Adam's two moments
CACHED_ROW_BYTES = DIM * 8 * 3  # a cache row has no gradient: weight + Adam's two moments


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, ITEMS + 1, dtype=torch.float64) ** 1.05
    out = []
    for _ in range(n):
        items = torch.multinomial(probs, 64, replacement=True, generator=gen)
        users = torch.randint(0, USERS, (64,), generator=gen)
        out.append((users, items, torch.randn(64, generator=gen, dtype=torch.float64)))
    return out


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> torch.Tensor:
    users, items, target = batch
    loss = ((model(users, items) - target) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss  # kept alive by the caller, as training loops do


def _pair() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Recommender()
    twin = copy.deepcopy(model)
    return (
        model,
        torch.optim.Adam(model.parameters(), lr=0.01),
        twin,
        torch.optim.Adam(twin.parameters(), lr=0.01),
    )


def _profile(model: nn.Module) -> object:
    """One recorded forward on a copy: the cache needs to know the table is read only by itself."""
    users, items, _ = _batches(1, seed=9)[0]
    twin = copy.deepcopy(model)
    for m in twin.modules():  # the copy must not feed the original's batch-id peaks
        m._forward_pre_hooks.clear()
    with torch.no_grad(), ActivationRecorder(twin) as rec:
        twin(users, items)
    return rec.profile()


def _ctx(model: nn.Module, opt: torch.optim.Optimizer, **kw) -> ActionContext:
    in_use = account(model, [opt]).total_bytes
    kw.setdefault("activation_profile", _profile(model))
    kw.setdefault("grad_spent", lambda p: True)  # after the step: its gradients are spent
    return ActionContext(
        model, [opt], budget_bytes=kw.pop("budget_bytes", in_use), in_use_bytes=in_use, **kw
    )


def _full(model: nn.Module) -> torch.Tensor:
    return model.state_dict()["items.weight"]


@pytest.mark.slow
def test_cache_estimate_equals_measured_and_training_equals_the_twin() -> None:
    model, opt, twin, twin_opt = _pair()
    batches = _batches(60)
    for b in batches[:10]:
        loss = _step(model, opt, b)
        _step(twin, twin_opt, b)
    weight = model.items.weight
    # budget such that in_use is 150 %: need = in_use - 75 % of budget
    in_use = account(model, [opt]).total_bytes
    budget = int(in_use / 1.5)
    ctx = _ctx(model, opt, budget_bytes=budget, rearm_free_fraction=0.25)
    plan = ACTIONS["cache_embedding"].plan(ctx)
    assert plan.target == "items" and plan.details["resize"] == "create"
    need = in_use - 0.75 * budget
    rows = plan.details["to_rows"]
    # the rows that leave are sized by a resident row (weight, gradient, moments); the rows that
    # stay cost a cache row (weight, moments; no gradient): the dropped gradient is a margin
    assert rows == ITEMS - -(-math.ceil(need) // ROW_BYTES)
    result = ACTIONS["cache_embedding"].apply(ctx, plan)
    assert result.status == "applied", result.reason
    saving = ITEMS * ROW_BYTES - rows * CACHED_ROW_BYTES
    assert result.saved_bytes == result.estimated_saving_bytes == saving >= need
    assert isinstance(model.items, CachedTable) and model.items.weight is weight
    assert any(p is weight for p in opt.param_groups[0]["params"])
    assert weight.shape == (rows, DIM)
    for b in batches[10:]:
        loss = _step(model, opt, b)  # noqa: F841
        _step(twin, twin_opt, b)
    assert torch.allclose(_full(model), _full(twin), rtol=0, atol=1e-12)
    assert torch.allclose(model.users.weight, twin.users.weight, rtol=0, atol=1e-12)


def test_a_new_optimizer_after_the_conversion_steps_the_cached_table_exactly() -> None:
    """The user does not know the agent cached the table: a new optimizer made from the model's
    parameters (a second phase of training) steps it as it would step the resident one."""
    model, opt, twin, twin_opt = _pair()
    batches = _batches(16)
    for b in batches[:5]:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    result = ACTIONS["cache_embedding"].apply(_ctx(model, opt))
    assert result.status == "applied", result.reason
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    for b in batches[5:]:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    assert model.items._optimizer is opt
    assert torch.allclose(_full(model), _full(twin), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "stage", ["host_table_made", "weight_moved", "optimizer_attached", "module_replaced"]
)
def test_failure_at_each_stage_rolls_back_bit_identical(stage: str) -> None:
    model, opt, twin, twin_opt = _pair()
    batches = _batches(20)
    for b in batches[:5]:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    weight = model.items.weight
    state_before = {k: v for k, v in opt.state[weight].items()}
    ctx = _ctx(model, opt, fail_at=stage)
    result = ACTIONS["cache_embedding"].apply(ctx)
    assert result.status == "failed" and isinstance(result.exception, InjectedFailureError)
    assert type(model.items) is nn.Embedding and model.items.weight is weight
    assert weight.shape == (ITEMS, DIM)
    assert all(opt.state[weight][k] is v for k, v in state_before.items())
    for b in batches[5:]:  # no hook left behind: training continues exactly as the twin's
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    assert torch.equal(model.items.weight, twin.items.weight)


def test_inconsistent_optimizer_state_fails_and_rolls_back() -> None:
    """A state tensor of the wrong shape (a real inconsistency) fails the attach mid-action."""
    model, opt, twin, twin_opt = _pair()
    batches = _batches(10)
    for b in batches[:3]:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    weight = model.items.weight
    opt.state[weight]["exp_avg_sq"] = opt.state[weight]["exp_avg_sq"][:-1]  # one row short
    twin_opt.state[twin.items.weight]["exp_avg_sq"] = twin_opt.state[twin.items.weight][
        "exp_avg_sq"
    ][:-1]
    result = ACTIONS["cache_embedding"].apply(_ctx(model, opt))
    assert result.status == "failed" and "exp_avg_sq" in result.reason
    assert type(model.items) is nn.Embedding and weight.shape == (ITEMS, DIM)
    assert opt.state[weight]["exp_avg"].shape == (ITEMS, DIM)


def test_refusals_name_the_blocker() -> None:
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    r = ACTIONS["cache_embedding"].plan(_ctx(model, opt))
    assert isinstance(r, Refusal) and "L2, not decoupled" in r.reason
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))  # float32, float64 table
    r = ACTIONS["cache_embedding"].plan(_ctx(model, opt))
    assert isinstance(r, Refusal) and "float32 tensor) on a torch.float64 table" in r.reason
    sparse = nn.Module()
    sparse.items = nn.Embedding(ITEMS, DIM, sparse=True)
    r = ACTIONS["cache_embedding"].plan(
        ActionContext(sparse, [torch.optim.SGD(sparse.parameters(), lr=0.1)])
    )
    assert isinstance(r, Refusal) and "sparse=True" in r.reason
    tied = Recommender()
    tied.out = nn.Linear(DIM, ITEMS, bias=False, dtype=torch.float64)
    tied.out.weight = tied.items.weight
    r = ACTIONS["cache_embedding"].plan(ActionContext(tied, []))
    assert isinstance(r, Refusal) and "tied" in r.reason


@pytest.mark.slow
def test_shrink_then_grow_back_to_resident_stays_exact() -> None:
    model, opt, twin, twin_opt = _pair()
    counter = LookupCounter()  # what watch() installs: lookups and peak unique ids per forward
    counter.watch_tables(model)
    batches = _batches(80)
    it = iter(batches)
    for b in [next(it) for _ in range(5)]:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    ctx = _ctx(model, opt, budget_bytes=None, lookup_counter=counter)  # no reading: a tenth
    first = ACTIONS["cache_embedding"].apply(ctx)
    assert first.status == "applied" and model.items.cache_rows == ITEMS // 10
    assert 0 < first.details["peak_batch_ids"] <= 64
    counter.close()
    for b in [next(it) for _ in range(10)]:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    # renewed pressure: the cache shrinks (down to the peak ids per batch and one block)
    shrink = ACTIONS["cache_embedding"].apply(_ctx(model, opt, budget_bytes=None))
    assert shrink.status == "applied" and shrink.details["resize"] == "shrink"
    assert model.items.cache_rows == model.items.peak_unique_ids + 1
    assert shrink.saved_bytes == shrink.estimated_saving_bytes > 0
    for b in [next(it) for _ in range(10)]:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    # memory is free again: grow by what fits above re-arm + margin
    in_use = account(model, [opt]).total_bytes
    spare_rows = 300
    budget = int((in_use + spare_rows * CACHED_ROW_BYTES) / 0.70)  # 25 % re-arm + 5 % margin
    ctx = ActionContext(
        model, [opt], budget_bytes=budget, in_use_bytes=in_use, rearm_free_fraction=0.25
    )
    grow = ACTIONS["grow_cache"].apply(ctx)
    assert grow.status == "applied" and grow.details["resize"] == "grow"
    assert grow.saved_bytes == grow.estimated_saving_bytes < 0
    assert abs(grow.details["to_rows"] - grow.details["from_rows"] - spare_rows) <= 1
    for b in [next(it) for _ in range(10)]:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    ctx = ActionContext(
        model, [opt], budget_bytes=10**12, in_use_bytes=in_use, rearm_free_fraction=0.25
    )
    back = ACTIONS["grow_cache"].apply(ctx)
    assert back.status == "applied" and back.details["resize"] == "resident"
    assert type(model.items) is nn.Embedding and model.items.weight.shape == (ITEMS, DIM)
    assert back.saved_bytes == back.estimated_saving_bytes
    assert torch.allclose(model.items.weight, twin.items.weight, rtol=0, atol=1e-12)
    for b in it:
        _step(model, opt, b)
        _step(twin, twin_opt, b)
    assert torch.allclose(model.items.weight, twin.items.weight, rtol=0, atol=1e-12)
    assert opt.state[model.items.weight]["exp_avg"].shape == (ITEMS, DIM)


@pytest.mark.slow
def test_agent_picks_the_cache_before_offload_and_resizes_with_events(db_path: Path) -> None:
    """A recommender under a CPU budget: the default ladder caches the item table."""
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # params alone use ~1/4 of the table's training bytes: a budget of 3x params forces action
    budget = int(account(model).total_bytes * 3)
    policy = edo_monitor.Policy(cooldown_steps=1)
    with edo_monitor.watch(model, db=db_path, budget=budget, policy=policy, interval_s=0.01) as mon:
        for b in _batches(60):
            _step(model, opt, b)
    actions = mon.summary().actions
    assert actions and actions[0]["action"] == "cache_embedding"
    assert all(a["action"] != "offload_embedding" for a in actions)
    assert isinstance(model.items, CachedTable) or type(model.items) is nn.Embedding
    with History(db_path) as history:
        events = history.events("latest", kind="action")
    assert events[0].data["saved_bytes"] == events[0].data["estimated_saving_bytes"]


def test_policy_decides_grow_after_calm_readings_only() -> None:
    from edo_monitor.actions import Plan
    from edo_monitor.decide.policy_events import Decision
    from edo_monitor.probes.readings import Reading

    grow = Plan("grow_cache", "items", -1000, "grow the row cache of items from 10 to 20 rows")
    policy = edo_monitor.Policy(grow_after_readings=3, cooldown_steps=0)

    def reading(step: int, free: float) -> Reading:
        return Reading(time_s=float(step), step=step, device_kind="cpu-budget", free_fraction=free)

    planner = {"grow_cache": grow}
    # 0.29 is above re-arm (0.25) but not above re-arm + margin (0.30): never grows
    assert [policy.evaluate(reading(s, 0.29), planner) for s in range(5)] == [[]] * 5
    assert policy.evaluate(reading(5, 0.31), planner) == []
    assert policy.evaluate(reading(6, 0.31), planner) == []
    (decision,) = policy.evaluate(reading(7, 0.31), planner)
    assert isinstance(decision, Decision) and decision.action == "grow_cache"
    assert decision.estimated_saving_bytes == -1000 and policy.pending is decision
    policy.resolve(decision, "applied")
    # a dip resets the count
    policy.evaluate(reading(8, 0.31), planner)
    policy.evaluate(reading(9, 0.29), planner)
    assert policy.evaluate(reading(10, 0.31), planner) == []
    observe = edo_monitor.Policy(mode="observe")
    assert all(observe.evaluate(reading(s, 0.9), planner) == [] for s in range(5))


def test_module_rows_of_a_converted_table_are_cache_sized_and_add_up_to_the_samples(
    db_path: Path,
) -> None:
    """After cache_embedding the table's row holds its (C, D) cache and Adam state, not
    the full table's gradient seen before the conversion; and the latest module rows of a moment
    add up, category by category, to the sample recorded with them (one accounting, two views)."""
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = _batches(10)
    f64 = 8
    with edo_monitor.watch(model, opt, db=db_path, interval_s=0.01, track_activations=False) as m:
        for b in batches[:4]:
            _step(model, opt, b)
            time.sleep(0.03)  # readings land: the full table's gradient is recorded
        # between two steps, on the training thread (as the safe point would)
        result = ACTIONS["cache_embedding"].apply(_ctx(model, opt))
        assert result.status == "applied"
        rows = model.items.cache_rows
        assert 0 < rows < ITEMS
        for b in batches[4:]:
            _step(model, opt, b)
            time.sleep(0.03)
        run_id = m.run_id
    con = sqlite3.connect(db_path)
    cats = ("params_bytes", "grads_bytes", "optimizer_state_bytes")
    items_rows = con.execute(
        "SELECT kind, " + ", ".join(cats) + " FROM module_stats WHERE run_id = ? AND module = "
        "'items' ORDER BY id",
        (run_id,),
    ).fetchall()
    latest = {
        r[0]: r[1:]
        for r in con.execute(
            "SELECT module, " + ", ".join(cats) + " FROM module_stats WHERE run_id = ? ORDER BY id",
            (run_id,),
        )
    }
    sample = con.execute(
        "SELECT " + ", ".join(cats) + " FROM samples WHERE run_id = ? ORDER BY id DESC LIMIT 1",
        (run_id,),
    ).fetchone()
    con.close()
    # before: the whole table, 4,000 x 16 float64 = 512,000 bytes each, Adam: two moments + step
    assert ("Embedding", 512_000, 512_000, 2 * 512_000 + 4) in items_rows
    # after: C rows of 16 float64 for the weight and each moment (+ Adam's step); no (C, D)
    # gradient: the touched rows' gradient was consumed by the last step
    cache = rows * DIM * f64
    assert items_rows[-1] == ("CachedTable", cache, 0, 2 * cache + 4)
    users = USERS * DIM * f64  # 6,400 bytes
    assert latest["users"] == (users, users, 2 * users + 4)
    assert set(latest) == {"items", "users"}
    assert sample == tuple(latest["items"][i] + latest["users"][i] for i in range(3))


def test_a_shrink_saving_under_the_minimum_is_not_planned() -> None:
    """Issue 23 item 3: the demo's second shrink saved 7.5 KiB for a re-layout of the cache; a
    resize saving less than MIN_RESIZE_BYTES is skipped (the ladder moves on)."""
    from edo_monitor.actions.cache_embedding import MIN_RESIZE_BYTES

    model, opt, _, _ = _pair()
    for b in _batches(5):
        _step(model, opt, b)
    first = ACTIONS["cache_embedding"].apply(_ctx(model, opt, budget_bytes=None))
    assert first.status == "applied" and model.items.cache_rows > 400
    in_use = account(model, [opt]).total_bytes
    for need, planned in ((10 * 1024, False), (2 * MIN_RESIZE_BYTES, True)):
        budget = int((in_use - need) / 0.75)
        ctx = ActionContext(
            model, [opt], budget_bytes=budget, in_use_bytes=in_use, rearm_free_fraction=0.25
        )
        plan = ACTIONS["cache_embedding"].plan(ctx)
        shrink = not isinstance(plan, Refusal) and plan.details.get("resize") == "shrink"
        assert shrink is planned, plan
        if not planned:  # the refusal says why the cache was kept, not only the other table's
            assert isinstance(plan, Refusal) and plan.target == ""
            freed = re.search(r"items: shrinking frees ([\d.]+) KiB, under the 64 KiB", plan.reason)
            assert freed is not None and 10 <= float(freed[1]) < 64, plan  # need: 10 KiB
            assert "users: no recorded step yet" in plan.reason


def test_caching_a_table_that_frees_under_the_minimum_is_refused_naming_it() -> None:
    """The demo's ladder then cached its 610-row bias table to free 5.23 KiB: refused now."""

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = nn.Embedding(150, DIM, dtype=torch.float64)  # 76,800 bytes with Adam

        def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
            return self.items(items % 150).sum(-1)

    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    counter = LookupCounter()
    counter.watch_tables(model)
    for b in _batches(3):
        _step(model, opt, b)
    ctx = _ctx(model, opt, budget_bytes=None, lookup_counter=counter)
    plan = ACTIONS["cache_embedding"].plan(ctx)
    counter.close()
    assert isinstance(plan, Refusal) and "under the minimum" in plan.reason, plan


def test_a_need_the_dense_gradient_alone_covers_still_caches_the_table() -> None:
    """The main demo's crossing needs less than the table's dense gradient: dropping it alone (a
    row cache keeps none) would free the need, and the row count, sized by cached-row bytes, came
    out at the whole table: the plan was refused ("would hold the whole table") and the demo
    offloaded its table instead. The rows that must go are sized by resident-row bytes; the
    dropped gradient is a margin on top."""
    from edo_monitor.actions.cache_embedding import _row_bytes

    model, opt, _, _ = _pair()
    for b in _batches(5):
        _step(model, opt, b)
    weight = model.items.weight
    n = weight.shape[0]
    grad_bytes = weight.numel() * weight.element_size()
    in_use = account(model, [opt]).total_bytes
    need = grad_bytes // 4  # less than the dense gradient the conversion drops
    budget = int((in_use - need) / 0.75)  # re-arm at 25 % free: `need` bytes must go
    ctx = _ctx(model, opt, budget_bytes=budget, rearm_free_fraction=0.25)
    plan = ACTIONS["cache_embedding"].plan(ctx)
    assert not isinstance(plan, Refusal), plan
    row = _row_bytes(weight, [opt])
    cached_row = _row_bytes(weight, [opt], cached=True)
    expected_rows = n - -(-_need(in_use, budget) // row)
    assert plan.details["to_rows"] == expected_rows < n
    assert plan.estimated_saving_bytes == n * row - expected_rows * cached_row >= need


def _need(in_use: int, budget: int) -> int:
    """Bytes the plan frees to reach the re-arm level (25 % free) from ``in_use``."""
    return int(in_use - 0.75 * budget)


def test_growing_back_to_resident_counts_the_dense_gradient() -> None:
    """A row cache has no dense gradient; the table made resident again has its (N, D) gradient
    back. grow_cache costed going resident by the cache rows alone, so the demo (40 steps) grew
    its cache back to the whole table with 11 MiB of spare, the gradient took 25 MiB more, and
    the next step ran out of its enforced budget. Now: resident only when the gradient fits too,
    else the cache grows to one row short of the table."""
    from edo_monitor.actions.cache_embedding import _row_bytes

    model, opt, _, _ = _pair()
    for b in _batches(5):
        _step(model, opt, b)
    first = ACTIONS["cache_embedding"].apply(_ctx(model, opt, budget_bytes=None))
    assert first.status == "applied"
    table = model.items
    n, cached = table.num_embeddings, table.cache_rows
    row = _row_bytes(table.weight, [opt], cached=True)
    grad_bytes = n * (_row_bytes(table.weight, [opt]) - row)
    in_use = account(model, [opt]).total_bytes
    for spare, resident in (
        ((n - cached) * row + grad_bytes // 2, False),
        ((n - cached) * row + grad_bytes + 4096, True),
    ):
        budget = int((in_use + spare) / 0.70)  # keep_free = (0.25 + 0.05) of the budget
        spare_seen = budget - in_use - 0.30 * budget
        ctx = ActionContext(
            model, [opt], budget_bytes=budget, in_use_bytes=in_use, rearm_free_fraction=0.25
        )
        plan = ACTIONS["grow_cache"].plan(ctx)
        assert not isinstance(plan, Refusal), plan
        assert (plan.details["resize"] == "resident") is resident, plan
        cost = -plan.estimated_saving_bytes
        assert cost <= spare_seen
        if resident:
            assert cost == (n - cached) * row + grad_bytes
        else:
            assert plan.details["to_rows"] == n - 1


@pytest.mark.slow
def test_the_action_on_a_compiled_model_stays_within_eagers_difference() -> None:
    """Issue 21 item 6: ``cache_embedding`` applied live to a model the user compiled (the
    action replaces the table inside ``torch.compile``'s wrapper, which then recompiles) trains
    as far from a compiled untouched twin as the eager action does from an eager twin, in float32
    (it was 25x farther); in float64 both are exact."""

    def run(dtype: torch.dtype, compiled: bool) -> float:
        torch.manual_seed(0)
        model = Recommender().to(dtype)
        twin = copy.deepcopy(model)
        fwd, twin_fwd = model, twin
        if compiled:
            torch._dynamo.reset()
            fwd, twin_fwd = torch.compile(model), torch.compile(twin)
        opt, twin_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, twin))
        batches = [(u, i, y.to(dtype)) for u, i, y in _batches(30)]
        for n, batch in enumerate(batches):
            if n == 10:
                ctx = _ctx(model, opt, budget_bytes=int(account(model, [opt]).total_bytes / 1.5))
                result = ACTIONS["cache_embedding"].apply(ctx, ACTIONS["cache_embedding"].plan(ctx))
                assert result.status == "applied", result.reason
            for f, o in ((fwd, opt), (twin_fwd, twin_opt)):
                _step(f, o, batch)
        assert isinstance(model.items, CachedTable)
        return float((_full(model) - _full(twin)).norm() / _full(twin).norm())

    assert run(torch.float64, compiled=True) < 1e-12
    eager32, compiled32 = run(torch.float32, compiled=False), run(torch.float32, compiled=True)
    assert 0 < compiled32 <= 2 * eager32, (compiled32, eager32)


def test_momentum_switched_off_and_back_across_caching_and_going_resident_stays_exact() -> None:
    """Regression: SGD keeps a switched-off momentum buffer and uses it again when momentum
    comes back. Caching a table whose optimizer held one dropped it (momentum restarted from
    zero), and going resident again kept the cache's ``(C, D)`` copy (the next step with momentum
    raised a size mismatch). The cache keeps every such key whole on the host."""
    torch.manual_seed(0)
    model = Recommender()
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, twin))
    batches = iter(_batches(40))

    def run(steps: int, momentum: float | None = None) -> None:
        for o in (opt, twin_opt):
            if momentum is not None:
                o.param_groups[0]["momentum"] = momentum
        for b in [next(batches) for _ in range(steps)]:
            _step(model, opt, b)
            _step(twin, twin_opt, b)

    run(5)
    run(5, momentum=0.0)
    cached = ACTIONS["cache_embedding"].apply(_ctx(model, opt, budget_bytes=None))
    assert cached.status == "applied" and isinstance(model.items, CachedTable)
    run(10, momentum=0.9)  # the buffer kept since the switch
    assert torch.allclose(_full(model), twin.items.weight, rtol=0, atol=1e-12)
    run(5, momentum=0.0)
    ctx = ActionContext(model, [opt], budget_bytes=10**12, in_use_bytes=1, rearm_free_fraction=0.25)
    back = ACTIONS["grow_cache"].apply(ctx)
    assert back.status == "applied" and type(model.items) is nn.Embedding
    assert opt.state[model.items.weight]["momentum_buffer"].shape == (ITEMS, DIM)
    run(10, momentum=0.9)
    assert torch.allclose(model.items.weight, twin.items.weight, rtol=0, atol=1e-12)


def test_the_host_headroom_counts_a_state_key_a_setting_switched_off() -> None:
    """The cache keeps such a key on the host with the table (above): the host bytes a cache of
    the table needs count it (they counted only the keys in use: the table alone)."""
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _step(model, opt, _batches(1)[0])
    weight = model.items.weight
    ctx = ActionContext(model, [opt], budget_bytes=None, in_use_bytes=None)
    table_bytes = weight.numel() * weight.element_size()
    assert host_headroom(ctx, weight, [opt]).table_bytes == 2 * table_bytes
    opt.param_groups[0]["momentum"] = 0.0
    assert host_headroom(ctx, weight, [opt]).table_bytes == 2 * table_bytes
