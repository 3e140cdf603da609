"""Incident memory snapshots (issue 25): stored with their events, in the format PyTorch's memory
viewer reads, built in CPU-budget mode from the accounting; the ``snapshot`` command, the
dashboard's ``m`` key, bad input, the cap, prune's thinning, and the CUDA path's logic with the
allocator faked at its boundary (``torch.cuda.memory._snapshot``)."""

from __future__ import annotations

import asyncio
import pickle
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.cuda import _memory_viz

import edo_monitor
from edo_monitor.agent.snapshots import SnapshotRecorder
from edo_monitor.measure.snapshots import (
    SnapshotError,
    build_cpu_snapshot,
    decode,
    encode,
    fragmentation,
    top_by_frame,
    totals,
)
from edo_monitor.store.history import History
from edo_monitor.store.prune import prune
from edo_monitor.store.snapshot_store import find_snapshot, load_snapshot, snapshot_infos

ROWS, DIM = 20_000, 32
# params + grads + Adam's two states of the table ~ 10.24 MB: a 12 MB budget is below the
# 20 % floor after the first step (as tests/test_agent_policy.py)
BUDGET = 12_000_000
LADDER = ["release_cache", "offload_embedding", "checkpoint_activations"]


def _train(
    db: Path, *, steps: int = 12, until_action: bool = False, **watch_kw: Any
) -> edo_monitor.Monitor:
    """``steps`` steps; with ``until_action``, more (at most 2,000, a few ms apart) until the
    tuner has applied an action: the crossing is seen by the sampler thread every 10 ms, and
    four 1 ms steps could end before it (a fresh-clone CI run had no action then)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(ROWS, DIM), nn.Linear(DIM, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    kw: dict[str, Any] = {"budget": BUDGET, "policy": edo_monitor.Policy(ladder=LADDER)}
    kw.update(watch_kw)
    with edo_monitor.watch(model, db=db, interval_s=0.01, strict=True, **kw) as mon:
        for k in range(2_000 if until_action else steps):
            if k >= steps:  # only with until_action
                if mon.summary().actions:
                    break
                time.sleep(0.002)
            loss = model(torch.randint(0, ROWS, (64,), generator=gen)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return mon


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    db = tmp_path_factory.mktemp("snap") / "h.db"
    return db, _train(db).run_id


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edo_monitor.surfaces.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_crossing_snapshot_totals_equal_the_sample_accounted_bytes(run_db: tuple[Path, int]):
    db, run_id = run_db
    with History(db) as h:
        crossing = next(
            e for e in h.events(run_id, kind="threshold_crossed") if e.data["direction"] == "below"
        )
        info = find_snapshot(h, run_id, crossing.id)
        snap = load_snapshot(h, info)
        with h._read() as conn:  # the reading the crossing was decided on: the last before it
            sample_in_use = conn.exec_driver_sql(
                "SELECT in_use_bytes FROM samples WHERE run_id = ? AND time_s <= ? "
                "ORDER BY time_s DESC LIMIT 1",
                (run_id, crossing.time_s),
            ).scalar()
    t = totals(snap)
    assert info.source == "cpu-budget" and info.phase == "at"
    assert t.allocated_bytes == crossing.data["in_use_bytes"] == sample_in_use
    assert info.allocated_bytes == t.allocated_bytes and t.reserved_bytes == BUDGET
    assert t.largest_free_block_bytes == BUDGET - t.allocated_bytes
    # the embedding table's params, grads and Adam state are its blocks, framed by module
    top = {r.frame: r.bytes for r in top_by_frame(snap, 20)}
    assert top["0 (params)"] == top["0 (grads)"] == ROWS * DIM * 4
    assert top["0 (optimizer_state)"] == 2 * ROWS * DIM * 4 + 4  # exp_avg, exp_avg_sq, step
    assert info.stored_bytes <= 2**20  # goal: ≤ 1 MiB stored


def test_action_has_before_and_after_snapshots(run_db: tuple[Path, int]) -> None:
    db, run_id = run_db
    with History(db) as h:
        action = h.events(run_id, kind="action")[0]
        rows = {r.phase: r for r in snapshot_infos(h, run_id, event_ids=[action.id])}
    assert set(rows) == {"before", "after"}
    saved = rows["before"].allocated_bytes - rows["after"].allocated_bytes
    assert saved == action.data["saved_bytes"] > 0  # the offloaded table's bytes left the tier


def test_snapshot_cli_pickle_loads_in_memory_viz_and_totals_match(
    run_db: tuple[Path, int], tmp_path: Path
) -> None:
    db, run_id = run_db
    out, html = tmp_path / "s.pickle", tmp_path / "s.html"
    with History(db) as h:
        crossing = h.events(run_id, kind="threshold_crossed")[0]
    res = _cli("snapshot", str(run_id), "--db", str(db), "--event", str(crossing.id),
               "--out", str(out), "--html", str(html), "--top", "3")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "0 (optimizer_state)" in res.stdout and "largest live blocks" in res.stdout
    snap = pickle.loads(out.read_bytes())
    lines: list[str] = []
    _memory_viz.segments(snap, format_flamegraph=lines.append)
    _memory_viz.memory(snap, format_flamegraph=lines.append)
    active = [
        int(line.rsplit(" ", 1)[1])
        for line in lines[1].splitlines()
        if ";active_allocated;" in line
    ]
    assert sum(active) == crossing.data["in_use_bytes"]
    page = _memory_viz.trace_plot(snap)
    assert "Active Memory Timeline" in page and html.read_text() == page


def test_no_snapshot_damaged_blob_and_cap(tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    off = _train(db, steps=4, snapshots=False)
    res = _cli("snapshot", str(off.run_id), "--db", str(db))
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert f"run {off.run_id} has no memory snapshot" in res.stderr

    capped = _train(db, steps=4, snapshot_cap=1)  # training goes on; the cap is an event
    assert capped.status == "finished" and capped.summary().events["snapshot_cap_reached"] == 1
    with History(db) as h:
        assert snapshot_infos(h, capped.run_id) == []

    on = _train(db, steps=4)
    with History(db) as h:
        info = snapshot_infos(h, on.run_id)[0]
        decision = h.events(on.run_id, kind="decision")[0]
    res = _cli("snapshot", str(on.run_id), "--db", str(db), "--event", str(decision.id))
    assert res.returncode == 1 and "has no memory snapshot (a decision event)" in res.stderr
    conn = sqlite3.connect(db)
    conn.execute("UPDATE snapshots SET blob = x'78da0000' WHERE id = ?", (info.id,))
    conn.commit()
    conn.close()
    res = _cli("snapshot", str(on.run_id), "--db", str(db), "--event", str(info.event_id))
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert f"the snapshot of event {info.event_id} is damaged" in res.stderr


def test_decode_refuses_objects_and_non_snapshots() -> None:
    import zlib

    # a global (os.system) is never loaded; a list is not a snapshot
    for value in (pickle.dumps(__import__("os").system), pickle.dumps([1, 2])):
        with pytest.raises(SnapshotError, match="event 7"):
            decode(zlib.compress(value), event=7)
    snap = build_cpu_snapshot([("m", "params", 10)], budget_bytes=100)
    assert decode(encode(snap)[0]) == snap


def test_fragmentation_at_an_oom() -> None:
    snap = build_cpu_snapshot(
        [("a", "params", 60), ("b", "grads", 30)], budget_bytes=100, request_bytes=25
    )
    frag = fragmentation(snap)
    assert frag == {
        "free_bytes": 10,
        "largest_free_block_bytes": 10,
        "request_bytes": 25,
        "device_free_bytes": 10,
        "fits_in_largest_free_block": False,
    }


def test_prune_thins_old_snapshots_keeping_the_last_of_each_kind(tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    mon = _train(db, steps=4, until_action=True)
    conn = sqlite3.connect(db)  # three more crossings' snapshots, as a longer run would have
    first = conn.execute(
        "SELECT s.id, s.event_id FROM snapshots s JOIN events e ON e.id = s.event_id "
        "WHERE e.kind = 'threshold_crossed'"
    ).fetchone()
    for _ in range(3):
        conn.execute(
            "INSERT INTO snapshots (run_id, time_s, step, event_id, phase, source, encoding, "
            "raw_bytes, stored_bytes, blob) SELECT run_id, time_s, step, event_id, phase, "
            "source, encoding, raw_bytes, stored_bytes, blob FROM snapshots WHERE id = ?",
            (first[0],),
        )
    conn.commit()
    before = conn.execute("SELECT count(*) FROM snapshots").fetchone()[0]
    conn.close()
    with History(db, readonly=False) as h:
        report = prune(h, downsample_older_than_s=0, now_s=2e9)
        kinds = sorted(r.event_kind for r in snapshot_infos(h, mon.run_id))
    assert report["snapshots_deleted"] == before - len(kinds)
    assert kinds == ["action", "threshold_crossed"]  # the last of each kind is kept


def test_cuda_path_keeps_the_oom_observer_snapshot_for_the_oom_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocator faked at its boundary: ``_snapshot()`` returns what a CUDA allocator
    would; the observer's moment is kept (frames trimmed, the request added to the trace) and
    stored with the ``oom`` event that follows, not a later snapshot."""
    frames = [{"filename": f"/u/train_{i}.py", "name": "f", "line": i + 1} for i in range(40)]
    block = {"address": 0, "size": 2**20, "requested_size": 2**20, "state": "active_allocated",
             "frames": frames}  # fmt: skip
    calls = iter(range(100))

    def fake_snapshot(device: object = None) -> dict[str, Any]:
        n = next(calls)
        return {
            "segments": [{"device": 0, "address": 0, "total_size": 2**21, "stream": 0,
                          "blocks": [dict(block), {"address": 2**20, "size": 2**20,
                                                   "state": "inactive", "frames": []}]}],
            "device_traces": [[]],
            "call": n,
        }  # fmt: skip

    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake_snapshot)
    with edo_monitor.watch(None, db=tmp_path / "h.db", interval_s=10, strict=True) as mon:
        rec: SnapshotRecorder = mon._snapshots  # type: ignore[assignment]
        rec._cuda = True
        monkeypatch.setattr(mon._device, "index", 0, raising=False)
        rec.on_allocator_oom(0, 3 * 2**20, 0, 2**19)
        mon._emit("oom", "out of memory", {"parsed": None})
    with History(tmp_path / "h.db") as h:
        info = find_snapshot(h, mon.run_id)
        snap = load_snapshot(h, info)
    assert info.source == "cuda" and info.event_kind == "oom" and snap["call"] == 0
    assert len(snap["segments"][0]["blocks"][0]["frames"]) == 16
    assert fragmentation(snap)["request_bytes"] == 3 * 2**20
    assert fragmentation(snap)["fits_in_largest_free_block"] is False
    assert top_by_frame(snap, 1)[0].frame == "train_0.py:1:f"


