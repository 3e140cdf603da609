"""Row cache figures: hit rates and their bounds, step time against table size, 100 %-hit overhead.

    python benchmarks/row_cache.py --data ../shared/data/movielens-small

Prints ten tables (each measured side by side in one run; ``--skip`` leaves tables out):

1. hit rate of :class:`edo_monitor.nn.CachedTable` (LFU, LRU; rows moved one by one) at caches
   of 1, 5, 10 and 25 % of the rows, on MovieLens item ids in rating-time order (batches of at most
   1,024 ratings) and on a Zipf(1.05) stream of ``--zipf-ids`` ids over ``--zipf-rows`` rows
   (batches of ``--zipf-batch``), each batch at most half the cache (one batch's rows must fit).
   The stream goes through the real module (``no_grad`` forwards of a 1-column table: the
   replacement logic a training step runs, without the row arithmetic); ms per forward of the
   bookkeeping;
2. Adam step time (forward, backward, step) at a fixed batch against table size, ``--sizes`` rows
   x 64: resident ``nn.EmbeddingBag``, cached at 10 % of the table, cached at a fixed
   ``--cache-rows``, offloaded (``OffloadedEmbedding``), one after the other; cached variants
   warm up ``--warmup`` steps first (not always enough to fill the cache: table 7 measures the
   fixed cache at steady state); misses per timed step;
3. a cache holding the whole table (100 % hits) against resident, stepped alternately on the same
   batches (bare, and with the agent's ``LookupCounter`` on both tables as ``watch()`` installs
   it): medians of forward, backward, step; ratio;
4. max relative difference (max |cached - twin| / max |twin|) of the table after 200 steps
   against a resident twin, per optimizer, in float32 and float64;
5. upper bounds on the hit rate of any cache of that size on the table 1 streams, same batching:
   a static cache of the most frequent rows in hindsight (share of lookups / of a batch's unique
   ids going to them), Belady's furthest-next-use eviction (the optimal replacement for the unique
   ids hit rate: no policy does better), and a cache of every row (only first uses miss).
   ``--bounds-zipf`` adds the Zipf stream (Belady runs in Python: about a minute a size);
6. chunked moves (aligned 512- and 2048-row chunks, LFU; ids as they are and renumbered by
   frequency rank in hindsight, the best layout chunks can have) from a 10 % cache that grows
   until one batch's chunks fit, against rows moved one by one in a cache of the size the chunks
   needed: cache size, hit rates, rows loaded;
7. the step time of a cache of a fixed ``--cache-rows`` rows over tables of ``--sizes`` rows, all
   in memory at once and stepped alternately, each at steady state (cache full, then
   ``--fixed-warmup`` steps); the goal's figure for "the step does not depend on the table".
8. cached (lazy fused step) against ``nn.Embedding(sparse=True)`` + ``SparseAdam`` (issue 23): the
   ratio of the medians and the median of the rounds' ratios (paired: drift hits both alike);
9. hit rate (unique ids, every load a miss) of LRU, LFU, LFU through
   :class:`edo_monitor.nn.LookAhead` (``--ahead`` batches) and Belady, on MovieLens in time and
   in file order and a Zipf(1.05) stream of ``--la-zipf-ids`` ids over ``--la-zipf-rows`` rows, at
   1/5/10/25 % caches (table 1's batching); rows loaded on the critical path (inside the forward,
   or for a batch at its own ``next()``) as % of lookups; ms per batch of the bookkeeping;
10. device bytes per cache row, measured (the cache's weight and the optimizer's state of it over
    the cache rows) against ``(1 + optimizer state) x row``, and the touched rows' gradient.

The streams and the hit-rate bounds are in ``row_cache_streams.py``, the step-time measurements
(tables 2, 3, 7, 8) in ``row_cache_timing.py``; this file runs the tables and prints them.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from row_cache_streams import (
    batch_for,
    belady_hit_rates,
    by_rank,
    movielens_items,
    static_bounds,
    window_oracle_hit_rate,
    zipf_stream,
)
from row_cache_timing import (
    DIM,
    _bag,
    _cached,
    _offloaded,
    fixed_cache_scaling,
    full_cache_overhead,
    sparse_comparison,
    step_time,
)
from torch import nn

from edo_monitor.nn import (
    CachedEmbedding,
    CachedTable,
    LookAhead,
)

VARIANTS = ("resident", "cached10", "cached", "offloaded")


def lookahead_rates(
    stream: torch.Tensor, rows: int, cache_rows: int, batch: int, ahead: int | None, policy: str
) -> tuple[float, float, float]:
    """(unique-id hit rate, critical-path loads / lookups, ms per batch) of a 1-column table fed
    ``stream`` in batches, plain (``ahead=None``) or through ``LookAhead(ahead)``. The hit rate
    is ``stats().hit_rate``, every load a miss, staged or not (``1 - loads / unique ids``, which
    this benchmark computed itself while a staged row counted as a hit too: the same figures);
    critical-path loads: inside the forward, or (look-ahead) at the batch's own ``next()``
    (``late_loads``)."""
    table = CachedEmbedding(rows, 1, cache_rows, policy=policy, _freeze=True, overflow="error")
    batches = [stream[s : s + batch] for s in range(0, stream.numel(), batch)]
    source = batches if ahead is None else LookAhead(batches, ahead, lambda b: b, table)
    t0 = time.perf_counter()
    with torch.no_grad():
        for ids in source:
            table(ids)
    ms = (time.perf_counter() - t0) / len(batches) * 1e3
    st = table.stats()
    critical = st.forward_loads + (source.late_loads if ahead is not None else 0)
    return st.hit_rate or 0.0, critical / st.lookups, ms


def device_row_bytes() -> list[tuple[str, int, int, int]]:
    """Per optimizer: (name, device bytes per cache row measured after 5 steps — the cache's
    ``weight`` and the optimizer's state tensors of it over ``cache_rows``; ``batch_rows`` is
    (touched rows, D) and reported apart —, ``(1 + state) x row`` bytes, the touched rows'
    gradient bytes)."""
    out = []
    makers = {  # name: (optimizer, per-row state tensors it keeps: momentum, sum, moments)
        "SGD": (lambda p: torch.optim.SGD(p, lr=0.1), 0),
        "SGD momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
        "Adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.1), 1),
        "Adam": (lambda p: torch.optim.Adam(p, lr=0.01), 2),
        "Adam amsgrad": (lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True), 3),
    }
    gen = torch.Generator().manual_seed(0)
    for name, (make, state_rows) in makers.items():
        table = CachedEmbedding(100_000, DIM, 10_000)
        opt = make([table.weight])
        for _ in range(5):
            opt.zero_grad()
            ids = torch.randint(0, 100_000, (1024,), generator=gen)
            table(ids).sum().backward()
            grad_bytes = table.batch_rows.grad.numel() * table.batch_rows.grad.element_size()
            opt.step()
        state = [v for v in opt.state[table.weight].values() if isinstance(v, torch.Tensor)]
        tensors = [table.weight.detach(), *(v for v in state if v.dim() == 2)]
        measured = sum(t.numel() * t.element_size() for t in tensors) // table.cache_rows
        row = DIM * table.weight.element_size()
        out.append((name, measured, row * (1 + state_rows), grad_bytes))
    return out


def _run_stream(table: CachedTable, ids: torch.Tensor, batch: int) -> float:
    """Feeds ``ids`` in batches through ``table`` (``no_grad``); ms per forward."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(ids), batch):
            table(ids[start : start + batch])
    return (time.perf_counter() - t0) / -(-len(ids) // batch) * 1e3


def hit_rates(stream: torch.Tensor, rows: int, max_batch: int) -> list[tuple]:
    """Per cache size and policy (LFU, LRU; row by row): (fraction, policy, batch, unique-id hit
    rate, lookup hit rate, ms per forward)."""
    out = []
    for fraction in (0.01, 0.05, 0.10, 0.25):
        batch = batch_for(rows, fraction, max_batch)
        for policy in ("lfu", "lru"):
            table = CachedEmbedding(
                rows, 1, int(rows * fraction), policy=policy, _freeze=True, overflow="error"
            )
            ms = _run_stream(table, stream, batch)
            st = table.stats()
            out.append((fraction, policy, batch, st.hit_rate, st.lookup_hit_rate, ms))
    return out


def chunk_rates(stream: torch.Tensor, rows: int, max_batch: int) -> list[tuple]:
    """Chunked moves (LFU, aligned 512- and 2048-row chunks; ids as they are and renumbered by
    frequency rank) from a 10 % cache that grows whenever a batch's chunks do not fit, then rows
    (LFU) in a cache of the size the chunks grew to, same batches (the 10 % batch of table 1).
    Per run: (moves, ids, batch, cache rows at the end, hit rate of unique ids (of chunks when
    chunked), lookup hit rate, rows loaded, ms per forward)."""
    batch = batch_for(rows, 0.10, max_batch)
    ranked = by_rank(stream, rows)
    logger = logging.getLogger("edo_monitor.nn.cached")
    level = logger.level
    logger.setLevel(logging.ERROR)  # one growth warning a batch otherwise
    out = []

    def run(block: int, ids: torch.Tensor, cache_rows: int, name: str) -> int:
        table = CachedEmbedding(
            rows, 1, cache_rows, block_rows=block, _freeze=True, overflow="grow"
        )
        ms = _run_stream(table, ids, batch)
        st = table.stats()
        moved = st.h2d_bytes // table.weight.element_size()  # 1 column, no optimizer state
        moves = "row" if block == 1 else f"chunk {block}"
        out.append((moves, name, batch, st.cache_rows, st.hit_rate, st.lookup_hit_rate, moved, ms))
        return st.cache_rows

    try:
        for block in (512, 2048):
            for name, ids in (("as stored", stream), ("by rank", ranked)):
                grown = run(block, ids, max(block, rows // 10), name)
                run(1, ids, grown, name)  # rows in a cache of the size the chunks needed
    finally:
        logger.setLevel(level)
    return out


# ----------------------------------------------------------------------------- exactness
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05),
    "SGD weight_decay=0.01": lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.01),
    "SGD momentum=0.9": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "SGD nesterov, wd=0.01": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "Adam amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "AdamW wd=0.01": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01),
}


