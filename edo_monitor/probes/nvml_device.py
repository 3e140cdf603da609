"""One NVML device handle, read with every fault handled: :class:`NvmlDevice`.

This module is the one place that asks NVML about a device: :class:`NvmlDevice` reads one handle
(name, memory, processes, utilisation) and owns every piece of fault handling, for the agent's
:class:`~edo_monitor.probes.nvml.NvmlProbe` and the system-wide daemon
(:mod:`edo_monitor.surfaces.daemon`) alike; :class:`NvmlProcess` is one process it lists and
:func:`nvml_module` imports and initialises ``pynvml``, or says why it cannot.

Calls: ``nvmlDeviceGetName``; ``nvmlDeviceGetMemoryInfo`` with ``version=nvmlMemory_v2`` (total,
reserved, free, used; ``used`` excludes the driver's reserved memory, as ``nvidia-smi`` shows
it), falling back to v1 (``used = total - free``) when the driver or binding lacks v2;
``nvmlDeviceGetComputeRunningProcesses`` (and, for the daemon,
``nvmlDeviceGetGraphicsRunningProcesses``) for per-process bytes; ``nvmlDeviceGetUtilizationRates``
(the daemon) for busy fractions.

Failures: a missing library or driver, a driver/library mismatch, an unknown device make the whole
source unavailable. ``NotSupported`` (MIG devices, some process queries) makes that one field
``None`` (an optional query, processes or utilisation, is then not asked again); any other error
of an optional query makes this reading's value ``None`` and it is asked again next time.
``GPU is lost`` mid-run marks the device unavailable for the rest of the run
(:attr:`NvmlDevice.lost`). Errors the binding raises that are not ``NVMLError``
(``NVMLLibraryMismatchError`` for a missing versioned function, ``AttributeError`` …) are handled
like the rest. Every change is reported once, with
its real cause: when the v2 memory query fails, v1 is tried before v2 is blamed, so a driver that
stopped answering (library/driver version mismatch after an upgrade, driver unloaded) is reported
as that, once, and not first as "memory info v2 unavailable".

Impossible values are unknown, not numbers: a byte count of ``NVML_VALUE_NOT_AVAILABLE``
(2**64 − 1, the driver's "N/A"), of 2**63 or more (it would not fit the history's signed 64-bit
integers) or above the device's total memory reads ``None``, reported once per field. A device
name that is not valid UTF-8 (pynvml's ``.decode()`` raises) does not make the source
unavailable: the name is decoded leniently or taken from torch (``fallback_name``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from edo_monitor.probes import EventCallback, ignore_event

__all__ = [
    "NvmlDevice",
    "NvmlProcess",
    "nvml_module",
]

logger = logging.getLogger(__name__)

#: NVML's "not available" value for unsigned 64-bit fields (``NVML_VALUE_NOT_AVAILABLE``).
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1
#: Byte counts at or above this do not fit a signed 64-bit integer (SQLite's INTEGER).
_INT64_LIMIT = 2**63

#: Errors that mean NVML as a whole stopped answering (not one function or field): the driver
#: and library versions differ (upgraded without a reboot), the driver is not loaded, NVML is
#: not initialised, the library is gone. pynvml's exception class names.
_FATAL_ERRORS = {
    "NVMLError_LibRmVersionMismatch": "NVML library and kernel driver versions do not match "
    "(driver upgraded without a reboot?)",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
    "NVMLError_Uninitialized": "NVML is not initialised",
    "NVMLError_LibraryNotFound": "the NVML library was not found",
}


def _decode(value: Any) -> str:
    """A str from NVML's ``char[]`` results; bytes that are not UTF-8 are replaced, not fatal."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _cause(exc: BaseException) -> str | None:
    """The real cause when ``exc`` means NVML as a whole stopped answering, else ``None``."""
    for cls in type(exc).__mro__:
        cause = _FATAL_ERRORS.get(cls.__name__)
        if cause is not None:
            return f"{cause}: {exc} ({type(exc).__name__})"
    return None


