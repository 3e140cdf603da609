"""The row cache's counters and entry points under a look-ahead (the faults of the LookAhead
review): every row loaded is one miss, prefetched ones too; entry points that change the cache
work under ``torch.inference_mode()``; the first load checks the cache was not written.

Real tables, real training loops; the streams are Zipf ids.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from edo_monitor.nn import CachedEmbedding, LookAhead

N, D, C = 300, 4, 30


def _zipf_batches(count: int, size: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    probs = 1.0 / torch.arange(1, N + 1, dtype=torch.float64) ** 1.05
    return [torch.multinomial(probs, size, replacement=True, generator=gen) for _ in range(count)]


@pytest.mark.parametrize("mode", ["plain", "lookahead", "prefetch"])
def test_hit_rate_counts_every_loaded_row_once_as_a_miss(mode: str) -> None:
    """hits + misses = unique ids looked up, hit_rate = 1 - loads / unique ids: a prefetched row
    was a miss when loaded and a hit again at its forward (LookAhead 0.692 for 0.555, manual
    prefetch 0.671 for 0.509)."""
    batches = _zipf_batches(100)
    unique = sum(int(torch.unique(b).numel()) for b in batches)
    t = CachedEmbedding(N, D, C, _weight=torch.randn(N, D, dtype=torch.float64))
    opt = torch.optim.SGD([t.weight], lr=0.1)
    t.attach(opt)
    source = LookAhead(batches, ahead=4, tables=t) if mode == "lookahead" else batches
    for b in source:
        if mode == "prefetch":
            t.prefetch(b)
        opt.zero_grad()
        t(b).pow(2).sum().backward()
        opt.step()
    s = t.stats()
    assert s.hits + s.misses == unique
    assert s.hit_rate == pytest.approx(1 - s.misses / unique)
    expected = {"plain": 0.509, "lookahead": 0.555, "prefetch": 0.509}[mode]
    assert s.hit_rate == pytest.approx(expected, abs=0.001)


@pytest.mark.parametrize("mode", ["lookahead", "prefetch", "resize", "flush", "load"])
def test_entry_points_under_inference_mode_leave_the_table_trainable(mode: str) -> None:
    """A LookAhead eval, ``prefetch``, ``resize``, ``flush`` or ``load_state_dict`` under
    ``torch.inference_mode()`` on a cache keeping a victim order (its slot threshold lowered
    here from 2^17) made inference tensors; the next training step raised "Inplace update to
    inference tensor outside InferenceMode". Training after it still matches a resident twin."""
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(N, D, dtype=torch.float64)
    t = CachedEmbedding(N, D, 64, _weight=w0.clone())
    t._victim_order_min_slots = 16  # the victim order from 16 slots (2^17 by default)
    twin = torch.nn.Embedding(N, D, _weight=w0.clone())
    opt, opt_twin = torch.optim.SGD([t.weight], lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    t.attach(opt)
    train = [torch.randint(0, N, (40,), generator=gen) for _ in range(6)]
    val = [torch.randint(0, N, (40,), generator=gen) for _ in range(4)]

    def step(ids: torch.Tensor) -> None:
        for table, o in ((t, opt), (twin, opt_twin)):
            o.zero_grad()
            table(ids).pow(2).sum().backward()
            o.step()

    for ids in train[:3]:
        step(ids)
    with torch.inference_mode():
        if mode == "lookahead":
            for ids in LookAhead(val, ahead=2, tables=t):
                t(ids)
        elif mode == "prefetch":
            for ids in val:
                t.prefetch(ids)
                t(ids)
        elif mode == "resize":
            t.resize(48)
            t.resize(96)
        elif mode == "flush":
            t.flush()
        else:
            t.load_state_dict(t.state_dict())
    for ids in train[3:]:
        step(ids)
    torch.testing.assert_close(t.full_weight(), twin.weight.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["plain", "lookahead", "prefetch", "resize"])
def test_cache_written_before_the_first_load_is_refused_whatever_loads_first(mode: str) -> None:
    """``nn.init`` on ``table.weight`` (the cache, not the table) is refused at the first load:
    under a LookAhead (or ``prefetch``) the first batch's rows filled every slot before the first
    lookup's check, and the write was dropped silently (training ran from the table's values);
    a resize before the first load made a new, zeroed cache (the write dropped as well)."""
    batches = [
        torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(i)) for i in range(3)
    ]
    t = CachedEmbedding(1000, D, 32)
    torch.nn.init.constant_(t.weight, 0.5)
    opt = torch.optim.SGD([t.weight], lr=0.1)
    with pytest.raises(ValueError, match="written before any row was loaded"):
        if mode == "resize":
            t.resize(C // 2)
        source = LookAhead(batches, ahead=2, tables=t) if mode == "lookahead" else batches
        for ids in source:
            if mode == "prefetch":
                t.prefetch(ids)
            opt.zero_grad()
            t(ids).sum().backward()
            opt.step()


@pytest.mark.parametrize("mode", ["lookahead", "prefetch", "resize"])
def test_a_warm_start_is_not_taken_for_a_written_cache_whatever_first_frees_a_slot(
    mode: str,
) -> None:
    """Regression: with ``id_frequencies`` every slot is preloaded; a ``prefetch`` (or a
    LookAhead) first evicts some of those rows, and the first-load check then found their
    values in the freed slots and raised "written before any row was loaded" on the first batch.
    The check now runs before anything frees a slot. Training is the resident twin's."""
    batches = _zipf_batches(12, 24)
    freq = torch.bincount(torch.cat(batches), minlength=N)
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    twin = torch.nn.Embedding(N, D, _weight=base.clone())
    t = CachedEmbedding(N, D, C, _weight=base.clone(), id_frequencies=freq)
    assert bool((t.slot_to_block >= 0).all())  # every slot preloaded: the first load evicts
    opts = [torch.optim.Adam([m.weight], lr=0.01) for m in (twin, t)]
    if mode == "resize":
        t.resize(C // 2)
    source = LookAhead(batches, ahead=4, tables=t) if mode == "lookahead" else batches
    for ids in source:
        if mode == "prefetch":
            t.prefetch(ids)
        for m, o in zip((twin, t), opts, strict=True):
            o.zero_grad()
            (m(ids) ** 2).sum().backward()
            o.step()
    assert t.stats().misses > 0
    want = twin.weight.detach()
    assert float((t.full_weight().detach() - want).abs().max() / want.abs().max()) < 1e-12


class _Rewinding:
    """Its own iterator: raises StopIteration at the end of an epoch, then rewinds."""

    def __init__(self, n: int) -> None:
        self.n, self.i, self.calls = n, 0, 0

    def __iter__(self) -> _Rewinding:
        return self

    def __next__(self) -> torch.Tensor:
        self.calls += 1
        if self.i >= self.n:
            self.i = 0
            raise StopIteration
        self.i += 1
        return torch.tensor([self.i - 1])


def test_loader_end_is_final_for_the_epoch() -> None:
    """After the loader's StopIteration it is not called again: a rewinding iterator's epoch
    ended with batches 0-4 twice, three times... (20 of 20 taken) and never stopped."""
    loader = _Rewinding(5)
    t = CachedEmbedding(10, 2, 4)
    got = [int(b) for b in LookAhead(loader, ahead=3, tables=t)]
    assert got == [0, 1, 2, 3, 4]
    assert loader.calls == 6  # five batches and one StopIteration
    assert [int(b) for b in LookAhead(loader, ahead=3, tables=t)] == [0, 1, 2, 3, 4]


def test_lookup_that_does_not_fit_counts_what_happened() -> None:
    """50 ids under no_grad, 10 of them cached, in a 10-row cache: read from the host, nothing
    loaded into the cache. It counted 40 forward loads and 10 hits with no miss (hit rate 1.0);
    now 0 forward loads, 10 hits, 40 misses (read from the host: their weight bytes moved)."""
    t = CachedEmbedding(1000, 2, 10)
    t.attach(torch.optim.SGD([t.weight], lr=0.1))
    with torch.no_grad():
        t(torch.arange(10))
        before = t.stats()
        out = t(torch.arange(50))
    s = t.stats()
    torch.testing.assert_close(out, t.full_weight()[:50])
    assert s.forward_loads - before.forward_loads == 0
    assert (s.hits - before.hits, s.misses - before.misses) == (10, 40)
    assert s.h2d_bytes - before.h2d_bytes == 40 * 2 * 4
    assert s.cache_rows == 10


@pytest.mark.parametrize("dense", [False, True])
def test_no_table_to_serve_passes_batches_through_without_ids(dense: bool) -> None:
    """``tables=None`` or a model with no cached table yet: ``ids(batch)`` is not called, the
    batches pass through (a float-only batch raised "holds no integer tensor")."""
    batches = [(torch.randn(4, 3), torch.randn(4)) for _ in range(3)]
    tables = torch.nn.Sequential(torch.nn.Linear(3, 1)) if dense else None
    got = list(LookAhead(batches, ahead=2, tables=tables))
    assert len(got) == 3 and all(g is b for g, b in zip(got, batches, strict=True))


def test_ids_called_once_a_batch_when_the_mapping_leaves_a_table_out() -> None:
    """A mapping naming one of two cached tables: ``ids()`` was called again for every waiting
    batch at every step (414 calls for 50 batches at ``ahead=8``); now once a batch."""
    model = torch.nn.ModuleDict(
        {"a": CachedEmbedding(100, 2, 20), "b": CachedEmbedding(100, 2, 20)}
    )
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 100, (8,), generator=gen) for _ in range(50)]
    calls = []

    def ids(b: torch.Tensor) -> dict[str, torch.Tensor]:
        calls.append(b)
        return {"a": b}

    for b in LookAhead(batches, ahead=8, ids=ids, tables=model):
        model["a"](b)
        model["b"](b)
    assert len(calls) == 50


