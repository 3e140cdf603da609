"""The probes against independent readings on a real CUDA device.

NVML against ``nvidia-smi``; the allocator probe against ``torch.cuda``'s own functions and byte
counts the test allocated; fragmentation from a real allocator snapshot of a pattern whose holes
are known; ``watch()`` on CUDA; and ``watch()`` leaving CUDA uninitialised for a model on the CPU.
Run them with ``tests/gpu/run.sh`` (docs/gpu.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import MiB, nvidia_smi, run_script, torch_uuid

import edo_monitor
from edo_monitor.probes.cuda import AllocatorProbe, device_waits
from edo_monitor.probes.nvml import NvmlProbe

pytestmark = pytest.mark.gpu


def test_nvml_matches_nvidia_smi() -> None:
    """Total, used and free within 1 MiB of nvidia-smi's; name and UUID equal; the process's own
    bytes equal nvidia-smi's compute-apps row for this pid, or ``None`` with an event when the
    driver does not list this pid (a container's PID namespace)."""
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # a context and a real allocation
    torch.cuda.synchronize()
    events: list[tuple[str, str, dict[str, Any]]] = []
    probe = NvmlProbe(0, torch_uuid=torch_uuid(), on_event=lambda k, m, d: events.append((k, m, d)))
    assert probe.start(), probe.reason
    try:
        smi_id = f"GPU-{torch_uuid()}"
        query = "--query-gpu=memory.total,memory.used,memory.free,uuid,name"
        deadline = time.monotonic() + 30
        while True:  # used memory moves while the driver settles: compare a stable pair
            before = probe.read()
            ((total_mib, used_mib, free_mib, smi_uuid, smi_name),) = nvidia_smi(
                f"--id={smi_id}", query
            )
            after = probe.read()
            if before["device_used_bytes"] == after["device_used_bytes"]:
                break
            assert time.monotonic() < deadline, "NVML's used bytes never settled"
        apps = nvidia_smi("--query-compute-apps=pid,used_memory,gpu_uuid")
    finally:
        probe.close()
    r = after
    print(
        f"NVML v{r['nvml_memory_info_version']}: total {r['device_total_bytes'] / MiB:.1f}, used "
        f"{r['device_used_bytes'] / MiB:.1f}, free {r['device_free_bytes'] / MiB:.1f} MiB, "
        f"process {r['process_device_bytes']}; nvidia-smi: total {total_mib}, used {used_mib}, "
        f"free {free_mib} MiB; compute apps {apps}; pid {os.getpid()}"
    )
    assert abs(r["device_total_bytes"] / MiB - int(total_mib)) <= 1
    assert abs(r["device_used_bytes"] / MiB - int(used_mib)) <= 1
    assert abs(r["device_free_bytes"] / MiB - int(free_mib)) <= 1
    assert probe.device_uuid == smi_uuid == smi_id
    assert probe.device_name == smi_name
    mine = [int(used) for pid, used, uuid in apps if pid == str(os.getpid()) and uuid == smi_uuid]
    if mine:
        assert abs(r["process_device_bytes"] / MiB - mine[0]) <= 1
        assert r["process_device_bytes"] >= x.numel()
    else:  # the driver does not list this pid: unknown, said once, never a wrong number
        assert r["process_device_bytes"] is None
        assert "process" in [d.get("field") for k, _, d in events if k == "probe_unavailable"]


def test_allocator_probe_matches_torch() -> None:
    """Allocated, reserved, slack and peak equal torch.cuda's functions and the bytes allocated
    here (sizes in whole MiB are not rounded by the allocator); device total/free equal
    ``mem_get_info``'s."""
    base_allocated = torch.cuda.memory_allocated(0)  # peaks were reset to this by the fixture
    tensors = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (3, 17, 64)]
    del tensors[1]  # 17 MiB freed: cached, not returned
    torch.cuda.synchronize()
    r = AllocatorProbe(0, snapshot_interval_s=0).read(with_device_info=True)
    free, total = torch.cuda.mem_get_info(0)
    allocated, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    print({k: v for k, v in r.items() if v is not None})
    assert r["allocated_bytes"] == allocated == base_allocated + (3 + 64) * MiB
    assert r["active_bytes"] == allocated  # nothing awaits a free on another stream
    assert r["reserved_bytes"] == reserved
    assert r["reserved_unallocated_bytes"] == reserved - allocated >= 17 * MiB
    assert r["peak_allocated_bytes"] == torch.cuda.max_memory_allocated(0)
    assert r["peak_allocated_bytes"] == base_allocated + (3 + 17 + 64) * MiB
    assert r["num_ooms"] == torch.cuda.memory_stats(0)["num_ooms"]
    assert r["device_total_bytes"] == total
    assert r["device_free_bytes"] == free
    assert r["device_used_bytes"] == total - free


