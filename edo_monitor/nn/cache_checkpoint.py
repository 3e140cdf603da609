"""The row cache's whole table: flushed, resized (every row exact), read back full, and the
optimizer's state dict as if the table were resident."""

from __future__ import annotations

import logging
from typing import Any

import torch

from edo_monitor.checks import whole_number
from edo_monitor.nn.cache_parts import (
    _initial_weight,
    _insert_row_buffers,
    _is_row_buffer,
    _pinned_empty,
    _strip_row_buffers,
    changes_cache,
    rebind_data,
)
from edo_monitor.nn.catch_up import _CHUNK_ELEMENTS
from edo_monitor.nn.optimizers import (
    ROW_STATE_KEYS,
    _group_of,
    _make_rule,
    initial_state,
    steps_taken,
)

logger = logging.getLogger(__name__)


class _Checkpointing:
    """The row cache's whole table: flushed, resized (every row exact), read back full, and the"""

    # ------------------------------------------------------------------ module conversions
    def _before_conversion(self, fn: Any) -> torch.device:
        """Before ``nn.Module._apply(fn)`` converts the cache (``model.to(device / dtype)``,
        ``.double()``, ``.half()``, ``.cuda()``, ``.cpu()``): the host table follows a dtype
        change (``nn.Module`` converts only parameters and buffers, so the cache became float64
        over a float32 host table, silently) and stays on the host when the cache moves (pinned
        when it moves to CUDA). Returns the cache's device before the conversion.

        Raises:
            ValueError: a dtype change while an optimizer is attached (its state of the table
                would keep the old dtype; convert before creating the optimizer), or of a table
                whose host rows are in a spill file (``host_alloc``).
        """
        weight = self.weight
        probe = fn(torch.empty(0, dtype=weight.dtype, device=weight.device))
        new_dtype, new_device = probe.dtype, probe.device
        if new_dtype != weight.dtype:
            if self._optimizer is not None:
                raise ValueError(
                    f"cached table: converting it from {weight.dtype} to {new_dtype} once "
                    f"{type(self._optimizer).__name__} steps it is not supported (the row "
                    f"cache keeps the rows it has not caught up yet, and their optimizer state, "
                    f"in {weight.dtype}); convert the model before its optimizer is created "
                    "(a table the agent cached: before watch())"
                )
            if self._host_alloc is not None:
                raise ValueError(
                    f"cached table: its host rows are in a spill file of {weight.dtype}; it "
                    f"cannot become {new_dtype}"
                )
        to_cuda = new_device != weight.device and new_device.type == "cuda"
        repin = to_cuda and self._host_alloc is None and not self.host_weight.is_pinned()
        self._pin = self._pin or repin  # the host table is pinned for copies to CUDA
        if new_dtype != self.host_weight.dtype or repin:

            def host(t: torch.Tensor) -> torch.Tensor:
                out = _pinned_empty(t.shape, new_dtype, self._pin)
                return out.copy_(t)

            self.host_weight = host(self.host_weight)
            self.host_state = {k: host(v) for k, v in self.host_state.items()}
        return weight.device

    def _after_conversion(self, old_device: torch.device) -> None:
        """After the conversion: the optimizer's state of the cache moves with it."""
        if self._optimizer is not None and self.weight.device != old_device:
            state = self._optimizer.state.get(self.weight, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    state[k] = v.to(self.weight.device)
        self._pending = None  # the step takes the moved cache's rows
        self._side_stream = None

    # ------------------------------------------------------------------ pickle, deepcopy
    def _pickle_state(self) -> dict[str, Any]:
        """The module's ``__dict__`` for pickle, ``torch.save(model)`` and ``copy.deepcopy``
        (``CachedTable.__getstate__``). Every row is brought up to the current step and the
        host table made whole first (:meth:`flush`): the copy has no optimizer to catch rows
        up with, and takes its cache's rows from the host table (:meth:`_unpickled`). The host rows'
        optimizer state stays (a copy made together with its optimizer, whose state of the
        table is the cache's rows, attaches to it with nothing lost; a new optimizer starts
        fresh). Left out: the optimizer binding, the touched rows' layout (a gradient does not
        pickle either) and the backwards in flight (``weight``'s gradient accumulator watched),
        a ``LookAhead`` serving the table (its loader), the agent's lookup listeners, the mark of
        an unchecked cache (a copy's weight has a version of its own), a spill
        file's allocator and a CUDA side stream. The copy attaches to the
        optimizer that steps it first."""
        self.flush()  # with no optimizer: the cache's rows written back
        state = dict(self.__dict__)
        state.update(
            _optimizer=None,
            _state_seen=None,
            _rule=None,
            _kind="",
            _hooks=[],
            _stash=None,
            _carry=None,
            _carry_mark=None,
            _unchecked_mark=None,
            _former=None,
            _pending=None,
            _forwards=[],
            _watched_node=None,
            _arrived={},
            _accumulating_tasks=set(),
            _lookahead=None,
            _host_alloc=None,
            _side_stream=None,
            _lookup_listeners=type(self._lookup_listeners)(),
            _layout_rows=torch.zeros(0, dtype=torch.int64),
            _row_pos=torch.full_like(self._row_pos, -1),
        )
        return state

    @torch.no_grad()
    def _unpickled(self) -> None:
        """After :meth:`_pickle_state`'s state is set: the cache's rows taken from the host
        table, which the flush made whole (a deep copy that met ``weight`` first, through the
        optimizer, copied it before the flush caught its rows up); no slot pinned and the row
        buffer empty (no gradient is pending), the buffer marked (a deep copy of a ``Parameter``
        drops its attributes)."""
        self.weight.data.copy_(self._gather_rows(self.host_weight))
        self._clear_pins()  # no gradient is pending in the copy
        rows = self.batch_rows
        rows.grad = None
        rows.data = rows.data.new_zeros(0, self.embedding_dim)
        rows._edo_row_buffer = True  # type: ignore[attr-defined]
        if not self._cache_checked:  # the copy's weight has a version of its own
            self._mark_unchecked()

    # ------------------------------------------------------------------ flush, resize, resident
    @changes_cache
    @torch.no_grad()
    def flush(self) -> None:
        """Bring every host row up to the current step and copy the cache to the host.

        After it, ``host_weight`` and ``host_state`` are the full table a resident twin would have
        now. Cost: one catch-up of the rows that missed steps, in chunks.
        """
        used = (self.slot_to_block >= 0).nonzero().reshape(-1)
        if used.numel():
            self._catch_up_rows(self._real_rows(self.slot_to_block[used], used)[1])
        if self._rule is not None:
            behind = (self.last_step < self.t).nonzero().reshape(-1)
            step = max(1, _CHUNK_ELEMENTS // max(1, self.embedding_dim * 4))
            for start in range(0, behind.numel(), step):
                ids = behind[start : start + step]
                w = self.host_weight[ids]
                st = {k: self.host_state[k][ids] for k in self._state_keys()}
                self._rule.catch_up_rows(w, st, self.last_step[ids], self.t)
                self.host_weight[ids] = w
                for k, v in st.items():
                    self.host_state[k][ids] = v
            self.last_step.fill_(self.t)
        used = (self.slot_to_block >= 0).nonzero().reshape(-1)
        self._write_back(used)

    @changes_cache
    @torch.no_grad()
    def resize(self, cache_rows: int) -> None:
        """Change the cache to ``cache_rows`` rows (rounded up to whole blocks, at most the table).

        Growing keeps every cached row in its slot. Shrinking keeps the rows used since the last
        optimizer step, then those a serving :class:`~edo_monitor.nn.lookahead.LookAhead`'s
        window uses (soonest first), then the most valuable ones (by the eviction policy),
        writing the others back. The same ``Parameter`` object is kept (its data, gradient and
        optimizer state are rebound to new tensors), so the optimizer keeps stepping it.

        Raises:
            ValueError: ``cache_rows < 1``, or fewer rows than those used since the last step.
        """
        cache_rows = whole_number(cache_rows, "cache_rows", 1)
        self._check_cache_once()  # a new layout drops the free slots' values
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
            la = self._lookahead
            if la is not None:  # the rows the look-ahead's window uses next are kept first
                score = la.score(self, self.slot_to_block[used], score)
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
            new_state["sum"][fresh] = initial_state(group, "sum")
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
        self.slot_freq = torch.zeros(new_slots, dtype=torch.int64)
        self.slot_freq[new_index] = self.block_freq[blocks]
        self.slot_pinned = torch.zeros(new_slots, dtype=torch.bool)
        self.slot_pinned[new_index] = pinned
        self.slot_score = torch.full((new_slots,), -1, dtype=torch.int64)
        self.slot_score[new_index] = self._policy_score(self.slot_freq[new_index], last_use)
        self._slot_mark = torch.zeros(new_slots, dtype=torch.bool)
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

    def reset_parameters(self) -> None:
        """Re-initialise the table as ``nn.Embedding.reset_parameters`` does: every row
        ``N(0, 1)`` (drawn on the host as one ``(N, D)`` tensor of the table's dtype, so the same
        generator state gives ``nn.Embedding``'s values), the padding row zero; loaded as
        :meth:`load_state_dict` loads a table (the cache takes its rows from it; optimizer
        state is left as it is, as ``nn.Embedding``'s)."""
        w = _initial_weight(self.options, None, self.host_weight.dtype)
        self.load_state_dict({"weight": w}, strict=False)

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
        # the keys in use and those a setting switched off: the host holds each whole (the
        # cache's copy of a switched-off key is stale for rows loaded since it was switched off)
        for key in self.host_state:
            if key in entry:
                entry[key] = self.host_state[key].clone()
        sd = dict(sd)
        sd["state"] = dict(sd["state"])
        sd["state"][idx] = entry
        return sd

    def _optimizer_load(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> dict[str, Any]:
        try:
            return self._optimizer_load_state(optimizer, sd)
        finally:
            self._state_seen = None  # the load gives the optimizer new state dicts

    def _optimizer_load_state(
        self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> dict[str, Any]:
        sd = _insert_row_buffers(optimizer, sd)
        idx = self._param_index(optimizer, buffers=True)
        if idx is None:
            return sd
        if idx not in sd["state"]:
            # no state for the table (saved before its first step): it starts afresh, as the
            # optimizer starts a resident table, after every row caught up under the old state
            self.flush()
            group = _group_of(optimizer, self.weight)
            for key, host in self.host_state.items():
                host.fill_(initial_state(group, key))
            self._reset_step(0, False)
            return sd
        entry = dict(sd["state"][idx])
        n, d = self.num_embeddings, self.embedding_dim
        t = steps_taken(entry, self.t)
        # the keys in use and those a setting switched off (kept for when it comes back)
        keys = [key for key in ROW_STATE_KEYS if entry.get(key) is not None]
        for key in keys:
            value = entry[key]
            if tuple(value.shape) == (n, d):
                continue
            if t == 0 and _uniform(value, d):  # the initial state (Adagrad's), every row alike
                entry[key] = value.reshape(-1)[:1].expand(n, d)
                continue
            raise ValueError(
                f"optimizer state {key!r} has shape {tuple(value.shape)}; a cached table "
                f"loads full-table state {(n, d)} (an optimizer not attached to the table when "
                "its state dict was taken holds the cache's rows: call table.attach(optimizer) "
                "before saving)"
            )
        # every row's weight up to the current step under the state it has, as a resident
        # table's are, before that state is replaced
        self.flush()
        for key in keys:
            if key not in self.host_state:
                self.host_state[key] = self._host_empty((n, d))
            self.host_state[key].copy_(entry[key])
            entry[key] = self._gather_rows(self.host_state[key])
        for key in [k for k in self.host_state if k not in keys and k not in self._state_keys()]:
            del self.host_state[key]  # switched off and not in the loaded state: gone there too
        sd = dict(sd)
        sd["state"] = dict(sd["state"])
        sd["state"][idx] = entry
        self._reset_step(t, entry.get("momentum_buffer") is not None)
        return sd

    def _reset_step(self, t: int, buffers: bool) -> None:
        """Every row is current at step ``t`` (after loading a checkpoint; ``buffers``: it holds
        SGD's momentum buffers)."""
        self.t = t
        self.last_step.fill_(t)
        self.slot_step.fill_(t)
        self._pending = None  # the layout's rows are the loaded ones now
        self._rewrites += 1
        if self._optimizer is not None:
            group = _group_of(self._optimizer, self.weight)
            self._rule = _make_rule(self._optimizer, group, t, buffers, self.weight.dtype)


def _uniform(value: torch.Tensor, dim: int) -> bool:
    """Whether ``value`` is rows ``(R, dim)``, ``R >= 1``, all of one value (a state no step
    has changed: Adagrad's ``sum`` made with the optimizer, of the cache's shape then)."""
    if value.dim() != 2 or value.shape[1] != dim or value.numel() == 0:
        return False
    return bool((value == value.reshape(-1)[0]).all())


def _module_state_dict_hook(
    module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """The module's ``state_dict()`` holds the full caught-up table ``(N, D)`` as ``weight``
    (it loads into an uncached model) and no ``batch_rows``."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = module.full_weight().detach().clone()
    state_dict.pop(prefix + "batch_rows", None)  # the touched rows' gradient holder: not state


@changes_cache
def _module_load_pre_hook(
    module: Any,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """``load_state_dict``: a full table ``(N, D)`` becomes the host table, every row current
    at step t, and the cache takes its slots' rows from it; another shape is one error."""
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
        # the cache's own rows in its place (a copy onto itself): taken out, torch reported the
        # key missing too, and the real reason came second
        state_dict[key] = module.weight.detach()
        return
    with torch.no_grad():
        module.flush()  # host optimizer state current before every row is declared current
        module.host_weight.copy_(value)
        module.last_step.fill_(module.t)
        module.slot_step.fill_(module.t)
        module._pending = None  # the step takes the loaded rows
        module._rewrites += 1
        rows = module._gather_rows(module.host_weight)
    state_dict[key] = rows.to(module.weight.dtype)


def _module_load_post_hook(module: Any, incompatible_keys: Any) -> None:
    """After ``load_state_dict``: a cache not checked yet is as the load left it (the load wrote
    every slot, so a write to ``weight`` before it is gone): the check starts from here."""
    if not getattr(module, "_cache_checked", True):
        module._mark_unchecked()
