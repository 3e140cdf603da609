"""Loaders as users pass them to a look-ahead (the faults of the ``watch(loader=)`` review): a
one-shot iterator left with ``break`` keeps the batches read ahead; batches whose ids the
look-ahead cannot find never fail the agent's training; a ``loader_ids`` mapping keyed by the
user's own table module serves the row cache the agent made of it. Real tables, real training
loops and real ``watch()`` runs on a CPU budget."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.nn import CachedEmbedding, CachedTable, LookAhead
from edo_monitor.nn.lookahead import first_int_tensor


def _stream(count: int | None = None) -> Iterator[torch.Tensor]:
    """Batch ``k`` holds the ids ``k`` (one-shot: a generator)."""
    for k in itertools.count() if count is None else range(count):
        yield torch.full((4,), k)


def _epochs(batches: object, steps: int = 5, epochs: int = 3) -> list[int]:
    """``steps`` batches an epoch, each epoch leaving its pass with ``break``."""
    got = []
    for _ in range(epochs):
        for s, b in enumerate(batches):  # type: ignore[call-overload]
            got.append(int(b[0]))
            if s + 1 == steps:
                break
    return got


def test_a_one_shot_loader_left_with_break_keeps_the_batches_read_ahead() -> None:
    """Regression: each ``break`` dropped the ``ahead`` batches read in advance (0-4, then
    13-17, then 26-30 where the generator itself gives 0-14). Its exception, read ahead, is
    raised in the next pass after the batches before it."""
    table = CachedEmbedding(1000, 4, 50)
    assert _epochs(_stream()) == list(range(15))
    assert _epochs(LookAhead(_stream(), ahead=8, tables=table)) == list(range(15))

    def failing() -> Iterator[torch.Tensor]:
        yield from _stream(2)
        raise KeyError("the loader's own")

    served = LookAhead(failing(), ahead=8, tables=table)
    assert [int(b[0]) for b in itertools.islice(served, 1)] == [0]
    got = []
    with pytest.raises(KeyError, match="the loader's own"):
        for b in served:
            got.append(int(b[0]))
    assert got == [1]
    # a loader whose iter() restarts (a list, a DataLoader) starts again, as it would alone
    assert _epochs(LookAhead(list(_stream(20)), ahead=8, tables=table)) == [0, 1, 2, 3, 4] * 3


def _orders(batches: object) -> list[list[int]]:
    """The batches three ways of reading a loader see: a warm-up ``next()`` of an iterator kept
    alive, then two ``for`` loops; ``zip`` of the loader with itself; loops nested in it."""
    it = iter(batches)  # type: ignore[call-overload]
    peeked = [int(next(it)[0]) for _ in range(3)]
    first = [int(b[0]) for b in batches]  # type: ignore[attr-defined]
    del it
    return [peeked, first, [int(b[0]) for b in batches]]  # type: ignore[attr-defined]


def test_a_one_shot_loader_read_by_two_loops_at_once_is_read_as_the_loader_alone() -> None:
    """Regression: ``iter()`` of a look-ahead over a generator began a new pass while one was
    going: a warm-up ``next()`` then a ``for`` loop skipped the batches the first pass had read
    ahead (0, 1, 2, 6, ..., 9, then 3, 4, 5 when the first was collected: 0.28 off in
    training). Like ``iter()`` of the generator itself, it gives the pass still going."""
    table = CachedEmbedding(100, 4, 20)
    assert _orders(_stream(10)) == [[0, 1, 2], list(range(3, 10)), []]
    assert _orders(LookAhead(_stream(10), ahead=3, tables=table)) == _orders(_stream(10))
    for loader in (_stream(7), LookAhead(_stream(7), ahead=3, tables=table)):
        assert [(int(a[0]), int(b[0])) for a, b in zip(loader, loader, strict=False)] == [
            (0, 1),
            (2, 3),
            (4, 5),
        ]
    nested = LookAhead(_stream(6), ahead=2, tables=table)
    assert [[int(b[0]) for b in nested] for _ in nested] == [[1, 2, 3, 4, 5]]
    # a loader whose iter() restarts gives each loop its own pass, as it would alone
    listed = list(_stream(10))
    assert _orders(LookAhead(listed, ahead=3, tables=table)) == _orders(listed)


def test_a_loop_that_reads_the_next_batch_before_its_step_is_told_what_defeats_the_look_ahead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A "prefetch the next batch" helper over the look-ahead runs each step one batch behind
    the one handed out last: its lookups match none of that batch's tensors. The warning named
    the one table ``?`` and blamed the model alone."""
    table = CachedEmbedding(50, 4, 8)

    def one_ahead(batches: LookAhead) -> Iterator[torch.Tensor]:
        it = iter(batches)
        cur = next(it, None)
        while cur is not None:
            nxt = next(it, None)
            yield cur
            cur = nxt

    with caplog.at_level(logging.WARNING, logger="edo_monitor.nn.lookahead_ids"):
        for ids in one_ahead(
            LookAhead([torch.tensor([k, k + 10]) for k in range(8)], 2, tables=table)
        ):
            table(ids)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("LookAhead: table CachedEmbedding looks up ids that are none")
    assert "a loop that reads the next batch before its step defeats the look-ahead" in line


