"""Modules by qualified name as a tree: which names nest, and per-module bytes that include
their submodules' (an activation profile's ``exclusive_bytes``, ``module_stats``'
``activations_bytes``) made into bytes that can be added up.

Pure Python: the live agent, the checkpointing planner and the hindsight readers share it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MODEL_MODULE", "largest_disjoint", "module_label", "nested", "own_bytes"]

#: What the model itself is called where a module's qualified name is shown or recorded: its
#: ``named_modules()`` name is ``""`` (a bare ``nn.Embedding`` watched as the model, say). The
#: attribution's module rows, events, refusals and ``explain`` all read it so; no qualified
#: name holds ``<``.
MODEL_MODULE = "<model>"


def module_label(name: str) -> str:
    """A module's qualified name as shown and recorded: ``name``, or :data:`MODEL_MODULE` for the
    model itself (``""``)."""
    return name or MODEL_MODULE


def nested(a: str, b: str) -> bool:
    """Whether modules ``a`` and ``b`` are the same or one holds the other (``""`` is the model,
    holding every module)."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def largest_disjoint(bytes_by_module: Mapping[str, int], limit: int) -> list[tuple[str, int]]:
    """Up to ``limit`` modules, largest first, none holding another, each with its bytes.

    A module's bytes include its submodules' (a block and its attention layer both count the
    attention's saved tensors), so adding up nested modules counts bytes twice; a module whose
    bytes are ``<= 0`` is never taken. Ties go to the name first in sorted order.
    """
    chosen: list[tuple[str, int]] = []
    for name, nbytes in sorted(bytes_by_module.items(), key=lambda kv: -kv[1]):
        if len(chosen) >= limit or nbytes <= 0:
            break
        if not any(nested(name, other) for other, _ in chosen):
            chosen.append((name, nbytes))
    return chosen


def own_bytes(bytes_by_module: Mapping[str, int]) -> dict[str, int]:
    """Each module's bytes less those of the listed modules directly inside it (the nearest
    listed ones; at least 0): bytes that add up over the modules without counting a
    submodule's twice.

    ``{"": 12, "b1": 10, "b1.attn": 6}`` gives ``{"": 2, "b1": 4, "b1.attn": 6}``.
    """
    out = dict(bytes_by_module)
    for name, nbytes in bytes_by_module.items():
        if not name:
            continue
        parent = name
        while parent:  # the nearest listed module holding it ("" last: the model)
            parent = parent.rpartition(".")[0]
            if parent in bytes_by_module:
                out[parent] -= nbytes
                break
    return {name: max(0, nbytes) for name, nbytes in out.items()}
