"""A device row cache over a host-resident embedding table, with exact optimizer semantics.

:class:`CachedEmbedding` / :class:`CachedEmbeddingBag` are drop-ins for ``nn.Embedding`` /
``nn.EmbeddingBag``. The full table ``(num_embeddings, embedding_dim)`` and each row's optimizer
state live in host memory (pinned when the cache is on CUDA); ``cache_rows`` rows live in the
device cache ``weight`` ``(cache_rows, embedding_dim)``, which is the ``Parameter`` the user's
optimizer holds (it does not step it: see "Every row lazy" below). Each forward:

1. the batch's unique ids are split into hits (already in a cache slot) and misses;
2. misses get free slots, or slots of evicted rows (LFU by default, LRU selectable; rows used since
   the last optimizer step, the current batch included, are never evicted); evicted rows (weight
   and optimizer state) are written back to the host;
3. missed rows are loaded with their optimizer state, after *catching up* the optimizer updates
   they missed while on the host (below);
4. ids are remapped to slots and the lookup runs on the cache (``F.embedding`` /
   ``F.embedding_bag``, so every option keeps its meaning).

Exactness. On a resident table the optimizer updates every row at every step, also those with a
zero gradient (momentum, Adam's moments, weight decay). A row on the host misses those updates;
when it is loaded again (and at every :meth:`flush`, which ``state_dict()`` calls) it gets exactly
the updates it missed, each with the learning rate that step had (schedulers included; recorded by
an optimizer step post-hook). How, per optimizer (zero gradient on the missed steps):

* ``SGD`` (momentum, dampening, Nesterov, weight decay): the update of ``(param, momentum)`` is
  linear, one 2x2 matrix per step; the product over any range of steps comes from a segment tree
  of those matrices in ``O(log steps)`` (closed form, any number of missed steps).
* ``Adam`` / ``AdamW`` (``amsgrad`` too; weight decay only decoupled): moments decay geometrically
  (closed form); the parameter's updates form a sum over the missed steps whose terms decay at least
  as ``(beta1 / sqrt(beta2)) ** j``; the first ``K`` terms (``K`` such that the ratio ** K <= 1e-13)
  are summed exactly, the rest are below float precision; decoupled decay is a product (segment
  tree). Cost ``O(rows × min(missed, K) × dim)``.
* ``Adagrad`` without weight decay: a zero gradient changes nothing.
* Refused by name (``ValueError``): L2 ``weight_decay`` with Adam or Adagrad (the update is
  nonlinear and does not decay: no bounded exact catch-up), ``fused``/``capturable`` groups, other
  optimizer classes, ``sparse=True``.

Every row lazy, the step fused (issue 23). The user's optimizer does not step ``weight``: no
``(C, D)`` gradient exists. The forward returns the batch's unique rows ``(U, D)`` through
:class:`~edo_monitor.nn.cache_step.CacheRows`; its backward adds their gradient into
``batch_rows.grad`` ``(U, D)`` (``U``: the rows touched since the last optimizer step, in the order
:meth:`CachedTable.dense_grad` gives with their ids). At the optimizer's step (a step pre-hook)
the cache updates exactly those rows (gather, update, scatter:
:func:`~edo_monitor.nn.cache_step.fused_update`) with the hyper-parameters of the group holding
``weight`` at that step, then hides ``batch_rows`` from the optimizer's own step. Each cache row
records the step it is at (``slot_step``); a row not touched keeps its value and catches up (the
closed forms below) when it is next looked up, evicted (written back with its own step and
caught up when loaded again), flushed or checkpointed. Gradients, exactly:

* ``batch_rows`` is a ``Parameter`` of the module (in ``model.parameters()``) and joins the
  optimizer group of ``weight`` at attach, so ``optimizer.zero_grad()`` / ``model.zero_grad()``
  clear it (``set_to_none`` either way) and ``clip_grad_norm_(model.parameters())`` sees the
  touched rows' gradient, whose norm is the resident table's (its other rows' gradient is zero);
  clipping scales it in place and the step uses the scaled values.
* Micro-batches before one step accumulate into the same buffer (it grows by the new rows, which
  stay pinned until the step).
* The step consumes the gradient: after it ``batch_rows.grad`` is ``None``. A resident table that
  is not zeroed between steps would sum the old gradient into the next step; the cache does not
  (every training loop zeroes). A backward of a graph built before the last step raises
  ``RuntimeError`` naming it. An optimizer step with no backward since the last one (gradient
  ``None``) is skipped for the table, as torch skips a parameter without a gradient.
* ``optimizer.state_dict()`` leaves ``batch_rows`` out (ids renumbered) and holds the full
  caught-up state; it loads into an optimizer over the uncached model and back.

Adam's catch-up sum is evaluated as a convergent series in ``eps / sqrt(v)`` per element where
that ratio is at most 1/8 of the smallest scale, exactly elsewhere; its coefficients and moments
depend on a row only through the step it is at, so they are computed once per distinct step
(``O(steps x missed x K + rows x dim x K)``, ``K <= 20``, ``steps`` the distinct steps among the
rows caught up).

The optimizer is found through a global optimizer step pre-hook on its first step, or given with
:meth:`attach`. Checkpoints: ``state_dict()`` holds the full caught-up ``weight`` ``(N, D)`` (an
``nn.Embedding`` loads it), and the attached optimizer's ``state_dict()`` holds full-table state;
both load into a cached or an uncached model.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from edo_monitor.nn.cache_step import CacheRows, fused_update, optimizer_kind
from edo_monitor.nn.embedding import BAG_MODES, EmbeddingOptions, _EdoEmbedding

__all__ = [
    "CACHE_POLICIES",
    "CacheStats",
    "CachedEmbedding",
    "CachedEmbeddingBag",
    "CachedTable",
    "optimizer_row_state_keys",
]

logger = logging.getLogger(__name__)

CACHE_POLICIES: tuple[str, ...] = ("lfu", "lru")
_TRUNCATION = 1e-13  # relative size of the first neglected Adam catch-up term
_CHUNK_ELEMENTS = 1 << 21  # float64 elements per catch-up chunk (16 MiB)


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
        ratio = self.beta1 if self.amsgrad else self.beta1 / math.sqrt(self.beta2)
        if ratio <= 0:
            self.window = 1
        else:
            self.window = max(1, math.ceil(math.log(_TRUNCATION) / math.log(ratio)))
        self.tree = _RangeProduct(1) if self.wd else None

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
        kf = k.double()
        bc1 = 1 - torch.pow(self.beta1, kf)
        bc2 = 1 - torch.pow(self.beta2, kf)
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
        inv_d = inv.to(dev)
        per = max(1, _CHUNK_ELEMENTS // (8 * dim))
        for start in range(0, rows, per):
            sl = slice(start, start + per)
            root = torch.sqrt(denom_src[sl])  # (r, D)
            sums = self._term_sums(coef, scale, root, inv_d[sl])
            p[sl] = p[sl] * total_decay[inv_d[sl]][:, None] - m[sl] * sums
        mf = missed.double()[:, None].to(p.device)
        m.mul_(torch.pow(self.beta1, mf))
        v.mul_(torch.pow(self.beta2, mf))

    def _term_sums(
        self, coef: torch.Tensor, scale: torch.Tensor, root: torch.Tensor, which: torch.Tensor
    ) -> torch.Tensor:
        """``sum_j coef_j / (root * scale_j + eps)`` ``(r, D)`` for rows ``r`` whose coefficients
        are row ``which`` ``(r,)`` of ``coef``, ``scale`` ``(u, J)`` (one row per distinct step).

        Exact form: ``O(r J D)``. For the elements where ``q = eps / (root * min_j scale_j) <=
        1/8`` the sum is the convergent series ``(1 / root) sum_k S_k (-eps / root)^k`` with
        moments ``S_k = sum_j coef_j / scale_j^(k+1)`` per distinct step (``O(u J K + r D K)``,
        ``K <= 20``), cut where ``q^K <= 1e-18`` (below float64 rounding); the other elements
        (``root`` near 0) take the exact form, element by element.
        """
        x = self.eps / root  # inf where root is 0
        sc_min = scale.masked_fill(coef == 0, float("inf")).amin(dim=1)
        q = x / sc_min[which][:, None]
        slow = ~(q <= 0.125)
        q_max = float(q.masked_fill(slow, 0).max()) if q.numel() else 0.0
        k_terms = 1 if q_max <= 1e-18 else math.ceil(math.log(1e-18) / math.log(q_max)) + 1
        inv = 1 / scale.masked_fill(coef == 0, 1.0)
        moments = []
        w = coef * inv
        for _ in range(k_terms):
            moments.append(w.sum(dim=1)[which])
            w = w * inv
        neg_x = -x.masked_fill(slow, 0.0)
        acc = moments[-1][:, None].expand_as(neg_x)
        for mk in reversed(moments[:-1]):
            acc = mk[:, None] + neg_x * acc
        out = acc / root
        rr, dd = slow.nonzero(as_tuple=True)
        if rr.numel():
            rt = root[rr, dd][:, None]
            u = which[rr]
            out[rr, dd] = (coef[u] / (rt * scale[u] + self.eps)).sum(dim=1)
        return out


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


# ----------------------------------------------------------------------------- the module
@dataclass(frozen=True)
class CacheStats:
    """Counters of a cached table.

    ``*_step`` values cover the forwards since the last optimizer step (or since the last
    :meth:`CachedTable.reset_step_stats`); the others are totals. Hits and misses count unique
    ids per forward; ``lookups``/``lookup_hits`` count every looked-up id (repeats too).
    ``h2d_bytes``/``d2h_bytes``: weight and optimizer-state bytes moved
    host→device (loads) and device→host (write-backs).
    """

    cache_rows: int
    num_embeddings: int
    hits: int
    misses: int
    evicted: int
    h2d_bytes: int
    d2h_bytes: int
    hits_step: int
    misses_step: int
    evicted_step: int
    h2d_bytes_step: int
    d2h_bytes_step: int
    peak_unique_ids: int
    lookups: int = 0
    lookup_hits: int = 0
    #: blocks loaded by a forward (on the critical path), not ahead of it by :meth:`prefetch`
    forward_loads: int = 0

    @property
    def hit_rate(self) -> float | None:
        """``hits / (hits + misses)`` over all forwards (``None`` before the first)."""
        total = self.hits + self.misses
        return self.hits / total if total else None

    @property
    def lookup_hit_rate(self) -> float | None:
        """Fraction of all looked-up ids (repeats counted) whose row was already cached."""
        return self.lookup_hits / self.lookups if self.lookups else None

    def history_totals(self) -> dict[str, int]:
        """The totals as the history's ``cache_*`` columns name them
        (:data:`edo_monitor.store.schema.CACHE_FIELDS`): rows now, lookups, lookup hits, rows
        loaded (misses), rows evicted, bytes moved either way (``h2d_bytes + d2h_bytes``)."""
        return {
            "cache_rows": self.cache_rows,
            "cache_lookups": self.lookups,
            "cache_lookup_hits": self.lookup_hits,
            "cache_rows_loaded": self.misses,
            "cache_rows_evicted": self.evicted,
            "cache_moved_bytes": self.h2d_bytes + self.d2h_bytes,
        }


def rebind_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """``param.data = data`` for a new shape, also when a live graph still holds ``param``.

    Autograd caches a parameter's gradient accumulator (with the shape it had) while any graph
    refers to it, e.g. the previous step's ``loss`` the training loop still holds; reusing it after
    a shape change fails in backward ("invalid gradient ... expected shape"). PyTorch drops that
    cache when ``.data`` changes dtype, so the data is swapped through another dtype first.
    Call with ``param.grad`` set to ``None``.
    """
    other = torch.float32 if data.dtype == torch.float64 else torch.float64
    param.data = torch.empty(0, dtype=other, device=data.device)
    param.data = data


def _pinned_empty(shape: Sequence[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Every host tensor of the cache (table copies, optimizer state) is allocated here, so a
    tier below host memory (a memory-mapped file) replaces one function."""
    t = torch.empty(tuple(shape), dtype=dtype)
    if pin:
        try:
            return t.pin_memory()
        except RuntimeError as exc:
            logger.warning("could not pin %d host bytes (%s); using pageable", t.nbytes, exc)
    return t


