"""Id lists given to the tables (hot ids, full-precision ids) are checked by one rule
(``table_checks.id_list``): floats and boolean masks are refused, not truncated or read as 0/1."""

from __future__ import annotations

import pytest
import torch

from edo_monitor.nn import EmbeddingOptions, HybridEmbedding
from edo_monitor.nn.lowbit import PerRowPrecisionEmbedding

N, D = 20, 8


def _make(kind: str, ids: object) -> torch.Tensor:
    weight, options = torch.randn(N, D), EmbeddingOptions(N, D)
    if kind == "hybrid":
        return HybridEmbedding.from_weight(weight, options, ids, 4).hot_ids
    return PerRowPrecisionEmbedding(weight, ids, options, 4, 8).full_ids


@pytest.mark.parametrize("kind", ["hybrid", "per-row"])
def test_float_ids_are_refused_not_truncated(kind: str) -> None:
    with pytest.raises(TypeError, match=r"must be integer ids, got torch\.float32"):
        _make(kind, torch.tensor([1.7]))


@pytest.mark.parametrize("kind", ["hybrid", "per-row"])
def test_a_boolean_mask_is_refused_with_the_way_to_pass_it(kind: str) -> None:
    mask = torch.zeros(N, dtype=torch.bool)
    mask[7] = True
    with pytest.raises(TypeError, match=r"a boolean mask: pass mask.nonzero\(\)"):
        _make(kind, mask)


@pytest.mark.parametrize("kind", ["hybrid", "per-row"])
def test_a_list_of_ids_is_taken_and_out_of_range_ids_named(kind: str) -> None:
    assert _make(kind, [7, 2]).tolist() == [2, 7]
    with pytest.raises(ValueError, match=rf"must lie in \[0, {N}\); got \[2, {N}\]"):
        _make(kind, [2, N])


@pytest.mark.parametrize("kind", ["hybrid", "per-row"])
@pytest.mark.parametrize("empty", [[], ()])
def test_an_empty_list_is_no_ids(kind: str, empty: object) -> None:
    """Regression: ``[]`` reads as a float32 tensor and was refused as "not integer ids"; it is
    no ids (an empty tensor of ints), as ``torch.zeros(0, dtype=torch.long)`` is."""
    got = _make(kind, empty)
    assert got.dtype == torch.long and got.numel() == 0
    assert torch.equal(got, _make(kind, torch.zeros(0, dtype=torch.long)))
