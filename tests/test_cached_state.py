"""The row cache's state carried across: checkpoints saved and loaded (into a fresh cached or
uncached model, or between a backward and its step), optimizer state replaced or restarted, dtype
conversions and moves. Each against a resident twin (float64, exact to rounding), as in
test_cached.py."""

from __future__ import annotations

import copy

import pytest
import torch
from test_cached import OPTIMIZERS, C, D, N, _pair, _rel, _train, _zipf_ids
from torch import nn

from edo_monitor.nn import CachedEmbedding, LookAhead


def test_checkpoint_into_fresh_uncached_model_continues_like_the_twin() -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    twin, cached = _pair(base)
    o1 = torch.optim.AdamW([twin.weight], lr=0.01, weight_decay=0.01)
    o2 = torch.optim.AdamW([cached.weight], lr=0.01, weight_decay=0.01)
    gen = torch.Generator().manual_seed(3)
    _train([(twin, o1), (cached, o2)], 30, gen)
    # as saved to a file: nothing shared with the live optimizer (its 'step' tensor included)
    model_sd, opt_sd = copy.deepcopy(cached.state_dict()), copy.deepcopy(o2.state_dict())
    assert model_sd["weight"].shape == (N, D)
    assert opt_sd["state"][0]["exp_avg"].shape == (N, D)
    fresh = nn.Embedding(N, D, dtype=torch.float64)
    fresh.load_state_dict(model_sd)
    o3 = torch.optim.AdamW([fresh.weight], lr=0.01, weight_decay=0.01)
    o3.load_state_dict(opt_sd)
    # and into another cached table (attached first, then loaded)
    other = CachedEmbedding(N, D, C, dtype=torch.float64)
    o4 = torch.optim.AdamW([other.weight], lr=0.01, weight_decay=0.01)
    other.attach(o4)
    other.load_state_dict(model_sd)
    o4.load_state_dict(copy.deepcopy(opt_sd))
    gen_state = gen.get_state()
    _train([(twin, o1), (fresh, o3)], 30, gen)
    gen.set_state(gen_state)
    _train([(cached, o2), (other, o4)], 30, gen)
    assert _rel(fresh.weight.detach(), twin.weight.detach()) < 1e-12
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
    assert _rel(other.full_weight(), twin.weight.detach()) < 1e-12


def _adam_pair_trained(seed: int) -> tuple:
    """A resident twin and a cached table (float64, each with Adam) after 20 steps on the same
    batches, and the batches' generator: ``(twin, cached, twin_opt, cached_opt, gen)``."""
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    twin, cached = _pair(base)
    o1, o2 = OPTIMIZERS["adam"]([twin.weight]), OPTIMIZERS["adam"]([cached.weight])
    gen = torch.Generator().manual_seed(seed)
    _train([(twin, o1), (cached, o2)], 20, gen)
    return twin, cached, o1, o2, gen


