"""Lookups per id of embedding tables, counted cheaply on the training thread.

A :class:`LookupCounter` installs a forward pre-hook on each table it watches and, on every
``sample_every``-th forward of that table, adds the batch's ids to a per-table ``(N,)`` int64 count
tensor in host memory (``index_add_`` of the batch's ids: work in the batch size, never in the
table size; the batch's distinct ids are counted without sorting it). A table that computes its
batch's unique ids itself (a :class:`~edo_monitor.nn.CachedTable`, through
``add_lookup_listener``) hands them over instead of the hook computing them a second time. ``N``
int64 counts are 8 bytes a row on the host (and a hook's position stamp 4 more), against
``4 × D × 4`` bytes a row on the device for a float32 table trained with Adam (weight, gradient,
two moments): for ``D = 64`` that is 0.8 % (1.2 %), and none of it on the device.

The counts are a sample: with ``sample_every = s`` they estimate ``s ×`` the true counts; shares
(what fraction of lookups the top ``K`` ids cover) need no scaling. EmbeddingBag inputs count each
entry of each bag, ``padding_idx`` entries excluded (they read no trainable row). The counter also
keeps each table's peak of distinct ids in one counted forward (``cache_embedding`` sizes a cache
from it).

The hook never raises into the user's forward: an unexpected error is logged once and that table's
counting stops.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edo_monitor.checks import whole_number
from edo_monitor.measure.module_hooks import add_forward_pre_hook

__all__ = ["LookupCounter", "TableFrequency"]

logger = logging.getLogger(__name__)

_ONE = torch.ones(1, dtype=torch.long)  # expanded to a batch's length: one lookup per id


@dataclass(frozen=True)
class TableFrequency:
    """What the counts say about one table.

    Attributes:
        table: the module's qualified name.
        sampled_lookups: lookups counted (``padding_idx`` excluded).
        distinct_ids: ids seen at least once.
        top_ids: the ``k`` most looked-up ids, most frequent first (ties by lower id).
        top_counts: their counts.
        top_share_fraction: share of the counted lookups that ``top_ids`` cover (0 with none).
        peak_unique_ids: most distinct ids one counted forward looked up (what a row cache of
            the table holds at least; hindsight reads it from the run's event).
    """

    table: str
    sampled_lookups: int
    distinct_ids: int
    top_ids: list[int]
    top_counts: list[int]
    top_share_fraction: float
    peak_unique_ids: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return {
            "table": self.table,
            "sampled_lookups": self.sampled_lookups,
            "distinct_ids": self.distinct_ids,
            "top_ids": self.top_ids,
            "top_counts": self.top_counts,
            "top_share_fraction": self.top_share_fraction,
            "peak_unique_ids": self.peak_unique_ids,
        }


class _Table:
    """One watched table's counts and the hook's scratch (see :class:`LookupCounter`)."""

    def __init__(self, num: int, name: str) -> None:
        self.num = num
        self.name = name  # in the warning about ids outside the table
        self.pad: int | None = None
        self.counts = torch.zeros(num, dtype=torch.long)
        self.peak_unique = 0
        self.calls = 0
        # the distinct-id count without a sort (torch.unique sorted the batch: 0.3 ms of a
        # 1024 x 7 batch, the largest part of the agent's cost on the training thread): each
        # position of the batch writes its index into `stamp` at its id; duplicates of an id
        # leave exactly one of their positions there, so the positions that read their own
        # index back are one per distinct id. O(batch); int32 positions, 4 bytes a row on the
        # host beside the counts' 8.
        self.stamp = torch.empty(0, dtype=torch.int32)
        self.positions = torch.empty(0, dtype=torch.int32)
        #: ids copied from a GPU without waiting for it: (pinned host copy, the copy's event)
        self.pending: deque[tuple[torch.Tensor, Any]] = deque()
        self.warned_range = False


class LookupCounter:
    """Counts lookups per id for the embedding tables of a model.

    Args:
        sample_every: count one forward in this many, per table (``>= 1``; 1 = every forward).

    Use :meth:`watch` to start counting a table, :meth:`counts` / :meth:`frequency` to read, and
    :meth:`close` to remove every hook. Counting runs on the thread that runs the forward (the
    training thread); reading from another thread sees a consistent-enough snapshot (counts only
    grow).

    Ids on a GPU are copied to pinned host memory without waiting for the GPU (``non_blocking``,
    a CUDA event recorded after the copy) and counted once the copy is done: at a later forward
    of the table (usually the next), or when the counts are read, which waits for the copies
    still running. At most :data:`MAX_PENDING` copies wait; one more waits for the oldest.
    Reading ``ids.cpu()`` in the hook made every forward wait for the GPU's queue.

    Raises:
        ValueError: for ``sample_every < 1``.
    """

    #: copies of a table's ids from a GPU that may be in flight at once
    MAX_PENDING = 16

    def __init__(self, sample_every: int = 1) -> None:
        self.sample_every = whole_number(sample_every, "sample_every", 1)
        self._tables: dict[str, _Table] = {}
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()  # the pending copies: the training thread and readers

    def watch(self, name: str, module: nn.Module) -> None:
        """Count lookups of ``module`` (an ``nn.Embedding``/``nn.EmbeddingBag`` or EDO table with
        ``num_embeddings``) under ``name``. Watching a name again replaces its hook, keeps counts.
        """
        if name in self._handles:
            self._handles.pop(name).remove()
        table = self._tables.setdefault(name, _Table(int(module.num_embeddings), name))
        table.pad = getattr(module, "padding_idx", None)
        add_listener = getattr(module, "add_lookup_listener", None)
        if callable(add_listener):
            # a row cache computes the batch's unique ids anyway: count from those
            self._handles[name] = add_listener(
                lambda uniq, mult: self._on_unique(name, table, uniq, mult)
            )
            return
        # not torch's own hook: a copy or pickle of the model would carry the lambda
        self._handles[name] = add_forward_pre_hook(
            module, lambda _module, args, kwargs: self._on_forward(name, table, args, kwargs)
        )

    def _sampled(self, table: _Table) -> bool:
        table.calls += 1
        return (table.calls - 1) % self.sample_every == 0

    def _stop(self, name: str, exc: Exception) -> None:
        logger.warning("lookup counting stopped for %s: %s", name, exc)
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.remove()

    def _on_unique(self, name: str, table: _Table, uniq: torch.Tensor, mult: torch.Tensor) -> None:
        """A row cache's listener: the batch's unique ids and their multiplicities."""
        try:
            if not self._sampled(table):
                return
            if table.pad is not None:
                keep = uniq != table.pad
                uniq, mult = uniq[keep], mult[keep]
            table.counts.index_add_(0, uniq.cpu(), mult.cpu())
            table.peak_unique = max(table.peak_unique, int(uniq.numel()))
        except Exception as exc:  # never fail the user's forward
            self._stop(name, exc)

    def _on_forward(
        self, name: str, table: _Table, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """The forward pre-hook: count the batch's ids (the first argument, or ``input=``, the
        name torch's tables give it), at once on the CPU, after their copy from a GPU (see the
        class docstring)."""
        try:
            ids = args[0] if args else kwargs.get("input")
            if not self._sampled(table) or not isinstance(ids, torch.Tensor):
                return
            flat = ids.detach().reshape(-1)
            with self._lock:
                if flat.is_cuda:
                    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                    table.pending.append((host, done))
                    self._drain(table, wait=len(table.pending) > self.MAX_PENDING)
                else:
                    self._count(table, flat)
        except Exception as exc:  # never fail the user's forward
            self._stop(name, exc)

    def _drain(self, table: _Table, wait: bool) -> None:
        """Count the pending copies that are done, oldest first; with ``wait``, the oldest
        whatever it takes (lock held)."""
        while table.pending:
            host, done = table.pending[0]
            if wait:
                done.synchronize()
                wait = False
            elif not done.query():
                return
            table.pending.popleft()
            self._count(table, host)

    def _drain_all(self, name: str) -> _Table:
        """Table ``name`` with every pending copy counted (waits for them).

        Raises:
            KeyError: for a table that was never watched.
        """
        table = self._tables[name]
        with self._lock:
            while table.pending:
                self._drain(table, wait=True)
        return table

    def _count(self, table: _Table, flat: torch.Tensor) -> None:
        """Add one batch of host ids to the counts and the distinct-id peak (lock held)."""
        flat = flat.long()
        if table.pad is not None:
            flat = flat[flat != table.pad]
        n = flat.numel()
        if n == 0:
            return
        low, high = (int(v) for v in torch.aminmax(flat))
        if low < 0 or high >= table.num:  # the table's own lookup fails on it: not counted
            if not table.warned_range:
                table.warned_range = True
                logger.warning(
                    "lookup counting: a batch of %s holds id %d, outside its %d rows; batches "
                    "like it are not counted",
                    table.name,
                    low if low < 0 else high,
                    table.num,
                )
            return
        if table.stamp.numel() != table.num:
            table.stamp = torch.zeros(table.num, dtype=torch.int32)
        if table.positions.numel() < n:
            table.positions = torch.arange(max(n, 2 * table.positions.numel()), dtype=torch.int32)
        table.counts.index_add_(0, flat, _ONE.expand(n))
        own = table.positions[:n]
        table.stamp.scatter_(0, flat, own)  # index_select/scatter_: the fast kernels on CPU
        distinct = int(table.stamp.index_select(0, flat).eq_(own).sum())
        table.peak_unique = max(table.peak_unique, distinct)

    def watch_tables(self, model: nn.Module) -> list[str]:
        """Watch every embedding table of ``model`` (as :func:`edo_monitor.measure.accounting.
        is_table_module` sees them); returns their names."""
        from edo_monitor.measure.accounting import is_table_module
        from edo_monitor.measure.module_tree import module_label

        names = []
        for name, module in model.named_modules():
            if is_table_module(module) and hasattr(module, "num_embeddings"):
                self.watch(module_label(name), module)
                names.append(module_label(name))
        return names

    def counts(self, name: str) -> torch.Tensor:
        """The ``(N,)`` int64 count tensor of table ``name`` (live: it keeps growing).

        Raises:
            KeyError: for a table that was never watched.
        """
        return self._drain_all(name).counts

    def peak_unique_ids(self, name: str) -> int | None:
        """Most distinct ids one counted forward of table ``name`` looked up (``padding_idx``
        left out); ``None`` before its first counted forward. ``cache_embedding`` sizes a cache
        to hold at least this many rows."""
        if name not in self._tables:
            return None
        peak = self._drain_all(name).peak_unique
        return peak or None

    @property
    def tables(self) -> Iterable[str]:
        """Names of the tables with counts."""
        return tuple(self._tables)

    def _ranked(self, name: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, counts) of the ``k`` most looked-up ids seen, by count desc, then id asc."""
        counts = self._drain_all(name).counts
        seen = torch.nonzero(counts, as_tuple=True)[0]  # ascending ids: only these are sorted
        # a stable sort of the negated counts orders ties by id (topk would order them arbitrarily)
        order = seen[torch.sort(-counts[seen], stable=True).indices[: max(0, k)]]
        return order, counts[order]

    def frequency(self, name: str, k: int = 10) -> TableFrequency:
        """The top ``k`` ids of table ``name`` and the share of lookups they cover.

        Raises:
            KeyError: for a table that was never watched.
        """
        table = self._drain_all(name)
        counts = table.counts
        total = int(counts.sum())
        ids, top = self._ranked(name, k)
        return TableFrequency(
            table=name,
            sampled_lookups=total,
            distinct_ids=int((counts > 0).sum()),
            top_ids=ids.tolist(),
            top_counts=top.tolist(),
            top_share_fraction=int(top.sum()) / total if total else 0.0,
            peak_unique_ids=table.peak_unique,
        )

    def hot_ids(self, name: str, k: int) -> torch.Tensor:
        """The ``k`` most looked-up ids of ``name`` (fewer when fewer were seen), int64 ``(<=k,)``.

        Raises:
            KeyError: for a table that was never watched.
        """
        return self._ranked(name, k)[0]

    def close(self) -> None:
        """Remove every hook (counts stay readable; copies still in flight are counted when
        they are read)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
