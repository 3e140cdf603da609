"""What the framework callbacks share: checking the ``watch()`` options they pass on, making
the run's name and config from the framework's, and finding the torch optimizers inside a
framework's wrappers."""

from __future__ import annotations

import inspect
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from edo_monitor.agent.monitor import Monitor
from edo_monitor.checks import mapping_or_none
from edo_monitor.errors import ConfigError
from edo_monitor.store.schema import RUN_NAME_MAX_CHARS

__all__ = [
    "align_tensorboard",
    "check_watch_kwargs",
    "derived_run_name",
    "record_resume",
    "run_config",
    "torch_optimizers",
    "unwrap_optimizer",
    "watch_options",
]

#: what a callback sets itself from the framework (the model, its optimizers)
_SET_BY_CALLBACK = frozenset({"self", "model", "optimizer"})


def watch_options(
    owner: str, policy: Any, budget: Any, db: Any, kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``watch()`` options a callback was made with (its named ones and the rest), checked
    when the callback is made: an option ``watch()`` does not take is refused.

    Raises:
        ConfigError: naming the options, and which are allowed.
    """
    check_watch_kwargs(kwargs, owner)
    return {"policy": policy, "budget": budget, "db": db, **kwargs}


def check_watch_kwargs(kwargs: Mapping[str, Any], owner: str) -> None:
    """Refuse, when the callback is made, an option ``watch()`` does not take.

    Raises:
        ConfigError: naming the options, and which are allowed.
    """
    allowed = set(inspect.signature(Monitor.__init__).parameters) - _SET_BY_CALLBACK
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ConfigError(
            f"{owner}({', '.join(f'{k}=...' for k in unknown)}): not an option of "
            f"edo_monitor.watch(); expected some of {sorted(allowed)} (the model and optimizer "
            "come from the trainer)"
        )


def derived_run_name(name: Any, fallback: str) -> str:
    """A run name the callback takes from the framework (``args.run_name``, the logger's
    ``"<name>/<version>"``), made one ``watch()`` takes, so that it never fails the fit: each
    control character (a tab, a newline, an escape) and each unpaired surrogate (which the history
    cannot store) becomes a space, and the name is shortened to
    :data:`~edo_monitor.store.schema.RUN_NAME_MAX_CHARS`; ``fallback`` (the model's class name)
    when nothing but spaces is left, or ``name`` is ``None``. A ``run_name=`` the user passes is
    not made safe: ``watch()`` checks it (a ``ConfigError`` naming it)."""
    text = "" if name is None else str(name)
    text = "".join(" " if unicodedata.category(ch) in ("Cc", "Cs") else ch for ch in text)[
        :RUN_NAME_MAX_CHARS
    ]
    return text if text.strip() else fallback


def run_config(own: Mapping[str, Any], user: Any) -> dict[str, Any]:
    """The run's ``config``: what the callback records of the framework (``own``), then the
    user's ``watch(config=)`` over it.

    Raises:
        ConfigError: ``user`` is neither a mapping nor ``None`` (as ``watch()`` refuses it).
    """
    return {**own, **mapping_or_none(user, "config", error=ConfigError)}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer whose ``step()`` runs last inside framework wrappers (accelerate's
    ``AcceleratedOptimizer``, any wrapper that keeps the real one as ``.optimizer``): the one
    PyTorch's global optimizer step hooks report, so the one the monitor counts steps of."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def torch_optimizers(optimizers: Iterable[Any]) -> list[torch.optim.Optimizer]:
    """The torch optimizers among ``optimizers``, unwrapped (others, e.g. a DeepSpeed engine's,
    are left out: the monitor then finds the model's optimizer through PyTorch's hooks)."""
    found = []
    for opt in optimizers:
        inner = unwrap_optimizer(opt)
        if isinstance(inner, torch.optim.Optimizer) and inner not in found:
            found.append(inner)
    return found


def record_resume(monitor: Any, resumed: dict[str, Any]) -> None:
    """Record, as a ``resumed_from`` event of ``monitor``'s new run, the run a resumed
    checkpoint was saved from (``resumed``: ``run_id``, ``run_uuid``, ``step`` and
    ``checkpoint``; also in the run's ``config["resumed_from"]``)."""
    monitor._log.emit(
        "resumed_from",
        f"resumes run {resumed.get('run_id')} ({resumed.get('run_uuid')}) from step "
        f"{resumed.get('step')} of checkpoint {resumed.get('checkpoint')}",
        resumed,
    )


def align_tensorboard(monitor: Any, framework_step: Any) -> None:
    """Put ``monitor``'s TensorBoard scalars and events on the framework's step axis: the
    framework is at ``framework_step`` (its global step, a resumed fit's checkpoint step) while
    the run is at ``monitor.steps``, so each is written at its run step plus the difference
    (:attr:`~edo_monitor.exporters.tensorboard.TensorBoardSink.step_offset`). The history keeps
    the run's own steps. A no-op without ``tensorboard=`` or a step that is not an int."""
    sink = getattr(monitor, "_tensorboard", None)
    if sink is None or isinstance(framework_step, bool) or not isinstance(framework_step, int):
        return
    sink.step_offset = max(0, framework_step - monitor.steps)
