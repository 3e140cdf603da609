"""What the framework callbacks share: checking the ``watch()`` options they pass on, and
finding the torch optimizers inside a framework's wrappers."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from edo_monitor.agent.monitor import Monitor
from edo_monitor.errors import ConfigError

__all__ = [
    "check_watch_kwargs",
    "record_resume",
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