FRAGMENTATION_SCRIPT = r"""
import json
import torch
from edo_monitor.probes.cuda import AllocatorProbe

MiB = 1024**2
out = {}
probe = AllocatorProbe(0, snapshot_interval_s=1.0)


def layout():
    return [
        [[b["state"], b["size"] // MiB] for b in seg["blocks"]]
        for seg in torch.cuda.memory_snapshot()
    ]


# one 64 MiB segment, cached; eight 8 MiB tensors carved from it in address order
big = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
del big
parts = [torch.empty(8 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
for i in (1, 3, 5, 7):
    parts[i] = None  # four 8 MiB holes, each between live tensors
torch.cuda.synchronize()
out["layout_4_holes"] = layout()
out["probe_4_holes"] = probe.read(now_s=10.0)
parts[2] = None  # holes 1 and 3 and the freed block 2 between them coalesce: one 24 MiB hole
torch.cuda.synchronize()
out["layout_coalesced"] = layout()
out["probe_coalesced"] = probe.read(now_s=20.0)
print(json.dumps(out))
"""


def test_fragmentation_from_a_real_snapshot(tmp_path: Path) -> None:
    """A fresh process carves a 64 MiB segment into eight 8 MiB tensors and frees every other one:
    4 holes of 8 MiB, fragmentation 1 - 8/32 = 0.75. Freeing the tensor between two holes makes
    one 24 MiB hole of 40 MiB inactive: 1 - 24/40 = 0.4. One segment throughout."""
    env_conf = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the default allocator layout
    try:
        out = run_script(FRAGMENTATION_SCRIPT, tmp_path)
    finally:
        if env_conf is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env_conf
    a, i = "active_allocated", "inactive"
    # the allocator did what the pattern assumes (best fit, splitting the cached segment)
    assert out["layout_4_holes"] == [[[a, 8], [i, 8]] * 4]
    assert out["layout_coalesced"] == [[[a, 8], [i, 24], [a, 8], [i, 8], [a, 8], [i, 8]]]
    p = out["probe_4_holes"]
    assert p["fragmentation"] == pytest.approx(0.75)
    assert p["largest_inactive_block_bytes"] == 8 * MiB
    assert p["segment_count"] == 1
    assert p["reserved_unallocated_bytes"] == 32 * MiB
    p = out["probe_coalesced"]
    assert p["fragmentation"] == pytest.approx(0.4)
    assert p["largest_inactive_block_bytes"] == 24 * MiB
    assert p["segment_count"] == 1
    assert p["reserved_unallocated_bytes"] == 40 * MiB


