"""The optimizers the row cache steps: what it reads off them (a table's group, the steps taken,
the per-element state keys and their initial values) and which catch-up rule each one gets, with
what is refused and why (:func:`_make_rule`, :func:`check_hyper_tensors`)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

from edo_monitor.nn.catch_up import _AdamRule, _NoopRule, _Rule, _SGDRule


def _group_of(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, Any]:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    raise ValueError("the optimizer does not step this table's cache weight")


def steps_taken(state: dict[str, Any], default: int) -> int:
    """The optimizer steps a parameter's ``state`` says it took: its ``step`` (Adam, Adagrad),
    else at least 1 when it holds a momentum buffer (SGD keeps no step; a buffer exists only
    after the first), else ``default``."""
    step = state.get("step")
    if step is not None:
        return int(step)
    return max(default, 1) if state.get("momentum_buffer") is not None else default


#: every per-element state key of the optimizers the cache steps (SGD, Adam, AdamW, Adagrad),
#: whether or not a group's settings use it now: a key a setting switched off (``momentum=0``,
#: ``amsgrad=False``) stays in the optimizer's state as it was, and is used again when the
#: setting comes back, so the cache keeps it whole on the host like the keys in use
ROW_STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "sum")


def optimizer_row_state_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple:
    """The per-element state keys ``optimizer`` keeps for a parameter of ``group``."""
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if group["momentum"] else ()
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        keys = ("exp_avg", "exp_avg_sq")
        return (*keys, "max_exp_avg_sq") if group.get("amsgrad") else keys
    if isinstance(optimizer, torch.optim.Adagrad):
        return ("sum",)
    return ()


def initial_state(group: dict[str, Any], key: str) -> float:
    """The value a per-element state ``key`` starts at in ``group`` (Adagrad's ``sum``: its
    ``initial_accumulator_value``; every other: 0)."""
    return float(group.get("initial_accumulator_value", 0.0)) if key == "sum" else 0.0


#: hyper-parameters torch computes with in their own dtype when given as tensors, per optimizer
#: kind: (name in the group, what it rounds there at every step); read off ``torch/optim``'s
#: single- and multi-tensor steps (torch 2.13) and measured (:func:`check_hyper_tensors`)
_ROUNDED_IN_OWN_DTYPE: dict[str, tuple[tuple[str, str], ...]] = {
    "adam": (
        ("lr", "each step's step size and decay"),
        ("betas[0]", "each step's bias correction 1 - beta1^t"),
        ("betas[1]", "1 - beta2 and each step's bias correction 1 - beta2^t"),
    ),
    "adamw": (("weight_decay", "each step's decay 1 - lr * weight_decay"),),
    "sgd": (("dampening", "1 - dampening"),),
    "adagrad": (
        ("lr_decay", "each step's learning rate lr / (1 + (t - 1) * lr_decay)"),
        ("lr", "each step's learning rate lr / (1 + (t - 1) * lr_decay)"),
    ),
}


def check_hyper_tensors(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype
) -> None:
    """Refuse a hyper-parameter of ``group`` that torch rounds in its own dtype, given as a tensor
    less precise than the table's ``dtype`` (a float32 tensor on a float64 table; an integer or
    bool tensor counts as torch's default dtype, the dtype of the quotients torch makes of it).

    torch computes with such a tensor in its dtype and rounds the result there at every step;
    the row cache (its fused step and its float64 catch-up) computes with the number the tensor
    holds, so the two part (relative difference to a resident float64 twin, float32 tensors,
    every row cached, 50 steps, 4 x 6 ids per step):

    * Adam and AdamW: ``lr`` (step size ``lr / (1 - beta1^t)`` and decay ``1 - lr *
      weight_decay``: 5e-10), ``betas[0]`` (``1 - beta1^t``: 4e-9), ``betas[1]`` (``1 - beta2``,
      ``1 - beta2^t``: 6e-8); decoupled decay (AdamW, or ``decoupled_weight_decay=True``) also
      ``weight_decay`` (``1 - lr * weight_decay``: 7e-7);
    * SGD: ``dampening`` (``1 - dampening``: 5e-8);
    * Adagrad: ``lr_decay`` (``lr / (1 + (t - 1) * lr_decay)``: 5e-9), and ``lr`` unless
      ``lr_decay`` is 0 (the same quotient: 5e-9).

    Taken as given, since torch applies them as the numbers they hold (a Python scalar, or a
    factor of a tensor of the table's dtype), as the cache does (measured: 1e-15, i.e.
    rounding; ``tests/test_cached_hyper_tensors.py``): SGD's ``lr``, ``momentum``,
    ``weight_decay``; Adam's ``eps`` (and its L2 ``weight_decay``, refused by
    :func:`_make_rule` when not 0); Adagrad's ``lr`` with ``lr_decay`` 0, ``eps``,
    ``initial_accumulator_value``. A tensor of the table's dtype or a more precise one is
    taken everywhere. ``betas`` may be a tuple of tensors.

    Called at the attach and at every step (a hyper-parameter made a tensor since).

    Raises:
        ValueError: naming the optimizer, the hyper-parameter, its value and dtype, the table's
            dtype, and what to give instead (a float, or a tensor of the table's dtype).
    """
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        kinds = ["adam"]
        if isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay"):
            kinds.append("adamw")
    elif isinstance(optimizer, torch.optim.SGD):
        kinds = ["sgd"]
    elif isinstance(optimizer, torch.optim.Adagrad):
        kinds = ["adagrad"]
    else:
        return
    betas = group.get("betas")
    for kind in kinds:
        for key, what in _ROUNDED_IN_OWN_DTYPE[kind]:
            if key.startswith("betas["):
                value = betas[int(key[6])] if isinstance(betas, tuple | list) else None
            else:
                value = group.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if kind == "adagrad" and key == "lr" and not float(group.get("lr_decay", 0.0)):
                continue  # lr / 1: the number it holds
            rounds_in = value.dtype if value.is_floating_point() else torch.get_default_dtype()
            if torch.finfo(rounds_in).eps <= torch.finfo(dtype).eps:
                continue
            raise ValueError(
                f"{type(optimizer).__name__} with {key}={value!r} (a {value.dtype} tensor) on a "
                f"{dtype} table: torch rounds {what} to {rounds_in}, which the row cache does "
                f"not reproduce; give {key} as a float (or a {dtype} tensor)"
            )


#: the optimizers the row cache steps by their own rule (their step() as torch defines it)
_STOCK = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad)


def _make_rule(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    base_step: int,
    buffers: bool = False,
    dtype: torch.dtype | None = None,
) -> _Rule:
    """The catch-up rule for ``group`` of ``optimizer`` from ``base_step`` on (``buffers``: SGD
    held momentum buffers then) for a table of ``dtype`` (:func:`check_hyper_tensors`; ``None``: not
    checked); ``ValueError`` naming what is refused."""
    name = type(optimizer).__name__
    step = inspect.unwrap(type(optimizer).step)
    stock = next((k for k in _STOCK if isinstance(optimizer, k)), None)
    if stock is not None and step is not inspect.unwrap(stock.step):
        raise ValueError(
            f"{name} overrides step() (a subclass of {stock.__name__}): the row cache steps the "
            f"table by {stock.__name__}'s own rule and would miss what the override does; use "
            f"{stock.__name__} itself, or an uncached table"
        )
    if dtype is not None:
        check_hyper_tensors(optimizer, group, dtype)
    for flag in ("fused", "capturable"):
        if group.get(flag):
            raise ValueError(f"{name} with {flag}=True is not supported by the row cache")
    if isinstance(optimizer, torch.optim.SGD):
        return _SGDRule(group, base_step, buffers)
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay")
        beta1, beta2 = (float(b) for b in group["betas"])
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):  # set through param_groups
            raise ValueError(
                f"{name} with betas=({beta1}, {beta2}): each beta must be in [0, 1), as "
                f"{name}'s constructor requires (at beta2 = 1 its bias correction 1 - beta2^t "
                "is 0)"
            )
        if not group.get("amsgrad") and beta2 > 0 and beta1 >= math.sqrt(beta2):
            raise ValueError(
                f"{name} with betas=({beta1}, {beta2}) cannot be caught up exactly in bounded "
                f"time: beta1 >= sqrt(beta2) makes a skipped row's updates grow step after step; "
                "the row cache needs beta1 < sqrt(beta2), or amsgrad=True"
            )
        if group["weight_decay"] and not decoupled:
            raise ValueError(
                f"{name} with weight_decay={group['weight_decay']} (L2, not decoupled) cannot be "
                "caught up exactly in bounded time; use AdamW (decoupled weight decay)"
            )
        return _AdamRule(group, base_step)
    if isinstance(optimizer, torch.optim.Adagrad):
        if group["weight_decay"]:
            raise ValueError(
                f"Adagrad with weight_decay={group['weight_decay']} cannot be caught up exactly "
                "in bounded time; use weight_decay=0"
            )
        return _NoopRule(group, base_step, ("sum",))
    raise ValueError(
        f"optimizer {name} is not supported by the row cache (supported: SGD, Adam, AdamW, Adagrad)"
    )
