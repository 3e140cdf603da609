"""The Adam catch-up of rows that missed steps, against replaying the steps one by one.

Rows caught up at once from their own steps to ``t`` must equal the same rows stepped with a zero
gradient at every missed step (the fused step follows ``torch.optim.Adam`` term by term, checked
against a resident twin in tests/test_cached.py). The second moments span ``eps`` from far below to
far above; the rows' steps cover the series with few and many terms and the exact form (rows from
the first steps), rows with no first moment lead and sit among the others, and there are more rows
than one piece of the sum holds, in no particular order of steps. The series' moments come from
the rule's tables, or from its ring (made at the first catch-up, kept as steps pass): both are
checked, the ring also when it is too small to keep every step's group.
"""

from __future__ import annotations

import pytest
import torch

from edo_monitor.nn.cache_step import fused_update
from edo_monitor.nn.catch_up import _CHUNK_ELEMENTS, _AdamRule

T = 300
_S0 = torch.zeros(1, dtype=torch.int64)


def _lr(k: int) -> float:
    return 1e-3 * 0.995**k  # a schedule: every step's own learning rate matters


CASES = [(False, (0.9, 0.999)), (True, (0.9, 0.999)), (False, (0.5, 0.0)), (False, (0.0, 0.99))]


def _case(
    amsgrad: bool,
    betas: tuple[float, float],
    dtype: torch.dtype,
    ring: int | None = None,
    weight_decay: float = 0.0,
) -> tuple:
    """A rule after ``T`` steps and rows ``(p, state, s)`` of ``dtype`` to catch up to ``T``;
    ``ring``: a first catch-up at step 3 makes the rule's ring of moments, of ``ring`` groups;
    ``weight_decay``: decoupled (AdamW)."""
    gen = torch.Generator().manual_seed(0)
    rows, dim = 5000, 64
    assert rows * dim * 8 > _CHUNK_ELEMENTS  # several pieces
    group = {"lr": 1e-3, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay}
    group["amsgrad"] = amsgrad
    rule = _AdamRule(group, 0)
    if ring is not None:
        rule._ring_capacity = ring
    for k in range(1, T + 1):
        rule.record(_lr(k))
        if k == 3 and ring is not None:  # makes the ring: it keeps the groups from step 3 on
            one = torch.ones(1, dim, dtype=dtype)
            rule.catch_up_rows(one.clone(), {key: one.clone() for key in rule.keys}, _S0, k)
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
    s[:100] = 0  # beyond float32's 181-step window (float64's: 373)
    s[100:110] = 1  # the bias correction spreads their scales beyond the series' reach
    m[110:120] = 0  # no first moment, among rows that have one
    p = p.to(dtype)
    return rule, group, p, {k: v.to(dtype) for k, v in state.items()}, s


def _replayed(group: dict, p: torch.Tensor, state: dict, s: torch.Tensor) -> tuple:
    """The rows stepped with a zero gradient at every step they missed, in float64."""
    want_p = p.to(torch.float64, copy=True)
    want = {k: v.to(torch.float64, copy=True) for k, v in state.items()}
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
    return want_p, want


@pytest.mark.parametrize(("amsgrad", "betas"), CASES)
def test_adam_catch_up_equals_the_missed_steps_replayed(
    amsgrad: bool, betas: tuple[float, float]
) -> None:
    """Betas of 0 included: ``beta2 = 0`` divided by zero when the rule was made."""
    rule, group, p, state, s = _case(amsgrad, betas, torch.float64)
    got_p = p.clone()
    got = {k: v.clone() for k, v in state.items()}
    rule.catch_up(got_p, got, s, T)
    want_p, want = _replayed(group, p, state, s)
    moved = want_p - p
    err = (got_p - want_p).abs().max() / moved.abs().max().clamp(min=1e-300)  # beta1 = 0: none
    assert float(err) <= 1e-12
    for key in state:
        assert torch.allclose(got[key], want[key], rtol=1e-12, atol=0)


@pytest.mark.parametrize("ring", [1 << 14, 200])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_kept_moments_equal_the_tables(
    ring: int, weight_decay: float, dtype: torch.dtype
) -> None:
    """A catch-up whose moments come from the ring (made at step 3 from the tables, kept step by
    step since; of 200 groups in float32, float64's its window of 287: the older ones from
    tables, slots reused) equals the replayed steps as the tables' does: float64 within 1e-12 of
    the rows' movement, float32 within their own rounding (half an ulp; three with decoupled
    decay, whose factor is rounded to float32 and multiplied in first). The rows come in two
    catch-ups: the second takes the exact form's tables the first kept (complete windows; the
    others' are made and padded to the window)."""
    rule, group, p, state, s = _case(False, (0.9, 0.999), dtype, ring, weight_decay)
    assert dtype in rule._rings  # the sums below read it
    got_p = p.clone()
    got = {k: v.clone() for k, v in state.items()}
    for part in (slice(0, 2500), slice(2500, None)):
        sub = {k: v[part] for k, v in got.items()}
        rule.catch_up_rows(got_p[part], sub, s[part], T)
    if ring > T and rule.windows[dtype] < T:  # complete windows (float32's: 181 < T)
        assert rule._complete_tables[rule.windows[dtype]]  # the exact form's tables were kept
    want_p, want = _replayed(group, p, state, s)
    moved = (want_p - p.double()).abs()
    if dtype == torch.float64:
        assert float((got_p - want_p).abs().max() / moved.max()) <= 1e-12
    else:
        allowed = want_p.abs() * (3 if weight_decay else 1) * 2.0**-24 + 1e-6 * moved
        assert bool(((got_p.double() - want_p).abs() <= allowed).all())
    for key in state:
        assert torch.allclose(
            got[key].double(), want[key], rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0
        )