def test_ids_found_at_any_depth_and_an_ids_error_under_warn_is_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The default ids look inside nested batches (``({"user": u}, labels)`` raised "holds no
    integer tensor"); a batch they still cannot read fails a plain LookAhead at its turn, and
    under ``ids_errors="warn"`` (the agent's) is served without look-ahead, one warning."""
    u = torch.tensor([3, 4])
    assert first_int_tensor(({"user": u, "x": torch.ones(2)}, torch.zeros(2))) is u

    @dataclasses.dataclass
    class Fields:  # a dataclass batch: its fields in order (it raised "holds no integer tensor")
        x: torch.Tensor
        ids: dict[str, torch.Tensor]

    assert first_int_tensor(Fields(torch.ones(2), {"user": u})) is u

    class Batch:  # a custom batch object: no integer tensor the default can find
        def __init__(self, ids: torch.Tensor) -> None:
            self.ids = ids

    batches = [Batch(torch.tensor([k])) for k in range(5)]
    table = CachedEmbedding(100, 4, 10)
    with pytest.raises(ValueError, match="holds no integer tensor"):
        list(LookAhead(batches, ahead=2, tables=table))
    with caplog.at_level(logging.WARNING, logger="edo_monitor.nn.lookahead"):
        assert list(LookAhead(batches, ahead=2, tables=table, ids_errors="warn")) == batches
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("LookAhead: ids(batch) failed (ValueError: a batch of type Batch")
    with pytest.raises(ValueError, match=r"^ids_errors='ignore'; expected 'raise' or 'warn'$"):
        LookAhead(batches, ids_errors="ignore")
    # no ids: each table's found from its own lookups (a two-table model's second cache was
    # served the first tensor, the user ids: more rows loaded than with no look-ahead at all)
    caplog.clear()
    two = nn.ModuleDict({name: CachedEmbedding(1000, 4, 40) for name in ("users", "goods")})
    g = torch.Generator().manual_seed(2)
    pairs = [tuple(torch.randint(0, 1000, (2, 16), generator=g)) for _ in range(8)]
    loads = []
    with caplog.at_level(logging.WARNING, logger="edo_monitor.nn.lookahead_ids"):
        for users, goods in LookAhead(pairs, ahead=2, tables=two):
            before = two["goods"].stats().forward_loads
            two["users"](users), two["goods"](goods)
            loads.append(two["goods"].stats().forward_loads - before)
    assert loads[0] > 0 and loads[3:] == [0] * 5 and not caplog.records


class _Rec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = nn.Embedding(2_000, 16), nn.Embedding(20_000, 16)

    def forward(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.users(f["user"]) * self.items(f["item"])).sum(-1)


def _nested_batches() -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            {
                "user": torch.randint(0, 2_000, (256,), generator=g),
                "item": torch.randint(0, 20_000, (256,), generator=g),
            },
            torch.randn(256, generator=g),
        )
        for _ in range(12)
    ]


def _train(db: Path | None, ids_for: Callable | None = None) -> tuple[list[float], nn.Module]:
    """The recommender on the nested batches: unwatched (``db=None``), or watched with them as
    ``loader=`` (``loader_ids=ids_for(model)`` when given), a budget the item table must leave."""
    torch.manual_seed(0)
    model = _Rec()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = _nested_batches()
    losses: list[float] = []
    if db is None:
        for features, labels in batches:
            loss = ((model(features) - labels) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, model
    budget = int(sum(p.numel() * p.element_size() for p in model.parameters()) * 1.3)
    policy = edo_monitor.Policy(ladder=["cache_embedding"])
    ids = {} if ids_for is None else {"loader_ids": ids_for(model)}
    with edo_monitor.watch(
        model, db=db, budget=budget, policy=policy, interval_s=0.005, loader=batches, **ids
    ) as mon:
        for features, labels in mon.loader:
            loss = ((model(features) - labels) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            time.sleep(0.01)
    assert mon.summary().status == "finished"
    return losses, model


def _by_module(model: nn.Module) -> Callable:
    """``loader_ids`` keyed by the model's own table modules, as the docs allow."""
    users, items = model.users, model.items
    return lambda b: {users: b[0]["user"], items: b[0]["item"]}


def test_the_agents_look_ahead_over_nested_batches_and_a_mapping_keyed_by_module(
    tmp_path: Path,
) -> None:
    """Regression: with ``(features_dict, labels)`` batches the agent's look-ahead raised "holds
    no integer tensor" out of the user's loop at the first step after it cached a table (the
    run failed after 2 steps); and a ``loader_ids`` mapping keyed by the user's table module
    (as documented) missed the row cache the agent replaced it with: no look-ahead, silently.
    Both train as the unwatched twin; keyed by module, no row loads inside the forward."""
    twin, _ = _train(None)
    nested, model = _train(tmp_path / "nested.db")
    assert isinstance(model.items, CachedTable)
    assert max(abs(a - b) for a, b in zip(nested, twin, strict=True)) < 1e-5
    keyed, model = _train(tmp_path / "keyed.db", _by_module)
    assert isinstance(model.items, CachedTable)
    assert max(abs(a - b) for a, b in zip(keyed, twin, strict=True)) < 1e-5
    assert model.items.stats().forward_loads == 0


def test_a_loader_given_but_never_iterated_through_the_monitor_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: ``watch(loader=batches)`` and the loop over ``batches`` itself (the README's
    first loop, with ``loader=`` added): no look-ahead, and nothing said."""
    model = nn.Sequential(nn.Embedding(100, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randint(0, 100, (8,)) for _ in range(4)]
    for served in (False, True):
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, logger="edo_monitor.agent.lifecycle"),
            edo_monitor.watch(model, db=tmp_path / "h.db", loader=batches) as mon,
        ):
            for ids in mon.loader if served else batches:
                model(ids).sum().backward()
                opt.step()
                opt.zero_grad()
        said = [r for r in caplog.records if "monitor.loader was never iterated" in r.getMessage()]
        assert len(said) == (0 if served else 1)
