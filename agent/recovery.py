"""Out-of-memory recovery inside a training step: :meth:`Monitor.run_step`.

The contract (what a PyTorch user writes anyway, minus the ``backward``)::

    loss = monitor.run_step(lambda mb: loss_fn(model(mb[0]), mb[1]), (x, y), optimizer=opt)

``step_fn(micro_batch) -> loss`` runs the forward of one (micro-)batch and returns its loss, a
scalar tensor that is the **mean** over the micro-batch's rows (``reduction="sum"``: the sum).
:class:`StepRecovery` computes the gradients of the whole batch from zero: for each micro-batch it
calls ``(loss * rows_i / rows).backward()`` (mean) or ``loss.backward()`` (sum), so the
accumulated gradients are those of the unsplit batch up to float reassociation; with
``optimizer`` it then runs ``optimizer.step()`` and ``optimizer.zero_grad()``. It returns the whole
batch's loss (detached).

On a ``torch.OutOfMemoryError`` during forward or backward (a real CUDA one, or
:class:`edo_monitor.BudgetOutOfMemoryError` in CPU-budget mode with ``enforce=True``):

1. everything the failed attempt held is released: the frames of the exception's traceback (and
   of its ``__context__``/``__cause__`` chain) are cleared and the traceback dropped (those frames
   keep the forward's activations alive), the partial gradients are set to ``None``, a garbage
   collection runs and, on CUDA, the allocator's cache is emptied;
2. the monitor's safe point runs without counting a step (pressure hooks, then a pending policy
   action is applied), so an action may free memory before the retry;
3. the micro-batch is halved (rows, rounded up) and the step retried. The split is kept for the
   next steps; after ``merge_after_steps`` clean steps it tries micro-batches twice as large (a
   merge that runs out of memory is split again and the next try waits twice as long);
4. at the floor (micro-batches of ``min_micro_batch_rows`` rows, default 1) it gives up and raises
   the step's *first* out-of-memory error (its traceback was cleared; a note says how far the
   recovery went).

Only forward and backward are retried: an out-of-memory error from ``optimizer.step()`` (the
CPU-budget check at the step boundary, or Adam's first state) propagates, because that step has
run. Events: ``oom`` (each failure, as without recovery), ``oom_recovered`` (the step succeeded
after splitting: the batch rows, micro-batch rows, micro-batches, failed attempts, seconds lost),
``micro_batches_merged`` (a merge held), ``oom_unrecovered`` (gave up at the floor).

Batches: a tensor (split on dim 0), or tuples, lists (named tuples included) and dicts of them,
nested; other leaves are passed whole to every micro-batch. Every tensor must have the same size
on dim 0.

Batch statistics: a failed attempt's forward updated the batch-norm layers' running statistics
(``BatchNorm*``, ``InstanceNorm*`` with ``track_running_stats``): they are put back before the
retry (a copy of them is taken before each step; they are small). Split, each micro-batch is
normalised with its own statistics and updates the running ones once (``num_batches_tracked``
grows by the number of micro-batches): for such a model the update is not the whole batch's, and
a warning says so once. Dropout draws other masks for a retried step, as for any other step.

DDP: when the watched model has ``no_sync`` (``DistributedDataParallel``), every micro-batch but
the last runs inside it, so gradients are all-reduced once per step. Each rank splits on its own:
a rank that splits while another does not would call ``backward`` a different number of times;
DDP's all-reduce happens only on the last micro-batch, so this stays correct as long as every rank
reaches that last ``backward`` (it does), but the ranks' step times differ. An out-of-memory error
inside a synced ``backward`` leaves DDP's reducer waiting for the gradients that never came (the
next forward raised "Expected to have finished reduction in the prior iteration"): before the
retry its state is reset (``reducer._reset_state()``, what DDP's own ``_update_process_group``
calls). With several ranks, one that fails inside a synced ``backward`` leaves the others in that
step's all-reduce: only an error in the forward or an unsynced ``backward`` is safe there.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.batchnorm import _NormBase

from edo_monitor.checks import whole_number
from edo_monitor.errors import ConfigError

if TYPE_CHECKING:
    from edo_monitor.agent.state import MonitorState

__all__ = ["StepRecovery", "batch_rows", "split_batch"]

logger = logging.getLogger(__name__)

DEFAULT_MERGE_AFTER_STEPS = 50


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _tensors(v)]
    return []


def batch_rows(batch: Any) -> int:
    """The number of rows (size on dim 0) of ``batch``'s tensors.

    Raises:
        ConfigError: no tensor in the batch, a tensor without dim 0, or tensors whose dim 0
            sizes differ (the message names them).
    """
    tensors = _tensors(batch)
    if not tensors:
        raise ConfigError(
            f"batch of type {type(batch).__name__} holds no tensor; expected a tensor or "
            "tuples/lists/dicts of tensors split on dim 0"
        )
    if any(t.dim() == 0 for t in tensors):
        raise ConfigError("batch holds a 0-dim tensor; every tensor needs a dim 0 to split on")
    sizes = sorted({int(t.shape[0]) for t in tensors})
    if len(sizes) > 1:
        raise ConfigError(f"batch tensors have different sizes on dim 0: {sizes}; expected one")
    return sizes[0]


def _split(batch: Any, rows: int, n: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, rows, dim=0))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, rows, n) for k, v in batch.items()}
        return [_like(batch, {k: p[i] for k, p in parts.items()}) for i in range(n)]
    if isinstance(batch, (tuple, list)):
        columns = [_split(v, rows, n) for v in batch]
        out = [[c[i] for c in columns] for i in range(n)]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
            return [type(batch)(*o) for o in out]
        return [_like(batch, o) for o in out]
    return [batch] * n  # not a tensor: every micro-batch gets it whole


def _like(batch: Any, items: Any) -> Any:
    """A container of ``batch``'s type holding ``items`` (a dict or a list): its type called
    with them, or, when that type takes other arguments (``defaultdict(factory, ...)``), a copy
    of ``batch`` refilled (its factory kept), else the plain ``dict`` / ``list`` / ``tuple``."""
    try:
        return type(batch)(items)
    except TypeError:
        pass
    if isinstance(batch, (dict, list)):
        new = copy.copy(batch)
        new.clear()
        if isinstance(new, dict):
            new.update(items)
        else:
            new.extend(items)
        return new
    return tuple(items) if isinstance(batch, tuple) else type(items)(items)


def split_batch(batch: Any, micro_batch_rows: int) -> list[Any]:
    """``batch`` cut into micro-batches of ``micro_batch_rows`` rows (the last one may be
    smaller), as views (no copy); same structure as ``batch``.

    Raises:
        ConfigError: see :func:`batch_rows`; ``micro_batch_rows`` < 1.
    """
    if micro_batch_rows < 1:
        raise ConfigError(f"micro_batch_rows={micro_batch_rows!r} must be >= 1")
    rows = batch_rows(batch)
    return _split(batch, micro_batch_rows, math.ceil(rows / micro_batch_rows))


def _release(exc: BaseException) -> None:
    """Clear the frames of ``exc``'s traceback and of its chained exceptions; drop the
    tracebacks. A frame still running (the caller's) cannot be cleared and is skipped."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        todo += [e.__context__, e.__cause__]


def _check_loss(loss: Any) -> None:
    """``step_fn``'s result must be a one-element tensor (what ``backward()`` takes).

    Raises:
        ConfigError: anything else, named with its type (and shape, for a tensor).
    """
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"step_fn returned {loss!r:.80} ({type(loss).__name__}); expected the micro-batch's "
            "loss, a scalar tensor"
        )
    if loss.numel() != 1:
        raise ConfigError(
            f"step_fn returned a tensor of shape {list(loss.shape)}; expected the micro-batch's "
            "loss, a scalar tensor (reduce it with .mean() or .sum())"
        )


