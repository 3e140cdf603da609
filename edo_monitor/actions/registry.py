"""The registry of actions by name, and the ladder the policy climbs by default."""

from __future__ import annotations

from edo_monitor.actions.base import Action
from edo_monitor.actions.cache_embedding import CacheEmbedding, GrowCache
from edo_monitor.actions.checkpoint_activations import CheckpointActivations
from edo_monitor.actions.compress_embedding import CompressEmbedding
from edo_monitor.actions.offload_embedding import OffloadEmbedding
from edo_monitor.actions.release_cache import ReleaseCache
from edo_monitor.actions.share_embedding import ShareEmbedding
from edo_monitor.actions.spill_embedding import SpillEmbedding
from edo_monitor.decide.plans import DEFAULT_LOSSLESS_LADDER, DEFAULT_LOSSY_LADDER

__all__ = ["ACTIONS", "DEFAULT_LOSSLESS_LADDER", "DEFAULT_LOSSY_LADDER", "LOSSY_ACTIONS"]

ACTIONS: dict[str, Action] = {
    a.name: a
    for a in (
        ReleaseCache(),
        CacheEmbedding(),
        GrowCache(),
        OffloadEmbedding(),
        CheckpointActivations(),
        CompressEmbedding("auto"),
        CompressEmbedding("bf16"),
        CompressEmbedding("fp16"),
        CompressEmbedding("int8"),
        CompressEmbedding("lowrank"),
        CompressEmbedding("int4"),
        CompressEmbedding("int2"),
        CompressEmbedding("2of8"),
        CompressEmbedding("perrow"),
        ShareEmbedding(),
        SpillEmbedding(),
    )
}
"""Every action by name (``release_cache``, ``cache_embedding``, ``grow_cache`` (asked for by the
policy when memory is free again, not on a ladder), ``offload_embedding``,
``checkpoint_activations``,
``compress_embedding`` (bf16 trainable / int8 frozen), ``compress_embedding_bf16``,
``compress_embedding_fp16``, ``compress_embedding_int8``, ``compress_embedding_lowrank``,
``compress_embedding_int4``, ``compress_embedding_int2``, ``compress_embedding_2of8``,
``compress_embedding_perrow`` (frozen, group-wise low-bit; see ``compress_embedding``),
``share_embedding`` (hot/cold hybrid), ``spill_embedding`` (the row cache over the disk
tier, when the host is short))."""

LOSSY_ACTIONS: frozenset[str] = frozenset(n for n, a in ACTIONS.items() if a.lossy)
