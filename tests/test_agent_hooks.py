"""The agent's hooks on real CPU training loops: saved-for-backward bytes alive at once, hooks
that never fail training, step bookkeeping that survives exceptions, and no CUDA initialisation.

Expected byte counts are derived by hand from the shapes (float32 = 4 bytes, int64 = 8 bytes)."""

from __future__ import annotations

import sqlite3
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import edo_monitor
from edo_monitor.actions.base import Action, ActionContext
from edo_monitor.actions.registry import ACTIONS
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.store.history import History

F32 = 4


def samples(db: Path) -> list[tuple[int, int | None]]:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT step, activations_bytes FROM samples ORDER BY id").fetchall()
    finally:
        con.close()


def wait_for(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.005)


# ----------------------------------------------------------------------------- the tracker
def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))


# batch 128: Linear(64, 256) saves its input x [128, 64]; ReLU saves its output [128, 256] (the
# next Linear's input, the same storage); pow(2) saves its input [128, 1]. Weights are skipped.
SMALL_STEP_BYTES = 128 * 64 * F32 + 128 * 256 * F32 + 128 * 1 * F32  # 164,352


def small_loss(model: nn.Module, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(128, 64, generator=gen)
    return model(x).pow(2).mean()


def test_bytes_alive_now_fall_when_backward_frees_the_graph() -> None:
    model = small_mlp()
    gen = torch.Generator().manual_seed(0)
    with ActivationTracker([*model.parameters()]) as tracker:
        loss = small_loss(model, gen)
        assert tracker.live_bytes == SMALL_STEP_BYTES
        loss.backward()
        assert tracker.live_bytes == 0
        assert tracker.take_peak() == SMALL_STEP_BYTES  # the peak since the start
        assert tracker.take_peak() == 0  # nothing alive since the last reading
        assert tracker.end_step() == SMALL_STEP_BYTES


def test_freeing_the_graph_runs_no_python_code_of_the_tracker() -> None:
    """Ctrl-C during backward(): Python runs a pending signal handler at the first Python code it
    executes, and a KeyboardInterrupt raised inside a ``__del__`` is printed and ignored. The
    holders' release used to be a ``__del__``, the first Python code after backward() freed the
    graph, so Ctrl-C was often lost and training went on. Inside backward() only the unpack hook
    (whose exceptions propagate) may run Python code of the tracker; the release runs none."""
    model = small_mlp()
    gen = torch.Generator().manual_seed(0)
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (
            event == "call"
            and frame.f_code.co_filename == ActivationTracker.pack.__code__.co_filename
        ):
            called.append(frame.f_code.co_name)

    with ActivationTracker([*model.parameters()]) as tracker:
        loss = small_loss(model, gen)
        sys.setprofile(profile)
        try:
            loss.backward()
            del loss  # the graph, and every holder with it
        finally:
            sys.setprofile(None)
        assert set(called) == {"unpack"}
        assert tracker.live_bytes == 0  # released all the same


def test_retained_graphs_stay_counted_until_dropped() -> None:
    model = small_mlp()
    gen = torch.Generator().manual_seed(0)
    with ActivationTracker([*model.parameters()]) as tracker:
        total = torch.zeros(())
        for step in range(1, 6):
            loss = small_loss(model, gen)
            loss.backward(retain_graph=True)
            total = total + loss  # keeps every step's graph (and its saved tensors) alive
            assert tracker.live_bytes == step * SMALL_STEP_BYTES
            assert tracker.end_step() == step * SMALL_STEP_BYTES
        del total, loss
        assert tracker.live_bytes == 0


def test_a_graph_dropped_without_backward_is_freed() -> None:
    """Regression: the pack hook kept the saved *output* with its grad_fn, a reference cycle
    through autograd's C++ graph that the garbage collector cannot see: the graph leaked."""
    x = torch.randn(1000, 100, requires_grad=True)
    with ActivationTracker() as tracker:
        out = x.sigmoid()  # sigmoid saves its own output
        assert tracker.live_bytes == 1000 * 100 * F32
        alive = weakref.ref(out)
        del out
        assert alive() is None
        assert tracker.live_bytes == 0


def test_views_of_one_storage_count_once_while_any_is_saved() -> None:
    x = torch.randn(8, 100, requires_grad=True)
    with ActivationTracker() as tracker:
        z = x.sigmoid()  # saves z: 8 x 100 floats
        a = z[:4].exp()  # exp saves its output: a new 4 x 100 storage
        b = z[4:] * 2.0  # saves nothing
        first = (z[:4] * z[4:]).sum()  # saves two views of z's storage
        assert tracker.live_bytes == 8 * 100 * F32 + 4 * 100 * F32
        del a, b
        assert tracker.live_bytes == 8 * 100 * F32
        first.backward(retain_graph=True)
        del first
        assert tracker.live_bytes == 8 * 100 * F32  # z still saved by its own sigmoid node
        del z
        assert tracker.live_bytes == 0


# ----------------------------------------------------------------------------- item 1
class SparseGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adj, self.lin(x))


