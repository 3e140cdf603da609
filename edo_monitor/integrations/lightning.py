"""Lightning: ``EdoMonitorCallback`` watches the LightningModule for the fit.

.. code-block:: python

    import lightning.pytorch as pl
    from edo_monitor.integrations.lightning import EdoMonitorCallback

    callback = EdoMonitorCallback(budget="12GiB", policy=edo_monitor.Policy())
    trainer = pl.Trainer(callbacks=[callback])
    trainer.fit(module, loader)

The callback subclasses ``lightning.pytorch.Callback`` (the ``lightning`` package), or
``pytorch_lightning.Callback`` when only the older ``pytorch_lightning`` package is installed;
:mod:`edo_monitor.integrations.pytorch_lightning` always uses the latter (a ``pytorch_lightning``
``Trainer`` accepts only its own package's callbacks).

Needs the ``[lightning]`` extra.
"""

from __future__ import annotations

from typing import Any

from edo_monitor.errors import missing_extra

try:
    from lightning.pytorch import Callback
except ImportError:  # only the older package
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:
        raise missing_extra(
            "edo_monitor.integrations.lightning", "lightning", "lightning", exc
        ) from None

from edo_monitor.integrations._lightning_base import LightningCallbackMixin, lightning_run_name

__all__ = ["EdoMonitorCallback", "lightning_run_name"]


class EdoMonitorCallback(LightningCallbackMixin, Callback):  # type: ignore[misc]
    """Watch the LightningModule with :func:`edo_monitor.watch` for the length of ``fit``.

    * **Start**: ``on_fit_start`` (after the strategy has put the module on its device and set up
      its optimizers; before the sanity check), one run per fit.
    * **Steps**: counted at the optimizer step — PyTorch's optimizer step post-hook on the first
      of ``trainer.optimizers``, which fires inside Lightning's ``optimizer.step(closure)``
      after the closure's forward and backward, once per optimizer step (so with
      ``accumulate_grad_batches=k``, once per ``k`` batches); equal to ``trainer.global_step``
      with one optimizer.
    * **Actions**: the policy's decisions are applied there, at Lightning's optimizer step
      boundary, on the training thread (the only place the model changes).
    * **Name**: ``run_name=`` when given (checked as ``watch()`` checks it), else the trainer's
      logger as ``"<name>/<version>"`` (``"lightning_logs/version_0"``), else the module's class
      name. A name taken from the logger never fails the fit: each control character in it (a
      tab, a newline) becomes a space, and it is shortened to 200 characters. The run's config
      records ``integration="lightning"``.
    * **End**: ``on_train_end`` (the fit loop is done) records it ``finished``; ``on_fit_end``
      and ``teardown`` end a fit that never trained; ``on_exception`` records it ``failed`` with
      the exception (``interrupted`` for Ctrl-C or SIGTERM; an out-of-memory error as an ``oom``
      event too).

    Args:
        policy: an :class:`edo_monitor.Policy` (the auto-tuner); ``None`` records only.
        budget: the memory budget (bytes, or ``"12GiB"``), as in ``watch()``.
        db: the history database (path or SQLAlchemy URL), as in ``watch()``.
        tensorboard: a ``SummaryWriter``, a log folder, or ``True`` for the ``SummaryWriter`` of
            the trainer's ``TensorBoardLogger`` (rank 0 only), as ``watch(tensorboard=)``;
            written at the trainer's global step (a fit resumed with ``ckpt_path=`` continues
            from the checkpoint's step, as Lightning's own scalars do), while the history
            counts the run's steps from 0.
        **watch_kwargs: any other option of :func:`edo_monitor.watch` (``interval_s``,
            ``run_name``, ``tags``, ``enforce``, ``metrics_port``, ``config`` ...).

    Attributes:
        monitor: the current (or last) fit's :class:`edo_monitor.Monitor` (``monitor.summary()``
            after the fit); ``None`` before one.

    Raises:
        ConfigError: an option ``watch()`` does not take (here), or a bad value (at fit start,
            failing the fit before it trains, as ``watch()`` would).
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
        super().__init__(
            policy=policy, budget=budget, db=db, tensorboard=tensorboard, **watch_kwargs
        )
