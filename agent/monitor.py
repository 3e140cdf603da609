"""The in-process agent: :func:`watch` and the :class:`Monitor` it yields.

``Monitor`` is the facade: it checks the arguments, owns the run's parts and starts and stops
them in order. The parts, one job a module (``docs/architecture.md``, "Data path"):

* :mod:`~edo_monitor.agent.run`: the run's row, engine and writer thread (:class:`RunRecord`),
  the summary (:class:`RunSummary`), the registry of watched models;
* :mod:`~edo_monitor.agent.device`: the device, its probes and budget (:class:`Device`);
* :mod:`~edo_monitor.agent.events`: events and failures inside the agent (:class:`EventLog`);
* :mod:`~edo_monitor.agent.sampler`: the **sampler thread**, probes -> :class:`Reading`
  (:class:`Sampler`), and :mod:`~edo_monitor.agent.module_rows` (:class:`ModuleRows`);
* :mod:`~edo_monitor.agent.safe_point`: the step boundary on the **training thread**, the only
  place the model or optimizer changes (:class:`SafePoint`);
* :mod:`~edo_monitor.agent.tuner`: readings -> policy -> decisions -> actions (:class:`Tuner`);
* :mod:`~edo_monitor.agent.oom_capture`: out-of-memory errors as ``oom`` events;
* :mod:`~edo_monitor.agent.recovery`: ``run_step``'s recovery by splitting the batch.

The **writer thread** (:class:`edo_monitor.store.writer.Writer`) drains a bounded queue into the
history database. Nothing in the training thread waits on the database.

A failure inside the agent never fails the training: it is logged once, recorded as an
``agent_error`` event, and the agent goes on (``strict=True`` re-raises it, for tests).
"""

from __future__ import annotations

import logging
import os
import threading
import unicodedata
import uuid as uuidlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from edo_monitor.actions.activation_profile import ActivationProfile
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.agent.device import Device
from edo_monitor.agent.events import EventLog
from edo_monitor.agent.lifecycle import _Lifecycle
from edo_monitor.agent.module_rows import ModuleRows
from edo_monitor.agent.oom_capture import record_oom
from edo_monitor.agent.ranks import (
    DEFAULT_SYNC_EVERY_STEPS,
    Coordinator,
    RankInfo,
)
from edo_monitor.agent.recovery import StepRecovery
from edo_monitor.agent.run import RunRecord, RunSummary, claim_model, release_model
from edo_monitor.agent.safe_point import SafePoint
from edo_monitor.agent.sampler import Sampler
from edo_monitor.agent.snapshots import DEFAULT_CAP_BYTES, SnapshotRecorder
from edo_monitor.agent.tuner import Tuner
from edo_monitor.checks import seconds, storable_config, whole_number
from edo_monitor.decide.policy import Policy
from edo_monitor.errors import ConfigError
from edo_monitor.exporters.prometheus import (
    DEFAULT_METRICS_HOST,
    MetricsServer,
    check_metrics_host,
    usable_metrics_port,
)
from edo_monitor.measure.accounting import Accounting, account
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.measure.module_hooks import uncompiled
from edo_monitor.probes.readings import Reading
from edo_monitor.store.paths import check_writable, resolve_db_url
from edo_monitor.store.schema import RUN_NAME_MAX_CHARS
from edo_monitor.store.spill_files import resolve_spill_dir
from edo_monitor.units import STORABLE_BYTES, parse_bytes

if TYPE_CHECKING:
    from edo_monitor.exporters.tensorboard import TensorBoardSink