def ring_adjacency() -> torch.Tensor:
    """50 x 50 COO with 100 distinct non-zeros: (i, i) and (i, i+1 mod 50)."""
    rows = [i for i in range(50) for _ in range(2)]
    cols = [(i + d) % 50 for i in range(50) for d in range(2)]
    indices = torch.tensor([rows, cols])
    return torch.sparse_coo_tensor(indices, torch.ones(100), (50, 50), check_invariants=True)


# x [50, 16] saved by the Linear; adj saved by sparse.mm: 2 x 100 int64 indices + 100 float
# values; the product [50, 8] saved by pow(2)
SPARSE_STEP_BYTES = 50 * 16 * F32 + (2 * 100 * 8 + 100 * F32) + 50 * 8 * F32  # 6,800


def test_sparse_saved_tensor_is_sized_as_indices_plus_values(db_path: Path) -> None:
    model = SparseGraph()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    adj = ring_adjacency()
    gen = torch.Generator().manual_seed(0)
    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        for _ in range(5):
            model(torch.randn(50, 16, generator=gen), adj).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    summary = mon.summary()
    assert summary.status == "finished" and summary.steps == 5
    assert summary.agent_errors == {} and "agent_error" not in summary.events
    assert summary.peak_activations_bytes == SPARSE_STEP_BYTES


