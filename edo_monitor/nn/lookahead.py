"""Eviction that looks ahead: a wrapper over the training loader for the row cache (issue 23).

A training loader knows its next batches. :class:`LookAhead` reads ``ahead`` batches in advance
and, for each :class:`~edo_monitor.nn.cached.CachedTable` it serves:

* while step ``i`` runs, the misses of batch ``i + 1`` are already fetched (below): the
  ``next()`` that hands out batch ``i`` stages batch ``i + 1``, so the forward of a batch finds
  its rows resident (counted: :attr:`CacheStats.forward_loads` are the loads a forward still had
  to do, :attr:`LookAhead.late_loads` those at the batch's own ``next()``);
* eviction chooses by next use inside the window (Belady: among rows used again within the next
  ``ahead`` batches, the one used furthest ahead goes first) and by frequency beyond it: rows not
  used in the window go before any row used in it, the least frequent first (ties: least recently
  used). Admission: a row loaded for one batch has a count of one, so once its batch has run it is
  the first to go and never pushes out a frequent row that the window does not need;
* rows the running step needs are never evicted (nor, as without the wrapper, rows holding a
  gradient since the last optimizer step), and neither are the prefetched, not yet run, batch's
  while the two batches fit. The next batch's misses are *staged* while step ``i`` runs (host
  gather, on CUDA the copy to the device on the side stream; the rows stay at their own steps
  and the batch's forward catches them up with its other stale rows) and placed into the
  cache at the ``next()`` after step ``i``, when batch ``i``'s rows may go: prefetching does not
  hold two batches in the cache. Where a batch and the next one's cached rows do not fit, the
  staging is dropped and the running batch's loads take the next one's rows (they load again
  at its turn): the wrapper never makes the cache grow or raise where it would not without it
  (issue 23 asked never to evict the prefetched batch's rows; kept to the letter, a cache that
  fits every batch grew or raised under the wrapper).

Cost of the eviction decision per step: ``O(K x U)`` to index the window (``U`` unique ids per
batch, ``K = ahead``; vectorized, one ``scatter_reduce`` into a persistent per-block array, reset
in the same ``O(K x U)``), ``O(U)`` for the protected set, and the victim choice of the cache
(:class:`~edo_monitor.nn.victims.VictimOrder` from 2^17 slots on): ``O(U + need log need)``
amortized, the rows inside the window left out of it; in smaller caches, and when the rows
outside the window are too few, one compare over the ``C`` scores the cache keeps and a
selection among the candidates under a bound (``O(C)`` elementwise, ``O(candidates)``; a
selection over every slot, the window's rows by next use, every few evictions).

Without the wrapper the cache works as before (its LFU or LRU policy).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from edo_monitor.checks import whole_number
from edo_monitor.nn.cache_parts import _CacheFullError, changes_cache, put_rows
from edo_monitor.nn.cached import CachedTable
from edo_monitor.nn.lookahead_ids import IdsFn, _IdsOfBatches, first_int_tensor

__all__ = ["LookAhead", "first_int_tensor"]

logger = logging.getLogger(__name__)

_NEVER = 1 << 62  # next use of a block outside the window
_BIG = 1 << 62  # score offset of rows used inside the window (above every frequency score)


def _then_raise(batches: list[Any], error: Exception) -> Iterator[Any]:
    """``batches``, then ``error`` raised (a one-shot loader's, read ahead before a ``break``)."""
    yield from batches
    raise error


class _Window:
    """One table's view of the window: next use per block and the protected blocks."""

    def __init__(self, table: CachedTable) -> None:
        self.next_use = torch.full((table.num_blocks,), _NEVER, dtype=torch.int64)
        self.indexed = torch.zeros(0, dtype=torch.int64)  # blocks whose next_use is set
        self.protected = torch.zeros(0, dtype=torch.int64)
        self.staged: dict[str, Any] | None = None  # rows staged for the batch about to run
        self.num_blocks = table.num_blocks

    def index(self, batches: list[tuple[int, torch.Tensor]]) -> None:
        """Set ``next_use`` from ``(batch number, unique blocks)`` of the window (``O(K x U)``)."""
        if self.indexed.numel():
            put_rows(self.next_use, self.indexed, _NEVER)
        if not batches:
            self.indexed = torch.zeros(0, dtype=torch.int64)
            return
        blocks = torch.cat([b for _, b in batches])
        numbers = torch.tensor([n for n, _ in batches], dtype=torch.int64)
        when = numbers.repeat_interleave(torch.tensor([b.numel() for _, b in batches]))
        self.next_use.scatter_reduce_(0, blocks, when, reduce="amin")
        self.indexed = blocks


def _versioned(t: torch.Tensor) -> bool:
    """Whether ``t`` keeps a version counter (torch's count of in-place writes to it and its
    views): an inference tensor, and some tensor subclasses, do not."""
    if t.is_inference():
        return False
    try:
        t._version  # noqa: B018 - read to see that it can be
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def _region(t: torch.Tensor) -> tuple[int, int, int]:
    """The storage (its address) and the bytes ``[start, end)`` in it that ``t`` covers."""
    size = t.element_size()
    start = t.storage_offset() * size
    steps = zip(t.shape, t.stride(), strict=True)
    extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in steps)
    return t.untyped_storage().data_ptr(), start, start + extent * size


