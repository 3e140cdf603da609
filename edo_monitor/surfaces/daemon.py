"""``edo-monitor daemon``: every GPU of the machine and every process on it, into the history.

What ``nvidia-smi -l`` / nvitop show for memory, recorded: each sample (every ``interval_s``,
1 s by default) writes one ``device_samples`` row per GPU (NVML index, UUID, name, total / used /
free bytes, utilisation) and one ``process_samples`` row per process on it (PID, name, kind,
bytes, and the run id when the process is a watched run), all with the sample's ``time_s``; what
it notices goes to ``device_events`` (:data:`edo_monitor.store.schema.DEVICE_EVENT_KINDS`).

NVML is read through :class:`edo_monitor.probes.nvml_device.NvmlDevice`, the agent's own fault
handling: a lost GPU (``NVMLError_GpuIsLost``) is a ``device_lost`` event and the daemon goes on
with the others; NVML stopping as a whole (driver/library mismatch after an upgrade, driver
unloaded) is a ``device_unavailable`` event per device (and ``nvml_unavailable`` when the device
list itself fails); a query a device does not support (MIG: processes, utilisation) reads
``NULL``. Every :data:`RESCAN_INTERVAL_S` the device list is read again (``nvmlDeviceGetCount``,
``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetUUID``): a UUID not seen before, or a lost one that
answers again, is ``device_appeared``; a tracked UUID no longer listed is ``device_lost``.

Process names come from psutil (``NULL`` when the PID is not visible here: NVML lists PIDs of
the host's PID namespace, so a daemon in a container sees them only with ``--pid=host``), read
once per PID while it stays on the GPU. A process is linked to a run by host and PID
(:class:`edo_monitor.store.writer.DeviceWriter`); a training in a container of its own PID
namespace records its container PID, which NVML does not list, so it is not linked.

One daemon a host records into a database: a second one on the same host and database is
refused at start (:func:`edo_monitor.store.device_writer.claim_host`), since its rows would
double every GPU's with nothing to tell them apart; daemons of other hosts may share it.

Rows are written by a :class:`~edo_monitor.store.writer.DeviceWriter` thread (batched, at most
``flush_interval_s`` late); :meth:`Daemon.close` writes everything queued. :func:`run_daemon`
stops on SIGTERM (a service manager) and SIGINT (Ctrl-C), then closes: nothing queued is lost.
This module never imports torch.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from edo_monitor.checks import seconds
from edo_monitor.errors import ConfigError, NvmlUnavailableError
from edo_monitor.probes.nvml_device import NvmlDevice, NvmlProcess, _cause, _decode, nvml_module

__all__ = [
    "DEFAULT_INTERVAL_S",
    "RESCAN_INTERVAL_S",
    "Daemon",
    "DaemonResult",
    "run_daemon",
]

logger = logging.getLogger(__name__)

#: Seconds between samples by default.
DEFAULT_INTERVAL_S = 1.0
#: Seconds between reads of NVML's device list (GPUs appearing or gone).
RESCAN_INTERVAL_S = 10.0
#: Both process lists: CUDA contexts and graphics contexts (a desktop, a renderer).
_PROCESS_KINDS = ("compute", "graphics")
_DEVICE_TABLE, _PROCESS_TABLE, _EVENT_TABLE = "device_samples", "process_samples", "device_events"


@dataclass
class _Tracked:
    """A GPU the daemon reads: its NVML index and UUID, name, and reader."""

    index: int
    uuid: str
    name: str | None
    device: NvmlDevice


@dataclass
class DaemonResult:
    """What a daemon did, for its last line and for tests.

    Attributes:
        samples: samples taken (each: every available GPU read once).
        queued: rows handed to the writer, by table.
        written: rows the writer wrote, by table (equal to ``queued`` when nothing was lost).
        not_written: rows not written, by table (queue full, refused, database gone).
        devices: UUIDs of the GPUs read at the end.
        signal: the signal that stopped it (``signal.SIGTERM`` / ``SIGINT``), if any.
    """

    samples: int = 0
    queued: dict[str, int] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)
    not_written: dict[str, int] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    signal: int | None = None

    def summary(self) -> str:
        """One line: samples, rows written by table, rows not written."""
        lost = sum(self.not_written.values())
        return (
            f"{self.samples} sample(s) of {len(self.devices)} GPU(s); written: "
            f"{self.written.get(_DEVICE_TABLE, 0)} device row(s), "
            f"{self.written.get(_PROCESS_TABLE, 0)} process row(s), "
            f"{self.written.get(_EVENT_TABLE, 0)} event(s); not written: {lost}"
        )


class Daemon:
    """Samples every GPU and every process on it into a history database.

    Args:
        db: path, SQLAlchemy URL or ``None`` (``EDO_DB``, else ``./edo-history.db``); SQLite and
            PostgreSQL as every writer.
        interval_s: seconds between samples (> 0).
        nvml: the ``pynvml`` module, or a fake with its functions and exception classes
            (tests); ``None`` imports ``pynvml``.
        host: the host name written in every row and matched against ``runs.host`` (default
            ``socket.gethostname()``, as the agent writes it).
        rescan_interval_s: seconds between reads of NVML's device list.
        process_names: read process names with psutil.
        flush_interval_s: the writer's longest wait before a row is written.
        queue_size: rows the writer may hold (beyond: dropped and counted).
        clock: the time written in rows (Unix seconds), ``time.time``.

    Raises:
        ConfigError: ``interval_s`` or ``rescan_interval_s`` not a finite number of seconds > 0.
    """

    def __init__(
        self,
        db: str | os.PathLike[str] | None = None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        nvml: ModuleType | Any | None = None,
        host: str | None = None,
        rescan_interval_s: float = RESCAN_INTERVAL_S,
        process_names: bool = True,
        flush_interval_s: float = 1.0,
        queue_size: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.interval_s = seconds(interval_s, "interval_s", error=ConfigError)
        self.rescan_interval_s = seconds(rescan_interval_s, "rescan_interval_s", error=ConfigError)
        self.host = host or socket.gethostname()
        self.process_names = process_names
        self.flush_interval_s = flush_interval_s
        self.queue_size = queue_size
        self._clock = clock
        self._nvml_arg = nvml
        self._nvml: Any = None
        self._engine: Any = None
        self._writer: Any = None
        self._devices: dict[str, _Tracked] = {}
        self._names: dict[int, str | None] = {}
        self._next_rescan_s = 0.0
        self._nvml_fault: str | None = None
        self._closed = False
        self._started_written = 0
        self.result = DaemonResult(
            queued=dict.fromkeys((_DEVICE_TABLE, _PROCESS_TABLE, _EVENT_TABLE), 0)
        )

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Initialise NVML, then open the database (created or upgraded) and the writer, and
        read the device list (a ``device_appeared`` event per GPU).

        Raises:
            ConfigError: bad ``db`` (an in-memory SQLite database included).
            NvmlUnavailableError: NVML cannot be used (nothing is created then).
            StoreError: the database cannot be used (read-only, newer schema, unreachable), or
                another daemon is recording this host into it
                (:func:`edo_monitor.store.device_writer.claim_host`: two recorded every GPU
                twice, rows that nothing tells apart).
        """
        from edo_monitor.store.device_writer import DeviceWriter, claim_host
        from edo_monitor.store.engine import open_engine
        from edo_monitor.store.paths import check_writable, resolve_db_url

        url = resolve_db_url(self.db)
        check_writable(url)  # an in-memory or read-only database: refused before anything
        nvml, reason = nvml_module(self._nvml_arg)
        if nvml is None:
            raise NvmlUnavailableError(
                f"NVML is not available ({reason}); the daemon reads GPUs through the NVIDIA "
                "driver's NVML library"
            )
        self._nvml = nvml
        now = self._clock()
        try:
            self._engine = open_engine(url)
            # one daemon a host and database: a second recorded every GPU twice, unnoticed
            claim_host(self._engine, self.host, os.getpid(), self._started_row(now))
        except BaseException:
            self._shutdown_nvml()
            if self._engine is not None:
                self._engine.dispose()
                self._engine = None
            raise
        self.result.queued[_EVENT_TABLE] += 1
        self._started_written = 1  # written by claim_host, not by the writer
        self._writer = DeviceWriter(
            self._engine,
            host=self.host,
            queue_size=self.queue_size,
            flush_interval_s=self.flush_interval_s,
        )
        self._writer.start()
        self._rescan(now, at_start=True)

    def _started_row(self, now: float) -> dict[str, Any]:
        return {
            "time_s": now,
            "host": self.host,
            "device_index": None,
            "device_uuid": None,
            "kind": "daemon_started",
            "message": (
                f"edo-monitor daemon started (pid {os.getpid()}, every {self.interval_s:g} s)"
            ),
            "data": {"pid": os.getpid(), "interval_s": self.interval_s},
        }

    def close(self) -> DaemonResult:
        """Record ``daemon_stopped``, write everything queued, release NVML and the database.
        Idempotent; returns :attr:`result` (``written`` / ``not_written`` final)."""
        if self._closed:
            return self.result
        self._closed = True
        if self._writer is not None:
            self._event(
                self._clock(),
                "daemon_stopped",
                f"edo-monitor daemon stopped after {self.result.samples} sample(s)",
                {"samples": self.result.samples},
            )
            self._writer.close()
            self.result.written = dict(self._writer.written)
            self.result.written[_EVENT_TABLE] = (
                self.result.written.get(_EVENT_TABLE, 0) + self._started_written
            )
            self.result.not_written = dict(self._writer.not_written)
            self.result.written.pop("samples", None)
            self.result.not_written.pop("samples", None)
        self.result.devices = [u for u, t in self._devices.items() if t.device.available]
        self._shutdown_nvml()
        if self._engine is not None:
            from edo_monitor.store.engine import close_engine

            close_engine(self._engine)  # its rows in the file itself, not only its -wal
        return self.result

    def _shutdown_nvml(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                logger.debug("nvmlShutdown failed", exc_info=True)
            self._nvml = None

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, stop: threading.Event) -> None:
        """Sample every ``interval_s`` (on a fixed schedule; a late sample is not caught up)
        until ``stop`` is set. An unexpected error in one sample is logged (once per message)
        and the next sample is taken."""
        logged: set[str] = set()
        next_s = time.monotonic()
        while not stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # keep sampling: one bad sample is not the machine's end
                text = f"{type(exc).__name__}: {exc}"
                if text not in logged:
                    logged.add(text)
                    logger.exception("daemon: a sample failed (%s); going on", text)
            next_s += self.interval_s
            now = time.monotonic()
            if next_s < now:  # late (a slow database, a suspended machine): skip, do not burst
                next_s = now
            stop.wait(next_s - now)

    # -- one sample ----------------------------------------------------------------------------
    @property
    def devices(self) -> dict[str, int]:
        """UUID → NVML index of the GPUs being read (available ones)."""
        return {u: t.index for u, t in self._devices.items() if t.device.available}

    def sample(self) -> int:
        """Read every available GPU once and queue its rows; returns the rows queued. Reads
        the device list first when :attr:`rescan_interval_s` has passed."""
        if self._writer is None:
            raise RuntimeError("Daemon.sample() before start()")
        now = self._clock()
        if now >= self._next_rescan_s:
            self._rescan(now)
        put = self._writer.put_row
        host = self.host
        devices = processes = 0
        pids: set[int] = set()
        for tracked in list(self._devices.values()):
            device = tracked.device
            if not device.available:
                continue
            memory = device.read_memory()
            if not device.available:
                continue  # lost or stopped during this read: its event says so
            gpu, mem = device.read_utilization()
            procs = device.read_processes(_PROCESS_KINDS)
            put(
                _DEVICE_TABLE,
                {
                    "time_s": now,
                    "host": host,
                    "device_index": tracked.index,
                    "device_uuid": tracked.uuid,
                    "device_name": tracked.name,
                    **memory,
                    "utilization_gpu_fraction": gpu,
                    "utilization_memory_fraction": mem,
                    "process_count": None if procs is None else len(procs),
                },
            )
            devices += 1
            for proc in procs or ():
                pids.add(proc.pid)
                put(_PROCESS_TABLE, self._process_row(now, tracked, proc))
                processes += 1
        if len(self._names) > len(pids):  # forget the names of PIDs no longer on any GPU
            self._names = {p: n for p, n in self._names.items() if p in pids}
        self.result.samples += 1
        queued = self.result.queued
        queued[_DEVICE_TABLE] += devices
        queued[_PROCESS_TABLE] += processes
        return devices + processes

    def _process_row(self, now: float, tracked: _Tracked, proc: NvmlProcess) -> dict[str, Any]:
        return {
            "time_s": now,
            "host": self.host,
            "device_index": tracked.index,
            "device_uuid": tracked.uuid,
            "pid": proc.pid,
            "process_name": self._name(proc.pid),
            "kind": proc.kind,
            "process_device_bytes": proc.process_device_bytes,
        }

    def _name(self, pid: int) -> str | None:
        """The process's name (psutil), read once while the PID stays on a GPU."""
        if not self.process_names:
            return None
        if pid in self._names:
            return self._names[pid]
        import psutil

        try:
            name: str | None = psutil.Process(pid).name()
        except (psutil.Error, OSError):  # not visible here (container), gone, or not ours
            name = None
        self._names[pid] = name
        return name

    # -- the device list -----------------------------------------------------------------------
    def _rescan(self, now: float, *, at_start: bool = False) -> None:
        """Read NVML's device list: new GPUs (or lost ones answering again) appear, tracked
        ones no longer listed are lost."""
        self._next_rescan_s = now + self.rescan_interval_s
        nvml = self._nvml
        listed: dict[str, tuple[int, Any]] = {}
        try:
            count = int(nvml.nvmlDeviceGetCount())
            for index in range(count):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = _decode(nvml.nvmlDeviceGetUUID(handle))
                except Exception as exc:
                    if _cause(exc):
                        raise
                    logger.debug("daemon: device %d not readable now: %s", index, exc)
                    continue  # lost, or not answering: it is not (re)appearing now
                listed[uuid] = (index, handle)
        except Exception as exc:
            message = _cause(exc) or f"device list unreadable: {type(exc).__name__}: {exc}"
            if message != self._nvml_fault:
                self._nvml_fault = message
                logger.warning("NVML: %s", message)
                self._event(now, "nvml_unavailable", f"NVML: {message}", {"error": message})
            return
        self._nvml_fault = None
        for uuid, tracked in list(self._devices.items()):
            if uuid in listed:
                continue
            del self._devices[uuid]
            if tracked.device.available:
                tracked.device.close()
                logger.warning(
                    "daemon: GPU %d (%s) is no longer listed by NVML", tracked.index, uuid
                )
                self._event(
                    now,
                    "device_lost",
                    f"GPU {tracked.index} ({uuid}) is no longer in NVML's device list",
                    {"reason": "not listed"},
                    tracked,
                )
        for uuid, (index, handle) in listed.items():
            tracked = self._devices.get(uuid)
            if tracked is not None and (tracked.device.available or not tracked.device.lost):
                tracked.index = index  # an unavailable (not lost) device stays so: its event said
                continue
            again = tracked is not None
            tracked = _Tracked(index, uuid, None, None)  # type: ignore[arg-type]
            tracked.device = NvmlDevice(
                nvml, handle, uuid=uuid, index=index, on_event=self._device_reporter(tracked)
            )
            tracked.name = tracked.device.read_name()
            self._devices[uuid] = tracked
            what = "answers again" if again else ("found" if at_start else "appeared")
            logger.info("daemon: GPU %d (%s) %s", index, uuid, what)
            self._event(
                now,
                "device_appeared",
                f"GPU {index} ({uuid}, {tracked.name or 'name unknown'}) {what}",
                {"name": tracked.name, "at_start": at_start, "again": again},
                tracked,
            )

    def _device_reporter(self, tracked: _Tracked) -> Callable[[str, str, Mapping[str, Any]], None]:
        """The ``on_event`` of one device's reader: the device's own faults become device
        events (``device_lost`` / ``device_unavailable`` when the whole device stops, else
        ``probe_unavailable``)."""

        def report(kind: str, message: str, data: Mapping[str, Any]) -> None:
            if "field" not in data:  # the device as a whole
                kind = "device_lost" if data.get("lost") else "device_unavailable"
            self._event(self._clock(), kind, message, dict(data), tracked)

        return report

    def _event(
        self,
        now: float,
        kind: str,
        message: str,
        data: Mapping[str, Any],
        tracked: _Tracked | None = None,
    ) -> None:
        self._writer.put_row(
            _EVENT_TABLE,
            {
                "time_s": now,
                "host": self.host,
                "device_index": None if tracked is None else tracked.index,
                "device_uuid": None if tracked is None else tracked.uuid,
                "kind": kind,
                "message": message,
                "data": dict(data),
            },
        )
        self.result.queued[_EVENT_TABLE] += 1


