"""The hit-rate bounds of benchmarks/row_cache_streams.py: Belady's eviction is the optimum
(checked by exhaustive search on small streams) and no real cache policy beats it."""

from __future__ import annotations

import importlib.util
import itertools
import random
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import torch

from edo_monitor.nn import CachedEmbedding


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "row_cache_streams.py"
    spec = importlib.util.spec_from_file_location("row_cache_streams", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _optimal_unique_hits(stream: list[int], cache_rows: int, batch: int) -> int:
    """Most unique-id hits any demand-loading cache gets: every eviction choice tried."""
    batches = [frozenset(stream[i : i + batch]) for i in range(0, len(stream), batch)]

    @cache
    def best(b: int, held: frozenset[int]) -> int:
        if b == len(batches):
            return 0
        need = batches[b]
        hits = len(need & held)
        over = len(held | need) - cache_rows
        if over <= 0:
            return hits + best(b + 1, held | need)
        return hits + max(
            best(b + 1, (held - set(out)) | need)
            for out in itertools.combinations(sorted(held - need), over)
        )

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_belady_equals_the_exhaustive_optimum(seed: int) -> None:
    bench = _bench()
    rnd = random.Random(seed)
    rows, cache_rows, batch = 8, 4, 2
    weights = [1 / (k + 1) for k in range(rows)]
    stream = rnd.choices(range(rows), weights, k=24)
    unique_rate, _ = bench.belady_hit_rates(torch.tensor(stream), cache_rows, batch)
    total_unique = sum(len(set(stream[i : i + batch])) for i in range(0, len(stream), batch))
    assert round(unique_rate * total_unique) == _optimal_unique_hits(stream, cache_rows, batch)


def test_bounds_on_a_hand_stream_and_no_policy_beats_belady() -> None:
    bench = _bench()
    # batches of 2: {0,1} {0,2} {3,0} {1,1}; a 2-row cache
    stream = torch.tensor([0, 1, 0, 2, 3, 0, 1, 1])
    s = bench.static_bounds(stream, 2, 2)
    assert s["static_lookups"] == pytest.approx(6 / 8)  # ids 0 (3 lookups) and 1 (3)
    assert s["every_row_lookups"] == pytest.approx(1 - 4 / 8)
    assert s["every_row_unique"] == pytest.approx(1 - 4 / 7)
    # Belady keeps 0 while it is used, evicts 1 for 2 in the 2nd batch and 2 (never used again)
    # for 3 in the 3rd; the 4th batch misses 1: 2 unique hits of 7, 2 lookups of 8
    assert bench.belady_hit_rates(stream, 2, 2) == (pytest.approx(2 / 7), pytest.approx(2 / 8))
    with pytest.raises(ValueError, match="3 distinct ids"):
        bench.belady_hit_rates(torch.tensor([0, 1, 2]), 2, 3)
    # a Zipf stream through the real module: LFU and LRU stay at or under Belady
    rows, cache_rows, batch = 500, 50, 20
    ids = bench.zipf_stream(rows, 4000, seed=3)
    bound, _ = bench.belady_hit_rates(ids, cache_rows, batch)
    for policy in ("lfu", "lru"):
        table = CachedEmbedding(rows, 1, cache_rows, policy=policy, _freeze=True)
        with torch.no_grad():
            for start in range(0, len(ids), batch):
                table(ids[start : start + batch])
        rate = table.stats().hit_rate
        assert rate is not None and 0.3 < rate <= bound
