"""The streams the row-cache benchmarks replay and the hit-rate bounds of any cache on them.

Streams: MovieLens item ids (rating-time or file order), a Zipf(1.05) stream, ids renumbered by
frequency rank; :func:`batch_for`, the batch size of a cache fraction. Bounds (table 5 and 9 of
``benchmarks/row_cache.py``): Belady's furthest-next-use eviction (the optimum for the unique-id
hit rate, checked against every eviction choice in ``tests/test_row_cache_bounds.py``), the
window oracle (furthest next use inside a look-ahead window, true frequency beyond it) and a
static cache of the most frequent rows in hindsight.
"""

from __future__ import annotations

import csv
import heapq
import itertools
from pathlib import Path

import torch


def movielens_items(data_dir: Path, time_order: bool = True) -> tuple[torch.Tensor, int]:
    """Dense item ids of every rating in timestamp order (or the file's order: by user), and the
    number of items."""
    rows = []
    with (data_dir / "ratings.csv").open(newline="") as f:
        for r in csv.DictReader(f):
            rows.append((int(r["timestamp"]), r["movieId"]))
    if time_order:
        rows.sort(key=lambda r: r[0])
    ids: dict[str, int] = {}
    seq = [ids.setdefault(m, len(ids)) for _, m in rows]
    return torch.tensor(seq), len(ids)


