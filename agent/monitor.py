"""The in-process agent: :func:`watch` and the :class:`Monitor` it yields.

Threads (DESIGN.md §3):

* the **training thread** (the user's) runs the optimizer step post-hook, which counts steps and is
  the only place the model or optimizer may change (the *safe point*);
* the **sampler thread** reads the probes every ``interval_s``, builds a :class:`Reading`, hands
  it to the writer and to the policy;
* the **writer thread** (:class:`edo_monitor.store.writer.Writer`) drains a bounded queue into the
  history database. Nothing in the training thread waits on the database.

A failure inside the agent never fails the training: it is logged once, recorded as an
``agent_error`` event, and the agent goes on (``strict=True`` re-raises it, for tests).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import socket
import threading
import time
import uuid as uuidlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from sqlalchemy import insert, update
from sqlalchemy.exc import SQLAlchemyError
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from edo_monitor.accounting import Accounting, account
from edo_monitor.actions.base import ActionContext, ActionResult
from edo_monitor.actions.checkpoint_activations import ActivationProfile, ActivationRecorder
from edo_monitor.actions.enforce import enforce_budget
from edo_monitor.actions.registry import ACTIONS
from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.agent.recovery import StepRecovery
from edo_monitor.errors import (
    AlreadyWatchedError,
    BudgetOutOfMemoryError,
    ConfigError,
    StoreError,
)
from edo_monitor.frequency import LookupCounter
from edo_monitor.leaks import GrowthDetector
from edo_monitor.metrics import (
    DEFAULT_METRICS_HOST,
    MetricsServer,
    require_prometheus,
    resolve_metrics_port,
    start_for_monitor,
)
from edo_monitor.nn.cached import CachedTable
from edo_monitor.policy import (
    Decision,
    Forecast,
    ForecastOutcome,
    Policy,
    ThresholdCrossing,
    make_planner,
)
from edo_monitor.probes.host import HostProbe
from edo_monitor.readings import Reading
from edo_monitor.store.engine import check_writable, open_engine, resolve_db_url
from edo_monitor.store.models import Run
from edo_monitor.store.schema import CACHE_FIELDS
from edo_monitor.store.writer import Writer
from edo_monitor.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from edo_monitor.integrations.tensorboard import TensorBoardSink

__all__ = ["DEFAULT_INTERVAL_S", "Monitor", "RunSummary", "watch"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.5

_watched_lock = threading.Lock()
_watched: dict[int, weakref.ref[nn.Module]] = {}


@dataclass(frozen=True)
class RunSummary:
    """What :meth:`Monitor.summary` reports.

    Attributes:
        run_id, run_uuid, run_name, status, device_kind, db_url: identify the run.
        steps: optimizer steps (or ``Monitor.step()`` calls) seen.
        samples: readings taken. samples_dropped: rows (samples, events, module rows) not
            written to the history: queue full, refused by the database, unwritable when the run
            ended (disk full), or held back because the database file was deleted or replaced.
        samples_written: samples the history database holds for the run.
        rows_not_written: ``samples_dropped`` by table (``samples``, ``events``,
            ``module_stats``).
        recorded_status: the status the database holds for the run after it ended (``None``:
            the end could not be recorded, so the stored run still says ``running``).
        store_problem: why rows were not written (``None`` when every row was).
        budget_bytes: the capacity the policy measures against (``None`` without a budget on a
            CPU).
        peak_in_use_bytes, peak_allocated_bytes, peak_reserved_bytes, peak_activations_bytes:
            peaks over the run's readings (``None`` where the source was unavailable).
        min_free_fraction: lowest ``free_fraction`` seen.
        events: count of events by kind. actions: the ``action`` events' data, in order.
        agent_errors: failures inside the agent by ``"where:ExceptionType"`` (the hooks, the
            sampler ...), every occurrence counted; each kind is one ``agent_error`` event.
    """

    run_id: int
    run_uuid: str
    run_name: str
    status: str
    device_kind: str
    db_url: str
    steps: int
    samples: int
    samples_dropped: int
    budget_bytes: int | None
    peak_in_use_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_activations_bytes: int | None
    min_free_fraction: float | None
    events: dict[str, int] = field(default_factory=dict)
    actions: tuple[dict[str, Any], ...] = ()
    agent_errors: dict[str, int] = field(default_factory=dict)
    samples_written: int = 0
    rows_not_written: dict[str, int] = field(default_factory=dict)
    recorded_status: str | None = None
    store_problem: str | None = None

    def __str__(self) -> str:
        """A readable multi-line summary (what ``print(monitor.summary())`` shows)."""
        mff = self.min_free_fraction
        lines = [
            f"run {self.run_id} ({self.run_name}): {self.status}, {self.device_kind}, "
            f"budget {format_bytes(self.budget_bytes)}",
            f"steps {self.steps}, samples {self.samples} ({self.samples_written} written, "
            f"{self.samples_dropped} row(s) not written)",
            f"peak in use {format_bytes(self.peak_in_use_bytes)}, allocated "
            f"{format_bytes(self.peak_allocated_bytes)}, reserved "
            f"{format_bytes(self.peak_reserved_bytes)}, activations "
            f"{format_bytes(self.peak_activations_bytes)}",
            f"min free {'N/A' if mff is None else f'{mff:.1%}'}",
            f"events {self.events or 'none'}",
        ]
        if self.agent_errors:
            lines.append(f"agent errors (training went on) {self.agent_errors}")
        lines += [
            f"action {a.get('action')} on {a.get('target')}: saved "
            f"{format_bytes(a.get('saved_bytes'))} in {a.get('duration_s', 0.0):.3f} s"
            for a in self.actions
        ]
        if self.samples_dropped or self.store_problem:
            nw = self.rows_not_written
            lines.append(
                f"NOT WRITTEN to the history: {nw.get('samples', 0)} sample(s), "
                f"{nw.get('events', 0)} event(s), {nw.get('module_stats', 0)} module row(s)"
                + (f" ({self.store_problem})" if self.store_problem else "")
            )
        if self.status not in ("running", "created") and self.recorded_status != self.status:
            lines.append(
                f"the database still records this run as {self.recorded_status or 'running'}"
            )
        lines.append(f"database {self.db_url}")
        return "\n".join(lines)


def _sum_cache_counters(
    tables: Mapping[str, tuple[dict[str, int], dict[str, int]]],
) -> dict[str, int | None]:
    """The sample's ``cache_*`` fields: the tables' increments (and rows now) summed; ``None``
    each when the model has no cached table."""
    if not tables:
        return {}
    return {f: sum(inc[f] for _, inc in tables.values()) for f in CACHE_FIELDS}


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


class Monitor:
    """A watched training run. Create it with :func:`watch`; use it as a context manager.

    Attributes (read-only while the block runs):
        run_id: ``runs.id`` of this run in the history database.
        run_uuid: the run's UUID.
        latest: the last :class:`Reading` (``None`` before the first sample).
        steps: step count so far.
        device_kind: ``"cuda"`` or ``"cpu-budget"``.
        optimizers: optimizers found (or given) that step the model's parameters.
        metrics_server: the Prometheus endpoint (``.url``, ``.port``) while the block runs with
            ``metrics_port``; ``None`` otherwise.
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
        #: base port of the Prometheus endpoint (+ LOCAL_RANK), ``None`` = no endpoint
        self.metrics_port = resolve_metrics_port(metrics_port)
        if self.metrics_port is not None:
            require_prometheus()  # ConfigError naming the [prometheus] extra
        self.metrics_host = metrics_host
        self.metrics_server: MetricsServer | None = None
        self.model = model
        self.optimizers = optimizers
        self._explicit_optimizers = bool(optimizers)
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
        self.run_name = run_name or (type(model).__name__ if model is not None else "process")
        self.tags = [tags] if isinstance(tags, str) else [str(t) for t in (tags or [])]
        self.strict = strict
        self.policy = policy
        self.enforce = enforce
        self._enforcing = False  # enforce in CPU-budget mode (decided on entering)
        self._last_static_bytes = 0
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

        self.run_id: int = -1
        self.run_uuid: str = str(uuidlib.uuid4())
        self.latest: Reading | None = None
        self.steps = 0
        self.status = "created"
        self.device_kind = "cpu-budget"
        self.device_index: int | None = None
        self.budget_bytes: int | None = self.budget_bytes_requested
        self.accounting = Accounting()

        self._pid = os.getpid()
        self._primary: torch.optim.Optimizer | None = optimizers[0] if optimizers else None
        self._classified: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = (
            weakref.WeakKeyDictionary()
        )
        self._hook_handle: Any = None
        self._tracker: ActivationTracker | None = None
        #: lookups per id of the model's tables (hot ids for share_embedding, history events)
        self._lookups: LookupCounter | None = None
        self._writer: Writer | None = None
        self._engine: Any = None
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._probes: dict[str, Any] = {}
        self._agent_errors: Counter[str] = Counter()  # "where:ExceptionType" -> occurrences
        self._pending_error: BaseException | None = None
        self._events: Counter[str] = Counter()
        self._actions: list[dict[str, Any]] = []
        self._module_rows: dict[str, dict[str, Any]] = {}
        #: each cached table's counters at the previous sample, by (module name, object id)
        self._cache_prev: dict[tuple[str, int], dict[str, int]] = {}
        self._want_step_accounting = False
        self._step_accounting: Accounting | None = None
        self._recorder: ActivationRecorder | None = None
        self._profiled_at_s = -float("inf")
        self._pressure_queue: list[ThresholdCrossing] = []
        #: the last per-module activation profile (``ActivationProfile``), ``None`` before one
        self.activation_profile: ActivationProfile | None = None
        self._samples = 0
        self._peaks: dict[str, int | None] = {
            "in_use_bytes": None,
            "allocated_bytes": None,
            "reserved_bytes": None,
            "activations_bytes": None,
        }
        self._min_free_fraction: float | None = None
        self._fraction_set = False
        self._entered = False
        self._recorded_status: str | None = None
        self._host_probe: Any = None
        self._leaks = GrowthDetector()  # steady growth of saved tensors across steps
        self._recovery: StepRecovery | None = None  # run_step's split state, made on first use
        #: readings as TensorBoard scalars, events as text (``tensorboard=``); ConfigError here
        #: for a bad value or without the package, the writer opened on entering
        self._tensorboard: TensorBoardSink | None = None
        if tensorboard is not None:
            from edo_monitor.integrations.tensorboard import TensorBoardSink

            self._tensorboard = TensorBoardSink(
                tensorboard, on_error=lambda exc: self._agent_error("tensorboard", exc)
            )

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Monitor:
        if self._entered:
            raise RuntimeError("a Monitor can be entered once; call watch() again for a new run")
        self._entered = True
        self._register_model()
        try:
            self._start()
        except BaseException:
            self._teardown()
            self._unregister_model()
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
            self._unregister_model()
        if exc is None and self.strict and self._pending_error is not None:
            raise self._pending_error

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
    def _register_model(self) -> None:
        if self.model is None:
            return
        with _watched_lock:
            ref = _watched.get(id(self.model))
            if ref is not None and ref() is self.model:
                raise AlreadyWatchedError(
                    f"model {type(self.model).__name__} (id {id(self.model):#x}) is already "
                    "watched by an open watch() block; watch each model once"
                )
            _watched[id(self.model)] = weakref.ref(self.model)

    def _unregister_model(self) -> None:
        if self.model is None:
            return
        with _watched_lock:
            ref = _watched.get(id(self.model))
            if ref is not None and ref() is self.model:
                del _watched[id(self.model)]

    def _detect_device(self) -> None:
        cuda_index = None
        if self.model is not None:
            for p in self.model.parameters():
                if p.is_cuda:
                    cuda_index = p.device.index if p.device.index is not None else 0
                    break
        elif torch.cuda.is_initialized() and torch.cuda.is_available():
            # is_initialized first: is_available() may initialise the driver (it queries the
            # device count), which can break a DataLoader that forks later
            cuda_index = torch.cuda.current_device()
        if cuda_index is not None:
            self.device_kind = "cuda"
            self.device_index = cuda_index

    def _start(self) -> None:
        self._detect_device()
        device_name = f"host CPU ({platform.machine() or 'unknown'})"  # cpu-budget: modelled
        device_uuid = None
        device_total = None
        self._host_probe = HostProbe(on_event=self._emit)
        self._host_probe.start()  # process tree and cgroup on their own thread
        self._probes["host"] = self._host_probe
        if self.device_kind == "cuda":
            from edo_monitor.probes.cuda import AllocatorProbe
            from edo_monitor.probes.nvml import NvmlProbe

            props = torch.cuda.get_device_properties(self.device_index)
            torch_uuid = str(getattr(props, "uuid", "") or "") or None
            nvml = NvmlProbe(
                self.device_index or 0,
                torch_uuid=torch_uuid,
                on_event=self._emit,
                fallback_name=props.name,
            )
            nvml.start()
            self._probes["nvml"] = nvml
            self._probes["cuda"] = AllocatorProbe(
                self.device_index or 0,
                snapshot_interval_s=self.snapshot_interval_s,
                on_event=self._emit,
            )
            device_name = nvml.device_name or props.name
            device_uuid = nvml.device_uuid or (f"GPU-{torch_uuid}" if torch_uuid else None)
            device_total = int(props.total_memory)
            self.budget_bytes = device_total
            if self.budget_bytes_requested is not None:
                self.budget_bytes = min(device_total, self.budget_bytes_requested)
                torch.cuda.set_per_process_memory_fraction(
                    self.budget_bytes / device_total, self.device_index
                )
                self._fraction_set = True
        self.accounting = self._account()
        self._enforcing = self.enforce and self.device_kind == "cpu-budget"
        self._last_static_bytes = self.accounting.total_bytes
        self._engine = open_engine(self.db_url)
        now = time.time()
        config = {
            "interval_s": self.interval_s,
            "snapshot_interval_s": self.snapshot_interval_s,
            "track_activations": self.track_activations,
            "enforce": self.enforce,
            "policy": repr(self.policy) if self.policy is not None else None,
            "floor": self.policy.min_free_fraction if self.policy is not None else None,
            "model": type(self.model).__name__ if self.model is not None else None,
            **self.user_config,
        }
        try:
            self.run_id = self._insert_run(now, config, device_name, device_uuid, device_total)
        except SQLAlchemyError as exc:
            raise StoreError(
                f"cannot record the run in history database {self.db_url.database or self.db_url}"
                f": {getattr(exc, 'orig', None) or exc}"
            ) from None
        self.status = "running"
        self._writer = Writer(
            self._engine,
            self.run_id,
            queue_size=self.queue_size,
            on_problem=lambda message: self._emit("store_error", message, {"error": message}),
        )
        self._writer.start()
        if self._tensorboard is not None:
            self._tensorboard.open()  # a log dir that cannot be written: one agent_error
        self._start_hooks()

    def _insert_run(
        self,
        now: float,
        config: dict[str, Any],
        device_name: str,
        device_uuid: str | None,
        device_total: int | None,
    ) -> int:
        with self._engine.begin() as conn:
            result = conn.execute(
                insert(Run).values(
                    uuid=self.run_uuid,
                    name=self.run_name,
                    host=socket.gethostname(),
                    pid=self._pid,
                    started_at_s=now,
                    heartbeat_at_s=now,
                    status="running",
                    device_kind=self.device_kind,
                    device_name=device_name,
                    device_uuid=device_uuid,
                    device_total_bytes=device_total,
                    budget_bytes=self.budget_bytes,
                    interval_s=self.interval_s,
                    torch_version=torch.__version__,
                    config=config,
                    tags=self.tags,
                    steps=0,
                    samples_dropped=0,
                )
            )
            return int(result.inserted_primary_key[0])

    def _start_hooks(self) -> None:
        self._hook_handle = register_optimizer_step_post_hook(self._on_optimizer_step)
        if self.track_activations:
            self._tracker = ActivationTracker(
                self._model_tensors(),
                on_error=lambda exc: self._agent_error("saved-tensor hook", exc),
            ).__enter__()
            if self._enforcing:
                self._tracker.limit_bytes = self.budget_bytes
                self._tracker.static_bytes = self.accounting.total_bytes
                self._tracker.on_exceed = self._budget_exceeded
        if self.model is not None:
            self._lookups = LookupCounter()
            self._lookups.watch_tables(self.model)
        self._arm_activation_profile()  # record the first step (table actions need it)
        self._sampler = threading.Thread(target=self._sample_loop, name="edo-sampler", daemon=True)
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
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
        if self.status == "running":
            try:
                last = self._sample_once()  # the last reading, after the last step
                if self.policy is not None:  # a forecast the run ended too soon to judge
                    outcome = self.policy.end_forecast(last.step, last.time_s)
                    if outcome is not None:
                        self._emit_forecast_outcome(outcome)
            except Exception:
                logger.debug("final sample failed", exc_info=True)
        if isinstance(exc, KeyboardInterrupt):
            status, error = "interrupted", "KeyboardInterrupt"
        elif exc is not None:
            status, error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
            if not getattr(exc, "_edo_recorded", False):
                self._record_oom(exc)
        else:
            status, error = "finished", None
        self._record_lookup_frequency()
        self._teardown()
        if self._writer is not None and self._writer.file_lost:
            # the file was deleted or replaced: the run's row is not there to update
            logger.warning(
                "edo-monitor: the end of run %d is not recorded: %s",
                self.run_id,
                self._writer.problem,
            )
        elif self._engine is not None and self.run_id >= 0:
            try:
                with self._engine.begin() as conn:
                    updated = conn.execute(
                        update(Run)
                        .where(Run.id == self.run_id)
                        .values(
                            status=status,
                            error=error,
                            ended_at_s=time.time(),
                            heartbeat_at_s=time.time(),
                            steps=self.steps,
                            samples_dropped=self._writer.dropped if self._writer else 0,
                        )
                    )
                if updated.rowcount == 1:
                    self._recorded_status = status
            except Exception:
                logger.exception("edo-monitor: could not record the end of run %d", self.run_id)
        if self._engine is not None:
            self._engine.dispose()
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
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self._sampler is not None and self._sampler.is_alive():
            self._sampler.join()
        if self._tensorboard is not None:
            self._tensorboard.close()  # the events still waiting, flushed (after the sampler)
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None
        if self._lookups is not None:
            self._lookups.close()
        if self._fraction_set:
            try:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device_index)
            except Exception:
                logger.debug("could not reset the memory fraction", exc_info=True)
            self._fraction_set = False
        if self._writer is not None:
            self._writer.run_values["steps"] = self.steps
            self._writer.close()
        nvml = self._probes.get("nvml")
        if nvml is not None:
            nvml.close()
        if self._host_probe is not None:
            self._host_probe.close()

    # ------------------------------------------------------------------ events & errors
    def _emit(self, kind: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        """Record an event (any thread; never blocks)."""
        self._events[kind] += 1
        if kind == "action":
            self._actions.append(dict(data or {}))
        if self._writer is not None:
            self._writer.put_event(kind, message, step=self.steps, data=data)
        if self._tensorboard is not None:
            self._tensorboard.add_event(kind, message, self.steps)  # written by the sampler

    def _agent_error(self, where: str, exc: BaseException) -> None:
        """Count a failure inside the agent; the first of each kind is logged with its traceback
        and recorded as one ``agent_error`` event (any thread; never raises)."""
        key = f"{where}:{type(exc).__name__}"
        self._agent_errors[key] += 1
        if self._agent_errors[key] == 1:
            logger.error(
                "edo-monitor: %s failed (training goes on)",
                where,
                exc_info=(type(exc), exc, exc.__traceback__),
            )
            self._emit("agent_error", f"{where}: {type(exc).__name__}: {exc}", {"where": where})
        if self.strict and self._pending_error is None:
            self._pending_error = exc

    # ------------------------------------------------------------------ training thread
    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if os.getpid() != self._pid or self._stop.is_set():
            return
        try:
            if optimizer is not self._primary and not self._classify(optimizer):
                return
            if optimizer is self._primary:
                self._safe_point(count=True)
        except BudgetOutOfMemoryError:
            raise  # enforce=True: the budget's out-of-memory error is the user's to see
        except Exception as exc:
            self._agent_error("step hook", exc)

    def _classify(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps the watched model (remembered per optimizer)."""
        known = self._classified.get(optimizer)
        if known is not None:
            return known
        if self._explicit_optimizers:
            steps_model = optimizer in self.optimizers
        elif self.model is None:
            steps_model = self._primary is None
        else:
            ids = {id(p) for p in self.model.parameters()}
            steps_model = any(id(p) in ids for g in optimizer.param_groups for p in g["params"])
        self._classified[optimizer] = steps_model
        if steps_model:
            if optimizer not in self.optimizers:
                self.optimizers.append(optimizer)
            if self._primary is None:
                self._primary = optimizer
        return steps_model

    def step(self) -> None:
        """Mark a step boundary in a loop without an optimizer (a safe point).

        When an optimizer of the model has been found, its steps are counted and this call is only
        a safe point (no double counting).
        """
        if os.getpid() != self._pid or self._stop.is_set() or self.status != "running":
            return  # a forked child, a closed block, or a Monitor never entered
        try:
            self._safe_point(count=self._primary is None)
        except BudgetOutOfMemoryError:
            raise  # enforce=True: the budget's out-of-memory error is the user's to see
        except Exception as exc:
            self._agent_error("step", exc)

    def _safe_point(self, *, count: bool) -> None:
        """The step boundary, on the training thread: the only place the model may change.

        Order: measure the step (accounting while gradients live; the activation profile), enforce
        the CPU budget against this step's peak, apply the pending decision, then close the step.
        Closing the step (count, activation peak, next profile) runs in ``finally``: an exception
        anywhere before it (the budget's out-of-memory error included: the optimizer step has run)
        never leaves the count behind or merges two steps.
        """
        try:
            # the profile first: the readings that see this step's accounting see its profile
            # too (table actions need one; recording starts on entering, so step 1 has it)
            self._collect_activation_profile()
            if self._want_step_accounting or self._enforcing:
                # between optimizer step and zero_grad, gradients and optimizer state are all
                # alive: the step's peak of static memory (the sampler may land anywhere)
                self._want_step_accounting = False
                self._step_accounting = self._account()
            if self._enforcing and self._step_accounting is not None:
                static = self._step_accounting.total_bytes
                if self._tracker is not None:
                    self._tracker.static_bytes = static
                # the highest saved bytes alive at once during this step (retained ones included)
                activations = self._tracker.step_peak_bytes if self._tracker is not None else 0
                last_static, self._last_static_bytes = self._last_static_bytes, static
                if static + activations > (self.budget_bytes or 0):
                    self._budget_exceeded(static - last_static, static + activations)
            self._deliver_pressure_hooks()
            self._apply_pending_decision()
        finally:
            self._close_step(count)
        if self.strict and self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise err

    def _close_step(self, count: bool) -> None:
        """Step bookkeeping; each part guarded so one failure cannot skip the others."""
        if count:
            self.steps += 1
            if self._writer is not None:
                self._writer.run_values["steps"] = self.steps
            if self._tracker is not None:
                try:
                    self._tracker.end_step()
                    self._check_growth(self._tracker.live_bytes)
                except Exception as exc:
                    self._agent_error("closing the step", exc)
        try:
            self._arm_activation_profile()
        except Exception as exc:
            self._agent_error("activation profile", exc)

    def _check_growth(self, activations_bytes: int) -> None:
        """Saved tensors alive at the step boundary: steady growth is a ``leak_suspected``."""
        suspicion = self._leaks.add(self.steps, "activations", activations_bytes)
        if suspicion is not None:
            self._emit(
                "leak_suspected",
                f"{suspicion.category} grow by {format_bytes(int(suspicion.growth_bytes_per_step))}"
                f" per step (steps {suspicion.first_step}-{suspicion.last_step})",
                dataclasses.asdict(suspicion),
            )

    def _budget_exceeded(self, requested_bytes: int, in_use_bytes: int) -> None:
        """Raise the CPU-budget out-of-memory error, recorded as an ``oom`` event first (so it is
        in the history even when the user catches it)."""
        assert self.budget_bytes is not None
        try:
            # at least the excess, as enforce_budget reports it; "accounted" is what was in use
            # before the request that failed
            requested = max(1, requested_bytes, in_use_bytes - self.budget_bytes)
            enforce_budget(
                self.budget_bytes,
                in_use_bytes,
                accounted_bytes=in_use_bytes - requested,  # in use before the failed request
                requested_bytes=requested,
            )
        except BudgetOutOfMemoryError as exc:
            self._record_oom(exc)
            exc._edo_recorded = True  # type: ignore[attr-defined]
            raise

    # ------------------------------------------------------------------ activation profile
    def _arm_activation_profile(self) -> None:
        """Every ``profile_interval_s``, record the next step's forward per module."""
        if (
            not self.track_activations
            or self.model is None
            or self._recorder is not None
            or time.monotonic() - self._profiled_at_s < self.profile_interval_s
        ):
            return
        tracker = self._tracker
        chain = (tracker.pack, tracker.unpack) if tracker is not None else None
        self._recorder = ActivationRecorder(self.model, chain=chain).__enter__()

    def _collect_activation_profile(self) -> None:
        if self._recorder is None:
            return
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        self._profiled_at_s = time.monotonic()
        for err in recorder.errors:  # its hooks caught them; the forward went on
            self._agent_error("activation profile hook", err)
        profile = recorder.profile()
        self.activation_profile = profile
        now = time.time()
        for module, nbytes in sorted(profile.exclusive_bytes.items()):
            if nbytes > 0 or module in self._module_rows:
                self._update_module_row(module or "<model>", now, activations_bytes=nbytes)

    # ------------------------------------------------------------------ policy
    def _action_context(self, reading: Reading | None = None) -> ActionContext:
        assert self.model is not None
        return ActionContext(
            self.model,
            self.optimizers,
            cuda_mode=self.device_kind == "cuda",
            reserved_unallocated_bytes=reading.reserved_unallocated_bytes if reading else None,
            release_cache_min_bytes=self.policy.release_cache_min_bytes,
            activation_profile=self.activation_profile,
            lookup_counter=self._lookups,
            budget_bytes=reading.budget_bytes if reading else None,
            in_use_bytes=reading.in_use_bytes if reading else None,
            rearm_free_fraction=self.policy.rearm_free_fraction,
            grow_margin_fraction=self.policy.grow_margin_fraction,
            host_available_bytes=reading.host_available_bytes if reading else None,
        )

    def _evaluate_policy(self, reading: Reading) -> None:
        """Sampler thread: crossings and at most one decision per reading (applied later)."""
        planner = make_planner(self._action_context(reading)) if self.model is not None else None
        for event in self.policy.evaluate(reading, planner):
            if isinstance(event, ThresholdCrossing):
                below = event.kind == "below_floor"
                self._emit(
                    "threshold_crossed",
                    f"free {event.free_fraction:.1%} "
                    + ("below the floor" if below else "back above the re-arm level")
                    + f" {event.threshold_fraction:.0%}",
                    {
                        "direction": "below" if below else "above",
                        "free_fraction": event.free_fraction,
                        "floor": self.policy.min_free_fraction,
                        "threshold": event.threshold_fraction,
                        "in_use_bytes": reading.in_use_bytes,
                        "budget_bytes": reading.budget_bytes,
                    },
                )
                self._pressure_queue.append(event)
            elif isinstance(event, Decision):
                err = event.expected_error
                data = {
                    "action": event.action,
                    "target": event.target,
                    "estimated_saving_bytes": event.estimated_saving_bytes,
                    "expected_error": err,
                    "reason": event.reason,
                    "mode": event.mode,
                    "free_fraction": event.free_fraction,
                }
                if event.forecast is not None:
                    data["forecast"] = event.forecast.index
                if event.planning_in_use_bytes is not None:
                    data["planning_in_use_bytes"] = event.planning_in_use_bytes
                self._emit(
                    "decision",
                    f"{'advise' if event.advisory else 'decide'}: {event.action} on "
                    f"{event.target or '-'} (est. {format_bytes(event.estimated_saving_bytes)}"
                    + (f", expected error {err:.2g})" if err is not None else ")")
                    + (" ahead of a forecast crossing" if event.forecast is not None else ""),
                    data,
                )
            elif isinstance(event, Forecast):
                self._emit_forecast(event)
            elif isinstance(event, ForecastOutcome):
                self._emit_forecast_outcome(event)
            else:
                self._emit(
                    "no_action",
                    ("a crossing is forecast" if event.forecast else "under pressure")
                    + ", but no action on the ladder applies",
                    {
                        "free_fraction": event.free_fraction,
                        "refusals": [
                            {"action": r.action, "target": r.target, "reason": r.reason}
                            for r in event.refusals
                        ],
                        **({"forecast": True} if event.forecast else {}),
                    },
                )

    def _emit_forecast(self, forecast: Forecast) -> None:
        """A ``forecast`` event: the prediction, as :meth:`Forecast.as_dict` gives it."""
        driver = next(iter(forecast.category_slopes), None)
        self._emit(
            "forecast",
            f"free {forecast.free_fraction:.1%} now, predicted below the "
            f"{forecast.floor_fraction:.0%} floor in {forecast.steps_ahead} steps (step "
            f"{forecast.predicted_step}) at +{format_bytes(round(forecast.slope_bytes_per_step))}"
            "/step"
            + (
                f", mostly {driver[0].removesuffix('_bytes')}"
                if driver is not None and driver[1] > 0
                else ""
            ),
            {**forecast.as_dict(), "forecast": forecast.index},
        )

    def _emit_forecast_outcome(self, outcome: ForecastOutcome) -> None:
        """A ``forecast_outcome`` event: whether forecast ``forecast`` (its index) came true."""
        fc = outcome.forecast
        if outcome.came_true:
            verdict = (
                f"came true: free below the floor at step {outcome.crossing_step}"
                + (" without the actions taken since" if outcome.saved_bytes else "")
                + f", {outcome.lead_steps} steps after the warning"
            )
        elif outcome.came_true is None:
            verdict = f"not judged: the run ended at step {outcome.step}"
        else:
            verdict = f"did not come true: free stayed above the floor to step {outcome.step}"
        self._emit(
            "forecast_outcome",
            f"forecast {fc.index} (step {fc.step}, predicted step {fc.predicted_step}) {verdict}",
            {
                "forecast": fc.index,
                "forecast_step": fc.step,
                "predicted_step": fc.predicted_step,
                "came_true": outcome.came_true,
                "crossing_step": outcome.crossing_step,
                "lead_steps": outcome.lead_steps,
                "judged_at_step": outcome.step,
                "saved_bytes": outcome.saved_bytes,
            },
        )

    def _deliver_pressure_hooks(self) -> None:
        while self._pressure_queue:
            crossing = self._pressure_queue.pop(0)
            err = self.policy.call_on_pressure(crossing)
            if err is not None:
                self._agent_error("on_pressure hook", err)

    def _apply_pending_decision(self) -> None:
        if self.policy is None or self.model is None:
            return
        decision = self.policy.pending
        if decision is None or decision.advisory:
            return
        ctx = self._action_context(self.latest)
        if decision.planning_in_use_bytes is not None:  # sized for the in-use forecast ahead
            ctx.in_use_bytes = max(ctx.in_use_bytes or 0, decision.planning_in_use_bytes)
        try:
            result = ACTIONS[decision.action].apply(ctx, decision.plan)
        except Exception as exc:  # Action.apply raised (e.g. its plan() at apply time): failed
            logger.warning("action %s raised at apply time: %r", decision.action, exc)
            result = ActionResult(
                decision.action,
                decision.target,
                "failed",
                estimated_saving_bytes=decision.estimated_saving_bytes,
                reason=f"{type(exc).__name__}: {exc}",
                exception=exc,
            )
        # resolved once: a failed decision is never retried on the same target
        ineffective = self.policy.resolve(decision, result)
        kind = {"applied": "action", "refused": "action_refused"}.get(
            result.status, "action_failed"
        )
        data = {
            "action": result.action,
            "target": result.target,
            "status": result.status,
            "estimated_saving_bytes": result.estimated_saving_bytes,
            "bytes_before": result.bytes_before,
            "bytes_after": result.bytes_after,
            "saved_bytes": result.saved_bytes if result.status == "applied" else 0,
            "duration_s": result.duration_s,
            "lossy": result.lossy,
            "expected_error": decision.expected_error,
            "error": result.error,
            "reason": result.reason,
            "details": result.details,
            "decided_at_step": decision.step,
        }
        if result.status == "applied":
            message = (
                f"{result.action} on {result.target}: saved {format_bytes(result.saved_bytes)} "
                f"in {result.duration_s:.3f} s"
            )
            # the accounting after the action, taken here on the training thread at the step
            # boundary, gradients alive: the next readings see the model as it is now (without
            # it they fell back to an accounting without gradients until the next boundary, and
            # a brief jump of free memory could end a pressure episode falsely)
            acc = self._account()
            if self._tracker is not None:
                self._tracker.set_params(self._model_tensors())
                self._tracker.static_bytes = acc.total_bytes
            self._step_accounting = acc
            if self._lookups is not None:  # the action may have swapped a table: count the new one
                self._lookups.watch_tables(self.model)
        else:
            message = f"{result.action} on {result.target or '-'} {result.status}: {result.reason}"
        self._emit(kind, message, data)
        if ineffective is not None:  # the ladder moves on from this (action, target)
            self._emit(
                "action_ineffective",
                f"{result.action} on {result.target} ineffective: {ineffective}",
                {"action": result.action, "target": result.target, "reason": ineffective},
            )
        err = self.policy.call_on_action(result)
        if err is not None:
            self._agent_error("on_action hook", err)
        if result.status == "failed" and self.strict and result.exception is not None:
            raise result.exception

    # ------------------------------------------------------------------ sampler thread
    def _sample_loop(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self._sample_once()
            except Exception as exc:
                self._agent_error("sampler", exc)
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # we fell behind: skip the missed ticks rather than burst
                next_t = time.monotonic()
                delay = 0.0
            if self._stop.wait(delay):
                break

    def _model_tensors(self) -> list[torch.Tensor]:
        """Parameters and buffers: counted as ``params_bytes``, so never as activations."""
        if self.model is None:
            return []
        return [*self.model.parameters(), *self.model.buffers()]

    def _account(self, *, include_grads: bool = True) -> Accounting:
        return account(
            self.model,
            self.optimizers,
            cuda_mode=self.device_kind == "cuda",
            include_grads=include_grads,
        )

    def _sample_once(self) -> Reading:
        """One reading: the sampler thread's tick, and the last one after it has stopped."""
        now = time.time()
        values: dict[str, Any] = {}
        values.update(self._probes["host"].read())
        # the last step boundary's accounting (gradients alive) is the step's peak; between
        # boundaries gradients may be gone, so a reading taken there would flap around the floor
        acc = self._step_accounting
        if acc is None:  # no step boundary yet: sizes only (this thread must not read .grad)
            acc = self._account(include_grads=False)
        self._want_step_accounting = True
        self.accounting = acc
        # the highest saved-for-backward bytes alive at once since the previous sample, and at
        # least the peak of the current step so far and of the last finished step: a sample
        # taken between a backward() and the next forward still counts what the step saved
        # (else readings swing with the moment they land in the step, and the policy decides on
        # one reading and applies on another)
        tracker = self._tracker
        activations = (
            max(tracker.take_peak(), tracker.step_peak_bytes, tracker.last_step_bytes)
            if tracker is not None
            else None
        )
        values.update(
            params_bytes=acc.params_bytes,
            grads_bytes=acc.grads_bytes,
            optimizer_state_bytes=acc.optimizer_state_bytes,
            host_tier_bytes=acc.host_bytes,
            activations_bytes=activations,
        )
        cache_tables = self._cache_counters()
        values.update(_sum_cache_counters(cache_tables))
        budget = self.budget_bytes
        if self.device_kind == "cuda":
            nvml = self._probes["nvml"]
            values.update(nvml.read())
            values.update(self._probes["cuda"].read(with_device_info=not nvml.available))
            if self.budget_bytes_requested is not None:
                in_use = values.get("reserved_bytes")
            else:
                in_use = values.get("device_used_bytes")
        else:
            in_use = acc.total_bytes + (activations or 0)
        free_fraction = None
        if budget and in_use is not None:
            free_fraction = (budget - in_use) / budget
        reading = Reading(
            time_s=now,
            step=self.steps,
            device_kind=self.device_kind,
            budget_bytes=budget,
            in_use_bytes=in_use,
            free_fraction=free_fraction,
            **values,
        )
        self.latest = reading
        self._samples += 1
        self._update_peaks(reading)
        if self._writer is not None:
            self._writer.put_sample(reading)
            self._write_changed_tables(acc, now)
            self._write_cache_rows(cache_tables, now)
        if self._tensorboard is not None:
            self._tensorboard.add_reading(reading)
        if self.policy is not None:
            self._evaluate_policy(reading)
        return reading

    def _update_peaks(self, r: Reading) -> None:
        for key in self._peaks:
            self._peaks[key] = _max(self._peaks[key], getattr(r, key))
        f = r.free_fraction
        if f is not None and (self._min_free_fraction is None or f < self._min_free_fraction):
            self._min_free_fraction = f

    def _write_changed_tables(self, acc: Accounting, now: float) -> None:
        for t in acc.tables + acc.modules:
            # gradients come and go with zero_grad(set_to_none=True): keep each table's peak
            old = self._module_rows.get(t.module, {})
            self._update_module_row(
                t.module,
                now,
                kind=t.kind,
                num_embeddings=t.num_embeddings or None,
                embedding_dim=t.embedding_dim or None,
                dtype=t.dtype,
                device=t.device,
                placement=t.placement,
                params_bytes=t.params_bytes,
                grads_bytes=max(t.grads_bytes, old.get("grads_bytes", 0)),
                optimizer_state_bytes=t.optimizer_state_bytes,
            )

    def _cache_counters(self) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
        """Each cached table's counters (``CachedTable.stats()``): ``name -> (totals since it
        was cached, increments since the previous sample)`` (sampler thread)."""
        if self.model is None:
            return {}
        out = {}
        seen = set()
        for name, module in self.model.named_modules():
            if not isinstance(module, CachedTable):
                continue
            totals = module.stats().history_totals()
            key = (name, id(module))
            seen.add(key)
            prev = self._cache_prev.get(key, {})
            increments = {k: max(0, v - prev.get(k, 0)) for k, v in totals.items()}
            increments["cache_rows"] = totals["cache_rows"]
            self._cache_prev[key] = totals
            out[name] = (totals, increments)
        for key in [k for k in self._cache_prev if k not in seen]:  # grown back, or replaced
            del self._cache_prev[key]
        return out

    def _write_cache_rows(
        self, tables: Mapping[str, tuple[dict[str, int], dict[str, int]]], now: float
    ) -> None:
        """Each cached table's totals into its module row; ``None`` once a table has no cache."""
        for name, (totals, _) in tables.items():
            self._update_module_row(name, now, **totals)
        for name, row in list(self._module_rows.items()):
            if name not in tables and row.get("cache_rows") is not None:
                self._update_module_row(name, now, **dict.fromkeys(CACHE_FIELDS))

    def _update_module_row(self, module: str, now: float, **fields: Any) -> None:
        """Merge ``fields`` into the module's latest row; queue a new row when it changed.

        One row per module holds every category (a table's bytes and the activations its
        forward saved), so the latest row of a module is its whole state.
        """
        old = self._module_rows.get(module)
        if old is None:
            old = {
                "module": module,
                "kind": self._module_kind(module),
                "num_embeddings": None,
                "embedding_dim": None,
                "dtype": None,
                "device": None,
                "placement": None,
                "params_bytes": 0,
                "grads_bytes": 0,
                "optimizer_state_bytes": 0,
                "activations_bytes": 0,
            }
        row = {**old, **fields}
        if row == self._module_rows.get(module):
            return
        self._module_rows[module] = row
        if self._writer is not None:
            self._writer.put_module_stat({**row, "time_s": now, "step": self.steps})

    def _module_kind(self, module: str) -> str:
        if self.model is None:
            return "module"
        if module == "<model>":
            return type(self.model).__name__
        try:
            return type(self.model.get_submodule(module)).__name__
        except AttributeError:
            return "module"

    def breakdown(self) -> list[dict[str, Any]]:
        """Module × category attribution, largest first: one dict per module with ``module``,
        ``kind``, ``params_bytes``, ``grads_bytes`` (peak seen), ``optimizer_state_bytes``,
        ``activations_bytes`` (from the last per-module profile) and ``total_bytes``.

        On CUDA a last row ``module="other"`` holds ``allocated_bytes`` (``memory_stats``) minus
        every known category of the latest reading: the CUDA context's neighbours, temporaries,
        tensors the agent cannot see.
        """
        rows = []
        for row in list(self._module_rows.values()):
            total = (
                row["params_bytes"]
                + row["grads_bytes"]
                + row["optimizer_state_bytes"]
                + row["activations_bytes"]
            )
            rows.append({**row, "total_bytes": total})
        rows.sort(key=lambda r: r["total_bytes"], reverse=True)
        latest = self.latest
        if latest is not None and latest.allocated_bytes is not None:
            known = sum(
                getattr(latest, k) or 0
                for k in (
                    "params_bytes",
                    "grads_bytes",
                    "optimizer_state_bytes",
                    "activations_bytes",
                )
            )
            rows.append(
                {"module": "other", "kind": "other", "total_bytes": latest.allocated_bytes - known}
            )
        return rows

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

    def _recovery_point(self) -> None:
        """Between a failed attempt and its retry: pressure hooks, then the pending policy
        action (no step is counted, nothing is measured). Never raises."""
        if os.getpid() != self._pid or self._stop.is_set() or self.status != "running":
            return
        try:
            self._deliver_pressure_hooks()
            self._apply_pending_decision()
        except Exception as exc:
            self._agent_error("recovery point", exc)

    # ------------------------------------------------------------------ OOM
    def _record_oom(self, exc: BaseException) -> None:
        """Record an ``oom`` event for an out-of-memory error (the error is re-raised as is)."""
        try:
            from edo_monitor.oom import parse_oom_message

            info = parse_oom_message(str(exc))
            if info is None and not isinstance(exc, torch.OutOfMemoryError):
                return
            tables = sorted(self.accounting.tables, key=lambda t: t.total_bytes, reverse=True)
            data = {
                "exception": type(exc).__name__,
                "parsed": _oom_dict(info),
                "raw": str(exc)[:4000],
                "last_reading": self.latest.as_dict() if self.latest is not None else None,
                "top_consumers": [
                    {"module": t.module, "total_bytes": t.total_bytes, "placement": t.placement}
                    for t in tables[:5]
                ],
            }
            self._emit("oom", f"out of memory: {str(exc).splitlines()[0][:300]}", data)
        except Exception as err:
            self._agent_error("oom capture", err)

    # ------------------------------------------------------------------ user API
    def summary(self) -> RunSummary:
        """Steps, peaks, minimum free fraction, events and actions so far (:class:`RunSummary`)."""
        return RunSummary(
            run_id=self.run_id,
            run_uuid=self.run_uuid,
            run_name=self.run_name,
            status=self.status,
            device_kind=self.device_kind,
            db_url=self.db_url.render_as_string(hide_password=True),
            steps=self.steps,
            samples=self._samples,
            samples_dropped=self._writer.dropped if self._writer is not None else 0,
            samples_written=self._writer.written["samples"] if self._writer is not None else 0,
            rows_not_written=dict(self._writer.not_written) if self._writer is not None else {},
            recorded_status=(
                self._recorded_status if self.status not in ("running", "created") else "running"
            ),
            store_problem=self._writer.problem if self._writer is not None else None,
            budget_bytes=self.budget_bytes,
            peak_in_use_bytes=self._peaks["in_use_bytes"],
            peak_allocated_bytes=self._peaks["allocated_bytes"],
            peak_reserved_bytes=self._peaks["reserved_bytes"],
            peak_activations_bytes=self._peaks["activations_bytes"],
            min_free_fraction=self._min_free_fraction,
            events=dict(self._events),
            actions=tuple(self._actions),
            agent_errors=dict(self._agent_errors),
        )


def _oom_dict(info: Any) -> dict[str, Any] | None:
    if info is None:
        return None
    import dataclasses

    d = dataclasses.asdict(info)
    d.pop("raw", None)
    return d


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

    Returns:
        A :class:`Monitor` (entering it starts the run).

    Raises:
        ConfigError: (a ``ValueError``) for a bad argument, naming the value; ``tensorboard``
            without the ``tensorboard`` package.
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
    )
