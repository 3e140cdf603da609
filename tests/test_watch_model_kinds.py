"""watch() of models that are not plain modules: a TorchScript module (no module hooks) and a
``torch.compile``'d model (watched as its own modules, hooks run as Python under Dynamo)."""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.store.history import History


def test_a_torchscript_model_is_watched_without_module_hooks(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: ``watch(torch.jit.script(model))`` failed on entering (``RuntimeError:
    register_forward_pre_hook is not supported on ScriptModules``), so training never started,
    and the sampler then failed at the modules' rows (``get_submodule``). The run is recorded
    with its accounting and saved bytes, without module hooks, and says so once."""
    torch.manual_seed(0)
    scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(scripted.parameters(), lr=0.1)
    with (
        caplog.at_level("WARNING", logger="edo_monitor"),
        edo_monitor.watch(scripted, db=db_path, budget="1MiB", strict=True) as mon,
    ):
        for _ in range(3):
            scripted(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    summary = mon.summary()
    assert summary.status == "finished" and summary.steps == 3
    assert summary.events.get("agent_error", 0) == 0
    assert sum("TorchScript" in r.getMessage() for r in caplog.records) == 1
    with History(db_path) as history:
        modules = {m.module: m.params_bytes for m in history.modules(mon.run_id)}
    assert modules["0"] == (8 * 16 + 16) * 4 and modules["2"] == (16 + 1) * 4


def test_a_compiled_model_is_watched_as_its_modules_and_trains_as_its_twin(db_path: Path) -> None:
    """Regression: ``watch(torch.compile(model))`` failed at the first forward: Dynamo traced
    the agent's module hook into the graph (``AssertionError: ... is already tracked for
    mutation``, the weak table of hooks). The hooks run as Python, the run records the model's
    own module names (not ``_orig_mod.*``) and counts the table's lookups, and a row-cache
    action applied under the budget trains as an unwatched compiled twin."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20_000, 32)
            self.head = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x).mean(1))

    def train(model: nn.Module, watched: bool) -> tuple[list[float], edo_monitor.Monitor | None]:
        torch.manual_seed(0)
        compiled = torch.compile(model, backend="eager")  # Dynamo's tracing, no C compiler
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        losses: list[float] = []
        policy = edo_monitor.Policy(ladder=["cache_embedding"])
        with (
            edo_monitor.watch(compiled, opt, db=db_path, budget="6MiB", policy=policy, strict=True)
            if watched
            else contextlib.nullcontext()
        ) as mon:
            for _ in range(20):
                x = torch.randint(0, 20_000, (64, 8), generator=gen)
                y = torch.randint(0, 10, (64,), generator=gen)
                loss = nn.functional.cross_entropy(compiled(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                time.sleep(0.02)  # readings between steps: the action comes in the run
        return losses, mon

    torch.manual_seed(0)
    model = Model()
    twin = copy.deepcopy(model)
    losses, mon = train(model, watched=True)
    twin_losses, _ = train(twin, watched=False)
    assert mon is not None
    summary = mon.summary()
    assert summary.status == "finished" and summary.steps == 20
    assert summary.events.get("agent_error", 0) == 0
    assert [a["action"] for a in summary.actions][:1] == ["cache_embedding"]
    assert summary.actions[0]["target"] == "emb"
    assert max(abs(a - b) for a, b in zip(losses, twin_losses, strict=True)) < 1e-5
    with History(db_path) as history:
        modules = {m.module for m in history.modules(mon.run_id)}
        (counted,) = history.events(mon.run_id, kind="lookup_frequency")
    assert {"emb", "head"} <= modules and not any("_orig_mod" in m for m in modules)
    assert "emb:" in counted.message and "of 10,240 lookups" in counted.message