def _written_elsewhere(t: torch.Tensor, written: list[torch.Tensor]) -> bool:
    """Whether the write that changed ``t``'s version counter (shared by every view of one
    tensor) is explained by the new batch's tensors ``written``: one of them in ``t``'s
    storage, none covering bytes of ``t`` (a ring of buffers, rows of one tensor, was refused
    as "one buffer reused")."""
    where, start, end = _region(t)
    shared = False
    for other in written:
        o_where, o_start, o_end = _region(other)
        if o_where != where:
            continue
        if o_start < end and start < o_end:
            return False
        shared = True
    return shared


class _Entry:
    """A batch read ahead: its number, the batch, its tensors one level deep (the batch, its
    tuple/list items, its dict values: watched for the loader writing into them), its unique
    blocks per table (``None``: not indexed yet), the tables (``id``) it was indexed for and
    the error ``ids(batch)`` raised for it."""

    __slots__ = ("batch", "blocks", "error", "indexed_for", "number", "tensors")

    def __init__(self, number: int, batch: Any) -> None:
        self.number = number
        self.batch = batch
        if isinstance(batch, torch.Tensor):
            items: Iterable[Any] = (batch,)
        elif isinstance(batch, Mapping):
            items = batch.values()
        else:
            items = batch if isinstance(batch, (tuple, list)) else ()
        self.tensors = [t for t in items if isinstance(t, torch.Tensor) and _versioned(t)]
        self.blocks: dict[int, torch.Tensor] | None = None
        self.indexed_for: frozenset[int] = frozenset()
        self.error: Exception | None = None


