"""The optimizers the row cache steps: what it reads off them (a table's group, the steps taken,
the per-element state keys and their initial values) and which catch-up rule each one gets, with
what is refused and why (:func:`_make_rule`)."""

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


def check_lr(optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype) -> None:
    """Refuse (``ValueError``, naming it) Adam's or AdamW's ``lr`` given as a tensor of less
    precision than the table's ``dtype`` (a float32 tensor on a float64 table): torch then
    computes each step's step size ``lr / (1 - beta1^t)`` and decay ``1 - lr * weight_decay``
    in the tensor's dtype and rounds them there (AdamW: 3e-7 of a float64 twin after 20 steps),
    which the catch-up's float64 tables do not reproduce. SGD and Adagrad apply such an ``lr``
    as the number it holds, as the cache does."""
    lr = group["lr"]
    if not isinstance(lr, torch.Tensor):
        return
    # an integer tensor's quotients come out in the default dtype
    rounds_in = lr.dtype if lr.is_floating_point() else torch.get_default_dtype()
    if (
        isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
        and torch.finfo(rounds_in).eps > torch.finfo(dtype).eps
    ):
        raise ValueError(
            f"{type(optimizer).__name__} with lr={lr!r} (a {lr.dtype} tensor) on a {dtype} "
            f"table: torch rounds each step's step size and decay to {rounds_in}, which the row "
            f"cache does not reproduce; give lr as a float (or a {dtype} tensor)"
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
    held momentum buffers then) for a table of ``dtype`` (:func:`check_lr`; ``None``: not
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
        check_lr(optimizer, group, dtype)
    for flag in ("fused", "capturable"):
        if group.get(flag):
            raise ValueError(f"{name} with {flag}=True is not supported by the row cache")
    if isinstance(optimizer, torch.optim.SGD):
        return _SGDRule(group, base_step, buffers)
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay")
        beta1, beta2 = (float(b) for b in group["betas"])
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
