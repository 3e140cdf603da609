"""Bytes saved for backward, measured with ``torch.autograd.graph.saved_tensors_hooks``.

The pack hook sees every tensor autograd saves during forward (in the training thread, inside the
``watch()`` block). Each storage is counted once per step (many saved tensors are views of one
storage), and the model's own parameters are skipped (they are counted as parameters). The pack
hook returns the tensor itself, so nothing is copied and nothing is kept alive.

At each step boundary :meth:`ActivationTracker.end_step` closes the step: the bytes saved during it
become ``last_step_bytes`` and the running peak. ``activations_bytes`` in a reading is the larger of
the last finished step's and the current step's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["ActivationTracker"]


class ActivationTracker:
    """Counts saved-for-backward bytes per step.

    Args:
        params: the watched model's parameters (their storages are not counted).
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._param_ptrs = self._ptrs(params)
        self._seen: set[int] = set()
        self.current_step_bytes = 0
        self.last_step_bytes = 0
        self.peak_step_bytes = 0
        self._context: Any = None
        #: CPU-budget enforcement during forward: when ``static_bytes`` + this step's saved bytes
        #: go over ``limit_bytes``, ``on_exceed(requested_bytes, in_use_bytes)`` is called (it
        #: raises the out-of-memory error, so the failing forward never reaches the optimizer)
        self.limit_bytes: int | None = None
        self.static_bytes = 0
        self.on_exceed: Callable[[int, int], None] | None = None

    @staticmethod
    def _ptrs(params: Iterable[torch.Tensor]) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in params}

    def set_params(self, params: Iterable[torch.Tensor]) -> None:
        """Replace the set of parameter storages to skip (after an action changed the model)."""
        self._param_ptrs = self._ptrs(params)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._seen and ptr not in self._param_ptrs:
            self._seen.add(ptr)
            nbytes = storage.nbytes()
            self.current_step_bytes += nbytes
            limit = self.limit_bytes
            if limit is not None and self.on_exceed is not None:
                in_use = self.static_bytes + self.current_step_bytes
                if in_use > limit:
                    self.current_step_bytes -= nbytes  # the allocation fails: it never happened
                    self.on_exceed(nbytes, in_use)
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> ActivationTracker:
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def end_step(self) -> int:
        """Close the current step; returns the bytes it saved for backward."""
        step_bytes = self.current_step_bytes
        self.last_step_bytes = step_bytes
        self.peak_step_bytes = max(self.peak_step_bytes, step_bytes)
        self.current_step_bytes = 0
        self._seen = set()
        return step_bytes

    @property
    def activations_bytes(self) -> int:
        """Bytes saved for backward, as the sampler reports them (see module docstring)."""
        return max(self.last_step_bytes, self.current_step_bytes)
