"""The exact catch-up of a row the optimizer did not step: per optimizer a rule that replays the
missed steps in closed form (SGD with momentum as 2x2 matrix products over a segment tree, Adam's
decays and bounded sums, Adagrad), each with its step's learning rate."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_TRUNCATION = 1e-13  # float64: relative size of the first neglected Adam catch-up term


_CHUNK_ELEMENTS = 1 << 21  # float64 elements per catch-up chunk (16 MiB)
_CACHE_ELEMENTS = 1 << 17  # float64 elements per piece of a pass that stays in cache (1 MiB)
_MAX_SPREAD = 0.35  # series terms at most: those a spread of 0.35 needs (float64 35, float32 16)
_TERM_BLOCK = 8  # series moments computed between two checks of which groups need more


def _window_rows(values: torch.Tensor, first: torch.Tensor, width: int) -> torch.Tensor:
    """``values[first[:, None] + arange(width)]`` ``(u, width)`` (``first + width <=
    len(values)``): whole rows of a sliding view, cheaper than a gather of every element."""
    return values.unfold(0, width, 1).index_select(0, first)


# ----------------------------------------------------------------------------- optimizer rules
class _RangeProduct:
    """Append-only per-step ``d x d`` matrices ``M_k`` (k = 1, 2, ...) with range products.

    ``query(lo, hi)`` gives ``M_hi @ ... @ M_{lo+1}`` (identity when ``lo >= hi``) for many ranges
    at once in ``O(log steps)`` batched 2x2 products (a segment tree; leaf ``k - 1`` holds ``M_k``;
    a node holds ``right @ left``: later steps multiply from the left).
    """

    def __init__(self, d: int) -> None:
        self.d = d
        self.size = 256
        self.n = 0
        self.tree = torch.eye(d, dtype=torch.float64).repeat(2 * self.size, 1, 1)

    def append(self, m: torch.Tensor) -> None:
        if self.n == self.size:
            old = self.tree
            self.size *= 2
            self.tree = torch.eye(self.d, dtype=torch.float64).repeat(2 * self.size, 1, 1)
            half = self.size // 2
            self.tree[self.size : self.size + self.n] = old[half : half + self.n]
            lo, hi = self.size // 2, self.size
            while lo >= 1:  # rebuild the internal nodes level by level
                idx = torch.arange(lo, hi)
                self.tree[idx] = self.tree[2 * idx + 1] @ self.tree[2 * idx]
                lo, hi = lo // 2, hi // 2
        i = self.size + self.n
        self.tree[i] = m
        self.n += 1
        i //= 2
        while i >= 1:
            self.tree[i] = self.tree[2 * i + 1] @ self.tree[2 * i]
            i //= 2

    def query(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Products over leaves ``[lo, hi)`` (``(Q,)`` int64 each) → ``(Q, d, d)`` float64."""
        q = lo.numel()
        eye = torch.eye(self.d, dtype=torch.float64).expand(q, self.d, self.d)
        res_l, res_r = eye.clone(), eye.clone()
        lo = lo.clamp(0, self.n) + self.size
        hi = hi.clamp(0, self.n) + self.size
        top = 2 * self.size - 1
        while bool((lo < hi).any()):
            active = lo < hi
            take_l = active & (lo % 2 == 1)
            node = self.tree[lo.clamp(max=top)]
            res_l = torch.where(take_l[:, None, None], node @ res_l, res_l)
            lo = lo + take_l.long()
            take_r = active & (hi % 2 == 1)
            hi = hi - take_r.long()
            node = self.tree[hi.clamp(max=top)]
            res_r = torch.where(take_r[:, None, None], res_r @ node, res_r)
            lo, hi = lo // 2, hi // 2
        return res_r @ res_l


def _group_of(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, Any]:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    raise ValueError("the optimizer does not step this table's cache weight")


def steps_taken(state: dict[str, Any], default: int) -> int:
    """The optimizer steps a parameter's ``state`` says it took: its ``step`` (Adam, Adagrad),
    else at least 1 when it holds a momentum buffer (SGD keeps no step; a buffer exists only
    after the first), else ``default``."""
    step = state.get("step")
    if step is not None:
        return int(step)
    return max(default, 1) if state.get("momentum_buffer") is not None else default


