"""What the policy needs to know about actions, without importing PyTorch.

:class:`Plan` and :class:`Refusal` (what an action's ``plan`` returns), every action's name, the
lossy ones and the default ladders. :mod:`edo_monitor.actions` (which needs torch) re-exports
them and registers the actions under these names (a test keeps both lists equal), so
:class:`edo_monitor.policy.Policy` can be built and run offline, e.g. by
:func:`edo_monitor.hindsight.replay`, in a process that never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ACTION_NAMES",
    "DEFAULT_LOSSLESS_LADDER",
    "DEFAULT_LOSSY_LADDER",
    "LOSSY_ACTION_NAMES",
    "Plan",
    "Refusal",
]

#: Every action's name, in registry order (see :data:`edo_monitor.actions.ACTIONS`).
ACTION_NAMES: tuple[str, ...] = (
    "release_cache",
    "cache_embedding",
    "grow_cache",
    "offload_embedding",
    "checkpoint_activations",
    "compress_embedding",
    "compress_embedding_bf16",
    "compress_embedding_fp16",
    "compress_embedding_int8",
    "compress_embedding_lowrank",
    "share_embedding",
)
#: The actions that change numerics (need ``allow_lossy``).
LOSSY_ACTION_NAMES: frozenset[str] = frozenset(
    {
        "compress_embedding",
        "compress_embedding_bf16",
        "compress_embedding_fp16",
        "compress_embedding_int8",
        "compress_embedding_lowrank",
        "share_embedding",
    }
)
DEFAULT_LOSSLESS_LADDER: tuple[str, ...] = (
    "release_cache",
    "cache_embedding",
    "offload_embedding",
    "checkpoint_activations",
)
DEFAULT_LOSSY_LADDER: tuple[str, ...] = ("compress_embedding", "share_embedding")


@dataclass(frozen=True)
class Plan:
    """What an action would do.

    Attributes:
        action: action name (a key of ``ACTIONS``).
        target: what it acts on (qualified module name(s), ``"allocator"``), for humans and events.
        estimated_saving_bytes: device-tier bytes it expects to free (int).
        reason: one line: why this target, what changes.
        details: action-specific values (variant, rank, module names ...), JSON-serialisable.
    """

    action: str
    target: str
    estimated_saving_bytes: int
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """Why an action does not apply now (``target`` may be ``""`` when there is none)."""

    action: str
    target: str
    reason: str
