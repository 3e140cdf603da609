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

import json
import logging
import os
import threading
import uuid as uuidlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from edo_monitor.actions.checkpoint_activations import ActivationProfile
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.agent.device import Device
from edo_monitor.agent.events import EventLog
from edo_monitor.agent.module_rows import ModuleRows
from edo_monitor.agent.oom_capture import record_oom
from edo_monitor.agent.ranks import (
    DEFAULT_SYNC_EVERY_STEPS,
    Coordinator,
    RankInfo,
    detect_ranks,
)
from edo_monitor.agent.recovery import StepRecovery
from edo_monitor.agent.run import RunRecord, RunSummary, claim_model, release_model
from edo_monitor.agent.safe_point import SafePoint
from edo_monitor.agent.sampler import Sampler
from edo_monitor.agent.snapshots import DEFAULT_CAP_BYTES, SnapshotRecorder
from edo_monitor.agent.tuner import Tuner
from edo_monitor.decide.policy import Policy
from edo_monitor.errors import ConfigError
from edo_monitor.exporters.prometheus import (
    DEFAULT_METRICS_HOST,
    MetricsServer,
    require_prometheus,
    resolve_metrics_port,
    start_for_monitor,
)
from edo_monitor.measure.accounting import Accounting, account
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.nn.spill import remove_run_spill_files
from edo_monitor.probes.readings import Reading
from edo_monitor.signals import Terminated, terminate_on_sigterm
from edo_monitor.store.paths import check_writable, resolve_db_url
from edo_monitor.store.spill_files import report_leftovers, resolve_spill_dir
from edo_monitor.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from edo_monitor.integrations.tensorboard import TensorBoardSink

