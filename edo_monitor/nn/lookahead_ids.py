"""What a batch looks up, for :class:`~edo_monitor.nn.lookahead.LookAhead`: the ids function's
answer per table (a tensor, or a mapping by table module or name; a table module the agent
replaced stands for its replacement), and, without an ids function, each table's ids found
from its own lookups."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from edo_monitor.nn.cached import CachedTable

if TYPE_CHECKING:
    from edo_monitor.nn.lookahead import _Entry

__all__ = ["IdsFn", "first_int_tensor"]

logger = logging.getLogger(__name__)

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

IdsFn = Callable[[Any], "torch.Tensor | Mapping[Any, torch.Tensor]"]


def first_int_tensor(batch: Any) -> torch.Tensor:
    """The default ``ids``: the batch itself when it is an integer tensor, else the first integer
    tensor in it, depth first (tuple/list items in order, dict values in insertion order,
    dataclass fields in their order, at any depth: ``({"user": u, "item": i}, labels)`` gives
    ``u``).

    Raises:
        ValueError: the batch holds no integer tensor (naming its type).
    """
    leaves = _int_leaves(batch)
    if not leaves:
        raise ValueError(
            f"a batch of type {type(batch).__name__} holds no integer tensor; give LookAhead ids="
        )
    return leaves[0]


def _int_leaves(item: Any, depth: int = 0) -> list[torch.Tensor]:
    """The integer tensors of a batch, depth first (as :func:`first_int_tensor` finds them)."""
    if isinstance(item, torch.Tensor):
        return [item] if item.dtype in _INT_DTYPES else []
    if depth > 8:  # a self-referencing structure, or none a batch has
        return []
    if isinstance(item, Mapping):
        item = item.values()
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        item = [getattr(item, f.name) for f in dataclasses.fields(item)]
    elif not isinstance(item, (tuple, list)):
        return []
    return [t for value in item for t in _int_leaves(value, depth + 1)]


def _replacement(module: nn.Module) -> nn.Module:
    """The module that now stands for ``module``: a table module a table action replaced calls
    its replacement (:func:`edo_monitor.actions.tables.replace_module` makes its ``forward`` a
    ``ReplacedForward`` naming the new module), followed to the last; ``module`` itself
    otherwise. A ``loader_ids`` mapping keyed by the user's ``nn.Embedding`` then serves the row
    cache made of it."""
    for _ in range(16):  # a chain of replacements, never a cycle
        owner = getattr(module.__dict__.get("forward"), "replacement", None)
        if not isinstance(owner, nn.Module) or owner is module:
            break
        module = owner
    return module


class _IdsOfBatches:
    """The ids of a batch per table (a mixin of :class:`~edo_monitor.nn.lookahead.LookAhead`,
    which sets ``ids``, ``_auto`` and the learning state in its ``__init__``)."""

    ids: IdsFn
    _auto: bool
    _learned: dict[int, tuple[int, ...]]
    _heard: dict[int, set[int]]
    _unmatched: dict[int, int]
    _listening: dict[int, Any]
    _head: list[torch.Tensor] | None

    def _blocks(self, batch: Any, tables: list[tuple[str, CachedTable]]) -> dict[int, torch.Tensor]:
        """Unique blocks per table (``id(table)`` -> ``(U,)`` int64) of one batch."""
        got = self.ids(batch)
        if isinstance(got, Mapping):  # a table module the agent replaced: its replacement's
            got = {_replacement(k) if isinstance(k, nn.Module) else k: v for k, v in got.items()}
        leaves = _int_leaves(batch) if self._auto else []
        out: dict[int, torch.Tensor] = {}
        for name, table in tables:
            places = self._learned.get(id(table)) if self._auto else None
            if places and places[-1] < len(leaves):  # the tensors this table's lookups read
                v = torch.cat([leaves[k].reshape(-1).to("cpu", torch.int64) for k in places])
            elif isinstance(got, Mapping):
                v = got.get(table, got.get(name)) if name else got.get(table)
                if v is None:
                    continue
            else:
                v = got
            flat = self._id_tensor(v, name)
            flat = flat[(flat >= 0) & (flat < table.num_embeddings)]
            r = table.block_rows
            out[id(table)] = torch.unique(flat // r if r > 1 else flat)
        return out

    def _id_tensor(self, value: Any, name: str) -> torch.Tensor:
        """``ids(batch)``'s value for one table, flat int64 on the host; ``TypeError`` naming
        what it gave when that is not integer ids (a float id was truncated to a row)."""
        ids = value if isinstance(value, torch.Tensor) else None
        if ids is None:
            try:
                ids = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError):
                ids = None
        if ids is None or ids.is_complex() or ids.is_floating_point() or ids.dtype == torch.bool:
            what = type(value).__name__ if ids is None else f"{ids.dtype} values"
            table = f" for table {name!r}" if name else ""
            raise TypeError(
                f"LookAhead ids(batch) gave {what}{table}; expected an integer tensor of ids"
            )
        return ids.reshape(-1).to("cpu", torch.int64)

    # ------------------------------------------------------------------ ids found by lookups
    def _listen(self, batch: Any, tables: list[tuple[str, CachedTable]]) -> None:
        """Before ``batch`` is handed out (no ``ids``): each table whose ids are not learned yet
        reports what its forward looks up (:meth:`_heard_lookup`)."""
        pending = [t for _, t in tables if id(t) not in self._learned]
        self._head = _int_leaves(batch) if pending else None
        for table in pending:
            if id(table) not in self._listening:
                hear = functools.partial(self._heard_lookup, id(table))
                self._listening[id(table)] = table.add_lookup_listener(hear)

    def _heard_lookup(self, key: int, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """A table's lookup listener: ``ids`` (its distinct ids, ascending) against the served
        batch's integer tensors; the places of those with the same distinct ids are kept. Never
        raises into the forward."""
        try:
            heard = self._heard.setdefault(key, set())
            for k, leaf in enumerate(self._head or ()):
                seen = torch.unique(leaf.reshape(-1).to("cpu", torch.int64))
                if seen.numel() == ids.numel() and torch.equal(seen, ids):
                    heard.add(k)
        except Exception:  # a lookup must never fail for the look-ahead
            logger.debug("LookAhead: matching a lookup failed", exc_info=True)

    def _learn(self, window: deque[_Entry], tables: list[tuple[str, CachedTable]]) -> None:
        """After a batch's step (no ``ids``): each table that looked up the batch's tensors
        serves those from now on (the batches waiting are indexed again); one whose lookups
        matched none in 3 batches (the model transforms its ids) is served the first, said
        once."""
        names = {id(t): name or type(t).__name__ for name, t in tables}  # one table: no name
        learned = False
        for key, places in list(self._heard.items()):
            if places:
                self._learned[key], learned = tuple(sorted(places)), True
            else:
                self._unmatched[key] = self._unmatched.get(key, 0) + 1
                if self._unmatched[key] < 3:
                    continue
                self._learned[key] = ()
                logger.warning(
                    "LookAhead: table %s looks up ids that are none of the batch's integer "
                    "tensors (its model transforms them? or the loop's step runs another batch "
                    "than the one handed out last: a loop that reads the next batch before "
                    "its step defeats the look-ahead): it is served the batch's first; give "
                    "ids= (loader_ids= in watch()) mapping its name to its ids",
                    names.get(key) or "?",
                )
            handle = self._listening.pop(key, None)
            if handle is not None:
                handle.remove()
        self._heard.clear()
        if learned:
            for entry in window:
                entry.indexed_for = frozenset()
