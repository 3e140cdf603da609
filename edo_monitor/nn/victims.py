"""The row cache's eviction order, kept between steps: a step's victims without a pass over every
slot (issue 23: the eviction decision at the batch's cost)."""

from __future__ import annotations

from typing import Any

import torch

from edo_monitor.nn.cache_eviction import _LAST_USE_SPAN

__all__ = ["VictimOrder"]

_FREE = -1  # the score of a free slot: taken before any victim
_NEVER_LISTED = torch.iinfo(torch.int64).max  # theta when every slot is ranked


def slot_scores(table: Any, slots: torch.Tensor) -> torch.Tensor:
    """Eviction scores ``(S,)`` int64 of cache ``slots`` (smallest goes first) from their counts
    and last uses: ``-1`` for a free slot, else the policy's (LFU: the block's use count, ties by
    last use, the forward number; LRU: the last use). A slot's score changes only when it is
    used, loaded or freed: the table keeps them (``slot_score``), which the order reads."""
    score = table._policy_score(table.slot_freq[slots], table.slot_last_use[slots])
    return torch.where(table.slot_to_block[slots] < 0, _FREE, score)


class VictimOrder:
    """The ``need`` lowest-score evictable slots of a cache, a step at the batch's cost.

    A *refresh* ranks the ``M = max(C / 4, 2 need)`` lowest-score slots (one ``topk`` over the
    ``C`` slots, sorted: ``O(C + M log M)``) and records ``theta``, the lowest score it left
    out. Afterwards every change of a slot's score (the forward's used slots, loads, evictions:
    :meth:`changed`, ``O(S)`` for ``S`` slots) marks the slot and, when its new score is below
    ``theta``, lists it (free slots; under LFU, slots used fewer times than ``theta``'s: a use
    stamps the newest forward, so a changed slot of ``theta``'s count scores above it). A
    choice (:meth:`choose`) looks at a prefix of the ranking past its marked front (the unmarked
    slots of the first ``2 need + 64``, doubled while too few qualify) and at the listed slots:
    every other slot scores at least the first score after the prefix, or ``theta``, so the
    ``need`` lowest of those looked at are the ``need`` lowest of the cache (the victims of one
    ``topk`` over all slots, up to ties: ``tests/test_victims.py``).

    Cost per step: ``O(U)`` for the ``U`` slots the batch uses, ``O(need + listed)`` for the
    choice and its ``topk`` (``listed`` is kept below ``M``: a refresh when it grows past), and a
    refresh when the ranking's prefix runs out, every ``M / need`` steps or so: ``O(C / (M /
    need)) = O(4 need)`` amortized. ``O(U + need log need)`` in all, not ``O(C)``.
    """

    def __init__(self) -> None:
        self._ranked: torch.Tensor | None = None  # slots, lowest score first
        self._ranked_score = torch.zeros(0, dtype=torch.int64)
        self._head = 0  # ranked[:head] are dropped (marked)
        self._theta = 0
        self._marked = torch.zeros(0, dtype=torch.bool)
        self._listed: list[torch.Tensor] = []  # changed slots scoring below theta (repeats)
        self._listed_count = 0
        self._arrays: tuple[torch.Tensor, ...] = ()  # the table's arrays ranked

    def reset(self) -> None:
        """Forget the ranking (the next choice refreshes it)."""
        self._ranked = None
        self._listed = []

    def _current(self, table: Any) -> bool:
        """Whether the ranking is of the table's arrays (a resize makes new ones)."""
        arrays = (table.slot_to_block, table.slot_freq, table.slot_last_use)
        return self._ranked is not None and all(
            a is b for a, b in zip(arrays, self._arrays, strict=True)
        )

    def refresh(self, table: Any, need: int) -> None:
        """Rank the lowest-score slots again (``O(C + M log M)``)."""
        count = table.slot_to_block.numel()
        keep = min(count, max(count // 4, 2 * need, 1))
        scores = table.slot_score
        if keep < count:
            top = torch.topk(scores, keep + 1, largest=False, sorted=True)
            self._theta = int(top.values[-1])
            self._ranked, self._ranked_score = top.indices[:-1], top.values[:-1]
        else:
            self._theta = _NEVER_LISTED
            self._ranked_score, self._ranked = torch.sort(scores, stable=True)
        self._head = 0
        self._marked = torch.zeros(count, dtype=torch.bool)
        self._listed, self._listed_count = [], 0
        self._arrays = (table.slot_to_block, table.slot_freq, table.slot_last_use)

    def changed(self, table: Any, slots: torch.Tensor, how: str = "loaded") -> None:
        """``slots`` ``(S,)`` changed score, ``how``: ``"used"`` by the forward now (stamped with
        its number), ``"freed"`` or ``"loaded"``: ``O(S)``."""
        if not self._current(table) or slots.numel() == 0:
            return
        self._marked[slots] = True
        if how == "freed":  # score -1
            low = slots if self._theta > _FREE else slots[:0]
        elif how == "used" and self._theta < _NEVER_LISTED:
            # stamped with the newest forward, above every last use ranked: below theta only
            # with fewer uses than theta's (LFU); never under LRU
            fewer = table.slot_freq[slots] < self._theta // _LAST_USE_SPAN
            low = slots[fewer] if table.policy == "lfu" else slots[:0]
        else:
            low = slots[table.slot_score[slots] < self._theta]
        if low.numel():
            self._listed.append(low)
            self._listed_count += low.numel()
            if self._listed_count > self._ranked_score.numel():
                self.reset()  # as many listed as ranked: rank them all again

    def choose(
        self, table: Any, need: int, keep: list[torch.Tensor], inside: Any = None
    ) -> torch.Tensor | None:
        """The ``need`` lowest-score slots (free ones first), none of them pinned, in ``keep``
        (slot tensors) nor, with ``inside`` (``blocks -> bool``: used within the look-ahead
        window), used soon; ``None`` when fewer such slots exist (the caller's full pass decides
        then, among the rows inside the window too)."""
        if need <= 0:
            return torch.zeros(0, dtype=torch.int64)
        for attempt in range(2):
            if attempt or not self._current(table):
                self.refresh(table, need)
            got = self._choose_ranked(table, need, keep, inside)
            if got is not None:
                return got
        return None

    def _choose_ranked(
        self, table: Any, need: int, keep: list[torch.Tensor], inside: Any
    ) -> torch.Tensor | None:
        assert self._ranked is not None
        ranked, ranked_score = self._ranked, self._ranked_score
        total = ranked.numel()
        listed = torch.unique(torch.cat(self._listed)) if self._listed else ranked[:0]
        listed_score = table.slot_score[listed]
        low = listed_score < self._theta  # the others score as much as slots not ranked
        listed, listed_score = listed[low], listed_score[low]
        self._listed = [listed]
        self._listed_count = listed.numel()
        for k in keep:
            table._slot_mark[k] = True  # the table's scratch: slots a choice must keep
        try:
            length = 2 * need + 64
            while True:
                end = min(total, self._head + length)
                self._drop_marked(end)
                pool = torch.cat([ranked[self._head : end], listed])
                score = torch.cat([ranked_score[self._head : end], listed_score])
                bound = int(ranked_score[end]) if end < total else self._theta
                ok = (score <= bound) & ~table._slot_mark[pool] & ~table.slot_pinned[pool]
                if inside is not None:
                    blocks = table.slot_to_block[pool]
                    ok &= ~((blocks >= 0) & inside(blocks.clamp(min=0)))
                if int(ok.sum()) >= need:
                    pool, score = pool[ok], score[ok]
                    return pool[torch.topk(score, need, largest=False, sorted=False).indices]
                if end >= total:
                    return None
                length *= 2
        finally:
            for k in keep:
                table._slot_mark[k] = False

    def _drop_marked(self, end: int) -> None:
        """Drop the marked slots of ``ranked[head:end]`` for good (their scores changed: listed,
        or above ``theta``), the unmarked ones kept in order just before ``end``; each ranked
        slot is dropped once between two refreshes."""
        assert self._ranked is not None
        part = self._ranked[self._head : end]
        unmarked = ~self._marked[part]
        kept = int(unmarked.sum())
        if kept == part.numel():
            return
        start = end - kept
        self._ranked_score[start:end] = self._ranked_score[self._head : end][unmarked]
        self._ranked[start:end] = part[unmarked]
        self._head = start
