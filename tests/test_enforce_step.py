"""``enforce=True`` without CUDA checks what is alive at once inside the step: the forward counts
the gradients alive (none after ``zero_grad()``), the backward each new gradient, and an error
there comes before the optimizer's step, as a GPU's would (agent/grads_alive.py)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.actions.activation_profile import ActivationRecorder
from edo_monitor.hindsight.explain import explain
from edo_monitor.measure.accounting import account
from edo_monitor.store.history import History

ROWS, DIM, HIDDEN, BATCH = 50_000, 16, 512, 1024
TABLE_BYTES = ROWS * DIM * 4  # 3,200,000
HEAD_BYTES = (DIM * HIDDEN + HIDDEN + HIDDEN + 1) * 4  # 36,868
MiB = 2**20


class Model(nn.Module):
    """A table and a head whose ReLU saves ``BATCH x HIDDEN`` floats (2 MiB) for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


def setup() -> tuple[Model, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randint(0, ROWS, (BATCH,))


def test_the_first_step_fails_in_the_backward_at_the_gradient_before_the_optimizer_step(
    db_path: Path,
) -> None:
    """Params (3.09 MiB) + the forward's saved bytes (2.07 MiB) fit in 6 MiB; the table's
    gradient (3.05 MiB) does not. Before, the first step's check came at the step boundary,
    after ``opt.step()`` had changed the weights; now the backward raises at that gradient, the
    gradient is not kept (the allocation failed) and the weights are as they were."""
    model, opt, ids = setup()
    before = [p.detach().clone() for p in model.parameters()]
    with edo_monitor.watch(model, opt, db=db_path, budget=6 * MiB, enforce=True) as mon:
        loss = model(ids).pow(2).mean()
        # the training thread's accounting walks while the error is checked and recorded (the
        # sampler's thread walks on its own clock, without gradients: not counted here)
        walks = []
        account, training_thread = mon._account, threading.get_ident()

        def counted(**kw: bool) -> object:
            if threading.get_ident() == training_thread:
                walks.append(kw)
            return account(**kw)

        mon._account = counted  # type: ignore[method-assign]
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError) as caught:
            loss.backward()
        del mon._account
        assert len(walks) == 1  # the check's, which the snapshot reuses (it walked again)
        assert model.emb.weight.grad is None
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        del loss
    assert str(caught.value).startswith("CPU-budget out of memory. Tried to allocate 3.05 MiB.")
    assert mon.summary().events["oom"] == 1
    with History(db_path) as history:
        (oom,) = history.events(mon.run_id, kind="oom")
        facts = explain(history, mon.run_id, event=oom.id).incidents[0].snapshot
    alive = oom.data["in_use"]
    assert alive["request"] == "grads_bytes" and alive["requested_bytes"] == TABLE_BYTES
    assert alive["params_bytes"] == TABLE_BYTES + HEAD_BYTES
    assert alive["grads_bytes"] == HEAD_BYTES + TABLE_BYTES  # the head's, then the table's
    assert alive["optimizer_state_bytes"] == 0
    # the saved bytes the check counts in the backward: the forward's peak (ids 8 KiB, the
    # Linear's input 64 KiB, ReLU's output 2 MiB, the last Linear's output...)
    assert 2 * MiB < alive["activations_bytes"] < 2.2 * MiB
    # the snapshot shows what the message says was accounted before the request
    in_use = sum(alive[k] for k in ("params_bytes", "grads_bytes", "activations_bytes"))
    assert facts is not None
    assert facts["allocated_bytes"] == in_use - TABLE_BYTES
    assert facts["fragmentation"]["fits_in_largest_free_block"] is False


def _accounted(alive: dict) -> int:
    """What an ``oom`` event's ``in_use`` says was alive without the refused request."""
    keys = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes")
    return sum(alive[k] for k in keys) - alive["requested_bytes"]


def test_the_runs_peak_and_lowest_free_fraction_reach_the_errors_figures(db_path: Path) -> None:
    """Regression: an error in the first step (no step boundary yet) left the run's peak at
    what the samples saw (the parameters: 14 % free recorded against 0.2 % in the error); the
    moment of the error is a sample now, with what the error says was accounted."""
    model, opt, ids = setup()
    budget = 6 * MiB
    with pytest.raises(edo_monitor.BudgetOutOfMemoryError):  # noqa: SIM117
        with edo_monitor.watch(
            model, opt, db=db_path, budget=budget, enforce=True, interval_s=60
        ) as mon:
            model(ids).pow(2).mean().backward()
    with History(db_path) as history:
        (oom,) = history.events(mon.run_id, kind="oom")
        accounted = _accounted(oom.data["in_use"])
        run = history.run(mon.run_id)
        assert history.peak(mon.run_id).value == accounted
    assert mon.summary().peak_in_use_bytes == accounted
    assert run.min_free_fraction == pytest.approx((budget - accounted) / budget)
    assert f"{accounted / MiB:.2f} MiB is accounted" in oom.message


