"""The row cache's victims: which slots an eviction frees (the policy's scores, the look-ahead's
next uses, the slots it must keep), by one pass over the cache or the table's kept order."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from edo_monitor.nn.cache_parts import _CacheFullError, put_rows

_NOT_EVICTABLE = torch.iinfo(torch.int64).max  # the score of a slot eviction must not take
_LAST_USE_SPAN = 1 << 32  # LFU scores are count * 2^32 + last use (the forward number)


def _lowest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions ``(k,)`` int64 of the ``k`` lowest of host ``values`` ``(n,)``, in no order
    (``k >= n``: every position). NumPy's introselect: 0.2 ms for the 8 x 700 lowest of 100,000
    scores, where ``torch.topk`` took 0.9-3 ms."""
    if k >= values.numel():
        return torch.arange(values.numel())
    return torch.from_numpy(np.argpartition(values.numpy(), k - 1)[:k])


class _VictimChoice:
    """The victim choice of :class:`~edo_monitor.nn.cached.CachedTable` (a part of it: the
    slot arrays are the table's)."""

    #: caches of fewer slots choose victims by one pass over every slot: keeping the order
    #: gains nothing there (side by side, batch 4096: the order's step 0.99x the pass's at
    #: 10,000 slots, 1.02x at 100,000, 0.85x at 1,000,000; docs/benchmarks.md)
    _victim_order_min_slots = 1 << 17

    def _choose_victims(
        self, count: int, keep_slots: list[torch.Tensor], inside: Any
    ) -> torch.Tensor:
        """:meth:`_evict`'s choice of ``count`` slots outside ``keep_slots``."""
        slots = None
        if self.slot_to_block.numel() >= self._victim_order_min_slots:
            slots = self._victim_order.choose(self, count, keep_slots, inside)
        if slots is None:
            slots = self._evict_full(count, keep_slots)
        return slots

    def _eviction_limits(self, keep: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        """The slots an eviction must keep (``keep``, the gradient layout's, the look-ahead's
        running and prefetched batches') and the look-ahead's ``blocks -> used in the window``
        (``None`` without one)."""
        keep_slots = [keep, self._layout_slots()]
        la = self._lookahead
        if la is None:
            return keep_slots, None
        keep_slots.append(la.protected_slots(self))
        return keep_slots, la.inside(self)

    def _policy_score(self, freq: torch.Tensor, last_use: torch.Tensor | int) -> torch.Tensor:
        """The policy's eviction score of slots with use counts ``freq`` and last uses
        ``last_use`` (smallest goes first): LFU ``count * 2^32 + last use`` (the count first,
        ties by last use; a forward number stays below 2^32), LRU the last use."""
        if self.policy == "lfu":
            return freq * _LAST_USE_SPAN + last_use
        return torch.as_tensor(last_use).expand(freq.shape)

    def _eviction_scores(self, keep_slots: list[torch.Tensor]) -> torch.Tensor:
        """Every slot's eviction score ``(C,)`` int64, smallest first: ``-1`` free;
        :data:`_NOT_EVICTABLE` pinned or in ``keep_slots``; else :attr:`slot_score` (the
        policy's), and with a look-ahead the rows used inside its window after every other
        row, the furthest next use first."""
        score = self.slot_score.clone()
        la = self._lookahead
        if la is not None:  # next use inside the look-ahead window first (Belady)
            score = la.score(self, self.slot_to_block.clamp(min=0), score)
            score.masked_fill_(self.slot_to_block < 0, -1)
        score.masked_fill_(self.slot_pinned, _NOT_EVICTABLE)
        for k in keep_slots:
            put_rows(score, k, _NOT_EVICTABLE)
        return score

    def _evict_full(self, count: int, keep_slots: list[torch.Tensor]) -> torch.Tensor:
        """:meth:`_evict`'s choice by one pass over every slot (``O(C)``): the ``count`` lowest
        :meth:`_eviction_scores` (free slots first; the rows used inside the look-ahead window
        are candidates too, after every other row).

        The candidates are the slots whose :attr:`slot_score` is at most a bound (one compare
        over the ``C`` scores, then ``O(candidates)``): every other slot scores above the bound
        (the look-ahead and the protection only raise scores), so when at least ``count``
        candidates still score within it, their ``count`` lowest are the lowest of all,
        whatever the bound. Else one selection over every slot decides (:func:`_lowest`), and
        sets the bound to its ``8 count``-th lowest score, so that the next few evictions find
        enough candidates (the selection over 100,000 slots costs 0.2 ms, and masking every
        slot as much again).

        Raises:
            _CacheFullError: fewer free or evictable slots than ``count``.
        """
        if count > self.slot_to_block.numel():
            raise self._full_error(count, keep_slots)
        bound = self._eviction_bound
        if bound is not None:
            candidates = torch.from_numpy(np.flatnonzero(self.slot_score.numpy() <= bound))
            if candidates.numel() >= count:
                got = self._lowest_candidates(count, candidates, keep_slots, bound)
                if got is not None:
                    return got
        score = self._eviction_scores(keep_slots)
        take = min(8 * count, score.numel())
        low = _lowest(score, take)
        low_values = score.index_select(0, low)
        victims = low.index_select(0, _lowest(low_values, count))
        if int(score.index_select(0, victims).max()) >= _NOT_EVICTABLE:
            raise self._full_error(count, keep_slots)
        evictable = low_values[low_values < _NOT_EVICTABLE]  # the count victims at least
        self._eviction_bound = int(evictable.max())
        return victims

    def _lowest_candidates(
        self, count: int, candidates: torch.Tensor, keep_slots: list[torch.Tensor], bound: int
    ) -> torch.Tensor | None:
        """The ``count`` lowest eviction scores among ``candidates`` (slots whose policy score
        is at most ``bound``), or ``None`` when fewer than ``count`` of them still score within
        ``bound`` once pinned, kept and (look-ahead) soon used rows are scored up."""
        score = self.slot_score.index_select(0, candidates)
        la = self._lookahead
        if la is not None:
            blocks = self.slot_to_block.index_select(0, candidates)
            score = la.score(self, blocks.clamp(min=0), score)
            score.masked_fill_(blocks < 0, -1)
        mark = self._slot_mark
        for k in keep_slots:
            put_rows(mark, k, True)
        held = mark.index_select(0, candidates) | self.slot_pinned.index_select(0, candidates)
        for k in keep_slots:
            put_rows(mark, k, False)
        score.masked_fill_(held, _NOT_EVICTABLE)
        if int((score <= bound).sum()) < count:
            return None
        return candidates.index_select(0, _lowest(score, count))

    def _full_error(self, count: int, keep_slots: list[torch.Tensor]) -> _CacheFullError:
        """The error of an eviction of ``count`` slots that the cache cannot make: the free or
        evictable slots and the slots it needed (those it keeps and ``count``)."""
        protect = self.slot_pinned.clone()
        for k in keep_slots:
            protect[k] = True
        used = self.slot_to_block >= 0
        available = int((used & ~protect).sum()) + int((~used).sum())
        return _CacheFullError(available, int(protect.sum()) + count)
