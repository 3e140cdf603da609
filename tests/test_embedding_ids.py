"""Every edo-monitor embedding table refuses the ids ``nn.Embedding`` refuses, with one message,
and the options and arguments it cannot honour, by name.

Tables that compute a row from an id (hashed, quotient-remainder, hybrid) returned a row for ids
outside ``[0, N)``, negative ones and floats; the others failed inside torch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from edo_monitor.nn import (
    CachedEmbedding,
    EmbeddingOptions,
    HashedEmbedding,
    HybridEmbedding,
    Int8RowwiseEmbedding,
    LowPrecisionEmbedding,
    LowRankEmbedding,
    OffloadedEmbedding,
    QREmbedding,
)
from edo_monitor.nn.lowbit import GroupwiseEmbedding

N, D = 10, 8


def _weight() -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(0))


TABLES: dict[str, Callable[[], nn.Module]] = {
    "hashed": lambda: HashedEmbedding(EmbeddingOptions(N, D), 4),
    "hashed_two": lambda: HashedEmbedding(EmbeddingOptions(N, D), 4, num_hashes=2),
    "qr": lambda: QREmbedding(EmbeddingOptions(N, D), num_remainders=4),
    "hybrid": lambda: HybridEmbedding(EmbeddingOptions(N, D), torch.tensor([0, 1]), 3),
    "int8": lambda: Int8RowwiseEmbedding(_weight(), EmbeddingOptions(N, D)),
    "lowrank": lambda: LowRankEmbedding.from_weight(
        _weight(), 2, EmbeddingOptions(N, D), requires_grad=True
    ),
    "int4": lambda: GroupwiseEmbedding(_weight(), EmbeddingOptions(N, D), 4, 8),
    "cached": lambda: CachedEmbedding(N, D, 4),
    "offloaded": lambda: OffloadedEmbedding(nn.Parameter(_weight()), EmbeddingOptions(N, D), "cpu"),
    "low_precision": lambda: LowPrecisionEmbedding(
        nn.Parameter(_weight().half()), EmbeddingOptions(N, D), torch.float32
    ),
}


@pytest.mark.parametrize("name", TABLES)
def test_bag_arguments_to_a_table_without_a_bag_mode_are_refused_by_name(name: str) -> None:
    """Regression: the tables other than the row cache returned a row per id ``(4, D)`` for
    ``table(ids, offsets)``, ignoring the offsets (``nn.Embedding`` takes none)."""
    table = TABLES[name]()
    ids = torch.tensor([1, 2, 3, 4])
    for kw in ({"offsets": torch.tensor([0, 2])}, {"per_sample_weights": torch.ones(4)}):
        (arg,) = kw
        with pytest.raises(TypeError, match=f"^{arg} given to a table without a bag mode"):
            table(ids, **kw)


@pytest.mark.parametrize("name", TABLES)
def test_ids_outside_the_table_and_non_integer_input_are_refused_by_name(name: str) -> None:
    table = TABLES[name]()
    assert table(torch.tensor([0, N - 1])).shape == (2, D)
    assert table(torch.tensor([0, N - 1], dtype=torch.int32)).shape == (2, D)
    for ids, seen in (
        (torch.tensor([3, N]), f"\\[3, {N}\\]"),
        (torch.tensor([-1, 2]), "\\[-1, 2\\]"),
    ):
        with pytest.raises(
            IndexError, match=f"^index out of range: ids must be in \\[0, {N}\\), got {seen}$"
        ):
            table(ids)
    for bad, kind in ((torch.tensor([1.7]), "torch.float32"), ([1, 2], "list")):
        with pytest.raises(
            TypeError, match=f"^input must be an integer tensor \\(int64/int32\\), got {kind}$"
        ):
            table(bad)


def test_options_a_computed_table_cannot_honour_are_refused_by_name() -> None:
    # regression: LowRankEmbedding ignored max_norm (a row of norm 11.8 where nn.Embedding gives
    # 0.1), scale_grad_by_freq (gradient 3 where nn.Embedding gives 1) and sparse (a dense
    # gradient)
    w = _weight()
    refused = [
        (EmbeddingOptions(N, D, max_norm=0.1), True, r"max_norm=0\.1"),
        (EmbeddingOptions(N, D, scale_grad_by_freq=True), True, "scale_grad_by_freq=True"),
        (EmbeddingOptions(N, D, sparse=True), False, "sparse=True"),
    ]
    for options, trainable, name in refused:
        with pytest.raises(ValueError, match=f"^LowRankEmbedding cannot honour {name} "):
            LowRankEmbedding.from_weight(w, 2, options, requires_grad=trainable)
    frozen = LowRankEmbedding.from_weight(
        w, 2, EmbeddingOptions(N, D, scale_grad_by_freq=True), requires_grad=False
    )  # no gradient: nothing to scale
    assert frozen(torch.tensor([1])).shape == (1, D)
    for make in (
        lambda o: Int8RowwiseEmbedding(w, o),
        lambda o: GroupwiseEmbedding(w, o, 4, 8),
        lambda o: HashedEmbedding(o, 4),
    ):
        with pytest.raises(ValueError, match=r"cannot honour max_norm=0\.1 "):
            make(EmbeddingOptions(N, D, max_norm=0.1))


def test_bad_options_and_cached_table_arguments_are_refused_by_name() -> None:
    # regression: each was accepted (and failed later, or lost data: a complex table's catch-up
    # dropped the imaginary part) or raised from inside torch
    refused: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: EmbeddingOptions(-1, 4), ValueError, r"^num_embeddings=-1; expected an int >= 1$"),
        (lambda: EmbeddingOptions(N, 4, padding_idx=N), ValueError, rf"^padding_idx={N}; "),
        (lambda: EmbeddingOptions(N, 4, bag_mode="median"), ValueError, r"^bag_mode='median'; "),
        (lambda: EmbeddingOptions(N, 4, max_norm=-1.0), ValueError, r"^max_norm=-1\.0; "),
        (lambda: CachedEmbedding(N, D, 4, padding_idx=1.5), ValueError, r"^padding_idx=1\.5; "),
        (
            lambda: CachedEmbedding(N, D, 4, _weight=torch.zeros(N, D, dtype=torch.int64)),
            ValueError,
            r"^_weight has dtype torch\.int64; expected a floating-point table$",
        ),
        (
            lambda: CachedEmbedding(N, D, 4, _weight=torch.zeros(N, D, dtype=torch.complex64)),
            ValueError,
            r"^_weight has dtype torch\.complex64; ",
        ),
        (
            lambda: CachedEmbedding(N, D, 4, dtype=torch.int64),
            ValueError,
            r"^dtype=torch\.int64; expected a floating-point dtype$",
        ),
        (
            lambda: CachedEmbedding(N, D, 4, _weight=[[0.0] * D] * N),
            TypeError,
            r"^_weight must be a tensor",
        ),
        (
            lambda: CachedEmbedding(N, D, 4, id_frequencies=torch.full((N,), -1)),
            ValueError,
            r"^id_frequencies must be counts: whole numbers >= 0$",
        ),
        (
            lambda: CachedEmbedding(N, D, 4, id_frequencies=torch.full((N,), 0.5)),
            ValueError,
            "counts",
        ),
        # hot ids 1.7, 2.2 were truncated to 1, 2; num_hashes=True was kept as True
        (
            lambda: HybridEmbedding(EmbeddingOptions(N, D), torch.tensor([1.7, 2.2]), 3),
            TypeError,
            r"^hot_ids must be integer ids, got torch\.float32$",
        ),
        (
            lambda: HashedEmbedding(EmbeddingOptions(N, D), 4, num_hashes=True),
            ValueError,
            r"^num_hashes=True; expected 1 or 2$",
        ),
        # an inf read back as a row of NaN
        (
            lambda: Int8RowwiseEmbedding(
                torch.ones(N, D).index_fill_(0, torch.tensor([3]), float("inf")),
                EmbeddingOptions(N, D),
            ),
            ValueError,
            r"^the table holds a value that is not finite \(inf at row 3\)",
        ),
    ]
    for make, error, message in refused:
        with pytest.raises(error, match=message):
            make()
    table = CachedEmbedding(N, D, np.int64(4), padding_idx=-1, id_frequencies=torch.arange(N * 1.0))
    assert (table.cache_rows, table.padding_idx) == (4, N - 1)  # NumPy's ints, and from the end


def test_a_table_weight_of_another_shape_or_kind_and_bad_sizes_are_refused_by_name() -> None:
    # regression: a weight that did not match the options failed at a lookup inside torch;
    # rank=2.5 raised "slice indices must be integers", rank=True was taken as 1, and
    # hash_ids(ids, 5.5) gave float buckets
    from edo_monitor.nn import OffloadedEmbedding, hash_ids

    options = EmbeddingOptions(N, D)
    wide = torch.randn(N, D + 1)
    for make in (
        lambda w: Int8RowwiseEmbedding(w, options),
        lambda w: GroupwiseEmbedding(w, options, 4, 8),
        lambda w: LowRankEmbedding.from_weight(w, 2, options, requires_grad=False),
        lambda w: OffloadedEmbedding(nn.Parameter(w, requires_grad=False), options, "cpu"),
    ):
        with pytest.raises(
            ValueError, match=rf"^weight has shape \({N}, {D + 1}\); expected \({N}, {D}\)$"
        ):
            make(wide)
        with pytest.raises(
            ValueError, match=r"^weight has dtype torch\.int64; expected a floating-point"
        ):
            make(torch.zeros(N, D, dtype=torch.int64))
    for rank in (2.5, True, 0, D + 1):
        with pytest.raises(ValueError, match=f"^rank={rank!r}; expected an int in \\[1, {D}\\]$"):
            LowRankEmbedding.from_weight(_weight(), rank, options, requires_grad=False)
    assert (
        LowRankEmbedding.from_weight(_weight(), np.int64(2), options, requires_grad=False).rank == 2
    )
    with pytest.raises(ValueError, match=r"^num_buckets=5\.5; expected an int >= 1$"):
        hash_ids(torch.tensor([1, 2]), 5.5)  # type: ignore[arg-type]
