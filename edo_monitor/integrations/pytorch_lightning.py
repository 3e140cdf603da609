"""``EdoMonitorCallback`` for the older ``pytorch_lightning`` package (``import
pytorch_lightning as pl``): a ``pytorch_lightning`` ``Trainer`` accepts only callbacks of its
own package, so this one subclasses ``pytorch_lightning.Callback``. Everything else is as in
:mod:`edo_monitor.integrations.lightning`. Needs ``pytorch_lightning``.
"""

from __future__ import annotations

from typing import Any

try:
    from pytorch_lightning import Callback
except ImportError as exc:
    raise ImportError(
        "edo_monitor.integrations.pytorch_lightning needs the pytorch_lightning package "
        f"(or use edo_monitor.integrations.lightning with the lightning package) ({exc})"
    ) from None

from edo_monitor.integrations._lightning_base import LightningCallbackMixin, lightning_run_name

__all__ = ["EdoMonitorCallback", "lightning_run_name"]


class EdoMonitorCallback(LightningCallbackMixin, Callback):  # type: ignore[misc]
    """:class:`edo_monitor.integrations.lightning.EdoMonitorCallback` for a
    ``pytorch_lightning.Trainer`` (same arguments, same behaviour)."""

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
