"""Expected errors of the lossy table actions, estimated at plan time (:attr:`Plan.expected_error`).

Every estimate is ``E[‖r̂ − r‖²] / E[‖r‖²]`` over the lookups' distribution (see
:class:`edo_monitor.decide.plans.Plan`): estimated from the table's counts when the
:class:`edo_monitor.measure.frequency.LookupCounter` has them (:class:`LookupDistribution`:
Good–Turing, so ids not counted yet get their share), else every row equally often; the
``padding_idx`` row left out (every action keeps it exact).

A plan runs under memory pressure, so an estimate never reads a whole large table: it reads a few
samples of at most :data:`PLAN_SAMPLE_ROWS` rows each, chosen by :func:`sample_lookups`. Where the
distribution has at most that many rows they are all read, each weighted by its probability (the
estimate is then exact, up to the modelling assumptions each function states); else a draw in
proportion to the probabilities, with a fixed seed, so the same table and counts give the same
estimate (the policy stays deterministic). Work and temporaries: the sampled rows in float64, a
few passes over ``(N,)`` host arrays (the counts, 1-byte masks) and arrays the size of the ids
counted so far; never a pass over the ``N × D`` table. On CUDA the sampled rows are gathered on
the device, from the thread that plans (the sampler's); unmeasured on a GPU.

* bf16 / fp16: :func:`edo_monitor.decide.plans.rounding_expected_error` (needs no rows).
* int8 row-wise: :func:`int8_rowwise_expected_error`.
* low rank: :func:`lowrank_expected_error`.
* hot/cold sharing: :func:`share_expected_error`.
* group-wise int4 / int2, 2:8 sparse int2, per-row precision: :func:`lowbit_expected_error`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from edo_monitor.nn.table_checks import check_finite

__all__ = [
    "GOOD_TURING_MAX_COUNT",
    "PLAN_SAMPLE_ROWS",
    "LookupDistribution",
    "LookupSample",
    "int8_rowwise_expected_error",
    "lowbit_expected_error",
    "lowrank_expected_error",
    "sample_lookups",
    "share_expected_error",
    "table_distribution",
]

logger = logging.getLogger(__name__)

#: Most rows one sample of a plan's error estimate reads. 4096 rows keep the sampling error of a
#: mean square near 1/sqrt(4096) ≈ 1.6 % (for rows whose squared norms vary about as much as their
#: mean); timings in docs/benchmarks.md.
PLAN_SAMPLE_ROWS = 4096
_SEED = 0


@dataclass(frozen=True)
class LookupSample:
    """Rows standing for the lookups' distribution (or the part of it outside some ids).

    Attributes:
        ids: ``(S,)`` int64 row ids (host).
        weights: ``(S,)`` float64 probabilities (host): a row's probability of being looked up
            when every row of its part is here, else its part's probability split evenly over
            the drawn rows (a draw in proportion to the probabilities). Weighted means over the
            sample estimate expectations over the lookups.
        mass: the probability that a lookup goes to an id that was not excluded (from the counts,
            exact; ``1`` with nothing excluded).
        exact: whether every row with a positive probability is here.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    mass: float
    exact: bool

    @property
    def empty(self) -> bool:
        """No row (e.g. every lookup goes to an excluded id)."""
        return self.ids.numel() == 0


#: Counts up to this get Good–Turing's adjusted count (:class:`LookupDistribution`); larger
#: counts are frequent enough to stand for themselves.
GOOD_TURING_MAX_COUNT = 5


