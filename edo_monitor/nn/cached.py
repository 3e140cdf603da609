"""A device row cache over a host-resident embedding table, with exact optimizer semantics.

:class:`~edo_monitor.nn.cached_modules.CachedEmbedding` / ``CachedEmbeddingBag`` (in
``cached_modules.py``) are drop-ins for ``nn.Embedding`` / ``nn.EmbeddingBag``. The full table
``(num_embeddings, embedding_dim)`` and each row's optimizer state live in host memory (pinned when
the cache is on CUDA); ``cache_rows`` rows live in the device cache ``weight`` ``(cache_rows,
embedding_dim)``, which is the ``Parameter`` the user's optimizer holds (it does not step it: see
"Every row lazy" below). Each forward:

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
  as ``(beta1 / sqrt(beta2)) ** j``; the first ``K`` terms are summed exactly, until the whole
  rest is below half an ulp of the dtype (373 steps at the default betas in float64, 181 in
  float32); decoupled decay is a product (segment
  tree). Cost ``O(rows × min(missed, K) × dim)``.
* ``Adagrad`` without weight decay: a zero gradient changes nothing.
* Refused by name (``ValueError``): L2 ``weight_decay`` with Adam or Adagrad (the update is
  nonlinear and does not decay: no bounded exact catch-up), ``fused``/``capturable`` groups, other
  optimizer classes, ``sparse=True``.

Every row lazy, the step fused (issue 23). The user's optimizer does not step ``weight``: no
``(C, D)`` gradient exists. The forward returns the batch's unique rows ``(U, D)`` through
:class:`~edo_monitor.nn.cache_step.CacheRows`; a backward that accumulates into ``weight``
(``loss.backward()``, not ``torch.autograd.grad``) adds their gradient into ``batch_rows.grad``
``(U, D)`` (``U``: the rows touched since the last optimizer step, in the order
:meth:`CachedTable.dense_grad` gives with their ids). At the optimizer's step (a step pre-hook)
the cache updates exactly those rows (:func:`~edo_monitor.nn.cache_step.fused_update`) with the
hyper-parameters of the group holding ``weight`` at that step, then hides ``batch_rows`` from the
optimizer's own step. A training forward gathers the rows new to the layout once, with their
optimizer state, and catches them up there (in ``batch_rows.data`` and the state beside it), not
in the cache: the lookup reads them there, the step updates them there and scatters them back
once (loading a state dict, moving the table or attaching another optimizer before the step
drops them; the step then takes the cache's rows). Each cache row
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
* The step takes the gradient out of the row buffer: after it ``batch_rows.grad`` is an empty
  ``(0, D)`` tensor, and the rows touched next are laid out afresh. The step's gradient is kept
  aside, as a resident table's stays until zeroed: when no ``zero_grad()`` (of the attached
  optimizer, or any that holds ``batch_rows``) came before the next backward, that backward adds
  to it (clipping after it sees the sum), and a step with no backward steps with it again
  (clipping before such a step sees none of it). Not while an optimizer that stepped the table
  before the attached one lives: its ``zero_grad()`` would not reach the row buffer, so the kept
  gradient is let go, as it was always (two optimizers stepping the table after one backward:
  the second takes it over and finds no gradient, where a resident table is stepped with it
  twice; it logs a warning). A backward of a graph built before the last step raises
  ``RuntimeError`` naming it. An optimizer step with no backward since the last one is
  skipped for the table when its gradient is ``None`` (after ``zero_grad()``, whose default sets
  it to ``None``), as torch skips a parameter without a gradient; after
  ``zero_grad(set_to_none=False)`` it steps every row with a zero gradient (weight decay,
  momentum, Adam's moments), as torch steps the resident table's zeroed one.
* ``optimizer.state_dict()`` leaves ``batch_rows`` out (ids renumbered) and holds the full
  caught-up state; it loads into an optimizer over the uncached model and back. State a
  setting switched off (``momentum=0``, ``amsgrad=False``) is kept whole on the host as it was,
  as torch keeps it for when the setting comes back: the checkpoint holds it ``(N, D)`` too.
* A gradient on ``weight`` itself (a loss term over it or over every parameter) never reaches
  the optimizer's own step: an all-zero one (DDP's ``0 * p.sum()``) is the resident table's
  (exact; a step without a lookup is a zero gradient for every row), a non-zero one has no
  exact step and is refused (``RuntimeError`` at the step; on a table the agent made, the
  cached rows it touches take it, with a warning: :meth:`_direct_grad`). An optimizer that
  holds ``batch_rows`` without ``weight`` is refused at its step (``ValueError``).
* The rows of forwards whose graphs are all gone with no backward since the step (an
  evaluation with gradients on) are let go at the next forward (:meth:`_release_dropped_forwards`).

Adam's catch-up sum over a row's missed steps is, per element, one series in ``y = root c /
(root c + eps)`` (``c``: the largest of the steps' scales) that converges for every ``root =
sqrt(v)``; its moments depend on a row only through the step it is at, so they are computed once
per distinct step, and a row takes as many terms as its own missed steps need (about 8 for 20
missed steps after 300, 20 for 286; ``O(steps x missed x K + rows x dim x K)``, ``steps`` the
distinct steps among the rows caught up); rows from the first steps, whose bias corrections
spread the scales beyond the series' cap (35 terms in float64, 16 in float32), are summed term
by term. A float32 table is caught up in float32, a float64 one in float64.

The optimizer is found through a global optimizer step pre-hook on its first step (registered
when the table is made), or given with :meth:`attach`. Until that first step the optimizer does
not hold the table's row buffer, so a ``zero_grad()`` before it does not clear a gradient from a
backward before it: call :meth:`attach` right after making the optimizer when a loop can run a
backward before its first ``zero_grad()`` (the agent's conversion attaches at once).
Checkpoints: ``state_dict()`` holds the full caught-up ``weight`` ``(N, D)`` (an ``nn.Embedding``
loads it), and the attached optimizer's ``state_dict()`` holds full-table state; both load into
an uncached model, or a cached one whose optimizer is attached (:meth:`attach` before
``optimizer.load_state_dict``: an optimizer over ``model.parameters()`` not attached yet holds
the row buffer too, and torch refuses the checkpoint's smaller group). Until the table's first
step the optimizer holds what it holds for a resident table (no state for SGD, Adam, AdamW;
Adagrad's, made with it): a forward adds none, so a copy or checkpoint taken between a backward
and that step resumes as the resident table's would.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.hooks import RemovableHandle

from edo_monitor.checks import whole_number
from edo_monitor.nn.cache_checkpoint import (
    _Checkpointing,
    _module_load_post_hook,
    _module_load_pre_hook,
    _module_state_dict_hook,
)
from edo_monitor.nn.cache_grads import _GradientLayout
from edo_monitor.nn.cache_optimizer import _OptimizerBinding
from edo_monitor.nn.cache_parts import (
    CACHE_POLICIES,
    CacheStats,
    _CacheFullError,
    _pinned_empty,
    changes_cache,
    to_device,
)
from edo_monitor.nn.cache_rows import _RowMovement
from edo_monitor.nn.cache_step import CacheRows
from edo_monitor.nn.catch_up import _Rule
from edo_monitor.nn.embedding import EmbeddingOptions, _EdoEmbedding, ids_in_bags
from edo_monitor.nn.table_checks import check_bag_arguments
from edo_monitor.nn.victims import VictimOrder

__all__ = ["CachedTable"]

logger = logging.getLogger(__name__)


class CachedTable(_EdoEmbedding, _OptimizerBinding, _GradientLayout, _RowMovement, _Checkpointing):
    """The row cache (see the module docstring); use
    :class:`~edo_monitor.nn.cached_modules.CachedEmbedding` or ``CachedEmbeddingBag``, or
    :meth:`from_weight` to wrap an existing table.

    Args:
        options: the table's options; ``sparse=True`` is refused (``ValueError``).
        host_weight: the full table ``(N, D)`` (moved to host memory; not copied when it already is
            there, pinned when ``device`` is CUDA).
        cache_rows: rows in the device cache ``C`` (``1 <= C``; rounded up to whole blocks).
        device: where the cache lives and lookups run.
        policy: ``"lfu"`` (default) or ``"lru"`` eviction.
        block_rows: rows moved together (1 = row by row; 512–2048 = chunked loading: a miss loads
            its whole aligned block of ids).
        overflow: more unique blocks in one training batch than the cache holds: ``"grow"`` (the
            cache grows to fit: logged as a warning the first time, later at INFO) or
            ``"error"`` (``RuntimeError`` naming both numbers). A lookup without gradients
            (``no_grad``, ``inference_mode``, a frozen table) that does not fit reads the rows
            outside the cache from the host, caught up in a copy, and leaves the cache as it is
            (``max_norm`` tables excepted: they grow, as their lookup writes rows back).
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
        block_rows = whole_number(block_rows, "block_rows", 1)
        n, d = options.num_embeddings, options.embedding_dim
        if tuple(host_weight.shape) != (n, d):
            raise ValueError(f"host_weight has shape {tuple(host_weight.shape)}; expected {(n, d)}")
        cache_rows = whole_number(cache_rows, "cache_rows", 1)
        device = torch.device(device) if device is not None else host_weight.device
        self.policy = policy
        self.block_rows = block_rows
        self.overflow = overflow
        self._grown = False  # the first growth is a warning, the later ones information
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
            given = torch.as_tensor(id_frequencies).reshape(-1)
            freq = given.to(torch.int64)
            if freq.numel() != n:
                raise ValueError(f"id_frequencies has {freq.numel()} entries; expected {n}")
            if (
                given.is_complex()
                or not torch.equal(freq.to(given.dtype), given)
                or (freq.numel() and int(freq.min()) < 0)
            ):
                raise ValueError("id_frequencies must be counts: whole numbers >= 0")
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
        # the layout's rows and optimizer state at step t, kept by training forwards
        self._pending: dict[str, torch.Tensor] | None = None
        self._rewrites = 0  # state dicts loaded so far (rows staged before one are stale)
        self._generation = 0
        self._stash: torch.Tensor | None = None
        self._kind = ""
        self.t = 0
        self._tick = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._state_seen: dict[str, Any] | None = None  # the optimizer's state of the cache
        self._mark_unchecked()  # the first lookup checks that no one wrote the cache
        self._rule: _Rule | None = None
        self._hooks: list[Any] = []
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
        self._victim_order = VictimOrder()
        self._eviction_bound: int | None = None  # see _evict_full
        self._step_counters = dict(self._counters)
        self.peak_unique_ids = 0
        # an OrderedDict: RemovableHandle holds a weak reference to it
        self._lookup_listeners: OrderedDict[int, Callable[[torch.Tensor, torch.Tensor], None]] = (
            OrderedDict()
        )
        self.register_state_dict_post_hook(_module_state_dict_hook)
        self.register_load_state_dict_pre_hook(_module_load_pre_hook)
        self.register_load_state_dict_post_hook(_module_load_post_hook)
        if requires_grad:
            self._auto_attach()
        if id_frequencies is not None:
            top = torch.argsort(self.block_freq, descending=True, stable=True)[:slots]
            with torch.no_grad():
                self._load_blocks(top[self.block_freq[top] > 0])
            self._mark_unchecked()  # the preload checked a cache none could write yet

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
        # block_freq of each slot's block, kept beside it so that eviction reads (C,) arrays
        # only (a gather of every slot's block from block_freq (N,) cost ~3 ms a step at N = 1M)
        self.slot_freq = torch.zeros(slots, dtype=torch.int64)
        self.slot_pinned = torch.zeros(slots, dtype=torch.bool)
        # each slot's eviction score by the policy (free: -1), kept as slots are used, loaded
        # and freed, so that an eviction reads one (C,) array (_RowMovement._evict_full)
        self.slot_score = torch.full((slots,), -1, dtype=torch.int64)
        self._slot_mark = torch.zeros(slots, dtype=torch.bool)  # scratch: slots an eviction keeps
        # slots pinned since the last optimizer step, so the step clears them in O(batch), not in
        # O(cache); None: too many listed (or the slots were renumbered), clear them all
        self._pinned_since_step: list[torch.Tensor] | None = []
        self._pinned_listed = 0
        # the graphs of the training forwards since the last step (their CacheRows nodes), and
        # whether a backward reached the cache since: _release_dropped_forwards
        self._forwards: list[weakref.ref[Any]] = []
        self._backward_seen = False
        rows = slots * self.block_rows
        self.slot_step = torch.zeros(rows, dtype=torch.int64)  # the step each cache row is at
        self.weight = nn.Parameter(
            torch.zeros(rows, self.embedding_dim, dtype=dtype, device=device),
            requires_grad=requires_grad,
        )

    # ------------------------------------------------------------------ construction helpers
    def __getstate__(self) -> dict[str, Any]:
        """Pickle, ``torch.save(model)``, ``copy.deepcopy``: see :meth:`_pickle_state`."""
        return self._pickle_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._unpickled()
        if self.weight.requires_grad:
            self._auto_attach()

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

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module``'s conversions, with the host table and the optimizer's state of the
        cache following them (:meth:`_before_conversion`, which raises ``ValueError`` for a
        dtype change it refuses)."""
        old_device = self._before_conversion(fn)
        out = super()._apply(fn, recurse)
        self._after_conversion(old_device)
        return out

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

    @changes_cache
    def prefetch(self, next_ids: torch.Tensor) -> None:
        """Load the rows of ``next_ids`` now (before the next forward needs them).

        On CUDA the copies run on a side stream, overlapping compute. Rows used since the last
        optimizer step are not evicted. Counted as misses, not as hits, in :meth:`stats`.

        Raises:
            TypeError, IndexError: ids the forward would refuse (not integers, outside
                ``[0, N)``), with its message.
        """
        ids = self._host_ids(next_ids)
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
                try:  # the hits of these ids stay too
                    new = self._evict(miss.numel(), slots[slots >= 0], for_batch=True)
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
        the model around it compiles once per input shape, with one graph break here. Under
        ``torch.inference_mode()`` it runs as under ``no_grad`` (the cache's tensors stay normal
        ones, trainable at the next step; the output is a normal tensor).
        """
        check_bag_arguments(self.options, offsets, per_sample_weights)
        if torch.is_inference_mode_enabled():
            # tensors made under inference mode cannot be changed outside it: the cache's own
            # (grown, loaded, pinned) must stay normal, or the next training step fails
            with torch.inference_mode(False), torch.no_grad():
                return self._lookup(input, offsets, per_sample_weights)
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
        self._check_cache_once()
        training = torch.is_grad_enabled() and self.weight.requires_grad
        if training:
            if self.weight._backward_hooks:
                raise RuntimeError(
                    "a gradient hook is registered on the cached table's weight "
                    "(weight.register_hook): the weight is the cache (cache_rows, D) and gets no "
                    "gradient (the touched rows' gradient is batch_rows.grad (U, D), stepped at "
                    "the optimizer's step), so the hook would be called with None and could not "
                    "change the step; remove it (handle.remove()), or keep the table resident"
                )
            self._release_dropped_forwards()
        keep = training and self._keeps_rows()
        o = self.options
        try:  # rows without a gradient need not be resident: the cache grows for training only
            urows, place, pad_pos = self._remap(
                input, catch_up=not keep, grow=training or o.max_norm is not None
            )
        except _CacheFullError:
            rows, place, pad_pos = self._current_rows(input)
            return self._combine(rows, place, pad_pos, offsets, per_sample_weights)
        positions = None
        if keep:  # the rows caught up in the row buffer (read there, stepped there)
            positions = self._take_rows(urows)
            index, source = positions, self.batch_rows.data
        else:
            if training:
                positions = self._layout_add(urows)
            index, source = urows, self.weight.data
        if (
            o.bag_mode is None
            and o.max_norm is None
            and not o.scale_grad_by_freq
            and pad_pos is None
        ):
            # one gather of every id's row; the backward adds each id's gradient at its row's place
            flat = place.reshape(-1)
            rows = index.index_select(0, flat)
            at = positions
            if positions is index:
                at = rows
            elif positions is not None:
                at = positions.index_select(0, flat)
            return self._gather(source, rows, at).view(*place.shape, self.embedding_dim)
        rows = self._gather(source, index, positions)
        out = self._combine(rows, place, pad_pos, offsets, per_sample_weights)
        if o.max_norm is not None:  # the renormalised rows are the table's rows now
            with torch.no_grad():
                source[to_device(index, self.device)] = rows.detach()
        return out

    def _combine(
        self,
        rows: torch.Tensor,
        place: torch.Tensor,
        pad_pos: int | None,
        offsets: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """The lookup's output from the batch's unique rows ``(U, D)`` and each id's place
        among them (host, ``input``'s shape): ``F.embedding`` / ``F.embedding_bag`` with every
        option (``max_norm`` renormalises ``rows`` in place)."""
        o, dev = self.options, self.device
        place = to_device(place, dev)
        if o.bag_mode is None:
            return F.embedding(place, rows, pad_pos, o.max_norm, o.norm_type, o.scale_grad_by_freq)
        place, per_sample_weights = ids_in_bags(
            place, offsets, per_sample_weights, o.include_last_offset
        )
        return F.embedding_bag(
            place,
            rows,
            to_device(offsets, dev) if offsets is not None else None,
            o.max_norm,
            o.norm_type,
            o.scale_grad_by_freq,
            o.bag_mode,
            False,
            to_device(per_sample_weights, dev) if per_sample_weights is not None else None,
            o.include_last_offset,
            pad_pos,
        )

    def _gather(
        self, source: torch.Tensor, index: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows ``index`` ``(n,)`` (host int64) of ``source`` (the cache or the row buffer) ``(n,
        D)``; with ``positions`` (host, the rows' places in the gradient layout) through
        :class:`~edo_monitor.nn.cache_step.CacheRows`, whose backward adds the gradient there."""
        dev_index = to_device(index, self.device)
        if positions is None:
            return source.index_select(0, dev_index)
        at = dev_index if positions is index else to_device(positions, self.device)
        out = CacheRows.apply(self.weight, source, dev_index, self, at, self._generation)
        if out.grad_fn is not None:
            self._forwards.append(weakref.ref(out.grad_fn))
            self._watch_weight_accumulator()
        return out
