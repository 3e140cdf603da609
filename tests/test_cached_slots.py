"""The row cache's bookkeeping: resizing, the LFU count and score kept per slot, a warm start
and prefetch, the rows pinned until the step, and the lookup listener the agent's counter uses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_cached import C, D, N, _pair, _rel, _train, _zipf_ids

from edo_monitor.nn import CachedEmbedding


def test_resize_both_ways_mid_training_stays_exact() -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    twin, cached = _pair(base, 60)
    o1 = torch.optim.SGD([twin.weight], lr=0.05, momentum=0.9, weight_decay=0.01)
    o2 = torch.optim.SGD([cached.weight], lr=0.05, momentum=0.9, weight_decay=0.01)
    gen = torch.Generator().manual_seed(4)
    _train([(twin, o1), (cached, o2)], 20, gen)
    _assert_slot_freq(cached)
    cached.resize(30)
    assert cached.cache_rows == 30 and o2.state[cached.weight]["momentum_buffer"].shape == (30, D)
    _assert_slot_freq(cached)
    _train([(twin, o1), (cached, o2)], 20, gen)
    _assert_slot_freq(cached)
    cached.resize(N)
    assert cached.cache_rows == N
    _train([(twin, o1), (cached, o2)], 20, gen)
    _assert_slot_freq(cached)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def _assert_slot_freq(cached: CachedEmbedding) -> None:
    """The LFU count kept per slot is its block's count, and the score kept per slot is its
    count and last use (what eviction ranks by; free slots -1)."""
    used = (cached.slot_to_block >= 0).nonzero().reshape(-1)
    assert used.numel() > 0
    want = cached.block_freq[cached.slot_to_block[used]]
    assert torch.equal(cached.slot_freq[used], want) and int(want.max()) > 1
    score = torch.full_like(cached.slot_score, -1)
    score[used] = want * 2**32 + cached.slot_last_use[used]
    assert torch.equal(cached.slot_score, score)


def test_prefetch_and_warm_start_give_the_same_results() -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    freq = torch.zeros(N, dtype=torch.int64)
    freq[:C] = 5
    twin, cached = _pair(base, 2 * C, id_frequencies=freq)
    # warm start: the frequent rows are cached, the other slots free
    assert set(cached.slot_to_block.tolist()) == set(range(C)) | {-1}
    o1 = torch.optim.Adam([twin.weight], lr=0.01)
    o2 = torch.optim.Adam([cached.weight], lr=0.01)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        ids = _zipf_ids(gen, (4, 6))
        target = torch.randn(4, 6, D, generator=gen, dtype=torch.float64)
        cached.prefetch(ids)
        assert bool((cached.block_to_slot[ids] >= 0).all())
        for m, o in ((twin, o1), (cached, o2)):
            o.zero_grad()
            ((m(ids) - target) ** 2).sum().backward()
            o.step()
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def _pinned_ids(table: CachedEmbedding) -> set[int]:
    return set(table.slot_to_block[table.slot_pinned].tolist())


def test_pins_are_the_rows_used_since_the_step_and_clear_at_it() -> None:
    """The step clears only the slots pinned since the last one (O(batch)); the pinned set is
    still exactly the rows used since the step: over accumulated forwards, after a resize that
    renumbers the slots, and after more forwards without a step than the cache has rows."""
    torch.manual_seed(0)
    table = CachedEmbedding(N, D, 50, dtype=torch.float64)
    opt = torch.optim.SGD([table.weight], lr=0.1)
    first, second = torch.tensor([1, 2, 3, 2]), torch.tensor([3, 40, 41])
    table(first).sum().backward()
    table(second).sum().backward()
    assert _pinned_ids(table) == {1, 2, 3, 40, 41}
    opt.step()
    assert _pinned_ids(table) == set()
    opt.zero_grad()  # (else the step's gradient stays, as a resident table's: its rows pinned)
    table(first).sum().backward()
    table.resize(60)  # slots renumbered: the pins move with their rows
    assert _pinned_ids(table) == {1, 2, 3}
    table(second).sum().backward()
    assert _pinned_ids(table) == {1, 2, 3, 40, 41}
    opt.step()
    assert _pinned_ids(table) == set()
    # 25 forwards of 3 ids without a step list 75 slots > 60 rows: the step then clears them all
    opt.zero_grad()
    for _ in range(25):
        table(torch.tensor([5, 6, 7])).sum().backward()
    assert _pinned_ids(table) == {5, 6, 7}
    assert table._pinned_since_step is None  # the unlisted path
    opt.step()
    assert _pinned_ids(table) == set()
    with torch.no_grad():  # no gradient pending: nothing pinned
        table(second)
    assert _pinned_ids(table) == set()


class _CountUnique(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ``unique`` kernels that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "unique" in func.__name__:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("block_rows", [1, 8])
def test_lookup_counter_on_a_cached_table_counts_like_on_a_resident_one(block_rows: int) -> None:
    """The agent's LookupCounter counts a cached table from the unique ids the cache computes
    (no forward pre-hook, no second unique): same counts and peak as on an nn.Embedding twin,
    padding excluded, sampling kept."""
    from edo_monitor.measure.frequency import LookupCounter

    torch.manual_seed(0)
    base = torch.randn(N, D)
    twin, cached = _pair(base, padding_idx=3, block_rows=block_rows)
    counters = [LookupCounter(sample_every=2), LookupCounter(sample_every=2)]
    counters[0].watch("t", twin)
    counters[1].watch("t", cached)
    assert len(cached._forward_pre_hooks) == 0 and len(cached._lookup_listeners) == 1
    gen = torch.Generator().manual_seed(2)
    for i in range(7):
        ids = _zipf_ids(gen, (5, 4 + i))
        ids[0, 0] = 3
        twin(ids)
        if i == 0:
            with _CountUnique() as mode:
                cached(ids)
            assert mode.calls == (1 if block_rows == 1 else 2)  # the cache's own, shared
        else:
            cached(ids)
    assert torch.equal(counters[1].counts("t"), counters[0].counts("t"))
    assert int(counters[1].counts("t")[3]) == 0 and int(counters[1].counts("t").sum()) > 0
    assert counters[1].peak_unique_ids("t") == counters[0].peak_unique_ids("t")
    counters[1].close()
    assert len(cached._lookup_listeners) == 0
