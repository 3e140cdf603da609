"""explain's remedies from what the run recorded: a table already a row cache, an out-of-memory
error before the first gradient, a run with no policy. Real watch() runs on a CPU budget into
real SQLite files."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.decide.estimate import estimate
from edo_monitor.store.history import History

ROWS, DIM = 20_000, 32
BUDGET = 9 * 2**20


def _train(
    db: Path,
    policy: edo_monitor.Policy | None,
    batches: list[int],
    interval_s: float = 0.01,
    **kw: object,
) -> int:
    """An EmbeddingBag table (Adam) and a head under a 9 MiB CPU budget, one step a batch size,
    a reading every ``interval_s``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(ROWS, DIM), nn.Linear(DIM, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    with edo_monitor.watch(
        model, db=str(db), budget=BUDGET, policy=policy, interval_s=interval_s, **kw
    ) as mon:
        for b in batches:
            ids = torch.randint(0, ROWS, (b, 16), generator=gen)
            loss = nn.functional.cross_entropy(model(ids), torch.randint(0, 2, (b,), generator=gen))
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.03)
    return mon.run_id


def _peak_ids(db: Path, run: int) -> int:
    """The most distinct ids of one batch the run recorded for its table."""
    with History(db) as h:
        (counted,) = h.events(run, kind="lookup_frequency")
    return int(counted.data["peak_unique_ids"])


@pytest.mark.timeout(180)
def test_explain_a_crossing_of_a_table_already_a_row_cache(tmp_path: Path) -> None:
    """Regression: a row cache's ``params_bytes`` are its cached rows', so the element size read
    as params // (all rows x dim) was 3 bytes for a float32 (576 bytes a row of the demo's
    64-wide table for 768); and the remedies a row cache cannot take (compressing, sharing
    a resident table) were listed for it."""
    db = tmp_path / "cached.db"
    run = _train(db, edo_monitor.Policy(ladder=["cache_embedding"]), [64] * 8 + [4096] * 8)
    with History(db) as h:
        crossings = [
            e for e in h.events(run, kind="threshold_crossed") if e.data["direction"] == "below"
        ]
    cached = crossings[-1]
    assert cached.step > 1, "no crossing while the table was a row cache: nothing to test"
    incident = edo_monitor.explain(str(db), run, event=cached.id).incidents[0]
    # (the live agent refused a second cache_embedding: listed apart, with the same numbers)
    remedies = {r.action: r for r in (*incident.remedies, *incident.refused_live)}
    row = DIM * 4 * 3  # float32 weight and Adam's two moments (a cache keeps no dense gradient)
    # the cache's rows at the crossing: its weight's bytes in the reading that crossed (the
    # crossing is at its reading's time; an action at the step of the crossing, applied before
    # or after that reading, is or is not in it)
    with sqlite3.connect(db) as conn:
        (params,) = conn.execute(
            "SELECT params_bytes FROM module_stats WHERE run_id = ? AND time_s <= ? "
            "AND placement = 'cached' ORDER BY time_s DESC, id DESC LIMIT 1",
            (run, cached.time_s),
        ).fetchone()
    cache_rows = params // (DIM * 4)  # an action's size, or the cache grown to fit a batch
    # already a row cache: the action can only shrink it (it read "keep 1,024 of 20,000 rows",
    # saving (20,000 - 1,024) rows of a resident table), and not below the distinct ids of one
    # batch the run recorded (1,024 was the floor for an unknown peak): the 4,096-row batches
    # need every row the cache holds, so no shrink is a remedy
    assert cache_rows <= _peak_ids(db, run)
    assert "cache_embedding" not in remedies
    assert row == DIM * 4 * 3  # the row of a cache (below): weight and moments
    offload = remedies["offload_embedding"]  # the cache's bytes: all it holds on the device
    assert offload.saving_bytes % (DIM * 4 * 3) == 4  # rows x (weight + 2 moments) + Adam's step
    # compress and share take a resident table only: no remedy, no quantize stage, for a row
    # cache (bf16 was listed as the cache's bytes less a whole bf16 table's)
    assert not [a for a in remedies if a.startswith(("compress_embedding", "share_embedding"))]
    assert not [s for s in incident.staged_plan.stages if s.action.startswith("quantize")]


