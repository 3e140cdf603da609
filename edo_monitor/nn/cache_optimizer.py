"""The row cache's optimizer: attached to the user's optimizer, its hyper-parameters followed step
by step, the lazy fused step over the batch's rows."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from edo_monitor.nn.cache_parts import put_rows, row_buffer_name, to_device
from edo_monitor.nn.cache_step import fused_update, optimizer_kind
from edo_monitor.nn.catch_up import _CHUNK_ELEMENTS, _Rule
from edo_monitor.nn.optimizers import (
    ROW_STATE_KEYS,
    _group_of,
    _make_rule,
    check_hyper_tensors,
    initial_state,
    steps_taken,
)

logger = logging.getLogger(__name__)

#: the cached tables that take the optimizer stepping them (:meth:`_OptimizerBinding._auto_attach`)
_WAITING: weakref.WeakSet[Any] = weakref.WeakSet()
_STEP_HOOK: Any = None  # the one global step pre-hook over them, registered at the first table


def _step_pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Every optimizer's step, first: each waiting table that ``opt`` steps attaches to it (a
    snapshot of the weak set: a table collected meanwhile just leaves it)."""
    for table in list(_WAITING):
        table._on_any_step(opt)


class _OptimizerBinding:
    """The row cache's optimizer: attached to the user's optimizer, its hyper-parameters followed
    step"""

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
        gets its slots' rows; cache-shaped state ``(C, D)`` is kept. Another optimizer attached
        before is let go first (:meth:`detach_optimizer`: every row caught up, its state of the
        table handed back whole), as when a new optimizer steps the table: the new one takes it
        over (to resume from a checkpoint into a new optimizer on the live model: attach it,
        then load its state dict).

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
            ValueError: the optimizer does not step ``weight``, its class or settings are refused
                (named).
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"attach() takes the torch.optim.Optimizer that steps the table, got "
                f"{type(optimizer).__name__} ({optimizer!r:.60})"
            )
        if self._optimizer is optimizer:
            return
        group = _group_of(optimizer, self.weight)
        if self._optimizer is not None:
            self.detach_optimizer()
        state = optimizer.state.get(self.weight, {})
        t = steps_taken(state, 0)
        buffers = state.get("momentum_buffer") is not None
        rule = _make_rule(optimizer, group, t, buffers, self.weight.dtype)
        kind = optimizer_kind(optimizer)
        n, d = self.num_embeddings, self.embedding_dim
        host_state: dict[str, torch.Tensor] = {}
        new_state: dict[str, torch.Tensor] = {}
        # the keys in use, then those a setting switched off that the state still holds
        unused = [k for k in ROW_STATE_KEYS if k not in rule.keys and state.get(k) is not None]
        for key in (*rule.keys, *unused):
            value = state.get(key)
            init = initial_state(group, key)
            if value is not None and t == 0 and bool((value == init).all()):
                # made with the optimizer (Adagrad), before any step: the cache may have grown
                # since, so its shape says nothing; its value is every row's initial state
                value = None
            if value is None:
                hs = self._host_empty((n, d))
                hs.fill_(init)
                host_state[key] = hs
                if key in state:  # replaced by the cache's rows of it
                    new_state[key] = self._gather_rows(hs).to(self.device, self.weight.dtype)
            elif key in self.host_state:
                # the table kept its host state, every row current since its flush (a copy made
                # with this optimizer): it holds them all; the optimizer's state is the cache's
                # rows as the slots were then, of the cache's shape (the table's too when the
                # cache holds every row: not in id order), and rows moved or the cache resized
                # since brought no state (no step changed any)
                hs = self.host_state[key]
                host_state[key] = hs
                new_state[key] = self._gather_rows(hs).to(self.device, self.weight.dtype)
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
                ids, rows = self._real_rows(self.slot_to_block[used], used)
                hs[ids] = value.detach().cpu()[rows]
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
        self._pending = None
        self._optimizer = optimizer
        self._state_seen = None
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
            names = group.get("param_names")
            if names is not None:  # an optimizer over named_parameters(): its name beside
                name = row_buffer_name(names[: at + 1])
                group["param_names"] = [*names[: at + 1], name, *names[at + 1 :]]
        optimizer.state.pop(self.batch_rows, None)
        # the auto-attach hook (if any) may be running now, inside torch's loop over the global
        # pre-hooks: it is removed after this step (removing it now would change that dict)
        ref = weakref.ref(self)

        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
            table = ref()
            if table is None:
                return None
            # torch passes the step's own arguments: (optimizer, closure?) and its keywords
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
            if closure is None:
                table._before_step(opt)
                return None

            # step(closure): the closure computes the gradient inside step (Lightning's automatic
            # optimization does), so the cache's rows are stepped and hidden once it has run,
            # before the optimizer's own loop; stepping them here found no gradient, and the
            # optimizer then stepped the (U, D) row buffer itself with another step's state
            def closure_then_rows() -> Any:
                loss = closure()
                again = ref()
                if again is not None:
                    again._before_step(opt)
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_then_rows}
            return (args[0], closure_then_rows, *args[2:]), kwargs

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
        """Let the optimizer go. Every row is brought up to the current step first
        (:meth:`flush`: without the optimizer nothing could catch them up later), the optimizer
        gets its state of this table back whole (``(N, D)`` host tensors in id order, what its
        ``state_dict()`` held for the table), and the hooks :meth:`attach` registered and the
        row buffer leave it. The optimizer that steps the table next attaches at that step:
        this one again takes its state back; a new one starts from its own (none: fresh)."""
        self._release_optimizer(hand_back=True)

    def _release_optimizer(self, hand_back: bool) -> None:
        """:meth:`detach_optimizer`; ``hand_back=False`` leaves the optimizer's state of the
        cache as it is (the agent's conversions have set it themselves)."""
        if self._rule is not None:
            self.flush()
            state = self._opt_state()
            if hand_back and state:
                for key in self.host_state:  # in use or switched off: whole, as last kept
                    if key in state:
                        state[key] = self.host_state[key]
                self.host_state = {}
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._optimizer is not None:  # the row buffer leaves the optimizer with the hooks
            if self._former is None:
                self._former = weakref.WeakSet()
            self._former.add(self._optimizer)
            self._carry = self._carry_mark = None
            for g in self._optimizer.param_groups:
                if any(p is self.batch_rows for p in g["params"]):
                    if "param_names" in g:
                        g["param_names"] = [
                            name
                            for p, name in zip(g["params"], g["param_names"], strict=True)
                            if p is not self.batch_rows
                        ]
                    g["params"] = [p for p in g["params"] if p is not self.batch_rows]
        self._optimizer = None
        self._state_seen = None
        self._rule = None
        self._pending = None

    def _auto_attach(self) -> None:
        """Give the table to the optimizer stepping it, through the module's one global step
        pre-hook (:func:`_step_pre_hook`, over a weak set of the tables waiting for one).

        The first optimizer whose step finds ``weight`` in its groups attaches (registered when
        the table is made, so a first step whose closure runs the first forward attaches too).
        Another optimizer stepping the table later, such as a new one made for a second phase of
        training, takes it over: the attached one is detached first (:meth:`detach_optimizer`:
        rows caught up, its state handed back whole), as a resident table is simply stepped by
        whichever optimizer steps it. Left when the table is collected, or by
        :meth:`_cancel_auto_attach`. (One hook a table, removed by a finalizer, made a table
        collected by the garbage collector inside torch's loop over the global hooks change
        that dict: ``RuntimeError: OrderedDict mutated during iteration`` in the user's
        ``optimizer.step()``.)
        """
        global _STEP_HOOK
        if _STEP_HOOK is None:
            _STEP_HOOK = register_optimizer_step_pre_hook(_step_pre_hook)
        _WAITING.add(self)

    def _on_any_step(self, opt: torch.optim.Optimizer) -> None:
        """:func:`_step_pre_hook` for this table: ``opt`` steps it and is not its optimizer yet:
        it takes the table over."""
        if opt is self._optimizer:
            return
        if self.weight.shape[0] != self.slot_step.numel():
            return  # not the cache's weight (a rolled-back conversion gave it back)
        params = [p for g in opt.param_groups for p in g["params"]]
        if not any(p is self.weight for p in params):
            if any(p is self.batch_rows for p in params):
                raise ValueError(
                    f"{type(opt).__name__} optimizer without the cached table's weight holds "
                    "its batch_rows (the buffer of the rows its own optimizer steps, in "
                    "model.parameters()): it would step those rows, or drop their gradient at "
                    "its zero_grad(); build it without the table's parameters: [p for p in "
                    "model.parameters() if p is not table.weight and p is not table.batch_rows]"
                )
            if self._optimizer is None:  # another optimizer's step: the gradient outlives it
                g = self.batch_rows.grad
                past = getattr(self, "_steps_past_grad", 0)
                self._steps_past_grad = past + 1 if g is not None and g.numel() else 0
            return
        past, self._steps_past_grad = getattr(self, "_steps_past_grad", 0), 0
        if self._optimizer is None and past and not any(p is self.batch_rows for p in params):
            logger.warning(
                "cached table: a %s steps it now (added to it since its last step?) with a "
                "gradient kept over %d step(s) of other optimizers: a zero_grad() of this one "
                "before this step did not reach it (the table's row buffer joins the optimizer "
                "as it attaches), so the step takes it whole; call table.attach(optimizer) "
                "right after optimizer.add_param_group()",
                type(opt).__name__,
                past,
            )
        if self._optimizer is not None:
            old = type(self._optimizer).__name__
            logger.info(
                "cached table: a %s steps it; the %s attached before is detached (its "
                "state of the table handed back whole)",
                type(opt).__name__,
                old,
            )
            grad = self.batch_rows.grad
            if grad is not None and grad.shape[0] == 0:  # no backward since that step
                logger.warning(
                    "cached table: a %s steps it with no backward since the %s stepped "
                    "it; that step consumed the gradient (a resident table would be "
                    "stepped with it twice): step a table with one optimizer",
                    type(opt).__name__,
                    old,
                )
        # attach lets the one before go first, and registers the instance pre-hook (it runs
        # right after this one)
        self.attach(opt)

    def _cancel_auto_attach(self) -> None:
        """Leave the global hook of :meth:`_auto_attach` (a table the agent converts attaches
        explicitly and may roll back: it registers the hook once the conversion stands)."""
        _WAITING.discard(self)

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self._optimizer or self._rule is None:
            return
        group = _group_of(optimizer, self.weight)
        check_hyper_tensors(optimizer, group, self.weight.dtype)  # made tensors since
        direct = self._direct_grad()
        if _Rule._hyper(group) != self._rule.hyper:
            # hyper-parameters changed: every host row catches up under the old ones first
            old = self._rule
            self.flush()
            self._rule = _make_rule(optimizer, group, self.t, old.buffers_after(self.t))
            self._state_appears(old.keys, group)
        if direct is not None:
            self._add_direct_grad(direct)
        if self._carry is not None:  # a step with no backward since the last one
            self._resolve_carry()
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

    def _state_appears(self, old_keys: tuple[str, ...], group: dict[str, Any]) -> None:
        """State keys the new rule keeps and ``old_keys`` did not (momentum switched on): made
        on the host at their initial value when the table never had them, and the cache's copy
        taken from the host again (the host rows are as the key was last kept: rows loaded
        meanwhile did not bring it)."""
        assert self._optimizer is not None and self._rule is not None
        state = self._optimizer.state[self.weight]
        for key in self._rule.keys:
            if key in old_keys:
                continue
            if key not in self.host_state:
                hs = self._host_empty((self.num_embeddings, self.embedding_dim))
                hs.fill_(initial_state(group, key))
                self.host_state[key] = hs
            state.pop(key, None)  # made again from the host rows (_cache_state)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self._optimizer or self._rule is None:
            return
        self._clear_pins()
        if self._stash is not None:  # the step took the gradient: a new layout begins
            grad, self._stash = self._stash, None
            ids = self._row_ids(self._layout_rows)
            self._generation += 1
            # an empty gradient, not None: a resident table keeps a gradient tensor after its
            # step, and zero_grad(set_to_none=False) keeps it (zeroed), so a later step without
            # a backward still steps every row (weight decay, momentum); zero_grad() makes it
            # None, and such a step skips the table, as for the resident one
            empty = self.batch_rows.new_zeros(0, self.embedding_dim)
            self._set_layout(torch.zeros(0, dtype=torch.int64), empty, empty.clone())
            # the step's gradient stays the resident table's until a zero_grad(): kept to be
            # added at the next backward or step if none came (:meth:`_resolve_carry`)
            self._carry = (ids, grad)
            self._mark_carry()
        self.reset_step_stats()

    # ------------------------------------------------------------------ lazy rows, fused step
    def _cache_state(self) -> dict[str, Any]:
        """The optimizer's state of the cache ``(C, D)`` per key, made from the host state when
        absent (before the first step).

        Raises:
            RuntimeError: the optimizer's state of the table was cleared or replaced by hand
                (``optimizer.state.clear()``) since the cache used it: the rows the cache has
                not caught up yet needed it (a resident table's were current), so no step could
                be exact; the message gives the way that is (:meth:`detach_optimizer` first).
        """
        assert self._optimizer is not None
        state = self._optimizer.state[self.weight]
        if self._state_seen is not None and state is not self._state_seen:
            raise RuntimeError(
                "the optimizer's state of this cached table was cleared or replaced outside "
                "load_state_dict() (optimizer.state.clear()?): rows not caught up yet needed it. "
                "To restart the optimizer's state, call table.detach_optimizer() before clearing "
                "it (every row is caught up first; the next step starts afresh)"
            )
        self._state_seen = state
        for key in self._state_keys():
            if key not in state:
                state[key] = self._gather_rows(self.host_state[key]).to(
                    self.device, self.weight.dtype
                )
        return state

    def _rows_state(self, rows: torch.Tensor, at: torch.Tensor) -> dict[str, torch.Tensor]:
        """The optimizer state ``{key: (R, D)}`` of cache ``rows`` (host int64; ``at``: the same
        on the device), for a forward to keep beside their values.

        Read from the host for a key the optimizer holds no state of yet (no step of the table
        since it was attached: its cached rows' state is their host rows'), so that a forward
        adds no state to the optimizer: until the table's first step it holds what it holds for
        a resident table (none for SGD, Adam, AdamW; a copy or checkpoint taken between a
        backward and the first step otherwise held a momentum buffer of zeros, and Adam state
        without its ``step``, which torch cannot load)."""
        state = self._opt_state()
        out = {}
        ids = None
        for key in self._state_keys():
            if key in state:
                out[key] = state[key].index_select(0, at)
                continue
            if ids is None:
                ids = self._row_ids(rows)
            host = self.host_state[key].index_select(0, ids)
            out[key] = to_device(host, self.device).to(self.weight.dtype)
        return out

    def _catch_up_rows(self, rows: torch.Tensor) -> None:
        """Bring cache ``rows`` ``(R,)`` (host int64) behind step ``t`` up to it, in place."""
        if self._rule is None or rows.numel() == 0:
            return
        s = self.slot_step[rows]
        stale = s < self.t
        if not bool(stale.any()):
            return
        order = torch.argsort(s[stale], stable=True)  # oldest first, as the rule sums them
        rows, s = rows[stale][order], s[stale][order]
        state = self._cache_state() if self._state_keys() else {}
        step = max(1, _CHUNK_ELEMENTS // max(1, self.embedding_dim * 4))
        for start in range(0, rows.numel(), step):
            r = to_device(rows[start : start + step], self.device)
            w = self.weight.data.index_select(0, r)
            st = {k: state[k].index_select(0, r) for k in self._state_keys()}
            self._rule.catch_up_rows(w, st, s[start : start + step], self.t)
            put_rows(self.weight.data, r, w)
            for k, v in st.items():
                put_rows(state[k], r, v)
        self.slot_step[rows] = self.t

    def _step_rows(self, group: dict[str, Any], grad: torch.Tensor) -> None:
        """The fused step t -> t+1 of the layout's rows with their gradient ``(U, D)``: on the
        row buffer's caught-up values when the forwards kept them (:meth:`_take_rows`), else on
        the cache's rows, caught up first."""
        rows = self._layout_rows
        if rows.numel() == 0:
            return
        r = to_device(rows, self.device)
        state = self._cache_state() if self._state_keys() else {}
        pending, self._pending = self._pending, None
        if pending is not None and set(pending) == set(self._state_keys()):
            p, st = self.batch_rows.data, pending
        else:
            self._catch_up_rows(rows)  # rows carried from an earlier step
            p = self.weight.data.index_select(0, r)
            st = {k: state[k].index_select(0, r) for k in self._state_keys()}
        starts = self._rule is not None and self._rule.starts_momentum(self.t + 1)
        fused_update(self._kind, group, p, grad.to(p.dtype), st, self.t + 1, starts)
        put_rows(self.weight.data, r, p)
        for k, v in st.items():
            put_rows(state[k], r, v)
        put_rows(self.slot_step, rows, self.t + 1)
