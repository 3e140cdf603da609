"""The Adam catch-up of rows that missed steps, against replaying the steps one by one.

Rows caught up at once from their own steps to ``t`` must equal the same rows stepped with a zero
gradient at every missed step (the fused step follows ``torch.optim.Adam`` term by term, checked
against a resident twin in tests/test_cached.py). The second moments span ``eps`` from far below to
far above; the rows' steps cover the series with few and many terms and the exact form (rows from
the first steps), rows with no first moment lead and sit among the others, and there are more rows
than one piece of the sum holds, in no particular order of steps.
"""

from __future__ import annotations

import pytest
import torch

from edo_monitor.nn.cache_step import fused_update
from edo_monitor.nn.catch_up import _CHUNK_ELEMENTS, _AdamRule

T = 300


def _lr(k: int) -> float:
    return 1e-3 * 0.995**k  # a schedule: every step's own learning rate matters


@pytest.mark.parametrize(
    ("amsgrad", "betas"),
    [(False, (0.9, 0.999)), (True, (0.9, 0.999)), (False, (0.5, 0.0)), (False, (0.0, 0.99))],
)
def test_adam_catch_up_equals_the_missed_steps_replayed(
    amsgrad: bool, betas: tuple[float, float]
) -> None:
    """Betas of 0 included: ``beta2 = 0`` divided by zero when the rule was made."""
    gen = torch.Generator().manual_seed(0)
    rows, dim = 5000, 64
    assert rows * dim * 8 > _CHUNK_ELEMENTS  # several pieces
    group = {"lr": 1e-3, "betas": betas, "eps": 1e-8, "weight_decay": 0.0}
    group["amsgrad"] = amsgrad
    rule = _AdamRule(group, 0)
    for k in range(1, T + 1):
        rule.record(_lr(k))
    p = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    m = torch.randn(rows, dim, generator=gen, dtype=torch.float64) * 1e-6
    m[:50] = 0  # rows that get no Adam update (their first moment is zero)
    exponent = torch.empty(rows, dim, dtype=torch.float64).uniform_(-12, -4, generator=gen)
    v = (10**exponent) ** 2  # sqrt(v) from 1e-12 to 1e-4: eps = 1e-8 in the middle
    v[60:70, :8] = 0
    state = {"exp_avg": m, "exp_avg_sq": v}
    if amsgrad:
        state["max_exp_avg_sq"] = v * 1.5
    s = torch.randint(0, T, (rows,), generator=gen)
    s[:100] = 0  # beyond the 286-step window
    s[100:110] = 1  # the bias correction spreads their scales beyond the series' reach
    m[110:120] = 0  # no first moment, among rows that have one

    got_p = p.clone()
    got = {k: v.clone() for k, v in state.items()}
    rule.catch_up(got_p, got, s, T)

    want_p = p.clone()
    want = {k: v.clone() for k, v in state.items()}
    for k in range(1, T + 1):
        idx = (s < k).nonzero().reshape(-1)
        if idx.numel() == 0:
            continue
        sub_p = want_p[idx]
        sub = {key: val[idx] for key, val in want.items()}
        fused_update("adam", {**group, "lr": _lr(k)}, sub_p, torch.zeros_like(sub_p), sub, k)
        want_p[idx] = sub_p
        for key, val in sub.items():
            want[key][idx] = val
    moved = want_p - p
    err = (got_p - want_p).abs().max() / moved.abs().max().clamp(min=1e-300)  # beta1 = 0: none
    assert float(err) <= 1e-12
    for key in state:
        assert torch.allclose(got[key], want[key], rtol=1e-12, atol=0)
