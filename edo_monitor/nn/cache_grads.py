"""The row cache's gradient: the layout of the rows touched since the last step (the row buffer
``batch_rows`` and its gradient), the forward taking rows into it, the backward adding to it, and
gradients that reach the table another way (on ``weight`` itself, or a replaced table's pending
one)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from edo_monitor.nn.cache_parts import put_rows, to_device

logger = logging.getLogger(__name__)

#: per cached table, who to tell when a gradient reaches its weight directly (a weak table: a
#: copy or pickle of the module carries no reference to the agent)
_DIRECT_GRAD_REPORTS: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = (
    weakref.WeakKeyDictionary()
)


def report_direct_grads(table: Any, callback: Callable[[Any], None]) -> None:
    """Call ``callback(table)`` the first time a gradient reaches cached ``table``'s weight
    directly, not through a lookup (see ``_direct_grad``): from that step the table is not
    stepped as the resident table would be. Replaces a callback set before."""
    _DIRECT_GRAD_REPORTS[table] = callback


class _GradientLayout:
    """The rows touched since the last step and their gradient (a mixin of
    :class:`~edo_monitor.nn.cached.CachedTable`)."""

    # (class defaults: a copy or an older pickle has none) the last step's gradient (ids,
    # grad), kept until the next backward or step finds whether a zero_grad() came since
    # (:meth:`_resolve_carry`); the row buffer's gradient as the cache last left it, with its
    # version; optimizers that stepped the table before the attached one (a zero_grad() of
    # theirs does not reach the row buffer: nothing is carried while one lives)
    _carry: tuple[torch.Tensor, torch.Tensor] | None = None
    _carry_mark: tuple[torch.Tensor, int] | None = None
    _former: weakref.WeakSet[torch.optim.Optimizer] | None = None

    def _keeps_rows(self) -> bool:
        """Whether a training forward keeps its rows in the row buffer (:meth:`_take_rows`): with
        an optimizer attached, without ``max_norm`` (a lookup renormalises rows: the cache must
        hold them), when every row of the layout was taken that way."""
        return (
            self._rule is not None
            and self.options.max_norm is None  # renormalised rows belong in the cache at once
            and (self._pending is not None or self._layout_rows.numel() == 0)
        )

    def _take_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions ``(U,)`` of unique cache ``rows`` (host int64) in the gradient layout.

        Rows new to the layout are gathered once with their optimizer state, caught up to step
        ``t`` there (not in the cache, whose rows stay at their own steps) and appended: the row
        buffer's values ``batch_rows.data`` ``(L, D)`` and the state in ``_pending`` (``{key:
        (L, D)}``) are the layout's rows at step ``t``, which the forward reads and the step
        updates and scatters once. Anything that rewrites the cache's rows before the step
        (loading a state dict, a device move, a new optimizer) drops them (``_pending = None``):
        the step then catches the cache's rows up instead (:meth:`_step_rows`).
        """
        pos = self._row_pos.index_select(0, rows)
        new = rows.masked_select(pos < 0)
        if new.numel() == 0:
            return pos
        s = self.slot_step.index_select(0, new)
        stale = int((s < self.t).sum())
        if stale:  # oldest first: the stale rows lead, as the rule sums them
            order = torch.argsort(s, stable=True)
            new, s = new.index_select(0, order), s.index_select(0, order)
        r = to_device(new, self.device)
        p = self.weight.data.index_select(0, r)
        st = self._rows_state(new, r)
        if stale:
            assert self._rule is not None
            self._rule.catch_up_rows(
                p[:stale], {k: v[:stale] for k, v in st.items()}, s[:stale], self.t
            )
        held = self._pending or {}
        self._pending = {k: torch.cat([held[k], v]) if k in held else v for k, v in st.items()}
        self._append_layout(new, p)
        return self._row_pos.index_select(0, rows)

    def _append_layout(self, new: torch.Tensor, values: torch.Tensor) -> None:
        """Append cache rows ``new`` ``(n,)`` (host int64, not in the layout) to the gradient
        layout, with the row buffer's ``values`` ``(n, D)`` for them and a zero gradient."""
        grad = self.batch_rows.grad
        if grad is not None:
            grad = torch.cat([grad.detach(), grad.new_zeros(new.numel(), self.embedding_dim)])
        if self._layout_rows.numel() == 0:  # a step's first forward: nothing to append to
            self._set_layout(new, grad, values)
            return
        data = torch.cat([self.batch_rows.data, values])
        self._set_layout(torch.cat([self._layout_rows, new]), grad, data)

    def _set_layout(
        self, rows: torch.Tensor, grad: torch.Tensor | None, data: torch.Tensor
    ) -> None:
        """The gradient layout becomes ``rows`` (host int64 cache rows) with ``grad`` and the row
        buffer's values ``data`` (both ``(len(rows), D)``)."""
        carried = self._carry is not None and self._carry_stands()
        old = self._layout_rows
        if old.numel():
            put_rows(self._row_pos, old, -1)
        self._layout_rows = rows
        put_rows(self._row_pos, rows, torch.arange(rows.numel()))
        self.batch_rows.grad = None
        self.batch_rows.data = data
        self.batch_rows.grad = grad
        if carried:
            self._mark_carry()
        else:
            self._carry = self._carry_mark = None

    def _layout_slots(self) -> torch.Tensor:
        """Slots of the rows holding a gradient (never evicted: it would lose it)."""
        return self._layout_rows // self.block_rows  # repeats allowed: used as an index

    def _layout_add(self, rows: torch.Tensor) -> torch.Tensor:
        """Positions ``(U,)`` of unique cache ``rows`` in the gradient layout (appended, the row
        buffer's values zero: the forward reads the cache's rows)."""
        pos = self._row_pos[rows]
        new = rows[pos < 0]
        if new.numel():
            zeros = self.batch_rows.new_zeros(new.numel(), self.embedding_dim)
            self._append_layout(new, zeros)
            pos = self._row_pos[rows]
        return pos

    # A backward hands each lookup's rows' gradient over (:meth:`_grad_arrived`); it is added
    # at the end of that backward only if the backward accumulated into ``weight`` (its gradient
    # accumulator ran: :meth:`_watch_weight_accumulator`), as a resident table's ``.grad`` would
    # be. ``torch.autograd.grad`` runs the lookups' backwards but not the accumulator: a gradient
    # taken only to be looked at was stepped too.
    def _watch_weight_accumulator(self) -> None:
        """After a training lookup: a pre-hook on ``weight``'s gradient accumulator (the node
        every graph over ``weight`` shares; autograd makes a new one when ``weight``'s data
        changes dtype or device, as a resize's rebind does) that notes each backward running
        it. The node watched is kept (to hook each node once: it takes no attribute and no weak
        reference); it holds no gradient."""
        edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
        node = (
            edge(self.weight).node
            if edge is not None
            else self.weight.view_as(self.weight).grad_fn.next_functions[0][0]
        )
        if node is self.__dict__.get("_watched_node"):
            return
        ref = weakref.ref(self)

        def accumulating(grad_outputs: Any) -> None:
            table = ref()
            if table is not None:
                table._accumulating().add(torch._C._current_graph_task_id())

        node.register_prehook(accumulating)
        self.__dict__["_watched_node"] = node

    def _accumulating(self) -> set[int]:
        """The running backwards (graph task ids) that accumulate into ``weight``."""
        tasks = self.__dict__.get("_accumulating_tasks")
        if tasks is None:
            tasks = self.__dict__["_accumulating_tasks"] = set()
        return tasks

    def _grad_arrived(self, positions: torch.Tensor, generation: int, grad: torch.Tensor) -> None:
        """Backward of :class:`CacheRows`: hold ``grad`` ``(U, D)`` for ``positions`` until the
        backward ends (:meth:`_backward_ended`)."""
        task = torch._C._current_graph_task_id()
        arrived = self.__dict__.setdefault("_arrived", {})
        if task not in arrived:
            arrived[task] = []
            ref = weakref.ref(self)

            def ended() -> None:
                table = ref()
                if table is not None:
                    table._backward_ended(task)

            torch.autograd.Variable._execution_engine.queue_callback(ended)
        arrived[task].append((positions, generation, grad))

    def _backward_ended(self, task: int) -> None:
        """The end of backward ``task``: its lookups' gradients are added if it accumulated into
        ``weight``, else dropped (``torch.autograd.grad``)."""
        held = self.__dict__.get("_arrived", {}).pop(task, [])
        accumulating = self._accumulating()
        if task not in accumulating:
            return
        accumulating.discard(task)
        for positions, generation, grad in held:
            self._accumulate_grad(positions, generation, grad)

    def _accumulate_grad(
        self, positions: torch.Tensor, generation: int, grad: torch.Tensor
    ) -> None:
        """Add a lookup's rows' gradient ``grad`` ``(U, D)`` at ``positions``."""
        if generation != self._generation:
            raise RuntimeError(
                "cached table: a backward ran after the optimizer step that followed its "
                "forward; run backward before optimizer.step() (the cache's gradient rows of "
                "that forward are no longer laid out)"
            )
        self._backward_seen = True
        if self._carry is not None:
            self._resolve_carry()
        with torch.no_grad():
            g = self.batch_rows.grad
            if g is None:
                g = torch.zeros_like(self.batch_rows)
                g.index_add_(0, positions.to(g.device), grad.to(g.dtype))
                self.batch_rows.grad = g
            else:
                g.index_add_(0, positions.to(g.device), grad.to(g.dtype))

    def dense_grad(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cache's pending gradient as ``(ids (U,) int64 host, grad (U, D))``, or ``None``."""
        g = self.batch_rows.grad
        if g is None:
            return None
        return self._row_ids(self._layout_rows), g

    def _direct_grad(self) -> torch.Tensor | None:
        """A gradient that reached ``weight`` ``(C, D)`` itself, not through a lookup (a loss
        term over ``.weight`` or over every parameter), taken from it before the optimizer's
        own step could step the cache with it (Adam stepped the table twice a step).

        All zero (``0 * p.sum()`` over the parameters, DDP's way to touch them all): the
        resident table's gradient is then its lookups' alone, and the step is exact; with no
        lookup since the last step it is a zero gradient for every row, stepped as one.
        Otherwise no exact step exists: the cache holds only some rows, each at its own step.
        A table the user made refuses it; one the agent made
        (``edo_action_made``) must not fail the training it watches: the gradient reaches the
        cached rows it touches (:meth:`_add_direct_grad`, returned here), a warning says
        the rows on the host got none, and the callback of :func:`report_direct_grads`, when the
        agent set one, is called (once: it records the run inexact from that step).

        Raises:
            RuntimeError: a non-zero gradient on the weight of a table the user made (the
                weight keeps it; nothing is stepped).
        """
        wgrad = self.weight.grad
        if wgrad is None:
            return None
        if not bool(wgrad.any()):
            self.weight.grad = None
            if self.batch_rows.grad is None:
                self.batch_rows.grad = torch.zeros_like(self.batch_rows)
            return None
        if not getattr(self, "edo_action_made", False):
            raise RuntimeError(
                "a gradient reached the cached table's weight directly (a loss term over "
                ".weight or over every parameter, such as an L2 penalty): the weight is the "
                "cache, some rows of the table each at its own step, so no step of it is the "
                "resident table's; take such a term over the looked-up rows, or use the "
                "optimizer's weight_decay"
            )
        self.weight.grad = None
        if not getattr(self, "_direct_grad_warned", False):
            self._direct_grad_warned = True
            logger.warning(
                "cached table: a gradient reached its weight directly (a loss term over the "
                "model's parameters?); it steps the cached rows it touches, at their cached "
                "values, and not the rows on the host, as the resident table's would"
            )
            report = _DIRECT_GRAD_REPORTS.get(self)  # the agent records it
            if report is not None:
                try:
                    report(self)
                except Exception:  # the agent's record must not fail the step
                    logger.exception("reporting a direct gradient of a cached table failed")
        return wgrad

    def _add_direct_grad(self, grad: torch.Tensor) -> None:
        """Add ``grad`` ``(C, D)`` (a gradient on ``weight``) into the batch's gradient at the
        cache rows it touches that hold table rows (a free slot holds none)."""
        rows = grad.ne(0).any(dim=1).nonzero().reshape(-1).cpu()
        rows = rows[self.slot_to_block.index_select(0, rows // self.block_rows) >= 0]
        self._add_row_grads(rows, grad.index_select(0, to_device(rows, grad.device)))

    @torch.no_grad()
    def take_table_grad(self, grad: torch.Tensor) -> None:
        """Take a whole table's pending gradient ``(N, D)`` (the replaced module's
        ``weight.grad``, when the agent caches a table between a backward and the table's
        optimizer step): its non-zero rows are made resident (pinned until the step) and their
        gradient becomes the batch's, so the step is the one the resident table would have
        taken; an all-zero one (``zero_grad(set_to_none=False)``) is a zero gradient.

        Raises:
            ValueError: ``grad`` is not ``(num_embeddings, D)``.
        """
        n, d = self.num_embeddings, self.embedding_dim
        if tuple(grad.shape) != (n, d):
            raise ValueError(f"grad has shape {tuple(grad.shape)}; expected {(n, d)}")
        ids = grad.ne(0).any(dim=1).nonzero().reshape(-1).cpu()
        if ids.numel() == 0:
            if self.batch_rows.grad is None:
                self.batch_rows.grad = torch.zeros_like(self.batch_rows)
            return
        self._take_id_grads(ids, grad.index_select(0, to_device(ids, grad.device)))

    # A resident table's gradient stays after a step until it is zeroed: the next backward adds
    # to it, a step with no backward steps with it again. The cache's step takes the gradient
    # out of the row buffer (the rows it touched are laid out afresh), so it keeps it aside
    # (``_carry``) and watches the row buffer's gradient: a zero_grad() replaces it (None) or
    # zeroes it in place (its version moves); the cache's own changes move the mark along.
    def _mark_carry(self) -> None:
        """Note the row buffer's gradient as the cache leaves it (while a gradient is kept)."""
        g = self.batch_rows.grad
        self._carry_mark = None if g is None else (g, g._version)
        if g is None:
            self._carry = None  # zeroed (set to None): nothing to add

    def _carry_stands(self) -> bool:
        """Whether no zero_grad() reached the row buffer since the kept gradient's step."""
        mark, g = self._carry_mark, self.batch_rows.grad
        return mark is not None and g is mark[0] and g._version == mark[1]

    @torch.no_grad()
    def _resolve_carry(self) -> None:
        """At the first backward (or a step with none) after a step: add that step's gradient
        back when no ``zero_grad()`` came since, as the resident table's stays; let it go
        otherwise. Not while an optimizer that stepped the table before lives (its zero_grad()
        would not reach the row buffer)."""
        carry, self._carry = self._carry, None
        stands, self._carry_mark = self._carry_stands(), None
        others = [o for o in self._former or () if o is not self._optimizer]
        if carry is None or not stands or others:
            return
        ids, grad = carry
        nonzero = grad.ne(0).any(dim=1)
        self._take_id_grads(ids[nonzero.cpu()], grad[nonzero])

    def _take_id_grads(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Make table rows ``ids`` ``(n,)`` (host int64, distinct) resident, pinned until the
        step, and add ``grads`` ``(n, D)`` into the batch's gradient at them."""
        if ids.numel() == 0:
            return
        r = self.block_rows
        blocks = torch.unique(ids // r) if r > 1 else ids
        slots = self._ensure(blocks, count=False)
        self._pin_slots(slots)
        rows = self.block_to_slot.index_select(0, ids // r) * r + ids % r if r > 1 else slots
        self._add_row_grads(rows, grads)

    def _add_row_grads(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Add ``grads`` ``(n, D)`` into the batch's gradient at cache ``rows`` ``(n,)`` (host
        int64, distinct, resident), laid out as a lookup lays its rows out."""
        if rows.numel() == 0:
            return
        pos = self._take_rows(rows) if self._keeps_rows() else self._layout_add(rows)
        g = self.batch_rows.grad
        if g is None:
            g = self.batch_rows.grad = torch.zeros_like(self.batch_rows)
        g.index_add_(0, to_device(pos, g.device), grads.to(g.device, g.dtype))
