"""The ``compress_embedding`` rules that need only what a run records of a table (no torch).

Which variant ``compress_embedding`` picks, which variants a table's dtype or trainability
refuses, the low-rank rank and the refusal of a variant that is not smaller: the live action
(:mod:`edo_monitor.actions.compress_embedding`) and ``replay``
(:mod:`edo_monitor.hindsight.replay_model`) both call these, so a replay decides what the live
action would from the recorded table (its dtype, its size, and whether it trains: a table whose
recorded gradient is 0 bytes is frozen). The rules that need the live model (tied weights, a
weight read outside its module, ``sparse``, ``max_norm``, the optimizer's ``eps``, the padding row,
lookup counts) stay in the action.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_LOW_RANK_FRACTION",
    "FROZEN_ONLY_VARIANTS",
    "chosen_variant",
    "lowrank_rank",
    "not_smaller_reason",
    "variant_refusal",
]

#: The variants that store a frozen table (no gradient, no optimizer state).
FROZEN_ONLY_VARIANTS: tuple[str, ...] = ("int8", "int4", "int2", "2of8", "perrow")
#: ``ActionContext.low_rank_fraction``'s default: the rank as a fraction of the columns.
DEFAULT_LOW_RANK_FRACTION = 0.5
#: The registered low-bit actions' group size (columns per scale and zero-point).
DEFAULT_GROUP_SIZE = 64


def chosen_variant(variant: str, trainable: bool) -> str:
    """The variant ``variant`` means for a table: ``"auto"`` (``compress_embedding``) is bf16
    for a trainable table and int8 for a frozen one; any other is itself."""
    if variant != "auto":
        return variant
    return "bf16" if trainable else "int8"


def variant_refusal(
    variant: str, *, trainable: bool, dtype: str, element_bytes: int, floating: bool
) -> str | None:
    """Why ``variant`` (already :func:`chosen_variant`) does not apply to a table of ``dtype``
    (as the caller prints it: ``"torch.float32"`` live, ``"float32"`` recorded),
    ``element_bytes`` a value, floating point or not, trainable or frozen; ``None`` when it
    may (the live action checks the rest)."""
    if not floating or element_bytes <= 2:
        return f"weight is {dtype}, already 16 bits or less"
    if variant in FROZEN_ONLY_VARIANTS and trainable:
        return f"{variant} is for frozen tables (requires_grad=False)"
    return None


def lowrank_rank(num_embeddings: int, embedding_dim: int, fraction: float) -> int:
    """``compress_embedding_lowrank``'s rank: ``round(embedding_dim × fraction)``, at least 1
    and at most ``min(num_embeddings, embedding_dim)``."""
    return max(1, min(num_embeddings, embedding_dim, round(embedding_dim * fraction)))


def not_smaller_reason(what: str, now_bytes: int, saving_bytes: int) -> str:
    """The refusal of ``what`` (``"int8"``, ``"rank 32"`` …) when it saves ``saving_bytes <= 0``
    of a table of ``now_bytes``, naming the bytes after the next step and now."""
    return (
        f"{what} would not be smaller: {now_bytes - saving_bytes:,} bytes after the next step "
        f"against {now_bytes:,} now (saves {saving_bytes:,})"
    )
