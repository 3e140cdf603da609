"""Memory snapshots at incidents, stored in the history: :class:`SnapshotRecorder`.

At each incident — an ``oom`` event, a ``threshold_crossed`` event going below the floor, an
``action`` / ``action_failed`` event (one snapshot before the action, one after) — the recorder
stores a snapshot in ``torch.cuda.memory._snapshot()``'s format
(:mod:`edo_monitor.measure.snapshots`), compressed, in the ``snapshots`` table, linked to the
event's row by the writer.

``oom_recovered`` / ``oom_unrecovered`` (``run_step``) take one as ``oom`` does.

* **CUDA.** The allocator's own snapshot. An out-of-memory error is caught by the allocator's
  OOM observer (``torch._C._cuda_attach_out_of_memory_observer``), which runs inside the failed
  ``malloc`` before the error unwinds and frees the step's tensors; the snapshot taken there is
  kept for the ``oom`` event that follows. With ``watch(snapshots=True)`` the allocator's history
  is recorded too (``torch.cuda.memory._record_memory_history(stacks="python", max_entries=N)``):
  the blocks then carry the Python frames that allocated them and ``device_traces`` the last
  ``N`` allocator actions. The history costs a Python stack capture on every allocation and
  free; without it (the default, ``snapshots=None``) nothing runs until an incident.
* **CPU-budget.** Built from what the agent accounts (:func:`edo_monitor.measure.snapshots.
  build_cpu_snapshot`): each module's parameters, gradients, optimizer state and saved
  activations, one block each with the module and category as the frame. Nothing runs until an
  incident; the snapshot's allocated bytes equal the reading's ``in_use_bytes`` at a crossing.

The stored bytes are capped per run (``cap_bytes``): the first snapshot over the cap is dropped
and recorded as one ``snapshot_cap_reached`` event, later ones are dropped and counted. Nothing
here raises into the training: a failure is an ``agent_error`` ("snapshot").
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from edo_monitor.measure.module_tree import MODEL_MODULE, module_label, own_bytes
from edo_monitor.measure.snapshots import ENCODING, build_cpu_snapshot, encode, totals
from edo_monitor.units import format_bytes

if TYPE_CHECKING:
    from edo_monitor.agent.state import MonitorState
    from edo_monitor.measure.accounting import Accounting

__all__ = [
    "DEFAULT_CAP_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_MAX_FRAMES",
    "INCIDENT_KINDS",
    "SnapshotRecorder",
    "trim_frames",
]

logger = logging.getLogger(__name__)

#: stored snapshot bytes per run (compressed) before ``snapshot_cap_reached``
DEFAULT_CAP_BYTES = 64 * 2**20
#: allocator actions the CUDA history keeps (``_record_memory_history(max_entries=)``)
DEFAULT_MAX_ENTRIES = 20_000
#: frames kept per block and trace entry in a stored snapshot (innermost first)
DEFAULT_MAX_FRAMES = 16
#: event kinds that take a snapshot
INCIDENT_KINDS = frozenset(
    {"oom", "oom_recovered", "oom_unrecovered", "threshold_crossed", "action", "action_failed"}
)
#: an OOM observer's snapshot older than this is not the ``oom`` event's (seconds)
_OOM_FRESH_S = 60.0

_observer_lock = threading.Lock()
_observer_attached = False
#: recorders of running CUDA runs (the observer cannot be detached: it calls these)
_active: weakref.WeakSet[SnapshotRecorder] = weakref.WeakSet()


def _oom_observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
    """The allocator's OOM observer: hand the moment to every running CUDA recorder."""
    for recorder in list(_active):
        recorder.on_allocator_oom(device, alloc, device_alloc, device_free)


def trim_frames(snapshot: dict[str, Any], max_frames: int) -> dict[str, Any]:
    """Keep at most ``max_frames`` frames (innermost first) per block and trace entry, in
    place; returns ``snapshot``."""

    def cut(item: dict[str, Any]) -> None:
        frames = item.get("frames")
        if isinstance(frames, list) and len(frames) > max_frames:
            item["frames"] = frames[:max_frames]

    for seg in snapshot.get("segments") or []:
        cut(seg)
        for b in seg.get("blocks") or []:
            cut(b)
    for trace in snapshot.get("device_traces") or []:
        for entry in trace or []:
            cut(entry)
    return snapshot


