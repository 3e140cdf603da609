"""Where the row cache's Adam step spends its time (issue 23): table 8's setup, profiled.

    python benchmarks/row_cache_profile.py [--rows 1000000] [--cache-rows 100000] [--warmup 300]
        [--steps 10] [--ops] [--eviction] [--device cuda]

``nn.Embedding(sparse=True)`` + ``SparseAdam`` and ``CachedEmbedding`` + ``Adam`` (100,000-row
cache, batch 4096 Zipf(1.05) ids, dim 64: ``benchmarks/row_cache.py``'s table 8) step the same
batches alternately after ``--warmup`` steps of the cache; the cached steps run under cProfile.
Prints the median step of each, their ratio, and milliseconds per step of the cache's parts
(cumulative: a part includes the parts it calls); ``--ops`` adds torch.profiler's table of the
operators of ``--steps`` more cached steps (self CPU time, largest first); ``--eviction`` times,
at every eviction of ``--steps`` more cached steps, the victim choice both ways on the same state:
one selection over every slot (``_evict_full``) and the kept order (``VictimOrder.choose``, its
refreshes included), medians and the order's mean. ``--device cuda``: both tables (the cache's
rows) on the GPU, the ids moved there in the step, each step ended by
``torch.cuda.synchronize()`` (a part that waits for the GPU counts the wait); ``--ops`` then
lists CUDA time too.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

import torch
from row_cache_timing import DIM, _zipf_batch
from torch import nn

from edo_monitor.nn import CachedEmbedding
from edo_monitor.surfaces import scripting

PARTS = (  # (file name, function): the cache's step, outermost first
    ("cache_rows.py", "_remap"),
    ("cache_rows.py", "_ensure"),
    ("cache_rows.py", "_evict"),
    ("cache_optimizer.py", "_take_rows"),
    ("catch_up.py", "_term_sums"),
    ("adam_series.py", "exact_sums"),
    ("adam_series.py", "horner_sums"),
    ("adam_series.py", "add_step"),
    ("cache_optimizer.py", "_step_rows"),
    ("graph.py", "_engine_run_backward"),
)


def _warmup_steps(text: str) -> int:
    """``type=`` for ``--warmup``: a whole number, 0 or more (the counts take
    ``scripting.positive_int``)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number, 0 or more")
    return value


def main() -> None:
    """Parse the options, run both tables and print the figures."""
    parser = scripting.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=scripting.positive_int, default=1_000_000, help="table rows")
    parser.add_argument("--warmup", type=_warmup_steps, default=300, help="warm-up steps")
    parser.add_argument("--steps", type=scripting.positive_int, default=10, help="profiled steps")
    parser.add_argument("--cache-rows", type=scripting.positive_int, default=100_000, help="cache")
    parser.add_argument("--ops", action="store_true", help="also torch.profiler's operators")
    parser.add_argument("--eviction", action="store_true", help="also time the victim choice")
    parser.add_argument(
        "--device", type=scripting.torch_device, default="cpu", help="cpu (default) or cuda[:N]"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    sparse = nn.Embedding(args.rows, DIM, sparse=True)
    weight = sparse.weight.detach().clone()
    sparse = sparse.to(device)
    sparse_opt = torch.optim.SparseAdam(sparse.parameters(), lr=1e-3)
    cached = CachedEmbedding(args.rows, DIM, args.cache_rows, _weight=weight, device=device)
    cached_opt = torch.optim.Adam(cached.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step(module: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
        t0 = time.perf_counter()
        module(ids.to(device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step(cached, cached_opt, _zipf_batch(args.rows, 4096, gen))
    for _ in range(5 if cuda else 0):  # the sparse table's kernels start up
        step(sparse, sparse_opt, _zipf_batch(args.rows, 4096, gen))
    profile = cProfile.Profile()
    times: dict[str, list[float]] = {"sparse": [], "cached": []}
    for _ in range(args.steps):
        ids = _zipf_batch(args.rows, 4096, gen)
        times["sparse"].append(step(sparse, sparse_opt, ids))
        profile.enable()
        times["cached"].append(step(cached, cached_opt, ids))
        profile.disable()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"rows {args.rows:,}, {args.steps} steps after {args.warmup}: sparse Adam "
        f"{med['sparse'] * 1e3:.2f} ms, cached Adam {med['cached'] * 1e3:.2f} ms (under "
        f"cProfile), cached / sparse {med['cached'] / med['sparse']:.2f}\n"
    )
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    print("| part of the cached step | ms a step |\n|---|--:|")
    for file, func in PARTS:
        total = sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(file) and fn == func)
        print(f"| {file}:{func} | {total / args.steps * 1e3:.2f} |")
    if args.ops:  # a second pass: the cached table alone, --steps more steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as ops:
            for _ in range(args.steps):
                step(cached, cached_opt, _zipf_batch(args.rows, 4096, gen))
        print(ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))
    if args.eviction:
        _time_eviction(cached, cached_opt, args, gen)


def _time_eviction(
    cached: CachedEmbedding, opt: torch.optim.Optimizer, args: argparse.Namespace, gen: Any
) -> None:
    """Time both victim choices at every eviction of ``args.steps`` steps (the same state)."""
    full_s: list[float] = []
    order_s: list[float] = []
    needs: list[int] = []
    evict = cached._evict

    def timed(count: int, keep: torch.Tensor) -> torch.Tensor:
        limits, inside = cached._eviction_limits(keep)
        t0 = time.perf_counter()
        cached._evict_full(count, limits)
        t1 = time.perf_counter()
        cached._victim_order.choose(cached, count, limits, inside)
        full_s.append(t1 - t0)
        order_s.append(time.perf_counter() - t1)
        needs.append(count)
        return evict(count, keep)

    cached._evict = timed  # type: ignore[method-assign]
    for _ in range(args.steps):
        cached(_zipf_batch(args.rows, 4096, gen).to(cached.weight.device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    cached._evict = evict  # type: ignore[method-assign]
    used = int((cached.slot_to_block >= 0).sum())
    print(
        f"\nvictim choice, {len(needs)} evictions of {statistics.median(needs):.0f} slots "
        f"(median), cache {cached.cache_rows:,} rows ({used:,} used): one selection over every "
        f"slot {statistics.median(full_s) * 1e3:.3f} ms, victim order "
        f"{statistics.median(order_s) * 1e3:.3f} ms (mean {statistics.mean(order_s) * 1e3:.3f} "
        f"ms, its refreshes included)"
    )


if __name__ == "__main__":
    main()