class LookAhead(_IdsOfBatches):
    """Iterate ``loader`` with ``ahead`` batches read in advance, prefetching and evicting by them.

    ``for batch in LookAhead(loader, ahead=8, ids=lambda b: b[0], tables=model): ...``

    The batches are handed out as the loader gave them, in its order, and each is held from its
    read until it is handed out: a loader must yield a new tensor for every batch. One that
    refills a single buffer (``buf.fill_(i); yield buf``) would have overwritten the batches
    still waiting by the time they are handed out; a torch write into a waiting batch's tensor
    (one level deep: the batch, its tuple/list items, its dict values, and views of them)
    while the loader reads the next one is refused (``ValueError``, below). A write torch does
    not see (through NumPy into ``torch.from_numpy(buf)``) is not detected. A ``DataLoader``
    yields new tensors (``pin_memory`` and workers too); so does ``yield buf.clone()``. The
    same unchanged tensor yielded twice is fine.

    An exception from the loader surfaces where iterating the loader itself would have raised
    it: the batches read before it are handed out first, then the same exception object is
    raised; an error of ``ids(batch)`` likewise surfaces at that batch's turn. A pass that stops
    early (``break``) over a one-shot loader (an iterator or generator: ``iter(loader) is
    loader``) keeps the batches it read ahead: the next pass hands them out first, as the
    iterator itself would have given them (they were dropped: 8 batches a ``break``); while a
    pass over one is still going (an iterator kept for a warm-up ``next()``), ``iter()`` gives
    that pass, as ``iter()`` of the iterator gives the iterator. A loader
    whose batches depend on the training state (hard negatives mined from the current model)
    is read ``ahead + 1`` batches early, from an older model: its batches differ from the plain
    loop's.

    Args:
        loader: any iterable of batches (a ``DataLoader``); read ``ahead + 1`` batches ahead.
        ahead: the window ``K >= 1``, in batches.
        ids: ``ids(batch)`` gives the ids a batch looks up: one tensor (every table looks up
            the same ids; any shape, int64/int32) or a mapping from the table (the module, or
            its name in ``tables`` when that is a model) to its tensor. Default: each table's
            found from its own lookups: the batch's integer tensors (depth first) whose distinct
            ids a table looked up at a batch's forward are that table's from then on; until
            then, and for a table that looks up none of them (its model transforms the ids: a
            warning after 3 batches), the first (:func:`first_int_tensor`). Tables the mapping
            leaves out are served without look-ahead; ids outside a table's ``[0, N)`` are
            ignored (the forward names them). Errors it raises propagate, at that batch's turn
            (``ids_errors="warn"``: one warning, and that batch served without look-ahead: the
            agent's ``watch(loader=)`` never fails training on it).
        tables: the cached tables: a model (its :class:`CachedTable` modules are found at every
            batch, so tables converted later by the agent are served from then on; a warning,
            once, when a pass starts with none), one table, or an iterable of tables; ``None``
            serves none (a warning, once, when iterated).

    Raises:
        ValueError: ``ahead`` not an int >= 1, ``ids`` not callable, ``tables`` of another type
            or a module that is no cached table and holds none (a plain ``nn.Embedding``: the
            agent converts a table by replacing it in its parent, where this reference would
            not see it); when iterated, a loader that wrote into a batch still waiting in the
            window (naming the batch and the fix).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        ahead: int = 8,
        ids: IdsFn | None = None,
        tables: nn.Module | Iterable[CachedTable] | None = None,
        *,
        ids_errors: str = "raise",
    ) -> None:
        ahead = whole_number(ahead, "ahead", 1)
        if ids_errors not in ("raise", "warn"):
            raise ValueError(f"ids_errors={ids_errors!r}; expected 'raise' or 'warn'")
        self._auto = ids is None  # each table's ids found from its own lookups
        if ids is None:
            ids = first_int_tensor
        if not callable(ids):
            raise ValueError(f"ids={ids!r}; expected a function batch -> ids tensor (or mapping)")
        if isinstance(tables, (str, bytes)) or (
            tables is not None and not isinstance(tables, (nn.Module, Iterable))
        ):
            raise ValueError(f"tables={tables!r}; expected a model, a CachedTable or tables")
        if (
            isinstance(tables, nn.Module)
            and not isinstance(tables, CachedTable)
            and next(tables.children(), None) is None
        ):
            raise ValueError(
                f"tables={tables!r} holds no cached table, and none can appear in it (a "
                f"{type(tables).__name__} with no submodules: the agent converts a table by "
                "replacing it in its parent); pass the model (its cached tables are found at "
                "every batch, those converted later too) or the CachedEmbedding modules"
            )
        if tables is not None and not isinstance(tables, nn.Module):
            tables = tuple(tables)  # iterated at every batch: a generator would be spent
            for i, table in enumerate(tables):
                if not isinstance(table, CachedTable):
                    raise ValueError(
                        f"tables[{i}] is a {type(table).__name__}; expected CachedTable modules "
                        f"(or pass the model, whose cached tables are found at every batch)"
                    )
        self.loader = loader
        self.ahead = ahead
        self.ids = ids
        self.tables = tables
        self._windows: dict[int, _Window] = {}
        #: blocks loaded for a batch at its own ``next()`` (not staged one batch ahead): the first
        #: batch's, and those whose staging was dropped; on the critical path like forward loads
        self.late_loads = 0
        self._warned = False  # serving no table said (once)
        self.ids_errors = ids_errors
        self._ids_warned = False  # an error of ids(batch) said (once), with ids_errors="warn"
        #: (no ``ids``) per table (``id``), the places of the batch's integer tensors (depth
        #: first) its lookups read, learned at a batch's forward; ``()``: none of
        #: them (the model transforms its ids): the first is served
        self._learned: dict[int, tuple[int, ...]] = {}
        self._heard: dict[int, set[int]] = {}  # the served batch's tensors each table read
        self._unmatched: dict[int, int] = {}  # served batches whose lookups matched none
        self._listening: dict[int, Any] = {}  # lookup listeners' handles, until learned
        self._head: list[torch.Tensor] | None = None  # the served batch's integer tensors
        #: passes begun over the loader (``watch()`` warns at the end of a run that began none)
        self.passes = 0
        #: a one-shot loader's batches read ahead and not handed out when a pass stopped early
        #: (and its exception, if it had raised): the next pass hands them out first
        self._carried: list[Any] = []
        self._carried_error: Exception | None = None
        #: the pass over a one-shot loader handed out last (``iter()`` gives it while it goes on)
        self._going: weakref.ReferenceType[Generator[Any, None, None]] | None = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ tables and ids
    def _named_tables(self) -> list[tuple[str, CachedTable]]:
        t = self.tables
        if isinstance(t, CachedTable):
            return [("", t)]
        if isinstance(t, nn.Module):
            return [(n, m) for n, m in t.named_modules() if isinstance(m, CachedTable)]
        if t is None:
            return []
        return [(str(i), m) for i, m in enumerate(t) if isinstance(m, CachedTable)]

    # ------------------------------------------------------------------ the cache's hooks
    def protected_slots(self, table: CachedTable) -> torch.Tensor:
        """Slots ``(P,)`` of the running and prefetched batches' cached blocks."""
        w = self._windows.get(id(table))
        if w is None or w.protected.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        slots = table.block_to_slot.index_select(0, w.protected)
        return slots.masked_select(slots >= 0)

    def inside(self, table: CachedTable) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``blocks -> bool`` (each used within the window), or ``None`` when ``table`` has no
        window."""
        w = self._windows.get(id(table))
        if w is None:
            return None
        next_use = w.next_use
        return lambda blocks: next_use.index_select(0, blocks) < _NEVER

    def score(self, table: CachedTable, blocks: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """Eviction scores (smallest first) of ``blocks`` (one per slot; a free slot's entry is
        masked by the caller): the cache's own (frequency) score beyond the window, above it the
        rows used inside it, furthest next use first."""
        w = self._windows.get(id(table))
        if w is None:
            return score
        nu = w.next_use.index_select(0, blocks)
        inside = nu < _NEVER
        return torch.where(inside, _BIG - nu, score)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        """A pass over the loader; over a one-shot loader, the pass still going if there is
        one, as ``iter()`` of an iterator gives the iterator itself (a new pass took the batches
        after those the going one had read ahead: a warm-up ``next(iter(loader))`` and then a
        ``for`` loop skipped ``ahead + 1`` batches)."""
        going = self._going() if self._going is not None else None
        if going is not None and going.gi_frame is not None:  # not finished
            return going
        self._say_if_serving_none()
        self.passes += 1
        source = iter(self.loader)
        one_shot = source is self.loader  # a DataLoader's iter() restarts; an iterator's not
        run = self._pass(source, one_shot)
        self._going = weakref.ref(run) if one_shot else None  # a dropped pass still ends
        return run

    def _pass(self, source: Iterator[Any], one_shot: bool) -> Iterator[Any]:
        """One pass over ``source`` (``one_shot``: the loader itself, not restarted)."""
        carried, self._carried = self._carried, []
        carried_error, self._carried_error = self._carried_error, None
        it: Iterator[Any] = source
        if one_shot and carried_error is not None:  # it raised: the same error after them
            it = _then_raise(carried, carried_error)
        elif one_shot and carried:
            it = itertools.chain(carried, source)
        window: deque[_Entry] = deque()
        count = 0
        failed: list[Exception] = []  # the loader's exception, raised once the window drains
        exhausted = False  # the loader's StopIteration is final for this epoch: not called again

        def pull() -> bool:
            nonlocal count, exhausted
            if failed or exhausted:
                return False
            waiting = [(e, t, t._version) for e in window for t in e.tensors]
            try:
                batch = next(it)
            except StopIteration:  # an iterator that rewinds would mix the next epoch in
                exhausted = True
                return False
            except Exception as err:  # the plain loop raises it after the batches read before
                failed.append(err)
                return False
            new = _Entry(count, batch)
            for entry, t, version in waiting:
                if t._version != version and not _written_elsewhere(t, new.tensors):
                    raise self._reused_buffer(entry, t, count)
            window.append(new)
            count += 1
            return True

        served: list[CachedTable] = []
        try:
            while len(window) < self.ahead + 1 and pull():
                pass
            while window:
                tables = self._named_tables()
                if self._auto:
                    self._learn(window, tables)
                self._index(window, tables)
                head = window[0]
                if head.error is not None:
                    raise head.error
                for _, table in tables:
                    self._serve(table, window, served)
                if self._auto:
                    self._listen(head.batch, tables)
                try:
                    yield head.batch
                except GeneratorExit:  # the pass stopped early: keep what was read ahead
                    if one_shot:
                        self._carried = [e.batch for e in list(window)[1:]]
                        self._carried_error = failed[0] if failed else None
                    raise
                window.popleft()
                pull()
            if failed:
                raise failed[0]
        finally:
            for table in served:
                if table._lookahead is self:
                    table._lookahead = None
            self._windows.clear()
            for handle in self._listening.values():
                handle.remove()
            self._listening.clear()
            self._head = None

    def _index(self, window: deque[_Entry], tables: list[tuple[str, CachedTable]]) -> None:
        """Call ``ids(batch)`` for the waiting batches not indexed for every table in
        ``tables`` (once per batch, again only when a table appears); an error it raises is
        kept, raised at that batch's turn. With no table to serve, no call: the batches pass
        through as the loader gives them (a float-only batch raised ``ids``' error). A table
        the mapping leaves out is no reason to call again (``ahead + 1`` calls a batch: 414
        for 50 batches at ``ahead=8``)."""
        if not tables:
            return
        now = frozenset(id(t) for _, t in tables)
        for entry in window:
            if entry.error is None and not now <= entry.indexed_for:
                try:
                    entry.blocks = self._blocks(entry.batch, tables)
                except Exception as err:  # raised at this batch's turn, or said once
                    entry.blocks = {}
                    if self.ids_errors == "raise":
                        entry.error = err
                    elif not self._ids_warned:
                        self._ids_warned = True
                        logger.warning(
                            "LookAhead: ids(batch) failed (%s: %s); such batches are served "
                            "without look-ahead (give loader_ids=: a function batch -> ids)",
                            type(err).__name__,
                            err,
                        )
                entry.indexed_for = now

    def _say_if_serving_none(self) -> None:
        """Warn (once) that this look-ahead serves no table: ``tables=None``, or a model holding
        no cached table yet (a table the agent converts later is served from then on)."""
        if self._warned or not (self.tables is None or not self._named_tables()):
            return
        self._warned = True
        if self.tables is None:
            logger.warning(
                "LookAhead(tables=None) reads ahead but serves no table: pass the model, a "
                "cached table or the cached tables as tables="
            )
        else:
            logger.warning(
                "LookAhead(tables=<%s>) finds no cached table in it: it reads ahead but serves "
                "none until one appears (a table the agent converts is served from the next "
                "batch); convert its tables (CachedEmbedding) or pass the model that holds them",
                type(self.tables).__name__,
            )

    def _reused_buffer(self, entry: _Entry, t: torch.Tensor, reading: int) -> ValueError:
        """The error for a loader that wrote into ``t`` of ``entry`` (still waiting) while
        giving batch ``reading``."""
        return ValueError(
            f"LookAhead: the loader wrote into batch {entry.number} (counting from 0; a "
            f"{t.dtype} tensor of shape {tuple(t.shape)}) while giving batch {reading}: it "
            f"reuses one buffer for its batches, and batch {entry.number}, read ahead "
            f"(ahead={self.ahead}) and not handed out yet, would be handed out holding a later "
            "batch's values; yield a new tensor for every batch (e.g. `yield buf.clone()`)"
        )

    @changes_cache
    def _serve(self, table: CachedTable, window: deque[_Entry], served: list) -> None:
        """Before batch ``window[0]`` runs (the step before it has run): place the rows staged for
        it into the cache, load what is still missing (counted in :attr:`late_loads`), and stage
        the misses of batch ``window[1]`` (host gather and, on CUDA, the copy to the
        device on the side stream), to be placed at the next call, when the step of this batch
        has run and its rows may go."""
        key = id(table)
        w = self._windows.get(key)
        if w is None or w.num_blocks != table.num_blocks:
            w = self._windows[key] = _Window(table)
        if table._lookahead is not self:
            table._lookahead = self
            served.append(table)
        ahead = [(e.number, e.blocks[key]) for e in window if e.blocks and key in e.blocks]
        staged, w.staged = w.staged, None
        if not ahead:
            w.index([])
            w.protected = torch.zeros(0, dtype=torch.int64)
            return
        w.index(ahead)
        now, nxt = ahead[0][1], ahead[1][1] if len(ahead) > 1 else None
        w.protected = now if nxt is None else torch.cat([now, nxt])
        with torch.no_grad():
            if staged is not None:
                self._place(table, staged)
            before = table._counters["misses"]
            table.prefetch(now * table.block_rows)  # loads only what staging did not bring
            self.late_loads += table._counters["misses"] - before
            if nxt is not None:
                miss = nxt.masked_select(table.block_to_slot.index_select(0, nxt) < 0)
                if 0 < miss.numel() <= table.slot_to_block.numel():
                    # at their own steps: the batch's forward catches them up with its other
                    # stale rows, in one pass (on a device, not on the host)
                    w.staged = table._stage_blocks(miss, catch_up=False)

    @staticmethod
    def _place(table: CachedTable, staged: dict[str, Any]) -> None:
        """Place ``staged`` rows into slots evicted now (protected: the batch about to run and
        the next one); dropped (the rows load later) when a staged row was cached or written
        back since, a state dict was loaded since, or the cache has no evictable slots for
        them."""
        blocks = staged["blocks"]
        if set(staged["st"]) != set(table._state_keys()) or staged["step"] > table.t:
            return  # the optimizer was attached (or reloaded) since: stage again
        if staged["rewrites"] != table._rewrites:
            return  # a state dict was loaded since: the staged rows are the old ones
        if bool((table.block_to_slot.index_select(0, blocks) >= 0).any()) or not torch.equal(
            table.last_step.index_select(0, staged["ids"]), staged["s"]
        ):
            return
        try:
            slots = table._evict(blocks.numel(), torch.zeros(0, dtype=torch.int64))
        except _CacheFullError:
            return
        table._place_staged(staged, slots)
