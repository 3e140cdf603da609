"""Issue 14 item 1: out-of-memory recovery inside the step (``Monitor.run_step``), on CPU with the
CPU budget enforced (``enforce=True`` raises ``BudgetOutOfMemoryError``, a
``torch.OutOfMemoryError``, from the saved-tensor hook during forward)."""

from __future__ import annotations

import copy
import weakref
from collections import defaultdict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from watch_helpers import wait_for

import edo_monitor
from edo_monitor.agent.recovery import batch_rows, split_batch
from edo_monitor.errors import ConfigError
from edo_monitor.store.history import History

F32 = 4
FEATURES, HIDDEN, ROWS = 64, 256, 64
# after a first step, the static bytes are params + grads (SGD keeps no state):
# 2 x (64 x 256 + 256 + 256 + 1) floats = 2 x 16,897 x 4 = 135,176 bytes.
# Saved for backward: the input x (a view of the whole batch's [64, 64] storage: 16,384 bytes
# whatever the micro-batch), ReLU's output [rows, 256] (the next Linear's input: the same
# storage), and pow's input [rows, 1].
#   whole batch: 135,176 + 16,384 + 65,536 = 217,096 > 200,000 at ReLU's output: out of memory;
#   32 rows:     135,176 + 16,384 + 32,768 + 128 = 184,456 <= 200,000: fits.
BUDGET = 200_000


class Probe(nn.Module):
    """Identity that keeps a weak reference to what passes through (Linear 1's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.refs.append(weakref.ref(x))
        return x


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), Probe(), nn.ReLU(), nn.Linear(HIDDEN, 1))


def data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, FEATURES, generator=gen), torch.randn(rows, 1, generator=gen)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


def warm_up(mon: Any, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A first step on 8 rows: the step boundary then counts params + grads as static."""
    mon.run_step(lambda mb: mse(model, mb), data(8, seed=99), optimizer=opt)


def test_split_batch_keeps_the_structure_and_splits_on_dim_0() -> None:
    Pair = namedtuple("Pair", "x y")
    x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    parts = split_batch({"p": Pair(x, y), "ids": [y, y], "name": "a"}, 2)
    assert [batch_rows(p) for p in parts] == [2, 2, 1]
    assert isinstance(parts[0]["p"], Pair) and parts[2]["name"] == "a"
    assert torch.equal(parts[1]["p"].x, torch.tensor([[4, 5], [6, 7]]))
    assert torch.equal(parts[2]["ids"][1], torch.tensor([4]))
    with pytest.raises(ConfigError, match=r"different sizes on dim 0: \[3, 5\]"):
        batch_rows((x, torch.zeros(3)))
    with pytest.raises(ConfigError, match="holds no tensor"):
        batch_rows({"a": 1})


def test_an_oom_is_recovered_by_splitting_and_the_update_equals_the_whole_batch(
    db_path: Path,
) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = model[1]
    seen: list[tuple[int, bool]] = []  # (rows, every earlier attempt's activation is dead)

    def step_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append((mb[0].shape[0], all(r() is None for r in probe.refs)))
        return mse(model, mb)

    with edo_monitor.watch(
        model, opt, db=db_path, interval_s=0.05, budget=BUDGET, enforce=True
    ) as mon:
        warm_up(mon, model, opt)
        reference = make_model()  # the model before the step under test
        reference.load_state_dict(model.state_dict())
        batch = data(ROWS, seed=1)
        probe.refs.clear()
        seen.clear()
        loss = mon.run_step(step_fn, batch)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    # the whole batch failed at ReLU (Linear 1's output was alive then); before the retry it is
    # dead; two micro-batches of 32 rows then ran
    assert seen == [(64, True), (32, True), (32, True)]
    assert mon.summary().events["oom"] == 1
    assert mon.summary().events["oom_recovered"] == 1
    with History(db_path) as history:
        (event,) = history.events("latest", kind="oom_recovered")
    assert event.data["batch_rows"] == 64
    assert event.data["micro_batch_rows"] == 32
    assert event.data["micro_batches"] == 2
    assert event.data["failed_attempts"] == 1
    assert event.data["attempted_micro_batch_rows"] == [64, 32]
    # the unsplit step, unwatched: same loss and gradients up to float reassociation
    ref_loss = mse(reference, batch)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for g, p in zip(grads, reference.parameters(), strict=True):
        rel = ((g - p.grad).abs().max() / p.grad.abs().max()).item()
        assert rel < 1e-5, rel


