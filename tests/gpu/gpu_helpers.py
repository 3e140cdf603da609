"""Helpers of the GPU tests: independent readings (``nvidia-smi``), fresh processes, tolerances."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from edo_monitor.actions import ActivationRecorder

MiB = 1024**2
GiB = 1024**3


def recorded_profile(model: nn.Module, x: torch.Tensor) -> object:
    """The activation profile of one forward and backward of ``model`` on ``x`` (what the agent
    records before it lets a table action change a weight: ``ActionContext.activation_profile``).
    The backward leaves gradients in ``model``: pass a copy to keep it untouched."""
    with ActivationRecorder(model) as rec:
        model(x).float().sum().backward()
    return rec.profile()


def nvidia_smi(*query: str) -> list[list[str]]:
    """Rows of ``nvidia-smi <query> --format=csv,noheader,nounits``, cells stripped.

    Skips the test when ``nvidia-smi`` is not installed (it is the independent reading).
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not found: no independent reading to compare with")
    out = subprocess.run(
        [smi, *query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def torch_uuid(index: int = 0) -> str:
    """The device's UUID as torch reports it (no ``GPU-`` prefix)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def run_script(code: str, tmp_path: Path, timeout_s: float = 120) -> dict:
    """Run ``code`` in a fresh Python process (cwd ``tmp_path``); return the JSON it printed last.

    A fresh process starts with CUDA uninitialised and an empty allocator, so what it measures
    depends on nothing an earlier test did. Its stderr is shown when it fails.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONUNBUFFERED"] = "1"
    script = tmp_path / "script.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, "-P", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    print(done.stdout[-3000:])
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def printed_tolerance_bytes(nbytes: int) -> float:
    """Half a unit of the last of the two decimals PyTorch prints a size with.

    PyTorch's ``format_size`` (c10/cuda/CUDACachingAllocator.cpp) prints ``N bytes`` up to 1 KiB,
    else ``x.xx`` KiB up to 1 MiB, MiB up to 1 GiB, GiB beyond; a size parsed back from it is
    within half a hundredth of that unit (plus a byte for the rounding to an integer).
    """
    if nbytes <= 1024:
        return 1.0
    unit = 1024 if nbytes <= MiB else MiB if nbytes <= GiB else GiB
    return unit * 0.005 + 1