def optimizer_row_state_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple:
    """The per-element state keys ``optimizer`` keeps for a parameter of ``group``."""
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if group["momentum"] else ()
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        keys = ("exp_avg", "exp_avg_sq")
        return (*keys, "max_exp_avg_sq") if group.get("amsgrad") else keys
    if isinstance(optimizer, torch.optim.Adagrad):
        return ("sum",)
    return ()


def initial_state(group: dict[str, Any], key: str) -> float:
    """The value a per-element state ``key`` starts at in ``group`` (Adagrad's ``sum``: its
    ``initial_accumulator_value``; every other: 0)."""
    return float(group.get("initial_accumulator_value", 0.0)) if key == "sum" else 0.0


class _Rule:
    """Catch-up of rows that missed steps; ``lr`` of every step since ``base_step`` is recorded."""

    keys: tuple[str, ...] = ()

    def __init__(self, group: dict[str, Any], base_step: int) -> None:
        self.hyper = self._hyper(group)
        self.base_step = base_step
        self._lr = torch.zeros(256, dtype=torch.float64)
        self.n = 0

    @staticmethod
    def _hyper(group: dict[str, Any]) -> tuple:
        return tuple(
            (k, v if not isinstance(v, torch.Tensor) else float(v))
            for k, v in sorted(group.items())
            if k not in ("params", "lr", "initial_lr", "foreach")
        )

    def record(self, lr: float) -> None:
        """Step ``base_step + n + 1`` happened with learning rate ``lr``."""
        if self.n == self._lr.numel():
            self._lr = torch.cat([self._lr, torch.zeros_like(self._lr)])
        self._lr[self.n] = lr
        self.n += 1

    def lr_windows(self, s: torch.Tensor, width: int) -> torch.Tensor:
        """Learning rates ``(u, width)`` of absolute steps ``s + 1 ... s + width`` for steps ``s``
        ``(u,)`` (int64, each in ``[base_step, t)``), 0 for steps after ``t``."""
        first = s - self.base_step
        end = int(first.max()) + width
        if end > self._lr.numel():  # steps not taken yet: the table's zeros
            self._lr = torch.cat([self._lr, self._lr.new_zeros(end)])
        return _window_rows(self._lr, first, width)

    def catch_up(
        self, p: torch.Tensor, state: dict[str, torch.Tensor], s: torch.Tensor, t: int
    ) -> None:
        """Bring rows ``p`` ``(R, D)`` and ``state`` (float64, or float32 for a float32 table:
        see :meth:`catch_up_rows`) from steps ``s`` ``(R,)`` to ``t``, in place."""

    def starts_momentum(self, step: int) -> bool:
        """Whether ``step`` creates the momentum buffers (SGD: the first step with momentum)."""
        return False

    def buffers_after(self, t: int) -> bool:
        """Whether the optimizer holds momentum buffers after step ``t`` (SGD only)."""
        return False

    def catch_up_rows(
        self, p: torch.Tensor, state: dict[str, torch.Tensor], s: torch.Tensor, t: int
    ) -> None:
        """:meth:`catch_up` for rows of any floating dtype, in place: float64 and float32 rows
        are caught up in their own dtype, others (float16, bfloat16) in float32. A float32 row's
        catch-up rounds once, about 1e-7 of what the missed steps move it; a resident float32
        table rounds the row at every one of those steps, so this stays within the resident
        table's own float32 rounding (``benchmarks/row_cache.py``, table 4)."""
        work = p.dtype if p.dtype in (torch.float64, torch.float32) else torch.float32
        if p.dtype == work and all(v.dtype == work for v in state.values()):
            self.catch_up(p, state, s, t)
            return
        p_work = p.to(work)
        state_work = {k: v.to(work) for k, v in state.items()}
        self.catch_up(p_work, state_work, s, t)
        p.copy_(p_work)
        for k, v in state_work.items():
            state[k].copy_(v)


