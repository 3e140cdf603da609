"""EDO embedding modules: same semantics as nn.Embedding / nn.EmbeddingBag (CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edo_monitor.measure.accounting import account, is_table_module
from edo_monitor.nn import (
    EmbeddingOptions,
    Int8RowwiseEmbedding,
    LowPrecisionEmbedding,
    LowRankEmbedding,
    OffloadedEmbedding,
    dequantize_int8_rowwise,
    quantize_int8_rowwise,
    row_error,
)

N, D, PAD = 50, 8, 3


def _bag_inputs() -> list[dict]:
    """1-D input with offsets (with a padding entry and an empty bag) and a 2-D input."""
    flat = torch.tensor([1, PAD, 7, 7, 49, 0, 12, PAD, PAD, 5])
    offsets = torch.tensor([0, 3, 3, 6])  # bag 1 is empty; bag 3 has only padding and 5
    psw = torch.linspace(0.5, 2.0, flat.numel())
    two_d = torch.tensor([[1, 2, PAD], [4, 4, 9]])
    return [
        {"input": flat, "offsets": offsets},
        {"input": flat, "offsets": offsets, "per_sample_weights": psw},
        {"input": two_d},
        {"input": flat, "offsets": torch.cat([offsets, torch.tensor([flat.numel()])]), "ilo": True},
    ]


def _reference(weight: torch.Tensor, mode: str | None, pad: int | None, ilo: bool = False):
    if mode is None:
        return nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=pad)
    return nn.EmbeddingBag.from_pretrained(
        weight.clone(), freeze=False, mode=mode, padding_idx=pad, include_last_offset=ilo
    )


def _call(module: nn.Module, case: dict) -> torch.Tensor:
    kwargs = {k: v for k, v in case.items() if k in ("offsets", "per_sample_weights")}
    return module(case["input"], **kwargs)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("pad", [None, PAD])
def test_offloaded_bag_matches_embedding_bag_outputs_and_grads(mode: str, pad: int | None) -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D)
    for case in _bag_inputs():
        if "per_sample_weights" in case and mode != "sum":
            continue
        ilo = bool(case.get("ilo"))
        ref = _reference(base, mode, pad, ilo)
        src = _reference(base, mode, pad, ilo)
        weight = src.weight
        off = OffloadedEmbedding(weight, EmbeddingOptions.from_module(src), "cpu")
        OffloadedEmbedding.offload_parameter(weight)
        assert off.weight is weight and weight._edo_host is True
        out_ref, out = _call(ref, case), _call(off, case)
        assert out.shape == out_ref.shape
        assert torch.equal(out, out_ref)
        out_ref.pow(2).sum().backward()
        out.pow(2).sum().backward()
        assert torch.equal(weight.grad, ref.weight.grad)
        if pad is not None:
            assert torch.count_nonzero(weight.grad[pad]) == 0


def test_offloaded_embedding_preserves_options_and_padding() -> None:
    torch.manual_seed(0)
    ref = nn.Embedding(N, D, padding_idx=PAD, max_norm=1.0, scale_grad_by_freq=True)
    src = nn.Embedding(N, D, padding_idx=PAD, max_norm=1.0, scale_grad_by_freq=True)
    src.load_state_dict(ref.state_dict())
    off = OffloadedEmbedding(src.weight, EmbeddingOptions.from_module(src), "cpu")
    x = torch.tensor([[1, 1, PAD], [4, 9, 1]])
    out_ref, out = ref(x), off(x)
    assert torch.equal(out, out_ref)
    assert torch.equal(src.weight, ref.weight)  # max_norm renormalised the same rows in place
    out_ref.sum().backward()
    out.sum().backward()
    assert torch.equal(src.weight.grad, ref.weight.grad)
    assert off.edo_placement == "host" and is_table_module(off)
    assert (off.num_embeddings, off.embedding_dim, off.padding_idx) == (N, D, PAD)


def test_offloaded_param_counts_as_host_tier_in_accounting() -> None:
    model = nn.Sequential(nn.Embedding(N, D), nn.Linear(D, 2))
    weight = model[0].weight
    before = account(model).params_bytes
    model[0] = OffloadedEmbedding(weight, EmbeddingOptions.from_module(model[0]), "cpu")
    OffloadedEmbedding.offload_parameter(weight)
    acc = account(model)
    assert acc.params_bytes == before - N * D * 4
    assert acc.host_bytes == N * D * 4
    assert acc.tables[0].placement == "host"


@pytest.mark.parametrize("mode", [None, "sum", "mean", "max"])
def test_low_precision_matches_reference_in_bf16(mode: str | None) -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D)
    base[PAD] = 0
    src = _reference(base, mode, PAD)
    opts = EmbeddingOptions.from_module(src)
    src.weight.data = src.weight.data.to(torch.bfloat16)
    low = LowPrecisionEmbedding(src.weight, opts, torch.float32)
    ref = _reference(base.to(torch.bfloat16).float(), mode, PAD)
    cases = [{"input": torch.tensor([[1, PAD, 4], [7, 8, 9]])}] if mode is None else _bag_inputs()
    for case in cases:
        if "per_sample_weights" in case and mode != "sum":
            continue
        if case.get("ilo"):
            continue
        out = _call(low, case)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, _call(ref, case), rtol=1e-2, atol=1e-2)
    out.sum().backward()
    assert low.weight.grad is not None and low.weight.grad.dtype == torch.bfloat16


def test_int8_quantization_error_is_at_most_half_a_step_per_row() -> None:
    torch.manual_seed(0)
    w = torch.randn(N, D) * torch.linspace(0.01, 10, N).unsqueeze(1)
    w[PAD] = 0
    q, scale = quantize_int8_rowwise(w)
    assert q.dtype == torch.int8 and scale.shape == (N,)
    deq = dequantize_int8_rowwise(q, scale)
    assert torch.all((deq - w).abs() <= scale.unsqueeze(1) / 2 + 1e-6)
    assert torch.equal(deq[PAD], torch.zeros(D))


@pytest.mark.parametrize("mode", [None, "sum", "mean", "max"])
def test_int8_module_matches_reference_on_dequantized_weight(mode: str | None) -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D)
    base[PAD] = torch.arange(D) * 0.123  # a non-zero padding row must stay exact
    src = _reference(base, mode, PAD)
    q = Int8RowwiseEmbedding(base, EmbeddingOptions.from_module(src))
    deq = q.dequantized()
    assert torch.equal(deq[PAD], base[PAD])
    ref = _reference(deq, mode, PAD)
    cases = [{"input": torch.tensor([[1, PAD, 4], [7, 8, 49]])}] if mode is None else _bag_inputs()
    for case in cases:
        if "per_sample_weights" in case and mode != "sum":
            continue
        if case.get("ilo"):
            continue
        torch.testing.assert_close(_call(q, case), _call(ref, case), rtol=1e-6, atol=1e-6)
    assert q.weight.dtype == torch.int8 and q.row_scale.shape == (N,)
    assert list(dict(q.named_parameters())) == []
    assert row_error(base, deq)["mean_row_cosine"] > 0.999


def test_int8_refuses_max_norm() -> None:
    src = nn.Embedding(N, D, max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        Int8RowwiseEmbedding(src.weight, EmbeddingOptions.from_module(src))


@pytest.mark.parametrize("mode", [None, "sum", "mean", "max"])
def test_low_rank_full_rank_reconstructs_and_gradients_flow(mode: str | None) -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D)
    src = _reference(base, mode, PAD)
    lr = LowRankEmbedding.from_weight(
        base, D, EmbeddingOptions.from_module(src), requires_grad=True
    )
    torch.testing.assert_close(lr.reconstructed(), base, rtol=1e-4, atol=1e-4)
    assert torch.equal(lr.reconstructed()[PAD], base[PAD])
    ref = _reference(lr.reconstructed(), mode, PAD)
    cases = [{"input": torch.tensor([[1, PAD, 4], [7, 8, 49]])}] if mode is None else _bag_inputs()
    out = None
    for case in cases:
        if "per_sample_weights" in case and mode != "sum":
            continue
        if case.get("ilo"):
            continue
        out = _call(lr, case)
        torch.testing.assert_close(out, _call(ref, case), rtol=1e-5, atol=1e-5)
    assert out is not None
    out.sum().backward()
    assert lr.left.grad is not None and lr.right.grad is not None
    assert torch.count_nonzero(lr.left.grad[PAD]) == 0


def test_low_rank_truncation_error_matches_svd() -> None:
    torch.manual_seed(0)
    base = torch.randn(N, D)
    opts = EmbeddingOptions(num_embeddings=N, embedding_dim=D)
    lr = LowRankEmbedding.from_weight(base, 2, opts, requires_grad=False)
    s = torch.linalg.svdvals(base)
    err = torch.linalg.matrix_norm(base - lr.reconstructed())
    torch.testing.assert_close(err, s[2:].norm(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="rank"):
        LowRankEmbedding.from_weight(base, D + 1, opts, requires_grad=False)


def test_row_error_values() -> None:
    ref = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    app = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 1.5]])
    err = row_error(ref, app)
    assert err["max_abs_error"] == pytest.approx(1.0)
    cos3 = (1 + 1.5) / (2**0.5 * (1 + 1.5**2) ** 0.5)
    assert err["min_row_cosine"] == pytest.approx(0.0)
    assert err["mean_row_cosine"] == pytest.approx((0 + 1 + cos3) / 3)
    assert row_error(ref, app, skip_rows=(0,))["min_row_cosine"] == pytest.approx(cos3)


def test_row_error_in_chunks_matches_the_whole_table_computation() -> None:
    """Regression: row_error made float64 copies of the whole table (about 8x its size)."""
    from edo_monitor.nn import row_error

    torch.manual_seed(3)
    ref = torch.randn(1_000, 16)
    ref[7] = 0.0
    app = ref.to(torch.bfloat16).float()
    app[9] = 0.0  # one zero row against a non-zero one: cosine 0
    whole = row_error(ref, app, skip_rows=(5,), chunk_rows=10_000)
    chunked = row_error(ref, app, skip_rows=(5,), chunk_rows=33)
    assert chunked["max_abs_error"] == whole["max_abs_error"]
    assert chunked["min_row_cosine"] == whole["min_row_cosine"] == 0.0
    assert chunked["mean_row_cosine"] == pytest.approx(whole["mean_row_cosine"], abs=1e-12)
    r, a = ref.double(), app.double()
    cos = (r * a).sum(1) / (r.norm(dim=1) * a.norm(dim=1))
    cos[7], cos[9] = 1.0, 0.0
    keep = torch.ones(1_000, dtype=torch.bool)
    keep[5] = False
    assert whole["mean_row_cosine"] == pytest.approx(float(cos[keep].mean()), abs=1e-12)
    assert whole["max_abs_error"] == pytest.approx(float((r - a).abs().max()))


def test_offloaded_module_reads_like_the_table_it_replaced() -> None:
    from edo_monitor.nn import EmbeddingOptions, OffloadedEmbedding

    bag = nn.EmbeddingBag(10, 4, mode="max", max_norm=1.5, sparse=True, padding_idx=2)
    off = OffloadedEmbedding(bag.weight, EmbeddingOptions.from_module(bag), "cpu")
    assert (off.max_norm, off.sparse, off.mode, off.padding_idx) == (1.5, True, "max", 2)
    assert off.norm_type == 2.0 and off.scale_grad_by_freq is False


def test_module_rows_hold_every_device_tier_byte_once_and_add_up_to_the_totals() -> None:
    """One walk gives both views: each row's device-tier bytes by category sum to the totals (an
    offloaded table's bytes are its row's host bytes; a BatchNorm's buffers are its own row's)."""
    model = nn.Sequential(nn.Embedding(N, D), nn.Linear(D, 2), nn.BatchNorm1d(2))
    weight = model[0].weight
    model[0] = OffloadedEmbedding(weight, EmbeddingOptions.from_module(model[0]), "cpu")
    OffloadedEmbedding.offload_parameter(weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    acc = account(model, [opt])
    rows = {r.module: r for r in acc.tables + acc.modules}
    table = N * D * 4
    offloaded = rows["0"]
    assert (offloaded.params_bytes, offloaded.grads_bytes, offloaded.host_bytes) == (
        0,
        0,
        3 * table,
    )
    lin = (D * 2 + 2) * 4
    assert (rows["1"].params_bytes, rows["1"].grads_bytes) == (lin, lin)
    assert rows["1"].optimizer_state_bytes == lin  # the momentum buffers
    # BatchNorm1d(2): weight and bias (grads and momentum too), running mean and var, and the
    # int64 num_batches_tracked
    bn = 2 * 2 * 4
    assert rows["2"].params_bytes == bn + 2 * 2 * 4 + 8
    for cat in ("params_bytes", "grads_bytes", "optimizer_state_bytes", "host_bytes"):
        assert getattr(acc, cat) == sum(getattr(r, cat) for r in rows.values())
    assert acc.params_bytes == lin + bn + 2 * 2 * 4 + 8
    assert acc.host_bytes == 3 * table


def test_int8_refuses_values_beyond_float32_instead_of_reading_back_nan() -> None:
    # regression: a float64 row with values near 1e300 was quantised in float32 and read back
    # as NaN, silently
    w = torch.tensor([[1e300, -2e300, 3e300], [1e-3, 2e-3, -3e-3]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^a value of magnitude 3e\+300 exceeds float32's range"):
        Int8RowwiseEmbedding(w, EmbeddingOptions(2, 3), output_dtype=torch.float64)
    fine = Int8RowwiseEmbedding(w[1:], EmbeddingOptions(1, 3), output_dtype=torch.float64)
    assert torch.allclose(fine(torch.tensor([0])), w[1:], rtol=0.01)
