"""Eviction that looks ahead (issue 23 item 2): ``edo_monitor.nn.LookAhead`` over a loader.

Real tables, real training loops, a real resident twin; the streams are Zipf ids.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.nn import CachedEmbedding, LookAhead

N, D, C = 200, 4, 24


def _zipf(gen: torch.Generator, count: int, n: int = N) -> torch.Tensor:
    probs = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.05
    ranks = torch.multinomial(probs, count, replacement=True, generator=gen)
    return torch.randperm(n, generator=torch.Generator().manual_seed(7))[ranks]


def _batches(steps: int, seed: int = 1, shape: tuple[int, int] = (3, 4)) -> list:
    gen = torch.Generator().manual_seed(seed)
    count = shape[0] * shape[1]
    return [
        (
            _zipf(gen, count).reshape(shape),
            torch.randn(*shape, D, generator=gen, dtype=torch.float64),
        )
        for _ in range(steps)
    ]


@pytest.mark.parametrize("opt", ["adam", "sgd_momentum"])
def test_lookahead_keeps_the_cache_exact_against_a_resident_twin(opt: str) -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    twin = nn.Embedding.from_pretrained(base.clone(), freeze=False)
    cached = CachedEmbedding(N, D, C, _weight=base.clone())
    make = {
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    }[opt]
    o1, o2 = make([twin.weight]), make([cached.weight])
    batches = _batches(120)
    for ids, target in batches:
        o1.zero_grad()
        ((twin(ids) - target) ** 2).sum().backward()
        o1.step()
    loader = LookAhead(batches, ahead=4, ids=lambda b: b[0], tables=cached)
    for ids, target in loader:
        o2.zero_grad()
        ((cached(ids) - target) ** 2).sum().backward()
        o2.step()
    st = cached.stats()
    assert st.evicted > 100  # rows really left and came back
    # rows came in staged one batch ahead (placed after the step that ran meanwhile)
    assert st.forward_loads == 0 and loader.late_loads < 0.1 * st.misses
    assert cached._lookahead is None  # the hook is gone when the iteration ends
    rel = (
        cached.full_weight() - twin.weight.detach()
    ).abs().max() / twin.weight.detach().abs().max()
    assert float(rel) < 1e-12


def test_rows_staged_before_a_checkpoint_load_are_not_placed_after_it() -> None:
    """The look-ahead stages the next batch's misses while a step runs; a table loaded in
    between (a roll-back) makes them stale: when the rows were current at staging (after a
    flush) the load went unnoticed and the placed rows brought back the pre-load values
    (2.3 off the twin)."""
    torch.manual_seed(0)
    n, c = 300, 30
    base = torch.randn(n, D, dtype=torch.float64)
    twin = nn.Embedding.from_pretrained(base.clone(), freeze=False)
    cached = CachedEmbedding(n, D, c, _weight=base.clone())
    o1, o2 = (torch.optim.SGD([t.weight], lr=0.05) for t in (twin, cached))
    cached.attach(o2)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, n, (16,), generator=gen) for _ in range(8)]
    loaded = {"weight": torch.zeros(n, D, dtype=torch.float64)}
    for i, ids in enumerate(LookAhead(batches, ahead=4, tables=cached)):
        if i == 6:
            twin.load_state_dict(loaded)
            cached.load_state_dict(loaded)
        for module, opt in ((twin, o1), (cached, o2)):
            opt.zero_grad()
            module(ids).pow(2).sum().backward()
            opt.step()
        if i == 5:
            cached.state_dict()  # a checkpoint: it flushes the table, every host row current
    assert not bool(twin.weight.detach().any())  # zero rows stay zero under this loss
    assert float(cached.full_weight().abs().max()) == 0.0


def test_rows_of_the_running_and_prefetched_batch_are_evicted_only_for_the_running_one() -> None:
    """A cache too small for two batches at times (24 ids a batch, 24 rows): no eviction takes a
    row of the batch about to run, and only the running batch's own loads (where it and the next
    batch's cached rows do not fit) take a row of the next one; the cache never grows, as it
    would not without the look-ahead (it grew, or raised with overflow="error", before)."""
    base = torch.randn(N, D, dtype=torch.float64)
    cached = CachedEmbedding(N, D, C, _weight=base)
    opt = torch.optim.SGD([cached.weight], lr=0.1)
    batches = _batches(80, shape=(4, 6))
    loader = LookAhead(batches, ahead=3, ids=lambda b: b[0], tables=cached)
    taken: list[tuple[int, set[int], bool]] = []
    evict, step = cached._evict, [0]

    def recording(count: int, protect: torch.Tensor, for_batch: bool = False) -> torch.Tensor:
        blocks_before = cached.slot_to_block.clone()
        slots = evict(count, protect, for_batch=for_batch)
        gone = blocks_before[slots]
        taken.append((step[0], set(gone[gone >= 0].tolist()), for_batch))
        return slots

    cached._evict = recording
    tight = 0
    for i, (ids, target) in enumerate(loader):
        assert step[0] == i
        nxt = batches[min(i + 1, 79)][0]
        tight += int(torch.unique(torch.cat([ids.reshape(-1), nxt.reshape(-1)])).numel() > C - 4)
        opt.zero_grad()
        ((cached(ids) - target) ** 2).sum().backward()
        opt.step()
        step[0] = i + 1  # the next() that follows hands out batch i + 1
    next_rows_taken = 0
    for i, gone, for_batch in taken:  # evictions at next() for batch i and inside its forward
        assert not gone & set(batches[i][0].reshape(-1).tolist()), i
        next_rows = gone & set(batches[min(i + 1, 79)][0].reshape(-1).tolist())
        assert for_batch or not next_rows, (i, next_rows)
        next_rows_taken += len(next_rows)
    assert tight > 5 and sum(len(g) for _, g, _ in taken) > 50
    assert next_rows_taken > 0  # the tight steps: the running batch's loads took them
    assert cached.cache_rows == C


def _loads(stream: torch.Tensor, batch: int, cache_rows: int, ahead: int | None) -> tuple:
    table = CachedEmbedding(N * 10, 1, cache_rows, _freeze=True, overflow="error")
    batches = [stream[s : s + batch] for s in range(0, stream.numel(), batch)]
    source = batches if ahead is None else LookAhead(batches, ahead, lambda b: b, table)
    unique = 0
    with torch.no_grad():
        for ids in source:
            unique += torch.unique(ids).numel()
            table(ids)
    st = table.stats()
    critical = st.forward_loads + (source.late_loads if ahead is not None else 0)
    return 1 - st.misses / unique, critical, unique, st.lookups


def test_hit_rate_at_least_lfu_on_zipf_and_forward_loads_under_one_percent() -> None:
    """Loads on the critical path: inside the forward, or at the batch's own ``next()``."""
    gen = torch.Generator().manual_seed(3)
    stream = _zipf(gen, 40_000, n=N * 10)
    plain, plain_forward, unique, _ = _loads(stream, 64, 200, None)
    ahead, forward, unique2, lookups = _loads(stream, 64, 200, 8)
    assert unique == unique2
    assert plain_forward > 0  # without the wrapper every miss is loaded inside the forward
    assert ahead >= plain, (ahead, plain)
    assert forward <= 0.01 * lookups, (forward, lookups)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="ahead=0"):
        LookAhead([], ahead=0, ids=lambda b: b)
    with pytest.raises(ValueError, match="ids=3"):
        LookAhead([], ahead=2, ids=3)
    with pytest.raises(ValueError, match="batch of type str holds no integer tensor"):
        list(LookAhead(["x"], ahead=2, tables=CachedEmbedding(N, D, C)))


