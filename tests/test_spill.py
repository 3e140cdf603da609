"""The disk tier's file: real memory-mapped files, a SIGKILLed run's leftover."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

from edo_monitor.nn.spill import SpillFile
from edo_monitor.store.spill_files import leftover_spill_files


def test_alloc_is_backed_by_the_file(tmp_path):
    sf = SpillFile(tmp_path)
    a = sf.alloc((100, 8), torch.float64)
    b = sf.alloc((3, 5), torch.float32)
    a[7] = 1.5
    b.fill_(2.0)
    assert sf.path.stat().st_size == sf.size_bytes >= 100 * 8 * 8 + 15 * 4
    raw = sf.path.read_bytes()
    row = torch.frombuffer(bytearray(raw[7 * 64 : 8 * 64]), dtype=torch.float64)
    assert torch.equal(row, torch.full((8,), 1.5, dtype=torch.float64))
    sf.remove()
    assert not sf.path.exists()
    assert float(a[7, 0]) == 1.5  # the mapping outlives the name


def test_sigkilled_run_leaves_one_named_file(tmp_path):
    code = (
        "import sys, time, torch\n"
        "from edo_monitor.nn.spill import SpillFile\n"
        f"sf = SpillFile({str(tmp_path)!r})\n"
        "t = sf.alloc((64, 4), torch.float32); t.fill_(1)\n"
        "print(sf.path, flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert leftover_spill_files(tmp_path) == []  # its process still runs
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    left = leftover_spill_files(tmp_path)
    assert [str(p) for p in left] == [path]


def test_row_cache_over_the_disk_tier_matches_a_resident_twin(tmp_path):
    from edo_monitor.nn import CachedEmbedding

    torch.manual_seed(0)
    w0 = torch.randn(200, 6, dtype=torch.float64)
    twin = torch.nn.Embedding(200, 6, _weight=w0.clone(), dtype=torch.float64)
    sf = SpillFile(tmp_path)
    cached = CachedEmbedding(200, 6, 40, _weight=w0.clone(), dtype=torch.float64,
                             host_alloc=sf.alloc)  # fmt: skip
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (twin, cached)]
    for _ in range(20):
        ids = torch.randint(0, 200, (32,))
        for m, o in zip((twin, cached), opts, strict=True):
            m(ids).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    cached.flush()
    assert sf.size_bytes >= 3 * 200 * 6 * 8  # weight, exp_avg, exp_avg_sq all in the file
    err = (cached.full_weight().detach() - twin.weight.detach()).abs().max().item()
    assert err <= 1e-12
    sf.remove()


def test_a_spill_file_without_room_is_an_error_not_a_sigbus(tmp_path, monkeypatch):
    """Regression: the file grew by ``truncate`` alone (sparse), so on a full disk the first
    write through the mapping killed the process with SIGBUS: no exception, no rollback, a
    ``crashed`` run. The range is now reserved on disk first; no room is an ``OSError``
    (ENOSPC) the action's transaction rolls back, and the file is as it was. The disk's answer
    is faked here as the kernel gives it (a 64 KiB tmpfs gave it for real)."""
    import errno

    import pytest

    spill = SpillFile(tmp_path)
    first = spill.alloc((4, 8), torch.float64)
    size = spill.path.stat().st_size

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"no room for 512000 bytes in spill file .*No space left"):
        spill.alloc((4000, 16), torch.float64)
    assert spill.path.stat().st_size == size == spill.size_bytes
    first.fill_(1.0)  # what was allocated before stays usable
    assert float(first.sum()) == 32.0