def _ring_loader(data: torch.Tensor, ring_size: int) -> Iterator[torch.Tensor]:
    ring = torch.empty(ring_size, data.shape[1], dtype=data.dtype)
    for i in range(len(data)):
        slot = ring[i % ring_size]
        slot.copy_(data[i])
        yield slot


def test_ring_of_buffers_views_of_one_tensor_is_not_refused() -> None:
    """A ring of 16 preallocated buffers (rows of one tensor), ahead=4: no waiting batch is
    written, yet the shared version counter made it "the loader wrote into batch 0"; the
    batches now come through exact. A ring of 3 (rows rewritten while waiting) is refused."""
    data = torch.randint(0, 100, (40, 8), generator=torch.Generator().manual_seed(0))
    t = CachedEmbedding(100, 2, 30)
    got = [b.clone() for b in LookAhead(_ring_loader(data, 16), ahead=4, tables=t)]
    assert torch.equal(torch.stack(got), data)
    with pytest.raises(ValueError, match="the loader wrote into batch 0"):
        list(LookAhead(_ring_loader(data, 3), ahead=4, tables=CachedEmbedding(100, 2, 30)))


def test_shrink_under_a_look_ahead_keeps_the_windows_rows() -> None:
    """A shrink while a LookAhead serves the table kept rows by LFU count alone: the window's
    10 rows written back (10 late loads right after), 20 rows no batch uses again kept. Now
    the window's rows are kept (0 late loads), and training matches a resident twin."""
    hot, later = torch.arange(0, 20), torch.arange(50, 60)
    batches = [hot] * 10 + [later] * 10
    w0 = torch.randn(100, 2, dtype=torch.float64)
    t = CachedEmbedding(100, 2, 40, _weight=w0.clone())
    twin = torch.nn.Embedding(100, 2, _weight=w0.clone())
    opt, opt_twin = torch.optim.SGD([t.weight], lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    t.attach(opt)
    source = LookAhead(batches, ahead=4, tables=t)
    late = None
    for i, ids in enumerate(source):
        for table, o in ((t, opt), (twin, opt_twin)):
            o.zero_grad()
            table(ids).sum().backward()
            o.step()
        if i == 11:
            late = source.late_loads
            t.resize(20)
            kept = set(t.slot_to_block[t.slot_to_block >= 0].tolist())
            assert set(later.tolist()) <= kept
    assert source.late_loads - late == 0
    torch.testing.assert_close(t.full_weight(), twin.weight.detach(), rtol=1e-12, atol=1e-12)
