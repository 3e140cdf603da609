"""``model.to(dtype)`` / ``.double()`` / ``.half()`` on a model holding a compressed table: the
table's results take the model's dtype (the next layer works) and its stored form stays as it
is (``embedding._StoredForm``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.nn import EmbeddingOptions, Int8RowwiseEmbedding, LowPrecisionEmbedding
from edo_monitor.nn.lowbit import GroupwiseEmbedding, PerRowPrecisionEmbedding

N, D = 40, 16


def _table(kind: str, weight: torch.Tensor) -> nn.Module:
    options = EmbeddingOptions(N, D)
    if kind == "int8":
        return Int8RowwiseEmbedding(weight, options)
    if kind == "int4":
        return GroupwiseEmbedding(weight, options, 4, 8)
    if kind == "per-row":
        return PerRowPrecisionEmbedding(weight, torch.tensor([3, 5]), options, 4, 8)
    return LowPrecisionEmbedding(nn.Parameter(weight.to(torch.bfloat16)), options, torch.float32)


@pytest.mark.parametrize("kind", ["int8", "int4", "per-row", "bf16"])
@pytest.mark.parametrize("cast", ["double", "half", "to_bfloat16"])
def test_a_cast_model_runs_with_its_compressed_table_in_the_new_dtype(kind: str, cast: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_table(kind, torch.randn(N, D) * 1e-6), nn.Linear(D, 2))
    ids = torch.tensor([[1, 3, 5, 7]])
    before = model[0](ids)
    stored = {name: t.dtype for name, t in model[0].state_dict().items()}
    dtype = {"double": torch.float64, "half": torch.float16, "to_bfloat16": torch.bfloat16}[cast]
    if cast == "to_bfloat16":
        model.to(torch.bfloat16)
    else:
        getattr(model, cast)()
    out = model[0](ids)
    assert out.dtype == dtype
    assert torch.equal(out, before.to(dtype))  # the same rows, rounded once
    assert {name: t.dtype for name, t in model[0].state_dict().items()} == stored
    assert model(ids).dtype == dtype  # the next layer takes it


def test_half_keeps_small_rows_of_an_int8_table() -> None:
    """A float32 row scale cast to float16 underflowed to 0: every row of a 1e-6 table read zero."""
    torch.manual_seed(0)
    model = nn.Sequential(Int8RowwiseEmbedding(torch.randn(N, D) * 1e-6, EmbeddingOptions(N, D)))
    model.half()
    assert model[0].row_scale.dtype == torch.float32
    assert bool((model[0](torch.arange(N)) != 0).any(dim=1).all())