def zipf_stream(rows: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` ids in ``[0, rows)`` with P(id = k) ∝ (k + 1) ** -1.05, ids shuffled."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
    ranks = torch.empty(count, dtype=torch.int64)
    for start in range(0, count, 1 << 22):  # multinomial draws at most 2**24 samples a call
        part = ranks[start : start + (1 << 22)]
        part.copy_(torch.multinomial(probs, part.numel(), replacement=True, generator=gen))
    return torch.randperm(rows, generator=gen)[ranks]  # hot ids spread over the table


def by_rank(stream: torch.Tensor, rows: int) -> torch.Tensor:
    """``stream`` with every id renumbered by its frequency rank in the stream (0 = most
    frequent; ties by id): the hot rows become contiguous, the best case for chunked moves."""
    counts = torch.bincount(stream, minlength=rows)
    order = torch.sort(-counts, stable=True).indices
    rank_of = torch.empty(rows, dtype=torch.int64)
    rank_of[order] = torch.arange(rows)
    return rank_of[stream]


def batch_for(rows: int, fraction: float, max_batch: int) -> int:
    """Ids per batch for a cache of ``fraction`` of ``rows``: at most half the cache."""
    return max(16, min(max_batch, int(rows * fraction) // 2))


def _batch_uniques(stream: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    """Per batch its distinct ids: (batch index, id, count in the batch), each ``(M,)``, sorted by
    batch then id, and the ``(batches + 1,)`` start of each batch in them."""
    rows = int(stream.max()) + 1
    key = (torch.arange(stream.numel()) // batch) * rows + stream
    keys, counts = torch.unique(key, return_counts=True)
    b_of, id_of = keys // rows, keys % rows
    batches = -(-stream.numel() // batch)
    starts = torch.searchsorted(b_of, torch.arange(batches + 1))
    return b_of, id_of, counts, starts


def _next_uses(b_of: torch.Tensor, id_of: torch.Tensor, never: int) -> torch.Tensor:
    """For each (batch, id) of :func:`_batch_uniques`, the next batch using that id (``never``
    when none does)."""
    order = torch.sort(id_of, stable=True).indices  # by id, batches ascending within an id
    nxt = torch.full_like(b_of, never)
    same = id_of[order[1:]] == id_of[order[:-1]]
    nxt[order[:-1][same]] = b_of[order[1:][same]]
    return nxt


def belady_hit_rates(stream: torch.Tensor, cache_rows: int, batch: int) -> tuple[float, float]:
    """Hit rates (unique ids per batch, lookups) of Belady's eviction on ``stream`` in batches of
    ``batch`` ids into a cache of ``cache_rows`` rows.

    A batch's distinct ids must all be in the cache (as in :class:`CachedTable`); on misses the
    rows evicted are those, outside the batch, whose next use is furthest ahead (never used again
    first). With demand loading this is optimal for the unique-ids hit rate (the exchange argument
    of Belady's MIN holds with a batch's rows protected); the lookup hit rate it reaches is that of
    the same schedule (weighted by repeats, no bound of its own). Python loop: ~1 µs a row access.

    Raises:
        ValueError: a batch has more distinct ids than ``cache_rows``.
    """
    b_of, id_of, counts, starts = _batch_uniques(stream, batch)
    never = int(b_of[-1]) + 1
    nxt = _next_uses(b_of, id_of, never)
    cached: dict[int, int] = {}  # id -> its next use (batch index)
    heap: list[tuple[int, int]] = []  # (-next use, id); entries with another next use are stale
    uniq_hits = lookup_hits = 0
    bounds = starts.tolist()
    for lo, hi in itertools.pairwise(bounds):
        ids = id_of[lo:hi].tolist()
        if len(ids) > cache_rows:
            raise ValueError(f"a batch has {len(ids)} distinct ids; the cache holds {cache_rows}")
        for i, nu, c in zip(ids, nxt[lo:hi].tolist(), counts[lo:hi].tolist(), strict=True):
            if i in cached:
                uniq_hits += 1
                lookup_hits += c
            cached[i] = nu
            heapq.heappush(heap, (-nu, i))
        excess = len(cached) - cache_rows
        if excess > 0:
            current, aside = set(ids), []
            while excess:
                neg, i = heapq.heappop(heap)
                if cached.get(i) != -neg:
                    continue
                if i in current:  # needed now: kept
                    aside.append((neg, i))
                    continue
                del cached[i]
                excess -= 1
            for entry in aside:
                heapq.heappush(heap, entry)
        if len(heap) > 4 * (cache_rows + batch):  # drop the stale entries
            heap = [(-nu, i) for i, nu in cached.items()]
            heapq.heapify(heap)
    return uniq_hits / id_of.numel(), lookup_hits / stream.numel()


def window_oracle_hit_rate(stream: torch.Tensor, cache_rows: int, batch: int, ahead: int) -> float:
    """Unique-id hit rate of the best eviction that sees only ``ahead`` batches: inside the window
    furthest next use first (as :class:`LookAhead`), beyond it the rows of lowest *true*
    frequency first (batches each row is in over the whole stream: an oracle no online counter
    can beat), the batch's rows kept, demand loading as in :func:`belady_hit_rates`. The ceiling
    of any "window + frequency" policy with this window. Vectorized, ``O(C)`` a batch."""
    b_of, id_of, _counts, starts = _batch_uniques(stream, batch)
    rows = int(stream.max()) + 1
    never = int(b_of[-1]) + 1 + ahead
    nxt = _next_uses(b_of, id_of, never)
    freq = torch.bincount(id_of, minlength=rows)
    cached = torch.zeros(rows, dtype=torch.bool)
    next_use = torch.full((rows,), never, dtype=torch.int64)
    hits = held = 0
    bounds = starts.tolist()
    for b, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        ids = id_of[lo:hi]
        present = cached[ids]
        hits += int(present.sum())
        held += int((~present).sum())
        cached[ids] = True
        next_use[ids] = nxt[lo:hi]
        excess = held - cache_rows
        if excess > 0:
            cand = cached.nonzero().reshape(-1)
            nu = next_use[cand]
            # int64 scores: beyond the window by frequency, inside it above every frequency
            score = torch.where(nu - b <= ahead, (1 << 40) - nu, freq[cand])
            keep = torch.zeros(rows, dtype=torch.bool)
            keep[ids] = True
            score = score.masked_fill(keep[cand], 1 << 62)
            cached[cand[torch.topk(score, excess, largest=False).indices]] = False
            held = cache_rows
    return hits / id_of.numel()


def static_bounds(stream: torch.Tensor, cache_rows: int, batch: int) -> dict[str, float]:
    """Shares a static cache of the ``cache_rows`` most frequent rows (in hindsight) would hit,
    and the hit rates of a cache holding every row (only each row's first use misses).

    Keys: ``static_lookups`` (share of all lookups going to the top rows by lookups),
    ``static_unique`` (share of the batches' distinct ids going to the top rows by batches seen),
    ``every_row_unique``, ``every_row_lookups``.
    """
    _, id_of, _, _ = _batch_uniques(stream, batch)
    lookups = torch.bincount(stream)
    per_batch = torch.bincount(id_of)
    distinct = int((lookups > 0).sum())
    k = min(cache_rows, lookups.numel())
    return {
        "static_lookups": float(torch.topk(lookups, k).values.sum()) / stream.numel(),
        "static_unique": float(torch.topk(per_batch, k).values.sum()) / id_of.numel(),
        "every_row_unique": 1 - distinct / id_of.numel(),
        "every_row_lookups": 1 - distinct / stream.numel(),
    }
