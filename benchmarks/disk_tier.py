"""The disk tier (issue 24, item 4): a row cache over a memory-mapped file against host memory.

    python benchmarks/disk_tier.py [--rows 200000] [--dim 32] [--steps 30] [--rounds 7]

Two :class:`edo_monitor.nn.CachedEmbedding` tables with the same float64 weights and Adam, one
whose host table and optimizer state live in host memory, one over a
:class:`edo_monitor.nn.spill.SpillFile` (``host_alloc=``) in ``--spill-dir`` (default a temp
folder), are trained on the same Zipf(1.3) batches, the cache sized for about 90 % hits of the
batch's unique ids. Timed side by side: each round runs ``--steps`` steps on one table then the
other (the order alternates each round); prints the medians of ms per step (forward, backward,
step) and their ratio (goal <= 1.3x), the hit rate, the rows loaded per second on the spilled
table's misses (its page cache warm: the file's pages were just written), the rows per second
gathered at random from the mapped file after ``fdatasync`` and ``posix_fadvise(DONTNEED)``
(Linux does not drop pages a process still maps, so on a machine with memory to spare this is a
page-cache read, not a cold disk read), and the max |difference| of the two tables at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from edo_monitor.nn import CachedEmbedding
from edo_monitor.nn.spill import SpillFile

ZIPF_A = 1.3


def _batches(rows: int, batch: int, n: int, seed: int) -> list[torch.Tensor]:
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = gen.zipf(ZIPF_A, size=batch * 2)
        ids = ids[ids <= rows][:batch] - 1
        out.append(torch.from_numpy(ids.astype(np.int64)))
    return out


def _step(table: CachedEmbedding, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    table(ids).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--cache-fraction", type=float, default=0.45)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--spill-dir", default=None)
    a = ap.parse_args()
    folder = a.spill_dir or tempfile.mkdtemp(prefix="edo-disk-tier-")
    torch.manual_seed(0)
    w0 = torch.randn(a.rows, a.dim, dtype=torch.float64)
    cache_rows = int(a.rows * a.cache_fraction)
    sf = SpillFile(folder)
    host = CachedEmbedding(a.rows, a.dim, cache_rows, _weight=w0.clone(), dtype=torch.float64)
    disk = CachedEmbedding(a.rows, a.dim, cache_rows, _weight=w0.clone(), dtype=torch.float64,
                           host_alloc=sf.alloc)  # fmt: skip
    del w0
    tables = {"host memory": host, "disk tier": disk}
    opts = {k: torch.optim.Adam(t.parameters(), lr=0.01) for k, t in tables.items()}
    warm = _batches(a.rows, a.batch, a.warmup, seed=1)
    for ids in warm:
        for k, t in tables.items():
            _step(t, opts[k], ids)
    ms: dict[str, list[float]] = {k: [] for k in tables}
    misses0, hits0 = disk.stats().misses, disk.stats().hits
    disk_s = 0.0
    for r in range(a.rounds):
        batches = _batches(a.rows, a.batch, a.steps, seed=100 + r)
        order = list(tables) if r % 2 == 0 else list(tables)[::-1]
        for k in order:
            t0 = time.perf_counter()
            for ids in batches:
                _step(tables[k], opts[k], ids)
            dt = time.perf_counter() - t0
            ms[k].append(dt / a.steps * 1e3)
            if k == "disk tier":
                disk_s += dt
    st = disk.stats()
    loaded = st.misses - misses0
    hit_rate = (st.hits - hits0) / max(1, st.hits - hits0 + loaded)
    host.flush()
    disk.flush()
    err = (disk.full_weight() - host.full_weight()).abs().max().item()
    # a cold read: write the file's pages back, drop them, gather random rows
    mm = disk.host_weight
    fd = os.open(sf.path, os.O_RDONLY)
    try:
        os.fdatasync(os.open(sf.path, os.O_RDWR))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    idx = torch.randint(0, a.rows, (20_000,))
    t0 = time.perf_counter()
    _ = mm[idx].sum()
    cold_rows_s = idx.numel() / (time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"rows {a.rows} x {a.dim} float64, Adam, cache {cache_rows} rows, batch {a.batch}, "
          f"{a.rounds} rounds x {a.steps} steps, file {sf.size_bytes / 2**20:.0f} MiB")  # fmt: skip
    print(f"{'tier':<12} {'ms/step (median)':>17} {'per round':>40}")
    for k in tables:
        print(f"{k:<12} {med[k]:>17.2f}   " + " ".join(f"{x:.1f}" for x in ms[k]))
    print(f"ratio disk/host: {med['disk tier'] / med['host memory']:.3f}x (goal <= 1.3x)")
    print(f"hit rate of the timed steps (unique ids): {hit_rate:.1%}")
    print(f"rows loaded from the file on misses: {loaded / disk_s:,.0f} per second of steps "
          f"({loaded} rows in {disk_s:.2f} s of disk-tier steps)")  # fmt: skip
    print(f"random rows gathered from the mapped file: {cold_rows_s:,.0f} rows/s (see docstring)")
    print(f"max |disk - host| after training: {err:.3g}")
    sf.remove()


if __name__ == "__main__":
    main()
