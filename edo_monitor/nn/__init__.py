"""Doing it, the modules: the EDO embedding tables actions swap in (host offload, device row cache,
low precision, int8 and low-bit, low rank, shared rows). Take a table's weight; hand on a module."""

from __future__ import annotations

from edo_monitor.nn.cache_parts import CACHE_POLICIES, CacheStats
from edo_monitor.nn.cached import CachedTable
from edo_monitor.nn.cached_modules import CachedEmbedding, CachedEmbeddingBag, attach_cached_tables
from edo_monitor.nn.compressed import (
    Int8RowwiseEmbedding,
    LowRankEmbedding,
    dequantize_int8_rowwise,
    quantize_int8_rowwise,
    row_error,
)
from edo_monitor.nn.embedding import (
    BAG_MODES,
    EmbeddingOptions,
    LowPrecisionEmbedding,
    OffloadedEmbedding,
)
from edo_monitor.nn.lookahead import LookAhead
from edo_monitor.nn.sharing import HashedEmbedding, HybridEmbedding, QREmbedding, hash_ids

__all__ = [
    "BAG_MODES",
    "CACHE_POLICIES",
    "CacheStats",
    "CachedEmbedding",
    "CachedEmbeddingBag",
    "CachedTable",
    "EmbeddingOptions",
    "HashedEmbedding",
    "HybridEmbedding",
    "Int8RowwiseEmbedding",
    "LookAhead",
    "LowPrecisionEmbedding",
    "LowRankEmbedding",
    "OffloadedEmbedding",
    "QREmbedding",
    "attach_cached_tables",
    "dequantize_int8_rowwise",
    "hash_ids",
    "quantize_int8_rowwise",
    "row_error",
]
