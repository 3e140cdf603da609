"""The use watcher of :class:`~edo_monitor.actions.checkpoint_activations.ActivationRecorder`:
which torch functions a table weight passes through during the recorded step.

A read of a table's weight outside its module's forward (an output layer tied by use) is found by
a ``TorchFunctionMode`` that hands every call's arguments to
:meth:`ActivationRecorder.note_use`; this module holds the mode, the names of the functions that
read only metadata, and the address span a weight's elements take (a view or ``.data`` of the
weight starts inside it).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)


class UseSink(Protocol):
    """Where the watcher reports a call
    (:class:`~edo_monitor.actions.checkpoint_activations.ActivationRecorder` is one)."""

    def note_use(self, func: Any, args: Any, kwargs: Any) -> None: ...


#: torch functions that read only metadata (shape, dtype, storage pointer ...), never values:
#: a parameter passed to one of them is not "used" (the agent's own accounting calls them too)
_METADATA_OPS = frozenset(
    {
        "__get__",
        "__set__",
        "__len__",
        "__hash__",
        "__format__",
        "__repr__",
        "dim",
        "ndimension",
        "size",
        "stride",
        "numel",
        "nelement",
        "element_size",
        "storage_offset",
        "untyped_storage",
        "data_ptr",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "is_pinned",
        "get_device",
        "_values",
        "_indices",
        "is_coalesced",
        "_is_view",
        # an alias of the same elements, no value read: state_dict() takes one of every
        # parameter (a checkpoint saved in the step blocked every table action); a read of the
        # alias later is still found, by the span of its elements
        "detach",
    }
)


class _UseWatcher(TorchFunctionMode):
    """Passes every torch function call of the recorded step to :meth:`ActivationRecorder.note_use`.

    Why a ``TorchFunctionMode`` and not the saved-tensor hooks: a weight read outside its module
    is not always saved for backward (``F.linear(x, W)`` with ``x`` not requiring grad saves only
    ``x``; a frozen table saves nothing; a read under ``no_grad`` is invisible to autograd), but
    every read passes the tensor to a torch function. The mode is active only during the one
    recorded step every ``profile_interval_s``, and its check is a dict lookup per argument.
    """

    def __init__(self, recorder: UseSink) -> None:
        super().__init__()
        self._recorder = recorder

    @torch.compiler.disable  # Python state: run as Python under torch.compile
    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            self._recorder.note_use(func, args, kwargs)
        except Exception:  # never fail the user's step
            logger.debug("use check of %r failed", func, exc_info=True)
        return func(*args, **kwargs)


def _element_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``(start, end)`` addresses of ``t``'s elements (its own, not its whole storage: parameters
    that are views of one flat buffer keep apart), ``None`` when there is nothing to compare
    (sparse, meta, no elements, a tensor subclass without memory of its own)."""
    if t.layout != torch.strided or t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        start = t.data_ptr()
    except Exception:
        return None
    if not start:
        return None
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()