def test_watch_with_a_loader_serves_the_models_cached_tables(db_path) -> None:
    import edo_monitor

    torch.manual_seed(0)
    model = nn.Sequential(CachedEmbedding(N, D, C, dtype=torch.float64))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = _batches(40)
    with pytest.raises(edo_monitor.ConfigError, match="ahead=0"):
        edo_monitor.watch(model, db=db_path, loader=batches, ahead=0)
    # each bad argument named as watch() calls it, before anything runs
    with pytest.raises(edo_monitor.ConfigError, match=r"^loader_ids=3; expected a function"):
        edo_monitor.watch(model, db=db_path, loader=batches, loader_ids=3)
    with pytest.raises(edo_monitor.ConfigError, match=r"^loader=5; expected an iterable"):
        edo_monitor.watch(model, db=db_path, loader=5)
    with pytest.raises(edo_monitor.ConfigError, match=r"^loader_ids=.* without loader="):
        edo_monitor.watch(model, db=db_path, loader_ids=lambda b: b)

    class Indexed:  # iterable as a sequence, through __getitem__ alone (as iter() takes it)
        def __getitem__(self, i: int) -> torch.Tensor:
            if i >= len(batches):
                raise IndexError(i)
            return batches[i]

    with edo_monitor.watch(model, db=db_path, loader=Indexed(), track_activations=False) as mon:
        assert len(list(mon.loader)) == len(batches)
    with edo_monitor.watch(
        model, opt, db=db_path, interval_s=0.01, track_activations=False, loader=batches, ahead=4
    ) as mon:
        for ids, target in mon.loader:  # the default ids: the batch's first integer tensor
            assert model[0]._lookahead is mon.loader
            opt.zero_grad()
            ((model(ids) - target) ** 2).sum().backward()
            opt.step()
    st = model[0].stats()
    assert st.misses > C and st.evicted > 0
    assert st.forward_loads == 0


