"""The share_embedding action and the lookup counter, on real training loops."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import edo_monitor
from edo_monitor.actions import ACTIONS, ActionContext, ActivationRecorder
from edo_monitor.actions.expected_error import LookupDistribution
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.nn import HybridEmbedding, hash_ids
from edo_monitor.store.history import History

N, D = 4000, 16


class Model(nn.Module):
    def __init__(self, **kw: object) -> None:
        super().__init__()
        self.emb = nn.Embedding(N, D, **kw)  # type: ignore[arg-type]
        self.head = nn.Linear(D, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


def _profile(model: nn.Module) -> object:
    """One recorded forward on a copy (sharing needs to know the table is read only by itself)."""
    with torch.no_grad(), ActivationRecorder(copy.deepcopy(model)) as rec:
        rec.model(torch.arange(8))
    return rec.profile()


def _zipf_ids(gen: torch.Generator, batch: int) -> torch.Tensor:
    ranks = torch.arange(1, N + 1, dtype=torch.float64)
    probs = ranks.pow(-1.1)
    return torch.multinomial(probs / probs.sum(), batch, replacement=True, generator=gen)


def _train(model: Model, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = _zipf_ids(gen, 256)
        loss = (model(ids) - 1.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _setup(**kw: object) -> tuple[Model, torch.optim.Optimizer, LookupCounter]:
    torch.manual_seed(0)
    model = Model(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    counter = LookupCounter()
    counter.watch_tables(model)
    _train(model, opt, 5)
    return model, opt, counter


def test_counter_counts_every_lookup_and_ranks_ties_by_id() -> None:
    emb = nn.EmbeddingBag(10, 2, mode="sum", padding_idx=0)
    counter = LookupCounter()
    counter.watch("t", emb)
    emb(torch.tensor([1, 2, 2, 0, 5, 5]), torch.tensor([0, 3]))
    emb(torch.tensor([[5, 7]]))
    assert counter.counts("t").tolist() == [0, 1, 2, 0, 0, 3, 0, 1, 0, 0]
    freq = counter.frequency("t", 3)
    assert freq.top_ids == [5, 2, 1]  # 1 and 7 tie at one lookup: the lower id first
    assert freq.top_counts == [3, 2, 1]
    assert freq.sampled_lookups == 7 and freq.distinct_ids == 4
    assert freq.top_share_fraction == pytest.approx(6 / 7)
    counter.close()
    emb(torch.tensor([[1]]))
    assert int(counter.counts("t")[1]) == 1  # closed: no more counting


def test_counter_samples_one_forward_in_k() -> None:
    emb = nn.Embedding(5, 2)
    counter = LookupCounter(sample_every=3)
    counter.watch("t", emb)
    for _ in range(7):  # forwards 1, 4 and 7 are counted
        emb(torch.tensor([4]))
    assert int(counter.counts("t")[4]) == 3
    with pytest.raises(ValueError, match="sample_every=0"):
        LookupCounter(sample_every=0)


def test_share_converts_the_table_keeps_training_and_estimate_equals_saving() -> None:
    model, opt, counter = _setup()
    old_weight = model.emb.weight
    old = old_weight.detach().clone()
    old_state = {k: v.clone() for k, v in opt.state[model.emb.weight].items()}
    ctx = ActionContext(model, [opt], activation_profile=_profile(model), lookup_counter=counter)
    plan = ACTIONS["share_embedding"].plan(ctx)
    assert plan.details["hot_ids"] == 200 and plan.details["buckets"] == 200  # 5 % of 4000 each
    result = ACTIONS["share_embedding"].apply(ctx, plan)
    assert result.status == "applied", result.reason
    assert result.saved_bytes == result.estimated_saving_bytes
    new = model.emb
    assert isinstance(new, HybridEmbedding)
    # the hot ids are the 200 most looked-up ids, their rows and Adam state copied exactly
    counts = counter.counts("emb")
    expected_hot = sorted(torch.sort(-counts, stable=True).indices[:200].tolist())
    assert new.hot_ids.tolist() == expected_hot
    hot = torch.tensor(expected_hot)
    assert torch.equal(new.hot_weight.detach(), old[hot])
    assert torch.equal(opt.state[new.hot_weight]["exp_avg"], old_state["exp_avg"][hot])
    assert torch.equal(opt.state[new.hot_weight]["step"], old_state["step"])
    # a bucket's weight and second moment start as the mean of their cold members'
    bucket = int(hash_ids(torch.tensor([3999]), 200)[0])
    cold = [i for i in range(N) if i not in set(expected_hot)]
    members = [i for i in cold if int(hash_ids(torch.tensor([i]), 200)[0]) == bucket]
    torch.testing.assert_close(new.cold_weight.detach()[bucket], old[members].mean(0))
    torch.testing.assert_close(
        opt.state[new.cold_weight]["exp_avg_sq"][bucket], old_state["exp_avg_sq"][members].mean(0)
    )
    # the old parameter left the optimizer; the new ones are in its group
    group_params = opt.param_groups[0]["params"]
    assert all(p is not old_weight for g in opt.param_groups for p in g["params"])
    assert all(p is not old_weight for p in opt.state)
    assert any(p is new.hot_weight for p in group_params)
    assert any(p is new.cold_weight for p in group_params)
    # the error under the lookups' distribution, recomputed here from its definition: each
    # counted id its Good-Turing probability, the ids not counted sharing p0 evenly
    dist = LookupDistribution.from_counts(counts)
    p = torch.full((N,), dist.p0 / (N - dist.seen_ids.numel()), dtype=torch.float64)
    p[dist.seen_ids] = dist.seen_probs
    got = new(torch.arange(N)).detach().double()
    ref = old.double()
    expected_err = float((p * (ref - got).pow(2).sum(1)).sum() / (p * ref.pow(2).sum(1)).sum())
    assert result.error is not None
    assert result.error["lookup_relative_error"] == pytest.approx(expected_err, rel=1e-9)
    # training goes on with the same optimizer, and the loss still falls
    before_step = new.cold_weight.detach().clone()
    _train(model, opt, 3, seed=1)
    assert not torch.equal(new.cold_weight.detach(), before_step)


@pytest.mark.parametrize("stage", ["converted", "optimizer_updated", "module_replaced"])
def test_share_is_transactional(stage: str) -> None:
    model, opt, counter = _setup(padding_idx=0)
    weight = model.emb.weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: v.clone() for k, v in opt.state[weight].items()}
    ctx = ActionContext(
        model, [opt], activation_profile=_profile(model), lookup_counter=counter, fail_at=stage
    )
    result = ACTIONS["share_embedding"].apply(ctx)
    assert result.status == "failed"
    assert isinstance(model.emb, nn.Embedding) and model.emb.weight is weight
    assert opt.param_groups[0]["params"][0] is weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in opt.state[weight].items():
        assert torch.equal(v, opt_before[k]), k


def test_share_refuses_what_it_cannot_keep() -> None:
    model, opt, counter = _setup(max_norm=1.0)
    refusal = ACTIONS["share_embedding"].plan(
        ActionContext(model, [opt], activation_profile=_profile(model), lookup_counter=counter)
    )
    assert "max_norm" in refusal.reason

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(N, D)
            self.out = nn.Linear(D, N, bias=False)
            self.out.weight = self.emb.weight

    tied = Tied()
    refusal = ACTIONS["share_embedding"].plan(ActionContext(tied, []))
    assert "tied to out" in refusal.reason


def test_share_without_counts_hashes_every_id() -> None:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 2)
    ctx = ActionContext(model, [opt], activation_profile=_profile(model))
    result = ACTIONS["share_embedding"].apply(ctx)
    assert result.status == "applied", result.reason
    assert result.details["hot_ids"] == 0 and model.emb.num_hot == 0
    assert result.saved_bytes == result.estimated_saving_bytes
    # the cold buckets took the table's place; the empty hot table stays out of the optimizer
    params = opt.param_groups[0]["params"]
    assert params[0] is model.emb.cold_weight
    assert [tuple(p.shape) for p in params] == [(200, D), (1, D), (1,)]


def test_watch_counts_lookups_and_shares_through_the_ladder(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # the table with Adam: 4000 x 16 x 4 bytes x 4 (weight, grad, two moments) = 1,024,000 bytes;
    # a 1.2 MB budget leaves ~14 % free after the first step, under the 20 % floor
    policy = edo_monitor.Policy(allow_lossy=True, ladder=["share_embedding"])
    with edo_monitor.watch(model, db=db, budget=1_200_000, policy=policy, interval_s=0.01) as mon:
        gen = torch.Generator().manual_seed(0)
        seen = torch.zeros(N, dtype=torch.long)
        for _ in range(40):
            ids = _zipf_ids(gen, 256)
            if isinstance(model.emb, nn.Embedding):
                seen.index_add_(0, ids, torch.ones_like(ids))
            loss = (model(ids) - 1.0).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (action,) = mon.summary().actions
    assert action["action"] == "share_embedding" and action["target"] == "emb"
    assert action["saved_bytes"] == action["estimated_saving_bytes"]
    hybrid = model.emb
    assert isinstance(hybrid, HybridEmbedding)
    # the hot ids are the most looked-up ids of the steps before the action
    k = hybrid.num_hot
    assert 0 < k <= 200
    expected = sorted(torch.sort(-seen, stable=True).indices[:k].tolist())
    assert hybrid.hot_ids.tolist() == expected
    with History(db) as history:
        (freq,) = history.events("latest", kind="lookup_frequency")
    # counted on every forward, the old table's and then the hybrid's (same name)
    assert freq.data["table"] == "emb"
    assert freq.data["sampled_lookups"] == 40 * 256
