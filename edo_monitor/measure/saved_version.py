"""PyTorch's check that a tensor saved for backward was not changed in place, kept under
``saved_tensors_hooks``.

Without hooks, autograd records a saved tensor's version counter when it saves it and raises in
backward when the tensor was modified in place since ("one of the variables needed for gradient
computation has been modified by an inplace operation"). With a pair of
``torch.autograd.graph.saved_tensors_hooks`` installed, autograd hands the tensor to the pack hook
and skips that check: the agent's hooks (the activation tracker, the activation profile) turned
such a loud error into silently wrong gradients. Each pack hook therefore keeps the version with
the tensor (:func:`stamp`) and each unpack hook checks it (:func:`checked`), as autograd would.
"""

from __future__ import annotations

import torch

__all__ = ["checked", "stamp"]


def stamp(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(tensor, its version counter now)``: what a pack hook keeps (``detach()`` aliases share
    the counter, so a detached alias may be stamped instead)."""
    return tensor, tensor._version


def checked(tensor: torch.Tensor, version: int) -> torch.Tensor:
    """``tensor``, when its version counter still reads ``version``.

    Raises:
        RuntimeError: it was modified in place since it was saved; autograd's own message, which
            the hooks would otherwise have suppressed.
    """
    now = tensor._version
    if now != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version {now}; "
            f"expected version {version} instead. Hint: the operation that changed it in place "
            "ran after it was saved for backward (checked by edo-monitor's saved-tensor hooks, "
            "as autograd checks it without hooks)"
        )
    return tensor
