"""Bytes saved for backward that are alive now, measured with ``saved_tensors_hooks``.

The pack hook sees every tensor autograd saves during forward (in the training thread, inside the
``watch()`` block). With a watched model it counts those of the model's *step window* only: from
the model's forward to the step boundary (:meth:`end_step` closes it), so the model's activations
and its loss's count, and the saved tensors of another model trained between two of its steps
(another ``watch()``'s, a model not watched) do not: before the window, those were charged to
the watched model, and under a CPU budget ``enforce=True`` raised the out-of-memory error in the
other model's forward. The window opens at the model's forward (a forward pre-hook), or else at
the first of its parameters saved: a step that calls the model's parts, not the model (a
LightningModule's ``training_step`` calls its children), read 0 bytes of activations with the
model's hook alone. From the step after one that opened so on, the model's children get the
hook too (a hook costs ~7 us a call: models called whole never get them); a step through a
grandchild still opens at its first parameter saved, missing what was saved before it. With two
watched models trained together on one thread (each in its own ``watch()``), a saved tensor is
the tracker's whose model's forward began last (:data:`_CURRENT`), whichever block's hooks
autograd calls.

Instead of the tensor the pack hook hands autograd a small holder (:class:`_Saved`) that keeps
the tensor and a key of its storage; autograd keeps the holder exactly as long as it keeps the
saved tensor (until ``backward()`` frees the graph, or for as long as a retained graph lives), and
the unpack hook gives the tensor back. When autograd drops the holder, a weak reference's
callback hands it back. So the tracker knows, at any moment, the bytes of saved tensors alive:

* each storage counts once while any holder of it is alive (many saved tensors are views of one
  storage: a reference count per storage, keyed by its ``data_ptr`` — unique while the holder
  keeps the storage alive);
* the model's own parameters and buffers are skipped (they are counted as ``params_bytes``);
* sparse tensors have no single storage: they count their indices plus values
  (:func:`edo_monitor.measure.accounting.tensor_bytes`), keyed by their values' storage;
* a tensor that requires grad is held detached (same storage and version counter): holding a saved
  *output* with its ``grad_fn`` would make a reference cycle through autograd's C++ graph that
  Python's garbage collector cannot see, and a graph dropped without ``backward()`` would never be
  freed.

Readings: :attr:`ActivationTracker.live_bytes` (alive now), :meth:`ActivationTracker.take_peak`
(the highest live bytes since the previous call: what a sample reports, so a sample taken between
steps does not miss a step's peak), :attr:`ActivationTracker.step_peak_bytes` and
:meth:`ActivationTracker.end_step` (the peak of the current step, for the step boundary), and
:attr:`ActivationTracker.peak_bytes` (the whole run). With gradient accumulation the peak is that of
the bytes alive *at once* (each micro-batch's graph is freed by its ``backward()``), not a sum over
micro-batches; saved tensors that outlive their step (``backward(retain_graph=True)`` and a loss
kept in a running total) stay counted, so a leak shows as growth.

Thread safety and signals: holders may be freed on any thread (autograd's device threads on
CUDA). The release runs no Python code: the holder's weak reference has the deque's own C method
``collections.deque.append`` as its callback, which appends the dead reference (atomic, never
blocks, so it cannot deadlock with a collection that runs inside the hook); the counters are
changed under one lock by whoever reads or packs next, which maps the reference back to its key.
A ``__del__`` method did this before, and it ran as the first Python code after ``backward()``
freed the graph: a Ctrl-C arriving during ``backward()`` was raised inside it and, as every
exception in ``__del__``, printed and ignored — training went on (2 of 5 tries of the demo).
Without Python code in the release, a pending Ctrl-C is raised in the training loop.

Failures: an error inside the pack hook (a tensor whose storage cannot be read, e.g. a wrapper
tensor subclass) is counted in :attr:`ActivationTracker.errors` and passed to ``on_error``; the
tensor is saved as is (uncounted) and training goes on. The CPU-budget
out-of-memory error raised by ``on_exceed`` is deliberate and propagates.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from edo_monitor.measure.accounting import is_parameter, tensor_bytes
from edo_monitor.measure.func_transforms import register_hooks, unregister_hooks
from edo_monitor.measure.module_hooks import add_forward_pre_hook
from edo_monitor.measure.saved_version import checked, stamp

__all__ = ["ActivationTracker"]

_STRIDED = torch.strided

#: per thread: the tracker of the watched model whose forward began last (``tracker``). Each
#: ``watch()`` sets its own saved-tensor hooks and only the top pair of the thread's stack is
#: called, so with two watched models trained together (a GAN's two ``watch()`` blocks, one
#: inside the other) the inner block's tracker got every saved tensor, the other model's too;
#: a tracker hands a tensor to the one whose model's forward began last instead.
_CURRENT = threading.local()


class _Saved:
    """What autograd keeps instead of a counted saved tensor: the tensor, its version counter
    when saved (checked on unpacking: :mod:`edo_monitor.measure.saved_version`), and a slot for
    the weak reference whose callback reports the holder's release (see the module docstring).
    An uncounted saved tensor is kept as ``(tensor, version)``."""

    __slots__ = ("__weakref__", "tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """``(key, bytes)`` of the memory ``tensor`` keeps alive.

    Strided: the storage's ``data_ptr`` and its whole ``nbytes`` (a view keeps all of it alive).
    Sparse: minus the values' storage pointer (a separate key space) and indices + values bytes.
    Raises whatever torch raises for a tensor without readable storage.
    """
    if tensor.layout is _STRIDED:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    values = tensor._values() if tensor.layout is torch.sparse_coo else tensor.values()
    return -values.untyped_storage().data_ptr(), tensor_bytes(tensor)


class ActivationTracker:
    """Counts the bytes of saved-for-backward tensors alive now, and their peaks.

    Use as a context manager around the training (the training thread); see the module docstring.

    Args:
        params: the watched model's parameters and buffers (their storages are not counted:
            they are the model's own memory, counted as ``params_bytes``).
        on_error: called as ``on_error(exc)`` for each error caught inside the pack hook (the
            agent counts them and records the first of each kind); also counted in :attr:`errors`.
        window_of: the watched model: count only inside its step window (its forward, or its
            first parameter saved, to :meth:`end_step`; see the module docstring). ``None``:
            every saved tensor counts.

    Attributes:
        errors: exceptions caught inside the pack hook (count).
        limit_bytes, static_bytes, grads_bytes, on_exceed: CPU-budget enforcement during the
            step: when ``static_bytes`` (parameters and optimizer state) + ``grads_bytes`` (the
            gradients alive now, kept by :class:`~edo_monitor.agent.grads_alive.GradientsAlive`)
            + the live saved bytes with a new storage (:meth:`pack`) or a new gradient
            (:meth:`add_grad_bytes`) would go over ``limit_bytes``,
            ``on_exceed(requested_bytes, in_use_bytes, category)`` (``"activations_bytes"`` or
            ``"grads_bytes"``: what the request is) is called before the bytes are counted
            (it raises the out-of-memory error, so the failing forward or backward never
            reaches the optimizer).
        on_open: called when the step window opens (the step's first forward of the model).
        last_step_bytes: the peak of the last step closed by :meth:`end_step`.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] = (),
        *,
        on_error: Callable[[BaseException], None] | None = None,
        window_of: torch.nn.Module | None = None,
    ) -> None:
        self._param_keys = self._keys(params)
        self._lock = threading.Lock()
        # weak references of released holders (appended by their callback: C, any thread), and
        # each live holder's reference with its storage key, by the reference's id
        self._released: collections.deque[weakref.ref[_Saved]] = collections.deque()
        self._holders: dict[int, tuple[weakref.ref[_Saved], int]] = {}
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._live = 0
        self._peak_step = 0
        self._peak_sample = 0
        self._peak_run = 0
        self.last_step_bytes = 0
        self.errors = 0
        self.on_error = on_error
        self._context: Any = None
        self.limit_bytes: int | None = None
        self.static_bytes = 0
        self.grads_bytes = 0
        self.on_open: Callable[[], None] | None = None
        self.on_exceed: Callable[[int, int, str], None] | None = None
        self._window_of = window_of
        self._open = window_of is None  # inside the step window (always, without a model)
        self._window_hooks: list[Any] = []
        self._parts_called = False  # a window opened at a parameter: hook the children too
        self._thread: int | None = None  # the thread whose saved-tensor hooks these are
        self._closed = False
        self._attempt_ended = False  # an out-of-memory error ended the step (end_attempt)

    @staticmethod
    def _keys(params: Iterable[torch.Tensor]) -> frozenset[int]:
        keys = set()
        for p in params:
            try:
                keys.add(_storage_key(p)[0])
            except Exception:  # a parameter without readable storage cannot be saved by key
                continue
        return frozenset(keys)

    def set_params(self, params: Iterable[torch.Tensor]) -> None:
        """Replace the set of parameter storages to skip (after an action changed the model)."""
        self._param_keys = self._keys(params)

    # ------------------------------------------------------------------ hooks (hot path)
    def pack(self, tensor: torch.Tensor) -> Any:
        """The pack hook: count ``tensor``'s storage while autograd keeps it; never raises for
        the tracker's own failures (only ``on_exceed``'s out-of-memory error propagates)."""
        owner = getattr(_CURRENT, "tracker", None)
        if owner is not None and owner is not self and not owner._closed:
            return owner.pack(tensor)  # saved in the forward of another watch()'s model
        if not self._open:  # outside the watched model's step window: not its memory
            self._open_at_own_parameter(tensor)
            return stamp(tensor)
        try:
            if tensor.layout is _STRIDED:  # inline: the common case, on the hot path
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key in self._param_keys:
                    return stamp(tensor)
                nbytes = storage.nbytes()
            else:
                key, nbytes = _storage_key(tensor)
            if nbytes == 0 or key in self._param_keys or is_parameter(tensor):
                return stamp(tensor)  # (a parameter made since the keys were taken: the last)
            if tensor.requires_grad:
                tensor = tensor.detach()  # no cycle through the output's grad_fn (see above)
            with self._lock:
                if self._released:
                    self._drain()
                refs = self._refs.get(key)
                if refs is not None:
                    self._refs[key] = refs + 1
                    return self._holder(tensor, key)
                limit = self.limit_bytes
                in_use = self.static_bytes + self.grads_bytes + self._live + nbytes
                if limit is None or in_use <= limit or self.on_exceed is None:
                    self._count(key, nbytes)
                    return self._holder(tensor, key)
        except Exception as exc:
            self._failed(exc)
            return stamp(tensor)
        # raises: the allocation failed, nothing was counted
        self.on_exceed(nbytes, in_use, "activations_bytes")
        with self._lock:  # an on_exceed that returns lets the storage be counted
            self._count(key, nbytes)
            return self._holder(tensor, key)

    def add_grad_bytes(self, delta: int, undo: Callable[[], None] | None = None) -> None:
        """Gradients alive grew by ``delta`` bytes (a parameter's gradient accumulated in
        backward; negative: shrank): checked against ``limit_bytes``, then counted in
        :attr:`grads_bytes`. Over the limit, ``undo()`` (taking the gradient back) runs before
        ``on_exceed``.

        The check counts the step's peak of saved bytes (:attr:`step_peak_bytes`), not those
        alive now: the backward frees the saved tensors as it goes, but makes the gradients of
        the activations they were, which no hook sees (the embedding's backward holds the
        gradient of its output, the output's size, while it makes the table's gradient); the
        forward's peak stands in for them until the step boundary.

        Raises:
            Exception: what ``on_exceed`` raises (the CPU-budget out-of-memory error); the bytes
            are then not counted.
        """
        with self._lock:
            if self._released:
                self._drain()
            in_use = self.static_bytes + self.grads_bytes + self._peak_step + delta
            limit = self.limit_bytes
            if delta <= 0 or limit is None or in_use <= limit or self.on_exceed is None:
                self.grads_bytes += delta
                return
        if undo is not None:
            undo()
        self.on_exceed(delta, in_use, "grads_bytes")
        with self._lock:  # an on_exceed that returns lets the bytes be counted
            self.grads_bytes += delta

    def _holder(self, tensor: torch.Tensor, key: int) -> _Saved:
        """A holder of ``tensor`` whose release hands ``key`` back (lock held)."""
        saved = _Saved(tensor)
        ref = weakref.ref(saved, self._released.append)
        self._holders[id(ref)] = (ref, key)
        return saved

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        """The unpack hook: the tensor the pack hook was given (or its detached alias).

        Raises:
            RuntimeError: it was modified in place after it was saved (autograd's check).
        """
        if type(packed) is _Saved:
            return checked(packed.tensor, packed.version)
        return checked(*packed)

    def _count(self, key: int, nbytes: int) -> None:
        """A first holder of ``key``: its bytes become live (lock held)."""
        self._refs[key] = 1
        self._sizes[key] = nbytes
        live = self._live + nbytes
        self._live = live
        if live > self._peak_step:
            self._peak_step = live
        if live > self._peak_sample:
            self._peak_sample = live
        if live > self._peak_run:
            self._peak_run = live

    def _drain(self) -> None:
        """Apply the holders freed since the last call (lock held)."""
        released = self._released
        holders = self._holders
        refs = self._refs
        while released:
            entry = holders.pop(id(released.popleft()), None)
            if entry is None:
                continue
            key = entry[1]
            n = refs.get(key, 1) - 1
            if n > 0:
                refs[key] = n
            else:
                refs.pop(key, None)
                self._live -= self._sizes.pop(key, 0)

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self.on_error is not None:
            with contextlib.suppress(Exception):  # reporting must not fail the forward either
                self.on_error(exc)

    # ------------------------------------------------------------------ readings
    @property
    def live_bytes(self) -> int:
        """Bytes of saved tensors alive now (each storage once, parameters skipped)."""
        with self._lock:
            self._drain()
            return self._live

    @property
    def step_peak_bytes(self) -> int:
        """The highest :attr:`live_bytes` since the last :meth:`end_step`."""
        with self._lock:
            self._drain()
            return self._peak_step

    @property
    def peak_bytes(self) -> int:
        """The highest :attr:`live_bytes` since the tracker was made."""
        return self._peak_run

    def take_peak(self) -> int:
        """The highest :attr:`live_bytes` since the previous call (or since the start); the next
        call starts from the bytes alive now. What one sample reports as ``activations_bytes``."""
        with self._lock:
            self._drain()
            peak = self._peak_sample
            self._peak_sample = self._live
            return peak

    def end_step(self) -> int:
        """Close the current step; returns its peak of live saved bytes (also
        :attr:`last_step_bytes`). The next step's peak starts from the bytes alive now. With a
        watched model, the step window closes until its next forward."""
        with self._lock:
            self._drain()
            peak = self._peak_step
            self._peak_step = self._live
        self.last_step_bytes = peak
        if self._window_of is not None:
            self._open = False  # until the model's next forward
            if self._parts_called and len(self._window_hooks) == 1:
                self._window_hooks += [
                    add_forward_pre_hook(m, self._open_window) for m in self._window_of.children()
                ]
        return peak

    def _open_window(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        _CURRENT.tracker = self  # what is saved from here on is this model's (see _CURRENT)
        if not self._open:
            self._opened()

    def end_attempt(self) -> None:
        """An out-of-memory error ended the step's attempt (its graph is freed as the error
        unwinds): the next forward opens the window afresh (:meth:`_opened`)."""
        if self._window_of is not None:
            self._open = False
        self._attempt_ended = True

    def _opened(self) -> None:
        """The window opens: the step's peak starts from the saved bytes alive now (an attempt
        an out-of-memory error ended does not count), then ``on_open``. Never after
        :meth:`__exit__`."""
        if self._closed:
            return
        with self._lock:
            self._drain()
            self._peak_step = self._live
            if self._attempt_ended:  # its peak was recorded with the error (Sampler.record_oom)
                self._peak_sample = self._live
                self._attempt_ended = False
        self._open = True
        if self.on_open is not None:
            try:
                self.on_open()
            except Exception as exc:  # never fails the user's forward
                self._failed(exc)

    def _open_at_own_parameter(self, tensor: torch.Tensor) -> None:
        """A closed window opens when one of the model's parameters is saved: its computation
        began without a forward of the model (or of a hooked child); the parameter itself is not
        counted. The step boundary then hooks the children (:meth:`end_step`)."""
        try:
            if tensor.layout is _STRIDED and tensor.untyped_storage().data_ptr() in (
                self._param_keys
            ):
                self._parts_called = True
                _CURRENT.tracker = self
                self._opened()
        except Exception as exc:
            self._failed(exc)

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> ActivationTracker:
        self._context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._context.__enter__()
        register_hooks(self.pack)  # torch.func's transforms take them off while they run
        self._thread = threading.get_ident()
        if self._window_of is not None:
            # not torch's own hook: a copy of the model (deepcopy, torch.save) would copy the
            # tracker behind a bound method, and fail on its lock
            self._window_hooks = [add_forward_pre_hook(self._window_of, self._open_window)]
        return self

    def __exit__(self, *exc: object) -> None:
        """Pop the hooks (on the thread that pushed them: PyTorch's saved-tensor hooks are the
        thread's own; left on it when exited from another, where they count nothing more)."""
        self._closed, self._open = True, False
        if self._context is not None:
            if threading.get_ident() == self._thread:
                self._context.__exit__(None, None, None)
            self._context = None
            unregister_hooks(self.pack)
        for hook in self._window_hooks:
            hook.remove()
        self._window_hooks = []
        if getattr(_CURRENT, "tracker", None) is self:
            _CURRENT.tracker = None
        self._window_of = None  # the model is the user's again (freed when they drop it)