class CachedTable(_EdoEmbedding):
    """The row cache (see the module docstring); use :class:`CachedEmbedding` or
    :class:`CachedEmbeddingBag`, or :meth:`from_weight` to wrap an existing table.

    Args:
        options: the table's options; ``sparse=True`` is refused (``ValueError``).
        host_weight: the full table ``(N, D)`` (moved to host memory; not copied when it already is
            there, pinned when ``device`` is CUDA).
        cache_rows: rows in the device cache ``C`` (``1 <= C``; rounded up to whole blocks).
        device: where the cache lives and lookups run.
        policy: ``"lfu"`` (default) or ``"lru"`` eviction.
        block_rows: rows moved together (1 = row by row; 512–2048 = chunked loading: a miss loads
            its whole aligned block of ids).
        overflow: more unique blocks in one batch than the cache holds: ``"grow"`` (the cache grows
            to fit, logged) or ``"error"`` (``RuntimeError`` naming both numbers).
        id_frequencies: optional ``(N,)`` counts from past data: LFU starts from them and the cache
            is pre-filled with the most frequent rows (warm start).
        requires_grad: whether ``weight`` (the cache) is trainable.
    """

    edo_placement = "cached"

    def __init__(
        self,
        options: EmbeddingOptions,
        host_weight: torch.Tensor,
        cache_rows: int,
        *,
        device: torch.device | str | None = None,
        policy: str = "lfu",
        block_rows: int = 1,
        overflow: str = "grow",
        id_frequencies: torch.Tensor | None = None,
        requires_grad: bool = True,
        host_alloc: Callable[[Sequence[int], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        super().__init__(options)
        self._host_alloc = host_alloc
        if options.sparse:
            raise ValueError("sparse=True is not supported by the row cache (dense grads only)")
        if policy not in CACHE_POLICIES:
            raise ValueError(f"policy={policy!r}; expected one of {CACHE_POLICIES}")
        if overflow not in ("grow", "error"):
            raise ValueError(f"overflow={overflow!r}; expected 'grow' or 'error'")
        if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
            raise ValueError(f"block_rows={block_rows!r}; expected an int >= 1")
        n, d = options.num_embeddings, options.embedding_dim
        if tuple(host_weight.shape) != (n, d):
            raise ValueError(f"host_weight has shape {tuple(host_weight.shape)}; expected {(n, d)}")
        if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 1:
            raise ValueError(f"cache_rows={cache_rows!r}; expected an int >= 1")
        device = torch.device(device) if device is not None else host_weight.device
        self.policy = policy
        self.block_rows = block_rows
        self.overflow = overflow
        self._pin = device.type == "cuda"
        hw = host_weight.detach()
        if not hw.is_cpu:
            hw = hw.to("cpu")
        if host_alloc is not None:  # the disk tier (edo_monitor.nn.spill): no pinning
            self._pin = False
            spilled = host_alloc(hw.shape, hw.dtype)
            spilled.copy_(hw)
            hw = spilled
        if self._pin and not hw.is_pinned():
            pinned = _pinned_empty(hw.shape, hw.dtype, True)
            pinned.copy_(hw)
            hw = pinned
        self.host_weight = hw
        self.host_state: dict[str, torch.Tensor] = {}
        self.num_blocks = -(-n // block_rows)
        self.last_step = torch.zeros(n, dtype=torch.int64)
        self.block_to_slot = torch.full((self.num_blocks,), -1, dtype=torch.int64)
        self.block_freq = torch.zeros(self.num_blocks, dtype=torch.int64)
        if id_frequencies is not None:
            freq = torch.as_tensor(id_frequencies, dtype=torch.int64).reshape(-1)
            if freq.numel() != n:
                raise ValueError(f"id_frequencies has {freq.numel()} entries; expected {n}")
            padded = torch.zeros(self.num_blocks * block_rows, dtype=torch.int64)
            padded[:n] = freq
            self.block_freq = padded.view(self.num_blocks, block_rows).sum(1)
        slots = min(-(-cache_rows // block_rows), self.num_blocks)
        self._alloc_slots(slots, device, hw.dtype, requires_grad)
        # the touched rows' gradient (U, D): see "Gradients" in the module docstring
        self.batch_rows = nn.Parameter(
            torch.zeros(0, d, dtype=hw.dtype, device=device), requires_grad=requires_grad
        )
        self.batch_rows._edo_row_buffer = True  # type: ignore[attr-defined]
        self._layout_rows = torch.zeros(0, dtype=torch.int64)  # cache rows, in gradient order
        self._row_pos = torch.full((self.cache_rows,), -1, dtype=torch.int64)
        self._generation = 0
        self._stash: torch.Tensor | None = None
        self._kind = ""
        self.t = 0
        self._tick = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._rule: _Rule | None = None
        self._hooks: list[Any] = []
        self._auto_hook: Any = None
        self._had_grad = False
        self._side_stream: Any = None
        self._counters = dict.fromkeys(
            (
                "hits",
                "misses",
                "evicted",
                "h2d_bytes",
                "d2h_bytes",
                "lookups",
                "lookup_hits",
                "forward_loads",
            ),
            0,
        )
        #: the eviction hook of a :class:`~edo_monitor.nn.lookahead.LookAhead` (``None``: none)
        self._lookahead: Any = None
        self._step_counters = dict(self._counters)
        self.peak_unique_ids = 0
        # an OrderedDict: RemovableHandle holds a weak reference to it
        self._lookup_listeners: OrderedDict[int, Callable[[torch.Tensor, torch.Tensor], None]] = (
            OrderedDict()
        )
        self.register_state_dict_post_hook(_module_state_dict_hook)
        self.register_load_state_dict_pre_hook(_module_load_pre_hook)
        if id_frequencies is not None:
            top = torch.argsort(self.block_freq, descending=True, stable=True)[:slots]
            with torch.no_grad():
                self._load_blocks(top[self.block_freq[top] > 0])

    def _host_empty(self, shape: Sequence[int]) -> torch.Tensor:
        """A host tensor for full-table state: the disk tier's allocator when given, else pinned
        (CUDA) or pageable memory."""
        if self._host_alloc is not None:
            return self._host_alloc(shape, self.host_weight.dtype)
        return _pinned_empty(shape, self.host_weight.dtype, self._pin)

    def _alloc_slots(
        self, slots: int, device: torch.device, dtype: torch.dtype, requires_grad: bool
    ) -> None:
        self.slot_to_block = torch.full((slots,), -1, dtype=torch.int64)
        self.slot_last_use = torch.zeros(slots, dtype=torch.int64)
        self.slot_pinned = torch.zeros(slots, dtype=torch.bool)
        # slots pinned since the last optimizer step, so the step clears them in O(batch), not in
        # O(cache); None: too many listed (or the slots were renumbered), clear them all
        self._pinned_since_step: list[torch.Tensor] | None = []
        self._pinned_listed = 0
        rows = slots * self.block_rows
        self.slot_step = torch.zeros(rows, dtype=torch.int64)  # the step each cache row is at
        self.weight = nn.Parameter(
            torch.zeros(rows, self.embedding_dim, dtype=dtype, device=device),
            requires_grad=requires_grad,
        )

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, options: EmbeddingOptions, cache_rows: int, **kwargs: Any
    ) -> CachedTable:
        """Wrap a full table ``(N, D)`` (not copied when already in host memory)."""
        return cls(options, weight, cache_rows, **kwargs)

    @property
    def cache_rows(self) -> int:
        """Rows in the device cache ``C``."""
        return int(self.weight.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the cache lives."""
        return self.weight.device

    def host_bytes(self) -> int:
        """Bytes of the host table and the host optimizer state."""
        n = self.host_weight.numel() * self.host_weight.element_size()
        return n + sum(t.numel() * t.element_size() for t in self.host_state.values())

    def row_bytes(self) -> int:
        """Device bytes per cache row: weight + the per-row optimizer state (no gradient: the
        gradient exists only for the touched rows, ``batch_rows``)."""
        es = self.weight.element_size() * self.embedding_dim
        return es * (1 + len(self._state_keys()))

    def stats(self) -> CacheStats:
        """Current :class:`CacheStats`."""
        c, s = self._counters, self._step_counters
        return CacheStats(
            self.cache_rows,
            self.num_embeddings,
            c["hits"],
            c["misses"],
            c["evicted"],
            c["h2d_bytes"],
            c["d2h_bytes"],
            s["hits"],
            s["misses"],
            s["evicted"],
            s["h2d_bytes"],
            s["d2h_bytes"],
            self.peak_unique_ids,
            c["lookups"],
            c["lookup_hits"],
            c["forward_loads"],
        )

    def reset_step_stats(self) -> None:
        """Start a new per-step window of counters (done at every optimizer step)."""
        self._step_counters = dict.fromkeys(self._counters, 0)

    def _count(self, **values: int) -> None:
        for k, v in values.items():
            self._counters[k] += v
            self._step_counters[k] += v

    def extra_repr(self) -> str:
        return super().extra_repr() + f", cache_rows={self.cache_rows}, policy={self.policy}"

    # ------------------------------------------------------------------ optimizer
    def _opt_state(self) -> dict[str, Any]:
        if self._optimizer is None:
            return {}
        return self._optimizer.state.get(self.weight, {})

    def _state_keys(self) -> tuple[str, ...]:
        return self._rule.keys if self._rule is not None else ()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer``'s semantics for rows outside the cache (see the module docstring).

        Registers step pre/post hooks (steps and learning rates) and state-dict hooks (full-table
        state) on ``optimizer``. Existing state of this table in ``optimizer``: full-table state
        ``(N, D)`` (a loaded checkpoint, a converted live table) moves to the host and the cache
        gets its slots' rows; cache-shaped state ``(C, D)`` is kept.

        Raises:
            ValueError: the optimizer does not step ``weight``, its class or settings are refused
                (named), or another optimizer is already attached.
        """
        if self._optimizer is optimizer:
            return
        if self._optimizer is not None:
            raise ValueError("another optimizer is already attached to this cached table")
        group = _group_of(optimizer, self.weight)
        state = optimizer.state.get(self.weight, {})
        step = state.get("step")
        has_buffer = state.get("momentum_buffer") is not None
        t = int(step) if step is not None else (1 if has_buffer else 0)
        rule = _make_rule(optimizer, group, t)
        kind = optimizer_kind(optimizer)
        n, d = self.num_embeddings, self.embedding_dim
        host_state: dict[str, torch.Tensor] = {}
        new_state: dict[str, torch.Tensor] = {}
        for key in rule.keys:
            value = state.get(key)
            init = float(group.get("initial_accumulator_value", 0.0)) if key == "sum" else 0.0
            if value is None:
                hs = self._host_empty((n, d))
                hs.fill_(init)
                host_state[key] = hs
            elif tuple(value.shape) == (n, d):  # full-table state in id order
                hs = value.detach()
                if self._host_alloc is not None:
                    spilled = self._host_alloc(hs.shape, hs.dtype)
                    spilled.copy_(hs)
                    hs = spilled
                elif not hs.is_cpu:
                    hs = hs.to("cpu")
                host_state[key] = hs
                new_state[key] = self._gather_rows(hs).to(self.device)
            elif tuple(value.shape) == tuple(self.weight.shape):  # cache layout: scatter to ids
                hs = self._host_empty((n, d))
                hs.fill_(init)  # rows never cached hold the initial state
                used = (self.slot_to_block >= 0).nonzero().reshape(-1)
                ids, real = self._block_rows_of(self.slot_to_block[used])
                hs[ids[real]] = value.detach().cpu()[self._slot_rows(used)[real]]
                host_state[key] = hs
            else:
                raise ValueError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}; expected the table "
                    f"{(n, d)} or the cache {tuple(self.weight.shape)}"
                )
        # nothing above changed the optimizer: commit now
        if new_state:
            live = optimizer.state[self.weight]
            for key, value in new_state.items():
                live[key] = value
        self.host_state = host_state
        self._optimizer = optimizer
        self._rule = rule
        self._kind = kind
        self.t = t
        self.last_step.fill_(t)
        self.slot_step.fill_(t)
        # the row buffer joins the table's group, so the optimizer's zero_grad clears it; its
        # step never sees it (hidden at the step) and its state_dict() leaves it out
        if not any(p is self.batch_rows for g in optimizer.param_groups for p in g["params"]):
            params = group["params"]
            at = next(i for i, p in enumerate(params) if p is self.weight)
            group["params"] = [*params[: at + 1], self.batch_rows, *params[at + 1 :]]
        optimizer.state.pop(self.batch_rows, None)
        # the auto-attach hook (if any) may be running now, inside torch's loop over the global
        # pre-hooks: it is removed after this step (removing it now would change that dict)
        ref = weakref.ref(self)

        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            table = ref()
            if table is not None:
                table._before_step(opt)

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            table = ref()
            if table is not None:
                table._after_step(opt)

        def sd_post(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
            table = ref()
            return table._optimizer_state_dict(opt, sd) if table is not None else sd

        def load_pre(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
            table = ref()
            return table._optimizer_load(opt, sd) if table is not None else sd

        self._hooks = [
            optimizer.register_step_pre_hook(pre),
            optimizer.register_step_post_hook(post),
            optimizer.register_state_dict_post_hook(sd_post),
            optimizer.register_load_state_dict_pre_hook(load_pre),
        ]

    def detach_optimizer(self) -> None:
        """Remove the hooks :meth:`attach` registered and the row buffer from the optimizer's
        groups (the module forgets the optimizer)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._optimizer is not None:  # the row buffer leaves the optimizer with the hooks
            for g in self._optimizer.param_groups:
                if any(p is self.batch_rows for p in g["params"]):
                    g["params"] = [p for p in g["params"] if p is not self.batch_rows]
        self._optimizer = None
        self._rule = None

    def _auto_attach(self) -> None:
        if self._optimizer is not None or self._auto_hook is not None:
            return
        ref = weakref.ref(self)

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            table = ref()
            if table is None or table._optimizer is not None:
                return
            if any(p is table.weight for g in opt.param_groups for p in g["params"]):
                table.attach(opt)  # registers the instance pre-hook, which runs right after

        self._auto_hook = register_optimizer_step_pre_hook(hook)

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self._optimizer or self._rule is None:
            return
        group = _group_of(optimizer, self.weight)
        if _Rule._hyper(group) != self._rule.hyper:
            # hyper-parameters changed: every host row catches up under the old ones first
            self.flush()
            self._rule = _make_rule(optimizer, group, self.t)
        grad = self.batch_rows.grad
        if grad is None:
            return  # as a resident table with no gradient: the optimizer skips it
        with torch.no_grad():
            self._step_rows(group, grad)
        self.t += 1
        self._rule.record(float(group["lr"]))
        if self._kind != "sgd":
            self._cache_state()["step"] = torch.tensor(float(self.t))
        # hidden from the optimizer's own step (it skips parameters without a gradient)
        self._stash, self.batch_rows.grad = grad, None

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._auto_hook is not None:
            self._auto_hook.remove()
            self._auto_hook = None
        if optimizer is not self._optimizer or self._rule is None:
            return
        self._clear_pins()
        if self._stash is not None:  # the step consumed the gradient: a new layout begins
            self._stash = None
            self._generation += 1
            self._set_layout(torch.zeros(0, dtype=torch.int64), None)
        self.reset_step_stats()

    # ------------------------------------------------------------------ lazy rows, fused step
    def _cache_state(self) -> dict[str, Any]:
        """The optimizer's state of the cache ``(C, D)`` per key, made from the host state when
        absent (before the first step)."""
        assert self._optimizer is not None
        state = self._optimizer.state[self.weight]
        for key in self._state_keys():
            if key not in state:
                state[key] = self._gather_rows(self.host_state[key]).to(
                    self.device, self.weight.dtype
                )
        return state

    def _catch_up_rows(self, rows: torch.Tensor) -> None:
        """Bring cache ``rows`` ``(R,)`` (host int64) behind step ``t`` up to it, in place."""
        if self._rule is None or rows.numel() == 0:
            return
        s = self.slot_step[rows]
        stale = s < self.t
        if not bool(stale.any()):
            return
        rows, s = rows[stale], s[stale]
        state = self._cache_state() if self._state_keys() else {}
        step = max(1, _CHUNK_ELEMENTS // max(1, self.embedding_dim * 4))
        for start in range(0, rows.numel(), step):
            r = rows[start : start + step].to(self.device)
            w64 = self.weight.data[r].double()
            st64 = {k: state[k][r].double() for k in self._state_keys()}
            self._rule.catch_up(w64, st64, s[start : start + step], self.t)
            self.weight.data[r] = w64.to(self.weight.dtype)
            for k, v in st64.items():
                state[k][r] = v.to(state[k].dtype)
        self.slot_step[rows] = self.t

    def _step_rows(self, group: dict[str, Any], grad: torch.Tensor) -> None:
        """The fused step t -> t+1 of the layout's rows with their gradient ``(U, D)``."""
        rows = self._layout_rows
        if rows.numel() == 0:
            return
        self._catch_up_rows(rows)  # rows carried from an earlier step
        r = rows.to(self.device)
        state = self._cache_state() if self._state_keys() else {}
        p = self.weight.data[r]
        st = {k: state[k][r] for k in self._state_keys()}
        fused_update(self._kind, group, p, grad.to(p.dtype), st, self.t + 1)
        self.weight.data[r] = p
        for k, v in st.items():
            state[k][r] = v
        self.slot_step[rows] = self.t + 1

    def _set_layout(self, rows: torch.Tensor, grad: torch.Tensor | None) -> None:
        """The gradient layout becomes ``rows`` (host int64 cache rows) with ``grad``."""
        old = self._layout_rows
        if old.numel():
            self._row_pos[old] = -1
        self._layout_rows = rows
        self._row_pos[rows] = torch.arange(rows.numel())
        self.batch_rows.grad = None
        self.batch_rows.data = torch.zeros(
            rows.numel(), self.embedding_dim, dtype=self.weight.dtype, device=self.device
        )
        self.batch_rows.grad = grad

    def _layout_slots(self) -> torch.Tensor:
        """Slots of the rows holding a gradient (never evicted: it would lose it)."""
        return self._layout_rows // self.block_rows  # repeats allowed: used as an index

    def _layout_add(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions ``(U,)`` of unique cache ``rows`` in the gradient layout (appended)."""
        pos = self._row_pos[rows]
        new = rows[pos < 0]
        if new.numel():
            grad = self.batch_rows.grad
            if grad is not None:
                pad = grad.new_zeros(new.numel(), self.embedding_dim)
                grad = torch.cat([grad.detach(), pad])
            self._set_layout(torch.cat([self._layout_rows, new]), grad)
            pos = self._row_pos[rows]
        return pos

    def _accumulate_grad(
        self, positions: torch.Tensor, generation: int, grad: torch.Tensor
    ) -> None:
        """Backward of :class:`CacheRows`: add ``grad`` ``(U, D)`` at ``positions``."""
        if generation != self._generation:
            raise RuntimeError(
                "cached table: a backward ran after the optimizer step that followed its "
                "forward; run backward before optimizer.step() (the cache's gradient rows of "
                "that forward are no longer laid out)"
            )
        with torch.no_grad():
            g = self.batch_rows.grad
            if g is None:
                g = torch.zeros_like(self.batch_rows)
                g.index_add_(0, positions.to(g.device), grad.to(g.dtype))
                self.batch_rows.grad = g
            else:
                g.index_add_(0, positions.to(g.device), grad.to(g.dtype))

    def dense_grad(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cache's pending gradient as ``(ids (U,) int64 host, grad (U, D))``, or ``None``."""
        g = self.batch_rows.grad
        if g is None:
            return None
        rows = self._layout_rows
        r = self.block_rows
        blocks = self.slot_to_block[rows // r]
        ids = blocks * r + rows % r
        return ids, g

    def _pin_slots(self, slots: torch.Tensor) -> None:
        """Pin ``slots`` (their gradient is pending) until the next optimizer step."""
        self.slot_pinned[slots] = True
        if self._pinned_since_step is None:
            return
        self._pinned_listed += slots.numel()
        if self._pinned_listed > self.slot_pinned.numel():  # forwards without steps: stop listing
            self._pinned_since_step = None
        else:
            self._pinned_since_step.append(slots)

    def _clear_pins(self) -> None:
        """Unpin every slot (after an optimizer step): the listed ones, or all when unlisted."""
        listed = self._pinned_since_step
        if listed is None:
            self.slot_pinned.zero_()
        elif listed:
            self.slot_pinned[torch.cat(listed)] = False
        self._pinned_since_step = []
        self._pinned_listed = 0

    # ------------------------------------------------------------------ moving rows
    def _block_rows_of(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids ``(B*R,)`` of ``blocks`` and whether each is a real row (``< N``)."""
        r = self.block_rows
        ids = (blocks[:, None] * r + torch.arange(r)[None, :]).reshape(-1)
        return ids, ids < self.num_embeddings

    def _slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        r = self.block_rows
        return (slots[:, None] * r + torch.arange(r)[None, :]).reshape(-1)

    def _gather_rows(self, host: torch.Tensor) -> torch.Tensor:
        """Rows of a full host tensor ``(N, D)`` for every cache slot ``(C, D)`` (free: zero)."""
        out = torch.zeros(self.cache_rows, self.embedding_dim, dtype=host.dtype)
        used = (self.slot_to_block >= 0).nonzero().reshape(-1)
        if used.numel():
            ids, real = self._block_rows_of(self.slot_to_block[used])
            rows = self._slot_rows(used)
            out[rows[real]] = host[ids[real]]
        return out

    def _write_back(self, slots: torch.Tensor) -> None:
        """Copy cache ``slots`` (weight + state) to the host; their rows are current (step t)."""
        if slots.numel() == 0:
            return
        ids, real = self._block_rows_of(self.slot_to_block[slots])
        rows = self._slot_rows(slots)[real]
        ids = ids[real]
        state = self._opt_state()
        moved = 0
        w = self.weight.detach()[rows.to(self.device)].to("cpu")
        self.host_weight[ids] = w
        self.last_step[ids] = self.slot_step[rows]  # lazy: caught up when next loaded
        moved += w.numel() * w.element_size()
        for key in self._state_keys():
            value = state.get(key)
            if value is not None:
                rows_state = value.detach()[rows.to(value.device)].to("cpu")
                self.host_state[key][ids] = rows_state.to(self.host_state[key].dtype)
                moved += rows_state.numel() * rows_state.element_size()
        self._count(d2h_bytes=moved)

    def _load_blocks(self, blocks: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Load ``blocks`` (caught up to step t) into free ``slots`` (default: the first free)."""
        if blocks.numel() == 0:
            return
        if slots is None:
            slots = (self.slot_to_block < 0).nonzero().reshape(-1)[: blocks.numel()]
        self._place_staged(self._stage_blocks(blocks), slots)

    def _stage_blocks(self, blocks: torch.Tensor) -> dict[str, Any]:
        """Rows of host ``blocks`` (not cached) caught up to step t, copied to the device (on
        CUDA on the side stream, not waited for): ``{"blocks", "ids", "real", "w", "st", "t",
        "s"}``. Placed into cache slots by :meth:`_place_staged`, now or after a later optimizer
        step (the rows, not cached, take no gradient: the lazy catch-up covers those steps)."""
        ids, real = self._block_rows_of(blocks)
        ids = ids[real]
        s = self.last_step[ids]
        w = self.host_weight[ids]
        keys = self._state_keys()
        st = {k: self.host_state[k][ids] for k in keys}
        if self._rule is not None and bool((s < self.t).any()):
            w64 = w.double()
            st64 = {k: v.double() for k, v in st.items()}
            self._rule.catch_up(w64, st64, s, self.t)
            w = w64.to(w.dtype)
            st = {k: v.to(st[k].dtype) for k, v in st64.items()}
        stream = self._load_stream()
        if stream is not None:  # CUDA: copy on a side stream; the placing waits for it
            with torch.cuda.stream(stream):
                w = w.to(self.device, non_blocking=True)
                st = {k: v.to(self.device, non_blocking=True) for k, v in st.items()}
        staged = {"blocks": blocks, "ids": ids, "real": real, "w": w, "st": st, "t": self.t}
        staged["s"] = s
        return staged

    def _place_staged(self, staged: dict[str, Any], slots: torch.Tensor) -> None:
        """Put rows staged by :meth:`_stage_blocks` into free cache ``slots``."""
        blocks, w, st = staged["blocks"], staged["w"], staged["st"]
        rows = self._slot_rows(slots)[staged["real"]]
        state = self._opt_state()
        moved = w.numel() * w.element_size()
        dev_rows = rows.to(self.device)
        stream = self._load_stream()
        if stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            w.record_stream(current)
            for v in st.values():
                v.record_stream(current)
        self.weight.data[dev_rows] = w.to(self.device, self.weight.dtype)
        for key in self._state_keys():
            value = state.get(key)
            if value is not None:
                value.data[rows.to(value.device)] = st[key].to(value.device, value.dtype)
                moved += st[key].numel() * st[key].element_size()
        self.slot_to_block[slots] = blocks
        self.block_to_slot[blocks] = slots
        self.slot_step[rows] = staged["t"]
        self._count(misses=int(blocks.numel()), h2d_bytes=moved)

    def _load_stream(self) -> Any:
        if self.device.type != "cuda":
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    def _evict(self, count: int, protect: torch.Tensor) -> torch.Tensor:
        """``count`` slots for new blocks: free ones first, then victims (written back)."""
        free = (self.slot_to_block < 0).nonzero().reshape(-1)
        if free.numel() >= count:
            return free[:count]
        need = count - free.numel()
        held = self._layout_slots()
        if held.numel():
            protect = protect.clone()
            protect[held] = True
        la = self._lookahead
        if la is not None:  # rows of the running and the prefetched batches stay
            protect = la.protect(self, protect)
        candidates = ((self.slot_to_block >= 0) & ~protect).nonzero().reshape(-1)
        if candidates.numel() < need:
            raise _CacheFullError(int(candidates.numel() + free.numel()))
        last = self.slot_last_use[candidates]
        if self.policy == "lfu":
            freq = self.block_freq[self.slot_to_block[candidates]]
            # least frequent first, ties: least recently used
            score = freq * (self._tick + 1) + last
        else:
            score = last
        if la is not None:  # next use inside the look-ahead window first (Belady)
            score = la.score(self, self.slot_to_block[candidates], score)
        # the need smallest scores (last use breaks LFU ties; ticks are unique per forward)
        order = torch.topk(score, need, largest=False, sorted=False).indices
        victims = candidates[order]
        self._write_back(victims)
        self.block_to_slot[self.slot_to_block[victims]] = -1
        self.slot_to_block[victims] = -1
        self._count(evicted=int(victims.numel()))
        return torch.cat([free, victims])

    def _ensure(
        self, blocks: torch.Tensor, *, count: bool, slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Make unique ``blocks`` resident; returns their slots. Grows or raises when too many.

        ``slots``: ``block_to_slot[blocks]`` when the caller has it already.
        """
        if slots is None:
            slots = self.block_to_slot[blocks]
        hit = slots >= 0
        miss = blocks[~hit]
        if count:
            self._count(hits=int(hit.sum()))
        if miss.numel():
            if count:
                self._count(forward_loads=int(miss.numel()))
            protect = self.slot_pinned.clone()
            protect[slots[hit]] = True
            try:
                new = self._evict(miss.numel(), protect)
            except _CacheFullError as full:
                needed = int(protect.sum()) + miss.numel()
                if self.overflow == "error":
                    raise RuntimeError(
                        f"the batch needs {needed * self.block_rows} cache rows (its unique ids "
                        f"plus rows used since the last optimizer step) but the cache holds "
                        f"{self.cache_rows} rows ({full.available} free or evictable blocks); "
                        f"grow the cache or pass overflow='grow'"
                    ) from None
                logger.warning(
                    "cached table: %d rows needed, cache has %d; growing it",
                    needed * self.block_rows,
                    self.cache_rows,
                )
                self.resize(needed * self.block_rows)
                return self._ensure(blocks, count=False)
            self._load_blocks(miss, new)
            slots = self.block_to_slot[blocks]
        return slots

    # ------------------------------------------------------------------ forward
    def _remap(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """The batch's unique cache rows ``(U,)`` (host int64, made resident and current), each
        id's place among them (``input``'s shape, on the cache device) and the padding row's
        place (``None`` when the batch has no padding id)."""
        flat = input.reshape(-1)
        if flat.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input must be an integer tensor (int64/int32), got {flat.dtype}")
        ids = flat.to("cpu", torch.int64)
        if ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= self.num_embeddings:
                raise IndexError(
                    f"index out of range: ids must be in [0, {self.num_embeddings}), got "
                    f"[{lo}, {hi}]"
                )
        r = self.block_rows
        blocks = ids // r if r > 1 else ids
        uniq, inverse, counts = torch.unique(blocks, return_inverse=True, return_counts=True)
        if r == 1:
            uniq_ids, id_counts = uniq, counts
        else:
            uniq_ids, id_place, id_counts = torch.unique(
                ids, return_inverse=True, return_counts=True
            )
        for listener in tuple(self._lookup_listeners.values()):
            listener(uniq_ids, id_counts)
        slots = self.block_to_slot[uniq]
        present = slots >= 0
        self._count(lookups=int(ids.numel()), lookup_hits=int(counts[present].sum()))
        self.peak_unique_ids = max(self.peak_unique_ids, int(uniq_ids.numel()))
        self._tick += 1
        with torch.no_grad():
            slots = self._ensure(uniq, count=True, slots=slots)
        self.block_freq[uniq] += 1
        self.slot_last_use[slots] = self._tick
        if torch.is_grad_enabled() and self.weight.requires_grad:
            self._pin_slots(slots)  # its gradient is pending until the optimizer step
        if r == 1:
            urows, place = slots, inverse
        else:  # the unique ids' rows: distinct, in the unique ids' order
            urows = self.block_to_slot[uniq_ids // r] * r + uniq_ids % r
            place = id_place
        pad_pos = None
        pad = self.padding_idx
        if pad is not None and uniq_ids.numel():
            i = int(torch.searchsorted(uniq_ids, pad))
            if i < uniq_ids.numel() and int(uniq_ids[i]) == pad:
                pad_pos = i  # urows are in the unique ids' order
        self._catch_up_rows(urows)
        return urows, place.reshape(input.shape).to(self.device), pad_pos

    def add_lookup_listener(
        self, listener: Callable[[torch.Tensor, torch.Tensor], None]
    ) -> RemovableHandle:
        """Call ``listener(ids, counts)`` at every forward with the batch's distinct ids and how
        often each occurs (two ``(U,)`` int64 host tensors, ids ascending, ``padding_idx``
        included), before any row moves: the unique the cache computes anyway, shared (the agent's
        :class:`~edo_monitor.measure.frequency.LookupCounter` counts through it instead of a second
        ``torch.unique`` in a forward pre-hook). The listener must not modify the tensors; an
        exception it raises propagates into the forward. Returns a handle whose ``remove()``
        unregisters it.
        """
        handle = RemovableHandle(self._lookup_listeners)
        self._lookup_listeners[handle.id] = listener
        return handle

    def prefetch(self, next_ids: torch.Tensor) -> None:
        """Load the rows of ``next_ids`` now (before the next forward needs them).

        On CUDA the copies run on a side stream, overlapping compute. Rows used since the last
        optimizer step are not evicted. Counted as misses, not as hits, in :meth:`stats`.
        """
        ids = next_ids.reshape(-1).to("cpu", torch.int64)
        if ids.numel() == 0:
            return
        r = self.block_rows
        blocks = torch.unique(ids // r if r > 1 else ids)
        if blocks.numel() > self.slot_to_block.numel():
            blocks = blocks[: self.slot_to_block.numel()]
        with torch.no_grad():
            slots = self.block_to_slot[blocks]
            miss = blocks[slots < 0]
            if miss.numel():
                protect = self.slot_pinned.clone()
                protect[slots[slots >= 0]] = True  # the hits of these ids stay too
                try:
                    new = self._evict(miss.numel(), protect)
                except _CacheFullError:
                    return  # prefetch is a hint: the forward loads what it needs
                self._load_blocks(miss, new)

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embedding / EmbeddingBag lookup through the cache (shapes as ``nn.Embedding(Bag)``).

        The lookup runs on the batch's unique rows ``(U, D)`` (``F.embedding`` /
        ``F.embedding_bag`` with the ids' places among them, so every option keeps its meaning).
        Under ``torch.compile`` this forward runs eagerly (``torch.compiler.disable``): the
        cache's bookkeeping changes sizes every step, and compiling it recompiled at every step;
        the model around it compiles once per input shape, with one graph break here.
        """
        if offsets is not None and self.options.bag_mode is None:
            raise TypeError("offsets/per_sample_weights are only for bag tables")
        if per_sample_weights is not None and self.options.bag_mode is None:
            raise TypeError("offsets/per_sample_weights are only for bag tables")
        return self._lookup(input, offsets, per_sample_weights)

    @torch.compiler.disable
    def _lookup(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        if self._optimizer is None and self.weight.requires_grad:
            self._auto_attach()
        training = torch.is_grad_enabled() and self.weight.requires_grad
        urows, place, pad_pos = self._remap(input)
        dev_rows = urows.to(self.device)
        if training:
            positions = self._layout_add(urows)
            rows = CacheRows.apply(self.weight, dev_rows, self, positions, self._generation)
        else:
            rows = self.weight.detach().index_select(0, dev_rows)
        o = self.options
        if o.bag_mode is None:
            out = F.embedding(place, rows, pad_pos, o.max_norm, o.norm_type, o.scale_grad_by_freq)
        else:
            dev = self.device
            out = F.embedding_bag(
                place,
                rows,
                offsets.to(dev) if offsets is not None else None,
                o.max_norm,
                o.norm_type,
                o.scale_grad_by_freq,
                o.bag_mode,
                False,
                per_sample_weights.to(dev) if per_sample_weights is not None else None,
                o.include_last_offset,
                pad_pos,
            )
        if o.max_norm is not None:  # the renormalised rows are the table's rows now
            with torch.no_grad():
                self.weight.data[dev_rows] = rows.detach()
        return out

    # ------------------------------------------------------------------ flush, resize, resident
    @torch.no_grad()
    def flush(self) -> None:
        """Bring every host row up to the current step and copy the cache to the host.

        After it, ``host_weight`` and ``host_state`` are the full table a resident twin would have
        now. Cost: one catch-up of the rows that missed steps, in chunks.
        """
        used = (self.slot_to_block >= 0).nonzero().reshape(-1)
        if used.numel():
            ids, real = self._block_rows_of(self.slot_to_block[used])
            self._catch_up_rows(self._slot_rows(used)[real])
        if self._rule is not None:
            behind = (self.last_step < self.t).nonzero().reshape(-1)
            step = max(1, _CHUNK_ELEMENTS // max(1, self.embedding_dim * 4))
            for start in range(0, behind.numel(), step):
                ids = behind[start : start + step]
                w64 = self.host_weight[ids].double()
                st64 = {k: self.host_state[k][ids].double() for k in self._state_keys()}
                self._rule.catch_up(w64, st64, self.last_step[ids], self.t)
                self.host_weight[ids] = w64.to(self.host_weight.dtype)
                for k, v in st64.items():
                    self.host_state[k][ids] = v.to(self.host_state[k].dtype)
            self.last_step.fill_(self.t)
        used = (self.slot_to_block >= 0).nonzero().reshape(-1)
        self._write_back(used)

    @torch.no_grad()
    def resize(self, cache_rows: int) -> None:
        """Change the cache to ``cache_rows`` rows (rounded up to whole blocks, at most the table).

        Growing keeps every cached row in its slot. Shrinking keeps the rows used since the last
        optimizer step and then the most valuable ones (by the eviction policy), writing the others
        back. The same ``Parameter`` object is kept (its data, gradient and optimizer state are
        rebound to new tensors), so the optimizer keeps stepping it.

        Raises:
            ValueError: ``cache_rows < 1``, or fewer rows than those used since the last step.
        """
        if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 1:
            raise ValueError(f"cache_rows={cache_rows!r}; expected an int >= 1")
        new_slots = min(-(-cache_rows // self.block_rows), self.num_blocks)
        old_slots = self.slot_to_block.numel()
        if new_slots == old_slots:
            return
        used = (self.slot_to_block >= 0).nonzero().reshape(-1)
        if new_slots < used.numel():
            held = self.slot_pinned.clone()
            held[self._layout_slots()] = True
            pinned = held[used]
            if int(pinned.sum()) > new_slots:
                raise ValueError(
                    f"cannot shrink to {cache_rows} rows: {int(pinned.sum()) * self.block_rows} "
                    "rows are used since the last optimizer step"
                )
            last = self.slot_last_use[used]
            if self.policy == "lfu":
                score = self.block_freq[self.slot_to_block[used]] * (self._tick + 1) + last
            else:
                score = last.clone()
            score = torch.where(pinned, torch.iinfo(torch.int64).max, score)
            order = torch.argsort(score, descending=True, stable=True)
            keep, drop = used[order[:new_slots]], used[order[new_slots:]]
            self._write_back(drop)
            self.block_to_slot[self.slot_to_block[drop]] = -1
            self._count(evicted=int(drop.numel()))
        else:
            keep = used
        # new layout: kept slots first (in their old order when growing)
        keep = keep.sort().values
        new_index = torch.arange(keep.numel())
        old_rows = self._slot_rows(keep).to(self.device)
        new_rows = self._slot_rows(new_index).to(self.device)
        rows = new_slots * self.block_rows
        p = self.weight

        def moved(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            out[new_rows] = t[old_rows]
            return out

        new_data = moved(p.data)
        new_grad = moved(p.grad) if p.grad is not None else None
        state = self._opt_state()
        new_state = {
            k: moved(v)
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape)
        }
        if self._rule is not None and "sum" in self._state_keys() and "sum" in new_state:
            group = _group_of(self._optimizer, p)  # type: ignore[arg-type]
            fresh = torch.ones(rows, dtype=torch.bool, device=p.device)
            fresh[new_rows] = False
            new_state["sum"][fresh] = float(group.get("initial_accumulator_value", 0.0))
        blocks = self.slot_to_block[keep]
        last_use, pinned = self.slot_last_use[keep], self.slot_pinned[keep]
        old_rows_h, new_rows_h = old_rows.cpu(), new_rows.cpu()
        slot_step = torch.zeros(rows, dtype=torch.int64)
        slot_step[new_rows_h] = self.slot_step[old_rows_h]
        row_map = torch.full((old_slots * self.block_rows,), -1, dtype=torch.int64)
        row_map[old_rows_h] = new_rows_h
        layout = row_map[self._layout_rows]  # the layout's rows are pinned, so kept
        # commit
        p.grad = None
        rebind_data(p, new_data)
        p.grad = new_grad
        for k, v in new_state.items():
            state[k] = v
        self.slot_to_block = torch.full((new_slots,), -1, dtype=torch.int64)
        self.slot_to_block[new_index] = blocks
        self.block_to_slot[blocks] = new_index
        self.slot_last_use = torch.zeros(new_slots, dtype=torch.int64)
        self.slot_last_use[new_index] = last_use
        self.slot_pinned = torch.zeros(new_slots, dtype=torch.bool)
        self.slot_pinned[new_index] = pinned
        self.slot_step = slot_step
        self._layout_rows = layout
        self._row_pos = torch.full((rows,), -1, dtype=torch.int64)
        self._row_pos[layout] = torch.arange(layout.numel())
        self._pinned_since_step = None  # slots renumbered: the next step clears every pin
        logger.info("cached table resized: %d -> %d rows", old_slots * self.block_rows, rows)

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The full caught-up table ``(N, D)`` (after :meth:`flush`; the host tensor itself)."""
        self.flush()
        return self.host_weight

    # ------------------------------------------------------------------ checkpoint hooks
    def _param_index(self, optimizer: torch.optim.Optimizer, *, buffers: bool) -> int | None:
        """``weight``'s index in a state dict of ``optimizer`` (row buffers counted or not)."""
        i = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p is self.weight:
                    return i
                if buffers or not _is_row_buffer(p):
                    i += 1
        return None

    def _optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> dict[str, Any]:
        sd = _strip_row_buffers(optimizer, sd)
        idx = self._param_index(optimizer, buffers=False)
        if idx is None or idx not in sd["state"]:
            return sd
        self.flush()
        entry = dict(sd["state"][idx])
        for key in self._state_keys():
            if key in entry:
                entry[key] = self.host_state[key].clone()
        sd = dict(sd)
        sd["state"] = dict(sd["state"])
        sd["state"][idx] = entry
        return sd

    def _optimizer_load(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> dict[str, Any]:
        sd = _insert_row_buffers(optimizer, sd)
        idx = self._param_index(optimizer, buffers=True)
        if idx is None or idx not in sd["state"]:
            return sd
        entry = dict(sd["state"][idx])
        n, d = self.num_embeddings, self.embedding_dim
        step = entry.get("step")
        t = int(step) if step is not None else self.t
        for key in self._state_keys():
            value = entry.get(key)
            if value is None:
                continue
            if tuple(value.shape) != (n, d):
                raise ValueError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}; a cached table "
                    f"loads full-table state {(n, d)}"
                )
            self.host_state[key].copy_(value)
            entry[key] = self._gather_rows(self.host_state[key])
        sd = dict(sd)
        sd["state"] = dict(sd["state"])
        sd["state"][idx] = entry
        self._reset_step(t)
        return sd

    def _reset_step(self, t: int) -> None:
        """Every row is current at step ``t`` (after loading a checkpoint)."""
        self.t = t
        self.last_step.fill_(t)
        self.slot_step.fill_(t)
        if self._optimizer is not None:
            group = _group_of(self._optimizer, self.weight)
            self._rule = _make_rule(self._optimizer, group, t)


def _is_row_buffer(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_edo_row_buffer", False))


def _strip_row_buffers(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` without the cached tables' row buffers (ids renumbered), as an optimizer over the
    uncached model would save it; unchanged when already stripped."""
    live = [g["params"] for g in optimizer.param_groups]
    groups = sd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(p) for p in live]:
        return sd
    drop = {
        i
        for g, ps in zip(groups, live, strict=True)
        for i, p in zip(g["params"], ps, strict=True)
        if _is_row_buffer(p)
    }
    if not drop:
        return sd
    kept = sorted(i for g in groups for i in g["params"] if i not in drop)
    new_id = {old: new for new, old in enumerate(kept)}
    out = dict(sd)
    out["param_groups"] = [
        {**g, "params": [new_id[i] for i in g["params"] if i not in drop]} for g in groups
    ]
    out["state"] = {new_id[k]: v for k, v in sd["state"].items() if k not in drop}
    return out


def _insert_row_buffers(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_strip_row_buffers` for ``optimizer.load_state_dict(sd)``."""
    live = [g["params"] for g in optimizer.param_groups]
    groups = sd["param_groups"]
    stripped = [sum(not _is_row_buffer(p) for p in ps) for ps in live]
    if [len(g["params"]) for g in groups] != stripped or stripped == [len(p) for p in live]:
        return sd
    new_id: dict[Any, int] = {}
    new_groups = []
    n = 0
    for g, ps in zip(groups, live, strict=True):
        old = iter(g["params"])
        ids = []
        for p in ps:
            if not _is_row_buffer(p):
                new_id[next(old)] = n
            ids.append(n)
            n += 1
        new_groups.append({**g, "params": ids})
    out = dict(sd)
    out["param_groups"] = new_groups
    out["state"] = {new_id[k]: v for k, v in sd["state"].items() if k in new_id}
    return out


class _CacheFullError(Exception):
    def __init__(self, available: int) -> None:
        super().__init__(available)
        self.available = available


def _module_state_dict_hook(
    module: CachedTable, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = module.full_weight().detach().clone()
    state_dict.pop(prefix + "batch_rows", None)  # the touched rows' gradient holder: not state


def _module_load_pre_hook(
    module: CachedTable,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    state_dict[prefix + "batch_rows"] = module.batch_rows.detach().clone()
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is None:
        return
    n, d = module.num_embeddings, module.embedding_dim
    if tuple(value.shape) != (n, d):
        error_msgs.append(
            f"{key}: a cached table loads the full table {(n, d)}, got {tuple(value.shape)}"
        )
        state_dict.pop(key)
        return
    with torch.no_grad():
        module.flush()  # host optimizer state current before every row is declared current
        module.host_weight.copy_(value)
        module.last_step.fill_(module.t)
        module.slot_step.fill_(module.t)
        rows = module._gather_rows(module.host_weight)
    state_dict[key] = rows.to(module.weight.dtype)


def _check_bag_mode(mode: str) -> str:
    if mode not in BAG_MODES:
        raise ValueError(f"mode={mode!r}; expected one of {BAG_MODES}")
    return mode


class CachedEmbedding(CachedTable):
    """Drop-in ``nn.Embedding``: rows on the host, ``cache_rows`` of them cached on ``device``.

    ``CachedEmbedding(num_embeddings, embedding_dim, cache_rows, padding_idx=None, max_norm=None,
    norm_type=2.0, scale_grad_by_freq=False, sparse=False, _weight=None, _freeze=False,
    device=None, dtype=None, *, policy="lfu", block_rows=1, overflow="grow",
    id_frequencies=None)``. The table is initialised as ``nn.Embedding`` does (``N(0, 1)``,
    padding row zero) unless ``_weight`` is given. ``forward(input)`` with ``input`` ``(*)`` int64
    returns ``(*, embedding_dim)``. ``sparse=True`` raises ``ValueError`` (refused by name).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        cache_rows: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **cache_options: Any,
    ) -> None:
        options = _options(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
            scale_grad_by_freq, sparse, None, False,
        )  # fmt: skip
        weight = _initial_weight(options, _weight, dtype)
        super().__init__(
            options,
            weight,
            cache_rows,
            device=device if device is not None else "cpu",
            requires_grad=not _freeze,
            **cache_options,
        )


class CachedEmbeddingBag(CachedTable):
    """Drop-in ``nn.EmbeddingBag`` over a host table with ``cache_rows`` cached on ``device``.

    ``CachedEmbeddingBag(num_embeddings, embedding_dim, cache_rows, max_norm=None, norm_type=2.0,
    scale_grad_by_freq=False, mode="mean", sparse=False, _weight=None, include_last_offset=False,
    padding_idx=None, device=None, dtype=None, *, policy, block_rows, overflow, id_frequencies)``.
    ``forward(input, offsets=None, per_sample_weights=None)`` returns ``(B, embedding_dim)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        cache_rows: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **cache_options: Any,
    ) -> None:
        options = _options(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
            scale_grad_by_freq, sparse, _check_bag_mode(mode), include_last_offset,
        )  # fmt: skip
        weight = _initial_weight(options, _weight, dtype)
        super().__init__(
            options,
            weight,
            cache_rows,
            device=device if device is not None else "cpu",
            **cache_options,
        )


def _options(
    n: int,
    d: int,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
    bag_mode: str | None,
    include_last_offset: bool,
) -> EmbeddingOptions:
    if padding_idx is not None:
        if not -n <= padding_idx < n:
            raise ValueError(f"padding_idx={padding_idx} must be within the {n} rows")
        if padding_idx < 0:
            padding_idx += n
    return EmbeddingOptions(
        num_embeddings=int(n),
        embedding_dim=int(d),
        padding_idx=padding_idx,
        max_norm=max_norm,
        norm_type=float(norm_type),
        scale_grad_by_freq=bool(scale_grad_by_freq),
        sparse=bool(sparse),
        bag_mode=bag_mode,
        include_last_offset=bool(include_last_offset),
    )


def _initial_weight(
    options: EmbeddingOptions, weight: torch.Tensor | None, dtype: torch.dtype | None
) -> torch.Tensor:
    n, d = options.num_embeddings, options.embedding_dim
    if weight is not None:
        if tuple(weight.shape) != (n, d):
            raise ValueError(f"_weight has shape {tuple(weight.shape)}; expected {(n, d)}")
        return weight.detach().to("cpu")
    w = torch.empty(n, d, dtype=dtype or torch.get_default_dtype())
    nn.init.normal_(w)
    if options.padding_idx is not None:
        w[options.padding_idx] = 0
    return w
