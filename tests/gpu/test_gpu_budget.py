"""A budget on CUDA is real: ``set_per_process_memory_fraction`` limits the allocator, the
policy acts when the model fills it, and an allocation over it fails with an out-of-memory error
that the agent records with the numbers PyTorch printed.

Sizes derive from the device's total memory, so the same test creates the same pressure on any
card. Run them with ``tests/gpu/run.sh`` (docs/gpu.md).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import GiB, MiB, nvidia_smi, printed_tolerance_bytes, torch_uuid
from torch import nn

import edo_monitor
from edo_monitor import History

pytestmark = pytest.mark.gpu

CUDA0 = torch.device("cuda", 0)
PAGE = 2 * MiB  # the caching allocator's large segments are whole multiples of 2 MiB


def _fraction() -> float | None:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return None if getter is None else float(getter(0))


def test_budget_pressure_offloads_then_releases_the_cache(tmp_path: Path) -> None:
    """A table of 1 % of the device (T bytes) trained with SGD and momentum keeps weight,
    gradient and momentum on the device: 3T, sized to 85 % of the budget, so free memory (budget
    minus the allocator's reserved bytes) falls to at most 15 %, below the 20 % floor. With the
    ladder offload_embedding -> release_cache the agent offloads the table (saving exactly 3T,
    its estimate), then returns the three freed T-byte segments to the driver (3T, plus at most a
    few small segments), and free memory goes back above the 25 % re-arm level. The fraction
    really set is budget / total, and it is reset afterwards."""
    total = torch.cuda.get_device_properties(0).total_memory
    table_bytes = max(64 * MiB, total // 100 // PAGE * PAGE)
    dim = 64
    rows = table_bytes // (dim * 4)
    budget = 3 * table_bytes * 100 // 85 // MiB * MiB
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(rows, dim), nn.Linear(dim, 16)).to(CUDA0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
    policy = edo_monitor.Policy(ladder=("offload_embedding", "release_cache"), cooldown_steps=1)
    db = tmp_path / "budget.db"
    g = torch.Generator().manual_seed(0)
    fraction_inside = None
    with edo_monitor.watch(model, opt, db=db, budget=budget, policy=policy, interval_s=0.01) as mon:
        fraction_inside = _fraction()
        deadline = time.monotonic() + 120
        while True:  # train until both actions are applied and free memory is back
            idx = torch.randint(0, rows, (1024,), generator=g).to(CUDA0)
            model(idx).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            done = [a.get("action") for a in mon.summary().actions]
            latest = mon.latest
            back = latest is not None and (latest.free_fraction or 0) >= policy.rearm_free_fraction
            if "release_cache" in done and back:
                break
            assert time.monotonic() < deadline, f"actions {done}, latest {latest}"
    s = mon.summary()
    print(f"table {table_bytes} bytes, budget {budget}, total {total}")
    print(s)
    assert s.device_kind == "cuda" and s.status == "finished"
    assert s.budget_bytes == budget
    if fraction_inside is not None:
        assert fraction_inside == pytest.approx(budget / total)
        assert _fraction() == 1.0
    assert s.min_free_fraction is not None
    assert s.min_free_fraction <= 1 - 3 * table_bytes / budget + 1e-9  # reserved >= 3T was seen
    assert s.events.get("oom", 0) == 0

    with History(db) as h:
        events = h.events(mon.run_id)
    timeline = [
        (e.kind, e.data.get("direction") or e.data.get("action"))
        for e in events
        if e.kind in ("threshold_crossed", "action")
    ]
    print(timeline)
    assert timeline == [
        ("threshold_crossed", "below"),
        ("action", "offload_embedding"),
        ("action", "release_cache"),
        ("threshold_crossed", "above"),
    ]
    offload, release = (e.data for e in events if e.kind == "action")
    assert offload["target"] == "0"
    assert offload["estimated_saving_bytes"] == 3 * table_bytes
    assert offload["saved_bytes"] == 3 * table_bytes
    assert 3 * table_bytes <= release["saved_bytes"] <= 3 * table_bytes + 8 * PAGE
    assert model[0].weight.device.type == "cpu"
    assert torch.cuda.memory_reserved(0) < 3 * table_bytes


def _process_bytes_from_smi() -> int | None:
    """This process's device memory as ``nvidia-smi`` lists it (MiB), or ``None`` if unlisted.

    On a machine where this is the only process on the GPU, a single listed process is this one
    even when its pid is the host's (a container's PID namespace).
    """
    uuid = f"GPU-{torch_uuid()}"
    apps = [
        (int(p), int(u))
        for p, u, g in nvidia_smi("--query-compute-apps=pid,used_memory,gpu_uuid")
        if g == uuid
    ]
    mine = [u for p, u in apps if p == os.getpid()]
    if mine:
        return mine[0] * MiB
    if len(apps) == 1:
        return apps[0][1] * MiB
    if apps:
        pytest.skip(f"other processes on the GPU ({apps}): cannot tell which one is this")
    return None


def test_a_real_cuda_oom_is_recorded_with_the_numbers_pytorch_printed(tmp_path: Path) -> None:
    """Under a budget of 2 % of the device, allocating the whole budget again fails: the
    ``OutOfMemoryError`` leaves the ``watch()`` block, the run is ``failed`` and one ``oom`` event
    holds the parsed message. Each parsed number equals what torch.cuda, the driver and
    nvidia-smi say at that moment, to the two decimals PyTorch prints; the message names the
    budget as the allowed memory."""
    total = torch.cuda.mem_get_info(0)[1]
    budget = max(GiB, total // 50 // PAGE * PAGE)
    model = nn.Linear(1024, 1024).to(CUDA0)
    db = tmp_path / "oom.db"
    seen: dict[str, Any] = {}
    with (
        pytest.raises(torch.OutOfMemoryError) as caught,
        edo_monitor.watch(model, db=db, budget=budget, interval_s=0.05) as mon,
    ):
        held = torch.empty(budget // 2, dtype=torch.uint8, device=CUDA0)
        ooms_before = torch.cuda.memory_stats(0)["num_ooms"]
        try:
            torch.empty(budget, dtype=torch.uint8, device=CUDA0)
        except torch.OutOfMemoryError:
            torch.cuda.synchronize()
            seen = {
                "allocated": torch.cuda.memory_allocated(0),
                "reserved": torch.cuda.memory_reserved(0),
                "free": torch.cuda.mem_get_info(0)[0],
                "ooms": torch.cuda.memory_stats(0)["num_ooms"] - ooms_before,
                "process": _process_bytes_from_smi(),
            }
            raise
    message = str(caught.value)
    print(message)
    print(seen)
    assert held.numel() == budget // 2
    assert seen["ooms"] == 1
    assert mon.summary().status == "failed"
    with History(db) as h:
        run = h.run(mon.run_id)
        ooms = [e for e in h.events(mon.run_id) if e.kind == "oom"]
    assert run.status == "failed"
    assert len(ooms) == 1
    data = ooms[0].data
    assert data["exception"] == "OutOfMemoryError"
    p = data["parsed"]
    print(p)

    def near(parsed: int | None, expected: int, slack_bytes: float = 0) -> bool:
        return parsed is not None and abs(parsed - expected) <= (
            printed_tolerance_bytes(expected) + slack_bytes
        )

    assert p["backend"] == "cuda"
    assert p["device_index"] == 0
    assert near(p["requested_bytes"], budget)  # a multiple of 2 MiB: not rounded up
    assert near(p["total_bytes"], total)
    assert near(p["free_bytes"], seen["free"])
    assert near(p["allocated_bytes"], seen["allocated"])
    slack = seen["reserved"] - seen["allocated"]
    assert near(p["reserved_unallocated_bytes"], slack)
    assert near(p["reserved_bytes"], seen["reserved"], printed_tolerance_bytes(seen["allocated"]))
    if seen["process"] is None:
        assert p["process_bytes"] is None
    else:  # nvidia-smi reads in whole MiB
        assert near(p["process_bytes"], seen["process"], MiB)
    allowed = re.search(r"([0-9.]+) (GiB|MiB) allowed", message)
    assert allowed is not None, message
    allowed_bytes = float(allowed.group(1)) * (GiB if allowed.group(2) == "GiB" else MiB)
    assert abs(allowed_bytes - budget) <= printed_tolerance_bytes(budget) + 1
