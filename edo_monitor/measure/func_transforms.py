"""``torch.func``'s transforms (``grad``, ``vjp``, ``jacrev``, ``hessian``) inside ``watch()``.

``torch.func`` refuses to run while saved-tensor hooks are set ("torch.func.{grad, vjp, jacrev,
hessian} don't yet support saved tensor hooks"): each transform enters
``torch.autograd.graph.disable_saved_tensors_hooks``, which raises when the thread's stack of hooks
is not empty. The agent keeps its hooks set for the whole ``watch()`` block (the activation
tracker's, :mod:`edo_monitor.agent.activations`, and a recorded step's,
:class:`~edo_monitor.actions.activation_profile.ActivationRecorder`: each registers its own
pair here), so a training step with per-sample gradients (DP-SGD through
``vmap(grad(...))``) ran outside ``watch()`` and failed inside it.

While some of the agent's hooks are registered here, ``disable_saved_tensors_hooks`` is wrapped:
the agent's hooks on top of the thread's stack are taken off for the duration (what the transform
saves is not counted as activations) and put back after it, in their order. A hook of the user's
on top of them still makes ``torch.func`` refuse, as it does without the agent. The wrapper is
looked up where ``torch.func`` looks (the module attribute, at each call) and is removed when the
last hook is unregistered.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.autograd.graph as autograd_graph

__all__ = ["register_hooks", "unregister_hooks"]

_LOCK = threading.Lock()
#: the pack hooks of the agent's hook pairs now registered (bound methods compare equal by their
#: object and function, so a pair is found again whatever attribute access made it)
_PACKS: list[Callable[[torch.Tensor], Any]] = []
_ORIGINAL = autograd_graph.disable_saved_tensors_hooks


@contextlib.contextmanager
def _disable_past_the_agent(error_message: str) -> Iterator[None]:
    """``disable_saved_tensors_hooks`` with the agent's hooks on top of this thread's stack taken
    off around it (and put back after)."""
    taken: list[tuple[Any, Any]] = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None and any(
        top[0] == pack for pack in list(_PACKS)
    ):
        torch._C._autograd._pop_saved_tensors_default_hooks()
        taken.append(top)
    try:
        with _ORIGINAL(error_message):
            yield
    finally:
        for pack, unpack in reversed(taken):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def register_hooks(pack: Callable[[torch.Tensor], Any]) -> None:
    """Note ``pack`` (the pack hook of a pair the agent sets) as the agent's: the transforms may
    take its pair off while they run."""
    with _LOCK:
        _PACKS.append(pack)
        if autograd_graph.disable_saved_tensors_hooks is _ORIGINAL:
            autograd_graph.disable_saved_tensors_hooks = _disable_past_the_agent


def unregister_hooks(pack: Callable[[torch.Tensor], Any]) -> None:
    """Forget ``pack`` (its pair was popped); the last one puts torch's function back (unless
    someone else replaced it since)."""
    with _LOCK:
        for i, known in enumerate(_PACKS):
            if known == pack:
                del _PACKS[i]
                break
        if not _PACKS and autograd_graph.disable_saved_tensors_hooks is _disable_past_the_agent:
            autograd_graph.disable_saved_tensors_hooks = _ORIGINAL