def test_watch_on_cuda_records_measured_numbers(tmp_path: Path) -> None:
    """A watched CUDA run: 20 steps, the budget, the peak equal to torch's, and the last reading
    (taken after the last step) equal to the allocator's figures read right after the block."""
    n, d = 100_000, 64
    model = torch.nn.Sequential(torch.nn.Embedding(n, d), torch.nn.Linear(d, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    g = torch.Generator().manual_seed(0)
    with edo_monitor.watch(model, db=tmp_path / "h.db", interval_s=0.05, budget="8GiB") as mon:
        for _ in range(20):
            model(torch.randint(0, n, (256,), generator=g).cuda()).sum().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    s, latest = mon.summary(), mon.latest
    print(s)
    assert s.device_kind == "cuda" and s.status == "finished"
    assert s.steps == 20
    assert s.budget_bytes == 8 * 1024**3
    assert s.peak_allocated_bytes == torch.cuda.max_memory_allocated(0)
    # weight, gradient and Adam's two states of the table were alive together
    assert s.peak_allocated_bytes >= 4 * n * d * 4
    assert latest is not None and latest.device_kind == "cuda"
    assert latest.allocated_bytes == allocated
    assert latest.reserved_bytes == reserved
    assert latest.in_use_bytes == reserved  # with a budget, the allocator's reserved bytes
    assert latest.free_fraction == pytest.approx((8 * 1024**3 - reserved) / (8 * 1024**3))
    assert latest.device_total_bytes is not None and latest.device_total_bytes > 0


NO_INIT_SCRIPT = r"""
import json
import multiprocessing as mp
import time

import torch

import edo_monitor


def child(q):
    try:
        q.put(["ok", float(torch.ones(4, device="cuda").sum().item())])
    except Exception as exc:
        q.put(["error", f"{type(exc).__name__}: {exc}"])


def fork_child_uses_cuda():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    result = q.get(timeout=120)
    p.join(60)
    return result


def wait_for_samples(mon, n, step=None):
    deadline = time.monotonic() + 60
    while mon.summary().samples < n and time.monotonic() < deadline:
        if step is not None:
            step()
        else:
            time.sleep(0.01)


def main():
    out = {}
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.randint(0, 1000, (32,))).sum().backward()
        opt.step()
        opt.zero_grad()

    if MODE == "control":
        out["is_available"] = torch.cuda.is_available()
    elif MODE == "baseline":
        for _ in range(20):
            step()
    else:
        with edo_monitor.watch(model, db="model.db", interval_s=0.01) as mon:
            wait_for_samples(mon, 5, step)
        out["model"] = [mon.summary().device_kind, mon.summary().samples >= 5]
        out["initialized_after_model"] = torch.cuda.is_initialized()
        with edo_monitor.watch(None, db="process.db", interval_s=0.01) as mon:
            wait_for_samples(mon, 5)
        out["process"] = [mon.summary().device_kind, mon.summary().samples >= 5]
        out["initialized_after_process"] = torch.cuda.is_initialized()
    out["child"] = fork_child_uses_cuda()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
"""


def test_watch_never_initialises_cuda_for_a_model_on_the_cpu(tmp_path: Path) -> None:
    """In a fresh process, ``watch()`` of a CPU model and ``watch(None)`` leave CUDA
    uninitialised, and a child forked afterwards can still use CUDA (a driver initialised in the
    parent breaks it: a control process that calls ``torch.cuda.is_available()`` shows whether
    this driver does). A baseline process that trains the same CPU model without watch() shows
    whether a forked child can use CUDA after that at all: on the H200 machine it could not
    (torch's autograd engine counts the CUDA devices at the first backward, a CPU one too, which
    initialises the driver), and then the test skips: nothing it could show about watch()."""
    baseline = run_script('MODE = "baseline"\n' + NO_INIT_SCRIPT, tmp_path)
    control = run_script('MODE = "control"\n' + NO_INIT_SCRIPT, tmp_path)
    out = run_script('MODE = "watch"\n' + NO_INIT_SCRIPT, tmp_path)
    print(f"baseline: a fork after CPU training without watch() -> {baseline['child']}")
    print(f"control: a fork after torch.cuda.is_available() -> {control['child']}")
    print(f"watch(): a fork after watch() of a CPU model -> {out['child']}")
    if baseline["child"][0] != "ok":
        pytest.skip(f"CPU training alone breaks a forked child's CUDA here: {baseline['child']}")
    assert out["model"] == ["cpu-budget", True]
    assert out["initialized_after_model"] is False
    assert out["process"] == ["cpu-budget", True]
    assert out["initialized_after_process"] is False
    assert out["child"][0] == "ok", out["child"]
    assert out["child"][1] == 4.0


def test_device_waits_counts_the_host_waiting_for_the_device() -> None:
    """``.item()`` of a device tensor waits once and a copy to the host once more; work that
    stays on the device waits never; the sync debug mode is off afterwards, also after a raise."""
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert device_waits(lambda: (x * 2).sum()) == 0
    assert device_waits(lambda: (x.sum().item(), x.cpu())) == 2

    def fails() -> None:
        x.sum().item()
        raise RuntimeError("in run")

    with pytest.raises(RuntimeError, match="in run"):
        device_waits(fails)
    assert torch.cuda.get_sync_debug_mode() == 0