def test_no_tables_is_said_when_iterated(caplog: pytest.LogCaptureFixture) -> None:
    """``LookAhead(loader)`` without ``tables=`` serves nothing: a warning says so (a new user's
    read-ahead that silently did nothing); the batches still pass through unchanged."""
    batches = [torch.arange(4), torch.arange(4, 8)]
    with caplog.at_level("WARNING", logger="edo_monitor.nn.lookahead"):
        got = list(LookAhead(batches, ahead=2))
    assert [b.tolist() for b in got] == [b.tolist() for b in batches]
    assert "serves no table" in caplog.text


def test_a_batch_that_needs_the_next_ones_rows_takes_them_as_without_a_lookahead() -> None:
    # a 2-row cache: batch 1 needs both rows, batch 2 reuses row 0 of batch 0; the look-ahead
    # protected batch 2's cached row 0 from batch 1, which then did not fit (raised, or grew)
    batches = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([0, 2])]
    for overflow in ("error", "grow"):
        table = CachedEmbedding(10, 4, 2, overflow=overflow)
        opt = torch.optim.SGD(table.parameters(), lr=0.1)
        for ids in LookAhead(batches, ahead=2, tables=table):
            table(ids).sum().backward()
            opt.step()
            opt.zero_grad()
        assert table.cache_rows == 2


def test_a_cache_the_size_of_the_largest_batch_never_grows_under_a_lookahead() -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    batches = [_zipf(gen, 8) for _ in range(60)]
    largest = max(int(torch.unique(b).numel()) for b in batches)
    weights = []
    for ahead in (None, 8):
        table = CachedEmbedding(N, D, largest, _weight=base.clone(), overflow="grow")
        opt = torch.optim.Adam(table.parameters(), lr=0.01)
        loader = batches if ahead is None else LookAhead(batches, ahead=ahead, tables=table)
        for ids in loader:
            table(ids).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        assert table.cache_rows == largest
        weights.append(table.state_dict()["weight"])
    torch.testing.assert_close(weights[1], weights[0], rtol=1e-12, atol=0)


def test_ids_that_are_not_integer_ids_and_tables_that_are_not_cached_are_refused_by_name() -> None:
    # regression: ids(batch) giving None raised torch's "Could not infer dtype of NoneType", float
    # ids were truncated to rows silently, and tables="emb" (a string) or a list holding a
    # non-table served nothing without a word
    table = CachedEmbedding(N, D, C)
    batches = [torch.tensor([1, 2])] * 3
    for ids, what in ((lambda b: None, "NoneType"), (lambda b: b + 0.5, "torch.float32 values")):
        with pytest.raises(TypeError, match=f"^LookAhead ids\\(batch\\) gave {what}; expected"):
            list(LookAhead(batches, ahead=2, ids=ids, tables=table))
    with pytest.raises(ValueError, match=r"^tables='emb'; expected a model"):
        LookAhead(batches, tables="emb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^tables\[1\] is a str; expected CachedTable"):
        LookAhead(batches, tables=[table, "x"])  # type: ignore[list-item]
    # a generator of tables is kept (it was spent at the first batch: the others went unserved)
    distinct = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6])]
    list(LookAhead(distinct, ahead=2, tables=(t for t in [table])))
    assert table.stats().misses == 6
