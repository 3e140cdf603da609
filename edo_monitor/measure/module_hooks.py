"""Forward pre-hooks on the user's modules that a copy of the model survives, and that a
``torch.compile``'d model runs as they are.

The agent watches forwards of the user's modules (the step window of the activation tracker, the
lookup counting of embedding tables). A hook torch keeps on the module is copied and pickled with
it: ``copy.deepcopy(model)``, ``torch.save(model)`` and ``AveragedModel(model)`` then copied the
tracker behind a bound-method hook (``TypeError: cannot pickle '_thread.lock' object``) or failed
on a lambda. Here the module holds one module-level function, :func:`_dispatch`, which pickles
by name and copies as itself; the callbacks live in a weak table keyed by the module, so a copy
(a different module) finds none and its hook does nothing.

Under ``torch.compile`` Dynamo traces a module's hooks into its graph; reading the weak table
there failed the user's first forward (``... is already tracked for mutation``). The hook is
excluded from tracing (``torch.compiler.disable``): Dynamo breaks the graph around it and it runs
as Python, each call, as without compiling.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["PreHookHandle", "add_forward_pre_hook", "is_agent_hook", "uncompiled"]

#: per module: torch's handle of its one dispatching hook, and the callbacks by key
_HOOKS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, dict[int, Callable[..., None]]]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()
_KEYS = iter(range(1 << 62))


@torch.compiler.disable  # runs as Python under torch.compile (see the module docstring)
def _dispatch(module: nn.Module, args: Any, kwargs: Any = None) -> None:
    """The forward pre-hook torch keeps on a module (with its keyword arguments: a model pickled
    before they were passed calls it without): its callbacks, if it is the module they were
    added to (a copy of it is not); their results are ignored (the forward's arguments are
    never replaced)."""
    entry = _HOOKS.get(module)
    if entry is not None:
        for callback in list(entry[1].values()):
            callback(module, args, kwargs or {})


class PreHookHandle:
    """What :func:`add_forward_pre_hook` returns: ``remove()`` takes the callback off (the last
    one takes the dispatching hook off the module too)."""

    def __init__(self, module: nn.Module, key: int) -> None:
        self._module = weakref.ref(module)
        self._key = key

    def remove(self) -> None:
        """Take the callback off; again, or after the module is gone, does nothing."""
        module = self._module()
        if module is None:
            return
        with _LOCK:
            entry = _HOOKS.get(module)
            if entry is None or entry[1].pop(self._key, None) is None or entry[1]:
                return
            del _HOOKS[module]
            entry[0].remove()


def add_forward_pre_hook(
    module: nn.Module, callback: Callable[[nn.Module, Any], None]
) -> PreHookHandle:
    """Call ``callback(module, args, kwargs)`` before each forward of ``module`` (the forward's
    positional and keyword arguments; the result is ignored), the way
    ``register_forward_pre_hook(..., with_kwargs=True)`` does, except that a copy or pickle of
    the module carries no reference to ``callback``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``callback`` not callable.
    """
    if not isinstance(module, nn.Module) or not callable(callback):
        raise TypeError(
            f"add_forward_pre_hook takes a module and a callable, got {type(module).__name__} "
            f"and {type(callback).__name__}"
        )
    with _LOCK:
        entry = _HOOKS.get(module)
        if entry is None:
            entry = (module.register_forward_pre_hook(_dispatch, with_kwargs=True), {})
            _HOOKS[module] = entry
        key = next(_KEYS)
        entry[1][key] = callback
    return PreHookHandle(module, key)


def is_agent_hook(hook: object) -> bool:
    """Whether ``hook`` (a value of a module's ``_forward_pre_hooks``) is the agent's own
    dispatching hook, not one of the user's."""
    return hook is _dispatch


def uncompiled(model: nn.Module | None) -> nn.Module | None:
    """The module ``torch.compile(model)`` wraps (its ``OptimizedModule``'s ``_orig_mod``), else
    ``model``: watched, its modules keep their own names (no ``_orig_mod.`` prefix) and the
    compiled wrapper calls them, hooks and all."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(model, optimized):
        inner = model._orig_mod
        return inner if isinstance(inner, nn.Module) else model
    return model
