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
@pytest.mark.parametrize("cast", ["double", "half", "to_bfloat16", "float"])
def test_a_cast_model_runs_with_its_compressed_table_in_the_new_dtype(kind: str, cast: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_table(kind, torch.randn(N, D) * 1e-6), nn.Linear(D, 2))
    ids = torch.tensor([[1, 3, 5, 7]])
    before = model[0](ids)
    stored = {name: t.dtype for name, t in model[0].state_dict().items()}
    dtype = {
        "double": torch.float64,
        "half": torch.float16,
        "to_bfloat16": torch.bfloat16,
        "float": torch.float32,  # the model's own dtype: the bf16 weight was cast to it
    }[cast]
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


def test_a_bf16_table_trains_on_under_adam_after_float_of_a_float32_model() -> None:
    """``.float()`` of a float32 model cast the bf16 weight to float32 (the saving gone) while
    Adam's state stayed bf16: the next step failed ("expected dtype c10::BFloat16")."""
    torch.manual_seed(0)
    model = nn.Sequential(_table("bf16", torch.randn(N, D)), nn.Linear(D, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for cast in (False, True):
        if cast:
            model.float()
        model(torch.tensor([[1, 3, 5]])).sum().backward()
        opt.step()
        opt.zero_grad()
    assert model[0].weight.dtype == torch.bfloat16
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["int8", "int4", "per-row"])
@pytest.mark.parametrize("strict", [True, False])
def test_the_uncompressed_state_dict_does_not_load_into_codes(kind: str, strict: bool) -> None:
    """Regression: int8's codes are its ``weight`` buffer, the key of the table before it was
    compressed: ``load_state_dict`` of that checkpoint cast the float rows into the codes
    (truncated: the table garbage) and only then raised about the missing ``row_scale`` (with
    ``strict=False``, silently). The load now raises naming the dtypes, strict or not, and the
    table reads as before; the compressed table's own state dict still loads. Every form with
    integer codes is held to it (the low-bit ``codes`` under a float tensor of that name)."""
    torch.manual_seed(0)
    table = _table(kind, torch.randn(N, D))
    model = nn.Sequential(table)
    ids = torch.arange(N)
    before = table(ids)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    codes = next(k for k, v in own.items() if not v.is_floating_point() and v.dim() == 2)
    plain = {**own, codes: torch.randn(own[codes].shape)}
    if kind == "int8":
        plain = nn.Sequential(nn.Embedding(N, D)).state_dict()  # the table before compression
    with pytest.raises(RuntimeError, match=rf"0\.{codes[2:]}: .* stores torch\.\w+ codes there"):
        model.load_state_dict(plain, strict=strict)
    assert torch.equal(table(ids), before)
    model.load_state_dict(own)
    assert torch.equal(table(ids), before)
