"""What a forward saves for backward, per module: :class:`ActivationRecorder` around one forward
gives an :class:`ActivationProfile` (the bytes each module alone saves, its inputs, which modules
change state, where a table's weight is read outside its module). ``checkpoint_activations``
plans from it; the agent records one every ``profile_interval_s`` (and one after checkpointing,
to measure it)."""

from __future__ import annotations

import bisect
import logging
import random
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from edo_monitor.actions.use_watch import _METADATA_OPS, _element_span, _UseWatcher
from edo_monitor.measure.accounting import is_parameter, is_table_module, tensor_bytes
from edo_monitor.measure.func_transforms import register_hooks, unregister_hooks
from edo_monitor.measure.module_tree import nested
from edo_monitor.measure.saved_version import checked, stamp

__all__ = ["ActivationProfile", "ActivationRecorder"]

logger = logging.getLogger(__name__)

_ACTIVE = threading.local()

#: ``depth`` > 0 while an optimizer's ``step`` runs on this thread (global step hooks, registered
#: once at import: registering them later, from inside the agent's own optimizer post-hook, would
#: change the dict PyTorch is iterating). Reads of a weight there are the optimizer's.
_OPTIMIZER_STEP = threading.local()


def _optimizer_step_pre(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    _OPTIMIZER_STEP.depth = getattr(_OPTIMIZER_STEP, "depth", 0) + 1
    for recorder in getattr(_ACTIVE, "recorders", ()):
        recorder.note_grads_at_step(optimizer)


def _optimizer_step_post(*args: Any) -> None:
    _OPTIMIZER_STEP.depth = max(0, getattr(_OPTIMIZER_STEP, "depth", 0) - 1)


register_optimizer_step_pre_hook(_optimizer_step_pre)
register_optimizer_step_post_hook(_optimizer_step_post)


@dataclass(frozen=True)
class ActivationProfile:
    """Saved-for-backward bytes of one recorded forward.

    Attributes:
        total_bytes: every saved activation storage, counted once (parameters excluded).
        exclusive_bytes: per qualified module name, the bytes saved only inside that module's
            forward, minus storages that are the module's inputs (what checkpointing it frees).
        called: names of the modules that ran.
        buffer_mutating: names of the modules during whose forward a buffer of the model changed
            (its version counter moved, or a buffer was rebound: BatchNorm's running statistics,
            any custom running state), or a plain attribute of the module or its submodules
            holding a tensor or a number (a running mean kept outside the buffers, a call
            counter), or Python's or NumPy's global random state (a LayerDrop drawn with
            ``random.random()``), or the forward's own tensor inputs (changed in place).
            Recomputing such a forward would change that state again, draw other numbers, or
            start from changed inputs (a checkpointed one failed the user's backward).
        held_input_bytes: per module name, the bytes of its inputs that nothing saved for
            backward (parameters excluded): what checkpointing it would keep alive besides (see
            :meth:`net_saving_bytes`).
        input_bytes: per module name, the bytes of its tensor inputs (each storage once).
        outside_uses: per embedding-table module name, where its parameters were read outside
            its own forward during the recorded step (``"<innermost module>: <op>"``, or
            ``"<no module>: <op>"`` for the user's code around the model), e.g. an output
            layer tied by use: ``F.linear(h, self.emb.weight)``, or ``h @ self.emb.weight.T``
            (``"<model>: matmul (a view of the weight)"``). Actions that change such a
            weight's dtype, shape, storage or device refuse. See :class:`ActivationRecorder`.
        grad_edits: names of the embedding tables whose weight's gradient the training loop
            changed between the backward and the optimizer's step while the gradient of some
            other parameter stayed as the backward left it: the table's gradient alone
            (``clip_grad_norm_(model.emb.weight, 1.0)``, ``emb.weight.grad.mul_(0.5)``), not an
            operation over every parameter (``clip_grad_norm_(model.parameters())``, a
            ``GradScaler``'s unscaling). Actions after which the table's ``weight`` has no
            gradient (the row cache's is ``batch_rows.grad``) refuse such a table: the loop's
            code would find ``weight.grad`` None and fail, or clip nothing.
    """

    total_bytes: int
    exclusive_bytes: dict[str, int] = field(default_factory=dict)
    called: frozenset[str] = frozenset()
    buffer_mutating: frozenset[str] = frozenset()
    outside_uses: dict[str, tuple[str, ...]] = field(default_factory=dict)
    held_input_bytes: dict[str, int] = field(default_factory=dict)
    input_bytes: dict[str, int] = field(default_factory=dict)
    grad_edits: frozenset[str] = frozenset()

    def net_saving_bytes(self, name: str) -> int:
        """What checkpointing module ``name`` frees: its exclusive bytes less its inputs that
        nothing saved (checkpointing keeps them alive to recompute from). A Dropout between a GELU
        and a Linear frees its mask but keeps the GELU's output, which was freed before: 0."""
        return self.exclusive_bytes.get(name, 0) - self.held_input_bytes.get(name, 0)

    def outside(self, blocks: Iterable[str]) -> dict[str, tuple[int, int]]:
        """``(exclusive bytes, input bytes)`` of each module run that neither holds nor sits
        inside any of ``blocks``: the part of the forward that checkpointing ``blocks`` leaves
        alone (two forwards of the same batch shapes give the same)."""
        chosen = list(blocks)
        return {
            m: (self.exclusive_bytes.get(m, 0), self.input_bytes.get(m, 0))
            for m in self.called
            if not any(nested(m, c) for c in chosen)
        }


class ActivationRecorder:
    """Context manager recording the tensors saved for backward during a forward of ``model``.

    Use on the training thread around a forward (not the backward)::

        with ActivationRecorder(model) as rec:
            loss = model(batch)
        profile = rec.profile()

    Installs forward hooks on ``model``'s modules and a ``saved_tensors_hooks`` pair; removes them
    on exit. Storages are keyed by ``data_ptr`` (saved tensors stay alive during the forward, so
    keys are unique); sparse tensors by their values' storage, sized as indices + values.
    ``chain=(pack, unpack)`` passes every saved tensor on to an outer pair of hooks (the agent's
    :class:`~edo_monitor.agent.activations.ActivationTracker`), which the innermost hooks would
    otherwise hide. An error inside the hooks is kept in ``errors`` and never reaches the forward.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        chain: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None,
    ) -> None:
        self.model = model
        #: an outer ``(pack, unpack)`` pair the recorder's saved-tensor hooks pass every tensor
        #: on to (the agent's live tracker keeps counting during a recorded step)
        self._chain = chain
        #: errors caught inside the recorder's hooks (training goes on; the profile misses them)
        self.errors: list[BaseException] = []
        self._names = {id(m): n for n, m in model.named_modules()}
        self._stack: list[str] = []
        self._bytes: dict[int, int] = {}
        self._owners: dict[int, frozenset[str]] = {}
        self._inputs: dict[str, dict[int, int]] = {}  # module -> its inputs' storages: bytes
        self._called: set[str] = set()
        self._static: set[int] = set()
        self._handles: list[Any] = []
        self._hooks: Any = None
        # buffer changes per module forward: the modules owning buffers, a stack of the buffers'
        # (identity, version) at each forward's start, the modules whose forward changed one
        self._buffer_owners = [m for m in model.modules() if m._buffers]
        self._buffer_marks: list[tuple[Any, ...]] = []
        self._mutating: set[str] = set()
        # reads of table parameters outside their module's forward (see _UseWatcher)
        self._watched: dict[int, tuple[str, frozenset[str]]] = {}
        #: the same by the parameters' memory: ``(start, end)`` addresses of each one's elements,
        #: sorted; a view or ``.data`` of a table weight (``self.emb.weight.T``, made before or
        #: during the step) starts inside them and reads the weight's values too
        self._watched_starts: list[int] = []
        self._watched_spans: list[tuple[int, tuple[str, frozenset[str]]]] = []
        self._outside: dict[str, set[str]] = {}
        self._use_mode: _UseWatcher | None = None
        # each parameter's gradient as the backward left it (the gradient, its version), and,
        # at its optimizer's step, which parameters' were changed since (see grad_edits)
        self._grad_marks: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._grads_kept: set[int] = set()
        self._grads_changed: set[int] = set()

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[int, int]:
        if t.layout != torch.strided:  # sparse: no single storage; indices + values
            values = t._values() if t.layout == torch.sparse_coo else t.values()
            return -values.untyped_storage().data_ptr(), tensor_bytes(t)
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()

    def _buffer_state(self) -> tuple[tuple[int, int], ...]:
        """``(id, _version)`` of every buffer now: an in-place update bumps the version, a
        rebinding changes the identity."""
        return tuple(
            (id(b), b._version)
            for m in self._buffer_owners
            for b in m._buffers.values()
            if b is not None
        )

    def _pre_buffers(self, name: str, module: nn.Module, inputs: list[torch.Tensor]) -> None:
        self._buffer_marks.append(
            (
                name,
                self._buffer_state(),
                _attribute_state(module),
                # weakly: a forward that raised (an out-of-memory error) never pops its mark,
                # and its inputs must not outlive it (a retry found them still allocated)
                [(weakref.ref(t), t._version) for t in inputs],
                _host_random_state(),
            )
        )

    def _post_buffers(self, name: str, module: nn.Module) -> None:
        while self._buffer_marks:
            mark_name, state, attributes, inputs, host_random = self._buffer_marks.pop()
            if mark_name == name:
                if (
                    state != self._buffer_state()
                    or attributes != _attribute_state(module)
                    or any((t := ref()) is not None and t._version != v for ref, v in inputs)
                    or host_random != _host_random_state()
                ):
                    self._mutating.add(name)
                return

    def _watch_table_params(self) -> None:
        """Map each table parameter to (its table's name, the names of modules holding it)."""
        holders: dict[int, set[str]] = {}
        spans: list[tuple[int, int, tuple[str, frozenset[str]]]] = []
        for name, m in self.model.named_modules(remove_duplicate=False):
            for p in m._parameters.values():
                if p is not None:
                    holders.setdefault(id(p), set()).add(name)
        for name, m in self.model.named_modules():
            if not is_table_module(m):
                continue
            for p in m.parameters():
                if id(p) not in self._watched:
                    hit = (name, frozenset(holders.get(id(p), {name})))
                    self._watched[id(p)] = hit
                    span = _element_span(p)
                    if span is not None:
                        spans.append((*span, hit))
        spans.sort(key=lambda s: s[0])
        self._watched_starts = [start for start, _, _ in spans]
        self._watched_spans = [(end, hit) for _, end, hit in spans]

    def _hit(self, t: torch.Tensor) -> tuple[tuple[str, frozenset[str]] | None, bool]:
        """``((table, owners), is_alias)`` when ``t`` is a watched weight (``is_alias`` False) or
        any other tensor whose first element lies in a watched weight's elements (a view,
        ``.data``: ``is_alias`` True). ``data_ptr()`` is one C call (no storage object made); live
        tensors' memory does not overlap unless they alias, so the match is exact."""
        hit = self._watched.get(id(t))
        if hit is not None:
            return hit, False
        if self._watched_starts and t.layout == torch.strided:
            try:
                ptr = t.data_ptr()
            except Exception:  # a wrapper subclass (FakeTensor, DTensor ...): no memory of its own
                return None, False
            i = bisect.bisect_right(self._watched_starts, ptr) - 1
            if ptr and i >= 0 and ptr < self._watched_spans[i][0]:
                return self._watched_spans[i][1], True
        return None, False

    def note_use(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Record a read of a table parameter outside the forward of every module holding it
        (called by the recorder's ``TorchFunctionMode`` for each torch function).

        A read is of the parameter itself or of any tensor starting inside its elements'
        memory: ``self.emb.weight.T`` is a property read (``__get__``, metadata-only by name)
        that hands out a view, and the view's ``matmul`` is the read of the values (recorded as
        ``"<model>: matmul (a view of the weight)"``); a view made before the recorded step, or
        ``weight.data``, is caught the same way. Matching by address is exact: only an alias of
        the weight lies in its memory (its gradient and optimizer state have their own), and
        the address is read only during the one recorded step.

        Not uses: metadata reads (:data:`_METADATA_OPS`), anything inside an optimizer's
        ``step`` (the actions move or convert the optimizer's state with the weight), and, for
        optimizer code run outside ``step``, ``_foreach_*`` ops and in-place ops whose first
        argument is the weight.
        """
        name = getattr(func, "__name__", "")
        if (
            getattr(_OPTIMIZER_STEP, "depth", 0)
            or name in _METADATA_OPS
            or name.startswith("_foreach")
        ):
            return
        in_place = name.endswith("_") and not name.endswith("__")
        for i, a in enumerate((*args, *kwargs.values())):
            items = a if isinstance(a, (list, tuple)) else (a,)
            for t in items:
                if not isinstance(t, torch.Tensor):
                    continue
                hit, alias = self._hit(t)
                if hit is None or (in_place and i == 0):
                    continue  # not watched; or updated in place (an optimizer's step)
                table, owners = hit
                if any(o in self._stack for o in owners):
                    continue
                where = self._stack[-1] if self._stack else "<no module>"
                what = f"{where or '<model>'}: {name}" + (
                    " (a view of the weight)" if alias else ""
                )
                self._outside.setdefault(table, set()).add(what)

    def _grad_made(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: note ``p``'s gradient as the backward leaves it."""
        if p.grad is not None:
            self._grad_marks[id(p)] = (weakref.ref(p.grad), p.grad._version)

    def note_grads_at_step(self, optimizer: torch.optim.Optimizer) -> None:
        """At ``optimizer``'s step (before it runs): which of its parameters' gradients were
        changed in place or replaced since the backward made them (called by a global optimizer
        pre-step hook)."""
        try:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    mark = self._grad_marks.pop(id(p), None)
                    if mark is None:
                        continue
                    grad, version = mark[0](), mark[1]
                    if grad is None or p.grad is not grad or grad._version != version:
                        self._grads_changed.add(id(p))
                    else:
                        self._grads_kept.add(id(p))
        except Exception as exc:  # never fail the user's step
            self.errors.append(exc)

    @torch.compiler.disable  # Python state: run as Python under torch.compile
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        name = self._names.get(id(module), "")
        try:
            self._pre_buffers(name, module, _tensors(args, kwargs))
        except Exception as exc:  # a hook must never fail the user's forward
            self.errors.append(exc)
        self._stack.append(name)
        self._called.add(name)
        try:
            keys = self._inputs.setdefault(name, {})
            for t in _tensors(args, kwargs):
                if not _has_storage(t):  # a wrapper (torch.func's inside a transform): no memory
                    continue
                ptr, nbytes = self._key(t)
                keys[ptr] = nbytes
        except Exception as exc:  # a hook must never fail the user's forward
            self.errors.append(exc)

    @torch.compiler.disable  # Python state: run as Python under torch.compile
    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = self._names.get(id(module), "")
        try:
            self._post_buffers(name, module)
        except Exception as exc:  # a hook must never fail the user's forward
            self.errors.append(exc)
        if self._stack and self._stack[-1] == name:
            self._stack.pop()

    def _record(self, t: torch.Tensor, stack: Iterable[str]) -> None:
        ptr, nbytes = self._key(t)
        if ptr in self._static or nbytes == 0 or is_parameter(t):
            return
        owners = frozenset(stack)
        self._bytes[ptr] = max(nbytes, self._bytes.get(ptr, 0))
        prev = self._owners.get(ptr)
        self._owners[ptr] = owners if prev is None else prev & owners

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            self._record(t, self._stack)
        except Exception as exc:  # a hook must never fail the user's forward
            self.errors.append(exc)
        return stamp(t) if self._chain is None else self._chain[0](t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        # autograd's in-place check, which hooks switch off (edo_monitor.measure.saved_version)
        return checked(*packed) if self._chain is None else self._chain[1](packed)

    def note_held(self, args: tuple, kwargs: dict, block: str) -> None:
        """Count the inputs a checkpointed ``block`` keeps alive, attributed outside the block."""
        stack = list(self._stack)
        if stack and stack[-1] == block:
            stack.pop()
        try:
            for t in _tensors(args, kwargs):
                self._record(t, stack)
        except Exception as exc:  # called from a checkpointed block's forward: never fail it
            self.errors.append(exc)

    def __enter__(self) -> ActivationRecorder:
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if not is_lazy(t):  # a lazy module's parameter has no storage yet
                self._static.add(self._key(t)[0])
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        self._watch_table_params()
        for p in self.model.parameters():
            if p.requires_grad and p.is_leaf and not is_lazy(p):
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_made))
        if self._watched:
            _OPTIMIZER_STEP.depth = 0  # a step that raised never ran its post-hook
            self._use_mode = _UseWatcher(self)
            self._use_mode.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        register_hooks(self._pack)  # torch.func's transforms take them off while they run
        stack = getattr(_ACTIVE, "recorders", [])
        stack.append(self)
        _ACTIVE.recorders = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        unregister_hooks(self._pack)
        self._hooks = None  # it holds our bound methods: a cycle that kept the model alive
        if self._use_mode is not None:
            try:
                self._use_mode.__exit__(None, None, None)
            except Exception:  # mode stack changed under us (another mode left open)
                logger.debug("could not pop the use-watching mode", exc_info=True)
            self._use_mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._grad_marks.clear()
        _ACTIVE.recorders.remove(self)
        self._stack.clear()

    def profile(self) -> ActivationProfile:
        """The :class:`ActivationProfile` of what was recorded."""
        total = sum(self._bytes.values())
        exclusive: dict[str, int] = {}
        for ptr, owners in self._owners.items():
            for name in owners:
                if ptr in self._inputs.get(name, ()):
                    continue
                exclusive[name] = exclusive.get(name, 0) + self._bytes[ptr]
        held = {
            name: n
            for name, inputs in self._inputs.items()
            if (
                n := sum(
                    b for p, b in inputs.items() if p not in self._bytes and p not in self._static
                )
            )
        }
        return ActivationProfile(
            total,
            exclusive,
            frozenset(self._called),
            frozenset(self._mutating),
            {k: tuple(sorted(v)) for k, v in self._outside.items()},
            held,
            {name: sum(inputs.values()) for name, inputs in self._inputs.items()},
            self._grad_edits(),
        )

    def _grad_edits(self) -> frozenset[str]:
        """The tables whose gradient alone the loop changed (:attr:`ActivationProfile.
        grad_edits`): none when every parameter's gradient was changed (an operation over all
        of them) or none was kept to compare with."""
        if not self._grads_kept:
            return frozenset()
        return frozenset(
            hit[0] for pid in self._grads_changed if (hit := self._watched.get(pid)) is not None
        )


def _attribute_state(module: nn.Module) -> tuple[tuple[Any, ...], ...]:
    """What a forward could change in ``module`` and its submodules besides buffers: each plain
    attribute holding a tensor (its identity and version counter: a running mean kept in an
    attribute, not a registered buffer) or a number (its identity: a call counter)."""
    return tuple(
        (id(m), key, id(value), value._version if isinstance(value, torch.Tensor) else None)
        for m in module.modules()
        for key, value in m.__dict__.items()
        if isinstance(value, (torch.Tensor, int, float))
    )


def _host_random_state() -> tuple[Any, ...]:
    """Python's ``random`` state and NumPy's global one (when imported): random draws a
    recomputing checkpoint does not replay (it restores torch's generators only)."""
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    return (
        random.getstate(),
        None if np_state is None else (np_state[1].tobytes(), *np_state[2:]),
    )


def _has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has memory of its own to key (a functorch ``TensorWrapper`` inside a
    ``torch.func`` transform, a ``FakeTensor``, a ``DTensor`` have none readable)."""
    try:
        if t.layout == torch.strided:
            t.untyped_storage()
        return True
    except (NotImplementedError, RuntimeError):
        return False


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _current_recorder() -> ActivationRecorder | None:
    stack = getattr(_ACTIVE, "recorders", None)
    return stack[-1] if stack else None
