"""Where the memory goes, on real CPU training loops: activations, module x category, OOMs,
allocator readings from recorded stats and snapshots."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.probes.cuda import AllocatorProbe
from edo_monitor.store.history import History


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(2_000, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, batch: int = 16) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 2_000, (batch,), generator=gen)
        model(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_activation_tracker_counts_each_storage_once_and_skips_parameters() -> None:
    lin = nn.Linear(100, 100, bias=False)
    x = torch.randn(8, 100, requires_grad=True)
    with ActivationTracker(lin.parameters()) as tracker:
        y = lin(x)  # saves x (its input) and the weight (a parameter: skipped)
        z = y.sigmoid()  # saves its output: one 8 x 100 float storage
        w = z[:4] * z[4:]  # saves two views of z's storage: counted once
        w.sum().backward()
        assert tracker.live_bytes == 0  # backward freed the graph and its saved tensors
    step_bytes = tracker.end_step()
    assert step_bytes == 8 * 100 * 4 + 8 * 100 * 4  # x, z: the step's peak alive at once
    assert tracker.last_step_bytes == step_bytes and tracker.step_peak_bytes == 0


def test_activations_recorded_per_step_and_can_be_turned_off(db_path: Path) -> None:
    model = TwoTower()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=db_path, interval_s=0.02) as mon:
        train(model, opt, 5, batch=64)
    with_tracking = mon.summary().peak_activations_bytes
    # one step saves the ids [64] (int64, for the table's backward), the table output [64, 32]
    # (Linear's input), the ReLU output [64, 64] (ReLU's and the next Linear's, one storage) and
    # the MLP output [64, 8] (pow's input); weights are parameters, not activations
    assert with_tracking == 64 * 8 + 64 * 32 * 4 + 64 * 64 * 4 + 64 * 8 * 4 == 27_136
    model2 = TwoTower()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    with edo_monitor.watch(model2, db=db_path, interval_s=0.02, track_activations=False) as mon2:
        train(model2, opt2, 5, batch=64)
    assert mon2.summary().peak_activations_bytes is None


def test_breakdown_and_history_modules_put_the_table_first(db_path: Path) -> None:
    model = TwoTower()
    opt = torch.optim.Adam(model.parameters())
    with edo_monitor.watch(model, db=db_path, interval_s=0.01, profile_interval_s=0.01) as mon:
        train(model, opt, 20, batch=32)
    rows = {r["module"]: r for r in mon.breakdown()}
    table = rows["table"]
    assert table["kind"] == "Embedding"
    assert table["params_bytes"] == 2_000 * 32 * 4
    assert table["grads_bytes"] == 2_000 * 32 * 4
    assert table["optimizer_state_bytes"] == 2 * 2_000 * 32 * 4 + 4
    # the embedding saves only its indices, which are its own input: nothing is the table's;
    # the ReLU output [32, 64] (saved by ReLU and by mlp.2) belongs to the mlp block
    assert table["activations_bytes"] == 0
    assert rows["mlp"]["activations_bytes"] == 32 * 64 * 4
    lin = rows["mlp.0"]
    assert lin["params_bytes"] == (32 * 64 + 64) * 4
    assert lin["optimizer_state_bytes"] == 2 * (32 * 64 + 64) * 4 + 2 * 4
    assert mon.breakdown()[0]["module"] == "table"
    assert "other" not in rows  # CPU: no allocator, no "other"
    with History(db_path) as history:
        modules = history.modules(mon.run_id)
    top = max(modules, key=lambda m: m.total_bytes)
    assert top.module == "table"
    assert (top.params_bytes, top.grads_bytes) == (256_000, 256_000)
    assert top.optimizer_state_bytes == 512_004


class Frozen(nn.Module):
    """An encoder that saves for backward until frozen (then run under ``no_grad``)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 16))
        self.head = nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.ones(16))
        self.frozen = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen:
            with torch.no_grad():
                h = self.enc(x)
            return self.head(h)
        return self.head(self.enc(x) * self.scale)


