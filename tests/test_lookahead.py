"""Eviction that looks ahead (issue 23 item 2): ``edo_monitor.nn.LookAhead`` over a loader.

Real tables, real training loops, a real resident twin; the streams are Zipf ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


@pytest.mark.parametrize("opt", ["adam", "sgd_momentum", "adamw_scheduled"])
def test_lookahead_keeps_the_cache_exact_against_a_resident_twin(opt: str) -> None:
    """Staged rows come in at their own steps and the forward catches them up: with a learning
    rate that changes every step between the staging and the forward, too."""
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    twin = nn.Embedding.from_pretrained(base.clone(), freeze=False)
    cached = CachedEmbedding(N, D, C, _weight=base.clone())
    make = {
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
        "adamw_scheduled": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    }[opt]
    o1, o2 = make([twin.weight]), make([cached.weight])
    s1, s2 = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.97) for o in (o1, o2))
    scheduled = opt.endswith("scheduled")
    batches = _batches(120)
    for ids, target in batches:
        o1.zero_grad()
        ((twin(ids) - target) ** 2).sum().backward()
        o1.step()
        if scheduled:
            s1.step()
    loader = LookAhead(batches, ahead=4, ids=lambda b: b[0], tables=cached)
    for ids, target in loader:
        o2.zero_grad()
        ((cached(ids) - target) ** 2).sum().backward()
        o2.step()
        if scheduled:
            s2.step()
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


# ------------------------------------------------------------ reused buffers, loader errors
def _refilled(count: int, view: bool = False) -> Iterator[Any]:
    """A loader that refills one buffer for every batch (``buf.fill_(i); yield buf``)."""
    buf = torch.zeros(3, dtype=torch.int64)
    target = torch.zeros(3, D, dtype=torch.float64)
    for i in range(count):
        buf.fill_(i)
        target.fill_(float(i))
        yield (buf[:], target) if view else buf


@pytest.mark.parametrize("view", [False, True])
def test_a_loader_that_refills_one_buffer_is_refused_before_a_wrong_batch_is_handed_out(
    view: bool,
) -> None:
    """A loader reusing one tensor for its batches: the read-ahead held references to the one
    buffer, so the batches came out as [3, 4, 5, 5, 5, 5] (ahead=3) and the model trained on
    the wrong ones without a word; now the read that writes into a waiting batch is refused,
    naming the batch and the fix, before anything is handed out. Copies work as the loader
    meant them."""
    table = CachedEmbedding(N, D, C)
    with pytest.raises(ValueError, match=r"wrote into batch 0 .* while giving batch 1") as err:
        next(iter(LookAhead(_refilled(6, view), ahead=3, tables=table)))
    assert "reuses one buffer" in str(err.value)
    assert "yield a new tensor for every batch (e.g. `yield buf.clone()`)" in str(err.value)
    copies = (b.clone() for b in _refilled(6))
    got = [int(b[0]) for b in LookAhead(copies, ahead=3, tables=table)]
    assert got == list(range(6))


def test_the_same_tensor_yielded_again_and_edited_by_the_step_is_not_refused() -> None:
    """Yielding one unchanged tensor again is no reuse, and neither is the training step's own
    in-place edit of a batch (it reaches the same tensor waiting later, as without LookAhead):
    only a write made while the loader gives the next batch counts."""
    ids = torch.tensor([1, 2, 3])
    table = CachedEmbedding(N, D, C)
    got = []
    for batch in LookAhead([ids, ids, ids, ids], ahead=2, tables=table):
        got.append(batch.tolist())
        batch.add_(1)  # the step edits its batch in place
    assert got == [[1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6]]  # as the plain loop sees them


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataloader_is_never_taken_for_a_reused_buffer(workers: int) -> None:
    """A ``DataLoader`` yields new tensors for every batch (collated, from worker processes),
    and, with ``batch_size=None``, views of its dataset: the same rows drawn again within the
    window are views of the same memory, unchanged, and pass. Every batch is handed out as the
    plain loader gives it, and the table is trained by them."""
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    gen = torch.Generator().manual_seed(2)
    ids = _zipf(gen, 64 * 4).reshape(64, 4)
    data = TensorDataset(ids, torch.randn(64, 4, D, generator=gen, dtype=torch.float64))
    batched = DataLoader(data, batch_size=4, num_workers=workers)
    sampler = RandomSampler(data, replacement=True, num_samples=40, generator=gen)
    single = DataLoader(data, batch_size=None, sampler=sampler)  # views of the dataset
    for loader in (batched, single):
        plain = [b[0].clone() for b in loader] if loader is batched else None
        table = CachedEmbedding(N, D, C, dtype=torch.float64)
        opt = torch.optim.SGD(table.parameters(), lr=0.1)
        got = []
        for batch_ids, target in LookAhead(loader, ahead=4, tables=table):
            got.append(batch_ids.clone())
            opt.zero_grad()
            ((table(batch_ids) - target) ** 2).sum().backward()
            opt.step()
        if plain is not None:
            assert len(got) == len(plain) and all(map(torch.equal, got, plain))
        else:  # each a row of the dataset; some drawn again within the window
            assert len(got) == 40 and all(bool((ids == b).all(1).any()) for b in got)
            assert any(
                torch.equal(got[i], got[j]) for i in range(40) for j in range(i + 1, min(i + 5, 40))
            )
        assert table.stats().misses > 0


def test_a_loader_error_is_raised_where_the_loader_raised_it() -> None:
    """A loader failing at batch 6 with ahead=3: the batches it gave before (0-5) are handed
    out and trained, then the loader's own exception object is raised (it was raised at the
    read ahead, after batch 2, and batches 3-5 were never trained)."""
    failure = RuntimeError("disk gone at batch 6")

    def failing() -> Iterator[torch.Tensor]:
        for i in range(6):
            yield torch.tensor([i, i + 10])
        raise failure

    table = CachedEmbedding(N, D, C)
    opt = torch.optim.SGD(table.parameters(), lr=0.1)
    got = []
    with pytest.raises(RuntimeError) as err:
        for ids in LookAhead(failing(), ahead=3, tables=table):
            got.append(int(ids[0]))
            opt.zero_grad()
            table(ids).sum().backward()
            opt.step()
    assert err.value is failure
    assert got == [0, 1, 2, 3, 4, 5]
    assert table._lookahead is None  # the hook is gone with the error too


def test_an_ids_error_is_raised_at_its_own_batchs_turn() -> None:
    """``ids(batch)`` failing for batch 4 (read ahead while batch 1 runs): batches 0-3 are
    handed out first, then its error, the same object."""
    failure = KeyError("no ids in batch 4")

    def ids(batch: torch.Tensor) -> torch.Tensor:
        if int(batch[0]) == 4:
            raise failure
        return batch

    batches = [torch.tensor([i, i + 10]) for i in range(8)]
    got = []
    with pytest.raises(KeyError) as err:
        for batch in LookAhead(batches, ahead=3, ids=ids, tables=CachedEmbedding(N, D, C)):
            got.append(int(batch[0]))
    assert err.value is failure
    assert got == [0, 1, 2, 3]


# ------------------------------------------------------------ tables that serve nothing
def test_a_plain_table_is_refused_and_a_model_without_cached_tables_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``tables=nn.Embedding(...)`` (a module holding no cached table, where none can appear:
    the agent replaces a table in its parent) served nothing without a word: refused, naming
    it. A model with no cached table (yet: the agent may convert one) and ``tables=None`` are
    served as before, with a warning once per LookAhead, not at every pass."""
    batches = [torch.tensor([1, 2]), torch.tensor([3, 4])]
    with pytest.raises(
        ValueError, match=r"^tables=Embedding\(200, 4\) holds no cached table, and none can "
    ):
        LookAhead(batches, tables=nn.Embedding(N, D))
    model = nn.Sequential(nn.Embedding(N, D), nn.Linear(D, 1))
    for tables, said in (
        (model, "LookAhead(tables=<Sequential>) finds no cached table"),
        (None, "LookAhead(tables=None) reads ahead but serves no table"),
    ):
        loader = LookAhead(batches, ahead=2, tables=tables)
        caplog.clear()
        with caplog.at_level("WARNING", logger="edo_monitor.nn.lookahead"):
            for _ in range(2):  # two epochs
                assert [b.tolist() for b in loader] == [b.tolist() for b in batches]
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 1 and said in messages[0]
    model[0] = CachedEmbedding(N, D, C)  # a model holding a cached table: nothing said
    caplog.clear()
    with caplog.at_level("WARNING", logger="edo_monitor.nn.lookahead"):
        list(LookAhead(batches, ahead=2, tables=model))
    assert not caplog.records
