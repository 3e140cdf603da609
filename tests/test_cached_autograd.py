"""A cached table where it meets autograd and the optimizer's bookkeeping: optimizers over
``named_parameters()`` (their ``param_names``), ``torch.autograd.grad`` and ``backward(inputs=)``
(no gradient reaches the step unless the backward accumulates), gradient hooks on ``weight``.
Each against an uncached twin: same init, ids and optimizer, float64."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from edo_monitor.nn import CachedEmbedding

ROWS, DIM = 20, 3


def _model(cached: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.emb = (
        CachedEmbedding(ROWS, DIM, 4, dtype=torch.float64)
        if cached
        else nn.Embedding(ROWS, DIM, dtype=torch.float64)
    )
    m.lin = nn.Linear(DIM, 1, dtype=torch.float64)
    if cached:  # the twin's rows
        m.emb.load_state_dict({"weight": _model(False).emb.weight.detach().clone()})
    return m


def _train(m: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    for i in range(steps):
        opt.zero_grad()
        m.lin(m.emb(torch.tensor([1, 5, 7 + i]))).sum().backward()
        opt.step()


NAMES = ["emb.weight", "lin.weight", "lin.bias"]


def test_an_optimizer_over_named_parameters_saves_the_uncached_names() -> None:
    """Regression: ``param_names`` kept the row buffer's name while its id was left out, so an
    uncached optimizer loading the state called ``lin.weight`` "emb.batch_rows"."""
    cm = _model(True)
    co = torch.optim.Adam(cm.named_parameters(), lr=0.01)
    _train(cm, co)
    sd = co.state_dict()
    (group,) = sd["param_groups"]
    assert (group["params"], group["param_names"]) == ([0, 1, 2], NAMES)
    twin = _model(False)
    to = torch.optim.Adam(twin.named_parameters(), lr=0.01)
    twin.load_state_dict(cm.state_dict())
    to.load_state_dict(copy.deepcopy(sd))
    (live,) = to.param_groups
    assert live["param_names"] == NAMES
    named = dict(twin.named_parameters())
    assert all(named[n] is p for n, p in zip(live["param_names"], live["params"], strict=True))


def test_a_named_state_loads_into_a_cached_optimizer_and_saves_back_the_same() -> None:
    """The uncached optimizer's named state into a cached one (over a list without the row
    buffer: attach puts it beside ``weight`` with its name) and out again, unchanged."""
    twin = _model(False)
    to = torch.optim.Adam(twin.named_parameters(), lr=0.01)
    _train(twin, to)
    cm = _model(True)
    cm.emb.load_state_dict({"weight": twin.emb.weight.detach().clone()})
    named = [(n, p) for n, p in cm.named_parameters() if not n.endswith("batch_rows")]
    co = torch.optim.Adam(named, lr=0.01)
    cm.emb.attach(co)
    assert co.param_groups[0]["param_names"] == [
        "emb.weight",
        "emb.batch_rows",
        "lin.weight",
        "lin.bias",
    ]
    co.load_state_dict(copy.deepcopy(to.state_dict()))
    assert co.param_groups[0]["param_names"][1] == "emb.batch_rows"
    again = co.state_dict()
    assert again["param_groups"][0]["param_names"] == NAMES
    ref = to.state_dict()["state"]
    for k, st in ref.items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(again["state"][k][key]), torch.as_tensor(value))
    cm.emb.detach_optimizer()  # the row buffer and its name leave together
    assert co.param_groups[0]["param_names"] == NAMES
    assert len(co.param_groups[0]["params"]) == 3


def _one_sgd_step(cached: bool, look: str) -> torch.Tensor:
    """One SGD(lr=1) step of the real loss after a look at another loss's gradient (``look``:
    ``"grad"``: ``torch.autograd.grad`` over every parameter with ``allow_unused``;
    ``"inputs"``: ``backward(inputs=)`` of the head only). The table's rows after it."""
    m = _model(cached)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    opt.zero_grad()
    ids = torch.tensor([1, 2, 2])
    aux = m.lin(m.emb(ids)).pow(2).sum()
    if look == "grad":
        params = [p for p in m.parameters() if p.requires_grad]
        torch.autograd.grad(aux, params, allow_unused=True)
    else:
        aux.backward(inputs=list(m.lin.parameters()))
        opt.zero_grad()
    m.lin(m.emb(ids)).sum().backward()
    opt.step()
    return m.emb.state_dict()["weight"]


@pytest.mark.parametrize("look", ["grad", "inputs"])
def test_a_gradient_only_looked_at_is_not_stepped(look: str) -> None:
    """Regression: the cache's backward added the rows' gradient to the step's in every backward
    pass, ``torch.autograd.grad`` included (it leaves ``.grad`` alone): a gradient taken only to
    be looked at was applied too (row 1 moved by the look's gradient as well)."""
    got, want = _one_sgd_step(True, look), _one_sgd_step(False, look)
    assert torch.equal(got, want), (got - want).abs().max()


