"""A bare embedding table watched as the model: no table action can swap it (it has no parent),
so the policy never decides one, the refusal says why, explain rules its remedies out, and the
table is called ``<model>`` wherever the agent names it (real training loops, real SQLite)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import edo_monitor
from edo_monitor.actions.base import ActionContext
from edo_monitor.actions.registry import ACTIONS
from edo_monitor.actions.tables import device_tables, tied_blocker
from edo_monitor.decide.plans import MODEL_MODULE, TABLE_BLOCKERS, Refusal, module_label
from edo_monitor.store.history import History

ROOT_REASON = (
    "<model>: table is the watched model itself: an action swaps a table in its parent module, "
    "and the model has none (watch a module that holds the table, such as nn.Sequential(table))"
)
TABLE_ACTIONS = ("cache_embedding", "spill_embedding", "offload_embedding")


def _train(model: nn.Module, db: Path, steps: int = 40) -> edo_monitor.Monitor:
    """The new user's run: 100,000 x 64 (params, grads and Adam's state: 97.7 MiB) under a
    60 MiB budget, the default policy."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with edo_monitor.watch(
        model, budget="60MiB", policy=edo_monitor.Policy(), db=db, interval_s=0.01
    ) as mon:
        for _ in range(steps):
            loss = model(torch.randint(0, 100_000, (256,))).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return mon


def test_a_table_that_is_the_model_is_never_decided_and_says_why(db_path: Path) -> None:
    """It was decided (``cache_embedding on -``), failed and was rolled back ("cannot replace
    the root model"), then ``offload_embedding`` the same: two actions that could not apply."""
    mon = _train(nn.Embedding(100_000, 64), db_path)
    summary = mon.summary()
    assert (summary.status, summary.steps, summary.actions) == ("finished", 40, ())
    with History(db_path) as h:
        events = h.events(mon.run_id)
    kinds = [e.kind for e in events]
    assert "decision" not in kinds and "action_failed" not in kinds
    (none,) = [e for e in events if e.kind == "no_action"]
    refusals = {r["action"]: r for r in none.data["refusals"]}
    for name in TABLE_ACTIONS:
        assert (refusals[name]["target"], refusals[name]["reason"]) == (MODEL_MODULE, ROOT_REASON)
    assert f"cache_embedding ({ROOT_REASON})" in none.message
    # the module rows name it as the refusals do
    assert [r["module"] for r in mon.breakdown()] == ["<model>"]

    explained = edo_monitor.explain(db_path, mon.run_id)
    (incident,) = explained.incidents
    assert not [r for r in incident.remedies if r.target == "<model>"]
    refused = {r.action: r.detail for r in incident.refused_live}
    assert {"offload_embedding", "cache_embedding"} <= refused.keys()
    assert set(refused.values()) == {"refused live: " + ROOT_REASON.removeprefix("<model>: ")}


def test_every_surface_calls_the_model_table_model_and_replay_refuses_it(db_path: Path) -> None:
    """``table_spectrum`` said ``": singular spectrum …"`` (table ``""``, which explain's staged
    plan could not match), ``lookup_frequency`` ``<root>``; replay planned the table actions the
    live agent refuses."""
    mon = _train(nn.Embedding(100_000, 64), db_path, steps=12)
    with History(db_path) as h:
        (spectrum,) = h.events(mon.run_id, kind="table_spectrum")
        (frequency,) = h.events(mon.run_id, kind="lookup_frequency")
    assert spectrum.data["table"] == MODEL_MODULE
    assert spectrum.message.startswith("<model>: singular spectrum")
    assert frequency.message.startswith("<model>: top 20 ids")
    result = edo_monitor.replay(str(db_path), mon.run_id, edo_monitor.Policy())
    assert not [d for d in result.decisions if d.target == MODEL_MODULE]
    reasons = {reason for _, refused in result.refusals for _, reason in refused}
    assert ROOT_REASON in reasons


def test_the_same_table_held_by_a_module_is_cached(db_path: Path) -> None:
    """What the refusal advises works: inside ``nn.Sequential`` the table has a parent."""
    mon = _train(nn.Sequential(nn.Embedding(100_000, 64)), db_path, steps=12)
    (first, *_) = mon.summary().actions
    assert (first["action"], first["target"], first["status"]) == (
        "cache_embedding",
        "0",
        "applied",
    )


def test_every_table_action_refuses_the_model_itself(tmp_path: Path) -> None:
    """The lossy rungs too (they swap the table as well), each with the table blocker first."""
    model = nn.Embedding(1_000, 16)
    (table,) = device_tables(model, [], cuda_mode=False)
    assert table.name == "<model>"
    ctx = ActionContext(
        model, [], cuda_mode=False, device=torch.device("cpu"), spill_dir=tmp_path / "spill"
    )
    for name in (
        *TABLE_ACTIONS,
        "compress_embedding",
        "compress_embedding_int8",
        "share_embedding",
    ):
        refusal = ACTIONS[name].plan(ctx)
        assert isinstance(refusal, Refusal), name
        assert refusal.reason.startswith("<model>: " + TABLE_BLOCKERS[2]), (name, refusal)


def test_a_weight_the_model_itself_holds_names_it_as_the_model() -> None:
    """A table tied to a parameter of the model's own read ``weight is tied to  (Tied)``."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1_000, 16)
            self.out_weight = self.emb.weight

    model = Tied()
    assert tied_blocker(model, model.emb, model.emb.weight) == "weight is tied to <model> (Tied)"
    assert tied_blocker(model, model, model.emb.weight).startswith(TABLE_BLOCKERS[2])
    assert (module_label(""), module_label("enc.emb")) == ("<model>", "enc.emb")
