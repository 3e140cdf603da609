"""Hugging Face ``Trainer``: ``EdoMonitorCallback`` watches the model for ``trainer.train()``.

.. code-block:: python

    from transformers import Trainer
    from edo_monitor.integrations.transformers import EdoMonitorCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[EdoMonitorCallback(budget="12GiB")])
    trainer.train()

How a failed ``train()`` is recorded: the ``Trainer`` has no exception callback — an exception
leaves ``train()`` without any callback being called — so the callback finds out afterwards:

1. at process exit (``atexit``) a run still open is ended; when SIGTERM ended ``train()`` (while
   the run lasts the monitor turns it into :class:`~edo_monitor.signals.Terminated`, as for
   ``watch()`` and Lightning, unless the process has a SIGTERM handler of its own; the callback
   keeps that exception, which Python does not report as uncaught), the run is ``interrupted``
   with ``SIGTERM``; when Python is exiting because of an uncaught exception that came out of
   the ``Trainer`` this callback belongs to (the interpreter sets ``sys.last_exc`` /
   ``sys.last_value`` before ``atexit`` runs; its traceback holds ``Trainer.train``'s frame),
   the run is ``failed`` with that exception (``interrupted`` for Ctrl-C); otherwise ``failed``
   with :class:`TrainingDidNotEnd`;
2. the next ``train()`` with the same callback ends the open run first, the same way (in a
   notebook the interpreter sets ``sys.last_value`` for the failed cell);
3. or say it yourself, at once: ``except Exception as exc: callback.close(exc); raise``.

Until then the run stays ``running`` and the monitor's hooks stay on (they are cheap and touch
nothing outside the model's optimizer steps). Needs the ``[transformers]`` extra (``transformers``
with ``accelerate``, which the ``Trainer`` needs).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import Any

from edo_monitor.errors import missing_extra

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise missing_extra(
        "edo_monitor.integrations.transformers", "transformers", "transformers", exc
    ) from None

from edo_monitor.agent.monitor import Monitor
from edo_monitor.integrations._common import (
    align_tensorboard,
    derived_run_name,
    record_resume,
    run_config,
    torch_optimizers,
    watch_options,
)
from edo_monitor.signals import Terminated

__all__ = ["EdoMonitorCallback", "TrainingDidNotEnd"]

logger = logging.getLogger(__name__)


class TrainingDidNotEnd(RuntimeError):  # noqa: N818 (it is recorded as the run's error)
    """The error recorded for a run whose ``Trainer.train()`` never reached ``on_train_end``
    and whose exception could not be seen (caught by the caller, or the process ended some other
    way: ``sys.exit`` in a callback, a signal handler of the process's own)."""


#: callbacks whose run is open: their runs are ended at process exit
_open_lock = threading.Lock()
_open: list[EdoMonitorCallback] = []
_atexit_registered = False


def _track(callback: EdoMonitorCallback) -> None:
    global _atexit_registered
    with _open_lock:
        if callback not in _open:
            _open.append(callback)
        if not _atexit_registered:
            atexit.register(_end_open_runs)
            _atexit_registered = True


def _untrack(callback: EdoMonitorCallback) -> None:
    with _open_lock:
        if callback in _open:
            _open.remove(callback)


def _trainer_exception(callback: EdoMonitorCallback) -> BaseException | None:
    """The exception the interpreter last reported as uncaught (``sys.last_exc``, or
    ``sys.last_value`` before Python 3.12), when it came out of a ``Trainer`` that calls
    ``callback``: a frame of ``transformers/trainer.py`` in its traceback whose ``self`` is that
    trainer. Else ``None`` (no such exception, or another trainer's)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException):
        return None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.replace("\\", "/").endswith("transformers/trainer.py"):
            handler = getattr(frame.f_locals.get("self"), "callback_handler", None)
            if any(cb is callback for cb in getattr(handler, "callbacks", ())):
                return exc
        tb = tb.tb_next
    return None


def _end_open_runs() -> None:
    """``atexit``: end every run a callback started and nothing ended."""
    with _open_lock:
        callbacks = list(_open)
    for callback in callbacks:
        try:
            callback._end(callback._unfinished_error())
        except Exception:
            logger.exception("edo-monitor: could not end a run at exit")


#: the key of ``TrainerState.stateful_callbacks`` (in each checkpoint's ``trainer_state.json``)
#: holding the run a checkpoint was saved from
STATE_KEY = "edo_monitor"


def _resumed_from(state: Any, args: Any) -> dict[str, Any] | None:
    """The run a resumed ``train(resume_from_checkpoint=)`` continues (``run_id``,
    ``run_uuid``, ``step``, ``checkpoint``), read from the loaded ``trainer_state.json``; ``None``
    for a fresh ``train()`` (global step 0) or a checkpoint saved without the callback."""
    step = getattr(state, "global_step", 0) or 0
    saved = getattr(state, "stateful_callbacks", None)
    prior = saved.get(STATE_KEY) if isinstance(saved, dict) and step > 0 else None
    if not isinstance(prior, dict) or not prior.get("run_uuid"):
        return None
    folder = os.path.join(str(getattr(args, "output_dir", "") or ""), f"checkpoint-{step}")
    return {
        "run_id": prior.get("run_id"),
        "run_uuid": str(prior["run_uuid"]),
        "step": int(step),
        "checkpoint": folder if os.path.isdir(folder) else None,
    }


class EdoMonitorCallback(TrainerCallback):
    """Watch the ``Trainer``'s model with :func:`edo_monitor.watch` for ``trainer.train()``.

    * **Start**: ``on_train_begin``, with the model and optimizer the ``Trainer`` passes (the
      optimizer unwrapped from accelerate's ``AcceleratedOptimizer``; when it passes none, the
      monitor finds the one that steps the model on its first step). One run per ``train()``.
    * **Steps**: counted at the optimizer step (PyTorch's optimizer step post-hook), once per
      optimizer step — ``state.global_step`` — not per gradient-accumulation micro-batch; a step
      fp16's grad scaler skips (inf/NaN gradients) is not counted. Without a torch optimizer
      (a DeepSpeed engine), ``on_step_end`` counts the step instead.
    * **Actions**: applied at the optimizer step boundary, on the training thread.
    * **Name**: ``run_name=`` when given (checked as ``watch()`` checks it), else
      ``args.run_name``, else the model's class name. A name taken from ``args`` never fails
      ``train()``: each control character in it (a tab, a newline) becomes a space, and it is
      shortened to 200 characters. The run's config records ``integration="transformers"``.
    * **End**: ``on_train_end`` records it ``finished``; a failure as the module docstring says
      (process exit, the next ``train()``, or :meth:`close` with the exception).
    * **Resume**: the run's id and UUID are kept in every checkpoint's ``trainer_state.json``
      (``stateful_callbacks["edo_monitor"]``); ``train(resume_from_checkpoint=)`` is a new run
      whose ``config["resumed_from"]`` and ``resumed_from`` event name that run, the step and
      the checkpoint folder.

    Args:
        policy: an :class:`edo_monitor.Policy` (the auto-tuner); ``None`` records only.
        budget: the memory budget (bytes, or ``"12GiB"``), as in ``watch()``.
        db: the history database (path or SQLAlchemy URL), as in ``watch()``.
        tensorboard: a ``SummaryWriter`` or a log folder, as ``watch(tensorboard=)``
            (the Trainer's TensorBoard folder puts the scalars beside its own logs:
            ``$TENSORBOARD_LOGGING_DIR`` on transformers 5, ``args.logging_dir`` on 4);
            written at the ``Trainer``'s global step (a resumed ``train()``'s continues from the
            checkpoint's step, as its own logs do), while the history counts the run's steps
            from 0.
        **watch_kwargs: any other option of :func:`edo_monitor.watch`.

    Attributes:
        monitor: the current (or last) ``train()``'s :class:`edo_monitor.Monitor`.

    Raises:
        ConfigError: an option ``watch()`` does not take (here), or a bad value (in
            ``on_train_begin``, failing ``train()`` before it trains).
    """

    def __init__(
        self,
        *,
        policy: Any = None,
        budget: int | str | None = None,
        db: Any = None,
        tensorboard: Any = None,
        **watch_kwargs: Any,
    ) -> None:
        self._watch_kwargs = watch_options("EdoMonitorCallback", policy, budget, db, watch_kwargs)
        self._tensorboard = tensorboard
        self.monitor: Monitor | None = None
        #: the SIGTERM that ended the open run's ``train()`` (:meth:`_keep_sigterm`)
        self._terminated: Terminated | None = None
        #: the monitor's SIGTERM handler and this callback's wrapper of it, while installed
        self._sigterm: tuple[Any, Any] | None = None

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **_: Any,
    ) -> None:
        """Start the run (ending one a previous ``train()`` left open, as failed)."""
        self._end(self._unfinished_error())
        self._terminated = None
        if model is None:
            logger.warning(
                "edo-monitor: the Trainer passed no model to on_train_begin; not watching"
            )
            return
        kwargs = dict(self._watch_kwargs)
        if kwargs.get("run_name") is None:  # the user's run_name= is watch()'s to check
            # the Trainer's may be a long path, or hold a tab
            kwargs["run_name"] = derived_run_name(
                getattr(args, "run_name", None), type(model).__name__
            )
        own = {
            "integration": "transformers",
            "max_steps": getattr(state, "max_steps", None),
            "start_global_step": getattr(state, "global_step", None),
            "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
        }
        kwargs["config"] = run_config(own, kwargs.get("config"))
        resumed = _resumed_from(state, args)
        if resumed is not None:
            kwargs["config"]["resumed_from"] = resumed
        optimizers = torch_optimizers([optimizer] if optimizer is not None else [])
        monitor = Monitor(model, optimizers or None, tensorboard=self._tensorboard, **kwargs)
        # the scalars sit on the Trainer's global step, as its own logs (a resumed train()'s
        # starts at the checkpoint's); the history counts the run's steps from 0
        align_tensorboard(monitor, getattr(state, "global_step", 0))
        before = _sigterm_handler()
        monitor.start()
        self.monitor = monitor
        _track(self)
        self._keep_sigterm(before)
        policy = monitor.policy
        if policy is not None and policy.mode == "auto" and _fused(optimizers):
            logger.warning(
                "edo-monitor: the Trainer's optimizer is fused (transformers' default "
                "optim='adamw_torch_fused'), and the embedding-table actions refuse fused "
                "optimizers; pass TrainingArguments(optim='adamw_torch') for them to apply"
            )
        saved = getattr(state, "stateful_callbacks", None)
        if isinstance(saved, dict):  # saved with every checkpoint's trainer_state.json
            saved[STATE_KEY] = {"run_id": monitor.run_id, "run_uuid": str(monitor.run_uuid)}
        if resumed is not None:
            record_resume(monitor, resumed)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        """A step boundary for a loop whose optimizer the monitor cannot hook (no torch
        optimizer found); otherwise the optimizer step has been its boundary already."""
        monitor = self.monitor
        if monitor is not None and monitor.status == "running" and not monitor.optimizers:
            monitor.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        """``train()`` is done: the run is ``finished``."""
        self._end(None)

    def close(self, exc: BaseException | None = None) -> None:
        """End the open run now: ``failed`` with ``exc`` (``interrupted`` for a
        ``KeyboardInterrupt``), or ``finished`` without one. A no-op when none is open."""
        self._end(exc)

    def _unfinished_error(self) -> BaseException:
        """What a run whose ``train()`` never reached ``on_train_end`` ended with: the SIGTERM
        that ended it, else the exception out of its ``Trainer``, else
        :class:`TrainingDidNotEnd`."""
        return (
            self._terminated
            or _trainer_exception(self)
            or TrainingDidNotEnd(
                "Trainer.train() did not reach on_train_end: an exception left it (the Trainer "
                "tells callbacks nothing of it) or the process ended during training"
            )
        )

    def _keep_sigterm(self, before: Any) -> None:
        """Keep the :class:`~edo_monitor.signals.Terminated` that the monitor's SIGTERM handler
        raises: Python does not report an uncaught ``SystemExit`` in ``sys.last_exc``, so
        without it the run would end ``TrainingDidNotEnd`` at exit. Only when the monitor
        installed its handler as it started (``before``: the handler until then), on the main
        thread: a handler of the process's own is left alone, as the monitor leaves it."""
        if threading.current_thread() is not threading.main_thread():
            return
        monitors = signal.getsignal(signal.SIGTERM)
        if monitors is before or not callable(monitors):
            return

        def keep(signum: int, frame: Any) -> None:
            try:
                monitors(signum, frame)
            except Terminated as exc:
                self._terminated = exc
                raise

        signal.signal(signal.SIGTERM, keep)
        self._sigterm = (monitors, keep)

    def _release_sigterm(self) -> None:
        """Put the monitor's SIGTERM handler back (its ``stop()`` then restores the default)."""
        held, self._sigterm = self._sigterm, None
        if held is None or threading.current_thread() is not threading.main_thread():
            return
        monitors, keep = held
        if signal.getsignal(signal.SIGTERM) is keep:
            signal.signal(signal.SIGTERM, monitors)

    def _end(self, exc: BaseException | None) -> None:
        _untrack(self)
        try:
            self._release_sigterm()
        except Exception:  # never the training's failure
            logger.debug("edo-monitor: the SIGTERM handler could not be put back", exc_info=True)
        if self.monitor is not None:
            self.monitor.stop(exc)


def _sigterm_handler() -> Any:
    """The process's SIGTERM handler (``None`` off the main thread, where none is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def _fused(optimizers: list[Any]) -> bool:
    """Whether a group of one of ``optimizers`` is fused (``fused=True``)."""
    return any(g.get("fused") for o in optimizers for g in o.param_groups)