def test_a_module_that_stops_saving_reads_zero_activations(db_path: Path) -> None:
    """Regression: a module missing from the latest profile (frozen and run under ``no_grad``)
    kept its last activations for the rest of the run, in ``module_stats``, ``breakdown()`` and
    ``show --modules``."""
    model = Frozen()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 16)
    with edo_monitor.watch(model, db=db_path, interval_s=0.01, profile_interval_s=1e-6) as mon:
        for step in range(6):
            if step == 3:
                model.frozen = True
                for p in [*model.enc.parameters(), model.scale]:
                    p.requires_grad_(False)
            if step == 2:
                before = {r["module"]: r["activations_bytes"] for r in mon.breakdown()}
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        after = {r["module"]: r["activations_bytes"] for r in mon.breakdown()}
    # while training: Tanh's output [64, 128] (Tanh's and enc.2's), the enc output (mul's)
    assert before["enc"] == 64 * 128 * 4
    assert before["<model>"] > 0
    # frozen: only head's input, saved inside the model's forward (not the head's: its input)
    assert after["enc"] == 0 and after["<model>"] == 64 * 16 * 4
    with History(db_path) as history:
        latest = {m.module: m.activations_bytes for m in history.modules(mon.run_id)}
    assert latest["enc"] == 0 and latest["<model>"] == 64 * 16 * 4


def test_oom_inside_watch_is_recorded_and_reraised_unchanged(db_path: Path) -> None:
    message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
        "of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB "
        "memory in use. Of the allocated memory 76.50 GiB is allocated by PyTorch, and 1.07 GiB "
        "is reserved by PyTorch but unallocated."
    )
    error = torch.OutOfMemoryError(message)
    model = TwoTower()
    with pytest.raises(torch.OutOfMemoryError) as caught, edo_monitor.watch(model, db=db_path):
        raise error
    assert caught.value is error
    with History(db_path) as history:
        (oom,) = history.events("latest", kind="oom")
        run = history.run("latest")
    assert run.status == "failed"
    parsed = oom.data["parsed"]
    assert parsed["requested_bytes"] == 2 * 1024**3
    assert parsed["total_bytes"] == round(79.15 * 1024**3)
    assert parsed["free_bytes"] == round(1.06 * 1024**3)
    assert parsed["process_bytes"] == round(78.08 * 1024**3)
    assert parsed["allocated_bytes"] == round(76.50 * 1024**3)
    assert parsed["reserved_unallocated_bytes"] == round(1.07 * 1024**3)
    assert oom.data["top_consumers"][0]["module"] == "table"
    # the table (2,000 x 32) and the MLP's Linear(32, 64) and Linear(64, 8), weights and biases
    params = (2_000 * 32 + 32 * 64 + 64 + 64 * 8 + 8) * 4
    assert oom.data["last_reading"]["params_bytes"] == params == 266_528


def test_other_errors_are_not_ooms(db_path: Path) -> None:
    with pytest.raises(ValueError), edo_monitor.watch(TwoTower(), db=db_path):
        raise ValueError("not memory")
    con = sqlite3.connect(db_path)
    assert con.execute("SELECT count(*) FROM events WHERE kind='oom'").fetchone()[0] == 0


GiB = 1024**3
RECORDED_STATS = {
    "allocated_bytes.all.current": 3 * GiB,
    "reserved_bytes.all.current": 5 * GiB,
    "active_bytes.all.current": 3 * GiB + 100,
    "inactive_split_bytes.all.current": 300 * 1024**2,
    "allocated_bytes.all.peak": 4 * GiB,
    "num_alloc_retries": 2,
    "num_ooms": 0,
}
RECORDED_SNAPSHOT = [
    {
        "total_size": 2 * GiB,
        "allocated_size": GiB,
        "active_size": GiB,
        "segment_type": "large",
        "blocks": [
            {"size": 768 * 1024**2, "state": "inactive"},
            {"size": GiB, "state": "active_allocated"},
            {"size": 256 * 1024**2, "state": "inactive"},
        ],
    }
]