@pytest.mark.parametrize(("amsgrad", "betas"), CASES)
def test_float32_rows_are_caught_up_to_their_own_rounding(
    amsgrad: bool, betas: tuple[float, float]
) -> None:
    """Float32 rows are caught up in float32: each within one float32 rounding of the value
    (half an ulp) plus 1e-6 of how far the missed steps move it."""
    rule, group, p, state, s = _case(amsgrad, betas, torch.float32)
    got_p = p.clone()
    got = {k: v.clone() for k, v in state.items()}
    rule.catch_up_rows(got_p, got, s, T)
    assert got_p.dtype == torch.float32
    want_p, want = _replayed(group, p, state, s)
    moved = (want_p - p.double()).abs()
    allowed = want_p.abs() * 2.0**-24 + 1e-6 * moved
    assert bool(((got_p.double() - want_p).abs() <= allowed).all())
    for key in state:
        tiny = torch.finfo(torch.float32).tiny  # below it float32 keeps fewer digits (beta 0.5)
        assert torch.allclose(got[key].double(), want[key], rtol=1e-6, atol=tiny)


def test_float64_rows_sum_every_step_float64_holds_when_the_learning_rate_rises() -> None:
    """Rows away for 390-450 steps while the learning rate rises 1000x at step 200: the
    float64 window sums the missed steps until the whole rest is below half an ulp (373 steps
    at the default betas). Cut at 1e-13 of the first term (286 steps) the rows were 5.2e-11 of
    their movement off the replayed steps (a helper's find: Adam's dynamics amplified that past
    1e-12 of a resident twin in training)."""
    steps = 450

    def lr(k: int) -> float:
        return 1e-6 if k <= 200 else 1e-3

    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    group["amsgrad"] = False
    rule = _AdamRule(group, 0)
    for k in range(1, steps + 1):
        rule.record(lr(k))
    assert rule.windows[torch.float64] == 373
    gen = torch.Generator().manual_seed(0)
    rows, dim = 400, 16
    p = torch.randn(rows, dim, dtype=torch.float64, generator=gen) * 1e-3
    m = torch.randn(rows, dim, dtype=torch.float64, generator=gen) * 1e-6
    exponent = torch.empty(rows, dim, dtype=torch.float64).uniform_(-12, -4, generator=gen)
    state = {"exp_avg": m, "exp_avg_sq": (10**exponent) ** 2}
    s = torch.randint(0, 60, (rows,), generator=gen).sort().values
    got_p, got = p.clone(), {k: v.clone() for k, v in state.items()}
    rule.catch_up(got_p, got, s, steps)
    want_p, want = p.clone(), {k: v.clone() for k, v in state.items()}
    for k in range(1, steps + 1):
        idx = (s < k).nonzero().reshape(-1)
        sub_p, sub = want_p[idx], {key: val[idx] for key, val in want.items()}
        fused_update("adam", {**group, "lr": lr(k)}, sub_p, torch.zeros_like(sub_p), sub, k)
        want_p[idx] = sub_p
        for key, val in sub.items():
            want[key][idx] = val
    assert float((got_p - want_p).abs().max() / (want_p - p).abs().max()) <= 1e-12


@pytest.mark.parametrize("eps", [1e-8, 0.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_summing_every_row_as_on_a_device_equals_skipping_the_still_ones(
    dtype: torch.dtype, eps: float
) -> None:
    """On a device the catch-up does not read back which rows have no first moment (it would
    wait for the device): it sums every row and masks those. The rows come out as the host's
    path, which skips the leading still rows, gives them (the Horner sums may take a term more
    for some rows: within the dtype's rounding of what the rows move); the still rows only
    decay, also where their sum is 0 / 0 (``eps = 0`` and no second moment)."""
    rule, _, p, state, s = _case(False, (0.9, 0.999), dtype, weight_decay=0.1)
    rule.eps = eps
    state["exp_avg_sq"][:5] = 0  # still rows (no first moment) without a second one either
    state["exp_avg_sq"][110:112] = 0
    still = state["exp_avg"].abs().amax(1) == 0
    assert int(still.sum()) == 60  # rows 0-49 (the oldest: skipped on the host) and 110-119
    results = []
    for skip in (None, False):
        rule.skip_still_rows = skip
        got_p, got = p.clone(), {k: v.clone() for k, v in state.items()}
        rule.catch_up(got_p, got, s, T)
        results.append((got_p, got))
    (host_p, host), (device_p, device) = results
    assert bool(torch.isfinite(device_p[still]).all())
    assert torch.equal(device_p[still], host_p[still])
    # eps = 0: rows with a first moment and a zero second one divide by zero, as Adam does
    finite = torch.isfinite(host_p).all(1)
    assert torch.equal(torch.isfinite(device_p).all(1), finite)
    assert int(finite.sum()) == (4990 if eps == 0 else 5000)
    moved = (host_p[finite].double() - p[finite].double()).abs().max()
    diff = (device_p[finite].double() - host_p[finite].double()).abs().max()
    assert float(diff / moved) <= 4 * torch.finfo(dtype).eps
    for key in state:
        assert torch.equal(device[key], host[key])  # the moments only decay: the same product
