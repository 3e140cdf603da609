"""spill_embedding: the row cache over the disk tier, chosen only when the host is short.

The host's available memory is faked at the probe boundary (``edo_monitor.probes.host.host_memory``
for a plan, ``psutil.virtual_memory`` for a watched run, whose readings go through it); the file,
the training loops and the crash (SIGKILL of a real subprocess) are real.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch
from action_helpers import Recommender
from torch import nn

import edo_monitor
from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder, Plan
from edo_monitor.actions.host_headroom import HOST_MARGIN_BYTES
from edo_monitor.decide.plans import DEFAULT_LOSSLESS_LADDER
from edo_monitor.measure.accounting import account
from edo_monitor.nn import CachedTable
from edo_monitor.store.history import History
from edo_monitor.store.spill_files import SPILL_PREFIX, leftover_spill_files

ITEMS, USERS, DIM = 4000, 50, 16
TABLE_HOST_BYTES = ITEMS * DIM * 8 * 3  # float64 weight + Adam's two moments


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
    return loss


def _first_plan(ctx: ActionContext) -> Plan:
    """What the default lossless ladder plans: its first action that does not refuse."""
    for name in DEFAULT_LOSSLESS_LADDER:
        plan = ACTIONS[name].plan(ctx)
        if isinstance(plan, Plan):
            return plan
    raise AssertionError("every action refused")


def _fake_host(monkeypatch: pytest.MonkeyPatch, available_bytes: int) -> None:
    """The machine's available memory, as psutil reads it (the cgroup's is read as is)."""
    real = psutil.virtual_memory

    monkeypatch.setattr(
        psutil, "virtual_memory", lambda: real()._replace(available=available_bytes)
    )


def test_the_ladder_spills_only_when_the_host_is_short(tmp_path, monkeypatch) -> None:
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, opt, _batches(1)[0])
    in_use = int(account(model, [opt]).total_bytes)
    users, items, _ = _batches(1, seed=9)[0]
    twin = copy.deepcopy(model)  # one recorded forward: the table is read only by itself
    with torch.no_grad(), ActivationRecorder(twin) as rec:
        twin(users, items)

    def ctx(spill_dir=tmp_path):
        return ActionContext(model, [opt], budget_bytes=in_use, in_use_bytes=in_use,
                             rearm_free_fraction=0.25, spill_dir=spill_dir,
                             activation_profile=rec.profile())  # fmt: skip

    import edo_monitor.probes.host as host_probe

    roomy = HOST_MARGIN_BYTES + TABLE_HOST_BYTES  # exactly enough: not short
    monkeypatch.setattr(host_probe, "host_memory", lambda *a, **k: (roomy, 2 * roomy))
    assert _first_plan(ctx()).action == "cache_embedding"
    refusal = ACTIONS["spill_embedding"].plan(ctx())
    # (it read "host memory is needs 18.31 MiB on the host, 22.1 GiB available")
    assert not isinstance(refusal, Plan) and refusal.reason.startswith(
        "items: host memory is enough for a row cache (spill only when short): needs "
    )
    monkeypatch.setattr(host_probe, "host_memory", lambda *a, **k: (roomy - 1, 2 * roomy))
    plan = _first_plan(ctx())
    assert plan.action == "spill_embedding" and plan.target == "items"
    assert plan.details["host_table_bytes"] == TABLE_HOST_BYTES
    assert plan.details["host_available_bytes"] == roomy - 1
    refusal = ACTIONS["cache_embedding"].plan(ctx())
    # two tables refused, each named in the reason: the target is neither (it was "items",
    # and the users table's reason read as the items table's)
    assert refusal.reason.startswith("items: host memory is short") and refusal.target == ""
    assert "; users: a cache of the peak ids" in refusal.reason
    # no spill folder: spill refuses, and the ladder moves on to offload
    assert _first_plan(ctx(None)).action == "offload_embedding"


def _watched(model, opt, db_path, batches, **kw):
    budget = int(account(model).total_bytes * 3)
    policy = edo_monitor.Policy(cooldown_steps=1)
    with edo_monitor.watch(model, db=db_path, budget=budget, policy=policy, interval_s=0.01,
                           **kw) as mon:  # fmt: skip
        for b in batches:
            _step(model, opt, b)
    return mon


@pytest.mark.slow
def test_a_watched_run_spills_trains_exactly_and_removes_its_file(db_path, monkeypatch) -> None:
    torch.manual_seed(0)
    model = Recommender()
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    batches = _batches(60)
    _fake_host(monkeypatch, HOST_MARGIN_BYTES + TABLE_HOST_BYTES // 2)
    spill_dir = Path(f"{db_path}.spill")  # the default: beside the history
    mon = _watched(model, opt, db_path, batches)
    for b in batches:
        _step(twin, twin_opt, b)
    actions = [a["action"] for a in mon.summary().actions]
    assert actions[0] == "spill_embedding" and "cache_embedding" not in actions[:1]
    with History(db_path) as history:
        (event, *_) = history.events("latest", kind="action")
    details = event.data["details"]
    path = Path(details["spill_file"])
    assert path.parent == spill_dir and path.name.startswith(SPILL_PREFIX)
    assert details["spill_file_bytes"] >= TABLE_HOST_BYTES  # the table and both Adam moments
    assert not path.exists() and list(spill_dir.iterdir()) == []  # removed when the run ended
    items = model.items
    full = items.full_weight() if isinstance(items, CachedTable) else items.weight
    err = (full.detach() - twin.items.weight.detach()).abs().max().item()
    assert err <= 1e-12
    assert torch.allclose(model.users.weight, twin.users.weight, rtol=0, atol=1e-12)


CRASH = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import psutil, torch
    import test_spill_action as t
    from edo_monitor.actions.host_headroom import HOST_MARGIN_BYTES
    from edo_monitor.nn import CachedTable
    import edo_monitor
    from edo_monitor.measure.accounting import account
    real = psutil.virtual_memory
    avail = HOST_MARGIN_BYTES + t.TABLE_HOST_BYTES // 2
    psutil.virtual_memory = lambda: real()._replace(available=avail)
    torch.manual_seed(0)
    model = t.Recommender()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    policy = edo_monitor.Policy(cooldown_steps=1)
    budget = int(account(model).total_bytes * 3)
    with edo_monitor.watch(model, db={db!r}, budget=budget, policy=policy, interval_s=0.01):
        for b in t._batches(200):
            t._step(model, opt, b)
            if isinstance(model.items, CachedTable):
                print("spilled", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.slow
def test_a_crash_leaves_one_file_that_the_next_run_and_doctor_report(db_path) -> None:
    code = CRASH.format(tests=str(Path(__file__).parent), db=str(db_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL and "spilled" in proc.stdout, proc.stderr[-2000:]
    spill_dir = Path(f"{db_path}.spill")
    (left,) = leftover_spill_files(spill_dir)
    assert left.stat().st_size >= TABLE_HOST_BYTES
    env = {**os.environ, "COLUMNS": "400"}
    # the installed CLI, whichever interpreter runs the tests (CI's venv is not on PATH)
    cli = [sys.executable, "-m", "edo_monitor.surfaces.cli"]
    doctor = subprocess.run([*cli, "doctor", "--db", str(db_path)], capture_output=True,
                            text=True, timeout=120, env=env)  # fmt: skip
    assert "leftover spill file" in doctor.stdout and left.name in doctor.stdout, doctor.stdout
    model = Recommender()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _watched(model, opt, db_path, _batches(3))  # host not short: nothing spills
    with History(db_path) as history:
        (event,) = history.events("latest", kind="spill_leftover")
    assert event.data["path"] == str(left) and left.exists()  # reported, not deleted
