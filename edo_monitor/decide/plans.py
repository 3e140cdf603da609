"""What the policy needs to know about actions, without importing PyTorch.

:class:`Plan` and :class:`Refusal` (what an action's ``plan`` returns), every action's name, the
lossy ones, the default ladders and :func:`rounding_expected_error` (the expected error of a
bf16/fp16 cast, shared by the action and by the offline replay). :mod:`edo_monitor.actions`
(which needs torch) re-exports them and registers the actions under these names (a test keeps
both lists equal), so
:class:`edo_monitor.decide.policy.Policy` can be built and run offline, e.g. by
:func:`edo_monitor.hindsight.replay`, in a process that never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edo_monitor.measure.module_tree import MODEL_MODULE, module_label

__all__ = [
    "ACTION_NAMES",
    "DEFAULT_LOSSLESS_LADDER",
    "DEFAULT_LOSSY_LADDER",
    "LOSSY_ACTION_NAMES",
    "MODEL_MODULE",
    "NOT_YET_KNOWN",
    "ROOT_TABLE_REASON",
    "TABLE_BLOCKERS",
    "UNIT_ROUNDOFF",
    "Plan",
    "Refusal",
    "module_label",
    "rounding_expected_error",
]


#: How a refusal's reason begins when the agent cannot tell yet (before the first recorded step,
#: before the first optimizer step), not that the action cannot apply: ``explain`` does not take
#: such a refusal as ruling a remedy out.
NOT_YET_KNOWN = ("no recorded step yet", "no optimizer has stepped yet")

#: How a refusal's reason begins when the table itself rules out every table action (its weight
#: tied to another module, or read outside its own forward, or the table is the watched model
#: itself, which no action can swap for another module), whichever action was refused:
#: ``explain`` takes one such refusal for all of that table's remedies.
TABLE_BLOCKERS = (
    "weight is tied to",
    "weight is read outside",
    "table is the watched model",
    "weight has gradient hooks",
    "table has backward hooks",
)

#: Why no table action takes a table that is the watched model itself (the live actions' and
#: ``replay``'s refusal).
ROOT_TABLE_REASON = (
    f"{TABLE_BLOCKERS[2]} itself: an action swaps a table in its parent module, and the model "
    "has none (watch a module that holds the table, such as nn.Sequential(table))"
)

#: The actions that change numerics (need ``allow_lossy``), in registry order.
_LOSSY = (
    "compress_embedding",
    "compress_embedding_bf16",
    "compress_embedding_fp16",
    "compress_embedding_int8",
    "compress_embedding_lowrank",
    "compress_embedding_int4",
    "compress_embedding_int2",
    "compress_embedding_2of8",
    "compress_embedding_perrow",
    "share_embedding",
)
#: Every action's name, in registry order (see :data:`edo_monitor.actions.ACTIONS`).
ACTION_NAMES: tuple[str, ...] = (
    "release_cache",
    "cache_embedding",
    "grow_cache",
    "offload_embedding",
    "checkpoint_activations",
    *_LOSSY,
    "spill_embedding",
)
LOSSY_ACTION_NAMES: frozenset[str] = frozenset(_LOSSY)
DEFAULT_LOSSLESS_LADDER: tuple[str, ...] = (
    "release_cache",
    "cache_embedding",
    "spill_embedding",
    "offload_embedding",
    "checkpoint_activations",
)
DEFAULT_LOSSY_LADDER: tuple[str, ...] = ("compress_embedding", "share_embedding")

#: Unit roundoff ``u`` (half the spacing of the numbers in [1, 2)) of the 16-bit float formats:
#: bf16 keeps 8 significant bits, fp16 11.
UNIT_ROUNDOFF: dict[str, float] = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def rounding_expected_error(variant: str) -> float:
    """Expected relative squared error of a table cast to ``variant`` (``"bf16"``/``"fp16"``),
    rounding to nearest: ``(2 ln 2 / 9) u²`` ≈ ``0.154 u²`` (see :data:`UNIT_ROUNDOFF`).

    Where it comes from: on a binade ``[2^e, 2^(e+1))`` the spacing is ``2u·2^e`` and the
    rounding error is uniform in half a spacing either way, so ``E[err²] = (2u·2^e)²/12``; with
    significands spread log-uniformly over the binade (as for values drawn from a smooth
    distribution spanning several binades, e.g. Gaussian rows), ``E[x²] = 2^(2e)·3/(2 ln 2)``.
    Their ratio is ``E‖r̂ − r‖² / E‖r‖²`` for a row ``r`` of such values. ``u²/3`` (a relative
    error uniform in ``[−u, u]``) overstates it: the bound ``u`` is reached only just above a
    power of two. Measured on an ``N(0, 1)`` table (tests/test_lossy_errors.py) the formula is
    within 20 % (the measured value is about 1.18× it); values that do not span binades (e.g.
    uniform in [0, 1]) give about 0.93×. Subnormals and overflow (fp16 above 65504) are not
    modelled.

    Raises:
        KeyError: for a variant other than ``"bf16"`` or ``"fp16"``.
    """
    return 2.0 * math.log(2.0) / 9.0 * UNIT_ROUNDOFF[variant] ** 2


@dataclass(frozen=True)
class Plan:
    """What an action would do.

    Attributes:
        action: action name (a key of ``ACTIONS``).
        target: what it acts on (qualified module name(s), ``"allocator"``), for humans and events.
        estimated_saving_bytes: device-tier bytes it expects to free (int).
        reason: one line: why this target, what changes.
        details: action-specific values (variant, rank, module names ...), JSON-serialisable.
        expected_error: for a lossy action, the expected relative squared error of a looked-up
            row after the action, ``E[‖r̂ − r‖²] / E[‖r‖²]``: ``r`` the row a lookup returned
            before, ``r̂`` the row it returns right after, both expectations over the lookups'
            distribution (the counted lookups of
            :class:`edo_monitor.measure.frequency.LookupCounter` when it has counts for the table,
            else every row equally often), the ``padding_idx`` row left out (every action keeps it
            exact). Dimensionless, ``>= 0``; ``0`` is exact, ``1`` is as large as the rows
            themselves (e.g. replacing them by zeros). Each action's ``plan`` says how it
            estimates it (from a bounded sample of rows for large tables).
            :class:`edo_monitor.decide.policy.Policy` ranks lossy plans by
            ``estimated_saving_bytes / expected_error``. ``None`` for lossless actions and where
            it is not known (e.g. a replay without the rows' values).
    """

    action: str
    target: str
    estimated_saving_bytes: int
    reason: str
    details: dict[str, Any] = field(default_factory=dict)
    expected_error: float | None = None


@dataclass(frozen=True)
class Refusal:
    """Why an action does not apply now (``target`` may be ``""`` when there is none)."""

    action: str
    target: str
    reason: str


def cache_rows_for(num_embeddings: int, floor_rows: int, need_bytes: int, row_bytes: int) -> int:
    """Rows a new row cache keeps so that converting the table frees at least ``need_bytes``.

    One resident row's bytes (``row_bytes``: weight, gradient, per-element state) come back for
    every row the cache leaves out, ``ceil(need_bytes / row_bytes)`` of them, and at least
    ``floor_rows`` (a batch's peak distinct ids) stay. A kept row then costs less than
    ``row_bytes`` (a cache has no dense gradient), so the conversion frees more than ``need_bytes``:
    the dense gradient is a margin, not a reason to keep more rows. (Counting it in the rows as
    well made a cache of all rows but one, or, before that, a refusal as "would hold the whole
    table" whenever dropping the gradient alone covered ``need_bytes``: the main demo offloaded
    its table instead of caching it.) A result ``>= num_embeddings`` means no cache fits.
    """
    return max(floor_rows, num_embeddings - -(-need_bytes // row_bytes))
