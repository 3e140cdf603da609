"""The EDO tables' arguments checked where they are given, each named with what is allowed (a bad
one was accepted, then failed inside torch at the first lookup or gave the wrong rows)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.nn import (
    EmbeddingOptions,
    HashedEmbedding,
    Int8RowwiseEmbedding,
    LowPrecisionEmbedding,
    LowRankEmbedding,
)
from edo_monitor.nn.lowbit import GroupwiseEmbedding

N, D = 20, 8


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"max_norm": True}, "max_norm=True; expected a number > 0 or None"),
        ({"norm_type": "x"}, "norm_type='x'; expected a number"),
        ({"sparse": "yes"}, "sparse='yes'; expected True or False"),
        ({"scale_grad_by_freq": 1}, "scale_grad_by_freq=1; expected True or False"),
        ({"include_last_offset": True}, "include_last_offset=True needs a bag_mode"),
    ],
)
def test_options_of_the_wrong_kind_are_refused(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EmbeddingOptions(N, D, **given)


def test_a_padding_row_of_the_wrong_shape_is_refused_where_it_is_given() -> None:
    options = EmbeddingOptions(N, D, padding_idx=2)
    with pytest.raises(ValueError, match=r"padding_row has shape \(10,\); expected \(8,\)"):
        HashedEmbedding(options, 4, padding_row=torch.ones(10))
    left, right = nn.Parameter(torch.randn(N, 2)), nn.Parameter(torch.randn(2, D))
    with pytest.raises(ValueError, match=r"padding_row has shape \(10,\); expected \(8,\)"):
        LowRankEmbedding(left, right, options, torch.ones(10))


def test_a_low_rank_table_with_padding_and_no_padding_row_reads_zeros_there() -> None:
    """As nn.Embedding starts its padding row; the factors' product was read (and trained)."""
    torch.manual_seed(0)
    left, right = nn.Parameter(torch.randn(N, 2)), nn.Parameter(torch.randn(2, D))
    table = LowRankEmbedding(left, right, EmbeddingOptions(N, D, padding_idx=2))
    rows = table(torch.tensor([2, 3]))
    assert torch.equal(rows[0], torch.zeros(D))
    assert torch.allclose(rows[1], left[3] @ right)


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
def test_an_output_dtype_that_is_not_floating_point_is_refused(kind: str) -> None:
    weight, options = torch.randn(N, D), EmbeddingOptions(N, D)
    with pytest.raises(ValueError, match=r"output_dtype=torch\.int64; expected a floating-point"):
        if kind == "int8":
            Int8RowwiseEmbedding(weight, options, torch.int64)
        elif kind == "int4":
            GroupwiseEmbedding(weight, options, 4, 8, torch.int64)
        else:
            LowPrecisionEmbedding(nn.Parameter(weight.bfloat16()), options, torch.int64)
