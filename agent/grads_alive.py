"""The watched model's gradients alive now, on the device tier: CPU-budget enforcement inside the
step (``watch(..., enforce=True)`` without CUDA).

The budget is checked against what is alive *at once*, as a GPU's allocator would fail: during
the forward, parameters + optimizer state + the gradients still alive (none after
``zero_grad()``'s default ``set_to_none=True``; all of them with gradient accumulation) + the
saved tensors; during the backward, each parameter's new gradient against the saved tensors still
alive then (autograd frees a node's saved tensors once the node has run, so a table's gradient,
made last, meets few of them). Before, the step boundary added the forward's peak of saved
tensors to the gradients measured after the backward, and the forward counted the previous step's
gradients: a step that fits on a GPU ran out of its CPU budget.

How: a post-accumulate-grad hook on each parameter that requires a gradient
(``Tensor.register_post_accumulate_grad_hook``; it is not copied with the module, so
``deepcopy``/``torch.save`` of the model are unaffected) hands the growth of that parameter's
``.grad`` to :meth:`ActivationTracker.add_grad_bytes`, which checks the budget (a new gradient
over it is taken back off the parameter before the out-of-memory error is raised: the allocation
failed, and the error's snapshot shows what was alive before it). ``zero_grad()``
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
