"""The run's events and the agent's own failures: :class:`EventLog`.

Every part of the agent records through one log: an event goes to the history writer's queue
(never blocking), to the TensorBoard sink's deque when there is one, and into the counters the
run's summary and the Prometheus endpoint read. A failure inside the agent is counted by
``"where:ExceptionType"``; the first of each kind is logged with its traceback and recorded as
one ``agent_error`` event, and with ``strict=True`` it is kept to be re-raised at the next safe
point (DESIGN.md §3, rule 3).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edo_monitor.agent.snapshots import SnapshotRecorder
    from edo_monitor.exporters.tensorboard import TensorBoardSink
    from edo_monitor.store.writer import Writer

__all__ = ["EventLog"]

logger = logging.getLogger(__name__)


class EventLog:
    """Events and agent errors of one run (any thread; nothing here blocks or raises).

    Args:
        step: returns the step count to record with each event.
        strict: keep the first agent error to re-raise (``Monitor(strict=True)``).

    Attributes:
        writer: the history writer (set when the run is recorded; ``None`` before).
        tensorboard: the TensorBoard sink (``watch(tensorboard=)``), else ``None``.
        counts: events recorded, by kind.
        actions: the ``action`` events' data, in order (applied actions).
        agent_errors: failures inside the agent by ``"where:ExceptionType"``, every occurrence.
        pending_error: with ``strict``, the first agent error not yet re-raised.
    """

    def __init__(self, step: Callable[[], int], *, strict: bool = False) -> None:
        self._step = step
        self.strict = strict
        self.writer: Writer | None = None
        self.tensorboard: TensorBoardSink | None = None
        #: the incident snapshots (``watch(snapshots=)``), else ``None``
        self.snapshots: SnapshotRecorder | None = None
        self.counts: Counter[str] = Counter()
        self.actions: list[dict[str, Any]] = []
        self.agent_errors: Counter[str] = Counter()
        self.pending_error: BaseException | None = None

    def emit(
        self,
        kind: str,
        message: str,
        data: Mapping[str, Any] | None = None,
        time_s: float | None = None,
        step: int | None = None,
    ) -> None:
        """Record an event of ``kind`` (``"action"``, ``"oom"`` ...) with its message and JSON
        data at ``step`` (``None``: the current step; the events a reading leads to give the
        reading's), at ``time_s`` (Unix seconds; ``None`` = now)."""
        self.counts[kind] += 1
        if kind == "action":
            self.actions.append(dict(data or {}))
        elif kind == "action_measured" and data and data["comparable"]:  # shown beside it
            for action in reversed(self.actions):
                if (action.get("action"), action.get("target")) == (
                    data["action"],
                    data["target"],
                ):
                    action["measured_saved_bytes"] = data["saved_bytes"]
                    break
        if step is None:
            step = self._step()
        if time_s is None:
            time_s = time.time()
        if self.writer is not None:
            self.writer.put_event(kind, message, step=step, data=data, time_s=time_s)
            if self.snapshots is not None:  # an incident's snapshot, linked to this event
                self.snapshots.on_event(kind, data, step, time_s)
        if self.tensorboard is not None:
            self.tensorboard.add_event(kind, message, step)  # written by the sampler

    def agent_error(self, where: str, exc: BaseException) -> None:
        """Count a failure inside the agent at ``where`` (``"sampler"``, ``"step hook"`` ...);
        the first of each kind is logged with its traceback (in one line, with its message, for
        an expected condition: an exception whose class sets ``one_line = True``, such as a
        rank agreement that timed out) and recorded as one ``agent_error`` event."""
        key = f"{where}:{type(exc).__name__}"
        self.agent_errors[key] += 1
        if self.agent_errors[key] == 1:
            one_line = getattr(type(exc), "one_line", False) is True
            logger.error(
                "edo-monitor: %s failed (training goes on)%s",
                where,
                f": {exc}" if one_line else "",
                exc_info=None if one_line else (type(exc), exc, exc.__traceback__),
            )
            self.emit("agent_error", f"{where}: {type(exc).__name__}: {exc}", {"where": where})
        if self.strict and self.pending_error is None:
            self.pending_error = exc

    def take_pending_error(self) -> BaseException | None:
        """The held-back agent error (``strict=True``), cleared; ``None`` when there is none."""
        err, self.pending_error = self.pending_error, None
        return err
