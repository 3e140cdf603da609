"""Hyper-parameters given as tensors to the optimizer of a row cache: exact, or refused by name.

torch computes with some hyper-parameters in the tensor's own dtype (Adam's ``lr`` and
``betas``, AdamW's ``weight_decay``, SGD's ``dampening``, Adagrad's ``lr_decay``, and its ``lr``
with a ``lr_decay``) and rounds there at every step; the row cache computes with the number the
tensor holds. A tensor less precise than the table (a float32 one on a float64 table; an
integer one counts as the default dtype) is refused, naming it, at the attach or at the step
that finds it (:func:`edo_monitor.nn.optimizers.check_hyper_tensors`). Every other tensor is
taken, and the cache stays exact against a resident float64 twin (a 20-row cache of a 200-row
table, three ids a step, so rows leave the cache and catch up when they come back).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_cached import N, _pair, _rel, _zipf_ids
from torch import nn

from edo_monitor.nn import CachedEmbedding

F32, F64 = torch.float32, torch.float64
Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _t(value: float, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _steps(
    modules: list[tuple[nn.Module, torch.optim.Optimizer]], steps: int, gen: torch.Generator
) -> None:
    """``steps`` optimizer steps of each module on the same batches: three Zipf ids a step."""
    for _ in range(steps):
        ids = _zipf_ids(gen, (3,))
        target = torch.randn(3, 4, generator=gen, dtype=F64)
        for module, opt in modules:
            opt.zero_grad()
            ((module(ids) - target) ** 2).sum().backward()
            opt.step()


# ------------------------------------------------------------------------------------ refused
REFUSED: dict[str, tuple[Make, str]] = {
    "adam_lr": (lambda p: torch.optim.Adam(p, lr=_t(0.01)), r"Adam with lr=tensor\(0.0100\)"),
    "adam_betas": (
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(_t(0.9), _t(0.999))),
        r"Adam with betas\[0\]=tensor\(0.9000\)",
    ),
    "adam_beta1": (
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(_t(0.9), _t(0.999, F64))),
        r"Adam with betas\[0\]=tensor\(0.9000\)",
    ),
    "adam_beta2": (
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(_t(0.9, F64), _t(0.999))),
        r"Adam with betas\[1\]=tensor\(0.9990\)",
    ),
    "adam_beta2_bfloat16": (
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(_t(0.9, F64), _t(0.5, torch.bfloat16))),
        r"Adam with betas\[1\]=tensor\(0.5000, dtype=torch.bfloat16\) \(a torch.bfloat16 tensor\)",
    ),
    "adamw_weight_decay": (
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=_t(0.1)),
        r"AdamW with weight_decay=tensor\(0.1000\)",
    ),
    "adam_decoupled_weight_decay": (
        lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=_t(0.1), decoupled_weight_decay=True),
        r"Adam with weight_decay=tensor\(0.1000\)",
    ),
    "sgd_dampening": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=_t(0.9, F64), dampening=_t(0.1)),
        r"SGD with dampening=tensor\(0.1000\)",
    ),
    "adagrad_lr_with_lr_decay": (
        lambda p: torch.optim.Adagrad(p, lr=_t(0.1), lr_decay=0.01),
        r"Adagrad with lr=tensor\(0.1000\)",
    ),
    "adagrad_lr_decay": (
        lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=_t(0.01)),
        r"Adagrad with lr_decay=tensor\(0.0100\)",
    ),
    # an integer tensor: torch's quotients of it come out in the default dtype (float32)
    "adagrad_integer_lr_decay": (
        lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=torch.tensor(0)),
        r"Adagrad with lr_decay=tensor\(0\) \(a torch.int64 tensor\) .* to torch.float32",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_less_precise_tensor_is_refused_by_name_at_the_attach(name: str) -> None:
    """The attach refuses it, naming the optimizer, the hyper-parameter, its value and dtype,
    and what to give instead; the tester measured each drifting from a resident twin (float32
    tensors, 50 steps: Adam's betas 4e-8, AdamW's weight_decay 7e-7, SGD's dampening 1e-8,
    Adagrad's lr with a lr_decay 4e-9)."""
    make, named = REFUSED[name]
    table = CachedEmbedding(N, 4, 20, dtype=F64)
    opt = make([table.weight])
    with pytest.raises(ValueError, match=named) as err:
        table.attach(opt)
    text = str(err.value)
    assert "on a torch.float64 table: torch rounds" in text
    assert "row cache does not reproduce" in text
    assert "as a float (or a torch.float64 tensor)" in text


@pytest.mark.parametrize("name", ["adam_betas", "adamw_weight_decay", "sgd_dampening"])
def test_a_less_precise_tensor_is_refused_by_the_step_that_finds_it(name: str) -> None:
    """Made a tensor after the attach (by hand, or a scheduler writing one): the step that
    finds it refuses it, before stepping any row."""
    key = {"adam_betas": "betas", "adamw_weight_decay": "weight_decay"}.get(name, "dampening")
    make, named = REFUSED[name]
    floats = make([nn.Parameter(torch.zeros(1))]).param_groups[0][key]
    floats = tuple(float(b) for b in floats) if key == "betas" else float(floats)
    torch.manual_seed(0)
    _, cached = _pair(torch.randn(N, 4, dtype=F64))
    opt = make([cached.weight])
    opt.param_groups[0][key] = floats
    gen = torch.Generator().manual_seed(1)
    _steps([(cached, opt)], 3, gen)
    opt.param_groups[0][key] = make([nn.Parameter(torch.zeros(1))]).param_groups[0][key]
    before = cached.full_weight().clone()
    with pytest.raises(ValueError, match=named):
        _steps([(cached, opt)], 1, gen)
    assert torch.equal(cached.full_weight(), before)


# ----------------------------------------------------------------------------------- accepted
ACCEPTED: dict[str, Make] = {
    # torch applies these as the numbers they hold: float32 tensors are exact too
    "sgd_lr_f32": lambda p: torch.optim.SGD(
        p, lr=_t(0.05), momentum=0.9, dampening=0.1, weight_decay=0.01
    ),
    "sgd_momentum_weight_decay_f32": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=_t(0.9), weight_decay=_t(0.01)
    ),
    "sgd_nesterov_momentum_f32": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=_t(0.9), nesterov=True, weight_decay=0.01
    ),
    "adam_eps_f32": lambda p: torch.optim.Adam(p, lr=0.01, eps=_t(1e-3)),
    "adagrad_lr_f32_without_lr_decay": lambda p: torch.optim.Adagrad(
        p, lr=_t(0.1), initial_accumulator_value=0.1
    ),
    "adagrad_eps_initial_f32": lambda p: torch.optim.Adagrad(
        p, lr=0.1, eps=_t(1e-3), initial_accumulator_value=_t(0.1)
    ),
    "adagrad_integer_lr": lambda p: torch.optim.Adagrad(p, lr=torch.tensor(1)),
    # tensors of the table's dtype: exact everywhere
    "adam_f64": lambda p: torch.optim.Adam(
        p, lr=_t(0.01, F64), betas=(_t(0.9, F64), _t(0.999, F64)), eps=_t(1e-8, F64)
    ),
    "adam_amsgrad_f64": lambda p: torch.optim.Adam(
        p, lr=_t(0.01, F64), betas=(_t(0.8, F64), _t(0.99, F64)), amsgrad=True
    ),
    "adamw_f64": lambda p: torch.optim.AdamW(
        p, lr=_t(0.01, F64), betas=(_t(0.9, F64), _t(0.999, F64)), weight_decay=_t(0.1, F64)
    ),
    "sgd_f64": lambda p: torch.optim.SGD(
        p, lr=_t(0.05, F64), momentum=_t(0.9, F64), dampening=_t(0.1, F64), weight_decay=0.01
    ),
    "adagrad_f64": lambda p: torch.optim.Adagrad(p, lr=_t(0.1, F64), lr_decay=_t(0.01, F64)),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_an_exact_tensor_keeps_the_cache_exact_against_a_resident_twin(name: str) -> None:
    """30 steps of three ids on a 20-row cache (rows evicted and caught up when they come
    back): the full table within 1e-12 of a resident float64 twin stepped by torch."""
    torch.manual_seed(0)
    twin, cached = _pair(torch.randn(N, 4, dtype=F64))
    o1, o2 = ACCEPTED[name]([twin.weight]), ACCEPTED[name]([cached.weight])
    _steps([(twin, o1), (cached, o2)], 30, torch.Generator().manual_seed(1))
    assert cached.stats().evicted > 10  # the catch-up ran
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12


