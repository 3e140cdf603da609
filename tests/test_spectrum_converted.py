"""``table_spectrum`` events of the tables the agent converted during the run (a row cache after
``cache_embedding``, an ``OffloadedEmbedding`` after ``offload_embedding``): they were missing,
exactly for the tables that caused the pressure. Real watch() runs on the CPU budget, a real
SQLite file; each event checked against the spectrum of a twin that trained the same table
resident, from the same sampled rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from action_helpers import Recommender
from torch import nn

import edo_monitor
from edo_monitor.agent.spectrum import SPECTRUM_MAX_ROWS, table_spectrum
from edo_monitor.measure.accounting import account
from edo_monitor.nn import CachedTable, OffloadedEmbedding
from edo_monitor.nn.compressed import Int8RowwiseEmbedding
from edo_monitor.nn.embedding import EmbeddingOptions
from edo_monitor.store.history import History

ITEMS, USERS, DIM, STEPS = 6000, 50, 16, 60  # more rows than are sampled: the sample matters


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, USERS, (64,), generator=g), torch.randint(0, ITEMS, (64,), generator=g))
        for _ in range(STEPS)
    ]


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for users, items in _batches():
        (model(users, items) - 1).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _run(db: Path, ladder: list[str] | None) -> tuple[nn.Module, list[str], dict[str, Any]]:
    """A watched run under a budget of 3x the model's accounted bytes (the table must go);
    returns the model, the actions applied and the run's table_spectrum events by table."""
    torch.manual_seed(0)
    model = Recommender(ITEMS)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    budget = int(account(model).total_bytes * 3)
    policy = edo_monitor.Policy(cooldown_steps=1, **({"ladder": ladder} if ladder else {}))
    with edo_monitor.watch(model, db=db, budget=budget, policy=policy, interval_s=0.01) as mon:
        _train(model, opt)
    actions = [a["action"] for a in mon.summary().actions]
    with History(db) as h:
        spectra = {e.data["table"]: e.data for e in h.events("latest", kind="table_spectrum")}
    return model, actions, spectra


@pytest.fixture(scope="module")
def twin() -> nn.Module:
    """The same model trained on the same batches, unwatched: its tables stay resident."""
    torch.manual_seed(0)
    model = Recommender(ITEMS)
    _train(model, torch.optim.Adam(model.parameters(), lr=0.01))
    return model


def _assert_same_spectrum(got: dict[str, Any], weight: torch.Tensor) -> None:
    want = table_spectrum(weight)
    assert {k: got[k] for k in ("rows_sampled", "num_embeddings", "embedding_dim")} == {
        "rows_sampled": SPECTRUM_MAX_ROWS,
        "num_embeddings": ITEMS,
        "embedding_dim": DIM,
    }
    assert got["singular_values"] == pytest.approx(want["singular_values"], rel=1e-9)
    assert got["total_energy"] == pytest.approx(want["total_energy"], rel=1e-9)


def test_a_row_cached_table_gets_its_spectrum(tmp_path: Path, twin: nn.Module) -> None:
    """The default ladder caches the item table: its event is the full caught-up table's
    spectrum (its ``weight`` is only the device cache, ``(C, D)``), the resident twin's."""
    model, actions, spectra = _run(tmp_path / "cache.db", None)
    assert "cache_embedding" in actions and isinstance(model.items, CachedTable), actions
    assert set(spectra) == {"items", "users"}
    # read without a flush (it caught every host row up: O(N) at the end of the run), and
    # reading rows counts no lookup
    table = model.items
    assert int((table.last_step < table.t).sum()) > 0
    stats, steps = table.stats(), table.last_step.clone()
    rows = table.current_rows(torch.arange(ITEMS))
    assert table.stats() == stats and torch.equal(table.last_step, steps)
    want = twin.items.weight.detach()
    assert float((rows - want).abs().max() / want.abs().max()) < 1e-12
    _assert_same_spectrum(spectra["items"], twin.items.weight)
    _assert_same_spectrum(spectra["items"], model.items.full_weight())
    assert spectra["items"]["num_embeddings"] != model.items.weight.shape[0]  # not the cache's


def test_an_offloaded_table_gets_its_spectrum(tmp_path: Path, twin: nn.Module) -> None:
    model, actions, spectra = _run(tmp_path / "offload.db", ["release_cache", "offload_embedding"])
    assert "offload_embedding" in actions and isinstance(model.items, OffloadedEmbedding), actions
    assert set(spectra) == {"items", "users"}
    _assert_same_spectrum(spectra["items"], twin.items.weight)


def test_a_compressed_table_is_skipped_and_a_plain_one_still_recorded() -> None:
    """A table whose rows are computed (int8 here) has no full weight to read: no event, and no
    agent error; the plain table beside it is recorded as before."""
    from edo_monitor.agent.spectrum import record_table_spectra, table_weight

    torch.manual_seed(0)
    weight = torch.randn(300, 8)
    model = nn.ModuleDict(
        {
            "frozen": Int8RowwiseEmbedding(weight, EmbeddingOptions(300, 8)),
            "plain": nn.Embedding(40, 8),
            "head": nn.Linear(8, 2),
        }
    )
    assert table_weight(model["frozen"]) is None and table_weight(model["head"]) is None

    class _State:
        def __init__(self) -> None:
            self.model = model
            self.events: list[tuple[str, dict[str, Any]]] = []
            self.errors: list[tuple[str, BaseException]] = []

        def _emit(self, kind: str, message: str, data: dict[str, Any]) -> None:
            self.events.append((kind, data))

        def _agent_error(self, where: str, exc: BaseException) -> None:
            self.errors.append((where, exc))

    state = _State()
    record_table_spectra(state)  # type: ignore[arg-type]
    assert state.errors == []
    assert [(k, d["table"]) for k, d in state.events] == [("table_spectrum", "plain")]


def test_a_table_holding_nan_has_no_spectrum_said_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The SVD's LinAlgError on a NaN table was logged with its whole traceback."""
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight[7, 3] = float("nan")
    with caplog.at_level("ERROR"), edo_monitor.watch(model, db=tmp_path / "h.db"):
        model(torch.tensor([1, 2])).sum().backward()
    (record,) = [r for r in caplog.records if "table spectrum" in r.getMessage()]
    assert record.exc_info is None
    assert record.getMessage() == (
        "edo-monitor: table spectrum of 0 failed (training goes on): the table holds a value "
        "that is not finite (or one beyond float32): no spectrum (an SVD cannot take it)"
    )