def exactness(make_opt: Callable, dtype: torch.dtype, steps: int = 200) -> tuple[float, float]:
    """``(max |cached - twin|, max |twin - float64 twin|)``, each over ``max |twin|``, after
    ``steps`` steps (1,000 rows, 10 % cache, StepLR): the cached table against a resident twin of
    its dtype, and that twin's own rounding against a float64 twin of the same start and batches
    (0 for float64)."""
    rows, d = 1000, 16
    torch.manual_seed(0)
    base = torch.randn(rows, d, dtype=dtype)
    twin = nn.Embedding.from_pretrained(base.clone(), freeze=False)
    cached = CachedEmbedding(rows, d, rows // 10, _weight=base.clone())
    models = [twin, cached]
    if dtype != torch.float64:
        models.append(nn.Embedding.from_pretrained(base.double(), freeze=False))
    runs = []
    for m in models:
        opt = make_opt([m.weight])
        runs.append((m, opt, torch.optim.lr_scheduler.StepLR(opt, 50, 0.5)))
    gen = torch.Generator().manual_seed(1)
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
    for _ in range(steps):
        ids = torch.multinomial(probs, 64, replacement=True, generator=gen)
        target = torch.randn(64, d, generator=gen, dtype=dtype)
        for m, opt, sched in runs:
            opt.zero_grad()
            ((m(ids) - target.to(m.weight.dtype)) ** 2).sum().backward()
            opt.step()
            sched.step()
    ref = twin.weight.detach()
    scale = ref.abs().max()
    vs_twin = float((cached.full_weight() - ref).abs().max() / scale)
    if len(models) == 2:
        return vs_twin, 0.0
    return vs_twin, float((ref.double() - models[2].weight.detach()).abs().max() / scale)


# ----------------------------------------------------------------------------- main
def _lookahead_streams(args: argparse.Namespace) -> list[tuple[str, torch.Tensor, int, int]]:
    streams = []
    if (args.data / "ratings.csv").is_file():
        for time_order in (True, False):
            items, n_items = movielens_items(args.data, time_order)
            order = "time order" if time_order else "file order"
            streams.append((f"MovieLens items, {order}", items, n_items, 1024))
    else:
        print(f"(MovieLens not found at {args.data}: its rows are left out)")
    z = zipf_stream(args.la_zipf_rows, args.la_zipf_ids)
    name = f"Zipf(1.05), {args.la_zipf_ids:,} ids over {args.la_zipf_rows:,} rows"
    streams.append((name, z, args.la_zipf_rows, args.zipf_batch))
    return streams


def _streams(args: argparse.Namespace) -> list[tuple[str, torch.Tensor, int, int]]:
    streams = []
    if (args.data / "ratings.csv").is_file():
        items, n_items = movielens_items(args.data)
        streams.append(("MovieLens items, time order", items, n_items, 1024))
    else:
        print(f"(MovieLens not found at {args.data}: its rows are left out)")
    z = zipf_stream(args.zipf_rows, args.zipf_ids)
    streams.append((f"Zipf(1.05), {args.zipf_ids:,} ids", z, args.zipf_rows, args.zipf_batch))
    return streams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/movielens-small"))
    parser.add_argument("--zipf-ids", type=int, default=10_000_000)
    parser.add_argument("--zipf-rows", type=int, default=1_000_000)
    parser.add_argument("--zipf-batch", type=int, default=4096, help="ids per Zipf batch (1, 5)")
    parser.add_argument("--sizes", default="1000000,4000000,8000000")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="table 2 columns")
    parser.add_argument("--cache-rows", type=int, default=100_000, help="fixed cache, table 2")
    parser.add_argument("--batch", type=int, default=4096, help="ids per step in tables 2 and 3")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=60, help="warm-up steps of cached tables")
    parser.add_argument("--fixed-warmup", type=int, default=300, help="table 7 warm-up steps")
    parser.add_argument("--fixed-steps", type=int, default=20, help="table 7 timed rounds")
    parser.add_argument("--hit-steps", type=int, default=40, help="timed steps per table 3 row")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--bounds-zipf", action="store_true", help="table 5 for Zipf too")
    parser.add_argument("--skip", default="", help="comma list of tables to skip (1,...,8)")
    parser.add_argument("--sparse-sizes", default="1000000,8000000", help="table 8 sizes")
    parser.add_argument("--sparse-warmup", type=int, default=300, help="table 8 warm-up steps")
    parser.add_argument("--sparse-steps", type=int, default=60, help="table 8 timed rounds")
    parser.add_argument("--ahead", type=int, default=8, help="table 9 look-ahead window")
    parser.add_argument("--la-zipf-ids", type=int, default=1_000_000, help="table 9 Zipf ids")
    parser.add_argument("--la-zipf-rows", type=int, default=100_000, help="table 9 Zipf rows")
    args = parser.parse_args()
    skip = set(args.skip.split(",")) if args.skip else set()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(unknown)}; expected some of {VARIANTS}")
    torch.set_num_threads(args.threads)
    streams = _streams(args) if not {"1", "5", "6"} <= skip else []

    if "1" not in skip:
        print("\n## 1. Hit rate (unique ids per batch found in the cache), rows moved one by one\n")
        print(
            "| stream | rows | cache | batch | policy | hit rate (unique ids) | "
            "hit rate (lookups) | ms / forward |"
        )
        print("|---|---:|---:|---:|---|---:|---:|---:|")
        for name, stream, rows, max_batch in streams:
            for fraction, policy, batch, rate, lookup_rate, ms in hit_rates(
                stream, rows, max_batch
            ):
                print(
                    f"| {name} | {rows:,} | {fraction:.0%} | {batch} | {policy.upper()} | "
                    f"{rate:.1%} | {lookup_rate:.1%} | {ms:.2f} |",
                    flush=True,
                )

    if "8" not in skip:
        print(
            f"\n## 8. Cached (lazy fused step) against sparse Adam, batch {args.batch} Zipf ids, "
            f"dim {DIM}, {args.cache_rows:,}-row cache, rotated order, medians of "
            f"{args.sparse_steps} rounds after {args.sparse_warmup} warm-up steps\n"
        )
        print(
            "| rows | sparse Adam s | cached Adam s | cached / sparse | cached / sparse, paired "
            "| resident Adam s | cached / resident | unique ids / batch |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        first_cached = None
        for i, rows in enumerate(int(x) for x in args.sparse_sizes.split(",")):
            r = sparse_comparison(
                rows, args.cache_rows, args.batch, args.sparse_warmup, args.sparse_steps, i == 0
            )
            first_cached = first_cached or r["cached"]
            res = f"{r['resident']:.4f} | {r['cached'] / r['resident']:.2f}" if i == 0 else "– | –"
            print(
                f"| {rows:,} | {r['sparse']:.4f} | {r['cached']:.4f} | "
                f"{r['cached'] / r['sparse']:.2f} | {r['paired']:.2f} | {res} | "
                f"{r['unique']:,.0f} |",
                flush=True,
            )
            gc.collect()
        print(
            f"\ncached at the largest / at the smallest size: see the rows above "
            f"(smallest {first_cached:.4f} s)"
        )

    if "2" not in skip:
        print(f"\n## 2. Adam step time (s), batch {args.batch} ids in bags of 8, dim {DIM}\n")
        names = {
            "resident": "resident",
            "cached10": "cached 10 %",
            "cached": f"cached {args.cache_rows:,} rows",
            "offloaded": "offloaded",
        }
        cols = [names[v] for v in variants]
        extra = [f"{names[v]} / at smallest" for v in variants if v.startswith("cached")]
        misses = [f"misses / step, {names[v]}" for v in variants if v.startswith("cached")]
        print("| rows | " + " | ".join(cols + extra + misses) + " |")
        print("|---:|" + "---:|" * len(cols + extra + misses))
        first: dict[str, float] = {}
        for rows in (int(s) for s in args.sizes.split(",")):
            makers = {
                "resident": lambda rows=rows: _bag(rows),
                "cached10": lambda rows=rows: _cached(rows, max(1, rows // 10)),
                "cached": lambda rows=rows: _cached(rows, min(rows, args.cache_rows)),
                "offloaded": lambda rows=rows: _offloaded(rows),
            }
            times, ratios, miss = [], [], []
            for v in variants:
                warm = args.warmup if v.startswith("cached") else 2
                t, m = step_time(makers[v], rows, args.batch, args.steps, warm)
                times.append(f"{t:.3f}")
                if v.startswith("cached"):
                    first.setdefault(v, t)
                    ratios.append(f"{t / first[v]:.2f}")
                    miss.append(f"{m:,.0f}")
            print(f"| {rows:,} | " + " | ".join(times + ratios + miss) + " |", flush=True)

    if "7" not in skip:
        sizes = [int(x) for x in args.sizes.split(",")]
        print(
            f"\n## 7. A cache of {args.cache_rows:,} rows against table size, stepped alternately "
            f"(Adam, batch {args.batch} ids in bags of 8, dim {DIM}; each cache full, then "
            f"{args.fixed_warmup} steps more; medians of {args.fixed_steps} rounds)\n"
        )
        print(
            "| rows | step s | forward s | misses / step | evicted / step | ratio to smallest | "
            "ratio to smallest, paired |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in fixed_cache_scaling(
            sizes, args.cache_rows, args.batch, args.fixed_warmup, args.fixed_steps
        ):
            print(
                f"| {r['rows']:,} | {r['median_s']:.3f} | {r['fwd_s']:.3f} | {r['misses']:,.0f} | "
                f"{r['evicted']:,.0f} | {r['ratio']:.2f} | {r['ratio_paired']:.2f} |",
                flush=True,
            )

    if "3" not in skip:
        rows = 100_000
        print(
            f"\n## 3. Whole table cached (100 % hits) vs resident, {rows:,} x {DIM}, Adam, "
            f"batch {args.batch}, stepped alternately, medians of {args.hit_steps} steps (ms)\n"
        )
        print(
            "| lookup counter | resident fwd / bwd / step | cached fwd / bwd / step | resident | "
            "cached | ratio | ratio, paired | max abs diff |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for counter in (False, True):
            r = full_cache_overhead(rows, args.batch, args.hit_steps, counter)

            def parts(name: str, r: dict[str, float] = r) -> str:
                return " / ".join(f"{r[f'{name}_{p}'] * 1e3:.1f}" for p in ("fwd", "bwd", "step"))

            print(
                f"| {'on both' if counter else 'none'} | {parts('resident')} | {parts('cached')} "
                f"| {r['resident'] * 1e3:.1f} | {r['cached'] * 1e3:.1f} | {r['ratio']:.2f} | "
                f"{r['ratio_paired']:.2f} | {r['max_diff']:.1e} |",
                flush=True,
            )

    if "4" not in skip:
        print("\n## 4. Exactness after 200 steps (max |cached - twin| / max |twin|)\n")
        print("| optimizer | float32 | float32 twin vs float64 twin | float64 |")
        print("|---|---:|---:|---:|")
        for name, make in OPTIMIZERS.items():
            f32, twin_rounding = exactness(make, torch.float32)
            f64, _ = exactness(make, torch.float64)
            print(f"| {name} | {f32:.1e} | {twin_rounding:.1e} | {f64:.1e} |", flush=True)

    if "5" not in skip:
        print("\n## 5. Upper bounds on the hit rate (same streams and batches as table 1)\n")
        print(
            "| stream | cache | batch | static top rows: lookups | static top rows: unique ids "
            "| Belady: unique ids | Belady: lookups | every row cached: unique ids | "
            "every row cached: lookups |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, stream, rows, max_batch in streams:
            if name.startswith("Zipf") and not args.bounds_zipf:
                continue
            for fraction in (0.01, 0.05, 0.10, 0.25):
                batch = batch_for(rows, fraction, max_batch)
                cache_rows = int(rows * fraction)
                s = static_bounds(stream, cache_rows, batch)
                b_unique, b_lookups = belady_hit_rates(stream, cache_rows, batch)
                print(
                    f"| {name} | {fraction:.0%} | {batch} | {s['static_lookups']:.1%} | "
                    f"{s['static_unique']:.1%} | {b_unique:.1%} | {b_lookups:.1%} | "
                    f"{s['every_row_unique']:.1%} | {s['every_row_lookups']:.1%} |",
                    flush=True,
                )

    if "9" not in skip:
        print(
            f"\n## 9. Hit rate (unique ids) with and without LookAhead(ahead={args.ahead}) "
            "against LRU, LFU and Belady; rows loaded on the critical path (inside the forward, "
            "or at the batch's own next()), % of lookups\n"
        )
        print(
            "| stream | cache | batch | LRU | LFU | LFU + look-ahead | Belady | look-ahead / "
            "Belady | window oracle / Belady | critical loads: LFU | critical loads: look-ahead | "
            "ms / batch: LFU | ms / batch: look-ahead |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, stream, rows, max_batch in _lookahead_streams(args):
            for fraction in (0.01, 0.05, 0.10, 0.25):
                batch = batch_for(rows, fraction, max_batch)
                cache_rows = int(rows * fraction)
                lru = lookahead_rates(stream, rows, cache_rows, batch, None, "lru")
                lfu = lookahead_rates(stream, rows, cache_rows, batch, None, "lfu")
                la = lookahead_rates(stream, rows, cache_rows, batch, args.ahead, "lfu")
                best, _ = belady_hit_rates(stream, cache_rows, batch)
                oracle = window_oracle_hit_rate(stream, cache_rows, batch, args.ahead)
                print(
                    f"| {name} | {fraction:.0%} | {batch} | {lru[0]:.1%} | {lfu[0]:.1%} | "
                    f"{la[0]:.1%} | {best:.1%} | {la[0] / best:.1%} | {oracle / best:.1%} | "
                    f"{lfu[1]:.2%} | "
                    f"{la[1]:.2%} | {lfu[2]:.2f} | {la[2]:.2f} |",
                    flush=True,
                )

    if "10" not in skip:
        print("\n## 10. Device bytes per cache row (dim 64, float32)\n")
        print(
            "| optimizer | measured: weight + state / cache rows | (1 + state) x row | "
            "touched rows' gradient (1,024 ids) |"
        )
        print("|---|---:|---:|---:|")
        for name, measured, expected, grad_bytes in device_row_bytes():
            print(f"| {name} | {measured} B | {expected} B | {grad_bytes:,} B |", flush=True)

    if "6" not in skip:
        print(
            "\n## 6. Chunked moves against rows (LFU; a 10 % cache that grows until a batch's "
            "chunks fit, then rows in a cache of that size)\n"
        )
        print(
            "| stream | ids | batch | moves | cache rows at the end | % of the table | "
            "hit rate (unique ids / chunks) | hit rate (lookups) | rows loaded | ms / forward |"
        )
        print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for name, stream, rows, max_batch in streams:
            for moves, ids, batch, cache_rows, rate, lookup_rate, moved, ms in chunk_rates(
                stream, rows, max_batch
            ):
                print(
                    f"| {name} | {ids} | {batch} | {moves} | {cache_rows:,} | "
                    f"{cache_rows / rows:.0%} | {rate:.1%} | {lookup_rate:.1%} | {moved:,} | "
                    f"{ms:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