__all__ = ["DEFAULT_INTERVAL_S", "Monitor", "RunSummary"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.5


class Monitor(_Lifecycle):
    """A watched training run. Create it with :func:`watch`; use it as a context manager.

    Attributes (read-only while the block runs):
        run_id: ``runs.id`` of this run in the history database.
        run_uuid: the run's UUID.
        latest: the last :class:`Reading` (``None`` before the first sample).
        steps: step count so far.
        status: ``"created"``, ``"running"``, then ``"finished"`` / ``"failed"`` /
            ``"interrupted"``.
        device_kind: ``"cuda"`` or ``"cpu-budget"``. device_index: the CUDA device (or ``None``).
        budget_bytes: the capacity the policy measures against (``None`` without a budget on a
            CPU).
        accounting: the accounting of the latest reading. activation_profile: the last
            per-module activation profile (``None`` before one).
        optimizers: optimizers found (or given) that step the model's parameters, those still
            alive (held weakly).
        metrics_server: the Prometheus endpoint (``.url``, ``.port``) while the block runs with
            ``metrics_port``; ``None`` otherwise.

    The parts, each a plain object the monitor owns (``agent/``): the run's record and writer
    (:class:`RunRecord`, ``run.py``), the device and its probes (:class:`Device`,
    ``device.py``), the events and agent errors (:class:`EventLog`, ``events.py``), the
    sampler thread (:class:`Sampler`, ``sampler.py``), the module rows (:class:`ModuleRows`,
    ``module_rows.py``), the step boundary (:class:`SafePoint`, ``safe_point.py``), the policy's
    bridge to the actions (:class:`Tuner`, ``tuner.py``) and OOM capture (``oom_capture.py``).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        db: str | os.PathLike[str] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        budget: int | str | None = None,
        run_name: str | None = None,
        tags: Iterable[str] | None = None,
        strict: bool = False,
        policy: Any = None,
        enforce: bool = False,
        track_activations: bool = True,
        snapshot_interval_s: float = 5.0,
        queue_size: int = 10_000,
        config: Mapping[str, Any] | None = None,
        profile_interval_s: float = 30.0,
        metrics_port: int | None = None,
        metrics_host: str = DEFAULT_METRICS_HOST,
        tensorboard: Any = None,
        sync_every_steps: int = DEFAULT_SYNC_EVERY_STEPS,
        snapshots: bool | None = None,
        snapshot_cap: int | str = DEFAULT_CAP_BYTES,
        loader: Iterable[Any] | None = None,
        ahead: int = 8,
        loader_ids: Callable[[Any], Any] | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ConfigError(f"model={type(model).__name__} is not a torch.nn.Module (or None)")
        model = uncompiled(model)  # torch.compile(model): its modules are the model's
        interval_s = seconds(interval_s, "interval_s", error=ConfigError)
        snapshot_interval_s = seconds(
            snapshot_interval_s, "snapshot_interval_s", zero="never", error=ConfigError
        )
        profile_interval_s = seconds(profile_interval_s, "profile_interval_s", error=ConfigError)
        queue_size = whole_number(queue_size, "queue_size", 1, error=ConfigError)
        allowed = "a torch.optim.Optimizer, an iterable of them, or None (found by its steps)"
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            optimizers = [] if optimizer is None else [optimizer]
        elif isinstance(optimizer, Iterable) and not isinstance(optimizer, (str, bytes, Mapping)):
            optimizers = list(optimizer)  # read once (a generator too) and kept
        else:  # 5, "adam", {"enc": opt}: a ConfigError naming it, not a TypeError from list()
            raise ConfigError(f"optimizer={optimizer!r} is not {allowed}")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(
                    f"optimizer holds {opt!r} ({type(opt).__name__}); expected {allowed}"
                )
        optimizers = list(dict.fromkeys(optimizers))  # one optimizer given twice is one
        if policy is not None and not isinstance(policy, Policy):
            raise ConfigError(f"policy={policy!r} is not an edo_monitor.Policy (or None)")
        for name, flag in (
            ("strict", strict),
            ("enforce", enforce),
            ("track_activations", track_activations),
        ):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name}={flag!r}; expected True or False")
        if run_name is not None and (not isinstance(run_name, str) or not run_name.strip()):
            raise ConfigError(
                f"run_name={run_name!r}; expected a non-empty string (or None: the model's)"
            )
        if run_name is not None and len(run_name) > RUN_NAME_MAX_CHARS:
            # PostgreSQL refused the row ("value too long"); SQLite took it: refused alike
            raise ConfigError(
                f"run_name is {len(run_name)} characters ({run_name[:40]!r}...); expected at "
                f"most {RUN_NAME_MAX_CHARS}"
            )
        if enforce and budget is None:
            raise ConfigError("enforce=True needs a budget= to enforce")
        # checked with or without a loader: a value that would fail with one is refused now
        ahead = whole_number(ahead, "ahead", 1, error=ConfigError)
        sync_every_steps = whole_number(sync_every_steps, "sync_every_steps", 1, error=ConfigError)
        if snapshots not in (None, True, False):
            raise ConfigError(f"snapshots={snapshots!r} must be None (auto), True or False")
        #: ``watch(snapshots=)``: None = at incidents, no allocator history; True = with it
        self.snapshots = snapshots
        self.snapshot_cap_bytes = parse_bytes(snapshot_cap, name="snapshot_cap")
        #: steps between the ranks' agreements on a decision (multi-rank jobs)
        self.sync_every_steps = sync_every_steps
        #: base port of the Prometheus endpoint (+ LOCAL_RANK), ``None`` = no endpoint
        self.metrics_port = usable_metrics_port(metrics_port)
        self.metrics_host = check_metrics_host(metrics_host)  # before the run row is written
        self.metrics_server: MetricsServer | None = None
        self.model = model
        #: ``watch(loader=)`` wrapped in :class:`edo_monitor.nn.LookAhead` (iterate it instead of
        #: the loader); ``None`` without a loader
        self.loader: Any = None
        if loader is None and loader_ids is not None:
            raise ConfigError(
                f"loader_ids={loader_ids!r} without loader=; it says which ids a loader's batch "
                "looks up"
            )
        if loader is not None:
            from edo_monitor.nn.lookahead import LookAhead

            # iterable by __iter__, or as a sequence by __getitem__ (as iter() takes it)
            if not isinstance(loader, Iterable) and not hasattr(type(loader), "__getitem__"):
                raise ConfigError(
                    f"loader={loader!r}; expected an iterable of batches (a DataLoader, a list, "
                    "a generator)"
                )
            if loader_ids is not None and not callable(loader_ids):
                raise ConfigError(
                    f"loader_ids={loader_ids!r}; expected a function batch -> ids tensor (or "
                    "mapping)"
                )
            try:
                # an ids error never fails training: a warning, and no look-ahead for that batch
                self.loader = LookAhead(loader, ahead, loader_ids, tables=model, ids_errors="warn")
            except ValueError as e:  # LookAhead's ahead=: watch() names it the same
                raise ConfigError(str(e)) from None
        # held weakly: an optimizer the training dropped (a second phase's new one in its
        # place) is freed with its state, and no longer counted
        self._optimizer_refs = [weakref.ref(o) for o in optimizers]
        self.interval_s = float(interval_s)
        self.budget_bytes_requested = (
            None if budget is None else parse_bytes(budget, name="budget", positive=True)
        )
        if self.budget_bytes_requested is not None and self.budget_bytes_requested > STORABLE_BYTES:
            raise ConfigError(
                f"budget={budget!r} is {self.budget_bytes_requested} bytes; expected less than "
                "2**63 bytes (8 EiB), the largest size the history stores"
            )
        self.db_url = resolve_db_url(db)
        check_writable(self.db_url)  # in-memory URL: ConfigError; read-only file: StoreError
        #: the disk tier's folder (``spill_embedding``'s file; edo_monitor.nn.spill)
        self.spill_dir = resolve_spill_dir(spill_dir, self.db_url)
        self.run_name = run_name or (type(model).__name__ if model is not None else "process")
        if tags is not None and not isinstance(tags, (str, Iterable)):
            raise ConfigError(
                f"tags={tags!r}: expected a string (one tag), an iterable of strings, or None"
            )
        self.tags = [tags] if isinstance(tags, str) else [str(t) for t in (tags or [])]
        for what, text in (("run_name", run_name or ""), *(("tags", t) for t in self.tags)):
            # a terminal escape in a stored name would reach every reader's terminal
            if any(unicodedata.category(ch) == "Cc" for ch in text):
                raise ConfigError(
                    f"{what} {text!r} holds a control character; expected printable text"
                )
            if any(unicodedata.category(ch) == "Cs" for ch in text):  # no UTF-8 for the row
                raise ConfigError(f"{what} {text!r} holds a lone surrogate; expected valid text")
        self.strict = strict
        self.policy = policy
        self.enforce = enforce
        self.track_activations = track_activations and model is not None
        #: a TorchScript module takes no module hooks: no step windows, no activation profiles
        self.scripted = isinstance(model, torch.jit.ScriptModule)
        if self.scripted:
            logger.warning(
                "edo-monitor: the model is a TorchScript module, which takes no module hooks: "
                "per-module activation profiles are off, and so are the table actions and "
                "checkpointing that need one; watch the module before torch.jit.script for them"
            )
        self.snapshot_interval_s = snapshot_interval_s
        self.queue_size = queue_size
        self.profile_interval_s = profile_interval_s
        self.user_config = storable_config(config, "config", error=ConfigError)

        self.run_uuid: str = str(uuidlib.uuid4())
        self.latest: Reading | None = None
        self.steps = 0
        self.status = "created"
        self.accounting = Accounting()
        #: the last per-module activation profile (``ActivationProfile``), ``None`` before one
        self.activation_profile: ActivationProfile | None = None
        #: the run's place in a multi-rank job (decided on entering; ``None``: no process group)
        self.ranks: RankInfo | None = None
        #: the ranks' agreement (a multi-rank job with a policy), made on entering
        self._coordinator: Coordinator | None = None

        self._pid = os.getpid()
        self._stop = threading.Event()  # set when the run ends: hooks and sampler stand down
        self._entered = False
        self._tracker: ActivationTracker | None = None
        #: lookups per id of the model's tables (hot ids for share_embedding, history events)
        self._lookups: LookupCounter | None = None
        self._restore_sigterm: Callable[[], None] = lambda: None
        self._recovery: StepRecovery | None = None  # run_step's split state, made on first use
        # the parts (module docstring); each holds a reference back to this facade
        self._log = EventLog(lambda: self.steps, strict=strict)
        self._run = RunRecord(self.db_url, self.run_uuid, queue_size=queue_size)
        self._device = Device(
            self.budget_bytes_requested,
            snapshot_interval_s=snapshot_interval_s,
            on_event=self._emit,
        )
        self._module_rows = ModuleRows(model, lambda: self.steps)
        self._sampler = Sampler(self)
        self._safe_point = SafePoint(self)
        self._tuner = Tuner(self)
        self._snapshots: SnapshotRecorder | None = None
        if snapshots is not False:
            self._snapshots = SnapshotRecorder(
                self, history=snapshots is True, cap_bytes=self.snapshot_cap_bytes
            )
        #: readings as TensorBoard scalars, events as text (``tensorboard=``); ConfigError here
        #: for a bad value or without the package, the writer opened on entering
        self._tensorboard: TensorBoardSink | None = None
        if tensorboard is not None:
            from edo_monitor.exporters.tensorboard import TensorBoardSink

            self._tensorboard = TensorBoardSink(
                tensorboard, on_error=lambda exc: self._agent_error("tensorboard", exc)
            )
            self._log.tensorboard = self._tensorboard

    # ------------------------------------------------------------------ the parts' numbers
    @property
    def run_id(self) -> int:
        """``runs.id`` of this run (``-1`` before it is recorded)."""
        return self._run.run_id

    @property
    def device_kind(self) -> str:
        """``"cuda"`` or ``"cpu-budget"`` (decided on entering)."""
        return self._device.kind

    @property
    def device_index(self) -> int | None:
        """The watched CUDA device's index (``None`` in CPU-budget mode)."""
        return self._device.index

    @property
    def budget_bytes(self) -> int | None:
        """The capacity the policy measures against: ``min(device total, budget=)`` on CUDA,
        ``budget=`` on a CPU (``None``: no budget on a CPU)."""
        return self._device.budget_bytes

    @property
    def job_id(self) -> str | None:
        """The multi-rank job's id, shared by its ranks (``None``: no process group)."""
        return self.ranks.job_id if self.ranks is not None else None

    @property
    def rank(self) -> int | None:
        """This process's rank in the job (``torch.distributed.get_rank()``), else ``None``."""
        return self.ranks.rank if self.ranks is not None else None

    @property
    def world_size(self) -> int | None:
        """The job's number of ranks (``get_world_size()``), else ``None``."""
        return self.ranks.world_size if self.ranks is not None else None

    @property
    def local_rank(self) -> int | None:
        """The rank among the job's ranks on this host (``LOCAL_RANK``), else ``None``."""
        return self.ranks.local_rank if self.ranks is not None else None

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Monitor:
        if self._entered:
            raise RuntimeError("a Monitor can be entered once; call watch() again for a new run")
        self._entered = True
        claim_model(self.model)
        try:
            self._start()
        except BaseException as exc:
            self._abort_start(exc)  # a run row already written records the failure
            release_model(self.model)
            self._let_go()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if os.getpid() != self._pid:
            # a forked child leaving the block (its exception, its sys.exit): the run, its
            # threads and its file are the parent's, still training; the child's copy of the
            # model is free to watch again
            release_model(self.model)
            return
        try:
            self._finish(exc)
        finally:
            release_model(self.model)
            self._let_go()
        if exc is None and self.strict and self._log.pending_error is not None:
            raise self._log.pending_error

    def _let_go(self) -> None:
        """Forget the user's model once the run has ended: a monitor kept for its summary (a
        notebook's ``mon``) held the model, and with it its device memory, after ``del model``.
        What the run measured stays (``summary()``, ``breakdown()``, ``accounting``)."""
        self.model = None
        self._module_rows.model = None

    def start(self) -> Monitor:
        """Start the run without a ``with`` block (what entering it does); end it with
        :meth:`stop`. For frameworks that call back at the start and end of training
        (:mod:`edo_monitor.integrations`).

        Returns:
            This monitor.

        Raises:
            RuntimeError: it was started (or entered) before.
            AlreadyWatchedError, StoreError: as entering does.
        """
        return self.__enter__()

    def stop(self, exc: BaseException | None = None) -> None:
        """End the run started by :meth:`start` (or by entering), as leaving the ``with`` block
        does: ``exc=None`` or a clean ``SystemExit`` records it ``finished``; an exception records
        it ``failed`` with that error (``KeyboardInterrupt``, SIGTERM: ``interrupted``; an OOM
        also as an ``oom`` event; see :func:`watch`). ``exc`` is not raised. A no-op when the run
        is not running (never started, or stopped already), so a framework's several end hooks
        may each call it.

        Raises:
            Exception: with ``strict=True``, a failure inside the agent held back until now, as
                leaving the block raises it.
        """
        if not self._entered or self.status != "running":
            return
        self.__exit__(
            None if exc is None else type(exc),
            exc,
            None if exc is None else exc.__traceback__,
        )

    # ------------------------------------------------------------------ shared helpers
    def _emit(
        self,
        kind: str,
        message: str,
        data: Mapping[str, Any] | None = None,
        time_s: float | None = None,
        step: int | None = None,
    ) -> None:
        """Record an event (any thread; never blocks): :meth:`EventLog.emit`."""
        self._log.emit(kind, message, data, time_s, step)

    def _agent_error(self, where: str, exc: BaseException) -> None:
        """Count a failure inside the agent (any thread; never raises):
        :meth:`EventLog.agent_error`."""
        self._log.agent_error(where, exc)

    def _record_oom(self, exc: BaseException) -> None:
        """Record an ``oom`` event for an out-of-memory error (the error is re-raised as is)."""
        record_oom(self, exc)

    def _recovery_point(self) -> None:
        """Between a failed attempt of :meth:`run_step` and its retry (never raises):
        :meth:`SafePoint.recovery_point`."""
        self._safe_point.recovery_point()

    def _model_tensors(self) -> list[torch.Tensor]:
        """Parameters and buffers: counted as ``params_bytes``, so never as activations."""
        if self.model is None:
            return []
        return [*self.model.parameters(), *self.model.buffers()]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers found (or given) that step the model, those still alive."""
        return [o for r in self._optimizer_refs if (o := r()) is not None]

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer`` among :attr:`optimizers` (held weakly; once)."""
        if all(o is not optimizer for o in self.optimizers):
            self._optimizer_refs.append(weakref.ref(optimizer))

    def _account(self, *, include_grads: bool = True) -> Accounting:
        """Bytes by category and module of the model and optimizers (:func:`account`)."""
        return account(
            self.model,
            self.optimizers,
            cuda_mode=self.device_kind == "cuda",
            include_grads=include_grads,
        )

    # ------------------------------------------------------------------ training thread
    def step(self) -> None:
        """Mark a step boundary in a loop without an optimizer (a safe point).

        When an optimizer of the model has been found, its steps are counted and this call is only
        a safe point (no double counting).
        """
        self._safe_point.step()

    def sync_stats(self) -> dict[str, Any] | None:
        """The ranks' agreement on this rank so far (multi-rank jobs; ``None`` otherwise):
        ``sync_every_steps``, ``syncs``, ``collectives``, ``mean_sync_s``, ``median_sync_s``,
        ``max_sync_s`` (wall seconds of one agreement: its collectives and local checks) and
        ``disabled`` (why agreement stopped, else ``None``). Also recorded at the end of the run
        as a ``rank_sync`` event."""
        return self._coordinator.stats() if self._coordinator is not None else None

    def breakdown(self) -> list[dict[str, Any]]:
        """Module × category attribution, largest first: one dict per module with ``module``,
        ``kind``, ``params_bytes``, ``grads_bytes``, ``optimizer_state_bytes`` (device tier, from
        the accounting of the latest reading: its totals are these rows' sums),
        ``activations_bytes`` (from the last per-module profile) and ``total_bytes``.

        On CUDA a last row ``module="other"`` holds ``allocated_bytes`` (``memory_stats``) minus
        every known category of the latest reading: the CUDA context's neighbours, temporaries,
        tensors the agent cannot see.
        """
        return self._module_rows.breakdown(self.latest)

    # ------------------------------------------------------------------ OOM recovery
    def run_step(
        self,
        step_fn: Callable[[Any], torch.Tensor],
        batch: Any,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        reduction: str = "mean",
        min_micro_batch_rows: int | None = None,
        merge_after_steps: int | None = None,
    ) -> torch.Tensor:
        """Run one training step that recovers from an out-of-memory error by splitting the batch.

        ``step_fn(micro_batch)`` runs the forward and returns the loss: a scalar tensor, the mean
        over the micro-batch's rows (``reduction="sum"``: their sum). ``run_step`` sets the
        gradients of what it trains (the model's parameters, ``optimizer``'s and the run's
        optimizers') to ``None``, calls ``backward`` on each micro-batch's loss scaled by its
        share of the rows (the update equals the whole batch's, but for batch-norm layers in
        training mode: see :mod:`edo_monitor.agent.recovery`), then, with ``optimizer``, runs
        ``optimizer.step()`` and ``optimizer.zero_grad()``. On ``torch.OutOfMemoryError`` in
        forward or backward it releases what the attempt held, applies a pending policy action,
        halves the micro-batch and retries; the split is kept for later steps and merged back
        after ``merge_after_steps`` clean steps (default 50). Details:
        :mod:`edo_monitor.agent.recovery`.

        Args:
            step_fn: ``micro_batch -> loss`` (scalar tensor).
            batch: a tensor, or tuples/lists/dicts of tensors, split on dim 0 (same size each).
            optimizer: stepped after the gradients are accumulated (``None``: the caller steps).
            reduction: ``"mean"`` or ``"sum"``: how ``step_fn``'s loss reduces over rows.
            min_micro_batch_rows: the floor (default 1), kept for later calls.
            merge_after_steps: clean steps before a merge is tried, kept for later calls.

        Returns:
            The whole batch's loss, detached.

        Raises:
            ConfigError: a bad argument or batch (checked before the step runs), or ``step_fn``
                returned something other than a scalar tensor (the message names it).
            torch.OutOfMemoryError: the step's first one, when micro-batches of
                ``min_micro_batch_rows`` rows still run out of memory; or one raised by
                ``optimizer.step()`` (that step has run: not retried).
        """
        if self._recovery is None:
            self._recovery = StepRecovery(self)
        self._recovery.configure(min_micro_batch_rows, merge_after_steps)
        return self._recovery.run(step_fn, batch, optimizer=optimizer, reduction=reduction)

    # ------------------------------------------------------------------ user API
    def summary(self) -> RunSummary:
        """Steps, peaks, minimum free fraction, events and actions so far (:class:`RunSummary`)."""
        writer = self._run.writer
        peaks = self._sampler.peaks
        return RunSummary(
            run_id=self.run_id,
            run_uuid=self.run_uuid,
            run_name=self.run_name,
            status=self.status,
            device_kind=self.device_kind,
            db_url=self.db_url.render_as_string(hide_password=True),
            steps=self.steps,
            samples=self._sampler.samples,
            samples_dropped=writer.dropped if writer is not None else 0,
            samples_written=writer.written["samples"] if writer is not None else 0,
            rows_not_written=dict(writer.not_written) if writer is not None else {},
            recorded_status=(
                self._run.recorded_status
                if self.status not in ("running", "created")
                else "running"
            ),
            store_problem=writer.problem if writer is not None else None,
            budget_bytes=self.budget_bytes,
            peak_in_use_bytes=peaks["in_use_bytes"],
            peak_allocated_bytes=peaks["allocated_bytes"],
            peak_reserved_bytes=peaks["reserved_bytes"],
            peak_activations_bytes=peaks["activations_bytes"],
            min_free_fraction=self._sampler.min_free_fraction,
            events=dict(Counter(self._log.counts) + Counter(writer.own_events if writer else {})),
            actions=tuple(self._log.actions),
            agent_errors=dict(self._log.agent_errors),
            job_id=self.job_id,
            rank=self.rank,
            world_size=self.world_size,
        )
