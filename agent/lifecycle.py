"""The monitor's start and end, in order: device, accounting, the run row and writer, hooks,
sampler, /metrics; then the last reading, the run's status, the teardown."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from edo_monitor.agent.activations import ActivationTracker
from edo_monitor.agent.ranks import (
    Coordinator,
    detect_ranks,
)
from edo_monitor.errors import ConfigError
from edo_monitor.exporters.prometheus import (
    start_for_monitor,
)
from edo_monitor.measure.frequency import LookupCounter
from edo_monitor.nn.spill import remove_run_spill_files
from edo_monitor.signals import Terminated, terminate_on_sigterm
from edo_monitor.store.spill_files import report_leftovers
from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def exit_code(exc: SystemExit) -> int:
    """The process's exit status when ``exc`` ends it, as Python sets it: ``None`` is 0, an int
    (``True``/``False`` too) is itself, anything else (``sys.exit("message")``) is printed and
    is 1."""
    code = exc.code
    if code is None:
        return 0
    return int(code) if isinstance(code, int) else 1


def ended_by(exc: BaseException | None) -> tuple[str, str | None]:
    """The status and error a run ended by ``exc`` records (``None``: the block ended).

    * ``None``, or a ``SystemExit`` whose exit status is 0 (``sys.exit()``, ``sys.exit(0)``:
      a clean early stop), or ``GeneratorExit`` (a training generator holding the block, which
      its consumer stopped: ``break``, ``close()``): ``finished``, no error;
    * ``KeyboardInterrupt``: ``interrupted``, error ``KeyboardInterrupt``;
    * SIGTERM (:class:`~edo_monitor.signals.Terminated`, a ``SystemExit(143)``):
      ``interrupted``, error ``SIGTERM``;
    * any other ``SystemExit`` (``sys.exit(2)``, ``sys.exit("message")``): ``failed``, error
      ``SystemExit: exit code N`` (and the message);
    * any other exception: ``failed``, error ``"<type>: <message>"``.
    """
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "KeyboardInterrupt"
    if isinstance(exc, Terminated):
        return "interrupted", "SIGTERM"
    if isinstance(exc, SystemExit):
        code = exit_code(exc)
        if code == 0:
            return "finished", None
        shown = "" if isinstance(exc.code, int) else f": {_text(exc.code)}"
        return "failed", f"SystemExit: exit code {code}{shown}"[:2000]
    if exc is not None and not isinstance(exc, GeneratorExit):
        return "failed", f"{type(exc).__name__}: {_text(exc)}"[:2000]
    return "finished", None


def _text(value: object) -> str:
    """``str(value)`` (an exception, an exit code), or what stands for it when the user's
    ``__str__`` raised (the agent's error took the place of the user's exception, and the run
    stayed ``running`` with its threads alive)."""
    try:
        return str(value)
    except Exception as err:
        return f"<str() of the {type(value).__name__} raised {type(err).__name__}>"


#: The keys of a run's ``config`` that the agent writes itself, some of them read back by the
#: history's readers (``floor`` and ``policy`` by explain and the dashboard, ``parallel_wrapper``
#: by the staged plan): a key of ``watch(config=...)`` never replaces one of them.
AGENT_CONFIG_KEYS = frozenset(
    {
        "interval_s",
        "snapshot_interval_s",
        "track_activations",
        "enforce",
        "policy",
        "floor",
        "model",
        "parallel_wrapper",
        "snapshots",
        "sync_every_steps",
    }
)
#: What a user's key that names one of :data:`AGENT_CONFIG_KEYS` is recorded as: ``user.<key>``.
USER_KEY_PREFIX = "user."


def user_config_entries(user_config: Mapping[str, Any]) -> dict[str, Any]:
    """``watch(config=...)`` as recorded beside the agent's keys: each key as given, except one
    that names an agent's key (:data:`AGENT_CONFIG_KEYS`), which is kept under
    ``user.<key>`` (prefixed again while the user's config holds that name too) with one
    warning naming them; the training goes on."""
    out: dict[str, Any] = {}
    moved: list[str] = []
    for key, value in user_config.items():
        name = key
        if key in AGENT_CONFIG_KEYS:
            name = USER_KEY_PREFIX + key
            while name in user_config:
                name = USER_KEY_PREFIX + name
            moved.append(f"{key!r} as {name!r}")
        out[name] = value
    if moved:
        logger.warning(
            "edo-monitor: config keys the agent records itself are kept under another name: "
            "%s (the run's config keeps the agent's value of each)",
            ", ".join(moved),
        )
    return out


class _Lifecycle:
    """The monitor's start and end, in order: device, accounting, the run row and writer, hooks,"""

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
        mode = getattr(self.policy, "mode", "auto")  # a policy of the user's own may have none
        no_free_reading = device.kind != "cuda" and device.budget_bytes is None
        if no_free_reading and self.policy is not None and mode != "observe":
            logger.warning(
                "edo-monitor: the policy cannot act here: nothing measures free memory (no CUDA "
                "device holds the model, and no budget= was given); give budget= to run it "
                "against a CPU budget"
            )
        from edo_monitor.actions.base import find_wrapped_parallel

        config = {
            "interval_s": self.interval_s,
            "snapshot_interval_s": self.snapshot_interval_s,
            "track_activations": self.track_activations,
            "enforce": self.enforce,
            "policy": repr(self.policy) if self.policy is not None else None,
            "floor": self.policy.min_free_fraction if self.policy is not None else None,
            "model": type(self.model).__name__ if self.model is not None else None,
            # DDP keeps replicas, FSDP shards: the staged plan's stage 3 depends on which
            "parallel_wrapper": find_wrapped_parallel(self.model)
            if self.model is not None
            else None,
            "snapshots": self.snapshots,
            **({"sync_every_steps": self.sync_every_steps} if self.ranks is not None else {}),
        }
        config.update(user_config_entries(self.user_config))  # never one of the agent's keys
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
            # a log dir that cannot be written: one agent_error; a rank of a job writes into
            # rank<N> of it (one folder for all was one TensorBoard run mixing the ranks)
            self._tensorboard.open(rank=self.rank if (self.world_size or 1) > 1 else None)
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
        unseen = (
            ""
            if self.optimizers
            else "; the state of an optimizer not given to watch() is "
            "not counted until its first step"
        )
        held = (
            f"the watched model already holds {acc.total_bytes} bytes "
            f"({format_bytes(acc.total_bytes)}: params {acc.params_bytes}, grads "
            f"{acc.grads_bytes}, optimizer state {acc.optimizer_state_bytes}{unseen}) on the "
            "device tier"
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
                window_of=None if self.scripted else self.model,
            ).__enter__()
            if self._safe_point.enforcing:
                self._safe_point.start_enforcing()
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
            except Exception as err:  # not ``exc``: the handler would unbind the run's error
                self._agent_error("end of run", err)
        status, error = ended_by(exc)
        if status == "failed" and not getattr(exc, "_edo_recorded", False):
            self._record_oom(exc)
        elif (
            status == "finished"
            and self.steps == 0
            and self.policy is not None
            and self.policy.mode == "auto"
        ):
            logger.warning(
                "edo-monitor: run %s saw no optimizer step, so the policy had no step "
                "boundary to act at; a loop that updates the parameters itself calls "
                "monitor.step() after each update",
                self.run_id,
            )
        if status == "finished" and self.steps and getattr(self.loader, "passes", 1) == 0:
            logger.warning(
                "edo-monitor: watch(loader=) was given but monitor.loader was never iterated, "
                "so no row cache had a look-ahead; iterate monitor.loader, not the loader"
            )
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

    def _abort_start(self, exc: BaseException) -> None:
        """Undo a start that raised ``exc``: stop what started and, when the run's row was
        written already, record how the run ended (:func:`ended_by`: ``failed`` with the error,
        ``interrupted`` for Ctrl-C or SIGTERM) instead of leaving it ``running``."""
        try:
            self._teardown()
        finally:
            if self.run_id >= 0:
                status, error = ended_by(exc)
                self._run.record_end(status, error, self.steps)  # never raises
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
            self.metrics_server = None  # the docs' "None otherwise": not a closed endpoint
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
