"""What the agent's parts see of the monitor that owns them.

Each part (sampler, safe point, tuner, snapshots, OOM capture, recovery) holds a reference back to
its :class:`~edo_monitor.agent.monitor.Monitor` and is typed against :class:`MonitorState`, so no
part imports the facade that imports it. The parts' own objects are ``Any`` here for the same
reason; their classes are in the modules named beside them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from edo_monitor.decide.policy import Policy
from edo_monitor.measure.accounting import Accounting
from edo_monitor.probes.readings import Reading


class MonitorState(Protocol):
    """The monitor's shared state and the calls its parts make (``Monitor`` has every one)."""

    model: nn.Module | None
    policy: Policy | None
    strict: bool
    interval_s: float
    profile_interval_s: float
    track_activations: bool
    latest: Reading | None
    steps: int
    status: str
    accounting: Accounting
    activation_profile: Any  # actions.checkpoint_activations.ActivationProfile | None
    _pid: int
    _stop: threading.Event
    _run: Any  # agent.run.RunRecord
    _device: Any  # agent.device.Device
    _log: Any  # agent.events.EventLog
    _tracker: Any  # agent.activations.ActivationTracker | None
    _lookups: Any  # measure.frequency.LookupCounter | None
    _module_rows: Any  # agent.module_rows.ModuleRows
    _safe_point: Any  # agent.safe_point.SafePoint
    _tuner: Any  # agent.tuner.Tuner
    _sampler: Any  # agent.sampler.Sampler
    _coordinator: Any  # agent.ranks.Coordinator | None
    _tensorboard: Any  # integrations.tensorboard.TensorBoardSink | None
    spill_dir: Any  # the disk tier's folder (Path), see nn/spill.py

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """The optimizers found (or given) that step the model, those still alive."""

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None: ...

    @property
    def device_kind(self) -> str:
        """``"cuda"`` or ``"cpu-budget"``."""

    @property
    def device_index(self) -> int | None:
        """The CUDA device index, ``None`` in CPU-budget mode."""

    @property
    def budget_bytes(self) -> int | None:
        """The capacity the policy measures against."""

    def _emit(
        self,
        kind: str,
        message: str,
        data: Mapping[str, Any] | None = None,
        time_s: float | None = None,
        step: int | None = None,
    ) -> None: ...

    def _agent_error(self, where: str, exc: BaseException) -> None: ...

    def _record_oom(self, exc: BaseException) -> None: ...

    def _recovery_point(self) -> None: ...

    def _model_tensors(self) -> list[torch.Tensor]: ...

    def _account(self, *, include_grads: bool = True) -> Accounting: ...
