"""The row cache's own optimizer step: one fused update over the rows a batch touched.

:class:`~edo_monitor.nn.CachedTable` does not let the user's optimizer step its cache ``weight``
``(C, D)`` densely. Its forward returns the batch's unique rows through :class:`CacheRows`, whose
backward adds their gradient into a ``(U, D)`` buffer (``U``: the rows touched since the last
optimizer step), and at the optimizer's step (a step pre-hook) the cache updates exactly those
rows with the formulas below (gather → update → scatter, one vectorized pass), taking every
hyper-parameter from the optimizer's group at that step. The formulas follow
``torch.optim``'s single-tensor implementations term by term (same order of operations), so a
row gets the value a resident table would have.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CacheRows", "fused_update"]


class CacheRows(torch.autograd.Function):
    """``source[index]`` ``(U, D)``, whose gradient goes to the table's row buffer (not ``weight``).

    ``forward(weight, source, index, table, positions, generation)``: ``source`` is the cache
    ``weight`` ``(C, D)`` itself, or the row buffer's values ``(L, D)`` (the batch's rows caught up
    at the forward, :meth:`~edo_monitor.nn.CachedTable._take_rows`); ``index`` ``(U,)`` int64 rows
    of ``source`` on its device; ``positions`` ``(U,)`` the rows' places in the table's gradient
    layout. The backward returns no gradient for ``weight`` (so ``weight.grad`` stays ``None``: no
    ``(C, D)`` gradient exists) and hands the rows' gradient to
    ``table._grad_arrived(positions, generation, grad)``, which adds it into the row buffer's
    gradient only if the backward accumulates into ``weight`` (``loss.backward()``,
    ``backward(inputs=[..., weight])``; not ``torch.autograd.grad``:
    :class:`~edo_monitor.nn.cache_grads._GradientLayout`).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        weight: torch.Tensor,
        source: torch.Tensor,
        index: torch.Tensor,
        table: Any,
        positions: torch.Tensor,
        generation: int,
    ) -> torch.Tensor:
        ctx.table = table
        ctx.positions = positions
        ctx.generation = generation
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ctx.table._grad_arrived(ctx.positions, ctx.generation, grad)
        return None, None, None, None, None, None


def fused_update(
    kind: str,
    group: dict[str, Any],
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    step: int,
    momentum_starts: bool = False,
) -> None:
    """One optimizer step of rows ``p`` ``(U, D)`` with gradient ``grad`` ``(U, D)``, in place.

    ``kind``: ``"sgd"``, ``"adam"`` (Adam and AdamW: decoupled decay when ``decoupled``) or
    ``"adagrad"``; ``state``: the rows' per-element state (``momentum_buffer``; ``exp_avg``,
    ``exp_avg_sq``, ``max_exp_avg_sq``; ``sum``), updated in place; ``step``: the parameter's
    step number after this step (1 at its first); ``momentum_starts``: SGD's momentum buffers
    are made at this step (the first with momentum). Refused settings never reach here
    (:func:`edo_monitor.nn.cached._make_rule` refuses them by name).
    """
    lr = float(group["lr"])
    if group.get("maximize"):
        grad = -grad
    if kind == "sgd":
        wd, mu = float(group["weight_decay"]), float(group["momentum"])
        if wd:
            grad = grad.add(p, alpha=wd)
        if mu:
            buf = state["momentum_buffer"]
            if momentum_starts:  # torch makes the buffer: a copy of the gradient
                buf.copy_(grad)
            else:
                buf.mul_(mu).add_(grad, alpha=1 - float(group["dampening"]))
            grad = grad.add(buf, alpha=mu) if group["nesterov"] else buf
        p.add_(grad, alpha=-lr)
    elif kind == "adam":
        beta1, beta2 = (float(b) for b in group["betas"])
        wd = float(group["weight_decay"])
        if wd:  # decoupled only (L2 with Adam is refused)
            p.mul_(1 - lr * wd)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bc1 = 1 - beta1**step
        bc2_sqrt = (1 - beta2**step) ** 0.5
        if group.get("amsgrad"):
            mx = state["max_exp_avg_sq"]
            torch.maximum(mx, v, out=mx)
            denom = (mx.sqrt() / bc2_sqrt).add_(float(group["eps"]))
        else:
            denom = (v.sqrt() / bc2_sqrt).add_(float(group["eps"]))
        p.addcdiv_(m, denom, value=-lr / bc1)
    elif kind == "adagrad":
        clr = lr / (1 + (step - 1) * float(group["lr_decay"]))
        s = state["sum"]
        s.addcmul_(grad, grad, value=1)
        p.addcdiv_(grad, s.sqrt().add_(float(group["eps"])), value=-clr)
    else:  # pragma: no cover - _make_rule refuses other optimizers
        raise ValueError(f"no fused step for {kind!r}")


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"``, ``"adam"`` or ``"adagrad"`` (the classes the row cache supports)."""
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return "adam"
    if isinstance(optimizer, torch.optim.Adagrad):
        return "adagrad"
    raise ValueError(f"optimizer {type(optimizer).__name__} is not supported by the row cache")
