"""The Adam catch-up's series: its moments (kept step by step for the recent steps, or from a
group's tables), the terms each group needs, and its evaluation (issue 23).

A row last stepped at step ``s`` and caught up to ``t`` takes, per element, the sum over its
missed steps ``j = 1 ... min(t - s, W)`` of ``coef_j / (root * scale_j + eps)``
(:meth:`edo_monitor.nn.catch_up._AdamRule._term_sums`). The sum is evaluated as a series whose
moments ``M_n(s) = sum_j coef_j delta_j^n`` (``delta_j = scale_j / scale_1 - 1``) depend on the
row only through ``s``: one *group* per step. Built at every catch-up they cost ``O(groups x W x
K)`` and about a hundred operator calls; kept here, each optimizer step adds its own column to
the ``W`` groups whose window it falls in (``O(W x K)``, about fifteen calls) and a catch-up
gathers its groups' moments.

With ``c`` a group's largest scale and ``delta_j = scale_j / c - 1`` in ``(-1, 0]``, each term is
``coef_j / (a (1 + delta_j y))`` for ``a = root c + eps`` and ``y = root c / a`` in ``[0, 1)``,
so the sum is ``(1 / a) sum_n M_n (-y)^n``: a series that converges for every ``root``. After
``K`` terms the rest is below ``rho |M_K| / M_0`` of the sum (``rho``: the group's largest over
smallest scale), cut at half the dtype's epsilon (:func:`series_terms`); the heavy first terms
have ``delta`` near 0, so in float64 a row that missed 20 steps after 300 needs about 8 terms
and one that missed 286 about 20 (float32: 93 % of a 1 M-row benchmark step's rows need at most
8). Groups still above the cut after the terms a spread of :data:`MAX_SPREAD` needs (rows caught
up from the first steps, where the bias correction changes fast) take the exact form
(:func:`exact_sums`, ``O(J D)`` a row).
"""

from __future__ import annotations

import math

import torch

from edo_monitor.nn.cache_parts import to_device

__all__ = [
    "MAX_SPREAD",
    "MomentRing",
    "exact_sums",
    "horner_sums",
    "max_terms",
    "series_terms",
    "table_moments",
]

MAX_SPREAD = 0.35  # series terms at most: those a spread of 0.35 needs (float64 35, float32 16)
_TERM_BLOCK = 8  # series moments computed between two checks of which groups need more
_PIECE_ELEMENTS = 1 << 19  # elements of the exact form's (rows, D, J) pieces (4 MiB in float64)


