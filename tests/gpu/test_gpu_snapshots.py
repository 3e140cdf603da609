"""Incident snapshots on CUDA (issue 25): the allocator's OOM observer stores the snapshot taken
inside the failed allocation, before the step's tensors are freed; with ``snapshots=True`` the
allocator's history gives the blocks their Python frames; the stored pickle opens in
``torch.cuda._memory_viz``; and the cost of the history on a small training loop is printed.
Run them with ``tests/gpu/run.sh`` (docs/gpu.md).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_helpers import MiB
from torch import nn
from torch.cuda import _memory_viz

import edo_monitor
from edo_monitor import History
from edo_monitor.measure.snapshots import fragmentation, top_by_frame, totals
from edo_monitor.store.snapshot_store import find_snapshot, load_snapshot

pytestmark = pytest.mark.gpu

CUDA0 = torch.device("cuda", 0)


def test_oom_snapshot_is_taken_before_the_tensors_are_freed(tmp_path: Path) -> None:
    """Under a budget of 512 MiB beside what the process already holds, 48 live 8 MiB tensors
    (384 MiB) then one 256 MiB request: the observer's snapshot holds the 48 tensors (they are
    freed when the error unwinds), names the request in its trace, and the blocks carry this
    file's frame (snapshots=True)."""
    db = tmp_path / "h.db"
    held: list[torch.Tensor] = []
    budget = torch.cuda.memory_reserved(0) + 512 * MiB  # an earlier test's leftovers not counted
    model = nn.Linear(4, 4).to(CUDA0)  # a CUDA model: watch(None) would be CPU-budget
    with edo_monitor.watch(model, db=db, budget=budget, snapshots=True, interval_s=10) as mon:
        assert mon.device_kind == "cuda"
        for _ in range(48):
            held.append(torch.empty(8 * MiB, dtype=torch.uint8, device=CUDA0))
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.empty(256 * MiB, dtype=torch.uint8, device=CUDA0)
        mon._record_oom(caught.value)
        held.clear()
    with History(db) as h:
        info = find_snapshot(h, mon.run_id)
        snap = load_snapshot(h, info)
    assert info.source == "cuda" and info.event_kind == "oom"
    t = totals(snap)
    assert t.allocated_bytes >= 48 * 8 * MiB
    assert fragmentation(snap)["request_bytes"] == 256 * MiB
    top = top_by_frame(snap, 1)[0]
    assert top.frame.startswith("test_gpu_snapshots.py:") and top.bytes >= 48 * 8 * MiB
    lines: list[str] = []
    _memory_viz.memory(snap, format_flamegraph=lines.append)
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snap)


def test_snapshot_command_on_a_cuda_run(tmp_path: Path) -> None:
    """``edo-monitor snapshot --out`` writes the allocator's pickle of an OOM run."""
    db = tmp_path / "h.db"
    budget = torch.cuda.memory_reserved(0) + 256 * MiB  # an earlier test's leftovers not counted
    model = nn.Linear(4, 4).to(CUDA0)
    with edo_monitor.watch(model, db=db, budget=budget, interval_s=10) as mon:
        keep = torch.empty(128 * MiB, dtype=torch.uint8, device=CUDA0)
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.empty(200 * MiB, dtype=torch.uint8, device=CUDA0)
        mon._record_oom(caught.value)
        del keep
    out = tmp_path / "s.pickle"
    res = subprocess.run(
        [sys.executable, "-m", "edo_monitor.surfaces.cli", "snapshot", "latest", "--db", str(db),
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    snap = pickle.loads(out.read_bytes())
    assert totals(snap).allocated_bytes >= 128 * MiB


def _loop_s(snapshots: bool | None, db: Path, steps: int = 200) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to(CUDA0)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 1024, device=CUDA0)
    with edo_monitor.watch(model, opt, db=db, snapshots=snapshots):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def test_cost_of_the_allocator_history(tmp_path: Path) -> None:
    """Prints the step time with the history on (snapshots=True) against the default, rotated
    three times; the figure goes to docs/benchmarks.md (no bound asserted but a sanity 3x)."""
    times: dict[str, list[float]] = {"default": [], "history": []}
    for i in range(3):
        for name, flag in (("default", None), ("history", True))[:: 1 if i % 2 == 0 else -1]:
            times[name].append(_loop_s(flag, tmp_path / f"{name}{i}.db"))
    best = {k: min(v) for k, v in times.items()}
    print(
        f"\nallocator history cost: default {best['default'] * 5:.3f} ms/step, history "
        f"{best['history'] * 5:.3f} ms/step, ratio {best['history'] / best['default']:.3f}"
    )
    assert best["history"] < 3 * best["default"]