def test_a_caught_error_leaves_its_steps_saved_bytes_out_of_later_readings(db_path: Path) -> None:
    """Regression: a loop that catches the error and goes on with smaller batches had the failed
    step's peak of saved bytes (2 MiB) in the next reading, whenever it came, beside the later
    steps' accounting: bytes never alive together (a reading over the enforced budget). The
    error's own sample holds that moment; the next step's forward starts the readings' peak
    afresh. Sampled at the start and the end only (``interval_s=60``): the end's reading."""
    model, opt, ids = setup()  # 7 MiB: the parameters and their gradients fit, with 2 MiB not
    budget = 7 * MiB
    with edo_monitor.watch(
        model, opt, db=db_path, budget=budget, enforce=True, interval_s=60
    ) as mon:
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError):
            model(ids).pow(2).mean().backward()
        opt.zero_grad()
        for _ in range(3):
            model(ids[:32]).pow(2).mean().backward()
            opt.step()
    with History(db_path) as history:
        samples = history.samples(mon.run_id, columns=["activations_bytes"], max_points=None)
        last = max(range(len(samples)), key=lambda i: samples.time_s[i])
        assert samples.max["activations_bytes"][last] < MiB
        assert history.peak(mon.run_id).value <= budget


@pytest.mark.parametrize("set_to_none", [True, False], ids=["freed", "zero-filled"])
def test_the_forward_counts_only_the_gradients_alive(db_path: Path, set_to_none: bool) -> None:
    """A step fits 8.5 MiB (params 3.09 + gradients 3.09 + the saved peak 2.07 MiB). Then a
    forward of a batch twice as large (an evaluation with gradients on): 3.09 MiB of params +
    4.14 MiB saved fit, unless the last step's gradients are still alive (``zero_grad`` filling
    them with zeros: 3.09 MiB more). Before, the forward counted the gradients of the last step
    boundary, ``zero_grad()``'s freed ones too, and failed either way."""
    model, opt, ids = setup()
    with edo_monitor.watch(model, opt, db=db_path, budget=int(8.5 * MiB), enforce=True) as mon:
        model(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        double = torch.cat([ids, ids.flip(0)])
        if set_to_none:
            model(double).sum()
        else:
            with pytest.raises(edo_monitor.BudgetOutOfMemoryError):
                model(double).sum()
    assert mon.summary().events.get("oom", 0) == (0 if set_to_none else 1)


def test_explain_counts_what_was_alive_when_the_message_says_nothing_is_free(
    db_path: Path,
) -> None:
    """Regression: after Adam's first state pushed the static bytes over the budget, the next
    forward's error says "0 bytes is free" (the message stops at 0) and ``explain`` took the
    shortfall as the request alone, 8 KiB, where what was alive exceeded the budget by 111 KiB.
    It now counts the event's categories, with the request in its own, less the exact budget;
    its ``mixed_precision`` remedy halves the activations only (bf16 autocast keeps the
    gradients float32), and the staged plan counts the same bytes."""
    from edo_monitor.measure.accounting import account

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    budget = int(account(model).total_bytes * 2.6)
    x = torch.randn(32, 64)
    with edo_monitor.watch(model, opt, db=db_path, budget=budget, enforce=True) as mon:
        for _ in range(2):
            try:
                model(x).pow(2).mean().backward()
                opt.step()
            except torch.OutOfMemoryError:
                pass
            opt.zero_grad()
    with History(db_path) as history:
        ooms = history.events(mon.run_id, kind="oom")
        incidents = {i.event_id: i for i in explain(history, mon.run_id).incidents}
    forward = ooms[-1]
    assert "0 bytes is free" in forward.message
    alive = forward.data["in_use"]
    total = sum(
        alive[k]
        for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes")
    )
    incident = incidents[forward.id]
    assert incident.shortfall_bytes == total - budget > alive["requested_bytes"]
    mixed = next(r for r in incident.remedies if r.action == "mixed_precision")
    assert mixed.saving_bytes == alive["activations_bytes"] // 2
    # the staged plan reads the same attribution (it took the last reading's activations, and
    # the request for more: 268,552 bytes where the remedy said 4,096)
    stages = {s.action: s for s in incident.staged_plan.stages}
    assert stages["mixed_precision+checkpointing"].saving_bytes == mixed.saving_bytes
    assert stages["zero1"].saving_bytes == alive["optimizer_state_bytes"] // 2


def test_explain_takes_the_runs_exact_budget_for_an_error_before_any_reading(
    db_path: Path,
) -> None:
    """An ``oom`` event recorded before the sampler's first reading (a loaded machine: its thread
    had not run yet) has no ``last_reading``; ``explain`` then took the budget from the message
    (rounded to 0.01 MiB) and the shortfall was off by the rounding (a flaky failure of the test
    above under ``pytest -n 2``). It takes the run's budget: the shortfall is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    budget = int(account(model).total_bytes * 2.6) + 1234  # not a round number of KiB
    with edo_monitor.watch(model, opt, db=db_path, budget=budget, enforce=True) as mon:
        for _ in range(2):
            try:
                model(torch.randn(32, 64)).pow(2).mean().backward()
                opt.step()
            except torch.OutOfMemoryError:
                pass
            opt.zero_grad()
    with sqlite3.connect(db_path) as conn:  # as recorded before the first reading
        conn.execute(
            "UPDATE events SET data = json_set(data, '$.last_reading', json('null')) "
            "WHERE run_id = ? AND kind = 'oom'",
            (mon.run_id,),
        )
    with History(db_path) as history:
        forward = history.events(mon.run_id, kind="oom")[-1]
        assert forward.data["last_reading"] is None
        incident = explain(history, mon.run_id, event=forward.id).incidents[0]
    alive = forward.data["in_use"]
    total = sum(
        alive[k]
        for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes")
    )
    assert incident.shortfall_bytes == total - budget


@pytest.mark.parametrize("order", ["dense-first", "table-first"])
def test_each_optimizers_step_is_checked(db_path: Path, order: str) -> None:
    """Two optimizers (a dense one for the head, Adam for the table, as recommenders often
    have): the table's Adam makes 6.10 MiB of state in its first step, which the 12 MiB budget
    cannot hold beside the params (3.09 MiB) and the table's gradient (3.05 MiB). Regression:
    only the first optimizer passed was checked, so step 0 went over the budget unseen and the
    error came a step later, at the wrong optimizer. Now it comes at the table optimizer's first
    step, in either order, asking for exactly its state."""
    model, _, ids = setup()
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    table = torch.optim.Adam(model.emb.parameters(), lr=0.1)
    steps = [head, table] if order == "dense-first" else [table, head]
    failed_at = None
    with edo_monitor.watch(model, [head, table], db=db_path, budget=12 * MiB, enforce=True):
        for step in range(2):
            model(ids).pow(2).mean().backward()
            try:
                for opt in steps:
                    opt.step()
                    opt.zero_grad()
            except edo_monitor.BudgetOutOfMemoryError as exc:
                failed_at = (step, opt, str(exc))
                break
    assert failed_at is not None
    step, opt, message = failed_at
    assert (step, opt) == (0, table)
    state = 2 * TABLE_BYTES  # Adam's two moments
    assert message.startswith(f"CPU-budget out of memory. Tried to allocate {state / MiB:.2f} MiB.")


def test_a_module_added_during_the_run_is_parameters_not_activations(db_path: Path) -> None:
    """Regression: the parameters a module added during the run (a larger head) were not among
    the storages the tracker skips, so its weight, which its Linear saves for backward (as a
    view, ``weight.t()``), was counted as saved activations: 2.44 MiB over the budget (an
    out-of-memory error the real bytes did not make), and in the activation profile. A
    parameter, or a view of one, is never an activation now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watching = {"interval_s": 0.01, "profile_interval_s": 0.001, "budget": "7MiB", "enforce": True}
    with edo_monitor.watch(model, db=db_path, **watching) as mon:
        for i in range(20):
            if i == 10:
                model[1] = nn.Linear(32, 20_000)  # 2.44 MiB of weight
                opt.add_param_group({"params": model[1].parameters()})
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            time.sleep(0.01)
    assert mon.status == "finished"
    with sqlite3.connect(db_path) as con:
        (peak,) = con.execute("SELECT max(activations_bytes) FROM samples").fetchone()
    # saved: the input (8 x 32), the first Linear's output (8 x 32), the head's (8 x 20,000)
    assert peak == (8 * 32 + 8 * 32 + 8 * 20_000) * 4
    assert mon.activation_profile.total_bytes == peak  # the profile of a step after it
    # a recording begun before the module was added (its parameters unknown when it began)
    with ActivationRecorder(model) as rec:
        model[1] = nn.Linear(32, 20_000)
        model(torch.randn(8, 32)).pow(2).mean().backward()
    assert rec.profile().total_bytes == peak
