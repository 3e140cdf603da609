"""What training code does around a cached table, beside its lookups: a loss term over every
parameter, optimizers split by parameter, forwards whose results are dropped. Each against a
resident ``nn.Embedding`` twin (float64) or a refusal naming the fix."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from edo_monitor.nn import CachedEmbedding

N, D, C = 500, 8, 30


def _pair() -> tuple[nn.Embedding, CachedEmbedding]:
    base = torch.randn(N, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return nn.Embedding(N, D, _weight=base.clone()), CachedEmbedding(N, D, C, _weight=base.clone())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("lookups", [True, False])
def test_a_zero_term_over_every_parameter_keeps_the_step_exact(lookups: bool) -> None:
    """``loss + 0 * sum(p.sum() for p in model.parameters())`` (DDP's way to touch every
    parameter) gave the cache's weight a gradient, and Adam stepped the cache a second time a
    step (its step count 31 after 30; rel 7.5e-3). Without a lookup it is a zero gradient for
    every row, as the resident table's."""
    twin, cached = _pair()
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (twin, cached)]
    gen = torch.Generator().manual_seed(1)
    for step in range(30):
        ids = torch.randint(0, N, (12,), generator=gen)
        for m, opt in zip((twin, cached), opts, strict=True):
            opt.zero_grad()
            loss = m(ids).pow(2).sum() if lookups or step % 3 == 0 else 0.0
            (loss + 0.0 * sum(p.sum() for p in m.parameters())).backward()
            opt.step()
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
    assert float(opts[1].state[cached.weight]["step"]) == 30.0
    sd0, sd1 = opts[0].state_dict()["state"][0], opts[1].state_dict()["state"][0]
    assert _rel(sd1["exp_avg_sq"], sd0["exp_avg_sq"]) < 1e-12


def test_a_non_zero_term_over_the_weight_is_refused_and_nothing_is_stepped() -> None:
    """An L2 term over ``.weight`` reaches only the cached rows, each at its own step: no step
    is the resident table's (rel 6e-2 before). The step refuses it, changing nothing."""
    _, cached = _pair()
    opt = torch.optim.SGD(cached.parameters(), lr=0.1, momentum=0.9)
    ids = torch.arange(10)
    (cached(ids).sum() + 1e-3 * cached.weight.pow(2).sum()).backward()
    before = cached.full_weight().clone()
    with pytest.raises(RuntimeError, match=r"gradient reached the cached table's weight"):
        opt.step()
    assert torch.equal(cached.full_weight(), before)
    assert cached.weight.grad is not None  # left where it was


def test_a_table_the_agent_made_steps_the_cached_rows_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The agent must not fail the training it watches: on a table it made, the term's gradient
    reaches the cached rows it touches (as a lookup's would) and a warning says so."""
    _, cached = _pair()
    cached.edo_action_made = True
    opt = torch.optim.SGD(cached.parameters(), lr=0.1)
    ids = torch.arange(4)
    cached(ids).sum().backward()  # rows 0-3 cached
    before = cached.full_weight().clone()
    opt.zero_grad()
    (cached(ids).sum() + cached.weight.pow(2).sum()).backward()
    with caplog.at_level(logging.WARNING, logger="edo_monitor.nn.cache_grads"):
        opt.step()
    assert "reached its weight directly" in caplog.text
    after = cached.full_weight()
    expected = before[:4] - 0.1 * (1 + 2 * before[:4])
    assert torch.allclose(after[:4], expected, rtol=1e-12, atol=0)
    assert torch.equal(after[4:], before[4:])
    assert cached.weight.grad is None


class _Model(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        self.lin = nn.Linear(D, 1, dtype=torch.float64)
        with torch.no_grad():
            self.lin.weight.fill_(0.3)
            self.lin.bias.fill_(0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids))


def test_an_optimizer_holding_the_row_buffer_but_not_the_table_is_refused() -> None:
    """``[p for p in model.parameters() if p is not model.emb.weight]`` holds ``batch_rows``:
    SGD stepped those rows before the table's optimizer did (rel 1.4e-3), Adam failed inside
    torch (size mismatch). Refused at that optimizer's step, naming the fix, which is exact."""
    twin, cached = _pair()
    model = _Model(cached)
    dense = torch.optim.SGD([p for p in model.parameters() if p is not cached.weight], lr=0.05)
    torch.optim.Adam([cached.weight], lr=0.01)  # the table's own
    (model(torch.arange(6)) - 1).pow(2).mean().backward()
    with pytest.raises(ValueError, match=r"holds its batch_rows .* p is not table\.batch_rows"):
        dense.step()
    # the fix the message names, against the twin
    twin_model, model = _Model(twin), _Model(_pair()[1])
    table = model.emb
    pairs = []
    for m, emb in ((twin_model, twin), (model, table)):
        rest = [p for p in m.parameters() if p is not emb.weight and p is not table.batch_rows]
        pairs.append((m, torch.optim.SGD(rest, lr=0.05), torch.optim.Adam([emb.weight], lr=0.01)))
    gen = torch.Generator().manual_seed(2)
    for _ in range(30):
        ids = torch.randint(0, N, (12,), generator=gen)
        for m, o_dense, o_table in pairs:
            o_dense.zero_grad()
            o_table.zero_grad()
            (m(ids) - 1).pow(2).mean().backward()
            o_dense.step()
            o_table.step()
    assert _rel(table.full_weight(), twin.weight.detach()) < 1e-12
    assert _rel(model.lin.weight.detach(), twin_model.lin.weight.detach()) < 1e-12


@pytest.mark.parametrize("overflow", ["grow", "error"])
def test_forwards_dropped_without_a_backward_let_their_rows_go(overflow: str) -> None:
    """An evaluation with gradients on (``eval()`` without ``no_grad``): each forward pinned its
    rows until a step that never came. 200 batches of 64 grew a 100-row cache to 7,218 rows
    (``overflow="error"``: raised at the second batch). A forward still held is kept."""
    twin, cached = _pair()
    cached = CachedEmbedding(N, D, 100, _weight=twin.weight.detach().clone(), overflow=overflow)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (twin, cached)]
    gen = torch.Generator().manual_seed(3)
    for m, opt in zip((twin, cached), opts, strict=True):
        opt.zero_grad()
        m(torch.arange(64)).sum().backward()
        opt.step()
    for _ in range(40):
        ids = torch.randint(0, N, (64,), generator=gen)
        twin(ids)
        cached(ids)  # dropped at once: no backward can reach it
    assert cached.cache_rows == 100
    held = cached(torch.arange(64, 128))  # kept for a backward: its rows stay
    cached(torch.arange(128, 160))
    loss = held.sum()
    # training goes on, exactly
    for m, opt in zip((twin, cached), opts, strict=True):
        opt.zero_grad()
        (m(torch.arange(64, 128)).sum() if m is twin else loss).backward()
        opt.step()
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
