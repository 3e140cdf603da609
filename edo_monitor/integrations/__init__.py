"""Where users already are: callbacks for training frameworks and a TensorBoard sink.

Each module imports its framework, so import the one you use (nothing is imported here):

* :mod:`edo_monitor.integrations.lightning` — ``EdoMonitorCallback`` for a Lightning ``Trainer``
  (``lightning.pytorch``, or ``pytorch_lightning`` when only that is installed);
  :mod:`edo_monitor.integrations.pytorch_lightning` is the same callback for the
  ``pytorch_lightning`` package by name. Extra: ``[lightning]``.
* :mod:`edo_monitor.integrations.transformers` — ``EdoMonitorCallback`` for the Hugging Face
  ``Trainer``. Extra: ``[transformers]``.
* :mod:`edo_monitor.integrations.tensorboard` — what ``watch(..., tensorboard=)`` writes.
  Extra: ``[tensorboard]``.
"""