def test_allocator_probe_waits_for_cuda_and_reads_recorded_stats() -> None:
    initialised = {"value": False}
    calls = {"snapshot": 0}

    def snapshot() -> list:
        calls["snapshot"] += 1
        return RECORDED_SNAPSHOT

    probe = AllocatorProbe(
        0,
        snapshot_interval_s=5.0,
        is_initialized=lambda: initialised["value"],
        memory_stats=lambda i: RECORDED_STATS,
        memory_snapshot=snapshot,
        mem_get_info=lambda i: (10 * GiB, 80 * GiB),
    )
    before = probe.read(with_device_info=True, now_s=0.0)
    assert all(v is None for v in before.values())  # unavailable, not zero
    initialised["value"] = True
    r = probe.read(with_device_info=True, now_s=1.0)
    assert r["allocated_bytes"] == 3 * GiB and r["reserved_bytes"] == 5 * GiB
    assert r["reserved_unallocated_bytes"] == 2 * GiB
    assert r["inactive_split_bytes"] == 300 * 1024**2
    assert r["peak_allocated_bytes"] == 4 * GiB and r["num_alloc_retries"] == 2
    assert r["device_total_bytes"] == 80 * GiB and r["device_free_bytes"] == 10 * GiB
    # holes of 768 MiB and 256 MiB: 1 - 768 / 1024
    assert r["fragmentation"] == pytest.approx(0.25)
    assert r["largest_inactive_block_bytes"] == 768 * 1024**2
    assert r["segment_count"] == 1
    probe.read(now_s=2.0)
    assert calls["snapshot"] == 1  # snapshots only every snapshot_interval_s
    probe.read(now_s=6.5)
    assert calls["snapshot"] == 2


def test_allocator_probe_failure_is_reported_once() -> None:
    events: list[str] = []

    def broken(i: int) -> dict:
        raise RuntimeError("driver said no")

    probe = AllocatorProbe(
        0,
        is_initialized=lambda: True,
        memory_stats=broken,
        memory_snapshot=lambda: [],
        mem_get_info=lambda i: (1, 2),
        on_event=lambda k, m, d: events.append(m),
    )
    assert probe.read()["allocated_bytes"] is None
    assert probe.read()["allocated_bytes"] is None
    assert len(events) == 1 and "driver said no" in events[0]


def test_run_peak_takes_the_allocator_peak_the_run_reached_between_readings() -> None:
    """Readings every interval miss a peak between them; the allocator's own peak stat
    (``allocated_bytes.all.peak``) holds it, but from the process's start: the run's summary takes
    it only once it rises above its value at the run's first reading (or after a reset)."""
    import threading
    from types import SimpleNamespace

    from edo_monitor.agent.sampler import Sampler
    from edo_monitor.probes.readings import Reading

    sampler = Sampler(SimpleNamespace(interval_s=1.0, _stop=threading.Event()))

    def read(allocated: int, peak_stat: int) -> int | None:
        r = Reading(0.0, 0, "cuda", allocated_bytes=allocated, peak_allocated_bytes=peak_stat)
        sampler._update_peaks(r)
        return sampler.peaks["allocated_bytes"]

    assert read(100, 900) == 100  # 900 was an earlier run's: not this one's
    assert read(120, 900) == 120
    assert read(110, 1500) == 1500  # reached between two readings
    assert read(100, 1500) == 1500
    assert read(100, 100) == 1500  # torch.cuda.reset_peak_memory_stats() inside the run
    assert read(90, 1700) == 1700
    cpu = Sampler(SimpleNamespace(interval_s=1.0, _stop=threading.Event()))
    cpu._update_peaks(Reading(0.0, 0, "cpu-budget", allocated_bytes=None))
    assert cpu.peaks["allocated_bytes"] is None