def run_daemon(
    db: str | os.PathLike[str] | None = None,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    nvml: ModuleType | Any | None = None,
    stop: threading.Event | None = None,
    on_ready: Callable[[Daemon], None] | None = None,
    **kwargs: Any,
) -> DaemonResult:
    """Run a :class:`Daemon` in the foreground until ``stop`` is set or SIGTERM / SIGINT
    arrives (handled from the main thread for as long as it runs, previous handlers put back),
    then close it: everything queued is written.

    Args:
        db, interval_s, nvml, **kwargs: see :class:`Daemon`.
        stop: set it to stop (another thread); default: a new event.
        on_ready: called once the daemon has started (database open, devices listed).

    Returns:
        The daemon's :class:`DaemonResult` (``signal``: the signal that stopped it).

    Raises:
        NvmlUnavailableError: no NVML (nothing was created). ConfigError, StoreError: bad or
        unusable database.
    """
    from edo_monitor.signals import stop_on_signals

    stop = stop or threading.Event()
    received: list[int] = []
    daemon = Daemon(db, interval_s=interval_s, nvml=nvml, **kwargs)
    restore = stop_on_signals(stop, received)
    try:
        daemon.start()
        try:
            if on_ready is not None:
                on_ready(daemon)
            daemon.run(stop)
        finally:
            result = daemon.close()
    finally:
        restore()
    result.signal = received[0] if received else None
    return result
