"""What a converting action may leave behind in the optimizers, found after every action.

A converting action (``cache_embedding``, ``offload_embedding``, ``compress_embedding*``,
``share_embedding``) replaces a table's ``Parameter`` by new ones, or rebinds the same
``Parameter`` to a tensor of another shape, dtype or device. Either way the optimizer must follow:

* a **replaced** parameter (in the model before the action, not after: int8 and low-rank
  compression, sharing) may stay in no ``param_group`` and be no key of ``optimizer.state``: the
  optimizer would go on stepping it and hold its weight, gradient and state (for an ``(N, D)``
  table with Adam, ``4 N D`` elements) while the model no longer uses it;
* a **kept** parameter whose shape, dtype or device changed (the row cache, bf16/fp16, offload)
  may keep no per-element state tensor in its old shape, dtype or device: a stale ``(N, D)``
  moment next to a ``(C, D)`` cache, an fp32 moment next to a bf16 weight.

:func:`optimizer_leftovers` lists both; :meth:`edo_monitor.actions.base.Action.apply` runs it
inside the action's transaction after every action and rolls the action back when it finds any
(the result is ``"failed"``, its reason naming the parameter and where it was found).

:func:`optimizer_only_bytes` is the other half: the device-tier bytes the optimizers hold for
parameters that are not the model's (weight, gradient, state). The action's measured bytes add
them to :func:`edo_monitor.measure.accounting.account`'s (which walks the model's parameters only),
so a leftover reference would show as no saving rather than as the estimate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from edo_monitor.measure.accounting import tensor_bytes

__all__ = ["ParamRecord", "optimizer_leftovers", "optimizer_only_bytes", "record_params"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamRecord:
    """A model parameter as it was before an action: qualified name and data's metadata."""

    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def record_params(model: nn.Module) -> dict[int, ParamRecord]:
    """Every parameter of ``model`` (tied ones once, first name), keyed by ``id``; reads metadata
    only (shape, dtype, device), never values."""
    out: dict[int, ParamRecord] = {}
    for name, p in model.named_parameters():
        if id(p) not in out:
            out[id(p)] = ParamRecord(name, p, tuple(p.shape), p.dtype, p.device)
    return out


def optimizer_leftovers(
    before: dict[int, ParamRecord],
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
) -> list[str]:
    """What the optimizers still hold of the parameters an action replaced or converted.

    Args:
        before: :func:`record_params` of the model taken just before the action.
        model: the model after the action.
        optimizers: the optimizers stepping it.

    Returns:
        One line per leftover (``"optimizer 0 param group 0 still holds replaced parameter
        emb.weight (4000, 16)"``, ``"optimizer 0 state of emb.weight: 'exp_avg' is (4000, 16)
        torch.float32 on cpu, the parameter now (256, 16) torch.float32 on cpu"``); empty when
        there is none.
    """
    now = {id(p) for p in model.parameters()}
    replaced = {k: r for k, r in before.items() if k not in now}
    problems: list[str] = []
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            for p in group["params"]:
                r = replaced.get(id(p))
                if r is not None:
                    problems.append(
                        f"optimizer {i} param group {j} still holds replaced parameter "
                        f"{r.name} {r.shape}"
                    )
        for p, state in list(opt.state.items()):
            r = replaced.get(id(p))
            if r is not None:
                problems.append(f"optimizer {i} state still holds replaced parameter {r.name}")
                continue
            r = before.get(id(p))
            if r is None or not isinstance(p, torch.Tensor):
                continue
            changed = (r.shape, r.dtype, r.device) != (tuple(p.shape), p.dtype, p.device)
            if not changed or not isinstance(state, dict):
                continue
            for key, v in list(state.items()):
                if isinstance(v, torch.Tensor) and _stale(v, r, p):
                    problems.append(
                        f"optimizer {i} state of {r.name}: {key!r} is {tuple(v.shape)} {v.dtype} "
                        f"on {v.device}, the parameter now {tuple(p.shape)} {p.dtype} on "
                        f"{p.device}"
                    )
    return problems


def _stale(v: torch.Tensor, r: ParamRecord, p: torch.Tensor) -> bool:
    """Whether per-element state ``v`` kept the old shape, dtype or device of ``p`` (``r``)."""
    if v.dim() == 0:  # scalars (Adam's step) stay as torch.optim keeps them
        return False
    shape = tuple(v.shape)
    if shape == r.shape and r.shape != tuple(p.shape):
        return True
    if shape != tuple(p.shape):
        return False  # not per-element (a factored state): not this check's to judge
    if r.dtype != p.dtype and v.is_floating_point() and v.dtype == r.dtype:
        return True
    return r.device != p.device and v.device == r.device


def optimizer_only_bytes(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, cuda_mode: bool
) -> int:
    """Device-tier bytes the optimizers hold for parameters that are not ``model``'s.

    Each such parameter (in a ``param_group`` or a key of ``optimizer.state``) counts its data,
    its gradient and its state tensors, each storage once, under the accounting's tier rule (CUDA
    mode: ``is_cuda``; CPU-budget mode: not marked ``_edo_host``). Reads ``.grad``: training
    thread only (as :meth:`edo_monitor.actions.base.Action.apply`).
    """
    in_model = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor, owner: torch.Tensor) -> None:
        nonlocal total
        if id(t) in seen:
            return
        seen.add(id(t))
        on_device = t.is_cuda if cuda_mode else not getattr(owner, "_edo_host", False)
        if on_device:
            total += tensor_bytes(t)

    for opt in optimizers:
        held = [p for g in opt.param_groups for p in g["params"]] + list(opt.state.keys())
        for p in held:
            if not isinstance(p, torch.Tensor) or id(p) in in_model or id(p) in seen:
                continue
            add(p, p)
            if p.grad is not None:
                add(p.grad, p)
            for o in optimizers:
                for v in list((o.state.get(p) or {}).values()):
                    if isinstance(v, torch.Tensor):
                        add(v, p)
    return total
