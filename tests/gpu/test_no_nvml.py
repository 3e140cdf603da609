"""On a CUDA machine without NVML (no driver library, a container without it): watch() logs one
line, records one event, and the allocator and host readings go on (README, DESIGN.md §5).

NVML is the hardware boundary: its ``nvmlInit`` is made to fail as pynvml fails when
``libnvidia-ml.so`` cannot be loaded (``NVMLError_LibraryNotFound``); nothing of edo-monitor is
changed.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import pytest
import torch

import edo_monitor


def test_without_nvml_one_log_line_and_the_other_readings_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pynvml = pytest.importorskip("pynvml")

    def library_not_found() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", library_not_found)
    db = tmp_path / "h.db"
    model = torch.nn.Sequential(torch.nn.Embedding(10_000, 64), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    with caplog.at_level(logging.WARNING), edo_monitor.watch(model, db=db, interval_s=0.02) as mon:
        deadline = time.monotonic() + 60
        while mon.steps < 10 or mon.summary().samples < 3:
            assert time.monotonic() < deadline, "the sampler took no readings"
            model(torch.randint(0, 10_000, (256,), device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    lines = [r for r in caplog.records if r.name == "edo_monitor.probes.nvml"]
    assert len(lines) == 1 and "NVML" in lines[0].getMessage(), [r.getMessage() for r in lines]
    assert mon.summary().events.get("probe_unavailable") == 1
    assert mon.status == "finished" and mon.device_kind == "cuda"
    con = sqlite3.connect(db)
    rows = con.execute(
        "SELECT device_used_bytes, process_device_bytes, device_total_bytes, allocated_bytes, "
        "process_rss_bytes FROM samples"
    ).fetchall()
    con.close()
    assert len(rows) == mon.summary().samples
    _, total_bytes = torch.cuda.mem_get_info()
    for used, process, total, allocated, rss in rows:
        assert process is None  # NVML's own number: unavailable, not zero
        # the device's size and use from CUDA instead (cudaMemGetInfo: total - free), which the
        # policy measures against when no budget is given
        assert total == total_bytes and used is not None and 0 < used < total
        assert allocated is not None and rss is not None and rss > 0
    # the last reading, taken after the last step: what the allocator holds now
    assert rows[-1][3] == torch.cuda.memory_allocated()
