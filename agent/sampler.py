"""The sampler thread (``edo-sampler``): probes -> :class:`Reading` -> history, TensorBoard and
the tuner.

Every ``interval_s`` it reads the host probe, on CUDA NVML and the caching allocator, takes the
accounting of the last step boundary (it never reads ``.grad`` itself: autograd writes gradients
from C++ without the GIL), the activation tracker's peak and the row caches' counters, and builds
one :class:`Reading`. The reading goes to the writer's queue with the module rows that changed,
to the TensorBoard sink, and to the tuner (:class:`edo_monitor.agent.tuner.Tuner`), which
evaluates the policy. Nothing here changes the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from edo_monitor.nn.cached import CachedTable
from edo_monitor.probes.readings import Reading
from edo_monitor.store.schema import CACHE_FIELDS

if TYPE_CHECKING:
    from edo_monitor.agent.state import MonitorState

__all__ = ["Sampler"]

PEAK_FIELDS = ("in_use_bytes", "allocated_bytes", "reserved_bytes", "activations_bytes")


def _sum_cache_counters(
    tables: Mapping[str, tuple[dict[str, int], dict[str, int]]],
) -> dict[str, int | None]:
    """The sample's ``cache_*`` fields: the tables' increments (and rows now) summed; none when
    the model has no cached table."""
    if not tables:
        return {}
    return {f: sum(inc[f] for _, inc in tables.values()) for f in CACHE_FIELDS}


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


class Sampler:
    """Takes the run's readings, on its own thread and once more after it has stopped.

    Args:
        monitor: the run (read: its device and probes, budget, step count, tracker, the safe
            point's step accounting, writer, TensorBoard sink, tuner; written: ``latest``,
            ``accounting``).

    Attributes:
        samples: readings taken.
        peaks: the highest ``in_use_bytes``, ``allocated_bytes``, ``reserved_bytes`` and
            ``activations_bytes`` seen (``None`` where the source never gave a value). On CUDA
            ``allocated_bytes`` also takes the allocator's own peak (``allocated_bytes.all.peak``,
            the reading's ``peak_allocated_bytes``) once it rises above what it was at the run's
            first reading (or after a ``torch.cuda.reset_peak_memory_stats()`` in the run): the
            run reached that value, between samples too. A peak from before the run (another
            run's, the process's start-up) is not the run's, and is left out.
        min_free_fraction: the lowest ``free_fraction`` seen.
        stop_event: the monitor's: set when the run is ending (the thread stops).
    """

    def __init__(self, monitor: MonitorState) -> None:
        self.m = monitor
        self.interval_s = monitor.interval_s
        self.stop_event: threading.Event = monitor._stop
        self.thread: threading.Thread | None = None
        self.samples = 0
        self.peaks: dict[str, int | None] = dict.fromkeys(PEAK_FIELDS)
        self.min_free_fraction: float | None = None
        #: peaks and min_free_fraction are updated from the training thread too (record_oom)
        self._peaks_lock = threading.Lock()
        #: the allocator's peak stat at the first reading (reached before the run: not counted)
        #: and at the last one (a lower value means the peak was reset)
        self._peak_stat_before: int | None = None
        self._peak_stat_last: int | None = None
        #: each cached table's counters at the previous sample, by (module name, object id)
        self._cache_prev: dict[tuple[str, int], dict[str, int]] = {}

    def start(self) -> None:
        """Start the ``edo-sampler`` daemon thread."""
        self.thread = threading.Thread(target=self._loop, name="edo-sampler", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (safe when it never started)."""
        self.stop_event.set()
        if self.thread is not None and self.thread.is_alive():
            self.thread.join()

    def _loop(self) -> None:
        next_t = time.monotonic()
        while not self.stop_event.is_set():
            try:
                self.sample_once()
            except Exception as exc:
                self.m._agent_error("sampler", exc)
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # we fell behind: skip the missed ticks rather than burst
                next_t = time.monotonic()
                delay = 0.0
            if self.stop_event.wait(delay):
                break

    def sample_once(self) -> Reading:
        """One reading: the sampler thread's tick, and the last one after it has stopped."""
        m = self.m
        device = m._device
        # the step first, then the time: a reading of step k is stamped after k began (a reading
        # stamped first and held back, by a slow probe or the training thread's GIL, could carry
        # the next step's number at a time before that step, or before an action done at the
        # boundary: replay would count the action in force too early). Values read later can
        # only be newer than the stamp.
        step = m.steps
        now = time.time()
        values: dict[str, Any] = {}
        values.update(device.probes["host"].read())
        # the last step boundary's accounting (gradients alive) is the step's peak; between
        # boundaries gradients may be gone, so a reading taken there would flap around the floor
        safe_point = m._safe_point
        acc = safe_point.step_accounting
        if acc is None:  # no step boundary yet: sizes only (this thread must not read .grad)
            acc = m._account(include_grads=False)
        safe_point.want_accounting = True
        m.accounting = acc
        # the highest saved-for-backward bytes alive at once since the previous sample, and at
        # least the peak of the current step so far and of the last finished step: a sample
        # taken between a backward() and the next forward still counts what the step saved
        # (else readings swing with the moment they land in the step, and the policy decides on
        # one reading and applies on another)
        tracker = m._tracker
        activations = (
            max(tracker.take_peak(), tracker.step_peak_bytes, tracker.last_step_bytes)
            if tracker is not None
            else None
        )
        values.update(
            params_bytes=acc.params_bytes,
            grads_bytes=acc.grads_bytes,
            optimizer_state_bytes=acc.optimizer_state_bytes,
            host_tier_bytes=acc.host_bytes,
            activations_bytes=activations,
        )
        cache_tables = self._cache_counters()
        values.update(_sum_cache_counters(cache_tables))
        budget = device.budget_bytes
        if device.kind == "cuda":
            nvml = device.probes["nvml"]
            values.update(nvml.read())
            values.update(device.probes["cuda"].read(with_device_info=not nvml.available))
            if device.budget_bytes_requested is not None:
                in_use = values.get("reserved_bytes")
            else:
                in_use = values.get("device_used_bytes")
        else:
            in_use = acc.total_bytes + (activations or 0)
        free_fraction = None
        if budget and in_use is not None:
            free_fraction = (budget - in_use) / budget
        reading = Reading(
            time_s=now,
            step=step,
            device_kind=device.kind,
            budget_bytes=budget,
            in_use_bytes=in_use,
            free_fraction=free_fraction,
            **values,
        )
        m.latest = reading
        self.samples += 1
        with self._peaks_lock:
            self._update_peaks(reading)
        writer = m._run.writer
        if writer is not None:
            writer.put_sample(reading)
            m._module_rows.write_accounting(acc, now)
            m._module_rows.write_cache_totals(cache_tables, now)
        if m._tensorboard is not None:
            m._tensorboard.add_reading(reading)
        if m.policy is not None:
            m._tuner.evaluate(reading)
        return reading

    def record_oom(self, alive: Mapping[str, Any]) -> None:
        """A reading of the moment a CPU budget refused a request (``enforce=True``; on the
        training thread): in use is what was alive without the request, by category as the
        check counted it (``alive``: :meth:`SafePoint._alive_with`'s breakdown, the request in
        its category). The samples on either side of it (the last boundary's accounting with
        the step's saved bytes) need not reach it: the run's peak and lowest free fraction
        would miss the out-of-memory error's own figures (a first step's error: 14 % free
        recorded, 0.2 % in the error). Written as a sample, not given to the policy."""
        m = self.m
        budget = m._device.budget_bytes
        if budget is None:
            return
        values = {
            k: int(alive[k])
            for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes")
        }
        request = alive.get("request")
        if request in values:  # the refused request was never alive
            values[request] -= int(alive["requested_bytes"])
        in_use = sum(values.values())
        reading = Reading(
            time_s=time.time(),
            step=m.steps,
            device_kind=m._device.kind,
            budget_bytes=budget,
            in_use_bytes=in_use,
            free_fraction=(budget - in_use) / budget,
            **values,
        )
        with self._peaks_lock:
            self._update_peaks(reading)
        writer = m._run.writer
        if writer is not None:
            writer.put_sample(reading)

    def _update_peaks(self, r: Reading) -> None:
        for key in self.peaks:
            self.peaks[key] = _max(self.peaks[key], getattr(r, key))
        stat = r.peak_allocated_bytes
        if stat is not None:
            if self._peak_stat_before is None:
                self._peak_stat_before = stat
            elif self._peak_stat_last is not None and stat < self._peak_stat_last:
                self._peak_stat_before = 0  # reset in the run: every later peak is the run's
            self._peak_stat_last = stat
            if stat > self._peak_stat_before:
                self.peaks["allocated_bytes"] = _max(self.peaks["allocated_bytes"], stat)
        f = r.free_fraction
        if f is not None and (self.min_free_fraction is None or f < self.min_free_fraction):
            self.min_free_fraction = f

    def _cache_counters(self) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
        """Each cached table's counters (``CachedTable.stats()``): ``name -> (totals since it
        was cached, increments since the previous sample)``."""
        model = self.m.model
        if model is None:
            return {}
        out = {}
        seen = set()
        for name, module in model.named_modules():
            if not isinstance(module, CachedTable):
                continue
            totals = module.stats().history_totals()
            key = (name, id(module))
            seen.add(key)
            prev = self._cache_prev.get(key, {})
            increments = {k: max(0, v - prev.get(k, 0)) for k, v in totals.items()}
            increments["cache_rows"] = totals["cache_rows"]
            self._cache_prev[key] = totals
            out[name] = (totals, increments)
        for key in [k for k in self._cache_prev if k not in seen]:  # grown back, or replaced
            del self._cache_prev[key]
        return out
