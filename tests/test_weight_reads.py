"""Issue 21 item 1: a table's weight read outside its module (tied by use) is never converted.

The read is found by the activation recorder's use watcher over one recorded step, by the
parameter itself or by any tensor on its storage (``self.emb.weight.T`` is a view: its
``matmul`` reads the weight). Every converting action refuses naming the read; the agent's
ladder moves on and the model trains bit-identical to an untouched twin.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import edo_monitor
from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder, Plan, Refusal
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.store.history import History

N, D = 600, 16

#: every action that replaces, moves or re-shapes a table's weight
CONVERTING = ["cache_embedding", "offload_embedding", "compress_embedding_bf16", "share_embedding"]


class LM(nn.Module):
    """The output layer is the table's weight, read outside the table's forward."""

    def __init__(self, n: int = N, d: int = D, read: str = "T") -> None:
        super().__init__()
        self.emb = nn.Embedding(n, d)
        self.read = read
        if read == "kept_view":
            self.kept_view = self.emb.weight.T  # a view made once, before any step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        w = self.emb.weight
        if self.read == "T":
            logits = h @ w.T
        elif self.read == "linear":
            logits = F.linear(h, w)
        elif self.read == "matmul_t":
            logits = torch.matmul(h, w.t())
        elif self.read == "index":  # a second lookup of the same rows, outside emb
            logits = (h + w[x]) @ torch.ones(D, N)
        elif self.read == "kept_view":
            logits = h @ self.kept_view
        else:
            raise ValueError(self.read)
        return F.cross_entropy(logits, x)


#: the read each variant makes, as the refusal names it
READS = {
    "T": "<model>: matmul (a view of the weight)",
    "linear": "<model>: linear",
    "matmul_t": "<model>: t",
    "index": "<model>: __getitem__",
    "kept_view": "<model>: matmul (a view of the weight)",
}


def _recorded_step(model: nn.Module, opt: torch.optim.Optimizer, counter: LookupCounter):
    x = torch.randint(0, N, (32,), generator=torch.Generator().manual_seed(0))
    with ActivationRecorder(model) as rec:
        model(x).backward()
        opt.step()
        opt.zero_grad()
    assert not rec.errors
    return rec.profile()


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("name", CONVERTING)
def test_every_converting_action_refuses_a_weight_read_outside_its_module(
    name: str, read: str
) -> None:
    torch.manual_seed(0)
    model = LM(read=read)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counter = LookupCounter()
    counter.watch_tables(model)
    profile = _recorded_step(model, opt, counter)
    assert list(profile.outside_uses) == ["emb"] and READS[read] in profile.outside_uses["emb"]
    weight = model.emb.weight
    before = weight.detach().clone()
    ctx = ActionContext(
        model,
        [opt],
        activation_profile=profile,
        lookup_counter=counter,
        budget_bytes=10**9,
        in_use_bytes=10**9,
        rearm_free_fraction=0.25,
    )
    refusal = ACTIONS[name].plan(ctx)
    assert isinstance(refusal, Refusal)
    assert "read outside emb's forward (" in refusal.reason and READS[read] in refusal.reason
    assert ACTIONS[name].apply(ctx).status == "refused"
    assert type(model.emb) is nn.Embedding and model.emb.weight is weight
    assert torch.equal(weight.detach(), before)


def test_a_table_read_only_through_its_module_still_gets_the_cache() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(N, D)
            self.head = nn.Linear(D, N)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.head(self.emb(x)), x)

    torch.manual_seed(0)
    model = Plain()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counter = LookupCounter()
    counter.watch_tables(model)
    profile = _recorded_step(model, opt, counter)
    assert profile.outside_uses == {}  # Adam's reads inside step(), zero_grad's: not reads
    ctx = ActionContext(
        model, [opt], activation_profile=profile, lookup_counter=counter, fail_at=None
    )
    plan = ACTIONS["cache_embedding"].plan(ctx)
    assert isinstance(plan, Plan) and plan.target == "emb"
    assert ACTIONS["cache_embedding"].apply(ctx, plan).status == "applied"


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, n: int) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, n, (64,), generator=gen)
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_tied_language_model_trains_under_pressure_bit_identical_to_its_twin(
    tmp_path: Path,
) -> None:
    """The issue's model: ``emb(x) @ emb.weight.T`` under an 8 MiB budget with Adam. Before the
    fix ``cache_embedding`` was applied and the next step raised ``IndexError``."""
    torch.manual_seed(0)
    model = LM(20000, 32, read="T")
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    db = tmp_path / "h.db"
    with edo_monitor.watch(model, db=db, budget="8MiB", policy=edo_monitor.Policy()) as mon:
        losses = _train(model, opt, 20, 20000)
    assert mon.summary().status == "finished"
    assert losses == _train(twin, twin_opt, 20, 20000)
    assert torch.equal(model.emb.weight, twin.emb.weight)
    assert type(model.emb) is nn.Embedding
    with History(db) as history:
        assert not history.events("latest", kind="action")
        *_, no_action = history.events("latest", kind="no_action")  # the settled reasons
    refusals = {r["action"]: r["reason"] for r in no_action.data["refusals"]}
    read = READS["T"]
    for name in ("cache_embedding", "offload_embedding"):  # the lossless ladder's table actions
        assert f"read outside emb's forward ({read})" in refusals[name]
    assert "checkpoint_activations" in refusals  # the ladder moved on past the tables
    # explain does not offer what the live agent refused on the table: it says why not
    # (it listed offloading and caching emb as the best lossless remedies)
    (incident, *_) = edo_monitor.explain(db, "latest").incidents
    assert all(r.target != "emb" or r.lossy for r in incident.remedies)
    not_remedies = {(r.action, r.target): r.detail for r in incident.refused_live}
    for name in ("cache_embedding", "offload_embedding"):
        assert f"read outside emb's forward ({read})" in not_remedies[(name, "emb")]


def test_parameters_sliced_from_one_flat_buffer_are_not_each_others_reads() -> None:
    """Only a tensor inside the table weight's own elements is its alias, not one elsewhere in
    the same storage (flat-parameter layouts slice every parameter from one buffer)."""
    torch.manual_seed(0)
    flat = torch.randn(N * D + N * D)
    model = nn.Module()
    model.emb = nn.Embedding(N, D)
    model.head = nn.Linear(D, N, bias=False)
    model.emb.weight = nn.Parameter(flat[: N * D].view(N, D))
    model.head.weight = nn.Parameter(flat[N * D :].view(N, D))
    assert model.emb.weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    x = torch.randint(0, N, (32,))
    with ActivationRecorder(model) as rec:
        F.cross_entropy(model.head(model.emb(x)), x).backward()
        logits = model.emb(x) @ model.emb.weight[: N // 2].T  # a slice's view: still emb's
    assert rec.profile().outside_uses == {
        "emb": ("<no module>: __getitem__", "<no module>: matmul (a view of the weight)")
    }  # and none for head's own weight, in the same storage
    assert logits.shape == (32, N // 2)


@pytest.mark.parametrize("save", [False, True])
def test_a_state_dict_taken_in_the_recorded_step_is_not_a_read(tmp_path: Path, save: bool) -> None:
    """``model.state_dict()`` (``torch.save`` of it) in the recorded step detaches every
    parameter: that was a read outside the table's forward ("<no module>: detach"), and every
    table action was refused until the next profile. A detached alias read later still is."""

    class Plain(nn.Module):
        def __init__(self, read_alias: bool) -> None:
            super().__init__()
            self.emb = nn.Embedding(N, D)
            self.head = nn.Linear(D, N)
            self.read_alias = read_alias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            if self.read_alias:
                h = h + self.emb.weight.detach()[0]
            return F.cross_entropy(self.head(h), x)

    for read_alias in (False, True):
        torch.manual_seed(0)
        model = Plain(read_alias)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randint(0, N, (32,), generator=torch.Generator().manual_seed(0))
        with ActivationRecorder(model) as rec:
            state = model.state_dict()
            if save:
                torch.save(state, tmp_path / "ckpt.pt")
            model(x).backward()
            opt.step()
            opt.zero_grad()
        uses = rec.profile().outside_uses
        if read_alias:
            assert "<model>: __getitem__ (a view of the weight)" in uses["emb"], uses
        else:
            assert uses == {}, uses