@dataclass(frozen=True)
class NvmlProcess:
    """One process on a device, as NVML lists it.

    Attributes:
        pid: the process id NVML reports (the host's PID namespace).
        process_device_bytes: its memory on the device, CUDA context included (``usedGpuMemory``
            of ``nvmlDeviceGetComputeRunningProcesses`` / ``…GraphicsRunningProcesses``);
            ``None`` when the driver gives N/A or an impossible value.
        kind: ``"compute"``, ``"graphics"`` or ``"compute+graphics"`` (listed by both calls;
            the larger of the two byte counts is kept).
        driver_na: the driver itself said N/A for the memory (pynvml gives ``None``), as opposed
            to a value found impossible here.
    """

    pid: int
    process_device_bytes: int | None
    kind: str
    driver_na: bool = False


#: process-list calls by kind: (pynvml function, report key, what the report calls it)
_PROCESS_CALLS = {
    "compute": ("nvmlDeviceGetComputeRunningProcesses", "procs", "process list"),
    "graphics": (
        "nvmlDeviceGetGraphicsRunningProcesses",
        "graphics-procs",
        "graphics process list",
    ),
}


class NvmlDevice:
    """One NVML device handle, read with every fault handled: the one place that does it (the
    agent's :class:`NvmlProbe` and the system-wide daemon, :mod:`edo_monitor.surfaces.daemon`, both
    read through it).

    What each fault does (module docstring): a lost GPU (``NVMLError_GpuIsLost``) or NVML
    stopping as a whole (driver/library mismatch, driver unloaded …) makes the device
    unavailable for good (:attr:`available` False, :attr:`reason`, :attr:`lost`); ``NotSupported``
    on one query makes that query's value ``None`` and the query is not asked again; any other
    error on an optional query (processes, utilisation) makes this reading's value ``None``, and
    the query is asked again next time. Each change is reported once (log warning and
    ``on_event("probe_unavailable", message, data)``). No method raises.

    Args:
        nvml: the ``pynvml`` module (or a fake with its functions and exception classes),
            initialised.
        handle: the device's handle (``nvmlDeviceGetHandleByIndex`` / ``…ByUUID``).
        uuid: the device's UUID, for reports. index: its NVML index, for reports.
        on_event: callback for ``probe_unavailable`` events.
        fallback_name: the name to use when NVML's cannot be read (e.g. torch's).
    """

    def __init__(
        self,
        nvml: ModuleType | Any,
        handle: Any,
        *,
        uuid: str | None = None,
        index: int | None = None,
        on_event: EventCallback = ignore_event,
        fallback_name: str | None = None,
    ) -> None:
        self._nvml = nvml
        self.handle = handle
        self.uuid = uuid
        self.index = index
        self._on_event = on_event
        self._fallback_name = fallback_name
        self._available = True
        self._reason: str | None = None
        self._lost = False
        self._memory_info_version = 2
        self._not_supported: set[str] = set()
        self._reported: set[str] = set()
        #: the device's total memory from the last good reading (bytes), bounds other values
        self.device_total_bytes: int | None = None

    @property
    def available(self) -> bool:
        """Whether NVML still answers for this device."""
        return self._available

    @property
    def reason(self) -> str | None:
        """Why the device is unavailable (``None`` while available)."""
        return self._reason

    @property
    def lost(self) -> bool:
        """Whether the device was lost (``NVMLError_GpuIsLost``: fell off the bus, reset)."""
        return self._lost

    def report(self, key: str, message: str, **data: Any) -> None:
        """Log ``message`` and emit a ``probe_unavailable`` event, once per ``key``."""
        if key in self._reported:
            return
        self._reported.add(key)
        logger.warning("NVML: %s", message)
        self._on_event("probe_unavailable", f"NVML: {message}", {"source": "nvml", **data})

    def _unavailable(self, message: str, *, lost: bool = False) -> None:
        self._available = False
        self._reason = message
        self._lost = self._lost or lost
        self.report("source", message, **({"lost": True} if lost else {}))

    def _is(self, exc: BaseException, name: str) -> bool:
        cls = getattr(self._nvml, name, None)
        return cls is not None and isinstance(exc, cls)

    def _fatal(self, exc: BaseException) -> bool:
        """Mark the device unavailable when ``exc`` means it is lost or NVML stopped; whether
        it did."""
        if self._is(exc, "NVMLError_GpuIsLost"):
            self._unavailable(f"device lost: {exc}", lost=True)
            return True
        cause = _cause(exc)
        if cause is not None:
            self._unavailable(cause)
            return True
        return False

    def _optional(self, key: str, field: str, what: str, call: str) -> tuple[bool, Any]:
        """Ask one optional query; ``(True, value)``, or ``(False, None)`` after handling its
        fault (see the class docstring)."""
        if not self._available or key in self._not_supported:
            return False, None
        try:
            return True, getattr(self._nvml, call)(self.handle)
        except Exception as exc:
            if self._fatal(exc):
                return False, None
            if self._is(exc, "NVMLError_NotSupported"):
                self._not_supported.add(key)
            self.report(key, f"{what} unavailable ({type(exc).__name__}: {exc})", field=field)
            return False, None

    def read_name(self) -> str | None:
        """The device name (``nvmlDeviceGetName``); never makes the device unavailable (pynvml
        decodes the C string strictly and raises ``UnicodeDecodeError`` on bytes that are not
        UTF-8): the fallback name is used instead, reported once."""
        try:
            return _decode(self._nvml.nvmlDeviceGetName(self.handle))
        except Exception as exc:
            name = self._fallback_name
            self.report(
                "name",
                f"device name unreadable ({type(exc).__name__}: {exc}); using "
                + (f"torch's {name!r}" if name else "none"),
                field="name",
            )
            return name

    def checked(self, field: str, value: Any, limit: int | None) -> int | None:
        """``value`` as an int, or ``None`` (reported once per field) when it is impossible:
        NVML's N/A value, 2**63 or more, negative, or above ``limit`` (the device total)."""
        if value is None:
            return None
        number = int(value)
        if 0 <= number < _INT64_LIMIT and (limit is None or number <= limit):
            return number
        what = (
            "NVML_VALUE_NOT_AVAILABLE (2**64-1)"
            if number == NVML_VALUE_NOT_AVAILABLE
            else f"{number}"
            + (f" > device total {limit}" if limit is not None and 0 <= number < _INT64_LIMIT
               else " (outside 0 .. 2**63-1)")
        )  # fmt: skip
        self.report(
            f"impossible:{field}",
            f"{field} reported as {what}; recorded as unknown",
            field=field,
            value=str(number),
        )
        return None

    def read_memory(self) -> dict[str, Any]:
        """Whole-device memory: ``device_total_bytes``, ``device_used_bytes``,
        ``device_free_bytes`` (bytes) and ``nvml_memory_info_version`` (2 or 1), ``None`` where
        unavailable.

        From ``nvmlDeviceGetMemoryInfo(version=nvmlMemory_v2)`` (``used`` excludes the driver's
        reserved memory, as ``nvidia-smi`` shows it), else v1 (``used = total - free``): v1 is
        tried before v2 is blamed, so a driver that stopped answering is reported as that."""
        out: dict[str, Any] = dict.fromkeys(_MEMORY_FIELDS)
        if not self._available:
            return out
        nvml, handle = self._nvml, self.handle
        try:
            info = None
            if self._memory_info_version == 2:
                try:
                    info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                except Exception as exc:
                    if self._is(exc, "NVMLError_GpuIsLost") or _cause(exc):
                        raise
                    # blame v2 only when v1 answers: an error that v1 shares is the real cause
                    info = nvml.nvmlDeviceGetMemoryInfo(handle)
                    self._memory_info_version = 1
                    self.report(
                        "v2",
                        f"memory info v2 unavailable ({type(exc).__name__}: {exc}); using v1",
                        field="memory_info_v2",
                    )
            if info is None:
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            total = self.checked("device_total_bytes", info.total, None)
            free = self.checked("device_free_bytes", info.free, total)
            if self._memory_info_version == 2:
                used = self.checked("device_used_bytes", info.used, total)
            else:
                used = None if total is None or free is None else total - free
        except Exception as exc:
            if self._fatal(exc):
                return out
            if self._is(exc, "NVMLError_NotSupported"):
                self.report("meminfo-ns", f"memory info not supported: {exc}", field="memory")
            else:
                self._unavailable(f"memory info failed: {type(exc).__name__}: {exc}")
            return out
        out.update(
            device_total_bytes=total,
            device_used_bytes=used,
            device_free_bytes=free,
            nvml_memory_info_version=self._memory_info_version,
        )
        if total is not None:
            self.device_total_bytes = total
        return out

    def read_processes(
        self, kinds: tuple[str, ...] = ("compute",), *, pid: int | None = None
    ) -> list[NvmlProcess] | None:
        """The processes on the device, by ``kinds`` (``"compute"``:
        ``nvmlDeviceGetComputeRunningProcesses``, ``"graphics"``:
        ``nvmlDeviceGetGraphicsRunningProcesses``), one entry per PID (only ``pid``'s when
        given); ``None`` when no asked list could be read. Byte counts above the device's total
        memory are impossible (``None``, reported once)."""
        by_pid: dict[int, NvmlProcess] = {}
        answered = False
        for kind in kinds:
            call, key, what = _PROCESS_CALLS[kind]
            field = "process" if kind == "compute" else f"{kind}_process"
            ok, procs = self._optional(key, field, what, call)
            if not ok:
                continue
            answered = True
            for proc in procs:
                proc_pid = int(proc.pid)
                if pid is not None and proc_pid != pid:
                    continue
                raw = getattr(proc, "usedGpuMemory", None)
                used = self.checked("process_device_bytes", raw, self.device_total_bytes)
                seen = by_pid.get(proc_pid)
                if seen is None:
                    by_pid[proc_pid] = NvmlProcess(proc_pid, used, kind, raw is None)
                elif seen.kind != kind:
                    best = used if seen.process_device_bytes is None else seen.process_device_bytes
                    if used is not None and best is not None:
                        best = max(best, used)
                    by_pid[proc_pid] = NvmlProcess(
                        proc_pid, best, f"{seen.kind}+{kind}", seen.driver_na and raw is None
                    )
        return list(by_pid.values()) if answered else None

    def read_utilization(self) -> tuple[float | None, float | None]:
        """``(gpu, memory)`` busy fractions in [0, 1] over NVML's last sample period
        (``nvmlDeviceGetUtilizationRates``: the share of time a kernel ran, and the share of
        time device memory was read or written); ``None`` where unavailable (MIG devices and
        some boards do not support it)."""
        ok, rates = self._optional("utilization", "utilization", "utilization", _UTIL_CALL)
        if not ok:
            return None, None
        out: list[float | None] = []
        for name in ("gpu", "memory"):
            value = getattr(rates, name, None)
            if value is None or not 0 <= int(value) <= 100:
                if value is not None:
                    self.report(
                        f"impossible:utilization_{name}",
                        f"utilization.{name} reported as {value}%; recorded as unknown",
                        field=f"utilization_{name}",
                        value=str(value),
                    )
                out.append(None)
            else:
                out.append(int(value) / 100.0)
        return out[0], out[1]

    def close(self) -> None:
        """Stop reading the device (nothing is asked of NVML after this)."""
        self._available = False
        self._reason = self._reason or "closed"


_UTIL_CALL = "nvmlDeviceGetUtilizationRates"
_MEMORY_FIELDS = (
    "device_total_bytes",
    "device_used_bytes",
    "device_free_bytes",
    "nvml_memory_info_version",
)


def nvml_module(nvml: ModuleType | Any | None = None) -> tuple[Any, str | None]:
    """``(pynvml, None)`` initialised, or ``(None, reason)`` when NVML cannot be used: the
    binding is not importable, or ``nvmlInit`` fails (library or driver missing, driver and
    library versions differ …), the reason naming the real cause.

    Args:
        nvml: the module (or a fake) to initialise; ``None`` imports ``pynvml``.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return None, f"nvidia-ml-py is not importable ({exc})"
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return None, _cause(exc) or f"nvmlInit failed: {exc} ({type(exc).__name__})"
    return nvml, None