def test_the_split_is_kept_and_a_merge_that_does_not_fit_waits_twice_as_long(
    db_path: Path,
) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows_seen: list[int] = []

    def step_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows_seen.append(mb[0].shape[0])
        return mse(model, mb)

    with edo_monitor.watch(
        model, opt, db=db_path, interval_s=0.05, budget=BUDGET, enforce=True
    ) as mon:
        warm_up(mon, model, opt)
        for step in range(8):
            mon.run_step(step_fn, data(ROWS, seed=step), optimizer=opt, merge_after_steps=2)
    # step 0: 64 fails, 2 x 32; steps 1-2 clean at 32; step 3 tries 64 (fails), 2 x 32; the next
    # try waits 4 clean steps (4-7), so step 7 runs at 32 too
    assert rows_seen == [64, 32, 32] + [32, 32] * 2 + [64, 32, 32] + [32, 32] * 4
    summary = mon.summary()
    assert summary.events["oom_recovered"] == 2 and summary.events["oom"] == 2
    assert summary.steps == 9
    with History(db_path) as history:
        merges = [e.data["merge_attempt"] for e in history.events("latest", kind="oom_recovered")]
    assert merges == [False, True]


@pytest.mark.parametrize(
    ("floor", "attempts"), [(None, [64, 32, 16, 8, 4, 2, 1]), (16, [64, 32, 16])]
)
def test_at_the_floor_it_gives_up_with_the_first_error(
    db_path: Path, floor: int | None, attempts: list[int]
) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows_seen: list[int] = []

    def step_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows_seen.append(mb[0].shape[0])
        return mse(model, mb)

    # 152,000: x's storage fits (135,176 + 16,384 = 151,560), but not even one row of ReLU's
    # output (+ 1,024); the whole batch's attempt asked for 64 x 256 floats (64 KiB), the last
    # one for 256 floats (1 KiB)
    with edo_monitor.watch(model, opt, db=db_path, budget=152_000, enforce=True) as mon:
        # 8 rows: 67,588 + 2,048 + 8,224 in forward, 135,176 + 10,272 at the boundary: fits
        warm_up(mon, model, opt)
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError) as info:
            mon.run_step(step_fn, data(ROWS, seed=1), min_micro_batch_rows=floor)
        assert all(p.grad is None for p in model.parameters())  # partial gradients released
    assert rows_seen == attempts
    assert "the recovery gave up" in "".join(getattr(info.value, "__notes__", []))
    # the first error: it was raised for the whole batch's ReLU output (64 x 256 floats)
    assert "Tried to allocate 64.00 KiB" in str(info.value)
    assert mon.summary().events["oom"] == len(attempts)
    assert mon.summary().events["oom_unrecovered"] == 1