class MomentRing:
    """Series moments, largest and last scale of the groups of the latest ``capacity`` steps.

    Args:
        window: the missed steps a catch-up sums (``W``: the rule's window for the dtype).
        terms: moments kept per group (``K``: the series' cap for the dtype).
        first: the first group kept (a step offset from the rule's base step); groups from it on
            get their columns here (:meth:`fill` puts in those that had columns before).
        beta1, beta2, amsgrad: the optimizer's; ``capacity``: groups kept (at least ``W + 1``;
            older ones are overwritten: :meth:`covers` says which are here).

    Group ``o`` (rows at step ``base + o``) gets column ``j`` at step ``k = base + o + j``:
    coefficient ``lr / (1 - beta1^k) * beta1^j`` and scale ``beta2^(j/2) / sqrt(1 - beta2^k)``
    (amsgrad: ``1 / sqrt(1 - beta2^k)``), times the decoupled decays of the steps after it while
    the group is in its window (the decays after the window the caller applies).
    """

    def __init__(
        self,
        window: int,
        terms: int,
        first: int,
        beta1: float,
        beta2: float,
        amsgrad: bool,
        capacity: int = 1 << 14,
    ) -> None:
        self.window, self.terms, self.first = window, terms, first
        self.capacity = max(capacity, window + 1)
        self.moments = torch.zeros(self.capacity, terms, dtype=torch.float64)
        self.top = torch.zeros(self.capacity, dtype=torch.float64)  # scale of column 1
        self.last = torch.zeros(self.capacity, dtype=torch.float64)  # scale of the last column
        self.negative = torch.zeros(self.capacity, dtype=torch.bool)  # a coefficient below 0
        # column j's beta1^j and beta2^(j/2), j = W ... 1: a step's columns for groups oldest
        # first are the last ``count`` entries
        j = torch.arange(window, 0, -1, dtype=torch.float64)
        self._beta1_j = torch.pow(beta1, j)
        self._beta2_half_j = torch.ones(window, dtype=torch.float64)
        if not amsgrad:
            self._beta2_half_j = torch.pow(beta2, j / 2)
        self._beta2_half_1 = float(self._beta2_half_j[-1])
        self._nan_delta = beta2 == 0 and not amsgrad  # every scale 0: delta 0/0, taken as 0
        self._powers = torch.empty(window, terms, dtype=torch.float64)  # scratch

    def covers(self, n: int) -> int:
        """The oldest group kept at step offset ``n`` (groups from it to ``n - 1`` are here; the
        slot of group ``n - capacity`` is taken by group ``n`` at the next step)."""
        return max(self.first, n - self.capacity)

    def _slots(self, lo: int, count: int) -> slice | torch.Tensor:
        """The slots of groups ``lo ... lo + count - 1``: a slice, or indices where they wrap."""
        start = lo % self.capacity
        if start + count <= self.capacity:
            return slice(start, start + count)
        return torch.arange(start, start + count) % self.capacity

    def fill(
        self,
        groups: torch.Tensor,
        moments: torch.Tensor,
        top: torch.Tensor,
        last: torch.Tensor,
        negative: torch.Tensor,
    ) -> None:
        """Put in groups ``groups`` ``(u,)`` (consecutive step offsets, all kept from now on)
        with their moments ``(K, u)`` (all ``K``), largest and last scale and negative flag
        ``(u,)``, computed from tables; the ring keeps them from ``groups[0]`` on."""
        if groups.numel() == 0:
            return
        lo = int(groups[0])
        at = self._slots(lo, groups.numel())
        self.moments[at] = moments.T
        self.top[at], self.last[at], self.negative[at] = top, last, negative
        self.first = lo

    def add_step(self, n: int, lr_over_bc1: float, root_bc2: float, decay: float) -> None:
        """Step offset ``n`` happened: its column joins groups ``n - W ... n - 1`` (those kept).

        ``lr_over_bc1``: ``lr / (1 - beta1^k)``; ``root_bc2``: ``sqrt(1 - beta2^k)``; ``decay``:
        ``1 - lr * weight_decay`` (1.0 without decoupled decay)."""
        count = min(self.window, n - self.first)
        if count <= 0:
            return
        newest = (n - 1) % self.capacity  # its first column: a fresh group in a reused slot
        self.moments[newest] = 0.0
        self.negative[newest] = lr_over_bc1 < 0
        scale = self._beta2_half_j[-count:] / root_bc2
        self.top[newest] = self._beta2_half_1 / root_bc2  # scale[-1], column 1's
        at = self._slots(n - count, count)
        delta = scale / self.top[at] - 1
        if self._nan_delta:
            delta.nan_to_num_(0.0)
        powers = self._powers[:count]
        powers[:, 1:] = delta[:, None]
        torch.mul(self._beta1_j[-count:], lr_over_bc1, out=powers[:, 0])
        powers.cumprod_(dim=1)  # coef * delta^n, n = 0 ... K-1
        if decay != 1.0:
            self.moments[at] = self.moments[at].mul_(decay).add_(powers)
        else:
            self.moments[at] += powers
        self.last[at] = scale
        if lr_over_bc1 < 0 or decay < 0:  # a negative term: the series' bound does not hold
            self.negative[at] = True

    def gather(
        self, groups: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Moments ``(K, u)``, largest scale ``(u,)``, largest over smallest scale ``(u,)`` and
        whether a coefficient is negative ``(u,)`` of ``groups`` ``(u,)`` (step offsets, each
        kept: see :meth:`covers`, and with at least one column)."""
        idx = groups % self.capacity
        top = self.top[idx]
        last = self.last[idx]
        ratio = torch.where(last > 0, top / last, 1.0)
        return self.moments[idx].T, top, ratio, self.negative[idx]


def max_terms(dtype: torch.dtype) -> int:
    """Series terms at most for ``dtype``: those a scale spread of :data:`MAX_SPREAD` needs to
    fall below half the dtype's epsilon (``MAX_SPREAD ** K <= eps / 2``: float64 35, float32
    16)."""
    return math.ceil(math.log(torch.finfo(dtype).eps / 2) / math.log(MAX_SPREAD))


def table_moments(
    coef: torch.Tensor,
    scale: torch.Tensor,
    widths: torch.Tensor,
    terms: int,
    tail: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Moments ``(terms, u)``, largest and smallest scale, their ratio and whether a coefficient
    is negative ``(u,)`` of groups given by their tables: coefficients and scales ``(u, J)``
    float64, a group's first ``widths`` ``(u,)`` columns its missed steps (the scales fall
    along them). With ``tail``, the moments past the first within ``tail`` of every group's sum
    are left 0 (checked every :data:`_TERM_BLOCK` terms)."""
    s_max, s_min = scale[:, 0], scale.gather(1, (widths - 1)[:, None])[:, 0]
    ratio = torch.where(s_min > 0, s_max / s_min, 1.0)
    delta = (scale / s_max[:, None]).sub_(1)
    delta.nan_to_num_(0.0)  # NaN only where every scale is 0 (beta2 = 0): y is 0 there
    unsure = coef.amin(dim=1) < 0  # the bound needs positive terms: exact form
    groups = coef.shape[0]
    moments = coef.new_zeros(terms, groups)  # moment n of every group: row n
    w = coef.clone()
    active = groups  # groups [0, active) hold one not yet within the bound
    for n0 in range(0, terms, _TERM_BLOCK):  # blocks of terms, then one check
        wa, da = w[:active], delta[:active]
        block = []
        for _ in range(n0, min(n0 + _TERM_BLOCK, terms)):
            block.append(wa.sum(dim=1))
            wa.mul_(da)
        moments[n0 : n0 + len(block), :active] = torch.stack(block)
        if tail is None:
            continue
        bound = moments[0, :active] * (tail / ratio[:active])  # |M_n| at most this: n do
        left = ((block[-1].abs() > bound) | unsure[:active]).nonzero()
        active = int(left[-1]) + 1 if left.numel() else 0
        if active == 0:
            break
    return moments, s_max, s_min, ratio, unsure