class StepRecovery:
    """The split state of one monitor's :meth:`Monitor.run_step` (see the module docstring).

    Attributes:
        micro_batch_rows: rows per micro-batch now (``None``: the whole batch).
        min_micro_batch_rows: the floor; below it the recovery gives up.
        merge_after_steps: clean steps before trying micro-batches twice as large.
        recoveries: steps recovered so far.
    """

    def __init__(
        self,
        monitor: MonitorState,
        *,
        min_micro_batch_rows: int = 1,
        merge_after_steps: int = DEFAULT_MERGE_AFTER_STEPS,
    ) -> None:
        self.monitor = monitor
        self.micro_batch_rows: int | None = None
        self.min_micro_batch_rows = 1
        self.merge_after_steps = DEFAULT_MERGE_AFTER_STEPS
        self._merge_wait_steps = DEFAULT_MERGE_AFTER_STEPS
        self.configure(min_micro_batch_rows, merge_after_steps)
        self._clean_steps = 0
        self.recoveries = 0
        self._warned_batch_statistics = False

    def configure(self, min_micro_batch_rows: int | None, merge_after_steps: int | None) -> None:
        """Set the floor and the merge interval (``None`` keeps the current value).

        Raises:
            ConfigError: a value that is not an int >= 1.
        """
        for name, value in (
            ("min_micro_batch_rows", min_micro_batch_rows),
            ("merge_after_steps", merge_after_steps),
        ):
            if value is None:
                continue
            value = whole_number(value, name, 1, error=ConfigError)
            if name == "merge_after_steps" and value != self.merge_after_steps:
                self._merge_wait_steps = value  # a new interval; an unchanged one keeps backing off
            setattr(self, name, value)

    # ------------------------------------------------------------------ one step
    def run(
        self,
        step_fn: Callable[[Any], torch.Tensor],
        batch: Any,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """One training step with recovery; returns the whole batch's loss (detached).

        An empty batch (0 rows) is run as it is: ``step_fn`` called once on it, its loss not
        scaled (what the caller's own loop would do).

        Raises:
            ConfigError: bad ``step_fn``, ``optimizer``, ``reduction`` or batch (see
                :func:`batch_rows`), checked before any work; ``step_fn`` returned something
                other than a one-element tensor (names what it returned).
            torch.OutOfMemoryError: the step's first one, when even micro-batches of
                ``min_micro_batch_rows`` rows run out of memory; or one from ``optimizer.step()``.
        """
        if not callable(step_fn):
            raise ConfigError(
                f"step_fn={step_fn!r} is not callable; expected a function micro_batch -> loss "
                "(a scalar tensor)"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer={optimizer!r} is not a torch.optim.Optimizer (or None: the caller "
                "steps)"
            )
        if reduction not in ("mean", "sum"):
            raise ConfigError(f"reduction={reduction!r}; expected 'mean' or 'sum'")
        rows = batch_rows(batch)
        micro = rows if self.micro_batch_rows is None else min(self.micro_batch_rows, rows)
        merging = False
        if micro < rows and self._clean_steps >= self._merge_wait_steps:
            micro, merging = min(rows, micro * 2), True
        first: BaseException | None = None
        failed_attempts = 0
        lost_s = 0.0
        attempts: list[int] = []
        stats = _running_stats(self.monitor.model)
        while True:
            attempts.append(micro)
            t0 = time.perf_counter()
            self._zero_grads(optimizer)
            if micro < rows:
                self._warn_batch_statistics(stats)
            try:
                loss = self._accumulate(step_fn, batch, rows, micro, reduction)
                break
            except torch.OutOfMemoryError as exc:
                _restore(stats)  # the failed attempt's forward counted for nothing
                if not getattr(exc, "_edo_recorded", False):
                    self.monitor._record_oom(exc)
                    exc._edo_recorded = True  # type: ignore[attr-defined]
                _release(exc)
                if first is None:
                    first = exc
                del exc
            self._zero_grads(optimizer)
            _reset_reducer(self.monitor.model)
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            lost_s += time.perf_counter() - t0
            failed_attempts += 1
            if micro <= self.min_micro_batch_rows:
                self._give_up(first, rows, micro, attempts)
            self.monitor._recovery_point()
            micro = max(self.min_micro_batch_rows, math.ceil(micro / 2))
        self._after_success(rows, micro, merging, failed_attempts, lost_s, attempts, first)
        first = None
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss

    def _accumulate(
        self,
        step_fn: Callable[[Any], torch.Tensor],
        batch: Any,
        rows: int,
        micro: int,
        reduction: str,
    ) -> torch.Tensor:
        parts = [batch] if micro >= rows else split_batch(batch, micro)
        no_sync = getattr(self.monitor.model, "no_sync", None)
        total: torch.Tensor | None = None
        for i, part in enumerate(parts):
            # the whole batch (an empty one included): its loss as it is
            whole = reduction == "sum" or len(parts) == 1
            scale = 1.0 if whole else batch_rows(part) / rows
            sync_off = no_sync() if no_sync is not None and i < len(parts) - 1 else None
            with sync_off if sync_off is not None else contextlib.nullcontext():
                loss = step_fn(part)
                _check_loss(loss)
                (loss * scale if scale != 1.0 else loss).backward()
            value = loss.detach() * scale
            total = value if total is None else total + value
            del loss
        assert total is not None
        return total

    def _warn_batch_statistics(self, stats: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Once per run: a split model normalises by batch statistics (see the module
        docstring)."""
        if stats and not self._warned_batch_statistics:
            self._warned_batch_statistics = True
            logger.warning(
                "edo-monitor run_step: the model has batch-norm layers in training mode; "
                "split into micro-batches, each normalises with its own statistics and updates "
                "the running ones once, so the update differs from the whole batch's"
            )

    def _zero_grads(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Set to ``None`` the gradients of every parameter the step trains: the model's, and
        those of ``optimizer`` and of the run's optimizers (a loss temperature, a head outside
        the watched model: a failed attempt's partial gradient of one was added to by the
        retry, which doubled it)."""
        model = self.monitor.model
        groups = [model.parameters()] if model is not None else []
        for opt in (optimizer, *self.monitor.optimizers):
            if opt is not None:
                groups.extend(g["params"] for g in opt.param_groups)
        for params in groups:
            for p in params:
                p.grad = None

    def _after_success(
        self,
        rows: int,
        micro: int,
        merging: bool,
        failed_attempts: int,
        lost_s: float,
        attempts: list[int],
        first: BaseException | None,
    ) -> None:
        if failed_attempts == 0:
            if merging:
                self.monitor._emit(
                    "micro_batches_merged",
                    f"micro-batches merged to {micro} of {rows} rows",
                    {"batch_rows": rows, "micro_batch_rows": micro},
                )
                self.micro_batch_rows = None if micro >= rows else micro
                self._merge_wait_steps = self.merge_after_steps
            self._clean_steps += 1
            return
        self.recoveries += 1
        self.micro_batch_rows = micro
        self._clean_steps = 0
        if merging:  # the merge did not fit: wait twice as long before the next try
            self._merge_wait_steps *= 2
        n = math.ceil(rows / micro)
        logger.info("edo-monitor: out of memory; step recovered with %d x %d rows", n, micro)
        self.monitor._emit(
            "oom_recovered",
            f"out of memory; step recovered with {n} micro-batches of {micro} rows "
            f"(batch {rows} rows, {failed_attempts} failed attempt(s))",
            {
                "batch_rows": rows,
                "micro_batch_rows": micro,
                "micro_batches": n,
                "failed_attempts": failed_attempts,
                "attempted_micro_batch_rows": attempts,
                "lost_s": lost_s,
                "merge_attempt": merging,
                "exception": type(first).__name__,
                "error": str(first).splitlines()[0][:300] if first is not None else None,
            },
        )

    def _give_up(
        self, first: BaseException | None, rows: int, micro: int, attempts: list[int]
    ) -> None:
        assert first is not None
        self.monitor._emit(
            "oom_unrecovered",
            f"out of memory even with micro-batches of {micro} rows (the floor); gave up",
            {
                "batch_rows": rows,
                "micro_batch_rows": micro,
                "min_micro_batch_rows": self.min_micro_batch_rows,
                "attempted_micro_batch_rows": attempts,
            },
        )
        first.add_note(
            f"edo-monitor run_step: still out of memory with micro-batches of {micro} rows "
            f"(floor {self.min_micro_batch_rows}; tried {attempts}); the recovery gave up"
        )
        raise first


def _reset_reducer(model: Any) -> None:
    """A DDP model's reducer back to "no backward under way" after a failed attempt (see the
    module docstring); nothing for other models, or a torch without the call."""
    reset = getattr(getattr(model, "reducer", None), "_reset_state", None)
    if callable(reset):
        reset()


def _running_stats(model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(buffer, copy)`` of the running statistics a forward in training mode updates
    (``BatchNorm*``, ``InstanceNorm*`` with ``track_running_stats``, ``SyncBatchNorm``)."""
    if not isinstance(model, torch.nn.Module):
        return []
    out = []
    for module in model.modules():
        if isinstance(module, _NormBase) and module.training and module.track_running_stats:
            for buffer in (module.running_mean, module.running_var, module.num_batches_tracked):
                if buffer is not None:
                    out.append((buffer, buffer.detach().clone()))
    return out


def _restore(stats: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put the running statistics back as they were before the attempt."""
    with torch.no_grad():
        for buffer, copy in stats:
            buffer.copy_(copy)