def test_dashboard_m_shows_the_selected_events_snapshot(run_db: tuple[Path, int]) -> None:
    from textual.widgets import DataTable

    from edo_monitor.tui.app import EdoTui
    from edo_monitor.tui.snapshot_screen import SnapshotScreen

    db, run_id = run_db
    app = EdoTui(db, run=str(run_id), refresh_s=0.2)

    async def go() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            screen = app.run_screen
            while not screen.event_rows:
                await pilot.pause(0.05)
            # the first event: the crossing below the floor
            screen.query_one("#events", DataTable).move_cursor(row=0, animate=False)
            assert screen.selected_event.kind == "threshold_crossed"
            await pilot.press("m")
            while not isinstance(app.screen, SnapshotScreen) or (
                app.screen.rows is None and app.screen.error is None
            ):
                await pilot.pause(0.05)
            assert app.screen.error is None
            frames = [r.frame for r in app.screen.rows]
            assert "0 (optimizer_state)" in frames
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, SnapshotScreen)

    asyncio.run(asyncio.wait_for(go(), 60))


def test_explain_shows_the_oom_snapshot_by_frame_and_its_fragmentation(tmp_path: Path) -> None:
    """An enforced CPU budget's OOM: the snapshot holds the request that failed; ``explain``
    lists the largest blocks by frame and says the request did not fit in the largest free
    block."""
    from edo_monitor.hindsight.explain import explain

    db = tmp_path / "h.db"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(ROWS, DIM), nn.Linear(DIM, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.arange(8)).sum().backward()
    opt.step()
    opt.zero_grad()
    with edo_monitor.watch(model, opt, db=db, budget=BUDGET, enforce=True, strict=True) as mon:
        for _ in range(2):  # small batches fit (the first step is profiled)
            model(torch.randint(0, ROWS, (64,))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        with pytest.raises(edo_monitor.BudgetOutOfMemoryError):
            model(torch.randint(0, ROWS, (20_000,))).pow(2).mean().backward()
    with History(db) as h:
        (oom,) = h.events(mon.run_id, kind="oom")
        result = explain(h, mon.run_id, event=oom.id)
    facts = result.incidents[0].snapshot
    assert facts is not None and facts["source"] == "cpu-budget"
    frag = facts["fragmentation"]
    # the request as the OOM's message states it (2.44 MiB: two decimals)
    assert frag["request_bytes"] == oom.data["parsed"]["requested_bytes"] == round(2.44 * 2**20)
    assert frag["fits_in_largest_free_block"] is False
    assert frag["largest_free_block_bytes"] == BUDGET - facts["allocated_bytes"]
    assert facts["top_frames"][0]["frame"] == "0 (optimizer_state)"
    res = _cli("explain", str(mon.run_id), "--db", str(db))
    assert res.returncode == 0, res.stderr
    assert "it does not fit in any free block" in res.stdout


@pytest.mark.postgres
def test_snapshots_round_trip_in_postgresql(pg_url: str) -> None:
    """BYTEA blobs, the event link by (kind, time_s) on double precision, and the cascade."""
    mon = _train(pg_url, steps=4)  # type: ignore[arg-type]
    with History(pg_url) as h:
        crossing = h.events(mon.run_id, kind="threshold_crossed")[0]
        info = find_snapshot(h, mon.run_id, crossing.id)
        snap = load_snapshot(h, info)
    assert totals(snap).allocated_bytes == crossing.data["in_use_bytes"]
    with History(pg_url, readonly=False) as h:
        prune(h, keep_last=0)
        assert snapshot_infos(h, mon.run_id) == []


class _Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.q(x) @ x.transpose(-1, -2), -1) @ x  # saves (B, T, T)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = _Attention(dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.attn(x))