def series_terms(
    moments: torch.Tensor, ratio: torch.Tensor, unsure: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Terms ``(u,)`` each group's rows take in ``dtype``: the first ``n`` whose moment is
    within the bound (the moments fall), at least those of every younger group (so term ``n``
    runs over a prefix of the rows, oldest first); ``max_terms(dtype) + 1``: the exact form."""
    tail = torch.finfo(dtype).eps / 2  # float64: 1.1e-16, float32: 6e-8
    bound = moments[0] * (tail / ratio)  # |M_n| at most this: n terms do
    within = (moments.abs() <= bound) & ~unsure
    terms = torch.where(within.any(dim=0), within.int().argmax(dim=0), max_terms(dtype) + 1)
    return torch.flip(torch.cummax(torch.flip(terms, [0]), 0).values, [0])


def exact_sums(
    coef: torch.Tensor, scale: torch.Tensor, root: torch.Tensor, which: torch.Tensor, eps: float
) -> torch.Tensor:
    """``sum_j coef_j / (root * scale_j + eps)`` term by term ``(r, D)`` for rows ``root``
    ``(r, D)`` of groups ``which`` ``(r,)`` (rows of ``coef`` and ``scale`` ``(u, J)``), in
    pieces of :data:`_PIECE_ELEMENTS` ``(rows, D, J)`` (one for a benchmark step's 20-30 rows;
    pieces of 1 MiB took 1.2x the time)."""
    out = torch.empty_like(root)
    coef = to_device(coef, root.device, root.dtype)
    scale = to_device(scale, root.device, root.dtype)
    which = to_device(which, root.device)
    dim, cols = root.shape[1], coef.shape[1]
    piece = max(1, _PIECE_ELEMENTS // (dim * cols))
    for a in range(0, root.shape[0], piece):
        u = which[a : a + piece]
        den = root[a : a + piece, :, None] * scale.index_select(0, u)[:, None, :]
        term = coef.index_select(0, u)[:, None, :] / den.add_(eps)
        out[a : a + piece] = term.sum(dim=2)
    return out


def horner_sums(
    moments: torch.Tensor,
    top: torch.Tensor,
    terms: torch.Tensor,
    which: torch.Tensor,
    root: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The series ``(1 / a) sum_n M_n (-y)^n`` ``(R, D)`` for rows ``root`` ``(R, D)`` of groups
    ``which`` ``(R,)`` (non-decreasing) with moments ``(K, u)``, largest scales ``top`` and
    term counts ``terms`` ``(u,)`` (non-increasing, each at most ``K``). Term ``n`` runs over
    the rows whose group takes it, rounded up to quarters of the rows (a row that also takes a
    later term of its group only gains accuracy): a step slices at most four times, and each
    term is one operator call."""
    k_terms = int(terms[0]) if terms.numel() else 0
    # rows that take term n: those of the groups with more than n terms
    rows_with = torch.searchsorted(which, (terms > torch.arange(k_terms)[:, None]).sum(1))
    dev, dtype = root.device, root.dtype  # the tables are the host's, float64
    mom = to_device(moments[:k_terms].index_select(1, which), dev, dtype)[:, :, None]  # (K, R, 1)
    b = root * to_device(top.index_select(0, which), dev, dtype)[:, None]  # root * c
    a = b + eps
    neg_y = b.div_(a).neg_()
    acc = torch.zeros_like(root)
    r = -1
    step = -(-root.shape[0] // 4)
    rows_at = rows_with.tolist()
    for n in range(k_terms - 1, -1, -1):  # Horner, over the rows that take term n
        if rows_at[n] > r:
            r = min(-(-rows_at[n] // step) * step, root.shape[0])
            acc_r, neg_y_r, mom_r = acc[:r], neg_y[:r], mom[:, :r].unbind(0)
        torch.addcmul(mom_r[n], acc_r, neg_y_r, out=acc_r)
    return acc.div_(a)
