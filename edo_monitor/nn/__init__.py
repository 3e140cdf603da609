"""EDO embedding modules (host offload, low precision, int8 row-wise, low rank)."""

from __future__ import annotations

from edo_monitor.nn.embedding import (
    BAG_MODES,
    EmbeddingOptions,
    Int8RowwiseEmbedding,
    LowPrecisionEmbedding,
    LowRankEmbedding,
    OffloadedEmbedding,
    dequantize_int8_rowwise,
    quantize_int8_rowwise,
    row_error,
)

__all__ = [
    "BAG_MODES",
    "EmbeddingOptions",
    "Int8RowwiseEmbedding",
    "LowPrecisionEmbedding",
    "LowRankEmbedding",
    "OffloadedEmbedding",
    "dequantize_int8_rowwise",
    "quantize_int8_rowwise",
    "row_error",
]
