"""The exact catch-up of a row the optimizer did not step: per optimizer a rule that replays the
missed steps in closed form (SGD with momentum as 2x2 matrix products over a segment tree, Adam's
decays and bounded sums, Adagrad), each with its step's learning rate."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_TRUNCATION = 1e-13  # relative size of the first neglected Adam catch-up term


_CHUNK_ELEMENTS = 1 << 21  # float64 elements per catch-up chunk (16 MiB)
_CACHE_ELEMENTS = 1 << 17  # float64 elements per piece of a pass that stays in cache (1 MiB)


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

    def lr_of(self, k: torch.Tensor) -> torch.Tensor:
        """Learning rates of absolute steps ``k`` (int64 tensor, each in ``(base_step, t]``)."""
        return self._lr[(k - self.base_step - 1).clamp(0, max(self.n - 1, 0))]

    def catch_up(
        self, p: torch.Tensor, state: dict[str, torch.Tensor], s: torch.Tensor, t: int
    ) -> None:
        """Bring float64 rows ``p`` ``(R, D)`` and ``state`` from steps ``s`` ``(R,)`` to ``t``."""


class _SGDRule(_Rule):
    def __init__(self, group: dict[str, Any], base_step: int) -> None:
        super().__init__(group, base_step)
        self.mu = float(group["momentum"])
        self.damp = float(group["dampening"])
        self.nesterov = bool(group["nesterov"])
        self.wd = float(group["weight_decay"])
        self.keys = ("momentum_buffer",) if self.mu else ()
        self.trivial = self.wd == 0 and self.mu == 0
        self.tree = _RangeProduct(2)

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
            first = k == 1
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
        if ratio <= 0:
            self.window = 1
        else:
            self.window = max(1, math.ceil(math.log(_TRUNCATION) / math.log(ratio)))
        self.tree = _RangeProduct(1) if self.wd else None
        self._bc = torch.zeros(2, 0, dtype=torch.float64)  # 1 - beta^k, k = 0, 1, ...
        self._saturated = 1
        while any(1 - b**self._saturated != 1.0 for b in (self.beta1, self.beta2)):
            self._saturated *= 2

    def _bias_corrections(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``1 - beta1^k`` and ``1 - beta2^k`` for absolute steps ``k`` (int64, any shape), as
        the fused step computes them (Python floats), from a table grown as steps pass; both are
        exactly 1.0 from step :attr:`_saturated` on (``beta^k`` below half an ulp of 1), so the
        table stops there (36,000 entries for ``beta2 = 0.999``)."""
        k = k.clamp(max=self._saturated)
        top = int(k.max()) if k.numel() else 0
        if top >= self._bc.shape[1]:
            n = min(max(2 * self._bc.shape[1], top + 1, 256), self._saturated + 1)
            self._bc = torch.tensor(
                [[1 - self.beta1**i for i in range(n)], [1 - self.beta2**i for i in range(n)]],
                dtype=torch.float64,
            )
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
        if p.shape[0] == 0:
            return
        m = state["exp_avg"]
        moving = (m != 0).any(dim=1).cpu()
        if not bool(moving.all()):
            # rows whose first moment is zero get no Adam update: only the decoupled decay
            dev = p.device
            still = (~moving).nonzero().reshape(-1)
            still_d = still.to(dev)
            decay = self._decay(s[still], torch.full_like(s[still], t))
            p[still_d] *= decay[:, None].to(dev)
            idx = moving.nonzero().reshape(-1)
            idx_d = idx.to(dev)
            sub_p = p[idx_d]
            sub_state = {k: v[idx_d] for k, v in state.items()}
            self._catch_up_moving(sub_p, sub_state, s[idx], t)
            p[idx_d] = sub_p
            for k, v in sub_state.items():
                state[k][idx_d] = v
            missed = (t - s[still]).double()[:, None]
            state["exp_avg_sq"][still_d] *= torch.pow(self.beta2, missed).to(dev)
            return
        self._catch_up_moving(p, state, s, t)

    def _catch_up_moving(
        self, p: torch.Tensor, state: dict[str, torch.Tensor], s: torch.Tensor, t: int
    ) -> None:
        if p.shape[0] == 0:
            return
        rows, dim = p.shape
        missed = t - s  # (R,)
        n = missed.clamp(max=self.window)
        width = int(n.max())
        if width == 0:
            return
        m, v = state["exp_avg"], state["exp_avg_sq"]
        denom_src = state["max_exp_avg_sq"] if self.amsgrad else v
        # the sum's coefficients depend on a row only through its step s: computed once per
        # distinct s (u <= rows, and <= the steps since the oldest), then shared by index
        us, inv = torch.unique(s, return_inverse=True)
        un = (t - us).clamp(max=self.window)
        j = torch.arange(1, width + 1, dtype=torch.int64)
        k = us[:, None] + j[None, :]  # (u, J) absolute step numbers
        valid = j[None, :] <= un[:, None]
        lr = torch.where(valid, self.lr_of(k), 0.0)
        bc1, bc2 = self._bias_corrections(k)
        decay = torch.where(valid, 1 - lr * self.wd, 1.0)  # per missed step in the window
        incl = torch.flip(torch.cumprod(torch.flip(decay, [1]), 1), [1])
        after = torch.ones_like(incl)
        after[:, :-1] = incl[:, 1:]  # product of the window's decays after step j
        tail = self._decay(us + un, torch.full_like(us, t))  # decays beyond the window
        jf = j.double()[None, :]
        coef = torch.where(valid, lr / bc1 * self.beta1**jf * after * tail[:, None], 0.0)
        root_bc2 = torch.sqrt(bc2)
        scale = 1 / root_bc2 if self.amsgrad else self.beta2 ** (jf / 2) / root_bc2
        dev = p.device
        coef, scale = coef.to(dev), scale.expand(coef.shape).to(dev)
        total_decay = (incl[:, 0] * tail).to(dev)
        inv_d, un_d = inv.to(dev), un.to(dev)
        per = max(1, _CHUNK_ELEMENTS // (8 * dim))
        for start in range(0, rows, per):
            sl = slice(start, start + per)
            root = torch.sqrt(denom_src[sl])  # (r, D)
            sums = self._term_sums(coef, scale, root, inv_d[sl], un_d)
            p[sl] = p[sl] * total_decay[inv_d[sl]][:, None] - m[sl] * sums
        mf = missed.double()[:, None].to(p.device)
        m.mul_(torch.pow(self.beta1, mf))
        v.mul_(torch.pow(self.beta2, mf))

    def _term_sums(
        self,
        coef: torch.Tensor,
        scale: torch.Tensor,
        root: torch.Tensor,
        which: torch.Tensor,
        width: torch.Tensor,
    ) -> torch.Tensor:
        """``sum_j coef_j / (root * scale_j + eps)`` ``(r, D)`` for rows ``r`` whose coefficients
        are row ``which`` ``(r,)`` of ``coef``, ``scale`` ``(u, J)`` (one row per distinct step,
        nonzero in its first ``width`` ``(u,)`` columns: the steps the row missed, at most J).

        Exact form: ``O(width D)`` a row. For the elements where ``q = eps / (root * min_j
        scale_j) <= 1/8`` the sum is the convergent series ``(1 / root) sum_k S_k (-eps /
        root)^k`` with moments ``S_k = sum_j coef_j / scale_j^(k+1)`` per distinct step
        (``O(u J K + r D K)``, ``K <= 21``), cut where ``q^K <= 1e-18`` (below float64 rounding);
        the other elements (``root`` near 0) take the exact form, over their row's own width
        rounded up to a power of two (a row that missed 17 steps sums 32 terms, not J). Both run
        in pieces of :data:`_CACHE_ELEMENTS` float64 elements, which stay in the CPU's cache
        between the passes of one piece (4.6x faster for the exact form than one pass over all).
        """
        x = self.eps / root  # inf where root is 0
        unused = coef == 0
        sc_min = scale.masked_fill(unused, float("inf")).amin(dim=1)
        q = x / sc_min[which][:, None]
        row_width = width[which]
        slow = ~(q <= 0.125)
        out = torch.empty_like(root)
        if not bool(slow.all()):
            self._series_sums(coef, scale, unused, root, which, x, q, slow, out)
        rr, dd = slow.nonzero(as_tuple=True)
        if rr.numel():
            out[rr, dd] = self._exact_sums(coef, scale, root, which, row_width, rr, dd)
        return out

    def _series_sums(
        self,
        coef: torch.Tensor,
        scale: torch.Tensor,
        unused: torch.Tensor,
        root: torch.Tensor,
        which: torch.Tensor,
        x: torch.Tensor,
        q: torch.Tensor,
        slow: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The series of :meth:`_term_sums` into ``out`` where ``slow`` is False (``unused``:
        ``coef == 0``; ``x = eps / root``, consumed)."""
        q_max = float(q.masked_fill(slow, 0).max())
        k_terms = 1 if q_max <= 1e-18 else math.ceil(math.log(1e-18) / math.log(q_max)) + 1
        inv = 1 / scale.masked_fill(unused, 1.0)
        moments = torch.empty(coef.shape[0], k_terms, dtype=coef.dtype, device=coef.device)
        w = coef * inv
        for k in range(k_terms):
            moments[:, k] = w.sum(dim=1)
            w.mul_(inv)
        neg_x = x.masked_fill_(slow, 0.0).neg_()
        rows = max(1, _CACHE_ELEMENTS // max(1, root.shape[1]))
        for a in range(0, root.shape[0], rows):  # Horner, in place, a piece at a time
            mom = moments.index_select(0, which[a : a + rows])  # (piece, K)
            acc = mom[:, -1:].expand(-1, root.shape[1]).clone()
            nx = neg_x[a : a + rows]
            for k in range(k_terms - 2, -1, -1):
                acc.mul_(nx).add_(mom[:, k : k + 1])
            out[a : a + rows] = acc.div_(root[a : a + rows])

    def _exact_sums(
        self,
        coef: torch.Tensor,
        scale: torch.Tensor,
        root: torch.Tensor,
        which: torch.Tensor,
        row_width: torch.Tensor,
        rr: torch.Tensor,
        dd: torch.Tensor,
    ) -> torch.Tensor:
        """The exact form of :meth:`_term_sums` for elements ``(rr, dd)`` ``(E,)`` each, ``(E,)``:
        elements grouped by their row's width rounded up to a power of two, each group summing
        only its own columns."""
        exact = torch.empty(rr.numel(), dtype=coef.dtype, device=coef.device)
        widths = row_width[rr]
        lo, hi = 0, 8
        while lo < coef.shape[1]:
            hi = min(hi, coef.shape[1])
            sel = ((widths > lo) & (widths <= hi)).nonzero().reshape(-1)
            if sel.numel():
                cols = (coef[:, :hi], scale[:, :hi])
                exact[sel] = self._exact_columns(*cols, root, which, rr[sel], dd[sel])
            lo, hi = hi, 2 * hi
        return exact

    def _exact_columns(
        self,
        coef: torch.Tensor,
        scale: torch.Tensor,
        root: torch.Tensor,
        which: torch.Tensor,
        rr: torch.Tensor,
        dd: torch.Tensor,
    ) -> torch.Tensor:
        """``sum_j coef_j / (root * scale_j + eps)`` over the columns of ``coef`` ``(u, w)`` for
        elements ``(rr, dd)``, in pieces of :data:`_CACHE_ELEMENTS`."""
        exact = torch.empty(rr.numel(), dtype=coef.dtype, device=coef.device)
        piece = max(1, _CACHE_ELEMENTS // coef.shape[1])
        # two (piece, w) buffers for every piece: fresh ones are 1 MiB allocations, above
        # the allocator's mmap threshold, so each piece would map and fault in new pages
        den_buf = coef.new_empty(min(piece, rr.numel()), coef.shape[1])
        term_buf = torch.empty_like(den_buf)
        for a in range(0, rr.numel(), piece):
            u = which[rr[a : a + piece]]
            rt = root[rr[a : a + piece], dd[a : a + piece]][:, None]
            den = torch.index_select(scale, 0, u, out=den_buf[: u.numel()])
            den.mul_(rt).add_(self.eps)
            term = torch.index_select(coef, 0, u, out=term_buf[: u.numel()])
            exact[a : a + piece] = term.div_(den).sum(dim=1)
        return exact


class _NoopRule(_Rule):
    def __init__(self, group: dict[str, Any], base_step: int, keys: tuple[str, ...]) -> None:
        super().__init__(group, base_step)
        self.keys = keys


def _make_rule(optimizer: torch.optim.Optimizer, group: dict[str, Any], base_step: int) -> _Rule:
    """The catch-up rule for ``group`` of ``optimizer``; ``ValueError`` naming what is refused."""
    name = type(optimizer).__name__
    for flag in ("fused", "capturable"):
        if group.get(flag):
            raise ValueError(f"{name} with {flag}=True is not supported by the row cache")
    if isinstance(optimizer, torch.optim.SGD):
        return _SGDRule(group, base_step)
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay")
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