def test_a_gradient_hook_on_a_cached_weight_is_refused_by_name() -> None:
    """Regression: a hook on ``weight`` (``register_hook``: scaling, masking, logging a table's
    gradient) was called with ``None`` (torch never passes ``None``: ``g * 0.5`` failed deep in
    the backward) and what it returned never reached the step (a zeroed gradient still moved
    the rows). A training lookup now refuses it, naming the hook; lookups without gradients and
    a table without hooks go on."""
    m = _model(True)
    handle = m.emb.weight.register_hook(lambda g: g * 0.5)
    with pytest.raises(RuntimeError, match=r"weight\.register_hook.*handle\.remove\(\)"):
        m.emb(torch.tensor([1, 2]))
    with torch.no_grad():
        assert m.emb(torch.tensor([1, 2])).shape == (2, DIM)
    handle.remove()
    m.lin(m.emb(torch.tensor([1, 2]))).sum().backward()
    assert m.emb.batch_rows.grad is not None


def test_the_agent_takes_no_table_action_on_a_weight_with_gradient_hooks(tmp_path: Path) -> None:
    """A table action makes a new weight, which the user's gradient hook would not follow (a
    converted row cache even refused it at the next forward: the user's training failed). Under
    pressure every table action is refused, naming the hooks, and the hook keeps its effect."""
    import edo_monitor
    from edo_monitor.decide.plans import TABLE_BLOCKERS
    from edo_monitor.store.history import History

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100_000, 64), nn.Linear(64, 1))
    model[0].weight.register_hook(lambda g: g * 0.0)  # the table frozen by its hook
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with edo_monitor.watch(
        model, budget="60MiB", policy=edo_monitor.Policy(), db=tmp_path / "h.db", interval_s=0.01
    ) as mon:
        for _ in range(30):
            model(torch.randint(0, 100_000, (256,))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert mon.summary().actions == ()
    assert torch.equal(model[0].weight, before)  # the hook's zero gradient, every step
    with History(tmp_path / "h.db") as h:
        (none, *_) = h.events(mon.run_id, kind="no_action")
    reasons = {r["action"]: r["reason"] for r in none.data["refusals"] if r["target"] == "0"}
    assert {"cache_embedding", "offload_embedding"} <= reasons.keys()
    assert set(reasons.values()) == {
        f"0: {TABLE_BLOCKERS[3]} (register_hook): a table action makes a new weight, and the "
        "hooks would not follow it"
    }


def _joins_later(cached: bool, attach: bool) -> torch.Tensor:
    """Progressive training: the optimizer steps the head only for 5 steps, then the table
    joins it (``add_param_group``); ``zero_grad()`` before every backward. The table's rows
    after the one step with it."""
    torch.manual_seed(0)
    w = torch.randn(ROWS, DIM, dtype=torch.float64)
    emb = (
        CachedEmbedding(ROWS, DIM, 4, _weight=w.clone())
        if cached
        else nn.Embedding(ROWS, DIM, _weight=w.clone())
    )
    head = nn.Linear(DIM, 1, dtype=torch.float64)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        if step == 5:
            opt.add_param_group({"params": [emb.weight]})
            if attach:
                emb.attach(opt)
        opt.zero_grad()
        head(emb(torch.randint(0, ROWS, (3,), generator=gen))).pow(2).sum().backward()
        opt.step()
    return emb.state_dict()["weight"]


def test_a_table_added_to_an_optimizer_later_warns_unless_attached(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A table that joins an optimizer by ``add_param_group`` brings the gradient of every
    backward since the start (no zero_grad() reached its row buffer, which joins the optimizer
    as the table attaches): the step takes it whole where a resident table's zero_grad() had
    cleared it. The cache cannot tell which zero_grad() a resident table would have seen, so it
    says so, naming the fix; attached at once, the table trains as the resident one."""
    twin = _joins_later(False, attach=False)
    with caplog.at_level("WARNING", logger="edo_monitor.nn.cache_optimizer"):
        unattached = _joins_later(True, attach=False)
    (record,) = [r for r in caplog.records if "add_param_group" in r.getMessage()]
    assert "kept over 5 step(s) of other optimizers" in record.getMessage()
    assert "table.attach(optimizer)" in record.getMessage()
    assert not torch.allclose(unattached, twin)  # what the warning is about
    caplog.clear()
    with caplog.at_level("WARNING", logger="edo_monitor.nn.cache_optimizer"):
        attached = _joins_later(True, attach=True)
    assert not [r for r in caplog.records if "add_param_group" in r.getMessage()]
    assert torch.allclose(attached, twin, rtol=1e-12, atol=0)


@pytest.mark.parametrize("inputs", ["all", "weight", "weight_twice"])
def test_a_backward_with_inputs_holding_the_weight_is_stepped_as_the_resident_table(
    inputs: str,
) -> None:
    """``loss.backward(inputs=...)`` with the table's ``weight`` among the inputs accumulates
    its gradient, as for a resident table (``"weight_twice"``: two such backwards before one
    step add up); without it (the head only), none (the other test above)."""

    def run(cached: bool) -> torch.Tensor:
        m = _model(cached)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        for step in range(3):
            opt.zero_grad()
            ids = torch.tensor([1, 2, 2 + step])
            chosen = list(m.parameters()) if inputs == "all" else [m.emb.weight]
            for _ in range(2 if inputs == "weight_twice" else 1):
                m.lin(m.emb(ids)).pow(2).sum().backward(inputs=chosen)
            opt.step()
        return m.emb.state_dict()["weight"]

    got, want = run(True), run(False)
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (got - want).abs().max()