def test_float32_tensors_on_a_float32_table_are_taken() -> None:
    """Not less precise than the table: taken, within the float32 twin's own rounding."""
    torch.manual_seed(0)
    twin, cached = _pair(torch.randn(N, 4))
    make = REFUSED["adamw_weight_decay"][0]
    o1, o2 = make([twin.weight]), make([cached.weight])
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        ids = _zipf_ids(gen, (3,))
        target = torch.randn(3, 4, generator=gen)
        for module, opt in ((twin, o1), (cached, o2)):
            opt.zero_grad()
            ((module(ids) - target) ** 2).sum().backward()
            opt.step()
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-5


def test_betas_tensors_changed_in_place_mid_run_are_followed() -> None:
    """``betas`` float64 tensors changed in place between steps (a scheduler that anneals them):
    the cache compared the tuple's tensors as objects and missed the change, catching rows up
    with the old betas (7.5e-2 from the twin after 20 more steps)."""
    torch.manual_seed(0)
    twin, cached = _pair(torch.randn(N, 4, dtype=F64))
    make = ACCEPTED["adam_f64"]
    o1, o2 = make([twin.weight]), make([cached.weight])
    gen = torch.Generator().manual_seed(1)
    _steps([(twin, o1), (cached, o2)], 20, gen)
    for opt in (o1, o2):
        opt.param_groups[0]["betas"][0].fill_(0.5)
        opt.param_groups[0]["betas"][1].fill_(0.9)
    _steps([(twin, o1), (cached, o2)], 20, gen)
    assert _rel(cached.full_weight(), twin.weight.detach()) < 1e-12
