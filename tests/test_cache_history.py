"""Row caches seen everywhere (issue 12, item 5): a real watched loop over a CachedEmbeddingBag
records the cache's counters per sample and per table, and ``History``, ``edo-monitor show`` and
the dashboard's tables panel show them."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import edo_monitor
from edo_monitor.nn import CachedEmbeddingBag
from edo_monitor.store.history import History
from edo_monitor.store.schema import CACHE_FIELDS
from edo_monitor.surfaces.cli import app

ROWS, DIM, CACHE = 5_000, 16, 500
STEPS = 40


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = CachedEmbeddingBag(ROWS, DIM, CACHE, mode="sum")
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(ids))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, dict[str, int]]:
    """A finished run of STEPS steps; the table's own totals at its end."""
    db = tmp_path_factory.mktemp("cache") / "h.db"
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.items.attach(opt)
    gen = torch.Generator().manual_seed(1)
    probs = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.05
    with edo_monitor.watch(model, opt, db=str(db), interval_s=0.01) as monitor:
        for _ in range(STEPS):
            ids = torch.multinomial(probs, 64 * 4, replacement=True, generator=gen).view(64, 4)
            model(ids).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            time.sleep(0.003)  # a few samples land between steps
        run_id = monitor.run_id
    st = model.items.stats()
    totals = st.history_totals()
    # the names map onto the table's own counters
    assert (totals["cache_rows_loaded"], totals["cache_moved_bytes"]) == (
        st.misses,
        st.h2d_bytes + st.d2h_bytes,
    )
    return db, run_id, totals


def test_samples_and_module_rows_add_up_to_the_tables_counters(
    recorded: tuple[Path, int, dict[str, int]],
) -> None:
    db, run_id, totals = recorded
    assert totals["cache_lookups"] == STEPS * 64 * 4  # every looked-up id, repeats too
    assert 0 < totals["cache_lookup_hits"] < totals["cache_lookups"]
    assert totals["cache_rows_loaded"] > CACHE and totals["cache_rows_evicted"] > 0
    con = sqlite3.connect(db)
    sums = con.execute(
        "SELECT " + ", ".join(f"sum({f})" for f in CACHE_FIELDS[1:]) + ", count(*) "
        "FROM samples WHERE run_id = ? AND cache_rows IS NOT NULL",
        (run_id,),
    ).fetchone()
    last_rows = con.execute(
        "SELECT cache_rows FROM samples WHERE run_id = ? ORDER BY id DESC LIMIT 1", (run_id,)
    ).fetchone()[0]
    con.close()
    # the increments of every sample add up to the table's totals: nothing counted twice or lost
    assert dict(zip(CACHE_FIELDS[1:], sums[:-1], strict=True)) == {
        k: v for k, v in totals.items() if k != "cache_rows"
    }
    assert sums[-1] >= 2 and last_rows == CACHE
    with History(db) as h:
        (items,) = [m for m in h.modules(run_id) if m.module == "items"]
        assert {f: getattr(items, f) for f in CACHE_FIELDS} == totals
        assert items.cache_hit_fraction == totals["cache_lookup_hits"] / totals["cache_lookups"]
        head = next(m for m in h.modules(run_id) if m.module == "head")
        assert head.cache_rows is None and head.cache_hit_fraction is None
        summary = h.cache_summary(run_id)
        assert summary is not None
        assert summary.lookups == totals["cache_lookups"]
        assert summary.moved_bytes == totals["cache_moved_bytes"]
        assert summary.rows_now == CACHE
        assert summary.moved_bytes_per_step == pytest.approx(
            totals["cache_moved_bytes"] / (summary.last_step - summary.first_step)
        )
        # downsampled, the buckets' means times their counts still add up to the total
        s = h.samples(run_id, columns=["cache_lookups"], max_points=3)
        total = sum(m * n for m, n in zip(s.mean["cache_lookups"], s.count, strict=True))
        assert s.downsampled and total == pytest.approx(totals["cache_lookups"])


def test_show_prints_the_row_caches(recorded: tuple[Path, int, dict[str, int]]) -> None:
    db, run_id, totals = recorded
    runner = CliRunner()
    res = runner.invoke(app, ["show", str(run_id), "--db", str(db)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    hit = 100 * totals["cache_lookup_hits"] / totals["cache_lookups"]
    caches = res.output[res.output.index("row caches") :]  # the table after the modules table
    line = next(line for line in caches.splitlines() if line.strip(" │|").startswith("items"))
    assert f"{CACHE:,} of {ROWS:,}" in line and f"{hit:.1f}%" in line
    assert f"{totals['cache_rows_loaded']:,}" in line
    res = runner.invoke(app, ["show", str(run_id), "--db", str(db), "--json"])
    data = json.loads(res.output)
    assert data["row_cache"]["lookups"] == totals["cache_lookups"]
    items = next(m for m in data["modules"] if m["module"] == "items")
    assert items["cache_rows_evicted"] == totals["cache_rows_evicted"]


def test_dashboard_tables_panel_shows_the_cache(
    recorded: tuple[Path, int, dict[str, int]],
) -> None:
    from textual.widgets import DataTable

    from edo_monitor.tui.app import EdoTui

    db, run_id, totals = recorded

    async def drive() -> list[str]:
        tui = EdoTui(db, run=str(run_id))
        async with tui.run_test(size=(160, 50)) as pilot:
            screen = tui.run_screen
            deadline = time.monotonic() + 60  # hang guard
            table = screen.query_one("#modules", DataTable)
            while table.row_count == 0 and time.monotonic() < deadline:
                await pilot.pause(0.02)
            return [str(c) for c in table.get_row("items")]

    row = asyncio.run(drive())
    hit = 100 * totals["cache_lookup_hits"] / totals["cache_lookups"]
    assert row[-2:] == [f"{CACHE:,}", f"{hit:.1f} %"]
