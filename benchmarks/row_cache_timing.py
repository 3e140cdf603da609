"""Step times of the row cache (tables 2, 3, 7 and 8 of ``benchmarks/row_cache.py``): Adam steps of
resident, cached and offloaded tables against table size, a fixed cache over growing tables, a
cache holding the whole table against resident, and the lazy fused step against sparse Adam.
Every comparison is side by side in one run (the same batches, rotated order, medians)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.nn import (
    CachedEmbedding,
    CachedEmbeddingBag,
    CachedTable,
    EmbeddingOptions,
    OffloadedEmbedding,
)
from edo_monitor.probes.cuda import device_waits

DIM = 64  # embedding columns of every timed table


def _zipf_batch(rows: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    # zipf by rank, ranks scattered by a fixed hash so hot rows are not contiguous
    u = torch.rand(batch, generator=gen, dtype=torch.float64)
    ranks = torch.clamp((rows ** (1 - 1.05) - 1) * u + 1, min=1e-300) ** (1 / (1 - 1.05))
    ranks = torch.clamp(ranks.long() - 1, 0, rows - 1)
    return (ranks * 2_654_435_761) % rows


def step_time(
    make: Callable[[], nn.Module], rows: int, batch: int, steps: int, warmup: int = 2
) -> tuple[float, float | None]:
    """Median seconds of forward + backward + Adam step over ``steps`` steps after ``warmup``
    steps, and the misses (unique rows loaded) per timed step of a cached table (else None)."""
    module = make()
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    times = []
    misses0 = 0
    for i in range(warmup + steps):
        if i == warmup and isinstance(module, CachedTable):
            misses0 = module.stats().misses
        ids = _zipf_batch(rows, batch, gen)
        offsets = torch.arange(0, batch, 8)
        t0 = time.perf_counter()
        loss = module(ids, offsets).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    misses = None
    if isinstance(module, CachedTable):
        misses = (module.stats().misses - misses0) / steps
    del module, opt
    gc.collect()
    return statistics.median(times), misses


def _bag(rows: int) -> nn.EmbeddingBag:
    torch.manual_seed(0)
    return nn.EmbeddingBag(rows, DIM, mode="sum")


def _offloaded(rows: int) -> nn.Module:
    src = _bag(rows)
    w = src.weight
    OffloadedEmbedding.offload_parameter(w)
    return OffloadedEmbedding(w, EmbeddingOptions.from_module(src), "cpu")


def _cached(rows: int, cache_rows: int) -> nn.Module:
    torch.manual_seed(0)
    return CachedEmbeddingBag(rows, DIM, cache_rows, mode="sum")


def fixed_cache_scaling(
    sizes: list[int], cache_rows: int, batch: int, warmup: int, steps: int
) -> list[dict[str, float]]:
    """One cached table of ``cache_rows`` rows per size in ``sizes`` (all in memory at once),
    stepped alternately (Adam; which goes first rotates) so load on the machine hits every size
    alike. Each is stepped until its cache is full (no free slot) and ``warmup`` steps more
    (Adam's catch-up window is 181 steps in float32: rows coming back then have missed up to
    that many), then ``steps`` timed rounds. Per size: ``rows``, ``median_s`` (whole step),
    ``fwd_s`` (forward: the cache's bookkeeping and row moves), ``misses``, ``evicted`` (per
    timed step), ``ratio`` (median over the smallest size's) and ``ratio_paired`` (median of
    the per-round ratios to the smallest size)."""
    tables, opts, gens = [], [], []
    for rows in sizes:
        tables.append(_cached(rows, min(rows, cache_rows)))
        opts.append(torch.optim.Adam(tables[-1].parameters(), lr=1e-3))
        gens.append(torch.Generator().manual_seed(0))
    offsets = torch.arange(0, batch, 8)

    def step(k: int) -> tuple[float, float]:
        ids = _zipf_batch(sizes[k], batch, gens[k])
        t0 = time.perf_counter()
        out = tables[k](ids, offsets)
        t1 = time.perf_counter()
        out.pow(2).mean().backward()
        opts[k].step()
        opts[k].zero_grad()
        return time.perf_counter() - t0, t1 - t0

    for k, table in enumerate(tables):
        while bool((table.slot_to_block < 0).any()):
            step(k)
    for _ in range(warmup):
        for k in range(len(tables)):
            step(k)
    before = [t.stats() for t in tables]
    times: list[list[tuple[float, float]]] = [[] for _ in tables]
    for i in range(steps):
        order = list(range(len(tables)))
        order = order[i % len(order) :] + order[: i % len(order)]
        for k in order:
            times[k].append(step(k))
    out = []
    for k, rows in enumerate(sizes):
        st = tables[k].stats()
        out.append(
            {
                "rows": rows,
                "median_s": statistics.median(t for t, _ in times[k]),
                "fwd_s": statistics.median(f for _, f in times[k]),
                "misses": (st.misses - before[k].misses) / steps,
                "evicted": (st.evicted - before[k].evicted) / steps,
            }
        )
    for k, res in enumerate(out):
        res["ratio"] = res["median_s"] / out[0]["median_s"]
        res["ratio_paired"] = statistics.median(
            a / b for (a, _), (b, _) in zip(times[k], times[0], strict=True)
        )
    return out


def full_cache_overhead(rows: int, batch: int, steps: int, counter: bool) -> dict[str, float]:
    """A cache of every row (warm-started: 100 % hits) and a resident twin, stepped alternately
    (Adam, the same batches; which goes first alternates too). Medians in seconds: ``{variant}``
    (whole step), ``{variant}_fwd/_bwd/_step``; ``ratio`` (of the medians), ``ratio_paired``
    (median of the per-step ratios), ``max_diff`` (max |cached - resident| after the run: 0 when
    the cache does the same arithmetic)."""
    resident = _bag(rows)
    cached = CachedEmbeddingBag(
        rows, DIM, rows, mode="sum", _weight=resident.weight.detach().clone(),
        id_frequencies=torch.ones(rows, dtype=torch.int64),
    )  # fmt: skip
    modules = {"resident": resident, "cached": cached}
    counters = []
    if counter:
        for m in modules.values():
            counters.append(LookupCounter())
            counters[-1].watch("table", m)
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in modules.items()}
    gen = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, batch, 8)
    parts: dict[str, list[tuple[float, float, float]]] = {k: [] for k in modules}
    for i in range(steps + 3):
        ids = _zipf_batch(rows, batch, gen)
        names = list(modules) if i % 2 else list(reversed(modules))
        for name in names:
            t0 = time.perf_counter()
            out = modules[name](ids, offsets)
            t1 = time.perf_counter()
            out.pow(2).mean().backward()
            t2 = time.perf_counter()
            opts[name].step()
            opts[name].zero_grad()
            t3 = time.perf_counter()
            if i >= 3:
                parts[name].append((t1 - t0, t2 - t1, t3 - t2))
    res: dict[str, float] = {}
    for name, p in parts.items():
        res[name] = statistics.median(sum(x) for x in p)
        for j, part in enumerate(("fwd", "bwd", "step")):
            res[f"{name}_{part}"] = statistics.median(x[j] for x in p)
    res["ratio"] = res["cached"] / res["resident"]
    res["ratio_paired"] = statistics.median(
        sum(c) / sum(r) for c, r in zip(parts["cached"], parts["resident"], strict=True)
    )
    res["max_diff"] = float((cached.full_weight() - resident.weight.detach()).abs().max())
    for c in counters:
        c.close()
    return res


def sparse_comparison(
    rows: int,
    cache_rows: int,
    batch: int,
    warmup: int,
    steps: int,
    resident: bool,
    device: str = "cpu",
    dim: int = DIM,
) -> dict[str, float]:
    """Issue 23's table: ``nn.Embedding(sparse=True)`` + ``SparseAdam`` against
    ``CachedEmbedding`` + ``Adam`` (``cache_rows`` rows; and a resident dense ``nn.Embedding``
    + ``Adam`` when ``resident``), the same Zipf batches, stepped alternately with the order
    rotated each round, after ``warmup`` steps (the cache full and Adam's float32 catch-up
    window of 181 steps passed). Medians in seconds per step (forward + backward + step +
    zero_grad), and ``paired``: the median over rounds of the round's cached / sparse (the two
    steps of a round run back to back, so load that drifts over the run hits both alike).
    ``device="cuda"``: the tables (the cache's rows) on the GPU, the ids moved there inside the
    timed step, the clock read after ``torch.cuda.synchronize()``; the host table stays on the
    host, and the other tables get 5 warm-up steps each (kernel start-up). ``dim``: the tables'
    columns (1 leaves mostly the per-step bookkeeping and operator calls: what bounds a step on
    a GPU, where the arithmetic is nearly free)."""
    torch.manual_seed(0)
    made: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    sparse = nn.Embedding(rows, dim, sparse=True)
    host_weight = sparse.weight.detach().clone()
    sparse = sparse.to(device)
    made["sparse"] = (sparse, torch.optim.SparseAdam(sparse.parameters(), lr=1e-3))
    cached = CachedEmbedding(rows, dim, cache_rows, _weight=host_weight, device=device)
    made["cached"] = (cached, torch.optim.Adam(cached.parameters(), lr=1e-3))
    if resident:
        dense = nn.Embedding(rows, dim, device=device)
        made["resident"] = (dense, torch.optim.Adam(dense.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(0)
    cuda = torch.device(device).type == "cuda"

    def step(name: str, ids: torch.Tensor) -> float:
        module, opt = made[name]
        t0 = time.perf_counter()
        module(ids.to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(warmup):
        step("cached", _zipf_batch(rows, batch, gen))
    if cuda:
        for name in made:
            for _ in range(5):
                step(name, _zipf_batch(rows, batch, gen))
    times: dict[str, list[float]] = {k: [] for k in made}
    names = list(made)
    for i in range(steps):
        ids = _zipf_batch(rows, batch, gen)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(step(name, ids))
    out = {k: statistics.median(v) for k, v in times.items()}
    out["paired"] = statistics.median(
        c / s for c, s in zip(times["cached"], times["sparse"], strict=True)
    )
    out["unique"] = float(torch.unique(ids).numel())
    if cuda:  # waits for the device a step, each table: 5 more steps, not timed
        for name in names:
            module, opt = made[name]

            def untimed(module: nn.Module = module, opt: torch.optim.Optimizer = opt) -> None:
                for _ in range(5):
                    module(_zipf_batch(rows, batch, gen).to(device)).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()

            out[f"{name}_waits"] = device_waits(untimed) / 5
    return out
