"""Rows in and out of the row cache: ids remapped to slots, misses loaded (one gathered copy, a side
stream on CUDA), rows written back and evicted, the rows in use pinned."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from edo_monitor.nn.cache_eviction import _VictimChoice
from edo_monitor.nn.cache_parts import _CacheFullError, put_rows, rows_to_host, to_device
from edo_monitor.nn.table_checks import check_ids

logger = logging.getLogger(__name__)


class _RowMovement(_VictimChoice):
    """Rows in and out of the row cache (a part of :class:`~edo_monitor.nn.cached.CachedTable`):
    ids remapped to slots, misses loaded (one gathered copy, a side stream on CUDA), victims
    written back (chosen by :class:`~edo_monitor.nn.cache_eviction._VictimChoice`), the rows in
    use pinned."""

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

    def _row_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """The table ids ``(R,)`` held by cache ``rows`` ``(R,)`` (host int64, rows in use)."""
        r = self.block_rows
        return self.slot_to_block.index_select(0, rows // r) * r + rows % r

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
        ids, rows = self._real_rows(blocks, slots)
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
            if value is None:  # no state of the cache yet: its rows' state is their host rows'
                host = self.host_state[key]  # (a catch-up moved it: SGD's first momentum step)
                put_rows(host, ids, st[key].to(host.device, host.dtype))
                continue
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
                # the first growth a warning, later ones (a cache sized by growing) information
                grown_before, self._grown = getattr(self, "_grown", False), True
                logger.log(
                    logging.INFO if grown_before else logging.WARNING,
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
    def _mark_unchecked(self) -> None:
        """The cache is as made (or preloaded): the next :meth:`_check_cache_once` checks that no
        one wrote it since, by the weight's version (an in-place write moves it: ``nn.init`` on
        ``.weight``, a copy under ``no_grad``) and by the free slots' values."""
        self._cache_checked = False
        self._unchecked_mark = (weakref.ref(self.weight), self.weight._version)

    def _check_cache_once(self) -> None:
        """:meth:`_check_free_slots` unless done since the cache was made (or preloaded): called
        by whatever first writes or frees a slot (a lookup, a load, an eviction, a resize), so
        the check sees the slots as the user left them: an eviction frees slots that still hold
        their rows (a warm start's preloaded ones, evicted by a ``prefetch``), which read as
        written by the user."""
        if not getattr(self, "_cache_checked", True):
            self._check_free_slots()

    def _check_free_slots(self) -> None:
        """At the first load or lookup: the cache is as made, its free slots zero. ``weight`` is
        the cache ``(C, D)``, not the table: ``nn.init.normal_(table.weight)`` (or ``zeros_``)
        wrote only slots that no row used, the table kept its own values, and training went on
        from them, silently.

        Written is: the weight's version moved since the cache was made (any in-place write to
        it, zeros too; not through ``.data``, which autograd does not count), or a free slot
        holds a value. A copy of the module (``deepcopy``, a pickle) and a ``load_state_dict``
        (``assign=True`` too) mark the weight anew; a weight the user replaced by hand
        (``table.weight = nn.Parameter(...)``) is checked by its values only.

        Raises:
            ValueError: the cache was written, with the ways that initialise the table.
        """
        self._cache_checked = True
        ref, version = getattr(self, "_unchecked_mark", None) or (None, None)
        written = ref is not None and ref() is self.weight and self.weight._version != version
        if not written:
            free = (self.slot_to_block < 0).nonzero().reshape(-1)
            if free.numel() == 0:
                return
            rows = to_device(self._slot_rows(free), self.device)
            written = bool(self.weight.data.index_select(0, rows).any())  # one wait, once
        if written:
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