@pytest.mark.timeout(180)
def test_explain_an_oom_in_the_first_step_counts_what_its_snapshot_says_was_alive(
    tmp_path: Path,
) -> None:
    """Regression: at an out-of-memory error of the first optimizer step (``enforce=True``) the
    table's ``module_stats`` row is from before its first backward: no gradient, no optimizer
    state. The remedies read it (offload 2.44 MiB, ``grads 0 bytes``; 128 bytes a row) while
    the error's own snapshot, and the in-use its shortfall counts, held the gradient and Adam's
    state (made by the failing step) too."""
    from edo_monitor.errors import BudgetOutOfMemoryError

    db = tmp_path / "oom.db"
    with pytest.raises(BudgetOutOfMemoryError):
        _train(db, edo_monitor.Policy(), [512] * 4, enforce=True)
    with History(db) as h:
        run = h.run("latest").id
        (oom,) = h.events(run, kind="oom")
    assert oom.step == 0 and oom.data["in_use"]["request"] == "step"
    incident = edo_monitor.explain(str(db), run, event=oom.id).incidents[0]
    remedies = {r.action: r for r in (*incident.remedies, *incident.refused_live)}
    weight = ROWS * DIM * 4
    table = weight * 4 + 4  # weight, gradient, Adam's two moments and its step counter
    offload = remedies["offload_embedding"]
    assert offload.saving_bytes == table
    assert "grads 2.44 MiB" in offload.detail
    row = DIM * 4 * 4
    assert f"({row} bytes a row)" in remedies["cache_embedding"].detail
    # a cache of the distinct ids of one batch the run recorded (1,024 rows before it was read)
    assert remedies["cache_embedding"].saving_bytes == (ROWS - _peak_ids(db, run)) * row
    # the shortfall counts the same bytes: all that was alive (the request in it) less the budget
    assert incident.in_use_bytes - incident.shortfall_bytes == BUDGET
    assert offload.enough
    bf16 = estimate(ROWS, DIM, dtype="bfloat16", optimizer="adam").total_with_step_bytes
    stages = {s.action: s for s in incident.staged_plan.stages}
    assert stages["quantize_bf16"].saving_bytes == table - bf16


@pytest.mark.timeout(180)
def test_explain_a_run_without_a_policy_says_why_nothing_is_explained(tmp_path: Path) -> None:
    """Regression: a run with no policy that went over its budget got ``no OOM and no pressure
    crossing to explain``, as if it had stayed comfortable: without a policy there is no floor,
    so no crossing is ever recorded. It now says so, with what the run did against its budget
    and where to look (replay)."""
    from typer.testing import CliRunner

    from edo_monitor.surfaces.cli import app

    db = tmp_path / "nopolicy.db"
    run = _train(db, None, [64] * 4)
    with History(db) as h:
        rows = list(
            h.samples(run, columns=["in_use_bytes", "free_fraction"], max_points=None).rows()
        )
    peak = max(r["in_use_bytes"] for r in rows)
    assert peak > BUDGET, "the run stayed under its budget: nothing to test"
    result = edo_monitor.explain(str(db), run)
    assert result.incidents == () and result.floor_fraction is None
    assert (result.budget_bytes, result.peak_in_use_bytes) == (BUDGET, peak)
    assert result.min_free_fraction == pytest.approx(min(r["free_fraction"] for r in rows))
    out = CliRunner().invoke(app, ["--db", str(db), "explain", str(run)], terminal_width=300)
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "no policy, so no floor: no pressure crossing was recorded" in text
    assert "of its budget 9 MiB" in text and "over the budget by" in text
    assert f"edo-monitor replay {run}" in text


def test_a_run_without_a_budget_is_not_sent_to_replay(tmp_path: Path) -> None:
    """Regression: a run with neither policy nor budget was sent to ``replay``, which then
    printed only "(no decision)" and "min free fraction: replay -, recorded -": with no budget
    no free memory is measured, and both now say so."""
    from typer.testing import CliRunner

    from edo_monitor.surfaces.cli import app

    db = tmp_path / "nobudget.db"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(model, db=str(db), interval_s=0.005) as mon:
        for _ in range(5):
            model(torch.randint(0, 100, (8,))).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
    runner = CliRunner()
    explained = runner.invoke(app, ["--db", str(db), "explain", "latest"], terminal_width=300)
    text = " ".join(explained.output.split())
    assert "no budget, so no free memory was measured" in text and "replay" not in text
    replayed = runner.invoke(app, ["--db", str(db), "replay", "latest"], terminal_width=300)
    assert replayed.exit_code == 0 and mon.summary().samples > 0
    assert f"run {mon.run_id} recorded no free memory (no budget)" in replayed.output