class _SGDRule(_Rule):
    """SGD; ``buffers``: whether the optimizer held momentum buffers at ``base_step`` (torch makes
    them at the first step with momentum, as a copy of the gradient: no dampening)."""

    def __init__(self, group: dict[str, Any], base_step: int, buffers: bool) -> None:
        super().__init__(group, base_step)
        self.mu = float(group["momentum"])
        self.damp = float(group["dampening"])
        self.nesterov = bool(group["nesterov"])
        self.wd = float(group["weight_decay"])
        self.keys = ("momentum_buffer",) if self.mu else ()
        self.trivial = self.wd == 0 and self.mu == 0
        self.tree = _RangeProduct(2)
        self._buffers = buffers
        self.first_step = base_step + 1 if self.mu and not buffers else None

    def starts_momentum(self, step: int) -> bool:
        return step == self.first_step

    def buffers_after(self, t: int) -> bool:
        return self._buffers or (self.first_step is not None and t >= self.first_step)

    def record(self, lr: float) -> None:
        k = self.base_step + self.n + 1
        super().record(lr)
        if self.trivial:
            return
        mu, wd = self.mu, self.wd
        if not mu:
            m = [[1 - lr * wd, 0.0], [0.0, 1.0]]
        else:
            # g = wd*p (zero gradient); b' = mu*b + (1-damp)*g, or b' = g at the first step
            first = k == self.first_step
            bp, bb = (wd, 0.0) if first else ((1 - self.damp) * wd, mu)
            if self.nesterov:  # p' = p - lr*(g + mu*b')
                m = [[1 - lr * (wd + mu * bp), -lr * mu * bb], [bp, bb]]
            else:  # p' = p - lr*b'
                m = [[1 - lr * bp, -lr * bb], [bp, bb]]
        self.tree.append(torch.tensor(m, dtype=torch.float64))

    def catch_up(
        self, p: torch.Tensor, state: dict[str, torch.Tensor], s: torch.Tensor, t: int
    ) -> None:
        if self.trivial or p.shape[0] == 0:
            return
        prod = self.tree.query(s - self.base_step, torch.full_like(s, t - self.base_step))
        prod = prod.to(p.device)
        a, b = prod[:, 0, 0, None], prod[:, 0, 1, None]
        if self.mu:
            buf = state["momentum_buffer"]
            c, d = prod[:, 1, 0, None], prod[:, 1, 1, None]
            new_p = a * p + b * buf
            buf.copy_(c * p + d * buf)
            p.copy_(new_p)
        else:
            p.mul_(a)


def _window(ratio: float, truncation: float) -> int:
    """Steps ``W >= 1`` with ``ratio ** W <= truncation`` (1 when ``ratio <= 0``)."""
    if ratio <= 0:
        return 1
    return max(1, math.ceil(math.log(truncation) / math.log(ratio)))


