"""Out-of-memory errors raised inside ``watch()`` are recorded as ``oom`` events (issue 9, item
11): CUDA libraries' allocation failures too, with no numbers parsed."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    ],
)
def test_cuda_library_allocation_failure_is_an_oom_event(tmp_path: Path, message: str) -> None:
    db = tmp_path / "h.db"
    model = nn.Linear(4, 1)
    with pytest.raises(RuntimeError, match="ALLOC_FAILED"), edo_monitor.watch(model, db=db) as mon:
        model(torch.ones(2, 4)).sum().backward()
        raise RuntimeError(message)  # what torch raises when cuBLAS / cuDNN cannot allocate
    assert mon.summary().events.get("oom") == 1
    con = sqlite3.connect(db)
    (data,) = con.execute("SELECT data FROM events WHERE kind = 'oom'").fetchone()
    status = con.execute("SELECT status FROM runs").fetchone()[0]
    con.close()
    parsed = json.loads(data)["parsed"]
    assert parsed["backend"] == "cuda"
    assert {k: v for k, v in parsed.items() if k != "backend"} == dict.fromkeys(
        (
            "requested_bytes",
            "device_index",
            "total_bytes",
            "free_bytes",
            "allocated_bytes",
            "reserved_bytes",
            "reserved_unallocated_bytes",
            "process_bytes",
        )
    )
    assert status == "failed"


def test_other_runtime_errors_are_not_oom(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    with pytest.raises(RuntimeError), edo_monitor.watch(model, db=tmp_path / "h.db") as mon:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    assert "oom" not in mon.summary().events
