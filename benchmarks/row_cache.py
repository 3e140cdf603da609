"""Row cache figures: hit rates, step time against table size, 100 %-hit overhead, exactness.

    python benchmarks/row_cache.py --data ../shared/data/movielens-small

Prints four tables (each measured side by side in one run):

1. hit rate of :class:`edo_monitor.nn.CachedTable` (LFU / LRU, row by row / 512-row chunks) at
   caches of 1, 5, 10 and 25 % of the rows, on MovieLens item ids in rating-time order (batches of
   at most 1,024 ratings) and on a Zipf(1.05) stream of ``--zipf-ids`` ids over ``--zipf-rows``
   rows (batches of at most 8,192), each batch at most half the cache (one batch's rows must fit);
   the time per forward of the cache bookkeeping;
2. Adam step time (forward, backward, step) at a fixed batch against table size, ``--sizes`` rows
   x 64: resident ``nn.EmbeddingBag``, cached at 10 %, and offloaded (``OffloadedEmbedding``);
3. step time of a cache holding the whole table (100 % hits after the first step) over resident;
4. max relative difference (max |cached - twin| / max |twin|) of the table after 200 steps
   against a resident twin, per optimizer, in float32 and float64.
"""

from __future__ import annotations

import argparse
import csv
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from edo_monitor.nn import CachedEmbedding, CachedEmbeddingBag, EmbeddingOptions, OffloadedEmbedding

DIM = 64


def movielens_items(data_dir: Path) -> tuple[torch.Tensor, int]:
    """Dense item ids of every rating in timestamp order, and the number of items."""
    rows = []
    with (data_dir / "ratings.csv").open(newline="") as f:
        for r in csv.DictReader(f):
            rows.append((int(r["timestamp"]), r["movieId"]))
    rows.sort(key=lambda r: r[0])
    ids: dict[str, int] = {}
    seq = [ids.setdefault(m, len(ids)) for _, m in rows]
    return torch.tensor(seq), len(ids)


