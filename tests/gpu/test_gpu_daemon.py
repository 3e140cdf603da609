"""``edo-monitor daemon`` on a real GPU: its device rows are what NVML and ``nvidia-smi`` say,
and this process (holding device memory) is among its process rows where NVML lists it."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch

from edo_monitor.surfaces.daemon import Daemon


def test_daemon_device_rows_match_nvml_and_nvidia_smi(tmp_path: Path) -> None:
    pynvml = pytest.importorskip("pynvml")
    held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # this process on the GPU
    torch.cuda.synchronize()
    db = tmp_path / "daemon.db"
    daemon = Daemon(db, interval_s=0.5, flush_interval_s=0.1)
    daemon.start()
    daemon.sample()
    result = daemon.close()
    assert sum(result.not_written.values()) == 0
    con = sqlite3.connect(db)
    rows = con.execute(
        "SELECT device_index, device_uuid, device_total_bytes, device_used_bytes, "
        "device_free_bytes, nvml_memory_info_version FROM device_samples ORDER BY device_index"
    ).fetchall()
    procs = con.execute(
        "SELECT device_uuid, pid, process_device_bytes FROM process_samples"
    ).fetchall()
    con.close()
    pynvml.nvmlInit()
    try:
        assert len(rows) == pynvml.nvmlDeviceGetCount() >= 1
        listed_me = False
        for index, uuid, total, used, free, version in rows:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            assert pynvml.nvmlDeviceGetUUID(handle) == uuid
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)  # v1: total never changes
            assert total == info.total and version in (1, 2)
            assert used is not None and free is not None and used + free <= total
            pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            listed_me |= os.getpid() in pids
        print("daemon rows:", rows)
    finally:
        pynvml.nvmlShutdown()
    mine = [p for p in procs if p[1] == os.getpid()]
    if listed_me:  # NVML lists host PIDs: in a container of its own PID namespace it does not
        assert mine and mine[0][2] is not None and mine[0][2] >= 256 << 20
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        out = subprocess.run(
            [smi, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        by_uuid = {
            u.strip(): int(mib) for _, u, mib in (line.split(",") for line in out.splitlines())
        }
        print("nvidia-smi:", by_uuid)
        for _, uuid, total, *_ in rows:
            assert abs(total / 2**20 - by_uuid[uuid]) <= 1  # nvidia-smi prints MiB
    del held