def test_ddp_syncs_only_on_the_last_micro_batch(db_path: Path, tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        inner = make_model()
        model = nn.parallel.DistributedDataParallel(inner)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        syncing: list[bool] = []

        def step_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            syncing.append(model.require_backward_grad_sync)
            x, y = mb
            return (model(x) - y).pow(2).mean()

        with edo_monitor.watch(
            model, opt, db=db_path, interval_s=0.05, budget=BUDGET, enforce=True
        ) as mon:
            mon.run_step(step_fn, data(8, seed=99), optimizer=opt)
            mon.run_step(step_fn, data(ROWS, seed=1), optimizer=opt)
        # warm-up: one batch, synced; then 64 rows (synced: it failed), 32 unsynced, 32 synced
        assert syncing == [True, True, False, True]
        assert mon.summary().events["oom_recovered"] == 1
        # it failed inside the synced backward (at a gradient): the retry reset DDP's reducer,
        # which had raised "Expected to have finished reduction in the prior iteration"
        with History(db_path) as history:
            (oom,) = history.events(mon.run_id, kind="oom")
        assert oom.data["in_use"]["request"] == "grads_bytes"
    finally:
        dist.destroy_process_group()


def test_the_split_merges_back_when_memory_was_freed(db_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rows_seen: list[int] = []

    def step_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows_seen.append(mb[0].shape[0])
        return mse(model, mb)

    # static with momentum: params + grads + momentum = 3 x 67,588 = 202,764; budget 260,000:
    #   64 rows: 202,764 + 16,384 + 65,536 = 284,684 at ReLU: out of memory; 32 rows: 252,044.
    # Without momentum state: 135,176 + 16,384 + 65,536 + 256 = 217,352: 64 rows fit again.
    with edo_monitor.watch(
        model, opt, db=db_path, interval_s=0.05, budget=260_000, enforce=True
    ) as mon:
        warm_up(mon, model, opt)  # 8 rows; boundary 202,764 + 10,272 fits
        rows_seen.clear()
        run = lambda seed: mon.run_step(  # noqa: E731
            step_fn, data(ROWS, seed=seed), optimizer=opt, merge_after_steps=1
        )
        run(1)  # recovered: 2 x 32
        for group in opt.param_groups:  # the momentum state goes away (freed by the user)
            group["momentum"] = 0.0
        opt.state.clear()
        run(2)  # 2 x 32 (one clean step; this step's boundary measures 135,176 static)
        run(3)  # merge tried: 64 rows fit
        run(4)  # whole batch
    assert rows_seen == [64, 32, 32, 32, 32, 64, 64]
    summary = mon.summary()
    assert summary.events["oom_recovered"] == 1
    assert summary.events["micro_batches_merged"] == 1
    with History(db_path) as history:
        (merged,) = history.events("latest", kind="micro_batches_merged")
    assert merged.data == {"batch_rows": 64, "micro_batch_rows": 64}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_empty_batch_is_run_once_as_the_users_own_loop_would(
    db_path: Path, reduction: str
) -> None:
    """It was a ZeroDivisionError (the loss scaled by 0 rows / 0 rows) and the run failed."""
    model = make_model()
    reference = make_model()  # the same initial weights: the user's own loop on the batch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = data(0, seed=1)
    rows_seen: list[int] = []

    def loss_of(m: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        err = (m(mb[0]) - mb[1]).pow(2)
        return err.mean() if reduction == "mean" else err.sum()

    def step_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows_seen.append(mb[0].shape[0])
        return loss_of(model, mb)

    with edo_monitor.watch(model, opt, db=db_path, interval_s=0.05) as mon:
        loss = mon.run_step(step_fn, batch, reduction=reduction)
        grads = [p.grad.clone() for p in model.parameters()]
        mon.run_step(step_fn, batch, optimizer=opt, reduction=reduction)
    ref_loss = loss_of(reference, batch)
    ref_loss.backward()
    assert rows_seen == [0, 0]  # called once per step, on the batch as it is
    assert (loss.isnan().item(), ref_loss.isnan().item()) == ((reduction == "mean"),) * 2
    for g, p in zip(grads, reference.parameters(), strict=True):
        assert torch.equal(g, p.grad)
    assert mon.status == "finished" and mon.summary().steps == 1  # the optimizer's step


def test_misuse_is_a_config_error_naming_the_argument(db_path: Path) -> None:
    """Raw errors before: ``'int' object is not callable``, ``'str' object has no attribute
    'step'``, ``'NoneType' object has no attribute 'backward'``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = data(8, seed=1)
    calls: list[int] = []

    def returning(value: Any) -> Any:
        def step_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> Any:
            calls.append(mb[0].shape[0])
            return value(mb) if callable(value) else value

        return step_fn

    before = [p.detach().clone() for p in model.parameters()]
    with edo_monitor.watch(model, opt, db=db_path, interval_s=0.05) as mon:
        with pytest.raises(ConfigError, match=r"^step_fn=5 is not callable; expected a function"):
            mon.run_step(5, batch, optimizer=opt)  # type: ignore[arg-type]
        with pytest.raises(
            ConfigError, match=r"^optimizer='sgd' is not a torch.optim.Optimizer \(or None"
        ):
            mon.run_step(returning(lambda mb: mse(model, mb)), batch, optimizer="sgd")  # type: ignore[arg-type]
        assert calls == []  # refused before the step ran
        for value, said in [
            (None, "step_fn returned None (NoneType)"),
            (1.5, "step_fn returned 1.5 (float)"),
            (lambda mb: model(mb[0]), "step_fn returned a tensor of shape [8, 1]"),
        ]:
            with pytest.raises(ConfigError) as err:
                mon.run_step(returning(value), batch, optimizer=opt)
            assert str(err.value).startswith(said), str(err.value)
            assert "expected the micro-batch's loss, a scalar tensor" in str(err.value)
    assert calls == [8, 8, 8]
    for b, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(b, p.detach())  # no optimizer step ran


def test_a_failed_attempt_leaves_the_batch_norm_statistics_as_they_were(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: each failed attempt's forward updated BatchNorm's running statistics, so one
    recovered step counted 6 batches (2 failed attempts + 4 micro-batches) and the running mean
    was 4x a plain step's. Now they are put back before the retry: the statistics are those of
    the micro-batches that ran, and a warning says the split changes the batch statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 1))
    twin = copy.deepcopy(model[:2])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with edo_monitor.watch(model, opt, db=db_path, budget=300_000, enforce=True) as mon:
        mon.run_step(lambda mb: (model(mb[0]) - mb[1]).pow(2).mean(), (x, y), optimizer=opt)
    with History(db_path) as history:
        (recovered,) = history.events(mon.run_id, kind="oom_recovered")
    assert recovered.data["failed_attempts"] >= 1
    micro, n = recovered.data["micro_batch_rows"], recovered.data["micro_batches"]
    for part in x.split(micro):  # the micro-batches that ran, and only them
        twin(part)
    bn, bn_twin = model[1], twin[1]
    assert bn.num_batches_tracked.item() == bn_twin.num_batches_tracked.item() == n
    assert torch.equal(bn.running_mean, bn_twin.running_mean)
    assert torch.equal(bn.running_var, bn_twin.running_var)
    assert "batch-norm layers in training mode" in caplog.text


@pytest.mark.parametrize("given", ["watch", "run_step"])
def test_a_retry_starts_every_trained_gradient_from_zero(db_path: Path, given: str) -> None:
    """Regression: a failed attempt's partial gradients were cleared for the model's parameters
    only: a parameter the optimizer steps outside the watched model (a loss temperature) kept
    the failed backward's gradient, and the retry added the whole batch's to it (2.30 for
    1.15). The optimizer given to ``watch()`` or to ``run_step`` names them."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    temp = nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([*model.parameters(), temp], lr=1.0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    want = torch.autograd.grad((model(x) * temp - y).pow(2).mean(), temp)[0]
    failing = [True]

    def fail_once(grad: torch.Tensor) -> torch.Tensor:  # inside the backward, after temp's
        if failing:
            failing.clear()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return grad

    model.weight.register_hook(fail_once)
    watched = (opt,) if given == "watch" else ()
    with edo_monitor.watch(model, *watched, db=db_path) as mon:
        loss_fn = lambda mb: (model(mb[0]) * temp - mb[1]).pow(2).mean()  # noqa: E731
        mon.run_step(loss_fn, (x, y), optimizer=None if given == "watch" else opt)
        if given == "watch":  # the caller steps
            opt.step()
    assert torch.allclose(temp.detach(), 1 - want, rtol=1e-6), (temp, 1 - want)
    assert mon.summary().events == {"oom": 1, "oom_recovered": 1}


def test_a_batch_of_a_mapping_type_with_other_arguments_is_split() -> None:
    """Regression: a micro-batch was rebuilt as ``type(batch)(dict)``, which ``defaultdict``
    (its factory first) refuses: the recovery itself raised ``TypeError`` at the first
    out-of-memory error. Rebuilt as a copy, its factory kept; a list subclass likewise."""

    class Rows(list):
        def __init__(self, name: str, items: list) -> None:
            super().__init__(items)
            self.name = name

    x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    batch = defaultdict(list, x=x, y=Rows("labels", [y]))
    parts = split_batch(batch, 2)
    assert [batch_rows(p) for p in parts] == [2, 2, 1]
    assert all(type(p) is defaultdict and p.default_factory is list for p in parts)
    assert torch.equal(parts[1]["x"], x[2:4]) and torch.equal(parts[2]["y"][0], y[4:])
    assert type(parts[0]["y"]) is Rows and parts[0]["y"].name == "labels"


def test_an_action_applied_before_a_retry_is_not_judged_without_gradients(db_path: Path) -> None:
    """Regression: between a failed attempt and its retry no gradient is alive, so the row cache
    applied there measured its saving without the table's gradient (exactly that much under the
    estimate, below half of it): it was recorded ``action_ineffective``, which also dropped the
    cooldown, and the same step decided ``grow_cache`` and grew the new cache back. Such a
    measurement is recorded as what it is and not judged: no ``action_ineffective``, no
    ``grow_cache``."""
    torch.manual_seed(0)
    rows, dim = 20_000, 32
    model = nn.Sequential(
        nn.Embedding(rows, dim), nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def loss_fn(mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (model(mb[0]) - mb[1]).pow(2).mean()

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, rows, (n,)), torch.randn(n, 1)

    policy = edo_monitor.Policy()
    with edo_monitor.watch(
        model, opt, db=db_path, budget="12MiB", enforce=True, interval_s=0.02, policy=policy
    ) as mon:
        mon.run_step(loss_fn, batch(16), optimizer=opt)  # Adam's state: free below 20 %
        wait_for(lambda: policy.pending is not None, "a pending decision")
        mon.run_step(loss_fn, batch(2048), optimizer=opt)  # out of memory: applied, retried
    with History(db_path) as history:
        kinds = [e.kind for e in history.events("latest")]
        (action,) = history.events("latest", kind="action")
    assert action.data["action"] == "cache_embedding"
    assert action.data["details"]["measured_without_gradients"] is True
    grad_bytes = rows * dim * F32  # the table's gradient, in the estimate and not measured
    assert action.data["estimated_saving_bytes"] - action.data["saved_bytes"] == grad_bytes
    assert "action_ineffective" not in kinds and "oom_recovered" in kinds
