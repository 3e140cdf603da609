"""Rows in and out of the row cache: ids remapped to slots, misses loaded (one gathered copy, a side
stream on CUDA), rows written back and evicted, the rows in use pinned."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from edo_monitor.nn.cache_parts import _CacheFullError, put_rows, rows_to_host, to_device
from edo_monitor.nn.embedding import check_ids

logger = logging.getLogger(__name__)

_NOT_EVICTABLE = torch.iinfo(torch.int64).max  # the score of a slot eviction must not take
_LAST_USE_SPAN = 1 << 32  # LFU scores are count * 2^32 + last use (the forward number)


def _lowest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions ``(k,)`` int64 of the ``k`` lowest of host ``values`` ``(n,)``, in no order
    (``k >= n``: every position). NumPy's introselect: 0.2 ms for the 8 x 700 lowest of 100,000
    scores, where ``torch.topk`` took 0.9-3 ms."""
    if k >= values.numel():
        return torch.arange(values.numel())
    return torch.from_numpy(np.argpartition(values.numpy(), k - 1)[:k])


class _RowMovement:
    """Rows in and out of the row cache: ids remapped to slots, misses loaded (one gathered copy, a
    side"""

    #: caches of fewer slots choose victims by one pass over every slot: keeping the order
    #: gains nothing there (side by side, batch 4096: the order's step 0.99x the pass's at
    #: 10,000 slots, 1.02x at 100,000, 0.85x at 1,000,000; docs/benchmarks.md)
    _victim_order_min_slots = 1 << 17

    def _pin_slots(self, slots: torch.Tensor) -> None:
        """Pin ``slots`` (their gradient is pending) until the next optimizer step."""
        put_rows(self.slot_pinned, slots, True)
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
            put_rows(self.slot_pinned, torch.cat(listed), False)
        self._pinned_since_step = []
        self._pinned_listed = 0
        self._forwards = []
        self._backward_seen = False

    def _release_dropped_forwards(self) -> None:
        """Let the rows of the forwards since the last step go when no backward reached the
        cache since and every one of their graphs is gone (an evaluation run with gradients
        on, its results dropped): no backward can come, so nothing is pending. Their rows were
        pinned and kept in the gradient layout until a step that may never come: 200 such
        batches grew a 100-row cache to 7,218 rows (``overflow="error"``: raised at the
        second). The cache's rows are as they were (a forward catches rows up in the row
        buffer, not in the cache); a zero gradient (``zero_grad(set_to_none=False)``) stays
        one."""
        forwards = self._forwards
        if not forwards or self._backward_seen or any(f() is not None for f in forwards):
            return
        self._clear_pins()
        self._pending = None
        self._generation += 1
        empty = self.batch_rows.new_zeros(0, self.embedding_dim)
        grad = None if self.batch_rows.grad is None else empty.clone()
        self._set_layout(torch.zeros(0, dtype=torch.int64), grad, empty)

    # ------------------------------------------------------------------ moving rows
    def _real_rows(
        self, blocks: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids ``(n,)`` of the table rows in ``blocks`` ``(B,)`` (the last block's rows past ``N``
        left out) and the cache rows ``(n,)`` holding them, the blocks being in ``slots``
        ``(B,)`` (``slots=blocks`` for the ids alone)."""
        r = self.block_rows
        if r == 1:
            return blocks, slots
        ids = (blocks[:, None] * r + torch.arange(r)[None, :]).reshape(-1)
        real = ids < self.num_embeddings
        return ids[real], self._slot_rows(slots)[real]

    def _slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The cache rows ``(S*R,)`` of ``slots`` ``(S,)`` (rows past ``N`` included)."""
        r = self.block_rows
        if r == 1:
            return slots
        return (slots[:, None] * r + torch.arange(r)[None, :]).reshape(-1)

    def _gather_rows(self, host: torch.Tensor) -> torch.Tensor:
        """Rows of a full host tensor ``(N, D)`` for every cache slot ``(C, D)`` (free: zero)."""
        out = torch.zeros(self.cache_rows, self.embedding_dim, dtype=host.dtype)
        used = (self.slot_to_block >= 0).nonzero().reshape(-1)
        if used.numel():
            ids, rows = self._real_rows(self.slot_to_block[used], used)
            out[rows] = host[ids]
        return out

    def _write_back(self, slots: torch.Tensor) -> None:
        """Copy cache ``slots`` (weight + state) to the host; their rows are current (step t)."""
        if slots.numel() == 0:
            return
        ids, rows = self._real_rows(self.slot_to_block.index_select(0, slots), slots)
        state = self._opt_state()
        keys = [k for k in self._state_keys() if state.get(k) is not None]
        dev_rows = to_device(rows, self.device)
        parts = [self.weight.detach().index_select(0, dev_rows)]
        for key in keys:
            value = state[key].detach()
            at = dev_rows if value.device == dev_rows.device else to_device(rows, value.device)
            parts.append(value.index_select(0, at))
        w, *rows_state = rows_to_host(parts)  # one wait for the device, not one per tensor
        put_rows(self.host_weight, ids, w.to(self.host_weight.dtype))
        put_rows(self.last_step, ids, self.slot_step.index_select(0, rows))  # caught up when loaded
        moved = 0
        for key, value in zip((None, *keys), (w, *rows_state), strict=True):
            if key is not None:
                host = self.host_state[key]
                put_rows(host, ids, value.to(host.dtype))
            moved += value.numel() * value.element_size()
        self._count(d2h_bytes=moved)

    def _load_blocks(
        self, blocks: torch.Tensor, slots: torch.Tensor | None = None, *, catch_up: bool = True
    ) -> None:
        """Load ``blocks`` into free ``slots`` (default: the first free), caught up to step t
        (``catch_up=False``: as they are, each row at its own step, like any stale cached row)."""
        if blocks.numel() == 0:
            return
        if slots is None:
            slots = (self.slot_to_block < 0).nonzero().reshape(-1)[: blocks.numel()]
        self._place_staged(self._stage_blocks(blocks, catch_up=catch_up), slots)

    def _stage_blocks(self, blocks: torch.Tensor, *, catch_up: bool = True) -> dict[str, Any]:
        """Rows of host ``blocks`` (not cached) caught up to step t (or, ``catch_up=False``, at
        their own steps), copied to the device (on CUDA on the side stream, not waited for):
        ``{"blocks", "ids", "w", "st", "t", "s", "step", "rewrites"}`` (``"t"``: the rows' step,
        an int or per row; ``"step"``: the table's when staged; ``"rewrites"``: the state dicts
        loaded before). Placed by :meth:`_place_staged`, now or after a later optimizer step
        (the rows, not cached, take no gradient: the lazy catch-up covers those steps)."""
        ids, _ = self._real_rows(blocks, blocks)  # the ids only
        s = self.last_step.index_select(0, ids)
        w = self.host_weight.index_select(0, ids)
        keys = self._state_keys()
        st = {k: self.host_state[k].index_select(0, ids) for k in keys}
        at: int | torch.Tensor = self.t
        if not catch_up:
            at = s
        elif self._rule is not None and bool((s < self.t).any()):
            self._rule.catch_up_rows(w, st, s, self.t)
        stream = self._load_stream()
        if stream is not None:  # CUDA: copy on a side stream; the placing waits for it
            with torch.cuda.stream(stream):
                w = to_device(w, self.device)
                st = {k: to_device(v, self.device) for k, v in st.items()}
        return {
            "blocks": blocks,
            "ids": ids,
            "w": w,
            "st": st,
            "t": at,
            "s": s,
            "step": self.t,
            "rewrites": self._rewrites,
        }

    def _place_staged(self, staged: dict[str, Any], slots: torch.Tensor) -> None:
        """Put rows staged by :meth:`_stage_blocks` into free cache ``slots``.

        Raises:
            ValueError: the first load, whatever loads (a forward, ``prefetch``, a
                :class:`~edo_monitor.nn.lookahead.LookAhead`), finds the cache written before
                any row was loaded (:meth:`_check_free_slots`).
        """
        self._check_cache_once()  # before these slots are written: a prefetch hid the write
        blocks, w, st = staged["blocks"], staged["w"], staged["st"]
        _, rows = self._real_rows(blocks, slots)
        state = self._opt_state()
        moved = w.numel() * w.element_size()
        dev_rows = to_device(rows, self.device)
        stream = self._load_stream()
        if stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            w.record_stream(current)
            for v in st.values():
                v.record_stream(current)
        put_rows(self.weight.data, dev_rows, w.to(self.device, self.weight.dtype))
        for key in self._state_keys():
            value = state.get(key)
            if value is not None:
                at = dev_rows if value.device == dev_rows.device else to_device(rows, value.device)
                put_rows(value.data, at, st[key].to(value.device, value.dtype))
                moved += st[key].numel() * st[key].element_size()
        put_rows(self.slot_to_block, slots, blocks)
        freq = self.block_freq.index_select(0, blocks)
        put_rows(self.slot_freq, slots, freq)
        last_use = self.slot_last_use.index_select(0, slots)
        put_rows(self.slot_score, slots, self._policy_score(freq, last_use))
        self._victim_order.changed(self, slots)
        put_rows(self.block_to_slot, blocks, slots)
        put_rows(self.slot_step, rows, staged["t"])
        put_rows(self._ahead_marks(), blocks, True)  # a miss now; its first lookup no hit
        self._count(misses=int(blocks.numel()), h2d_bytes=moved)

    def _ahead_marks(self) -> torch.Tensor:
        """Per block ``(num_blocks,)`` bool: loaded (counted a miss) and not looked up since.
        Every row loaded is a miss, those loaded ahead of their forward (``prefetch``,
        :class:`~edo_monitor.nn.lookahead.LookAhead`) too, so their first lookup is no hit
        (it was: each prefetched row counted twice, ``hit_rate`` 0.69 for 0.56)."""
        marks = getattr(self, "_loaded_ahead", None)
        if marks is None or marks.numel() != self.num_blocks:
            marks = self._loaded_ahead = torch.zeros(self.num_blocks, dtype=torch.bool)
        return marks

    def _load_stream(self) -> Any:
        if self.device.type != "cuda":
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    def _evict(self, count: int, keep: torch.Tensor, *, for_batch: bool = False) -> torch.Tensor:
        """``count`` slots for new blocks: free ones first, then victims (written back).

        The victims are the ``count - free`` lowest scores (LFU: count, then last use; LRU: last
        use; with a look-ahead, rows used inside its window after every other row, the furthest
        next use first) among the slots neither in ``keep`` (slot indices), pinned, holding a
        gradient nor needed by the look-ahead's running or prefetched batch. Found by the
        table's :class:`~edo_monitor.nn.victims.VictimOrder` at the batch's cost in a cache of
        :attr:`_victim_order_min_slots` slots or more; in a smaller one, or when the rows
        outside the window are too few, by :meth:`_evict_full` (one compare over the ``C`` kept
        scores, then the candidates under its bound; a selection over every slot every few
        evictions).

        ``for_batch``: the blocks are the running batch's (its forward, or the look-ahead's load
        of it; ``keep`` its other rows): when they do not fit beside the look-ahead's next
        batch, that batch's rows go (they load again later), as without a look-ahead, rather
        than the cache growing or raising where it would not without one.

        Raises:
            _CacheFullError: fewer free or evictable slots than ``count``.
        """
        self._check_cache_once()  # before victims free slots that still hold their rows
        keep_slots, inside = self._eviction_limits(keep)
        try:
            slots = self._choose_victims(count, keep_slots, inside)
        except _CacheFullError:
            if not for_batch or self._lookahead is None:
                raise
            slots = self._choose_victims(count, keep_slots[:2], inside)
        victims = slots.masked_select(self.slot_to_block.index_select(0, slots) >= 0)
        if victims.numel():
            self._write_back(victims)
            put_rows(self.block_to_slot, self.slot_to_block.index_select(0, victims), -1)
            put_rows(self.slot_to_block, victims, -1)
            put_rows(self.slot_score, victims, -1)
            self._victim_order.changed(self, victims, "freed")
            self._count(evicted=int(victims.numel()))
        return slots

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

    def _ensure(
        self,
        blocks: torch.Tensor,
        *,
        count: bool,
        slots: torch.Tensor | None = None,
        grow: bool = True,
    ) -> torch.Tensor:
        """Make unique ``blocks`` resident; returns their slots. Grows or raises when too many
        (``grow=False``: raises :class:`_CacheFullError`, having changed nothing).

        ``count``: a forward's lookup: counts its hits (rows cached and not loaded ahead of it,
        :meth:`_ahead_marks`) and ``forward_loads``, once the rows are in.

        ``slots``: ``block_to_slot[blocks]`` when the caller has it already.
        """
        if slots is None:
            slots = self.block_to_slot.index_select(0, blocks)
        hit = slots >= 0
        miss = blocks.masked_select(~hit)
        if miss.numel():
            try:
                new = self._evict(miss.numel(), slots.masked_select(hit), for_batch=True)
            except _CacheFullError as full:
                if not grow:
                    raise
                needed = full.needed
                if self.overflow == "error":
                    raise RuntimeError(
                        f"the batch needs {needed * self.block_rows} cache rows (its unique ids "
                        f"and the rows used since the last optimizer step) but the cache holds "
                        f"{self.cache_rows} rows ({full.available} free or evictable blocks); "
                        f"grow the cache or pass overflow='grow'"
                    ) from None
                logger.warning(
                    "cached table %s: %d rows needed, cache has %d; growing it",
                    getattr(self, "edo_name", None)  # the agent's name for a table it cached
                    or f"({self.num_embeddings} x {self.embedding_dim})",
                    needed * self.block_rows,
                    self.cache_rows,
                )
                self.resize(needed * self.block_rows)
                new = None
            if new is None:
                slots = self._ensure(blocks, count=False)
            else:
                self._load_blocks(miss, new, catch_up=False)  # _remap catches up every row
                slots = self.block_to_slot.index_select(0, blocks)
        if count:  # counted once the rows are in: a batch that did not fit loaded nothing
            marks = self._ahead_marks()  # the cached blocks' marks: loading misses left them
            hits = int((~marks.index_select(0, blocks.masked_select(hit))).sum())
            self._count(hits=hits, forward_loads=int(miss.numel()))
            put_rows(marks, blocks, False)  # looked up: a later lookup of these rows is a hit
        return slots

    # ------------------------------------------------------------------ forward
    def _check_cache_once(self) -> None:
        """:meth:`_check_free_slots` unless done since the cache was made (or preloaded): called
        by whatever first writes or frees a slot (a lookup, a load, an eviction, a resize), so
        the check sees the slots as the user left them: an eviction frees slots that still hold
        their rows (a warm start's preloaded ones, evicted by a ``prefetch``), which read as
        written by the user."""
        if not getattr(self, "_cache_checked", True):
            self._check_free_slots()

    def _check_free_slots(self) -> None:
        """At the first load or lookup: the cache's free slots are as made (zero). ``weight`` is the
        cache ``(C, D)``, not the table: ``nn.init.normal_(table.weight)`` wrote only slots that
        no row used, the table kept its own values, and training went on from them, silently.

        Raises:
            ValueError: a free slot holds a value, with the ways that initialise the table.
        """
        self._cache_checked = True
        free = (self.slot_to_block < 0).nonzero().reshape(-1)
        if free.numel() == 0:
            return
        rows = to_device(self._slot_rows(free), self.device)
        if bool(self.weight.data.index_select(0, rows).any()):  # one wait for the device, once
            raise ValueError(
                "CachedEmbedding.weight is the device cache (cache_rows, D), not the table, and "
                "was written before any row was loaded (nn.init on .weight, or an average of "
                "the parameters such as AveragedModel / EMA?): that changes no row of the table. "
                "Give the table at construction (_weight=w), or load it: "
                "table.load_state_dict({'weight': w}) with w (num_embeddings, D); average "
                "tables through their state_dict()"
            )

    def _host_ids(self, input: torch.Tensor) -> torch.Tensor:
        """``input``'s ids, flat int64 on the host.

        Raises:
            TypeError: ``input`` is not an int64 / int32 tensor.
            IndexError: an id outside ``[0, N)`` (the message gives the range and the ids').
        """
        if isinstance(input, torch.Tensor):
            if input.is_meta:
                raise TypeError("input is a meta tensor: a cached table looks up real ids")
            if input.dtype in (torch.int64, torch.int32):
                input = input.reshape(-1).to("cpu", torch.int64)
        check_ids(input, self.num_embeddings)  # the range on the host: no device assert
        return input

    def _remap(
        self, input: torch.Tensor, *, catch_up: bool = True, grow: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """The batch's unique cache rows ``(U,)`` (host int64, made resident and, unless
        ``catch_up=False``, current), each id's place among them (host int64, ``input``'s shape)
        and the padding row's place (``None`` when the batch has no padding id).

        Raises:
            _CacheFullError: ``grow=False`` and the rows do not fit (nothing loaded or evicted).
        """
        ids = self._host_ids(input)
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
        slots = self.block_to_slot.index_select(0, uniq)
        present = slots >= 0
        self._count(lookups=int(ids.numel()), lookup_hits=int(counts.masked_select(present).sum()))
        self.peak_unique_ids = max(self.peak_unique_ids, int(uniq_ids.numel()))
        self._tick += 1
        with torch.no_grad():
            slots = self._ensure(uniq, count=True, slots=slots, grow=grow)
        freq = self.block_freq.index_select(0, uniq) + 1
        put_rows(self.block_freq, uniq, freq)
        put_rows(self.slot_freq, slots, freq)
        put_rows(self.slot_last_use, slots, self._tick)
        put_rows(self.slot_score, slots, self._policy_score(freq, self._tick))
        self._victim_order.changed(self, slots, "used")
        if torch.is_grad_enabled() and self.weight.requires_grad:
            self._pin_slots(slots)  # its gradient is pending until the optimizer step
        if r == 1:
            urows, place = slots, inverse
        else:  # the unique ids' rows: distinct, in the unique ids' order
            urows = self.block_to_slot[uniq_ids // r] * r + uniq_ids % r
            place = id_place
        if catch_up:
            self._catch_up_rows(urows)
        return urows, place.reshape(input.shape), self._pad_place(uniq_ids)

    def _pad_place(self, uniq_ids: torch.Tensor) -> int | None:
        """The padding id's place among ``uniq_ids`` (sorted), or ``None``."""
        pad = self.padding_idx
        if pad is not None and uniq_ids.numel():
            i = int(torch.searchsorted(uniq_ids, pad))
            if i < uniq_ids.numel() and int(uniq_ids[i]) == pad:
                return i
        return None

    @torch.no_grad()
    def current_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ``(k,)`` of the table as they are at step t, ``(k, D)`` on the device,
        without loading, evicting or counting anything (a flush would catch every host row up:
        1.55 s for the pressure demo's 100,003 rows, O(N) for any table)."""
        rows, place, _ = self._current_rows(ids, count=False)
        return rows.index_select(0, to_device(place.reshape(-1), rows.device))

    @torch.no_grad()
    def _current_rows(
        self, input: torch.Tensor, *, count: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """For a lookup without gradients whose rows do not fit in the cache: the batch's
        unique rows ``(U, D)`` on the device, current at step t, each id's place among them
        (host int64, ``input``'s shape) and the padding row's place. Cached rows are caught up
        in place; the others are read from the host and caught up in a copy: nothing is loaded,
        evicted or grown (an evaluation over more ids than the cache holds grew it for good).

        Counted as what happened: the cached blocks not loaded ahead are hits, the others read
        from the host misses (their weight bytes ``h2d_bytes``), no ``forward_loads`` (none was
        loaded into the cache; 50 ids with 10 cached counted 40 forward loads and a hit rate
        of 1.0, now 10 hits and 40 misses, 0.2)."""
        ids = self._host_ids(input)
        uniq, place = torch.unique(ids, return_inverse=True)
        r = self.block_rows
        blocks = uniq // r if r > 1 else uniq
        slots = self.block_to_slot.index_select(0, blocks)
        cached = slots >= 0
        ublocks = torch.unique(blocks) if r > 1 else blocks
        if count:
            found = ublocks.masked_select(self.block_to_slot.index_select(0, ublocks) >= 0)
            marks = self._ahead_marks()
            hits = int((~marks.index_select(0, found)).sum())
            put_rows(marks, found, False)
            self._count(
                hits=hits,
                misses=int(ublocks.numel() - found.numel()),
                h2d_bytes=int((~cached).sum()) * self.embedding_dim * self.weight.element_size(),
            )
        dev = self.device
        rows = torch.empty(uniq.numel(), self.embedding_dim, dtype=self.weight.dtype, device=dev)
        if bool(cached.any()):
            at = slots[cached] * r + uniq[cached] % r if r > 1 else slots[cached]
            self._catch_up_rows(at)
            cached_rows = self.weight.data.index_select(0, to_device(at, dev))
            put_rows(rows, to_device(cached.nonzero().reshape(-1), dev), cached_rows)
        far = uniq[~cached]
        if far.numel():
            w = self.host_weight.index_select(0, far)
            s = self.last_step.index_select(0, far)
            if self._rule is not None and bool((s < self.t).any()):
                st = {k: self.host_state[k].index_select(0, far) for k in self._state_keys()}
                self._rule.catch_up_rows(w, st, s, self.t)
            put_rows(rows, to_device((~cached).nonzero().reshape(-1), dev), to_device(w, dev))
        return rows, place.reshape(input.shape), self._pad_place(uniq)
