"""The Lightning callback's body, shared by the ``lightning.pytorch`` and ``pytorch_lightning``
flavours (each module subclasses its own package's ``Callback`` with this mixin first).

No Lightning import here: the trainer and module are used through the attributes both packages
have (``trainer.optimizers``, ``trainer.logger``, ``trainer.loggers``, ``trainer.global_rank``).
"""

from __future__ import annotations

import logging
from typing import Any

from edo_monitor.agent.monitor import Monitor
from edo_monitor.errors import ConfigError
from edo_monitor.integrations._common import (
    align_tensorboard,
    derived_run_name,
    record_resume,
    run_config,
    torch_optimizers,
    watch_options,
)
from edo_monitor.nn import attach_cached_tables

__all__ = ["LightningCallbackMixin", "lightning_run_name"]

logger = logging.getLogger(__name__)


def lightning_run_name(trainer: Any, module: Any) -> str:
    """The run's name: ``"<logger name>/<version>"`` of the trainer's (first) logger, e.g.
    ``"lightning_logs/version_3"`` for a ``CSVLogger`` or ``TensorBoardLogger`` (an int version
    is written ``version_N``, as their folders are); the logger's name alone when it has no
    version; the LightningModule's class name without a logger, or when the logger cannot say
    (an error reading it is logged at debug level). Made a name ``watch()`` takes, as
    :func:`~edo_monitor.integrations._common.derived_run_name` says: each control character (a
    tab in the logger's name, say) a space, at most ``RUN_NAME_MAX_CHARS`` characters."""
    fallback = type(module).__name__
    lg = getattr(trainer, "logger", None)
    if lg is not None:
        try:
            name, version = lg.name, lg.version
        except Exception:
            logger.debug("the logger's name/version could not be read", exc_info=True)
            name = version = None
        if name:
            if version is None or version == "":
                return derived_run_name(name, fallback)
            v = f"version_{version}" if isinstance(version, int) else str(version)
            return derived_run_name(f"{name}/{v}", fallback)
    return fallback


