"""A table holding a value that is not finite (NaN, inf) is refused by every compressed form, by
name and row, and by the compression actions' plans; the error measure shows it."""

from __future__ import annotations

import pytest
import torch
from action_helpers import ctx_of, make

from edo_monitor.actions import ACTIONS
from edo_monitor.actions.base import Action, ActionContext
from edo_monitor.decide.plans import Plan, Refusal
from edo_monitor.nn import EmbeddingOptions, LowRankEmbedding, row_error
from edo_monitor.nn.compressed import quantize_int8_rowwise
from edo_monitor.nn.lowbit import (
    GroupwiseEmbedding,
    PerRowPrecisionEmbedding,
    quantize_groupwise,
    sparsify_2of8,
)

N, D, ROW = 6, 16, 2

FORMS = {
    "int8": lambda w: quantize_int8_rowwise(w),
    "int4": lambda w: quantize_groupwise(w, 4, 8),
    "int2": lambda w: quantize_groupwise(w, 2, 8),
    "2of8": lambda w: sparsify_2of8(w, 8),
    "int4 module": lambda w: GroupwiseEmbedding(w, EmbeddingOptions(N, D), 4, 8),
    # row 0 kept whole: the bad row is the low-bit part's second, still named as row 2
    "per-row": lambda w: PerRowPrecisionEmbedding(w, torch.tensor([0]), EmbeddingOptions(N, D)),
    "low rank": lambda w: LowRankEmbedding.from_weight(
        w, 4, EmbeddingOptions(N, D), requires_grad=False
    ),
}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("form", FORMS)
def test_every_compressed_form_refuses_a_value_that_is_not_finite(form: str, bad: float) -> None:
    """int4 / int2 / 2:8 / per-row took a NaN and spread it over its group (2:8 into other
    columns), and low rank failed inside the SVD (LinAlgError)."""
    w = torch.randn(N, D)
    w[ROW, 5] = bad
    with pytest.raises(ValueError, match=rf"not finite \({bad} at row {ROW}\)"):
        FORMS[form](w)


@pytest.mark.parametrize(
    "action",
    [
        "compress_embedding_int8",
        "compress_embedding_int4",
        "compress_embedding_2of8",
        "compress_embedding_lowrank",
    ],
)
def test_a_compression_plan_refuses_a_table_holding_nan_by_its_row(action: str) -> None:
    """The int4 plan's expected error was NaN (ranked first among plans), its result's
    max_abs_error 0.0; the low-rank plan raised out of ``Action.apply``."""
    model, opt = make(frozen=True)
    with torch.no_grad():
        model.emb.weight[7, 3] = float("nan")
    table = model.emb
    result = ACTIONS[action].apply(ctx_of(model, opt))
    assert result.status == "refused"
    assert "not finite (nan at row 7)" in result.reason
    assert model.emb is table


@pytest.mark.parametrize(
    ("action", "dtype", "value", "reason"),
    [
        ("compress_embedding_fp16", torch.float32, float("nan"), "not finite (nan at row 7)"),
        ("compress_embedding_bf16", torch.float32, float("inf"), "not finite (inf at row 7)"),
        (
            "compress_embedding_fp16",
            torch.float32,
            -1e5,
            "beyond fp16's range (-100000 at row 7; its largest is 65504)",
        ),
        (
            "compress_embedding_bf16",
            torch.float64,
            1e39,
            "beyond bf16's range (1e+39 at row 7; its largest is 3.38953e+38)",
        ),
    ],
)
def test_a_16_bit_plan_refuses_a_value_the_dtype_cannot_hold(
    action: str, dtype: torch.dtype, value: float, reason: str
) -> None:
    """Regression: fp16 and bf16 converted a table holding NaN, inf or a finite value past their
    range (fp16: 1e5 became inf, the model's output with it) and reported an error of inf. One
    value in range just below fp16's largest is taken."""
    model, opt = make(frozen=True)
    model.to(dtype)
    with torch.no_grad():
        model.emb.weight[7, 3] = value
    table = model.emb
    result = ACTIONS[action].apply(ctx_of(model, opt))
    assert result.status == "refused" and reason in result.reason, result
    assert model.emb is table and model.emb.weight.dtype == dtype
    with torch.no_grad():
        model.emb.weight[7, 3] = 65504.0
    assert ACTIONS[action].apply(ctx_of(model, opt)).status == "applied"
    assert torch.isfinite(model.emb.weight).all()


def test_the_error_of_a_nan_row_is_nan_not_zero() -> None:
    reference = torch.zeros(4, 3)
    approx = reference.clone()
    approx[1, 2] = float("nan")
    error = row_error(reference, approx)
    assert error["max_abs_error"] != error["max_abs_error"]  # NaN


class _UnplannableAction(Action):
    """An action whose planning fails (as the low-rank plan's SVD did on a NaN table)."""

    name = "unplannable"

    def plan(self, ctx: ActionContext) -> Plan | Refusal:
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")


def test_an_action_whose_planning_fails_returns_failed_instead_of_raising() -> None:
    model, opt = make()
    result = _UnplannableAction().apply(ctx_of(model, opt))
    assert result.status == "failed"
    assert result.reason.endswith("LinAlgError: linalg.svd: The algorithm failed to converge")
