"""The watched model's gradients alive now, on the device tier: CPU-budget enforcement inside the
step (``watch(..., enforce=True)`` without CUDA).

The budget is checked as the step runs, against what is alive then:

* in the forward: parameters + optimizer state + the gradients alive (none after ``zero_grad()``'s
  default ``set_to_none=True``; the earlier micro-batches' with gradient accumulation) + the saved
  tensors alive. Before, the forward counted the last step boundary's gradients, freed or not;
* in the backward: each parameter's new gradient, with the gradients alive and the step's *peak*
  of saved tensors. The backward frees saved tensors as it goes but makes the gradients of the
  activations they were, which no hook sees; the peak stands in for them. The error comes
  before the optimizer's step (the first step's came at the boundary, after the weights had
  changed), and the gradient is taken back off the parameter (the allocation failed; the error's
  snapshot shows what was alive before it);
* at the step boundary (:class:`~edo_monitor.agent.safe_point.SafePoint`): the optimizer state
  its step made.

How: a post-accumulate-grad hook on each parameter that requires a gradient
(``Tensor.register_post_accumulate_grad_hook``; it is not copied with the module, so
``deepcopy``/``torch.save`` of the model are unaffected) hands the growth of that parameter's
``.grad`` to :meth:`ActivationTracker.add_grad_bytes`, which checks the budget. ``zero_grad()``
has no hook: the gradients alive are walked again when the step window opens (the step's first
forward) and at the step boundary. A parameter on the host tier (``_edo_host``, an offloaded
table) is not counted, as in :func:`edo_monitor.measure.accounting.account`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.measure.accounting import tensor_bytes

__all__ = ["GradientsAlive"]

logger = logging.getLogger(__name__)


class GradientsAlive:
    """Keeps ``tracker.grads_bytes`` equal to the device-tier bytes of the model's ``.grad``
    tensors alive now (each tensor once), growing it in backward as each gradient accumulates.

    Args:
        tracker: the activation tracker whose budget check the gradients join.
        model: the watched model.
    """

    def __init__(self, tracker: ActivationTracker, model: nn.Module) -> None:
        self._tracker = tracker
        self._model = model
        self._bytes: dict[int, int] = {}  # id(parameter) -> its gradient's bytes counted
        self._handles: list[Any] = []
        tracker.on_open = self.refresh
        self.watch()

    def watch(self) -> None:
        """(Re)hook the model's parameters (after an action changed them) and count anew."""
        self.remove()
        for p in self._model.parameters():
            if p.requires_grad and not is_lazy(p) and p.is_leaf:
                self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        self.refresh()

    def refresh(self) -> None:
        """Count the gradients alive now (a walk over the model's parameters)."""
        counted: dict[int, int] = {}
        for p in self._model.parameters():
            grad = p.grad
            if grad is not None and not getattr(p, "_edo_host", False):
                counted[id(p)] = tensor_bytes(grad)
        self._bytes = counted
        self._tracker.grads_bytes = sum(counted.values())

    def _accumulated(self, p: torch.Tensor) -> None:
        """The hook: ``p.grad`` was just made or accumulated into."""
        grad = p.grad
        if grad is None or getattr(p, "_edo_host", False):
            return
        n = tensor_bytes(grad)
        old = self._bytes.get(id(p), 0)
        if n == old:
            return

        def undo() -> None:  # the allocation failed: no gradient, as on a GPU
            p.grad = None

        self._tracker.add_grad_bytes(n - old, undo if old == 0 else None)
        self._bytes[id(p)] = n

    def remove(self) -> None:
        """Take the hooks off (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