class LightningCallbackMixin:
    """Watches the LightningModule for the fit; see ``EdoMonitorCallback`` in
    :mod:`edo_monitor.integrations.lightning` for the user-facing description."""

    def __init__(
        self,
        *,
        policy: Any = None,
        budget: int | str | None = None,
        db: Any = None,
        tensorboard: Any = None,
        **watch_kwargs: Any,
    ) -> None:
        super().__init__()
        self._watch_kwargs = watch_options("EdoMonitorCallback", policy, budget, db, watch_kwargs)
        self._tensorboard = tensorboard
        #: the current (or last) fit's :class:`~edo_monitor.Monitor`; ``None`` before a fit
        self.monitor: Monitor | None = None
        #: the run a checkpoint being resumed was saved from (its :meth:`state_dict`)
        self._resumed_from: dict[str, Any] | None = None
        #: the global step of the checkpoint being resumed (``on_load_checkpoint``)
        self._resumed_global_step: int | None = None

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the callback: the run it was saved from (``run_id``,
        ``run_uuid``, ``step``), so that a fit resumed from it names that run."""
        m = self.monitor
        if m is None or not m.run_uuid:
            return {}
        return {"run_id": m.run_id, "run_uuid": str(m.run_uuid), "step": m.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores a checkpoint (``fit(ckpt_path=)``, before ``on_fit_start``)."""
        self._resumed_from = dict(state_dict) if state_dict.get("run_uuid") else None

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Lightning loads a checkpoint to resume (before ``on_fit_start``; its loops, and so
        ``trainer.global_step``, are restored only after it): keep its global step, where the
        resumed fit's TensorBoard steps start."""
        step = checkpoint.get("global_step")
        self._resumed_global_step = step if isinstance(step, int) else None

    # ------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Start the run: the module (on its device by now) and the trainer's optimizers."""
        if self.monitor is not None:
            self.monitor.stop()  # a fit whose end never came (no-op when it ended)
            self._restore_sigterm()  # left by a failed fit (Lightning's teardown put it back)
        kwargs = dict(self._watch_kwargs)
        if kwargs.get("run_name") is None:  # the user's run_name= is watch()'s to check
            kwargs["run_name"] = lightning_run_name(trainer, pl_module)
        own = {
            "integration": "lightning",
            "lightning_package": type(trainer).__module__.split(".")[0],
            "max_steps": getattr(trainer, "max_steps", None),
            "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", None),
        }
        kwargs["config"] = run_config(own, kwargs.get("config"))
        resumed = self._resumed_from
        self._resumed_from = None
        resumed_step, self._resumed_global_step = self._resumed_global_step, None
        if resumed is not None:
            resumed = {**resumed, "checkpoint": _checkpoint_path(trainer)}
            kwargs["config"]["resumed_from"] = resumed
        optimizers = torch_optimizers(getattr(trainer, "optimizers", None) or [])
        # tables an earlier fit cached: the optimizers configure_optimizers() just made hold
        # their row buffers, and a checkpoint's optimizer state (restored after this hook)
        # loads only into an attached one
        try:
            attach_cached_tables(pl_module, optimizers)
        except (TypeError, ValueError) as exc:  # a new optimizer the cache refuses: its step says
            logger.warning(
                "edo-monitor: a cached table could not attach at the fit's start: %s", exc
            )
        self.monitor = Monitor(
            pl_module,
            optimizers or None,
            tensorboard=self._resolve_tensorboard(trainer),
            **kwargs,
        )
        # the scalars sit on the trainer's global step (a resumed fit's starts at the checkpoint's)
        step = getattr(trainer, "global_step", 0)
        align_tensorboard(self.monitor, resumed_step if resumed_step is not None else step)
        self.monitor.start()
        if resumed is not None:
            record_resume(self.monitor, resumed)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The trainer's loops are restored by now: its ``global_step`` is where the fit's
        TensorBoard steps start (the checkpoint's step, known earlier, unless the strategy
        restores after setup), and a checkpoint's run restored after ``on_fit_start`` (such a
        strategy) is recorded now (``resumed_from``)."""
        if self.monitor is not None and self.monitor.status == "running":
            align_tensorboard(self.monitor, getattr(trainer, "global_step", None))
            resumed, self._resumed_from = self._resumed_from, None
            if resumed is not None:  # a strategy that restores after setup: loaded since
                checkpoint = _checkpoint_path(trainer)
                record_resume(self.monitor, {**resumed, "checkpoint": checkpoint})

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The fit loop is done: the run is ``finished`` (before the strategy's teardown moves
        the module off the device, so the last reading still sees it there)."""
        self._stop(None)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """A fit that never ran its training loop ends here."""
        self._stop(None)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The last hook of a fit: whatever is still running ends ``finished``, and SIGTERM's
        action is the one before the fit again. A checkpoint loaded and not taken by a fit
        (``validate(ckpt_path=)``) is forgotten: the next fit is not resumed from it."""
        if str(getattr(stage, "value", stage)) == "fit":
            self._stop(None)
        self._restore_sigterm()
        self._resumed_from = None
        self._resumed_global_step = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """The fit (or validate, test, predict) raised: the run is ``failed`` with ``exception``
        (``interrupted`` for Ctrl-C, which Lightning turns into a graceful shutdown). Lightning
        calls no ``teardown`` after it: a checkpoint loaded for it is forgotten here (the next
        fit was recorded as resumed from it), and SIGTERM's handler, which Lightning puts back
        after this hook, is an ended run's: the next run takes its place
        (:func:`~edo_monitor.signals.terminate_on_sigterm`)."""
        self._stop(exception)
        self._resumed_from = None
        self._resumed_global_step = None

    # ------------------------------------------------------------------ helpers
    def _stop(self, exc: BaseException | None) -> None:
        if self.monitor is not None:
            self.monitor.stop(exc)

    def _restore_sigterm(self) -> None:
        """Put back the SIGTERM action the ended run's monitor replaced. The monitor's handler
        (SIGTERM raises :class:`~edo_monitor.signals.Terminated` while the run lasts) is what
        Lightning's signal connector finds at the fit's start: it calls it from its own during
        the fit, and puts it back when the trainer tears down, after the monitor's ``stop()``
        found Lightning's handler in its place and so left it. The monitor's own restore, called
        again once that is done, puts back the default action (only if its handler is still
        the process's)."""
        monitor = self.monitor
        if monitor is None or monitor.status == "running":
            return
        try:
            monitor._restore_sigterm()
        except Exception:  # never the training's failure
            logger.debug("the SIGTERM handler could not be put back", exc_info=True)

    def _resolve_tensorboard(self, trainer: Any) -> Any:
        """``tensorboard=True``: the ``SummaryWriter`` of the trainer's ``TensorBoardLogger``
        (the scalars land in the logger's own run); off on ranks other than 0, where Lightning
        gives loggers no writer."""
        if self._tensorboard is not True:
            return self._tensorboard
        if getattr(trainer, "global_rank", 0) != 0:
            return None
        for lg in getattr(trainer, "loggers", None) or []:
            if type(lg).__name__ == "TensorBoardLogger":
                return lg.experiment
        raise ConfigError(
            "EdoMonitorCallback(tensorboard=True) needs a TensorBoardLogger on the Trainer; "
            "pass a log folder or a SummaryWriter instead"
        )


def _checkpoint_path(trainer: Any) -> str | None:
    """The checkpoint the trainer loaded (``ckpt_path``), ``None`` when it names none (it read
    ``'None'``)."""
    path = getattr(trainer, "ckpt_path", None)
    return None if path is None else str(path)
