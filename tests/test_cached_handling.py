"""The row cache as users handle it: its optimizer detached and attached again, a new optimizer
taking the table over, the model pickled or deep-copied, a tensor learning rate, bad ids. Each
against a resident twin (float64, exact to rounding), as in test_cached.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from test_cached import OPTIMIZERS, _pair, _rel, _train

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


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_trained_model_trains_on_its_own_and_the_original_goes_on(how: str) -> None:
    """``copy.deepcopy(model)`` and ``torch.save(model)`` / ``torch.load``: the copy holds every
    row current (no optimizer state: a resident table's pickle holds none either) and trains
    with an optimizer of its own as a copy of the twin does; the original goes on exactly."""
    twin, cached, o1, o2, gen = _trained("adam", 10, seed=5)
    if how == "deepcopy":
        copy_cached = copy.deepcopy(cached)
    else:
        buf = io.BytesIO()
        torch.save(cached, buf)
        buf.seek(0)
        copy_cached = torch.load(buf, weights_only=False)
    assert isinstance(copy_cached, CachedEmbedding) and copy_cached._optimizer is None
    assert not copy_cached.host_state  # no optimizer state in the copy
    assert _rel(copy_cached.full_weight(), twin.weight.detach()) < 1e-12
    copy_twin = copy.deepcopy(twin)
    c1 = torch.optim.SGD(copy_twin.parameters(), lr=0.1, momentum=0.9)
    c2 = torch.optim.SGD(copy_cached.parameters(), lr=0.1, momentum=0.9)
    copy_gen = torch.Generator().manual_seed(6)
    _train([(copy_twin, c1), (copy_cached, c2)], 8, copy_gen)
    assert _rel(copy_cached.full_weight(), copy_twin.weight.detach()) < 1e-12
    _train([(twin, o1), (cached, o2)], 8, gen)  # the original, with its optimizer
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


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