class _AdamRule(_Rule):
    def __init__(self, group: dict[str, Any], base_step: int) -> None:
        super().__init__(group, base_step)
        self.beta1, self.beta2 = (float(b) for b in group["betas"])
        self.eps = float(group["eps"])
        self.amsgrad = bool(group.get("amsgrad"))
        self.wd = float(group["weight_decay"])
        self.keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())
        # beta2 = 0: v is zero after the first missed step, the terms shrink as beta1 alone
        ratio = self.beta1 if self.amsgrad or not self.beta2 else self.beta1 / math.sqrt(self.beta2)
        # the missed steps a catch-up sums (terms shrink at least as ratio ** j): in float64 up
        # to the first term below 1e-13 of the first; in float32 until the whole rest, below
        # ratio ** W / (1 - ratio) of the first, is under half an ulp (286 and 181 steps at the
        # default betas)
        half_ulp = torch.finfo(torch.float32).eps / 2
        self.windows = {
            torch.float64: _window(ratio, _TRUNCATION),
            torch.float32: _window(ratio, half_ulp * (1 - ratio)),
        }
        self.tree = _RangeProduct(1) if self.wd else None
        self._bc = torch.zeros(2, 0, dtype=torch.float64)  # 1 - beta1^k, sqrt(1 - beta2^k)
        self._saturated = 1
        while any(1 - b**self._saturated != 1.0 for b in (self.beta1, self.beta2)):
            self._saturated *= 2

    def _bias_corrections(self, s: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``1 - beta1^k`` and ``sqrt(1 - beta2^k)`` ``(u, width)`` for absolute steps ``k = s + 1
        ... s + width`` (``s`` ``(u,)`` int64), as the fused step computes them (Python floats,
        the root by ``torch.sqrt``), from a table grown as steps pass; both are exactly 1.0 from
        step :attr:`_saturated` on (``beta^k`` below half an ulp of 1), so the table stops there
        (36,000 entries for ``beta2 = 0.999``)."""
        last = int(s.max()) + width  # the latest step asked for
        top = min(last, self._saturated)
        if top >= self._bc.shape[1]:
            n = min(max(2 * self._bc.shape[1], top + 1, 256), self._saturated + 1)
            self._bc = torch.tensor(
                [[1 - self.beta1**i for i in range(n)], [1 - self.beta2**i for i in range(n)]],
                dtype=torch.float64,
            )
            self._bc[1].sqrt_()
        if last < self._bc.shape[1]:  # rows of a sliding view
            return _window_rows(self._bc[0], s + 1, width), _window_rows(self._bc[1], s + 1, width)
        k = (s[:, None] + torch.arange(1, width + 1)).clamp(max=self._saturated)
        return self._bc[0][k], self._bc[1][k]

    def record(self, lr: float) -> None:
        super().record(lr)
        if self.tree is not None:
            self.tree.append(torch.tensor([[1 - lr * self.wd]], dtype=torch.float64))

    def _decay(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        if self.tree is None:
            return torch.ones(lo.shape, dtype=torch.float64)
        return self.tree.query(lo - self.base_step, hi - self.base_step)[:, 0, 0]

    def catch_up(
        self, p: torch.Tensor, state: dict[str, torch.Tensor], s: torch.Tensor, t: int
    ) -> None:
        rows = p.shape[0]
        if rows == 0:
            return
        if rows > 1 and not bool((s[1:] >= s[:-1]).all()):
            # the sum wants the rows oldest first (then its groups' term counts fall)
            order = torch.argsort(s, stable=True)
            idx = order.to(p.device)
            sub_p = p.index_select(0, idx)
            sub_state = {k: v.index_select(0, idx) for k, v in state.items()}
            self.catch_up(sub_p, sub_state, s[order], t)
            p.index_copy_(0, idx, sub_p)
            for k, v in sub_state.items():
                state[k].index_copy_(0, idx, v)
            return
        per = max(1, _CHUNK_ELEMENTS // (8 * p.shape[1]))  # rows a piece: its temporaries
        if rows > per:
            for a in range(0, rows, per):
                sl = slice(a, a + per)
                self.catch_up(p[sl], {k: v[sl] for k, v in state.items()}, s[sl], t)
            return
        missed = t - s  # (R,)
        window = self.windows[p.dtype]
        width = int(missed.clamp(max=window).max())
        if width == 0:
            return
        m, v = state["exp_avg"], state["exp_avg_sq"]
        moving = (m.abs().amax(dim=1) != 0).cpu()  # NaN counts as moving
        # rows whose first moment is zero get no Adam update, only the decoupled decay: the
        # leading ones (rows never stepped, at the oldest step) skip the sum
        lead = int(moving.int().argmax()) if bool(moving.any()) else rows
        # the sum's coefficients depend on a row only through its step s: computed once per
        # distinct s (u <= rows, and <= the steps since the oldest), then shared by index
        us, inv = torch.unique_consecutive(s, return_inverse=True)
        un = (t - us).clamp(max=window)
        j = torch.arange(1, width + 1, dtype=torch.int64)
        lr = self.lr_windows(us, width)  # (u, J): 0 after step t, past a row's missed steps
        bc1, root_bc2 = self._bias_corrections(us, width)
        jf = j.double()[None, :]
        dev = p.device
        if self.wd:
            valid = j[None, :] <= un[:, None]  # the rows' missed steps
            decay = torch.where(valid, 1 - lr * self.wd, 1.0)  # per missed step in the window
            incl = torch.flip(torch.cumprod(torch.flip(decay, [1]), 1), [1])
            after = torch.ones_like(incl)
            after[:, :-1] = incl[:, 1:]  # product of the window's decays after step j
            tail = self._decay(us + un, torch.full_like(us, t))  # decays beyond the window
            p.mul_((incl[:, 0] * tail).to(dev, p.dtype)[inv.to(dev)][:, None])
            lr.mul_(after).mul_(tail[:, None])
        coef = lr.div_(bc1).mul_(self.beta1**jf)  # 0 outside the missed steps, as lr
        scale = 1 / root_bc2 if self.amsgrad else self.beta2 ** (jf / 2) / root_bc2
        if lead < rows:
            denom = state["max_exp_avg_sq"] if self.amsgrad else v
            sums = self._term_sums(coef, scale.expand(coef.shape), un, inv[lead:], denom[lead:])
            if self.eps == 0:  # 0 / 0 where a row has no moment: it moves by nothing
                sums.masked_fill_(~moving[lead:, None].to(dev), 0.0)
            p[lead:].sub_(m[lead:] * sums)
        mf = missed.double()[:, None]
        m.mul_(torch.pow(self.beta1, mf).to(dev, m.dtype))
        v.mul_(torch.pow(self.beta2, mf).to(dev, v.dtype))

    def _term_sums(
        self,
        coef: torch.Tensor,
        scale: torch.Tensor,
        widths: torch.Tensor,
        which: torch.Tensor,
        denom: torch.Tensor,
    ) -> torch.Tensor:
        """``sum_j coef_j / (sqrt(denom) * scale_j + eps)`` ``(R, D)`` (``denom``'s dtype) for
        rows whose coefficients are row ``which`` ``(R,)`` (non-decreasing: the groups oldest
        first) of ``coef`` and ``scale`` ``(u, J)`` float64 (one row per distinct step, its first
        ``widths`` ``(u,)`` columns its missed steps, coefficients 0 after them; the scales fall
        along a row, the coefficients are positive).

        With ``c`` a group's largest scale and ``delta_j = scale_j / c - 1`` in ``(-1, 0]``, each
        term is ``coef_j / (a (1 + delta_j y))`` for ``a = root c + eps`` and ``y = root c / a``
        in ``[0, 1)``, so the sum is ``(1 / a) sum_n M_n (-y)^n`` with moments ``M_n = sum_j
        coef_j delta_j^n`` per group: a series that converges for every ``root``. After ``K``
        terms the rest is below ``rho |M_K| / M_0`` of the sum (``rho``: the group's largest
        over smallest scale), cut at half the dtype's epsilon; the heavy first terms have ``delta``
        near 0, so in float64 a row that missed 20 steps after 300 needs about 8 terms and one
        that missed 286 about 20 (float32: 93 % of a 1 M-row benchmark step's rows need at most
        8). Term ``n`` runs over the rows whose group needs it, a prefix of the rows oldest
        first: ``O(u J K + sum over rows of K D)``. Groups still above the cut after the terms a
        spread of :data:`_MAX_SPREAD` needs (rows caught up from the first steps, where the bias
        correction changes fast) take the exact form, ``O(J D)`` a row.
        """
        first = int(which[0])
        coef, scale, widths = coef[first:], scale[first:], widths[first:]
        which = which - first
        # the scales fall along a row: its first and its last missed step hold the extremes
        s_max, s_min = scale[:, 0], scale.gather(1, (widths - 1)[:, None])[:, 0]
        ratio = torch.where(s_min > 0, s_max / s_min, 1.0)
        delta = (scale / s_max[:, None]).sub_(1)
        if self.beta2 == 0 and not self.amsgrad:  # every scale 0: y is 0, delta any number
            delta.nan_to_num_(0.0)
        tail = torch.finfo(denom.dtype).eps / 2  # float64: 1.1e-16, float32: 6e-8
        max_terms = math.ceil(math.log(tail) / math.log(_MAX_SPREAD))
        bound = coef.sum(dim=1) * (tail / ratio)  # |M_n| at most this: n terms do
        unsure = coef.amin(dim=1) < 0  # the bound needs positive terms: exact form
        groups = coef.shape[0]
        moments = coef.new_zeros(max_terms, groups)  # moment n of every group: row n
        w = coef.clone()
        active = groups  # groups [0, active) hold one not yet within the bound
        for n0 in range(0, max_terms, _TERM_BLOCK):  # blocks of terms, then one check
            wa, da = w[:active], delta[:active]
            block = []
            for _ in range(n0, min(n0 + _TERM_BLOCK, max_terms)):
                block.append(wa.sum(dim=1))
                wa.mul_(da)
            moments[n0 : n0 + len(block), :active] = torch.stack(block)
            left = ((block[-1].abs() > bound[:active]) | unsure[:active]).nonzero()
            active = int(left[-1]) + 1 if left.numel() else 0
            if active == 0:
                break
        # terms a group needs: the first n whose moment is within the bound (moments fall)
        within = (moments.abs() <= bound) & ~unsure
        terms = torch.where(within.any(dim=0), within.int().argmax(dim=0), max_terms + 1)
        # a group takes at least the terms of every younger one: term n runs over a prefix
        terms = torch.flip(torch.cummax(torch.flip(terms, [0]), 0).values, [0])
        root = denom.sqrt()
        out = torch.empty_like(root)
        exact = int((terms > max_terms).sum())
        split = int(torch.searchsorted(which, exact))  # rows of the exact groups come first
        if split:
            out[:split] = self._exact_sums(coef[:exact], scale[:exact], root[:split], which[:split])
        if split == root.shape[0]:
            return out
        root, which = root[split:], which[split:]
        k_terms = int(terms[exact]) if exact < groups else 0
        # rows that take term n: those of the groups with more than n terms
        rows_with = torch.searchsorted(which, (terms > torch.arange(k_terms)[:, None]).sum(1))
        dev, dtype = root.device, root.dtype  # the tables are the host's, float64
        mom = moments[:k_terms].index_select(1, which).to(dev, dtype)[:, :, None]  # (K, R, 1)
        b = root * s_max.index_select(0, which).to(dev, dtype)[:, None]  # root * c
        a = b + self.eps
        neg_y = b.div_(a).neg_()
        acc = torch.zeros_like(root)
        r = -1
        # term n over the rows that take it, rounded up to eighths of the rows (a row that also
        # takes a later term of its group only gains accuracy), so a step slices few times
        step = -(-root.shape[0] // 8)
        rows_at, mom_n = rows_with.tolist(), mom.unbind(0)
        for n in range(k_terms - 1, -1, -1):  # Horner, over the rows that take term n
            if rows_at[n] > r:
                r = min(-(-rows_at[n] // step) * step, root.shape[0])
                acc_r, neg_y_r = acc[:r], neg_y[:r]
            torch.addcmul(mom_n[n][:r], acc_r, neg_y_r, out=acc_r)
        out[split:] = acc.div_(a)
        return out

    def _exact_sums(
        self, coef: torch.Tensor, scale: torch.Tensor, root: torch.Tensor, which: torch.Tensor
    ) -> torch.Tensor:
        """``sum_j coef_j / (root * scale_j + eps)`` term by term for rows ``root`` ``(r, D)`` of
        groups ``which`` ``(r,)``, in pieces of :data:`_CACHE_ELEMENTS` ``(rows, D, J)``."""
        out = torch.empty_like(root)
        coef, scale = coef.to(root.device, root.dtype), scale.to(root.device, root.dtype)
        which = which.to(root.device)
        dim, cols = root.shape[1], coef.shape[1]
        piece = max(1, _CACHE_ELEMENTS // (dim * cols))
        for a in range(0, root.shape[0], piece):
            u = which[a : a + piece]
            den = root[a : a + piece, :, None] * scale.index_select(0, u)[:, None, :]
            term = coef.index_select(0, u)[:, None, :] / den.add_(self.eps)
            out[a : a + piece] = term.sum(dim=2)
        return out


class _NoopRule(_Rule):
    def __init__(self, group: dict[str, Any], base_step: int, keys: tuple[str, ...]) -> None:
        super().__init__(group, base_step)
        self.keys = keys


def _make_rule(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], base_step: int, buffers: bool = False
) -> _Rule:
    """The catch-up rule for ``group`` of ``optimizer`` from ``base_step`` on (``buffers``: SGD
    held momentum buffers then); ``ValueError`` naming what is refused."""
    name = type(optimizer).__name__
    for flag in ("fused", "capturable"):
        if group.get(flag):
            raise ValueError(f"{name} with {flag}=True is not supported by the row cache")
    if isinstance(optimizer, torch.optim.SGD):
        return _SGDRule(group, base_step, buffers)
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay")
        beta1, beta2 = (float(b) for b in group["betas"])
        if not group.get("amsgrad") and beta2 > 0 and beta1 >= math.sqrt(beta2):
            raise ValueError(
                f"{name} with betas=({beta1}, {beta2}) cannot be caught up exactly in bounded "
                f"time: beta1 >= sqrt(beta2) makes a skipped row's updates grow step after step; "
                "the row cache needs beta1 < sqrt(beta2), or amsgrad=True"
            )
        if group["weight_decay"] and not decoupled:
            raise ValueError(
                f"{name} with weight_decay={group['weight_decay']} (L2, not decoupled) cannot be "
                "caught up exactly in bounded time; use AdamW (decoupled weight decay)"
            )
        return _AdamRule(group, base_step)
    if isinstance(optimizer, torch.optim.Adagrad):
        if group["weight_decay"]:
            raise ValueError(
                f"Adagrad with weight_decay={group['weight_decay']} cannot be caught up exactly "
                "in bounded time; use weight_decay=0"
            )
        return _NoopRule(group, base_step, ("sum",))
    raise ValueError(
        f"optimizer {name} is not supported by the row cache (supported: SGD, Adam, AdamW, Adagrad)"
    )