@dataclass(frozen=True)
class LookupDistribution:
    """The probability that the next lookup of an ``n``-row table goes to each id.

    Counted ids have their own probabilities (``seen_ids``, ``seen_probs``); the ``n − M``
    uncounted ids share ``p0`` evenly. Without counts, ``M = 0`` and ``p0 = 1`` (every id equally
    likely). Build it with :meth:`from_counts` (or :func:`table_distribution`).

    Attributes:
        n: rows of the table.
        seen_ids: ``(M,)`` int64 ids with a count, ascending (host).
        seen_probs: ``(M,)`` float64, summing to ``1 − p0``.
        p0: probability of the uncounted ids together (0 when every id has a count).
        seen_mask: ``(n,)`` bool, ``True`` at ``seen_ids``; ``None`` when ``M = 0``.
    """

    n: int
    seen_ids: torch.Tensor
    seen_probs: torch.Tensor
    p0: float
    seen_mask: torch.Tensor | None = None

    @classmethod
    def uniform(cls, n: int) -> LookupDistribution:
        """Every id equally likely (no counts)."""
        return cls(n, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64), 1.0)

    def is_seen(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each of ``ids`` has a count (bool, ``ids``' shape)."""
        if self.seen_mask is None:
            return torch.zeros(ids.shape, dtype=torch.bool)
        return self.seen_mask[ids]

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> LookupDistribution:
        """Good–Turing's estimate from a sample of lookups (``counts`` ``(N,)`` int; all zero:
        :meth:`uniform`).

        Counts are a sample, and a small one early in a run: ids counted once stand for many ids
        with no count yet. The uncounted ids take ``p0 = N1 / n`` (``N_r`` ids counted ``r``
        times, ``n`` lookups); an id counted ``r ≤`` :data:`GOOD_TURING_MAX_COUNT` times weighs
        ``r* = (r + 1) N_(r+1) / N_r`` (``r`` itself where ``N_(r+1) = 0``), a more frequent one
        ``r``; the counted ids share ``1 − p0`` in proportion to those weights. Measured on
        Zipf(1.1) lookups over 4000 ids (tests/test_lossy_errors.py), the share of lookups
        outside the 200 most counted ids was estimated 0.289 / 0.249 against 0.264 / 0.249 true
        after 1280 / 10240 counted lookups, where the raw counts said 0.176 / 0.237.

        Work: two passes over the ``N`` counts (a mask, ``nonzero``); the rest is over the ``M``
        counted ids.
        """
        c = counts.detach().to("cpu", torch.long).reshape(-1)
        n = int(c.numel())
        mask = c > 0
        seen = torch.nonzero(mask).flatten()
        cs = c[seen]  # a live counter may have grown since the mask: its values are still >= 1
        total = int(cs.sum())
        if total <= 0:
            return cls.uniform(n)
        top = GOOD_TURING_MAX_COUNT
        nr = torch.bincount(cs.clamp(max=top + 2), minlength=top + 3).double()  # N_1..N_(top+1)
        p0 = min(1.0, float(nr[1]) / total) if seen.numel() < n else 0.0
        lut = torch.arange(top + 1, dtype=torch.float64)
        for r in range(1, top + 1):
            if nr[r] > 0 and nr[r + 1] > 0:
                lut[r] = (r + 1) * nr[r + 1] / nr[r]
        weights = torch.where(cs <= top, lut[cs.clamp(max=top)], cs.double())
        probs = weights * ((1.0 - p0) / float(weights.sum()))
        return cls(n, seen, probs, p0, mask)


def table_distribution(counter: object, table: str, n: int) -> LookupDistribution:
    """:meth:`LookupDistribution.from_counts` of ``counter``'s counts of ``table``; uniform
    without a counter, without counts for the table, or before its first counted lookup."""
    if counter is None or table not in counter.tables:  # type: ignore[attr-defined]
        return LookupDistribution.uniform(n)
    return LookupDistribution.from_counts(counter.counts(table))  # type: ignore[attr-defined]


def _unseen_ids(
    dist: LookupDistribution,
    excluded: torch.Tensor,
    blocked: torch.Tensor | None,
    k: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, int, bool]:
    """Up to ``k`` uncounted ids, not ``excluded`` (distinct ids; ``blocked`` their ``(n,)`` mask,
    ``None`` when there are none), drawn uniformly: ``(ids, how many such ids there are, whether
    ids holds them all)``."""
    n = dist.n

    def allowed(ids: torch.Tensor) -> torch.Tensor:
        keep = ~dist.is_seen(ids)
        return keep if blocked is None else keep & ~blocked[ids]

    count = n - int(dist.seen_ids.numel()) - int((~dist.is_seen(excluded)).sum())
    if count <= 0:
        return torch.zeros(0, dtype=torch.long), 0, True
    if count > k:  # rejection sampling: O(k) work while most ids are allowed
        draw = torch.randint(0, n, (2 * k,), generator=gen)
        draw = draw[allowed(draw)]
        if draw.numel() >= k:
            return draw[:k], count, False
    pool = torch.arange(n)
    pool = pool[allowed(pool)]
    if pool.numel() <= k:
        return pool, count, True
    return pool[torch.randint(0, pool.numel(), (k,), generator=gen)], count, False


def sample_lookups(
    dist: LookupDistribution,
    *,
    exclude: torch.Tensor | None = None,
    max_rows: int = PLAN_SAMPLE_ROWS,
    seed: int = _SEED,
) -> LookupSample:
    """Rows standing for ``dist``'s lookups, the ``exclude`` ids left out.

    Two parts, counted ids and uncounted ids, each of at most ``max_rows`` rows: all of the
    part's rows, each with its probability, when it has no more, else a seeded draw in proportion
    to the probabilities (weights: the part's probability split evenly).

    Args:
        dist: the lookups' distribution.
        exclude: ids left out (the padding row, hot ids), int64; ``None`` for none.
        max_rows: most rows of each part.
        seed: of the draws (same inputs, same sample).

    Returns:
        A :class:`LookupSample`; its ``mass`` is the probability of the ids not excluded.
    """
    gen = torch.Generator().manual_seed(seed)
    excluded = torch.zeros(0, dtype=torch.long)
    blocked = None
    if exclude is not None and exclude.numel():
        excluded = torch.unique(exclude.detach().to("cpu", torch.long).reshape(-1))
        blocked = torch.zeros(dist.n, dtype=torch.bool)
        blocked[excluded] = True
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    exact = True
    ids, probs = dist.seen_ids, dist.seen_probs
    if blocked is not None and ids.numel():
        keep = ~blocked[ids]
        ids, probs = ids[keep], probs[keep]
    seen_mass = float(probs.sum())
    if ids.numel() <= max_rows:
        parts.append((ids, probs))
    else:
        cdf = torch.cumsum(probs, 0)
        draws, _ = torch.sort(torch.rand(max_rows, generator=gen, dtype=torch.float64))
        at = torch.searchsorted(cdf, draws * float(cdf[-1]), right=True).clamp(max=ids.numel() - 1)
        parts.append((ids[at], torch.full((max_rows,), seen_mass / max_rows, dtype=torch.float64)))
        exact = False
    unseen_mass = 0.0
    uncounted = dist.n - int(dist.seen_ids.numel())
    if dist.p0 > 0 and uncounted > 0:
        uids, count, whole = _unseen_ids(dist, excluded, blocked, max_rows, gen)
        if uids.numel():
            unseen_mass = dist.p0 * count / uncounted
            parts.append(
                (uids, torch.full((uids.numel(),), unseen_mass / uids.numel(), dtype=torch.float64))
            )
            exact = exact and whole
    return LookupSample(
        torch.cat([i for i, _ in parts]),
        torch.cat([w for _, w in parts]),
        seen_mass + unseen_mass,
        exact,
    )


def _rows(weight: torch.Tensor, sample: LookupSample) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled rows in float64 and their weights, both on the table's device.

    Raises:
        ValueError: a sampled row holds a value that is not finite (no format holds it).
    """
    w = weight.detach()
    rows = w[sample.ids.to(w.device)].double()
    check_finite(rows, "a compressed table", sample.ids)
    return rows, sample.weights.to(w.device)


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> float:
    total = float(weights.sum())
    return float((weights * values).sum()) / total if total > 0 else 0.0


def _pad(padding_idx: int | None) -> torch.Tensor | None:
    return None if padding_idx is None else torch.tensor([padding_idx], dtype=torch.long)


def int8_rowwise_expected_error(
    weight: torch.Tensor, dist: LookupDistribution, padding_idx: int | None
) -> float:
    """Expected relative squared error of symmetric row-wise int8 (scale ``s = absmax / 127``).

    Each element's rounding error is taken as uniform in ``[−s/2, s/2]`` (variance ``s²/12``),
    but the largest (``±127 s``) is exact, so a row ``r`` of ``D`` elements gets
    ``(D − 1) s²/12``; the estimate is ``Σ p (D − 1) s²/12 / Σ p ‖r‖²`` over the lookups
    (:func:`sample_lookups`). Values that sit on the int8 grid (e.g. rows of equal magnitudes)
    round exactly and have less error than this.

    Args:
        weight: the ``(N, D)`` table (any device, any float dtype).
        dist: the lookups' distribution (:func:`table_distribution`).
        padding_idx: left out (kept exact by the action).
    """
    d = weight.shape[1]
    sample = sample_lookups(dist, exclude=_pad(padding_idx))
    if sample.empty:
        return 0.0
    rows, c = _rows(weight, sample)
    scale = rows.abs().amax(dim=1) / 127.0
    den = _weighted_mean(rows.pow(2).sum(dim=1), c)
    return _weighted_mean((d - 1) * scale.pow(2) / 12.0, c) / den if den > 0 else 0.0


def lowrank_expected_error(
    weight: torch.Tensor, rank: int, dist: LookupDistribution, padding_idx: int | None
) -> float:
    """Expected relative squared error of the truncated SVD at ``rank`` (what
    :meth:`edo_monitor.nn.LowRankEmbedding.from_weight` keeps).

    The action factors the whole table, every row counting once, so the basis ``V`` here is the
    top ``rank`` right singular vectors of the rows :func:`sample_lookups` gives without counts:
    the whole table when it has at most ``S = max(``:data:`PLAN_SAMPLE_ROWS```, 2 D)`` rows, else
    a uniform draw of ``S`` rows. For a whole table without counts and without a padding row the
    estimate is exact: the discarded singular-value energy fraction
    ``Σ_{j>rank} σ_j² / Σ_j σ_j²``. Otherwise it is ``Σ p ‖r − r V Vᵀ‖² / Σ p ‖r‖²`` over a second,
    independent sample of the lookups (``p`` their probabilities). Independent, because a
    sample's own top singular vectors fit it better than the table's do: on ``N(0, 1)`` rows
    (``D = 64``, rank 32, ``S = 4096``) the drawn rows' own discarded fraction is 0.446 where the
    table's is 0.497; a fresh sample projected on the drawn basis gives about 0.50 (a basis fitted
    to fewer rows can only do worse on the table than the table's own, by an amount second-order
    in the basis' error). Work: an SVD of ``S × D``, ``O(S D²)``: it grows with ``D²``, as the
    action's own SVD of the whole table does (timings in docs/benchmarks.md).

    Args:
        weight: the ``(N, D)`` table; ``rank`` in ``[1, min(N, D)]``.
        dist: the lookups' distribution (:func:`table_distribution`).
        padding_idx: left out of the evaluated rows (kept exact by the action).
    """
    n, d = weight.shape
    uniform = LookupDistribution.uniform(n)
    basis = sample_lookups(uniform, max_rows=max(PLAN_SAMPLE_ROWS, 2 * d))
    x, _ = _rows(weight, basis)
    _, svals, vh = torch.linalg.svd(x, full_matrices=False)
    energy = svals.pow(2)
    if basis.exact and not dist.seen_ids.numel() and padding_idx is None:  # reuse the SVD
        total = float(energy.sum())
        return float(energy[rank:].sum()) / total if total > 0 else 0.0
    sample = sample_lookups(dist, exclude=_pad(padding_idx), seed=_SEED + 1)
    if sample.empty:
        return 0.0
    rows, c = _rows(weight, sample)
    v = vh[:rank].T  # (D, rank)
    residual = rows - (rows @ v) @ v.T
    den = _weighted_mean(rows.pow(2).sum(dim=1), c)
    return _weighted_mean(residual.pow(2).sum(dim=1), c) / den if den > 0 else 0.0


def share_expected_error(
    weight: torch.Tensor,
    hot_ids: torch.Tensor,
    num_buckets: int,
    dist: LookupDistribution,
    padding_idx: int | None,
) -> float:
    """Expected relative squared error of a hot/cold :class:`edo_monitor.nn.HybridEmbedding`.

    Hot ids keep their rows exactly; a cold id's row becomes the mean of its bucket's cold
    members. The estimate is the share of lookups that go to cold ids times the error of a cold
    lookup, relative to the mean square of a looked-up row::

        cold_share × [(1 − q)² V_c + q (1 − q) V] / E_all ‖r‖²

    ``μ`` and ``V = E‖r − μ‖²`` are the mean and spread of the cold rows each counting once (as
    they do in a bucket mean); ``V_c = E_c‖r − μ‖²`` the spread over the cold lookups;
    ``E_all ‖r‖²`` the mean square over all lookups; ``q = E[1/m]`` for ``m`` the members of a
    looked-up id's bucket. Where exact values would cost a pass over the table (every bucket's
    mean), the estimate assumes what the hash makes nearly true: a bucket's other members are a
    random draw of the cold rows, so ``m − 1`` is Poisson with mean ``λ = (n_cold − 1) / B`` and
    ``q = (1 − e^−λ) / λ``; ``E[1/m²]`` is taken as ``q²`` (no effect when ``V_c = V``, e.g.
    without counts, where the estimate is ``(1 − q) V / E‖r‖²``). ``cold_share`` follows from the
    lookups' distribution (ids not counted yet are cold); ``μ, V, V_c, E_all ‖r‖²``
    come from :func:`sample_lookups` (exact weighted sums for a small table). The action records
    the exact value under ``dist`` over every row after converting (``lookup_relative_error``).

    Args:
        weight: the ``(N, D)`` table.
        hot_ids: ``(K,)`` ids that keep their rows (the ``K`` most counted, as the action takes).
        num_buckets: ``B``.
        dist: the lookups' distribution (:func:`table_distribution`).
        padding_idx: left out (kept exact by the action).
    """
    n = int(weight.shape[0])
    pad = _pad(padding_idx)
    hot = hot_ids.detach().to("cpu", torch.long).reshape(-1)
    excluded = hot if pad is None else torch.cat([hot, pad]).unique()
    n_cold = n - int(excluded.numel())
    if n_cold <= 0:
        return 0.0
    members = sample_lookups(LookupDistribution.uniform(n), exclude=excluded)  # cold rows, once
    rows, c = _rows(weight, members)
    mu = (c.unsqueeze(1) * rows).sum(dim=0) / c.sum()
    spread = _weighted_mean((rows - mu).pow(2).sum(dim=1), c)
    cold = sample_lookups(dist, exclude=excluded)  # cold lookups
    every = sample_lookups(dist, exclude=pad)  # all lookups
    if cold.empty or every.empty or every.mass <= 0:
        return 0.0
    crows, cc = _rows(weight, cold)
    spread_lookups = _weighted_mean((crows - mu).pow(2).sum(dim=1), cc)
    arows, ac = _rows(weight, every)
    den = _weighted_mean(arows.pow(2).sum(dim=1), ac)
    if den <= 0:
        return 0.0
    cold_share = cold.mass / every.mass
    lam = (n_cold - 1) / num_buckets
    q = 1.0 if lam <= 0 else -math.expm1(-lam) / lam
    cold_error = (1.0 - q) ** 2 * spread_lookups + q * (1.0 - q) * spread
    return cold_share * cold_error / den


def lowbit_expected_error(
    weight: torch.Tensor,
    dist: LookupDistribution,
    padding_idx: int | None,
    *,
    fmt: str,
    bits: int = 4,
    group_size: int = 64,
    full_ids: torch.Tensor | None = None,
) -> float:
    """Expected relative squared error of a group-wise low-bit table (formats of
    :mod:`edo_monitor.nn.lowbit`).

    These formats are row-local (a row's codes depend on that row only), so the sampled rows are
    quantised exactly as the action will quantise them and their error measured:
    ``Σ p ‖r̂ − r‖² / Σ p ‖r‖²`` over :func:`sample_lookups` (exact for a table of at most
    :data:`PLAN_SAMPLE_ROWS` rows; otherwise a seeded draw). With ``full_ids`` (per-row
    precision) those rows are exact: the numerator is the low-bit lookups' mean error times
    their share of the lookups (``mass``), the denominator the mean square over every lookup.
    Work: the sampled rows, twice at most (never the whole table).

    Args:
        weight: the ``(N, D)`` table.
        dist: the lookups' distribution (:func:`table_distribution`).
        padding_idx: left out (kept exact by the action).
        fmt: ``"groupwise"`` (``bits`` 4 or 2) or ``"2of8"`` (2:8 sparse + 2 bits).
        bits, group_size: the format's parameters.
        full_ids: ``(K,)`` ids kept at full precision (per-row precision), else ``None``.

    Raises:
        ValueError: for a format or parameters the formats refuse.
    """
    from edo_monitor.nn.lowbit import (
        dequantize_groupwise,
        dequantize_sparse_2of8,
        quantize_groupwise,
        sparsify_2of8,
    )

    d = int(weight.shape[1])

    def squared_error(rows: torch.Tensor) -> torch.Tensor:
        if fmt == "groupwise":
            q = quantize_groupwise(rows, bits, group_size)
            approx = dequantize_groupwise(q.codes, q.scale, q.zero, bits, q.group_size, d)
        elif fmt == "2of8":
            s = sparsify_2of8(rows, group_size)
            approx = dequantize_sparse_2of8(s.codes, s.positions, s.scale, s.zero, s.group_size, d)
        else:
            raise ValueError(f"fmt={fmt!r}; expected 'groupwise' or '2of8'")
        return (approx.double() - rows).pow(2).sum(dim=1)

    pad = _pad(padding_idx)
    every = sample_lookups(dist, exclude=pad)
    if every.empty:
        return 0.0
    rows, c = _rows(weight, every)
    den = _weighted_mean(rows.pow(2).sum(dim=1), c)
    if den <= 0:
        return 0.0
    if full_ids is None or not full_ids.numel():
        return _weighted_mean(squared_error(rows), c) / den
    full = full_ids.detach().to("cpu", torch.long).reshape(-1)
    excluded = full if pad is None else torch.cat([full, pad])
    low = sample_lookups(dist, exclude=excluded, seed=_SEED + 1)
    if low.empty or every.mass <= 0:
        return 0.0
    lrows, lc = _rows(weight, low)
    return (low.mass / every.mass) * _weighted_mean(squared_error(lrows), lc) / den