class SnapshotRecorder:
    """A run's incident snapshots (called by :class:`~edo_monitor.agent.events.EventLog`).

    Args:
        monitor: the run.
        history: CUDA only: record the allocator's history (frames and trace).
        cap_bytes: stored (compressed) bytes per run before ``snapshot_cap_reached``.
        max_entries: allocator actions the CUDA history keeps.
        max_frames: frames kept per block and trace entry.

    Attributes:
        stored: snapshots queued for the history. stored_bytes: their compressed bytes.
        dropped: snapshots not stored because the cap was reached.
    """

    def __init__(
        self,
        monitor: MonitorState,
        *,
        history: bool = False,
        cap_bytes: int = DEFAULT_CAP_BYTES,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_frames: int = DEFAULT_MAX_FRAMES,
    ) -> None:
        self.m = monitor
        self.history = history
        self.cap_bytes = cap_bytes
        self.max_entries = max_entries
        self.max_frames = max_frames
        self.stored = 0
        self.stored_bytes = 0
        self.dropped = 0
        self._cuda = False
        self._history_on = False
        self._before: dict[str, Any] | None = None
        self._oom: tuple[float, dict[str, Any]] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """On CUDA: attach the OOM observer (once per process) and, with ``history``, start the
        allocator's history. Never raises (an ``agent_error``)."""
        global _observer_attached
        self._cuda = self.m.device_kind == "cuda"
        if not self._cuda:
            return
        try:
            import torch

            with _observer_lock:
                if not _observer_attached:
                    torch._C._cuda_attach_out_of_memory_observer(_oom_observer)
                    _observer_attached = True
            _active.add(self)
            if self.history:
                torch.cuda.memory._record_memory_history(
                    "all", context="all", stacks="python", max_entries=self.max_entries
                )
                self._history_on = True
        except Exception as exc:
            self.m._agent_error("snapshot", exc)

    def stop(self) -> None:
        """Detach from the observer and stop the history this recorder started."""
        _active.discard(self)
        if self._history_on:
            self._history_on = False
            try:
                import torch

                torch.cuda.memory._record_memory_history(None)
            except Exception as exc:
                self.m._agent_error("snapshot", exc)

    # ------------------------------------------------------------------ incidents
    def on_allocator_oom(self, device: int, alloc: int, device_alloc: int, free: int) -> None:
        """The OOM observer's moment (inside the failed allocation): take the snapshot now,
        before the error frees the step's tensors; the ``oom`` event stores it."""
        if device != self.m.device_index:
            return
        try:
            snap = self._cuda_snapshot()
            traces = snap.setdefault("device_traces", [])
            if not any(e.get("action") == "oom" for t in traces for e in (t or [])):
                while len(traces) <= device:  # no history: record the request for `explain`
                    traces.append([])
                traces[device].append(
                    {"action": "oom", "addr": 0, "size": int(alloc), "stream": 0,
                     "time_us": int(time.time() * 1e6), "frames": [], "device_free": int(free)}
                )  # fmt: skip
            snap.setdefault("edo", {}).update(
                {"oom_request_bytes": int(alloc), "oom_device_free_bytes": int(free)}
            )
            with self._lock:
                self._oom = (time.monotonic(), snap)
        except Exception as exc:
            self.m._agent_error("snapshot", exc)

    def before_action(self) -> None:
        """At the safe point, just before an action applies: keep the "before" snapshot for
        the action's event."""
        try:
            self._before = self._take("before", None)
        except Exception as exc:
            self.m._agent_error("snapshot", exc)

    def on_event(self, kind: str, data: Mapping[str, Any] | None, step: int, time_s: float) -> None:
        """After an event is queued: store its snapshot(s) when ``kind`` is an incident."""
        if kind not in INCIDENT_KINDS:
            return
        data = data or {}
        try:
            if kind == "threshold_crossed" and data.get("direction") != "below":
                return
            snaps: list[tuple[str, dict[str, Any]]] = []
            if kind in ("action", "action_failed"):
                before, self._before = self._before, None
                if before is not None:
                    snaps.append(("before", before))
                snaps.append(("after", self._take("after", data)))
            elif kind.startswith("oom"):
                with self._lock:
                    pending, self._oom = self._oom, None
                if pending is not None and time.monotonic() - pending[0] < _OOM_FRESH_S:
                    snaps.append(("at", pending[1]))
                else:
                    snaps.append(("at", self._take("oom", data)))
            else:
                snaps.append(("at", self._take("crossing", data)))
            for phase, snap in snaps:
                self._store(phase, snap, kind, step, time_s)
        except Exception as exc:
            self.m._agent_error("snapshot", exc)

    # ------------------------------------------------------------------ taking and storing
    def _cuda_snapshot(self) -> dict[str, Any]:
        import torch

        snap = torch.cuda.memory._snapshot(self.m.device_index)
        return trim_frames(snap, self.max_frames)

    def _take(self, why: str, data: Mapping[str, Any] | None) -> dict[str, Any]:
        """A snapshot of this moment: the allocator's on CUDA, else one built."""
        t0 = time.perf_counter()
        snap = self._cuda_snapshot() if self._cuda else self._cpu_snapshot(why, data)
        # what taking it cost the thread it ran on (benchmarks/snapshots.py reads it)
        snap.setdefault("edo", {}).update(why=why, take_s=time.perf_counter() - t0)
        return snap

    def _cpu_snapshot(self, why: str, data: Mapping[str, Any] | None) -> dict[str, Any]:
        m = self.m
        tracker = m._tracker
        request = None
        if why == "crossing" and m.latest is not None:
            # the reading the crossing was decided on: its accounting and activations
            acc = m.accounting
            activations = m.latest.activations_bytes or 0
        else:  # the training thread (oom, action)
            # an action: the accounting of the step boundary it ran at; an out-of-memory error
            # (in the forward, the backward or at the boundary): what is alive at that moment
            if why == "oom":  # the budget check's own walk when it raised the error
                acc = m._safe_point.oom_accounting or m._account()
            else:
                acc = m._safe_point.step_accounting or m.accounting
            activations = tracker.live_bytes if tracker is not None else 0
            if why == "oom":
                parsed = (data or {}).get("parsed") or {}
                request = parsed.get("requested_bytes")
                alive = (data or {}).get("in_use")
                if alive:  # the CPU-budget check's own saved bytes, without the request
                    activations = alive["activations_bytes"]
                    if alive["request"] == "activations_bytes":
                        activations -= alive["requested_bytes"]
        blocks = list(_accounting_blocks(acc))
        blocks += self._activation_blocks(int(activations))
        budget = m.budget_bytes
        return build_cpu_snapshot(
            blocks,
            budget_bytes=budget,
            time_us=int(time.time() * 1e6),
            request_bytes=request,
            extra={
                "source": "cpu-budget",
                "why": why,
                "budget_bytes": budget,
                "host_tier_bytes": acc.host_bytes,
                "host_tier": {
                    r.module: r.host_bytes for r in (*acc.tables, *acc.modules) if r.host_bytes
                },
            },
        )

    def _activation_blocks(self, activations: int) -> list[tuple[str, str, int]]:
        """``activations`` bytes split over modules in the shares of the last activation profile
        (each module's bytes less its listed submodules': a block's bytes include its layers');
        what no module holds alone is one block of ``<model>``."""
        if activations <= 0:
            return []
        profile = self.m.activation_profile
        out: list[tuple[str, str, int]] = []
        if profile is not None and profile.total_bytes > 0:
            for name, nbytes in sorted(own_bytes(profile.exclusive_bytes).items()):
                share = activations * nbytes // profile.total_bytes
                if share > 0:
                    out.append((module_label(name), "activations", share))
        rest = activations - sum(b for _, _, b in out)
        if rest > 0:
            out.append((MODEL_MODULE, "activations (shared)", rest))
        return out

    def _store(self, phase: str, snap: dict[str, Any], kind: str, step: int, time_s: float) -> None:
        writer = self.m._run.writer
        if writer is None:
            return
        blob, raw_bytes = encode(snap)
        with self._lock:
            if self.stored_bytes + len(blob) > self.cap_bytes:
                self.dropped += 1
                first = self.dropped == 1
            else:
                first = None
                self.stored += 1
                self.stored_bytes += len(blob)
        if first is not None:
            if first:  # recorded once; the events after it are counted in its data at the end
                self.m._emit(
                    "snapshot_cap_reached",
                    f"snapshot of a {kind} event not stored: the run's snapshots reached the cap "
                    f"of {format_bytes(self.cap_bytes)} ({self.stored} stored, "
                    f"{format_bytes(self.stored_bytes)}); later ones are dropped",
                    {
                        "cap_bytes": self.cap_bytes,
                        "stored": self.stored,
                        "stored_bytes": self.stored_bytes,
                        "refused_bytes": len(blob),
                        "event_kind": kind,
                    },
                )
            return
        t = totals(snap)
        writer.put_snapshot(
            {
                "time_s": time.time(),
                "step": step,
                "phase": phase,
                "source": "cuda" if self._cuda else "cpu-budget",
                "encoding": ENCODING,
                "raw_bytes": raw_bytes,
                "stored_bytes": len(blob),
                "allocated_bytes": t.allocated_bytes,
                "reserved_bytes": t.reserved_bytes,
                "blob": blob,
            },
            event_kind=kind,
            event_time_s=time_s,
        )


def _accounting_blocks(acc: Accounting) -> Iterator[tuple[str, str, int]]:
    """``(module, category, bytes)`` of each device-tier piece of ``acc``: a table placed by an
    action (``placement`` other than ``device``, e.g. a row cache) says so in its category."""
    for row in (*acc.tables, *acc.modules):
        tag = "" if row.placement == "device" else f" [{row.placement}]"
        yield row.module, "params" + tag, row.params_bytes
        yield row.module, "grads" + tag, row.grads_bytes
        yield row.module, "optimizer_state" + tag, row.optimizer_state_bytes
