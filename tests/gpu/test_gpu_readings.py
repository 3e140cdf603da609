"""Checks only a GPU can answer. Run them as one short script on a CUDA machine:

    .venv/bin/pytest -m gpu tests/gpu -q

They compare the probes with independent readings (``nvidia-smi``, ``torch.cuda``) and run the
main example on CUDA with a budget.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import edo_monitor
from edo_monitor.probes.cuda import AllocatorProbe
from edo_monitor.probes.nvml import NvmlProbe

MiB = 1024**2


def nvidia_smi_mib(index: int) -> tuple[int, int]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not found")
    out = subprocess.run(
        [
            smi,
            f"--id={index}",
            "--query-gpu=memory.used,memory.total",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    used, total = (int(v) for v in out.strip().split(","))
    return used, total


def test_nvml_used_and_total_match_nvidia_smi() -> None:
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # context + a real allocation
    props = torch.cuda.get_device_properties(0)
    probe = NvmlProbe(0, torch_uuid=str(props.uuid))
    assert probe.start(), probe.reason
    reading = probe.read()
    smi_index = int(probe._nvml.nvmlDeviceGetIndex(probe._handle))
    used_mib, total_mib = nvidia_smi_mib(smi_index)
    version = reading["nvml_memory_info_version"]
    print(f"NVML used {reading['device_used_bytes'] / MiB:.0f} MiB, total "
          f"{reading['device_total_bytes'] / MiB:.0f} MiB (v{version}); "
          f"nvidia-smi used {used_mib} MiB, total {total_mib} MiB")  # fmt: skip
    assert abs(reading["device_total_bytes"] / MiB - total_mib) <= 1
    assert abs(reading["device_used_bytes"] / MiB - used_mib) <= 64  # other processes move
    assert reading["process_device_bytes"] is None or reading["process_device_bytes"] >= x.numel()
    probe.close()


def test_allocator_stats_match_torch() -> None:
    tensors = [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (3, 17, 64)]
    del tensors[1]  # leave a hole
    probe = AllocatorProbe(0, snapshot_interval_s=0.001)
    r = probe.read(with_device_info=True)
    assert r["allocated_bytes"] == torch.cuda.memory_allocated(0)
    assert r["reserved_bytes"] == torch.cuda.memory_reserved(0)
    assert r["reserved_unallocated_bytes"] == r["reserved_bytes"] - r["allocated_bytes"]
    _free, total = torch.cuda.mem_get_info(0)
    assert r["device_total_bytes"] == total
    assert 0.0 <= r["fragmentation"] <= 1.0
    assert r["segment_count"] >= 1
    print(f"allocated {r['allocated_bytes']}, reserved {r['reserved_bytes']}, "
          f"fragmentation {r['fragmentation']:.3f}, segments {r['segment_count']}")  # fmt: skip


def test_watch_on_cuda_records_measured_numbers(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(100_000, 64), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    with edo_monitor.watch(model, db=tmp_path / "h.db", interval_s=0.05, budget="8GiB") as mon:
        for _ in range(20):
            model(torch.randint(0, 100_000, (256,), device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    s = mon.summary()
    assert s.device_kind == "cuda" and s.steps == 20
    assert s.budget_bytes == 8 * 1024**3
    assert s.peak_allocated_bytes is not None and s.peak_allocated_bytes >= 4 * 100_000 * 64 * 4
    assert mon.latest is not None and mon.latest.device_total_bytes is not None


def test_main_example_on_cuda_with_a_budget(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "train_embedding.py"
    done = subprocess.run(
        [sys.executable, str(example), "--db", str(tmp_path / "d.db"), "--steps", "40",
         "--device", "cuda", "--budget", "2GiB"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "device           cuda" in done.stdout