def test_nested_blocks_are_counted_once_in_the_snapshot_and_in_explain(tmp_path: Path) -> None:
    """A block's recorded activations include its attention layer's. Regression: the crossing
    snapshot gave a share to each of ``<model>``, ``b1``, ``b1.attn`` … (27.4 MB of blocks for
    a reading of 23.4 MB in use), and ``explain``'s checkpointing remedy and staged plan added
    up ``b1``, ``b1.attn``, ``b2``, ``b2.attn``. Now the snapshot's blocks add up to the reading
    and the remedy names the two blocks with their recorded bytes."""
    from edo_monitor.hindsight.explain import explain
    from edo_monitor.hindsight.recorded import _activations_at, _load

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("b1", _Block(32))
    model.add_module("b2", _Block(32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    db = tmp_path / "nested.db"
    small, large = torch.randn(4, 256, 32), torch.randn(16, 256, 32)  # 2.9 and 11 MiB saved
    policy = edo_monitor.Policy(mode="observe")
    with edo_monitor.watch(
        model, db=db, budget="12MiB", interval_s=0.01, profile_interval_s=0.01, policy=policy
    ) as mon:
        for step in range(200):  # the modules' rows are recorded before the large batches
            model(small if step < 5 else large).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if mon.summary().events.get("threshold_crossed"):
                break
            time.sleep(0.01)
    with History(db) as h:
        crossing = h.events(mon.run_id, kind="threshold_crossed")[0]
        info = find_snapshot(h, mon.run_id, crossing.id)
        snap = load_snapshot(h, info)
        _, rows, _ = _load(h, mon.run_id)
        recorded = _activations_at(rows, crossing.time_s)  # the rows explain reads
        incident = explain(h, mon.run_id, event=crossing.id).incidents[0]
    assert totals(snap).allocated_bytes == crossing.data["in_use_bytes"]
    assert recorded["b1"] > recorded["b1.attn"] > 0  # a block holds its layer's bytes
    (remedy,) = [r for r in incident.remedies if r.action == "checkpoint_activations"]
    assert sorted(remedy.target.split(", ")) == ["b1", "b2"]
    assert remedy.saving_bytes == recorded["b1"] + recorded["b2"]
    stage1 = incident.staged_plan.stages[0]
    assert sorted(stage1.target.partition("checkpoint ")[2].split(", ")) == ["b1", "b2"]