def zipf_stream(rows: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` ids in ``[0, rows)`` with P(id = k) ∝ (k + 1) ** -1.05, ids shuffled."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
    ranks = torch.multinomial(probs, count, replacement=True, generator=gen)
    return torch.randperm(rows, generator=gen)[ranks]  # hot ids spread over the table


def hit_rates(stream: torch.Tensor, rows: int, max_batch: int) -> list[tuple]:
    """Per cache size, LFU/LRU, row/chunk: (fraction, policy, block, batch, unique-id hit rate,
    lookup hit rate, ms per forward); batches are at most half the cache (a batch must fit)."""
    out = []
    for fraction in (0.01, 0.05, 0.10, 0.25):
        batch = max(16, min(max_batch, int(rows * fraction) // 2))
        for policy in ("lfu", "lru"):
            for block in (1, 512):
                table = CachedEmbedding(
                    rows, 1, max(block, int(rows * fraction)), policy=policy, block_rows=block,
                    _freeze=True, overflow="error",
                )  # fmt: skip
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        for start in range(0, len(stream), batch):
                            table(stream[start : start + batch])
                except RuntimeError as exc:  # one batch's blocks do not fit in the cache
                    msg = str(exc).split(" (")[0]
                    out.append((fraction, policy, block, batch, None, None, msg))
                    continue
                ms_fwd = (time.perf_counter() - t0) / -(-len(stream) // batch) * 1e3
                st = table.stats()
                out.append(
                    (fraction, policy, block, batch, st.hit_rate, st.lookup_hit_rate, ms_fwd)
                )
    return out


def _zipf_batch(rows: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    # zipf by rank, ranks scattered by a fixed hash so hot rows are not contiguous
    u = torch.rand(batch, generator=gen, dtype=torch.float64)
    ranks = torch.clamp((rows ** (1 - 1.05) - 1) * u + 1, min=1e-300) ** (1 / (1 - 1.05))
    ranks = torch.clamp(ranks.long() - 1, 0, rows - 1)
    return (ranks * 2_654_435_761) % rows


def step_time(make: Callable[[], nn.Module], rows: int, batch: int, steps: int) -> float:
    """Median seconds of forward + backward + Adam step over ``steps`` steps (after 2 warm-up)."""
    module = make()
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 2):
        ids = _zipf_batch(rows, batch, gen)
        offsets = torch.arange(0, batch, 8)
        t0 = time.perf_counter()
        loss = module(ids, offsets).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del module, opt
    gc.collect()
    return statistics.median(times)


def _bag(rows: int) -> nn.EmbeddingBag:
    torch.manual_seed(0)
    return nn.EmbeddingBag(rows, DIM, mode="sum")


def _offloaded(rows: int) -> nn.Module:
    src = _bag(rows)
    w = src.weight
    OffloadedEmbedding.offload_parameter(w)
    return OffloadedEmbedding(w, EmbeddingOptions.from_module(src), "cpu")


def _cached(rows: int, fraction: float) -> nn.Module:
    torch.manual_seed(0)
    # the whole table: warm start with every row, so every lookup hits
    freq = torch.ones(rows, dtype=torch.int64) if fraction >= 1 else None
    return CachedEmbeddingBag(
        rows, DIM, max(1, int(rows * fraction)), mode="sum", id_frequencies=freq
    )


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


def exactness(make_opt: Callable, dtype: torch.dtype, steps: int = 200) -> float:
    """max |cached - twin| / max |twin| after ``steps`` steps (1,000 rows, 10 % cache, StepLR)."""
    rows, d = 1000, 16
    torch.manual_seed(0)
    base = torch.randn(rows, d, dtype=dtype)
    twin = nn.Embedding.from_pretrained(base.clone(), freeze=False)
    cached = CachedEmbedding(rows, d, rows // 10, _weight=base.clone())
    pairs = []
    for m in (twin, cached):
        opt = make_opt([m.weight])
        pairs.append((m, opt, torch.optim.lr_scheduler.StepLR(opt, 50, 0.5)))
    gen = torch.Generator().manual_seed(1)
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
    for _ in range(steps):
        ids = torch.multinomial(probs, 64, replacement=True, generator=gen)
        target = torch.randn(64, d, generator=gen, dtype=dtype)
        for m, opt, sched in pairs:
            opt.zero_grad()
            ((m(ids) - target) ** 2).sum().backward()
            opt.step()
            sched.step()
    ref = twin.weight.detach()
    return float((cached.full_weight() - ref).abs().max() / ref.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/movielens-small"))
    parser.add_argument("--zipf-ids", type=int, default=10_000_000)
    parser.add_argument("--zipf-rows", type=int, default=1_000_000)
    parser.add_argument("--sizes", default="1000000,4000000,8000000")
    parser.add_argument("--batch", type=int, default=4096, help="ids per step in table 2")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--skip", default="", help="comma list of tables to skip (1,2,3,4)")
    args = parser.parse_args()
    skip = set(args.skip.split(",")) if args.skip else set()
    torch.set_num_threads(2)

    if "1" not in skip:
        streams = []
        if (args.data / "ratings.csv").is_file():
            items, n_items = movielens_items(args.data)
            streams.append(("MovieLens items, time order", items, n_items, 1024))
        else:
            print(f"(MovieLens not found at {args.data}: its rows are left out)")
        z = zipf_stream(args.zipf_rows, args.zipf_ids)
        streams.append((f"Zipf(1.05), {args.zipf_ids:,} ids", z, args.zipf_rows, 8192))
        print("\n## 1. Hit rate (unique ids per batch found in the cache)\n")
        print(
            "| stream | rows | cache | batch | policy | moves | hit rate (unique ids) | "
            "hit rate (lookups) | ms / forward |"
        )
        print("|---|---:|---:|---:|---|---|---:|---:|---:|")
        for name, stream, rows, max_batch in streams:
            for fraction, policy, block, batch, rate, lookup_rate, ms in hit_rates(
                stream, rows, max_batch
            ):
                moves = "row" if block == 1 else f"chunk {block}"
                head = (
                    f"| {name} | {rows:,} | {fraction:.0%} | {batch} | {policy.upper()} | {moves} |"
                )
                if rate is None:
                    print(f"{head} fails: {ms} | | |")
                else:
                    print(f"{head} {rate:.1%} | {lookup_rate:.1%} | {ms:.2f} |")

    if "2" not in skip:
        print(f"\n## 2. Adam step time (s), batch {args.batch} ids in bags of 8, dim {DIM}\n")
        print("| rows | resident | cached 10 % | offloaded | cached / cached at smallest |")
        print("|---:|---:|---:|---:|---:|")
        first_cached = None
        for rows in (int(s) for s in args.sizes.split(",")):
            resident = step_time(lambda rows=rows: _bag(rows), rows, args.batch, args.steps)
            cached = step_time(lambda rows=rows: _cached(rows, 0.10), rows, args.batch, args.steps)
            offloaded = step_time(lambda rows=rows: _offloaded(rows), rows, args.batch, args.steps)
            first_cached = first_cached or cached
            print(
                f"| {rows:,} | {resident:.3f} | {cached:.3f} | {offloaded:.3f} | "
                f"{cached / first_cached:.2f} |"
            )

    if "3" not in skip:
        rows = 100_000
        resident = step_time(lambda: _bag(rows), rows, args.batch, 20)
        full = step_time(lambda: _cached(rows, 1.0), rows, args.batch, 20)
        print(f"\n## 3. Whole table cached (100 % hits) vs resident, {rows:,} x {DIM}, Adam\n")
        print("| resident s | cached 100 % s | ratio |")
        print("|---:|---:|---:|")
        print(f"| {resident:.4f} | {full:.4f} | {full / resident:.2f} |")

    if "4" not in skip:
        print("\n## 4. Exactness after 200 steps (max |cached - twin| / max |twin|)\n")
        print("| optimizer | float32 | float64 |")
        print("|---|---:|---:|")
        for name, make in OPTIMIZERS.items():
            f32 = exactness(make, torch.float32)
            f64 = exactness(make, torch.float64)
            print(f"| {name} | {f32:.1e} | {f64:.1e} |")


if __name__ == "__main__":
    main()