@pytest.mark.parametrize("replace", ["load_optimizer_state", "new_optimizer"])
def test_optimizer_state_replaced_mid_training_keeps_every_row_exact(replace: str) -> None:
    """Rows on the host are behind the current step until looked up; replacing the optimizer's
    state (a checkpoint loaded into the live optimizer, or a new optimizer attached after
    ``detach_optimizer``) catches them up first under the state they had, as a resident
    table's rows are (both lost the missed updates before)."""
    twin, cached, o1, o2, gen = _adam_pair_trained(seed=6)
    saved = copy.deepcopy(o1.state_dict())
    _train([(twin, o1), (cached, o2)], 5, gen)
    if replace == "load_optimizer_state":
        o1.load_state_dict(copy.deepcopy(saved))
        o2.load_state_dict(copy.deepcopy(saved))
    else:
        cached.detach_optimizer()
        o1, o2 = (
            OPTIMIZERS["sgd_momentum"]([twin.weight]),
            OPTIMIZERS["sgd_momentum"]([cached.weight]),
        )
        cached.attach(o2)
    _train([(twin, o1), (cached, o2)], 10, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


@pytest.mark.parametrize("between", ["load_module", "load_optimizer", "eval_forward"])
def test_what_runs_between_backward_and_step_is_seen_by_the_step(between: str) -> None:
    """The forward keeps the batch's rows caught up for its step; a checkpoint loaded before
    that step replaces them, and the step updates the loaded rows, as the twin's does; an
    evaluation forward over the same rows changes nothing."""
    twin, cached, o1, o2, gen = _adam_pair_trained(seed=5)
    saved = copy.deepcopy(twin.state_dict()), copy.deepcopy(o1.state_dict())
    _train([(twin, o1), (cached, o2)], 5, gen)
    ids, target = _zipf_ids(gen, (4, 6)), torch.randn(4, 6, D, generator=gen, dtype=torch.float64)
    for module, opt in ((twin, o1), (cached, o2)):
        opt.zero_grad()
        ((module(ids) - target) ** 2).sum().backward()
        if between == "load_module":
            module.load_state_dict(saved[0])
        elif between == "load_optimizer":
            opt.load_state_dict(copy.deepcopy(saved[1]))
        else:
            with torch.no_grad():
                module(torch.cat([ids.reshape(-1), torch.arange(N)]))
        opt.step()
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
    s1, s2 = o1.state_dict()["state"][0], o2.state_dict()["state"][0]
    assert int(s2["step"]) == int(s1["step"])
    for key in ("exp_avg", "exp_avg_sq"):
        assert _rel(s2[key], s1[key]) < 1e-12


@pytest.mark.parametrize("convert", ["double", "to"])
def test_module_dtype_conversions_convert_the_host_table_too(convert: str) -> None:
    """``nn.Module`` converts parameters and buffers only: ``.double()`` made the cache float64
    over a float32 host table, so every row that left the cache was rounded to float32 (a new
    user: 5.4e-8 from a float64 twin). Now the host table follows, and training is exact."""
    torch.manual_seed(0)
    cached = CachedEmbedding(N, D, C)  # float32
    cached = cached.double() if convert == "double" else cached.to(torch.float64)
    assert cached.full_weight().dtype == torch.float64
    assert cached.state_dict()["weight"].dtype == torch.float64
    twin = nn.Embedding.from_pretrained(cached.full_weight().clone(), freeze=False)
    o1, o2 = torch.optim.Adam([twin.weight], lr=0.01), torch.optim.Adam([cached.weight], lr=0.01)
    _train([(twin, o1), (cached, o2)], 30, torch.Generator().manual_seed(2))
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
    assert CachedEmbedding(N, D, C).half().full_weight().dtype == torch.float16


def test_a_dtype_conversion_with_the_optimizer_attached_is_refused_and_changes_nothing() -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    _twin, cached = _pair(base)
    opt = torch.optim.Adam([cached.weight], lr=0.01)
    _train([(cached, opt)], 3, torch.Generator().manual_seed(2))
    # the message says what holds the old dtype: the cache (it read "while SGD holds its state"
    # to a user whose plain SGD holds none)
    with pytest.raises(
        ValueError,
        match=r"from torch\.float64 to torch\.float32 once Adam steps it is not supported \(the "
        r"row cache keeps",
    ):
        cached.float()
    assert cached.weight.dtype == torch.float64 and cached.host_weight.dtype == torch.float64
    assert cached.to(torch.float64) is cached  # no change: nothing to refuse


def test_checkpoint_of_an_optimizer_over_model_parameters_loads_into_an_uncached_twin() -> None:
    """The optimizer built from model.parameters() holds the row buffer; its state_dict() does
    not (ids renumbered), so it loads into an optimizer over the uncached model and back."""
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)

    def model(table: nn.Module) -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(table, nn.Linear(D, 1, dtype=torch.float64))

    twin_m, cached_m = (model(t) for t in _pair(base, 30))
    o1 = torch.optim.Adam(twin_m.parameters(), lr=0.01)
    o2 = torch.optim.Adam(cached_m.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        ids = _zipf_ids(gen, (16,))
        for m, o in ((twin_m, o1), (cached_m, o2)):
            o.zero_grad()
            m(ids).pow(2).sum().backward()
            o.step()
    sd = copy.deepcopy(o2.state_dict())  # state_dict() holds the live tensors
    assert [len(g["params"]) for g in sd["param_groups"]] == [3]  # weight, linear w and b
    fresh = model(nn.Embedding(N, D, dtype=torch.float64))
    fresh.load_state_dict(cached_m.state_dict())
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_opt.load_state_dict(sd)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))  # and the other way round
    for _ in range(10):
        ids = _zipf_ids(gen, (16,))
        for m, o in ((twin_m, o1), (fresh, fresh_opt), (cached_m, o2)):
            o.zero_grad()
            m(ids).pow(2).sum().backward()
            o.step()
    assert _rel(fresh[0].weight.detach(), twin_m[0].weight.detach()) < 1e-12
    assert _rel(cached_m[0].full_weight(), twin_m[0].weight.detach()) < 1e-12