__all__ = ["DEFAULT_INTERVAL_S", "Monitor", "RunSummary", "watch"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.5


class Monitor:
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
        optimizers: optimizers found (or given) that step the model's parameters.
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
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
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
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)):
            raise ConfigError(f"interval_s={interval_s!r} must be a number of seconds > 0")
        if not interval_s > 0 or interval_s != interval_s or interval_s == float("inf"):
            raise ConfigError(f"interval_s={interval_s!r} must be a finite number of seconds > 0")
        if not snapshot_interval_s >= 0:
            raise ConfigError(f"snapshot_interval_s={snapshot_interval_s!r} must be >= 0")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"queue_size={queue_size!r} must be an int >= 1")
        optimizers: list[torch.optim.Optimizer] = []
        if optimizer is not None:
            optimizers = (
                [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
            )
            for opt in optimizers:
                if not isinstance(opt, torch.optim.Optimizer):
                    raise ConfigError(
                        f"optimizer={type(opt).__name__} is not a torch.optim.Optimizer (or None)"
                    )
        if policy is not None and not isinstance(policy, Policy):
            raise ConfigError(f"policy={policy!r} is not an edo_monitor.Policy (or None)")
        if not profile_interval_s > 0:
            raise ConfigError(f"profile_interval_s={profile_interval_s!r} must be > 0")
        if enforce and budget is None:
            raise ConfigError("enforce=True needs a budget= to enforce")
        if (
            isinstance(sync_every_steps, bool)
            or not isinstance(sync_every_steps, int)
            or sync_every_steps < 1
        ):
            raise ConfigError(f"sync_every_steps={sync_every_steps!r} must be an int >= 1")
        if snapshots not in (None, True, False):
            raise ConfigError(f"snapshots={snapshots!r} must be None (auto), True or False")
        #: ``watch(snapshots=)``: None = at incidents, no allocator history; True = with it
        self.snapshots = snapshots
        self.snapshot_cap_bytes = parse_bytes(snapshot_cap, name="snapshot_cap")
        #: steps between the ranks' agreements on a decision (multi-rank jobs)
        self.sync_every_steps = sync_every_steps
        #: base port of the Prometheus endpoint (+ LOCAL_RANK), ``None`` = no endpoint
        self.metrics_port = resolve_metrics_port(metrics_port)
        if self.metrics_port is not None:
            require_prometheus()  # ConfigError naming the [prometheus] extra
        self.metrics_host = metrics_host
        self.metrics_server: MetricsServer | None = None
        self.model = model
        #: ``watch(loader=)`` wrapped in :class:`edo_monitor.nn.LookAhead` (iterate it instead of
        #: the loader); ``None`` without a loader
        self.loader: Any = None
        if loader is not None:
            from edo_monitor.nn.lookahead import LookAhead

            try:
                self.loader = LookAhead(loader, ahead, loader_ids, tables=model)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.optimizers = optimizers
        self.interval_s = float(interval_s)
        self.budget_bytes_requested = None if budget is None else parse_bytes(budget, name="budget")
        if self.budget_bytes_requested == 0:
            raise ConfigError("budget=0 leaves no memory; expected a positive size")
        if self.budget_bytes_requested is not None and self.budget_bytes_requested >= 2**63:
            raise ConfigError(
                f"budget={budget!r} is {self.budget_bytes_requested} bytes; expected less than "
                "2**63 bytes (8 EiB), the largest size the history stores"
            )
        self.db_url = resolve_db_url(db)
        check_writable(self.db_url)  # in-memory URL: ConfigError; read-only file: StoreError
        #: the disk tier's folder (``spill_embedding``'s file; edo_monitor.nn.spill)
        self.spill_dir = resolve_spill_dir(spill_dir, self.db_url)
        self.run_name = run_name or (type(model).__name__ if model is not None else "process")
        self.tags = [tags] if isinstance(tags, str) else [str(t) for t in (tags or [])]
        self.strict = strict
        self.policy = policy
        self.enforce = enforce
        self.track_activations = track_activations and model is not None
        self.snapshot_interval_s = snapshot_interval_s
        self.queue_size = queue_size
        self.profile_interval_s = float(profile_interval_s)
        self.user_config = dict(config or {})
        try:
            json.dumps(self.user_config)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"config={config!r} cannot be stored: {exc}; expected JSON-serialisable values"
            ) from None

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
            from edo_monitor.integrations.tensorboard import TensorBoardSink

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
        except BaseException:
            self._teardown()
            release_model(self.model)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._finish(exc)
        finally:
            release_model(self.model)
        if exc is None and self.strict and self._log.pending_error is not None:
            raise self._log.pending_error

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
        does: ``exc=None`` records it ``finished``; an exception records it ``failed`` with that
        error (a ``KeyboardInterrupt``: ``interrupted``; an out-of-memory error also as an ``oom``
        event). ``exc`` is not raised. A no-op when the run is not running (never started, or
        stopped already), so a framework's several end hooks may each call it.

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

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        rank_error: BaseException | None = None
        try:
            self.ranks = detect_ranks()  # a collective on the group without a launcher job id
        except Exception as exc:  # recorded once the writer runs; the run is then no job's
            rank_error = exc
        if self.ranks is not None:
            self._coordinator = Coordinator(self, self.sync_every_steps)
        device = self._device
        device.detect(self.model)
        device.open_probes()
        self.accounting = self._account()
        self._safe_point.enforcing = self.enforce and device.kind == "cpu-budget"
        self._check_budget_fits(device.budget_bytes)
        config = {
            "interval_s": self.interval_s,
            "snapshot_interval_s": self.snapshot_interval_s,
            "track_activations": self.track_activations,
            "enforce": self.enforce,
            "policy": repr(self.policy) if self.policy is not None else None,
            "floor": self.policy.min_free_fraction if self.policy is not None else None,
            "model": type(self.model).__name__ if self.model is not None else None,
            "snapshots": self.snapshots,
            **({"sync_every_steps": self.sync_every_steps} if self.ranks is not None else {}),
            **self.user_config,
        }
        self._run.open(
            {
                "name": self.run_name,
                "pid": self._pid,
                "device_kind": device.kind,
                "device_name": device.name,
                "device_uuid": device.uuid,
                "device_total_bytes": device.total_bytes,
                "budget_bytes": device.budget_bytes,
                "interval_s": self.interval_s,
                "config": config,
                "tags": self.tags,
                "job_id": self.job_id,
                "rank": self.rank,
                "world_size": self.world_size,
                "local_rank": self.local_rank,
            },
            on_problem=lambda message: self._emit("store_error", message, {"error": message}),
            job=self._job_row(),
        )
        self.status = "running"
        self._log.writer = self._run.writer
        self._module_rows.writer = self._run.writer
        if self._snapshots is not None:
            self._snapshots.start()  # CUDA: the OOM observer (and the allocator's history)
            self._log.snapshots = self._snapshots
        if rank_error is not None:
            self._agent_error("rank detection", rank_error)
        if self._tensorboard is not None:
            self._tensorboard.open()  # a log dir that cannot be written: one agent_error
        report_leftovers(self.spill_dir, self._emit)  # a crashed run's spill file
        self._start_hooks()

    def _check_budget_fits(self, budget_bytes: int | None) -> None:
        """Refuse an enforced CPU budget that the model's device-tier bytes already exceed.

        With ``enforce=True`` such a run cannot make a single step: the first saved tensor of
        the first forward (or the first step boundary) goes over the budget, before the tuner
        could move anything off the device tier (actions apply only at step boundaries). Not
        enforced (``enforce=False``), the run goes on and a warning is logged: the readings show
        it over budget and a policy may offload tables.

        Raises:
            ConfigError: ``enforce=True`` in CPU-budget mode and the accounting at entry (params,
                buffers, gradients and optimizer state on the device tier) exceeds
                ``budget_bytes``; the message names both numbers.
        """
        acc = self.accounting
        if budget_bytes is None or acc.total_bytes <= budget_bytes:
            return
        held = (
            f"the watched model already holds {acc.total_bytes} bytes "
            f"({format_bytes(acc.total_bytes)}: params {acc.params_bytes}, grads "
            f"{acc.grads_bytes}, optimizer state {acc.optimizer_state_bytes}) on the device tier"
        )
        budget = f"budget={budget_bytes} bytes ({format_bytes(budget_bytes)})"
        if self._safe_point.enforcing:
            raise ConfigError(
                f"{budget} is smaller than the model: {held}; with enforce=True the first "
                f"forward would run out of memory. Give a budget above {acc.total_bytes} bytes, "
                "or enforce=False to watch it over budget (a policy may then offload tables)"
            )
        logger.warning("edo-monitor: %s is smaller than the model: %s", budget, held)

    def _job_row(self) -> dict[str, Any] | None:
        """The ``jobs`` row this rank's run belongs to (``None`` outside a process group)."""
        if self.ranks is None:
            return None
        return {
            "id": self.ranks.job_id,
            "name": self.run_name,
            "world_size": self.ranks.world_size,
            "backend": self.ranks.backend,
            "id_source": self.ranks.id_source,
        }

    def _start_hooks(self) -> None:
        self._safe_point.install()
        # SIGTERM's default action kills the process without running Python: the run would read
        # "crashed"; while the block lasts it raises Terminated instead (no handler of the user's
        # is replaced)
        self._restore_sigterm = terminate_on_sigterm()
        if self.track_activations:
            self._tracker = ActivationTracker(
                self._model_tensors(),
                on_error=lambda exc: self._agent_error("saved-tensor hook", exc),
            ).__enter__()
            if self._safe_point.enforcing:
                self._tracker.limit_bytes = self.budget_bytes
                self._tracker.static_bytes = self.accounting.total_bytes
                self._tracker.on_exceed = self._safe_point.budget_exceeded
        if self.model is not None:
            self._lookups = LookupCounter()
            self._lookups.watch_tables(self.model)
        self._safe_point.arm_activation_profile()  # record the first step (table actions need it)
        self._sampler.start()
        if self.metrics_port is not None:
            self.metrics_server = start_for_monitor(self, self.metrics_port, self.metrics_host)
        logger.info(
            "edo-monitor: watching run %d (%s, %s) -> %s",
            self.run_id,
            self.run_name,
            self.device_kind,
            self.db_url,
        )

    def _finish(self, exc: BaseException | None) -> None:
        self._sampler.stop()
        self._safe_point.close_recorder()
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
        if self.status == "running":
            try:
                last = self._sampler.sample_once()  # the last reading, after the last step
                if self.policy is not None:  # a forecast the run ended too soon to judge
                    outcome = self.policy.end_forecast(last.step, last.time_s)
                    if outcome is not None:
                        self._tuner.emit_forecast_outcome(outcome)
            except Exception:
                logger.debug("final sample failed", exc_info=True)
            try:
                self._tuner.expire_pending_decision()
            except Exception as exc:
                self._agent_error("end of run", exc)
        if isinstance(exc, KeyboardInterrupt):
            status, error = "interrupted", "KeyboardInterrupt"
        elif isinstance(exc, Terminated):
            status, error = "interrupted", "SIGTERM"
        elif exc is not None:
            status, error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
            if not getattr(exc, "_edo_recorded", False):
                self._record_oom(exc)
        else:
            status, error = "finished", None
        self._record_lookup_frequency()
        if self._coordinator is not None and self._coordinator.syncs:
            stats = self._coordinator.stats()
            self._emit(
                "rank_sync",
                f"{stats['syncs']} agreements of the ranks every {self.sync_every_steps} steps, "
                f"{stats['collectives']} collectives, mean {stats['mean_sync_s'] * 1e3:.3f} ms "
                f"per agreement",
                stats,
            )
        self._teardown()
        self._run.record_end(status, error, self.steps)
        self.status = status

    def _record_lookup_frequency(self, top_k: int = 20) -> None:
        """One ``lookup_frequency`` event per table: its top ids and the share they cover."""
        if self._lookups is None:
            return
        self._lookups.close()
        for table in self._lookups.tables:
            freq = self._lookups.frequency(table, top_k)
            if freq.sampled_lookups:
                self._emit(
                    "lookup_frequency",
                    f"{table}: top {len(freq.top_ids)} ids cover {freq.top_share_fraction:.1%} "
                    f"of {freq.sampled_lookups:,} lookups ({freq.distinct_ids:,} distinct ids)",
                    freq.as_dict(),
                )

    def _teardown(self) -> None:
        """Stop threads and remove hooks; safe to call on a half-started monitor."""
        self._stop.set()
        self._restore_sigterm()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self._sampler.stop()
        if self._tensorboard is not None:
            self._tensorboard.close()  # the events still waiting, flushed (after the sampler)
        self._safe_point.remove()
        if self._lookups is not None:
            self._lookups.close()
        if self._snapshots is not None:
            self._snapshots.stop()
        self._device.reset_fraction()
        remove_run_spill_files(self.spill_dir)  # the run ended: its disk tier's file goes
        self._run.close_writer(self.steps)
        self._device.close_probes()

    # ------------------------------------------------------------------ shared helpers
    def _emit(self, kind: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        """Record an event (any thread; never blocks): :meth:`EventLog.emit`."""
        self._log.emit(kind, message, data)

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
        model's gradients to ``None``, calls ``backward`` on each micro-batch's loss scaled by its
        share of the rows (the update equals the whole batch's), then, with ``optimizer``, runs
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
            ConfigError: a bad argument or batch.
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
            events=dict(self._log.counts),
            actions=tuple(self._log.actions),
            agent_errors=dict(self._log.agent_errors),
            job_id=self.job_id,
            rank=self.rank,
            world_size=self.world_size,
        )


def watch(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
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
) -> Monitor:
    """Watch a training run; use as ``with edo_monitor.watch(model) as monitor:``.

    Args:
        model: the model to watch; ``None`` monitors the process only.
        optimizer: optimizer(s) stepping the model; by default found through PyTorch's global
            optimizer step hooks (the first one that steps a parameter of ``model``).
        db: history database: file path or SQLAlchemy URL; default ``$EDO_DB`` or
            ``./edo-history.db``.
        interval_s: seconds between samples (> 0).
        budget: memory budget in bytes or as a string (``"512MiB"``, ``"2GB"``). On CUDA it is
            enforced with ``torch.cuda.set_per_process_memory_fraction``; on a CPU it is the
            capacity the accounted bytes are measured against (CPU-budget mode).
        run_name: a name for the run (default: the model's class name).
        tags: labels for queries (a string is one tag).
        strict: re-raise failures inside the agent (for tests) instead of logging them.
        policy: an :class:`edo_monitor.Policy` (the auto-tuner): evaluated on each reading, its
            decisions applied at the next step boundary; ``None`` records only.
        enforce: CPU-budget mode: raise :class:`edo_monitor.BudgetOutOfMemoryError` (a
            ``torch.OutOfMemoryError``) when the accounted bytes exceed the budget (needs
            ``budget``): during forward, from the saved-tensor hook, when the activations would
            overflow it (before the optimizer step, as a GPU would); at the step boundary when
            gradients or new optimizer state did (that optimizer step has run). Ignored on CUDA,
            where the allocator enforces the budget. Each one is recorded as an ``oom`` event.
        track_activations: measure bytes saved for backward with saved-tensor hooks.
        snapshot_interval_s: seconds between allocator snapshots for fragmentation (0 = never).
        queue_size: capacity of the history queue (items beyond it are dropped and counted).
        config: extra key/values recorded with the run.
        profile_interval_s: seconds between per-module activation profiles (one step's forward
            is recorded with module hooks; needs ``track_activations``).
        metrics_port: serve Prometheus metrics on ``/metrics`` at this port + ``$LOCAL_RANK``
            (default ``$EDO_METRICS_PORT``, else no endpoint; 0 = any free port, see
            ``monitor.metrics_server.port``); needs the ``[prometheus]`` extra. Names:
            ``docs/metrics.md``. A port that cannot be bound is a warning, not an error.
        metrics_host: the address the endpoint binds (default ``127.0.0.1``, loopback only).
        tensorboard: a ``torch.utils.tensorboard.SummaryWriter``, or a log folder (str or path)
            to open one in: each reading's main numbers become scalars ``edo/<column>`` at the
            reading's step, each event (decision, action, crossing, OOM ...) text
            ``edo/events/<kind>/text_summary``; written by the sampler thread, flushed when the
            run ends (a writer made from a folder is closed, one passed in is not). Needs the
            ``[tensorboard]`` extra. A failing write is an ``agent_error``, never the training's.
        sync_every_steps: in a multi-rank job (an initialised ``torch.distributed`` process
            group), the ranks agree on one decision every this many optimizer steps (one small
            collective; a second when a decision is taken), and every rank applies it at that
            step, or none does (default 4). Every rank must step the same number of times.
        snapshots: a memory snapshot in the format of ``torch.cuda.memory._snapshot()`` at each
            incident (OOM, crossing below the floor, before/after an action), stored linked to
            its event (``edo-monitor snapshot``). ``None`` (default): at incidents only, nothing
            runs before one (on CUDA the allocator's snapshot, its blocks without frames; in
            CPU-budget mode one built from the accounting). ``True``: on CUDA also record the
            allocator's history (Python frames of every block, the last 20,000 allocator actions;
            costs a stack capture per allocation). ``False``: none.
        snapshot_cap: compressed snapshot bytes stored per run (bytes or ``"64MiB"``); beyond
            it snapshots are dropped and one ``snapshot_cap_reached`` event says so.
        loader: the training loader: ``monitor.loader`` is then an
            :class:`edo_monitor.nn.LookAhead` over it (iterate that instead): it reads ``ahead``
            batches in advance and, for every row-cached table of ``model`` (those the agent
            converts later too), prefetches the next batch's rows and evicts by next use in the
            window. Without it the cache evicts by its own policy (LFU).
        ahead: the look-ahead window in batches (an int >= 1).
        loader_ids: ``loader_ids(batch)``: the ids the batch looks up (a tensor, or a mapping from
            table module or name to tensor); default: the first integer tensor of the batch.
        spill_dir: folder of the disk tier's file (``spill_embedding``, when the host cannot
            hold a row cache's table): default ``<history file>.spill`` beside an SQLite
            history, else ``<temp dir>/edo-spill``; the file is removed when the run ends.

    Returns:
        A :class:`Monitor` (entering it starts the run).

    Raises:
        ConfigError: (a ``ValueError``) for a bad argument, naming the value; ``tensorboard``
            without the ``tensorboard`` package; on entering, ``enforce=True`` with a CPU budget
            below the bytes the model already holds (naming both).
        AlreadyWatchedError: on entering, when ``model`` is already watched.
        StoreError: on entering, when the database cannot be opened.
    """
    return Monitor(
        model,
        optimizer,
        db=db,
        interval_s=interval_s,
        budget=budget,
        run_name=run_name,
        tags=tags,
        strict=strict,
        policy=policy,
        enforce=enforce,
        track_activations=track_activations,
        snapshot_interval_s=snapshot_interval_s,
        queue_size=queue_size,
        config=config,
        profile_interval_s=profile_interval_s,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        tensorboard=tensorboard,
        sync_every_steps=sync_every_steps,
        snapshots=snapshots,
        snapshot_cap=snapshot_cap,
        loader=loader,
        ahead=ahead,
        loader_ids=loader_ids,
        spill_dir=spill_dir,
    )