class Wrapped(torch.Tensor):
    """A wrapper tensor subclass (like DTensor or a quantised tensor): it has no readable storage
    of its own, so the tracker cannot size it."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t.elem if isinstance(t, Wrapped) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_a_failing_hook_is_counted_recorded_once_and_training_goes_on(db_path: Path) -> None:
    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        gen = torch.Generator().manual_seed(0)
        for _ in range(6):
            model(Wrapped(torch.randn(4, 3, generator=gen))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    twin, twin_opt = make()
    train(twin, twin_opt)
    model, opt = make()
    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        train(model, opt)
    summary = mon.summary()
    assert summary.status == "finished" and summary.steps == 6
    # one input per step saved for backward: 6 failures of the saved-tensor hook; in the one
    # profiled step the recorder's forward pre-hook and pack hook failed on it too
    assert summary.agent_errors == {
        "saved-tensor hook:RuntimeError": 6,
        "activation profile hook:RuntimeError": 2,
    }
    assert summary.events["agent_error"] == 2  # one event per kind
    with History(db_path) as history:
        wheres = sorted(e.data["where"] for e in history.events("latest", kind="agent_error"))
    assert wheres == ["activation profile hook", "saved-tensor hook"]
    # the training itself is exactly that of an unwatched twin
    pairs = zip(model.parameters(), twin.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


# ----------------------------------------------------------------------------- item 2
class RaisesAtApply(Action):
    """An action whose plan works on the sampler thread and raises at apply time."""

    name = "test_raises_at_apply"
    lossy = False

    def __init__(self) -> None:
        self.apply_time_plans = 0

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        if threading.current_thread() is threading.main_thread():  # the training thread
            self.apply_time_plans += 1
            raise RuntimeError("plan broke at apply time")
        return Plan(self.name, "0", 1, "test")


def test_an_action_raising_at_apply_fails_once_and_every_step_counts(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    action = RaisesAtApply()
    monkeypatch.setitem(ACTIONS, action.name, action)  # registered like any action
    policy = edo_monitor.Policy(
        min_free_fraction=0.5, rearm_free_fraction=0.6, cooldown_steps=0, ladder=[action.name]
    )
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # static: params + grads = 2 x (64*256 + 256 + 256 + 1) floats = 135,176 bytes; one step's
    # saved bytes 164,352: 299,528 fit, two steps' (463,880) would not
    budget = 380_000
    gen = torch.Generator().manual_seed(0)
    steps = 0
    with edo_monitor.watch(
        model, db=db_path, interval_s=0.01, budget=budget, enforce=True, policy=policy
    ) as mon:

        def step() -> None:
            nonlocal steps
            small_loss(model, gen).backward()
            opt.step()
            opt.zero_grad()
            steps += 1

        while action.apply_time_plans == 0 and steps < 10_000:
            step()
        for _ in range(40):
            step()
        apply_time_plans = action.apply_time_plans  # (the last sample, after the block, plans)
    summary = mon.summary()
    assert summary.status == "finished"
    assert summary.steps == steps
    assert apply_time_plans == 1  # failed once, never retried in 40 steps
    assert summary.events["decision"] == 1
    assert summary.events["action_failed"] == 1
    assert "oom" not in summary.events  # no two steps' activations added up
    with History(db_path) as history:
        (failed,) = history.events("latest", kind="action_failed")
    assert failed.data["status"] == "failed"
    assert failed.data["reason"] == "RuntimeError: plan broke at apply time"


def test_a_budget_error_at_the_step_boundary_still_counts_the_step(db_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(100, 100)  # 10,100 floats: 40,400 bytes
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # forward: params 40,400 + the input 8 x 100 floats (3,200) fit in 100,000, and so do params
    # + grads in the backward; at the boundary params + grads + Adam's two new states
    # (4 x 40,400) do not: the boundary raises, after the optimizer step has run (it is a step)
    with edo_monitor.watch(model, db=db_path, budget=100_000, enforce=True) as mon:
        model(torch.randn(8, 100)).sum().backward()
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError):
            opt.step()
        assert mon.steps == 1
        assert opt.state[model.weight]["step"].item() == 1.0
    assert mon.summary().steps == 1
    assert mon.summary().events["oom"] == 1


def test_budget_error_messages_state_the_accounted_bytes_and_what_is_free(db_path: Path) -> None:
    """The message's numbers, by hand: Linear(10, 10) holds 110 floats (440 bytes); SGD with
    momentum adds a gradient and a momentum buffer of the same size at the first step."""
    torch.manual_seed(0)
    model = nn.Linear(10, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with edo_monitor.watch(model, db=db_path, budget=1_000, enforce=True):
        # forward saves the input [1, 10] (40 bytes): 440 + 40 fit, and the backward's gradients
        # with it (920); at the boundary params + grads + momentum (1,320) do not (the graph and
        # its saved input are freed by then). The request is the momentum (440): before it 880
        # bytes were accounted, 120 free (it read "880 bytes ... 480 accounted": the step's
        # saved bytes added to the gradients made after them)
        model(torch.randn(1, 10)).sum().backward()
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError) as boundary:
            opt.step()
        assert str(boundary.value) == (
            "CPU-budget out of memory. Tried to allocate 440 bytes. Budget of 1000 bytes of which "
            "120 bytes is free. 880 bytes is accounted to the watched model."
        )
        # caught, training goes on with the gradients kept (zeroed in place): 1,320 bytes are
        # accounted before the next input is saved, more than the budget: 0 free (the message
        # used to stretch the request to the excess and say "1000 bytes is accounted")
        opt.zero_grad(set_to_none=False)
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError) as forward:
            model(torch.randn(1, 10))
        assert str(forward.value) == (
            "CPU-budget out of memory. Tried to allocate 40 bytes. Budget of 1000 bytes of which "
            "0 bytes is free. 1.29 KiB is accounted to the watched model."  # 1,320 bytes
        )


def test_an_enforced_budget_below_the_model_is_refused_on_entering(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """440 bytes of parameters cannot fit in 400: with enforce=True the first forward would fail,
    before any action could move memory, so entering refuses, naming both numbers."""
    model = nn.Linear(10, 10)
    with (
        pytest.raises(edo_monitor.ConfigError) as caught,
        edo_monitor.watch(model, db=db_path, budget=400, enforce=True),
    ):
        pytest.fail("entered")  # pragma: no cover
    message = str(caught.value)
    assert "budget=400 bytes" in message
    assert "already holds 440 bytes" in message and "params 440" in message
    # no optimizer given: its state is not counted yet, and the message says so (it read as
    # what the model holds, 2.5 MB of Adam state left out)
    assert "optimizer not given to watch() is not counted until its first step" in message
    opt = torch.optim.Adam(model.parameters())
    with (
        pytest.raises(edo_monitor.ConfigError) as caught,
        edo_monitor.watch(model, opt, db=db_path, budget=400, enforce=True),
    ):
        pytest.fail("entered")  # pragma: no cover
    assert "not counted" not in str(caught.value)
    # not enforced, the run goes on over budget (a policy may offload tables): a warning only
    with (
        caplog.at_level("WARNING", logger="edo_monitor.agent.monitor"),
        edo_monitor.watch(model, db=db_path, budget=400) as mon,
    ):
        model(torch.randn(1, 10)).sum().backward()
        mon.step()
    assert mon.summary().status == "finished"
    assert any("budget=400 bytes" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- item 6
MICRO_BATCH = 512
# Linear(256, 1024) saves its input [512, 256]; each ReLU saves its output [512, 1024] (the next
# Linear's input, same storage); pow(2) saves the difference [512, 1]
MICRO_BATCH_BYTES = MICRO_BATCH * (256 + 1024 + 1024 + 1) * F32  # 4,720,640 (4.50 MiB)


def test_gradient_accumulation_reports_the_peak_alive_at_once(db_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    # params + grads = 2 x 1,313,793 floats = 10.02 MiB; + 4.50 MiB fits in 20 MiB, while the
    # sum of four micro-batches (18.01 MiB) would not
    with edo_monitor.watch(model, db=db_path, interval_s=0.02, budget="20MiB", enforce=True) as mon:
        for _ in range(3):
            for _ in range(4):
                x = torch.randn(MICRO_BATCH, 256, generator=gen)
                y = torch.randn(MICRO_BATCH, 1, generator=gen)
                ((model(x) - y).pow(2).mean() / 4).backward()
            opt.step()
            opt.zero_grad()
    summary = mon.summary()
    assert summary.steps == 3 and "oom" not in summary.events
    assert summary.peak_activations_bytes == MICRO_BATCH_BYTES
    assert max(a for _, a in samples(db_path)) == MICRO_BATCH_BYTES


# ----------------------------------------------------------------------------- item 7
def test_saved_tensors_kept_across_steps_show_as_growth(db_path: Path) -> None:
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
        wait_for(lambda: mon.summary().samples >= 1)
        total = torch.zeros(())
        for step in range(1, 21):
            loss = small_loss(model, gen)
            loss.backward(retain_graph=True)
            total = total + loss  # the classic leak: every step's graph stays alive
            opt.step()
            opt.zero_grad()
            if step == 10:
                seen = mon.summary().samples
                wait_for(lambda seen=seen: mon.summary().samples > seen)
    series = [a for _, a in samples(db_path)]
    assert series[0] == 0
    assert series == sorted(series)  # it only grows
    assert any(10 * SMALL_STEP_BYTES <= a < 20 * SMALL_STEP_BYTES for a in series)
    assert series[-1] == 20 * SMALL_STEP_BYTES  # 3,287,040: twenty steps' saved tensors
    del total, loss


# ----------------------------------------------------------------------------- item 13
def test_watch_on_a_cpu_model_never_asks_cuda(db_path: Path) -> None:
    """``torch.cuda.is_available()`` may initialise the driver (a later fork then breaks);
    ``watch()`` of a CPU model (or of the process) must not call it, nor initialise CUDA."""
    calls: list[str] = []
    watched = {"is_available", "_lazy_init", "init", "current_device", "device_count"}

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_name in watched and "torch/cuda" in code.co_filename:
            calls.append(code.co_name)

    initialised = torch.cuda.is_initialized()
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with edo_monitor.watch(model, db=db_path, interval_s=0.01) as mon:
            for _ in range(3):
                small_loss(model, gen).backward()
                opt.step()
                opt.zero_grad()
        with edo_monitor.watch(db=db_path, interval_s=0.01) as process_only:
            process_only.step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert mon.device_kind == "cpu-budget" and process_only.device_kind == "cpu-budget"
    assert calls == []
    assert torch.cuda.is_initialized() == initialised


@pytest.mark.parametrize("steps_before", [0, 3], ids=["profiled-step", "tracked-step"])
def test_a_saved_tensor_changed_in_place_fails_the_backward_as_without_watch(
    db_path: Path, steps_before: int
) -> None:
    """Regression: with saved-tensor hooks installed autograd skips its version check, so under
    ``watch()`` ``sigmoid(...).mul_(2)`` trained on wrong gradients (-2.71 for 2.33) where
    PyTorch raises. The hooks check the version themselves (the first step is also profiled)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with edo_monitor.watch(lin, opt, db=db_path):
        for _ in range(steps_before):
            lin(x).sigmoid().sum().backward()
            opt.step()
            opt.zero_grad()
        y = lin(x).sigmoid()
        y.mul_(2)  # changes the output sigmoid saved for its backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_the_activation_profile_alone_keeps_the_in_place_check() -> None:
    from edo_monitor.actions.activation_profile import ActivationRecorder

    lin = nn.Linear(4, 4)
    with ActivationRecorder(lin):
        y = lin(torch.randn(8, 4)).sigmoid()
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("enforce", [False, True], ids=["watched", "enforced"])
def test_a_lazy_module_is_watched_from_its_first_forward(db_path: Path, enforce: bool) -> None:
    """Regression: ``watch()`` of a model with ``nn.LazyLinear`` failed on entering
    (``ValueError: Attempted to use an uninitialized parameter``). Its parameters count 0 bytes
    until the first forward makes them; from the next step on they are parameters, not saved
    activations, and with ``enforce=True`` their gradients are checked."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 8), nn.LazyLinear(1))
    opt: torch.optim.Optimizer | None = None
    with edo_monitor.watch(model, db=db_path, budget="64MiB", enforce=enforce, strict=True) as mon:
        assert mon.accounting.params_bytes == 100 * 8 * 4
        for _ in range(3):
            loss = model(torch.randint(0, 100, (32,))).sum()
            if opt is None:  # the parameters exist now
                opt = torch.optim.Adam(model.parameters(), lr=0.01)
            loss.backward()
            opt.step()
            opt.zero_grad()
        # the table's output (32 x 8 floats) and the ids (32 int64), not the Linear's weight
        assert mon._tracker.last_step_bytes == 32 * 8 * 4 + 32 * 8
        if enforce:
            grads = mon._safe_point.grads_alive
            assert grads is not None and len(grads._handles) == 3  # table, weight, bias
    summary = mon.summary()
    assert summary.status == "finished" and "agent_error" not in summary.events
    params = (100 * 8 + 8 + 1) * 4
    with History(db_path) as history:
        last = list(history.samples(mon.run_id).rows())[-1]
    assert (last["params_bytes"], last["grads_bytes"]) == (params, params)


def test_a_run_that_ends_before_the_samplers_first_tick_reads_its_gradients(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (a CI flake of the lazy-module test): when every step ended before the
    sampler thread's first reading (a thread starved under load), no boundary had taken the
    accounting with gradients alive, and the run's last reading said 0 bytes of gradients.
    The first boundary accounts now, whatever the sampler did."""
    from edo_monitor.agent.sampler import Sampler

    real = Sampler.sample_once
    trained = threading.Event()

    def late(self: Sampler) -> Any:  # the first tick comes after the training
        trained.wait(10)
        return real(self)

    monkeypatch.setattr(Sampler, "sample_once", late)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with edo_monitor.watch(model, db=db_path, budget="64MiB", strict=True) as mon:
        for _ in range(3):
            model(torch.randint(0, 100, (32,))).sum().backward()
            opt.step()
            opt.zero_grad()
        trained.set()
    params = (100 * 8 + 8 + 1) * 4
    with History(db_path) as history:
        last = list(history.samples(mon.run_id).rows())[-1]
    assert (last["params_bytes"], last["grads_bytes"]) == (params, params)
