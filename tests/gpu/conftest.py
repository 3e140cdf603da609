"""GPU checks: marked ``gpu`` and skipped where CUDA is unavailable.

Run them on a CUDA machine with ``tests/gpu/run.sh`` (docs/gpu.md), or ``pytest -m gpu tests/gpu``.
Every test starts from an emptied allocator cache with reset peaks (:func:`clean_cuda`), so the
byte counts one test expects are not shifted by what an earlier one left cached.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).resolve().parent
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False)"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/gpu ``gpu``; skip them all without CUDA (before ``-m``)."""
    skip = pytest.mark.skip(reason=NO_CUDA)
    available = torch.cuda.is_available()
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(GPU_DIR):
            item.add_marker(pytest.mark.gpu)
            if not available:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_cuda() -> Iterator[None]:
    """Free what earlier tests cached, reset peaks and the memory fraction; again afterwards."""

    def clean() -> None:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)

    clean()
    yield
    clean()
