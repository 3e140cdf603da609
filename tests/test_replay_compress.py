"""replay models the compress rungs with the live action's rules (decide.compress_rules): the
variant ``compress_embedding`` picks, the frozen-only variants, 16 bits or less, not smaller.
Real watch() runs on a CPU budget into real SQLite files, then replays of them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor import Policy
from edo_monitor.store.history import History

N, D = 4000, 32


def _live_run(db: Path, frozen: bool, ladder: list[str]) -> list:
    """40 steps under a budget ~15 % above the table (below the 20 % floor from the start)."""
    torch.manual_seed(0)
    emb = nn.Embedding(N, D)
    emb.weight.requires_grad_(not frozen)
    model = nn.Sequential(emb, nn.Flatten(), nn.Linear(D * 4, 1))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    table_bytes = N * D * 4 * (1 if frozen else 2)  # weight (+ its gradient; SGD keeps no state)
    policy = Policy(allow_lossy=True, ladder=ladder, cooldown_steps=1)
    with edo_monitor.watch(
        model, opt, db=str(db), budget=int(table_bytes / 0.85), policy=policy, interval_s=0.02
    ):
        for _ in range(40):
            loss = model(torch.randint(0, N, (8, 4))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.02)
    with History(str(db)) as history:
        return history.events(history.run("latest").id)


@pytest.mark.timeout(120)
def test_replay_of_a_frozen_table_compresses_it_to_int8_as_live(tmp_path: Path) -> None:
    """``compress_embedding`` is int8 for a frozen table: replay modelled bf16 (as if trainable)
    and a saving of 0 bytes."""
    db = tmp_path / "frozen.db"
    events = _live_run(db, True, ["compress_embedding"])
    live = [e.data for e in events if e.kind == "action" and e.data["status"] == "applied"]
    assert [a["details"]["variant"] for a in live] == ["int8"]
    # int8 values + a float32 scale a row, against the float32 table
    assert live[0]["saved_bytes"] == N * D * 4 - (N * D + N * 4) == 368_000
    result = edo_monitor.replay(
        str(db), "latest", {"allow_lossy": True, "ladder": ("compress_embedding",)}
    )
    first = result.decisions[0]
    assert first.action == "compress_embedding" and first.target == "0"
    assert first.saving_bytes == live[0]["saved_bytes"]
    assert "0 to int8" in first.reason
    assert len(result.decisions) == 1  # compressed once, as live


@pytest.mark.timeout(120)
def test_replay_of_a_trainable_table_refuses_int8_as_live(tmp_path: Path) -> None:
    db = tmp_path / "trainable.db"
    events = _live_run(db, False, ["compress_embedding_int8"])
    assert not [e for e in events if e.kind == "action"]
    live_reasons = {
        r["reason"] for e in events if e.kind == "no_action" for r in e.data["refusals"]
    }
    frozen_only = "0: int8 is for frozen tables (requires_grad=False)"
    assert frozen_only in live_reasons
    result = edo_monitor.replay(
        str(db), "latest", {"allow_lossy": True, "ladder": ("compress_embedding_int8",)}
    )
    assert result.decisions == ()
    assert {reason for _, refused in result.refusals for _, reason in refused} == {frozen_only}


@pytest.mark.timeout(120)
def test_explain_counts_a_frozen_table_compressed_as_it_stays(tmp_path: Path) -> None:
    """Regression: ``explain``'s remedies and staged plan costed every compression as for a
    trainable table, adding a gradient a frozen table never gets: bf16 read a saving of 0 bytes
    where it halves the table (256,000 bytes)."""
    db = tmp_path / "frozen.db"
    _live_run(db, True, ["release_cache"])
    incident = edo_monitor.explain(str(db), "latest").incidents[0]
    remedies = {r.action: r for r in incident.remedies}
    assert remedies["compress_embedding_bf16"].saving_bytes == N * D * 2 == 256_000
    stages = {s.action: s for s in incident.staged_plan.stages}
    assert stages["quantize_bf16"].saving_bytes == 256_000
