"""The exact catch-up of a row the optimizer did not step: per optimizer a rule that replays the
missed steps in closed form (SGD with momentum as 2x2 matrix products over a segment tree, Adam's
decays and bounded sums, Adagrad), each with its step's learning rate."""

from __future__ import annotations

import math
from typing import Any

import torch

from edo_monitor.nn.adam_series import (
    MomentRing,
    exact_sums,
    horner_sums,
    max_terms,
    series_terms,
    table_moments,
)
from edo_monitor.nn.cache_parts import put_rows, to_device

_CHUNK_ELEMENTS = 1 << 21  # float64 elements per catch-up chunk (16 MiB)
_KEPT_TABLES = 1024  # exact-form groups whose tables a rule keeps, per window (4.7 MB at most)


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
        """The group's hyper-parameters but the learning rate, as numbers (a tensor's value,
        also inside ``betas``: one changed in place is a change), to compare step to step."""

        def number(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return float(v)
            if isinstance(v, tuple | list):
                return tuple(number(x) for x in v)
            return v

        return tuple(
            (k, number(v))
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
        prod = to_device(prod, p.device)
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
    #: groups a :class:`~edo_monitor.nn.adam_series.MomentRing` keeps (older ones: tables)
    _ring_capacity = 1 << 14

    def __init__(self, group: dict[str, Any], base_step: int) -> None:
        super().__init__(group, base_step)
        self.beta1, self.beta2 = (float(b) for b in group["betas"])
        self.eps = float(group["eps"])
        self.amsgrad = bool(group.get("amsgrad"))
        self.wd = float(group["weight_decay"])
        self.keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())
        # beta2 = 0: v is zero after the first missed step, the terms shrink as beta1 alone
        ratio = self.beta1 if self.amsgrad or not self.beta2 else self.beta1 / math.sqrt(self.beta2)
        # the missed steps a catch-up sums (terms shrink at least as ratio ** j, at a constant
        # learning rate): until the whole rest, below ratio ** W / (1 - ratio) of the first, is
        # under half an ulp of the dtype (373 and 181 steps at the default betas). Cutting
        # float64 at 1e-13 of the first term (286 steps) left ~1e-13 of a row's movement per
        # catch-up, which Adam's dynamics amplified past 1e-12 of a resident twin
        self.windows = {
            dtype: _window(ratio, torch.finfo(dtype).eps / 2 * (1 - ratio))
            for dtype in (torch.float64, torch.float32)
        }
        self.tree = _RangeProduct(1) if self.wd else None
        self._bc = torch.zeros(2, 0, dtype=torch.float64)  # 1 - beta1^k, sqrt(1 - beta2^k)
        self._rings: dict[torch.dtype, MomentRing] = {}  # per dtype caught up in
        self._betas = torch.tensor([self.beta1, self.beta2], dtype=torch.float64)
        # the exact form's tables of groups whose window is complete, per window: step -> rows
        self._complete_tables: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        #: skip the rows without a first moment by reading them on the host (``None``: when the
        #: rows are on the host; on a device the read would wait for it, so every row is summed
        #: and those rows masked: the same values, more arithmetic)
        self.skip_still_rows: bool | None = None
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
        decay = 1 - lr * self.wd
        if self.tree is not None:
            self.tree.append(torch.tensor([[decay]], dtype=torch.float64))
        if self._rings:
            k = self.base_step + self.n  # the step just taken, as the fused step computes it
            lr_over_bc1 = lr / (1 - self.beta1**k)
            root_bc2 = math.sqrt(1 - self.beta2**k)
            for ring in self._rings.values():
                ring.add_step(self.n, lr_over_bc1, root_bc2, decay)

    def _ring(self, dtype: torch.dtype, t: int) -> MomentRing | None:
        """The moments kept for catch-ups in ``dtype``, or ``None`` for a catch-up to another
        step than the latest. Made at the first such catch-up, filled from tables with the groups
        of the steps so far (the latest ``capacity``: a one-time ``O(steps x W x K)``), then
        kept by :meth:`record`."""
        n = t - self.base_step
        if n != self.n:
            return None
        ring = self._rings.get(dtype)
        if ring is None:
            window, terms = self.windows[dtype], max_terms(dtype)
            ring = MomentRing(
                window, terms, n, self.beta1, self.beta2, self.amsgrad, self._ring_capacity
            )
            lo = max(0, n - ring.capacity)  # the groups of the steps so far, from tables
            if lo < n:
                us = torch.arange(lo, n) + self.base_step
                coef, scale, widths = self._tables(us, t, window, tail=False)
                moments, top, last, _, negative = table_moments(coef, scale, widths, terms)
                ring.fill(us - self.base_step, moments, top, last, negative)
            self._rings[dtype] = ring
        return ring

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
            idx = to_device(order, p.device)
            sub_p = p.index_select(0, idx)
            sub_state = {k: v.index_select(0, idx) for k, v in state.items()}
            self.catch_up(sub_p, sub_state, s[order], t)
            put_rows(p, idx, sub_p)
            for k, v in sub_state.items():
                put_rows(state[k], idx, v)
            return
        per = max(1, _CHUNK_ELEMENTS // (8 * p.shape[1]))  # rows a piece: its temporaries
        if rows > per:
            for a in range(0, rows, per):
                sl = slice(a, a + per)
                self.catch_up(p[sl], {k: v[sl] for k, v in state.items()}, s[sl], t)
            return
        missed = t - s  # (R,), largest first
        behind = int((missed > 0).sum())  # rows [behind, R) are at step t already
        if behind == 0:
            return
        m, v = state["exp_avg"], state["exp_avg_sq"]
        moving = m[:behind].abs().amax(dim=1) != 0  # NaN counts as moving
        # rows whose first moment is zero get no Adam update, only the decoupled decay: on the
        # host the leading ones (rows never stepped, at the oldest step) skip the sum; on a
        # device, where finding them would wait for it, every row is summed and those masked
        lead = 0
        if self.skip_still_rows or (self.skip_still_rows is None and moving.is_cpu):
            on_host = moving.cpu()
            lead = int(on_host.int().argmax()) if bool(on_host.any()) else behind
        # the sum's coefficients depend on a row only through its step s: one group per
        # distinct s (u <= rows, and <= the steps since the oldest), shared by index
        us, inv = torch.unique_consecutive(s[:behind], return_inverse=True)
        dev = p.device
        if self.wd:  # the decoupled decays of the missed steps
            decay = self._decay(us, torch.full_like(us, t))
            p[:behind].mul_(to_device(decay[inv][:, None], dev, p.dtype))
        if self.amsgrad:
            # torch's first missed step takes max(max, beta2 v), the largest of them all (v only
            # decays after it): a max below it (amsgrad switched on since the row's step, its
            # max made at 0 or left stale) is raised to it before the sum divides by it
            mx = state["max_exp_avg_sq"][:behind]
            mx.copy_(torch.maximum(mx, v[:behind] * self.beta2))
        if lead < behind:
            denom = state["max_exp_avg_sq"] if self.amsgrad else v
            sums = self._term_sums(us, inv[lead:], t, denom[lead:behind])
            # a row without a moment moves by nothing (its sum may be 0 / 0 with eps = 0)
            sums.masked_fill_(~moving[lead:, None], 0.0)
            p[lead:behind].sub_(m[lead:behind] * sums)
        # the moments' decays over the missed steps, beta1^k and beta2^k, in one pass
        decays = to_device(torch.pow(self._betas, missed[:behind, None].double()), dev, m.dtype)
        m[:behind].mul_(decays[:, :1])
        v[:behind].mul_(decays[:, 1:])

    def _tables(
        self, us: torch.Tensor, t: int, window: int, *, tail: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sum's coefficients and scales ``(u, J)`` float64 of groups ``us`` (their steps,
        ``(u,)`` ascending, each behind ``t``) and their missed steps in the window ``(u,)``:
        column ``j`` is the group's step ``s + j``, its coefficient ``lr / (1 - beta1^k) *
        beta1^j`` times the decoupled decays of the steps after it (``tail=False``: only those
        within the window), 0 after ``t``."""
        un = (t - us).clamp(max=window)
        width = int(un[0])
        j = torch.arange(1, width + 1, dtype=torch.int64)
        lr = self.lr_windows(us, width)  # (u, J): 0 after step t, past a group's missed steps
        bc1, root_bc2 = self._bias_corrections(us, width)
        jf = j.double()[None, :]
        if self.wd:
            valid = j[None, :] <= un[:, None]  # the groups' missed steps
            decay = torch.where(valid, 1 - lr * self.wd, 1.0)  # per missed step in the window
            incl = torch.flip(torch.cumprod(torch.flip(decay, [1]), 1), [1])
            after = torch.ones_like(incl)
            after[:, :-1] = incl[:, 1:]  # product of the window's decays after step j
            lr.mul_(after)
            if tail:  # the decays beyond the window
                lr.mul_(self._decay(us + un, torch.full_like(us, t))[:, None])
        coef = lr.div_(bc1).mul_(self.beta1**jf)  # 0 outside the missed steps, as lr
        scale = 1 / root_bc2 if self.amsgrad else self.beta2 ** (jf / 2) / root_bc2
        return coef, scale.expand(coef.shape), un

    def _exact_tables(
        self, us: torch.Tensor, t: int, window: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_tables`' coefficients and scales ``(u, J)`` of groups ``us`` that take the
        exact form (rows from the first steps, which keep coming back while the table warms
        up). A group whose window is complete no longer changes but for the decays after it
        (applied here): its rows are kept, up to :data:`_KEPT_TABLES` groups a window, so a
        catch-up stacks them instead of making them (about 25 operator calls a step)."""
        kept = self._complete_tables.setdefault(window, {})
        steps = us[: int((us <= t - window).sum())].tolist()  # the complete windows, oldest
        missing = [s for s in steps if s not in kept]
        if not steps or len(kept) + len(missing) > _KEPT_TABLES:
            coef, scale, _ = self._tables(us, t, window)
            return coef, scale
        if missing:
            coef, scale, _ = self._tables(torch.tensor(missing), t, window, tail=False)
            kept.update(zip(missing, zip(coef, scale, strict=True), strict=True))
        coef = torch.stack([kept[s][0] for s in steps])
        scale = torch.stack([kept[s][1] for s in steps])
        if self.wd:  # the decays after the window
            done = us[: len(steps)] + window
            coef.mul_(self._decay(done, torch.full_like(done, t))[:, None])
        if len(steps) == us.numel():
            return coef, scale
        # windows still filling: made, their columns after the missed steps coefficient 0
        fresh_coef, fresh_scale, _ = self._tables(us[len(steps) :], t, window)
        width = fresh_coef.shape[1]
        pad = (0, window - width)
        fresh_coef = torch.nn.functional.pad(fresh_coef, pad)
        fresh_scale = torch.nn.functional.pad(fresh_scale, pad, value=1.0)
        return torch.cat([coef, fresh_coef]), torch.cat([scale, fresh_scale])

    def _term_sums(
        self, us: torch.Tensor, which: torch.Tensor, t: int, denom: torch.Tensor
    ) -> torch.Tensor:
        """``sum_j coef_j / (sqrt(denom) * scale_j + eps)`` ``(R, D)`` (``denom``'s dtype) over
        the missed steps of rows of groups ``which`` ``(R,)`` (non-decreasing: the groups oldest
        first) of ``us`` (the groups' steps, ascending; coefficients and scales as
        :meth:`_tables` gives them), as the series of :mod:`edo_monitor.nn.adam_series`: the
        moments of the latest steps' groups from the rule's ring (kept as steps pass: ``O(K)`` a
        group), older groups' from their tables (``O(J K)`` a group); the groups beyond the
        series' reach term by term, from their tables.
        """
        first = int(which[0])
        us = us[first : int(which[-1]) + 1]
        which = which - first
        groups = us.numel()
        window = self.windows[denom.dtype]
        ring = self._ring(denom.dtype, t)
        kept = groups  # groups [kept, u) have their moments in the ring
        if ring is not None:
            kept = int(torch.searchsorted(us, self.base_step + ring.covers(t - self.base_step)))
        tables = self._tables(us[:kept], t, window) if kept else None
        parts = []
        if tables is not None:
            tail = torch.finfo(denom.dtype).eps / 2
            moments, top, _, ratio, unsure = table_moments(*tables, max_terms(denom.dtype), tail)
            parts.append((moments, top, ratio, unsure))
        if kept < groups:
            assert ring is not None
            moments, top, ratio, unsure = ring.gather(us[kept:] - self.base_step)
            if self.wd:  # the decays after the window (kept moments hold those within it)
                done = us[kept:] + (t - us[kept:]).clamp(max=window)
                moments = moments * self._decay(done, torch.full_like(done, t))
            parts.append((moments, top, ratio, unsure))
        moments, top, ratio, unsure = (
            parts[0] if len(parts) == 1 else (torch.cat(x, -1) for x in zip(*parts, strict=True))
        )
        terms = series_terms(moments, ratio, unsure, denom.dtype)
        root = denom.sqrt()
        exact = int((terms > max_terms(denom.dtype)).sum())
        split = int(torch.searchsorted(which, exact))  # rows of the exact groups come first
        if split == 0:
            return horner_sums(moments, top, terms, which, root, self.eps)
        if exact > kept:  # tables for the exact groups the ring holds
            coef, scale = self._exact_tables(us[:exact], t, window)
        else:
            assert tables is not None
            coef, scale = tables[0][:exact], tables[1][:exact]
        out = torch.empty_like(root)
        out[:split] = exact_sums(coef, scale, root[:split], which[:split], self.eps)
        if split < root.shape[0]:
            rest = slice(exact, None)
            out[split:] = horner_sums(
                moments[:, rest], top[rest], terms[rest], which[split:] - exact, root[split:],
                self.eps,
            )  # fmt: skip
        return out


class _NoopRule(_Rule):
    def __init__(self, group: dict[str, Any], base_step: int, keys: tuple[str, ...]) -> None:
        super().__init__(group, base_step)
        self.keys = keys