def test_sgd_momentum_state_loaded_into_a_fresh_cached_table_goes_on_exactly() -> None:
    """SGD keeps no step in its state: a fresh table that loaded a momentum buffer counted itself
    at step 0 and took its next step for the first, replacing the buffer instead of decaying it
    (0.18 from the twin after 10 more steps)."""
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    twin, cached = _pair(base)
    make = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)  # noqa: E731
    o1, o2 = make([twin.weight]), make([cached.weight])
    gen = torch.Generator().manual_seed(3)
    _train([(twin, o1), (cached, o2)], 10, gen)
    fresh = CachedEmbedding(N, D, C, dtype=torch.float64)
    o3 = make([fresh.weight])
    fresh.attach(o3)
    fresh.load_state_dict(copy.deepcopy(cached.state_dict()))
    o3.load_state_dict(copy.deepcopy(o2.state_dict()))
    _train([(twin, o1), (fresh, o3)], 10, gen)
    assert _rel(fresh.full_weight(), twin.weight.detach()) < 1e-12


@pytest.mark.parametrize("between", ["state_dict", "load_state_dict", "to"])
def test_rows_renormalised_by_max_norm_are_the_tables_before_the_step(between: str) -> None:
    """A forward with ``max_norm`` renormalises its rows in the table (as ``nn.Embedding``
    does): a checkpoint taken, a checkpoint loaded or a move between that forward's backward
    and the step sees and keeps them (they lived only in the row buffer until the step)."""
    gen = torch.Generator().manual_seed(8)
    base = torch.randn(N, D, generator=gen, dtype=torch.float64) * 2  # norms above max_norm
    twin = nn.Embedding.from_pretrained(base.clone(), freeze=False, max_norm=1.0)
    cached = CachedEmbedding(N, D, C, max_norm=1.0, _weight=base.clone())
    o1, o2 = OPTIMIZERS["sgd_momentum"]([twin.weight]), OPTIMIZERS["sgd_momentum"]([cached.weight])
    pairs = ((twin, o1), (cached, o2))
    for step in range(3):
        ids = _zipf_ids(gen, (4, 6))
        for module, opt in pairs:
            opt.zero_grad()
            module(ids).pow(2).sum().backward()
        if step == 1 and between == "state_dict":
            assert _rel(cached.state_dict()["weight"], twin.weight.detach()) < 1e-12
        elif step == 1 and between == "load_state_dict":
            cached.load_state_dict(copy.deepcopy(cached.state_dict()))
        elif step == 1:
            cached.to("cpu")
        for _, opt in pairs:
            opt.step()
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def test_an_optimizer_checkpoint_without_the_tables_state_restarts_it_like_the_twin() -> None:
    """An optimizer state dict saved before the table's first step holds no state for it:
    loaded later, the twin's optimizer starts the table afresh (step 1, zero moments); the
    cache did too little (kept its moments and step count: 1 % off 3 steps later)."""
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(N, D, generator=gen, dtype=torch.float64)
    twin, cached = _pair(base)
    o1, o2 = OPTIMIZERS["adam"]([twin.weight]), OPTIMIZERS["adam"]([cached.weight])
    cached.attach(o2)
    saved = copy.deepcopy(o1.state_dict()), copy.deepcopy(o2.state_dict())
    _train([(twin, o1), (cached, o2)], 20, gen)
    o1.load_state_dict(saved[0])
    o2.load_state_dict(saved[1])
    _train([(twin, o1), (cached, o2)], 5, gen)
    assert int(o2.state_dict()["state"][0]["step"]) == int(o1.state[twin.weight]["step"]) == 5
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_before_the_tables_first_step_the_optimizer_holds_the_twins_state(name: str) -> None:
    """Regression: a training forward of an attached table put the cache's state into the
    optimizer before the table's first step (a step of other parameters first, or a backward
    not yet stepped: a frozen warm-up, an accumulation window): Adam's moments without their
    ``step`` (``copy.deepcopy`` and ``torch.load`` of the optimizer raised ``KeyError: 'step'``),
    SGD's momentum buffer of zeros (a checkpoint taken there resumed 0.2 off after one step:
    the buffer took ``(1 - dampening) * grad``, torch's first step takes ``grad``). The
    optimizer now holds the twin's state there (none; Adagrad's made with it), and a
    checkpoint taken there resumes like the twin, into a cached or an uncached model."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(N, D, generator=gen, dtype=torch.float64)
    twin, cached = _pair(base)
    o1, o2 = OPTIMIZERS[name]([twin.weight]), OPTIMIZERS[name]([cached.weight])
    cached.attach(o2)
    for opt in (o1, o2):
        opt.step()  # a step before any gradient of the table (its warm-up)
    ids = _zipf_ids(gen, (64,))
    for module in (twin, cached):
        (module(ids) ** 2).sum().backward()
    keys = {k: sorted(v) for k, v in o1.state_dict()["state"].items()}
    assert {k: sorted(v) for k, v in o2.state_dict()["state"].items()} == keys
    assert [sorted(v) for v in o2.state.values()] == [sorted(v) for v in o1.state.values()]
    saved = copy.deepcopy((cached.state_dict(), o2.state_dict()))
    copy.deepcopy((cached, o2))  # the live optimizer too

    def resumed(module: nn.Module) -> nn.Module:
        opt = OPTIMIZERS[name]([module.weight])
        if isinstance(module, CachedEmbedding):
            module.attach(opt)
        module.load_state_dict(copy.deepcopy(saved[0]))
        opt.load_state_dict(copy.deepcopy(saved[1]))
        (module(ids) ** 2).sum().backward()
        opt.step()
        return module

    o1.step()
    plain = resumed(nn.Embedding(N, D, dtype=torch.float64))
    again = resumed(CachedEmbedding(N, D, C, dtype=torch.float64))
    assert _rel(plain.weight.detach(), twin.weight.detach()) < 1e-12
    assert _rel(again.full_weight(), twin.weight.detach()) < 1e-12


@pytest.mark.parametrize("load", ["prefetch", "lookahead"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rows_loaded_before_the_caches_state_exists_keep_their_caught_up_state(
    name: str, load: str
) -> None:
    """Regression: a first batch without ids of the table (an empty multi-hot feature) steps it
    with a zero gradient: SGD with momentum and weight decay gives every row a buffer
    ``wd * w``. A row loaded after that step by ``prefetch`` or a :class:`LookAhead`, before the
    cache's own state existed, was caught up but its state was dropped (the buffer stayed 0):
    5.8e-4 off after the next step. Its state is its host row's until the cache has one."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(N, D, generator=gen, dtype=torch.float64)
    twin, cached = _pair(base)
    batches = [torch.zeros(0, dtype=torch.int64), _zipf_ids(gen, (8,)), _zipf_ids(gen, (8,))]
    o1, o2 = OPTIMIZERS[name]([twin.weight]), OPTIMIZERS[name]([cached.weight])
    for ids in batches:
        o1.zero_grad()
        (twin(ids) ** 2).sum().backward()
        o1.step()
    served = LookAhead(batches, ahead=2, tables=cached) if load == "lookahead" else batches
    for i, ids in enumerate(served):
        if load == "prefetch" and i == 1:
            cached.prefetch(ids)
        o2.zero_grad()
        (cached(ids) ** 2).sum().backward()
        o2.step()
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def test_adagrad_state_saved_before_the_optimizer_was_attached_loads_as_the_initial_state() -> None:
    """Regression: Adagrad makes its ``sum`` with the optimizer, the cache's shape ``(C, D)``; a
    checkpoint taken before the table's first step (between the micro-batches of the first
    accumulation window), with the optimizer not attached yet, did not load back ("has shape
    (20, 4)"). No step changed it: it is every row's initial state, and resumes like the twin."""
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(N, D, generator=gen, dtype=torch.float64)
    twin, cached = _pair(base)
    o1, o2 = OPTIMIZERS["adagrad"]([twin.weight]), OPTIMIZERS["adagrad"]([cached.weight])
    batches = [_zipf_ids(gen, (16,)) for _ in range(6)]
    saved = []
    for module, opt in ((twin, o1), (cached, o2)):
        (module(batches[0]) ** 2).sum().backward()  # the first micro-batch
        saved.append(copy.deepcopy((module.state_dict(), opt.state_dict())))
        for ids in batches[1:]:
            (module(ids) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
    for (module, opt), (weights, state) in zip(((twin, o1), (cached, o2)), saved, strict=True):
        module.load_state_dict(weights)
        opt.load_state_dict(state)
        for ids in batches[1:]:
            (module(ids) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
    half = {k: v[: C // 2] for k, v in saved[1][1]["state"][0].items() if k == "sum"}
    touched = copy.deepcopy(saved[1][1])
    touched["state"][0]["sum"] = torch.cat([half["sum"], half["sum"] + 1.0])  # not initial
    with pytest.raises(ValueError, match=r"'sum' has shape \(20, 4\).*table.attach\(optimizer\)"):
        o2.load_state_dict(touched)


def test_adagrad_state_made_before_the_cache_grew_is_its_initial_state() -> None:
    """Adagrad makes its ``sum`` state with the optimizer, the cache's shape then; a first
    batch with more unique ids than cache rows grows the cache before the first step attaches
    it, and the attach refused the old-shaped state (ValueError) though it is every row's
    initial value."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(N, D, generator=gen, dtype=torch.float64)
    twin, cached = _pair(base, cache_rows=10)
    make = OPTIMIZERS["adagrad"]
    o1, o2 = make([twin.weight]), make([cached.weight])
    ids = torch.arange(50)
    for module, opt in ((twin, o1), (cached, o2)):
        module(ids).pow(2).sum().backward()
        opt.step()
    assert cached.cache_rows >= 50
    _train([(twin, o1), (cached, o2)], 10, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def _restart_run(opt_name: str, detach: bool, replace: bool = False) -> float:
    """Relative difference after 100 steps of a cached table and a resident twin whose
    optimizer's state is cleared after 50 (the cached one detached first when ``detach``)."""
    from collections import defaultdict

    torch.manual_seed(0)
    base = torch.randn(50, 4, dtype=torch.float64)
    ids = [torch.randint(0, 50, (6,)) for _ in range(100)]
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    }[opt_name]
    out = []
    for table in (
        nn.Embedding(50, 4, _weight=base.clone()),
        CachedEmbedding(50, 4, 8, _weight=base.clone()),
    ):
        opt = make(table.parameters())
        for i, batch in enumerate(ids):
            if i == 50:
                if detach and isinstance(table, CachedEmbedding):
                    table.detach_optimizer()
                if replace:
                    opt.state = defaultdict(dict)
                else:
                    opt.state.clear()
            (table(batch) - 1).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out.append(table.state_dict()["weight"])
    return float((out[1] - out[0]).abs().max() / out[0].abs().max())


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_an_optimizer_state_cleared_by_hand_is_refused_and_detaching_first_restarts_exactly(
    opt_name: str,
) -> None:
    # the cache made its rows' state again from stale host rows: 0.13 (SGD) and 0.04 (Adam)
    # relative to the twin after 100 steps, silently
    for replace in (False, True):
        with pytest.raises(RuntimeError, match="detach_optimizer"):
            _restart_run(opt_name, detach=False, replace=replace)
    assert _restart_run(opt_name, detach=True) <= 1e-12


def test_a_full_table_of_the_wrong_shape_is_refused_with_one_reason_and_nothing_changes() -> None:
    # regression: the message began with 'Missing key(s) in state_dict: "emb.weight"' (the key
    # was there) and the real reason came second
    model = nn.Sequential()
    model.emb = CachedEmbedding(N, D, C)
    before = model.state_dict()["emb.weight"].clone()
    sd = model.state_dict()
    sd["emb.weight"] = torch.zeros(N + 1, D)
    with pytest.raises(RuntimeError) as caught:
        model.load_state_dict(sd)
    lines = str(caught.value).splitlines()
    assert lines[1:] == [
        f"\temb.weight: a cached table loads the full table {(N, D)}, got {(N + 1, D)}"
    ]
    assert "Missing key" not in str(caught.value)
    assert torch.equal(model.state_dict()["emb.weight"], before)


#: a setting that stops an optimizer using a per-row state key: (setting, off, on, key)
SWITCHED = {
    "sgd_momentum": ("momentum", 0.0, 0.9, "momentum_buffer"),
    "adam_amsgrad": ("amsgrad", False, True, "max_exp_avg_sq"),
}


@pytest.mark.parametrize(
    "resume", ["live", "detached", "into_uncached", "into_cached", "loaded_then_attached"]
)
@pytest.mark.parametrize("cache_rows", [C, N], ids=["cache", "every_row"])
@pytest.mark.parametrize("name", sorted(SWITCHED))
def test_state_a_setting_switched_off_is_kept_whole_like_the_twins(
    name: str, cache_rows: int, resume: str
) -> None:
    """Regression: with ``momentum`` set to 0 (or ``amsgrad`` off) mid-run, the optimizer keeps
    the key's state as it was and uses it again when the setting comes back. The cache handed
    out its own stale ``(C, D)`` copy, in slot order: ``state_dict()`` held it (a checkpoint that
    crashed an uncached model once momentum was back, or, when the cache held every row, loaded
    silently and trained 0.155 away from the twin), ``detach_optimizer()`` handed it back, a
    cached table refused its own checkpoint, and one attached with the key in the optimizer's
    state dropped it. Now the host keeps the key whole, as last kept."""
    setting, off, on, key = SWITCHED[name]
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    twin, cached = _pair(base, cache_rows)
    o1, o2 = OPTIMIZERS[name]([twin.weight]), OPTIMIZERS[name]([cached.weight])
    gen = torch.Generator().manual_seed(4)
    _train([(twin, o1), (cached, o2)], 15, gen)
    for o in (o1, o2):
        o.param_groups[0][setting] = off
    _train([(twin, o1), (cached, o2)], 15, gen)
    kept = o1.state[twin.weight][key]
    model_sd, opt_sd = copy.deepcopy(cached.state_dict()), copy.deepcopy(o2.state_dict())
    assert opt_sd["state"][0][key].shape == (N, D)
    assert _rel(opt_sd["state"][0][key], kept) < 1e-12
    table: nn.Embedding = cached
    if resume == "detached":  # the optimizer gets the key back whole and attaches again
        cached.detach_optimizer()
        assert _rel(o2.state[cached.weight][key], kept) < 1e-12
    elif resume == "into_uncached":
        table = nn.Embedding(N, D, dtype=torch.float64)
        table.load_state_dict(model_sd)
        o2 = OPTIMIZERS[name]([table.weight])
        o2.load_state_dict(opt_sd)
    elif resume == "into_cached":  # a cached table loads its own checkpoint
        table = CachedEmbedding(N, D, cache_rows, dtype=torch.float64)
        o2 = OPTIMIZERS[name]([table.weight])
        table.attach(o2)
        table.load_state_dict(model_sd)
        o2.load_state_dict(opt_sd)
    elif resume == "loaded_then_attached":  # its first step attaches, the setting still off
        table = CachedEmbedding(N, D, cache_rows, dtype=torch.float64)
        table.load_state_dict(model_sd)
        o2 = OPTIMIZERS[name]([table.weight])
        o2.load_state_dict(opt_sd)
        _train([(twin, o1), (table, o2)], 5, gen)
    for o in (o1, o2):
        o.param_groups[0][setting] = on
    _train([(twin, o1), (table, o2)], 15, gen)
    weight = table.full_weight() if isinstance(table, CachedEmbedding) else table.weight.detach()
    assert _rel(weight, twin.weight.detach()) < 1e-12
    assert _rel(o2.state_dict()["state"][0][key], o1.state[twin.weight][key]) < 1e-12


def test_reset_parameters_draws_the_twins_rows_and_training_goes_on_like_it() -> None:
    """Regression: ``reset_parameters`` (``nn.Embedding``'s, called by ``model.apply`` init
    code) was missing (``AttributeError``). The same generator state gives the twin's rows,
    padding row zero; Adam's state is kept by both, and the next steps are the twin's."""
    base = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    twin, cached = _pair(base, padding_idx=2)
    o1, o2 = OPTIMIZERS["adam"]([twin.weight]), OPTIMIZERS["adam"]([cached.weight])
    gen = torch.Generator().manual_seed(4)
    _train([(twin, o1), (cached, o2)], 10, gen)
    torch.manual_seed(9)
    twin.reset_parameters()
    torch.manual_seed(9)
    cached.reset_parameters()
    assert torch.equal(cached.full_weight(), twin.weight.detach())
    assert not cached.full_weight()[2].any()
    _train([(twin, o1), (cached, o2)], 10, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