@pytest.mark.timeout(180)
def test_a_crossing_in_the_first_step_explains_the_remedy_the_agent_applied_a_step_later(
    tmp_path: Path,
) -> None:
    """Regression: at a crossing in step 0 the live agent refused the table actions for what it
    could not know yet ("no recorded step yet", and "no optimizer of the run steps it", false
    there: Adam stepped it from step 0), and explain took those refusals as ruling the
    remedies out, though the agent cached the table a step later and the run recovered. The
    table's row at the crossing had no gradient or Adam state yet, while the episode's peak
    (the shortfall) had both: every remedy left was "not enough"."""
    db = tmp_path / "first.db"
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(ROWS, DIM), nn.Linear(DIM, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    budget = int(sum(p.numel() * p.element_size() for p in model.parameters()) * 1.2)
    policy = edo_monitor.Policy(ladder=["cache_embedding"])
    with edo_monitor.watch(
        model, db=str(db), budget=budget, interval_s=0.005, policy=policy
    ) as mon:
        for _ in range(8):
            loss = model(torch.randint(0, ROWS, (64,))).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)
    run = mon.run_id
    with History(db) as h:
        first = h.events(run, kind="threshold_crossed")[0]
        applied = [e for e in h.events(run, kind="action") if e.data["status"] == "applied"]
        (refused,) = h.events(run, kind="no_action")
    assert first.step == 0 and first.data["direction"] == "below", "no crossing at step 0"
    reasons = {r["action"]: r["reason"] for r in refused.data["refusals"]}
    assert reasons["cache_embedding"].startswith("0: no optimizer has stepped yet (")
    assert applied and applied[0].data["action"] == "cache_embedding"
    incident = edo_monitor.explain(str(db), run, event=first.id).incidents[0]
    assert not [r for r in incident.refused_live if r.action == "cache_embedding"]
    remedies = {r.action: r for r in incident.remedies}
    row = DIM * 4 * 4  # float32 weight, gradient and Adam's two moments, as at the peak
    cache = remedies["cache_embedding"]
    assert cache.saving_bytes == (ROWS - _peak_ids(db, run)) * row
    assert cache.enough and not cache.lossy
    assert remedies["offload_embedding"].enough


def test_refusals_are_split_only_where_a_table_is_named() -> None:
    """Regression: a refusal's per-table reasons are joined by "; ", and a reason holding "; "
    itself was cut there (and its tail taken for another table's reason)."""
    from types import SimpleNamespace

    from edo_monitor.hindsight.recorded import refused_live

    reason = "users: a loop (x; y) steps it; items: no recorded step yet: cannot tell"
    events = [
        SimpleNamespace(kind="no_action", data={"refusals": [{"action": "a", "reason": reason}]}),
        SimpleNamespace(kind="action_refused", data={"action": "b", "reason": "items: x; z"}),
    ]
    assert refused_live(events, {"users", "items"}) == {
        ("a", "users"): "a loop (x; y) steps it",  # items' "not yet" reason rules nothing out
        ("b", "items"): "x; z",
    }


@pytest.mark.timeout(180)
def test_a_tied_table_has_no_remedy_and_a_trainable_one_no_int8(tmp_path: Path) -> None:
    """Regression: the output layer shares the token table's weight; live, the lossless rungs
    were refused as tied, and explain listed the lossy ones (int8, share, low-rank) for it,
    which every table action refuses as well. And int8, which the live action refuses for a
    trainable table, was listed for the trainable position table."""

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(ROWS, DIM), nn.Embedding(4096, DIM)
            self.head = nn.Linear(DIM, ROWS, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
            return self.head(h).flatten(0, 1)

    db = tmp_path / "tied.db"
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    budget = int(sum(p.numel() * p.element_size() for p in model.parameters()) * 1.3)
    policy = edo_monitor.Policy()
    with edo_monitor.watch(
        model, db=str(db), budget=budget, interval_s=0.005, policy=policy
    ) as mon:
        for _ in range(6):
            x = torch.randint(0, ROWS, (4, 16))
            nn.functional.cross_entropy(model(x), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)
    explanation = edo_monitor.explain(str(db), mon.run_id)
    assert explanation.incidents, "no crossing: nothing to explain"
    for incident in explanation.incidents:
        assert not [r for r in incident.remedies if r.target == "tok"]
        refused = {r.action for r in incident.refused_live if r.target == "tok"}
        assert {"offload_embedding", "compress_embedding_bf16", "share_embedding"} <= refused
        assert all("weight is tied to head" in r.detail for r in incident.refused_live)
        pos = {r.action for r in incident.remedies if r.target == "pos"}
        assert "compress_embedding_bf16" in pos and "compress_embedding_int8" not in pos
