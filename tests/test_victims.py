"""The row cache's eviction order kept between steps (issue 23: the eviction decision at the
batch's cost): ``edo_monitor.nn.victims.VictimOrder`` against one pass over every slot, and that
pass's own choice among the slots under its bound against one ``topk`` over every slot.

Real tables in real training loops (Zipf ids, Adam); at every eviction both choices are made on the
same state, and the victims' scores must be the same multiset (ties may pick other slots).
"""

from __future__ import annotations

import pytest
import torch

from edo_monitor.nn import CachedEmbedding, LookAhead
from edo_monitor.nn.cache_parts import put_rows
from edo_monitor.nn.victims import VictimOrder, slot_scores

N, D, C = 40_000, 4, 4_000


def _batches(steps: int, batch: int = 256, rows: int = N) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(7))
    return [order[torch.multinomial(probs, batch, True, generator=gen)] for _ in range(steps)]


@pytest.mark.parametrize(
    ("policy", "ahead", "rows", "batch"),
    [("lfu", 0, N, 256), ("lru", 0, N, 256), ("lfu", 4, N, 256), ("lfu", 0, 2 * C, 1024)],
)
def test_victims_are_the_lowest_scores_of_every_slot(
    policy: str, ahead: int, rows: int, batch: int
) -> None:
    """``rows = 2 C``: half the table cached, so the ranked slots have been used several times
    and a use of one of them can leave it below the ranking's threshold."""
    table = CachedEmbedding(rows, D, C, policy=policy)
    table._victim_order_min_slots = 0  # the order at any size (a real cache keeps it from 2^17)
    opt = torch.optim.Adam(table.parameters(), lr=1e-3)
    evict = table._evict
    compared = refreshes = 0
    refresh = table._victim_order.refresh

    def counted_refresh(*args: object) -> None:
        nonlocal refreshes
        refreshes += 1
        refresh(*args)  # type: ignore[arg-type]

    def checked(count: int, keep: torch.Tensor, for_batch: bool = False) -> torch.Tensor:
        nonlocal compared
        limits, inside = table._eviction_limits(keep)
        fast = table._victim_order.choose(table, count, limits, inside)
        if fast is not None:
            full = table._evict_full(count, limits)
            assert fast.unique().numel() == count
            got, want = slot_scores(table, fast).sort().values, slot_scores(table, full)
            assert torch.equal(got, want.sort().values)
            compared += 1
        return evict(count, keep, for_batch=for_batch)

    table._evict = checked  # type: ignore[method-assign]
    table._victim_order.refresh = counted_refresh  # type: ignore[method-assign]
    batches = _batches(120, batch, rows)
    loader = LookAhead(batches, ahead=ahead, tables=table) if ahead else batches
    for ids in loader:
        table(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert compared >= 100  # nearly every step evicted
    # the ranking is made again every few steps, not at every eviction (the O(C) pass)
    assert refreshes <= compared // 4


@pytest.mark.parametrize(("policy", "ahead"), [("lfu", 0), ("lru", 0), ("lfu", 4)])
def test_the_choice_under_the_bound_is_the_lowest_scores_of_every_slot(
    policy: str, ahead: int
) -> None:
    """The full pass picks its victims among the slots scoring at most the bound of its last
    selection over every slot when they are enough: the same scores as one ``topk`` over every
    slot, at every eviction; the selection over every slot runs at a few of them only. The
    scores it keeps per slot are those of the slots' counts and last uses (free: -1) at every
    eviction."""
    table = CachedEmbedding(N, D, C, policy=policy)
    opt = torch.optim.Adam(table.parameters(), lr=1e-3)
    full = table._evict_full
    evictions = ranked = 0

    def checked(count: int, keep_slots: list[torch.Tensor]) -> torch.Tensor:
        nonlocal evictions, ranked
        every = torch.arange(table.slot_to_block.numel())
        assert torch.equal(table.slot_score, slot_scores(table, every))
        scores = table._eviction_scores(keep_slots)
        bound = table._eviction_bound
        got = full(count, keep_slots)
        want = torch.topk(scores, count, largest=False).values
        assert torch.equal(scores[got].sort().values, want.sort().values)
        evictions += 1
        ranked += table._eviction_bound != bound
        return got

    table._evict_full = checked  # type: ignore[method-assign]
    batches = _batches(120)
    loader = LookAhead(batches, ahead=ahead, tables=table) if ahead else batches
    for ids in loader:
        table(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert evictions >= 100
    assert ranked <= evictions // 3


def test_large_caches_keep_the_order_small_ones_pass_over_every_slot() -> None:
    """From 2^17 slots on the order is kept (ranked at the first eviction, then ranked again
    after a resize, which makes new slot arrays); a smaller cache never ranks."""
    rows = 400_000
    gen = torch.Generator().manual_seed(3)
    for slots, batch, kept in ((1 << 17, 60_000, True), (C, 1_500, False)):
        table = CachedEmbedding(rows, 1, slots)
        assert table._victim_order_min_slots == 1 << 17
        with torch.no_grad():
            for _ in range(3):
                table(torch.randint(0, rows, (batch,), generator=gen))
        assert table.stats().evicted > 0
        order: VictimOrder = table._victim_order
        assert order._current(table) is kept
    assert table.cache_rows == C
    table.resize(2 * C)
    table._victim_order_min_slots = 0
    assert not order._current(table)  # new slot arrays: the next choice ranks them
    victims = order.choose(table, 10, [torch.zeros(0, dtype=torch.int64)])
    assert victims is not None and bool((table.slot_to_block[victims] < 0).all())  # free first


def test_the_bound_is_an_evictable_score_when_kept_rows_rank_among_the_lowest() -> None:
    """A small cache whose batch keeps most of it: the full ranking's lowest scores include kept
    rows (the int64 maximum); the bound is the highest evictable one among them, so the next
    evictions look at a few candidates (it was the maximum less one: every slot a candidate)."""
    table = CachedEmbedding(1_000, D, 64)
    opt = torch.optim.SGD(table.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        table(torch.randperm(1_000, generator=gen)[:40]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    bound = table._eviction_bound
    assert bound is not None
    assert bound < 2**32 * int(table.block_freq.max() + 1)  # a count-and-last-use score


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
@pytest.mark.parametrize("number", [False, True])
@pytest.mark.parametrize("shape", [(50, 3), (50,)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_put_rows_is_setitem(
    dtype: torch.dtype, number: bool, shape: tuple[int, ...], contiguous: bool
) -> None:
    """``put_rows`` (NumPy's fancy assignment where it can, else ``index_copy_`` /
    ``index_fill_``) writes what ``dst[index] = src`` writes: rows of an ``(N, D)`` table or
    elements of the cache's ``(C,)`` bookkeeping, from a tensor or one number, for every dtype
    the cache keeps, into a strided ``dst`` too."""
    gen = torch.Generator().manual_seed(3)
    values = (torch.rand((2 * shape[0], *shape[1:]), generator=gen) * 9).to(dtype)
    dst = values[: shape[0]] if contiguous else values[::2]  # every other row: strided
    index = torch.randperm(shape[0], generator=gen)[:17]
    src: torch.Tensor | int | bool = (torch.rand((17, *shape[1:]), generator=gen) * 9).to(dtype)
    if number:
        src = True if dtype == torch.bool else 5
    want = dst.clone()
    want[index] = src
    put_rows(dst, index, src)
    assert torch.equal(dst, want)
