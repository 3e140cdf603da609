"""The row cache as users handle it: its optimizer detached and attached again, a new optimizer
taking the table over, the model pickled or deep-copied, a tensor learning rate, bad ids. Each
against a resident twin (float64, exact to rounding), as in test_cached.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from test_cached import OPTIMIZERS, C, _pair, _rel, _train

from edo_monitor.nn import CachedEmbedding

N, D = 200, 4


def _trained(name: str, steps: int, seed: int) -> tuple:
    torch.manual_seed(seed)
    twin, cached = _pair(torch.randn(N, D, dtype=torch.float64))
    o1, o2 = OPTIMIZERS[name]([twin.weight]), OPTIMIZERS[name]([cached.weight])
    gen = torch.Generator().manual_seed(seed)
    _train([(twin, o1), (cached, o2)], steps, gen)
    return twin, cached, o1, o2, gen


@pytest.mark.parametrize("name", ["sgd_momentum", "adagrad", "adam"])
@pytest.mark.parametrize("how", ["attach", "next_step"])
def test_detach_then_the_same_optimizer_again_keeps_every_row_exact(name: str, how: str) -> None:
    """``detach_optimizer()`` hands the optimizer its state of the table whole ((N, D), in id
    order, the twin's optimizer's), so attaching it again (explicitly, or by stepping it) loses
    nothing: the rows outside the cache kept their momentum (it was reset to zero)."""
    twin, cached, o1, o2, gen = _trained(name, 12, seed=3)
    cached.detach_optimizer()
    state, want = o2.state[cached.weight], o1.state[twin.weight]
    keys = [k for k in want if k != "step"]
    assert keys and all(state[k].shape == (N, D) for k in keys)
    assert all(_rel(state[k], want[k]) < 1e-12 for k in keys)
    if how == "attach":
        cached.attach(o2)
    _train([(twin, o1), (cached, o2)], 12, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
    s1, s2 = o1.state_dict()["state"][0], o2.state_dict()["state"][0]
    assert all(_rel(s2[k], s1[k]) < 1e-12 for k in keys)


def test_a_new_optimizer_takes_the_table_over_and_the_old_one_back() -> None:
    """A new optimizer over the model's parameters (a second phase of training) steps the table
    from its first step, as it steps a resident one; the old optimizer, stepped again later,
    takes the table back with the state it had: each keeps its own, as for the twin."""
    twin, cached, o1, o2, gen = _trained("adam", 10, seed=4)
    n1 = torch.optim.SGD(twin.parameters(), lr=0.2, momentum=0.5)
    n2 = torch.optim.SGD(cached.parameters(), lr=0.2, momentum=0.5)  # the row buffer too
    _train([(twin, n1), (cached, n2)], 6, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
    assert cached._optimizer is n2
    _train([(twin, o1), (cached, o2)], 6, gen)
    assert cached._optimizer is o2
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
    for (a, b), key in ((n1, n2), "momentum_buffer"), ((o1, o2), "exp_avg_sq"):
        assert _rel(b.state_dict()["state"][0][key], a.state_dict()["state"][0][key]) < 1e-12


def test_attach_of_a_new_optimizer_takes_the_table_over_to_resume_a_checkpoint() -> None:
    """The README's resume recipe on the live model: a new optimizer, ``attach`` it, load an
    older checkpoint of the optimizer into it (``ValueError: another optimizer is already
    attached`` before), then train on: as the twin's new optimizer loaded with it."""
    twin, cached, o1, o2, gen = _trained("adam", 10, seed=6)
    saved = [copy.deepcopy(o.state_dict()) for o in (o1, o2)]
    _train([(twin, o1), (cached, o2)], 3, gen)
    n1 = torch.optim.Adam(twin.parameters(), lr=0.01)
    n2 = torch.optim.Adam(cached.parameters(), lr=0.01)
    cached.attach(n2)
    assert cached._optimizer is n2
    n1.load_state_dict(saved[0])
    n2.load_state_dict(saved[1])
    _train([(twin, n1), (cached, n2)], 6, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def _copied(obj: object, how: str) -> object:
    if how == "deepcopy":
        return copy.deepcopy(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_trained_model_trains_on_its_own_and_the_original_goes_on(how: str) -> None:
    """``copy.deepcopy(model)`` and ``torch.save(model)`` / ``torch.load``: the copy holds every
    row current and no optimizer, and trains with an optimizer of its own as a copy of the
    twin does (fresh state); the original goes on exactly."""
    twin, cached, o1, o2, gen = _trained("adam", 10, seed=5)
    copy_cached = _copied(cached, how)
    assert isinstance(copy_cached, CachedEmbedding) and copy_cached._optimizer is None
    assert _rel(copy_cached.full_weight(), twin.weight.detach()) < 1e-12
    copy_twin = copy.deepcopy(twin)
    c1 = torch.optim.SGD(copy_twin.parameters(), lr=0.1, momentum=0.9)
    c2 = torch.optim.SGD(copy_cached.parameters(), lr=0.1, momentum=0.9)
    copy_gen = torch.Generator().manual_seed(6)
    _train([(copy_twin, c1), (copy_cached, c2)], 8, copy_gen)
    assert _rel(copy_cached.full_weight(), copy_twin.weight.detach()) < 1e-12
    _train([(twin, o1), (cached, o2)], 8, gen)  # the original, with its optimizer
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


@pytest.mark.parametrize("name", ["sgd_momentum", "adagrad", "adam"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("order", ["model first", "optimizer first"])
def test_a_model_copied_with_its_optimizer_goes_on_as_the_twins_copies(
    name: str, how: str, order: str
) -> None:
    """``copy.deepcopy((model, optimizer))`` or one ``torch.save`` of both, in either order: the
    copies go on exactly as the twin's copies (the rows outside the cache kept their state: it
    was reset, 1.3 % off in 6 steps; and the copied optimizer holds one row buffer, the copy's)."""
    twin, cached, o1, o2, gen = _trained(name, 10, seed=8)
    if order == "model first":
        twin2, o1c = _copied((twin, o1), how)
        cached2, o2c = _copied((cached, o2), how)
    else:
        o1c, twin2 = _copied((o1, twin), how)
        o2c, cached2 = _copied((o2, cached), how)
    held = [p for g in o2c.param_groups for p in g["params"]]
    assert len(held) == 2 and held[0] is cached2.weight and held[1] is cached2.batch_rows
    copy_gen = torch.Generator().manual_seed(9)
    _train([(twin2, o1c), (cached2, o2c)], 8, copy_gen)
    assert _rel(cached2.full_weight(), twin2.weight.detach()) < 1e-12
    s1, s2 = o1c.state_dict()["state"], o2c.state_dict()["state"]
    assert list(s2) == [0]
    assert all(_rel(v, s1[0][k]) < 1e-12 for k, v in s2[0].items() if k != "step")
    _train([(twin, o1), (cached, o2)], 8, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


@pytest.mark.parametrize("then", ["resize", "a batch larger than the cache", "copied mid-step"])
def test_a_copy_with_its_optimizer_whose_cache_changes_before_its_first_step(then: str) -> None:
    """The copy's cache resized (by hand, or grown by a batch) before its optimizer's first step,
    or the copy made between forward and backward (the original's rows pinned): the copied
    optimizer's cache-shaped state no longer fits the cache, and the copy's host state holds
    every row (it raised "optimizer state 'exp_avg' has shape (20, 4) ...")."""
    twin, cached, o1, o2, _ = _trained("adam", 6, seed=10)
    ids = torch.arange(N - 12, N)
    if then == "copied mid-step":  # a forward whose rows the copy does not look up
        for module in (twin, cached):
            module(torch.arange(12)).sum()
    twin2, o1c = copy.deepcopy((twin, o1))
    cached2, o2c = copy.deepcopy((cached, o2))
    if then == "resize":
        cached2.resize(40)
    elif then == "a batch larger than the cache":
        ids = torch.arange(2 * 20)
    for module, opt in ((twin2, o1c), (cached2, o2c)):
        opt.zero_grad()
        module(ids).sin().sum().backward()
        opt.step()
    assert cached2.cache_rows == (20 if then == "copied mid-step" else 40)
    assert _rel(cached2.full_weight(), twin2.weight.detach()) < 1e-12
    s1, s2 = o1c.state_dict()["state"][0], o2c.state_dict()["state"][0]
    assert _rel(s2["exp_avg"], s1["exp_avg"]) < 1e-12


def test_a_copy_with_its_optimizer_of_a_cache_holding_every_row() -> None:
    """A cache holding every row (``cache_rows == N``): the copied optimizer's state has the
    table's shape but the slots' order, not the ids' (rows got each other's moments: 0.6 off)."""
    torch.manual_seed(11)
    twin, cached = _pair(torch.randn(N, D, dtype=torch.float64), cache_rows=N)
    o1, o2 = OPTIMIZERS["adam"]([twin.weight]), OPTIMIZERS["adam"]([cached.weight])
    gen = torch.Generator().manual_seed(11)
    _train([(twin, o1), (cached, o2)], 6, gen)
    twin2, o1c = copy.deepcopy((twin, o1))
    cached2, o2c = copy.deepcopy((cached, o2))
    _train([(twin2, o1c), (cached2, o2c)], 6, gen)
    assert _rel(cached2.full_weight(), twin2.weight.detach()) < 1e-12
    s1, s2 = o1c.state_dict()["state"][0], o2c.state_dict()["state"][0]
    assert _rel(s2["exp_avg"], s1["exp_avg"]) < 1e-12


def test_a_model_whose_table_a_lookahead_serves_pickles_without_it() -> None:
    """A ``LookAhead`` over a generator serves the table: the model pickles (the copy is not
    served; the generator made pickling fail) and the original goes on being served."""
    from edo_monitor.nn import LookAhead

    torch.manual_seed(0)
    table = CachedEmbedding(N, D, 20, dtype=torch.float64)
    opt = torch.optim.Adam(table.parameters(), lr=0.01)
    batches = (torch.randint(0, N, (6,)) for _ in range(6))
    for step, ids in enumerate(LookAhead(batches, ahead=2, tables=table)):
        opt.zero_grad()
        table(ids).pow(2).sum().backward()
        opt.step()
        if step == 2:
            copied = _copied(table, "torch.save")
            assert copied._lookahead is None and table._lookahead is not None
            assert torch.equal(copied.full_weight(), table.full_weight())
    assert table.stats().forward_loads <= 6  # the rows of the first batch only


def test_two_optimizers_after_one_backward_are_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """Two optimizers stepping the table after one backward: the first step consumes the
    gradient, the second takes the table over and finds none (a resident table is stepped with
    it twice); the takeover says so."""
    torch.manual_seed(0)
    table = CachedEmbedding(N, D, 20, dtype=torch.float64)
    first = torch.optim.Adam([table.weight], lr=0.01)
    second = torch.optim.SGD([table.weight], lr=0.1)
    table(torch.arange(5)).sum().backward()
    first.step()
    with caplog.at_level("WARNING", logger="edo_monitor.nn.cache_optimizer"):
        second.step()
    assert "a SGD steps it with no backward since the Adam stepped it" in caplog.text
    assert table._optimizer is second


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum", "adagrad"])
@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
def test_a_tensor_lr_is_exact_or_refused_by_name(name: str, lr_dtype: torch.dtype) -> None:
    """A tensor ``lr`` (as compiled optimizers take): torch's Adam and AdamW compute each step's
    step size and decay in the tensor's dtype, so a float32 one on a float64 table is refused
    by name, at the attach or at the step that finds it (AdamW drifted 3e-7 from the twin in
    20 steps); a float64 one, and SGD's or Adagrad's of either dtype, stay exact."""
    refused = name.startswith("adam") and lr_dtype == torch.float32
    twin, cached, o1, o2, gen = _trained(name, 0, seed=7)
    lr = float(o1.param_groups[0]["lr"])
    for opt in (o1, o2):
        opt.param_groups[0]["lr"] = torch.tensor(lr, dtype=lr_dtype)
    if refused:
        with pytest.raises(ValueError, match=r"lr=tensor\(.*float32 tensor\) on a torch.float64"):
            _train([(cached, o2)], 1, gen)
        later = CachedEmbedding(N, D, 20, dtype=torch.float64)  # made a tensor mid-run
        opt = OPTIMIZERS[name]([later.weight])
        _train([(later, opt)], 2, gen)
        opt.param_groups[0]["lr"] = torch.tensor(lr, dtype=lr_dtype)
        with pytest.raises(ValueError, match=r"float32 tensor\) on a torch.float64 table"):
            _train([(later, opt)], 1, gen)
        whole = CachedEmbedding(N, D, 20, dtype=torch.float64)  # its quotients: float32
        with pytest.raises(ValueError, match=r"int64 tensor\) .* decay to torch.float32"):
            whole.attach(type(opt)([whole.weight], lr=torch.tensor(1)))
        return
    _train([(twin, o1), (cached, o2)], 20, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def test_bad_ids_are_refused_by_the_forward_and_by_prefetch_alike() -> None:
    """Ids outside ``[0, N)`` or not integers: the same clear error from ``prefetch`` as from the
    forward (prefetch raised torch's own ``index 200 is out of bounds`` and took float ids), and
    nothing loaded."""
    table = CachedEmbedding(N, D, 20)
    for call in (table, table.prefetch):
        with pytest.raises(IndexError, match=r"ids must be in \[0, 200\), got \[3, 200\]"):
            call(torch.tensor([3, 200]))
        with pytest.raises(IndexError, match=r"got \[-1, 5\]"):
            call(torch.tensor([5, -1]))
        with pytest.raises(TypeError, match=r"integer tensor .* got torch\.float32"):
            call(torch.tensor([1.0, 2.0]))
    assert table.stats().misses == 0


def test_a_table_collected_inside_an_optimizer_step_leaves_the_step_alone() -> None:
    """Each table had a global step pre-hook of its own, removed by a finalizer: a table the
    garbage collector freed while torch looped over the global hooks changed that dict, and the
    user's ``optimizer.step()`` raised ``RuntimeError: OrderedDict mutated during iteration``."""
    import gc

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def collect(*_: object) -> None:
        gc.collect()

    collecting = register_optimizer_step_pre_hook(collect)
    gc.disable()  # the tables below stay uncollected until the step's hook collects them
    try:
        for _ in range(3):  # tables only the cyclic collector frees
            table = CachedEmbedding(N, D, C)
            table.__dict__["_cycle"] = table
        del table
        param = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([param], lr=0.5)
        param.sum().backward()
        opt.step()
        assert param.tolist() == [0.5, 0.5]
    finally:
        gc.enable()
        collecting.remove()


def test_a_growing_cache_names_its_table_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: "cached table: 5 rows needed, cache has 2; growing it" named no table; a
    table the agent cached is named as the model names it (``edo_name``), another by its size."""
    import logging

    table = CachedEmbedding(100, 4, 2)
    with caplog.at_level(logging.INFO, logger="edo_monitor.nn.cache_rows"):
        table(torch.arange(5))
        table.edo_name = "items"
        table(torch.arange(10, 20))
        table(torch.arange(30, 50))
    # the first growth a warning; later ones (6 and 7 lines in a new user's 40 and 400-step
    # runs, each a warning) information
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "cached table (100 x 4): 5 rows needed, cache has 2; growing it"),
        ("INFO", "cached table items: 10 rows needed, cache has 5; growing it"),
        ("INFO", "cached table items: 20 rows needed, cache has 10; growing it"),
    ]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_steps_without_zero_grad_between_sum_the_old_gradient_in(name: str) -> None:
    """A resident table's gradient stays after a step until it is zeroed: a backward adds to
    it, a step without one steps with it again. The cache dropped it at the step (helper: the
    row moved by -0.1 where the resident one moved by -0.2). Steps here zero with ``None``,
    zero in place, zero between the forward and the backward, or not at all; some have no
    backward; every step with one clips (the norm is the resident table's, the old gradient in
    it); a small cache evicts in between."""
    torch.manual_seed(5)
    twin, cached = _pair(torch.randn(N, D, dtype=torch.float64), cache_rows=8)
    o1, o2 = OPTIMIZERS[name]([twin.weight]), OPTIMIZERS[name]([cached.weight])
    gen = torch.Generator().manual_seed(5)
    kinds = ("none", "in place", "not", "after forward", "not", "not, no backward")
    for step in range(72):
        ids = torch.randint(0, N, (4, 3), generator=gen)
        target = torch.randn(4, 3, D, generator=gen, dtype=torch.float64)
        how = kinds[step % len(kinds)]
        norms = []
        for module, opt in ((twin, o1), (cached, o2)):
            if how == "none":
                opt.zero_grad()
            elif how == "in place":
                opt.zero_grad(set_to_none=False)
            if how != "not, no backward":
                loss = ((module(ids) - target) ** 2).sum()
                if how == "after forward":
                    opt.zero_grad()
                loss.backward()
            if how != "not, no backward":  # with no backward the kept gradient is added at
                norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), 40.0)))
            opt.step()  # the step: clipping before it does not see it (documented)
        assert norms[1:] == pytest.approx(norms[:1], rel=1e-12), (step, how)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def _zeros(t: CachedEmbedding) -> None:
    torch.nn.init.zeros_(t.weight)


@pytest.mark.parametrize(
    "how",
    [
        "zeros_",
        "constant_0",
        "fill_0_no_grad",
        "copy_zeros_no_grad",
        "preloaded_then_zeros_",
        "deepcopy_then_zeros_",
        "saved_loaded_then_zeros_",
        "load_state_dict_then_zeros_",
    ],
)
def test_a_cache_written_with_zeros_before_the_first_load_is_refused(how: str) -> None:
    """Regression: the check of a cache written before any row was loaded (``weight`` is the
    cache, not the table) looked for values in the free slots, and zeros are what a free slot
    holds: ``nn.init.zeros_(table.weight)`` (a common way to start a table) was dropped silently
    and training ran from the table's own rows; on a preloaded cache it zeroed the preloaded rows
    of the table and kept the rest. The check reads the weight's version now (any in-place
    write); a copy's weight has its own, marked when the copy is made."""
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    freq = torch.arange(N) if how.startswith("preloaded") else None
    t = CachedEmbedding(N, D, C, _weight=base.clone(), id_frequencies=freq)
    if how.startswith("deepcopy"):
        t = copy.deepcopy(t)
    elif how.startswith("saved_loaded"):
        buf = io.BytesIO()
        torch.save(t, buf)
        buf.seek(0)
        t = torch.load(buf, weights_only=False)
    elif how.startswith("load_state_dict"):
        t.load_state_dict({"weight": base * 2})
    if how == "constant_0":
        torch.nn.init.constant_(t.weight, 0.0)
    elif how == "fill_0_no_grad":
        with torch.no_grad():
            t.weight.fill_(0.0)
    elif how == "copy_zeros_no_grad":
        with torch.no_grad():
            t.weight.copy_(torch.zeros_like(t.weight))
    else:
        _zeros(t)
    with pytest.raises(ValueError, match="written before any row was loaded"):
        t(torch.tensor([1, 2]))


@pytest.mark.parametrize("then", ["nothing", "load_state_dict", "deepcopy", "double"])
def test_a_cache_not_written_before_the_first_load_is_not_refused(then: str) -> None:
    """The version check's other side: what the cache does to its own weight before the first
    load (a state dict loaded, a copy made, a dtype conversion) is not a write by the user; a
    ``zeros_`` before a ``load_state_dict`` is overwritten by the load (the loaded rows count)."""
    torch.manual_seed(0)
    base = torch.randn(N, D, dtype=torch.float64)
    t = CachedEmbedding(N, D, C, _weight=base.clone())
    want = base
    if then == "load_state_dict":
        _zeros(t)
        want = base * 2
        t.load_state_dict({"weight": want})
    elif then == "deepcopy":
        t = copy.deepcopy(t)
    elif then == "double":
        t = t.float().double()
    ids = torch.tensor([1, 2, 3])
    torch.testing.assert_close(t(ids), want[ids].to(t.weight.dtype), rtol=0, atol=1e-6)
