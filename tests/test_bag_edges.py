"""Bag batches at the edge of nn.EmbeddingBag's rules, through each of the edo tables' three bag
lookups: the tables that compute their rows (int8 stands for them: ``_lookup_from_rows``), the
tables that hold theirs (offloaded: ``_functional_lookup``) and the row cache (``_combine``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.nn import (
    CachedEmbeddingBag,
    EmbeddingOptions,
    Int8RowwiseEmbedding,
    OffloadedEmbedding,
)

N, D, PAD = 20, 4, 3
KINDS = ["int8", "offloaded", "cached"]


def _pair(kind: str, mode: str, pad: int | None, ilo: bool) -> tuple[nn.Module, nn.EmbeddingBag]:
    """An edo bag table of ``kind`` and nn.EmbeddingBag over the same rows."""
    torch.manual_seed(0)
    options = EmbeddingOptions(N, D, padding_idx=pad, bag_mode=mode, include_last_offset=ilo)
    weight = torch.randn(N, D)
    if kind == "int8":
        table: nn.Module = Int8RowwiseEmbedding(weight, options)
        weight = table.dequantized()
    elif kind == "offloaded":
        table = OffloadedEmbedding(nn.Parameter(weight.clone()), options, "cpu")
    else:
        table = CachedEmbeddingBag.from_pretrained(
            weight, 8, mode=mode, padding_idx=pad, include_last_offset=ilo
        )
    reference = nn.EmbeddingBag.from_pretrained(
        weight, mode=mode, padding_idx=pad, include_last_offset=ilo
    )
    return table, reference


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pad", [None, PAD])
@pytest.mark.parametrize("ilo", [False, True])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_batch_of_no_bags_over_some_ids_gives_no_rows(
    mode: str, ilo: bool, pad: int | None, kind: str
) -> None:
    """Ids with no bag to go in (offsets empty, or only the closing offset): ``(0, D)``, as
    nn.EmbeddingBag's sum and mean bags give (its max and padded bags crash the process)."""
    table, _ = _pair(kind, mode, pad, ilo)
    ids, offsets = torch.tensor([1, 2, 5]), torch.tensor([0] if ilo else [], dtype=torch.int64)
    out = table(ids, offsets)
    assert out.shape == (0, D)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_ids_after_the_closing_offset_are_left_out_as_nn_embedding_bag_does(
    mode: str, kind: str
) -> None:
    table, reference = _pair(kind, mode, None, True)
    ids, offsets = torch.tensor([1, 2, 4, 5, 6, 9]), torch.tensor([0, 2, 4])
    expected = reference(ids, offsets)
    assert torch.allclose(table(ids, offsets), expected, rtol=0, atol=1e-6)
    if mode == "sum":  # the bags [1, 2] and [4, 5]; 6 and 9 in none
        assert torch.equal(expected, reference.weight[[1, 4]] + reference.weight[[2, 5]])


def test_decreasing_offsets_are_refused_as_nn_embedding_bag_refuses_them() -> None:
    table, reference = _pair("int8", "sum", None, False)
    ids, offsets = torch.tensor([1, 2, 4, 5, 6, 9]), torch.tensor([0, 4, 2])
    with pytest.raises(RuntimeError) as expected:
        reference(ids, offsets)
    with pytest.raises(RuntimeError) as got:
        table(ids, offsets)
    assert str(got.value) == str(expected.value)
