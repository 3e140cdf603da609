"""NVML probe: whole-device memory and this process's share, through ``pynvml`` (nvidia-ml-py).

Calls: ``nvmlInit``; ``nvmlDeviceGetHandleByIndex`` / ``nvmlDeviceGetHandleByUUID`` and
``nvmlDeviceGetUUID`` to find the device; ``nvmlDeviceGetName``; ``nvmlDeviceGetMemoryInfo`` with
``version=nvmlMemory_v2`` (total, reserved, free, used; ``used`` excludes the driver's reserved
memory, as ``nvidia-smi`` shows it), falling back to v1 (``used = total - free``) when the driver
or binding lacks v2; ``nvmlDeviceGetComputeRunningProcesses`` for ``process_device_bytes``.

Device mapping: the torch device index counts the devices CUDA makes visible, in
``CUDA_VISIBLE_DEVICES`` order (entries are NVML indices, full UUIDs or unique UUID prefixes,
``GPU-…`` or ``MIG-…``). Once CUDA is initialised, the device's UUID from
``torch.cuda.get_device_properties(i).uuid`` is used instead; both are mapped to an NVML handle
by UUID. Before that, integer entries are read as NVML (PCI bus) indices, which matches CUDA's
order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are all the same model.

Failures: a missing library or driver, a driver/library mismatch, an unknown device make the whole
source unavailable. ``NotSupported`` (MIG devices, some process queries) makes that one field
``None``. ``GPU is lost`` mid-run marks the device unavailable for the rest of the run. Errors the
binding raises that are not ``NVMLError`` (``NVMLLibraryMismatchError`` for a missing versioned
function, ``AttributeError`` …) are handled like the rest. Every change is reported once, with
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
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from edo_monitor.probes import EventCallback, ignore_event

__all__ = ["NvmlProbe", "parse_visible_devices", "resolve_nvml_uuid"]

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

_NVML_FIELDS = (
    "device_total_bytes",
    "device_used_bytes",
    "device_free_bytes",
    "process_device_bytes",
    "nvml_memory_info_version",
)


def parse_visible_devices(value: str | None) -> list[str] | None:
    """Split ``CUDA_VISIBLE_DEVICES`` into entries; ``None`` when unset (all devices visible).

    CUDA stops at the first invalid entry; so does this (an empty entry ends the list).
    """
    if value is None:
        return None
    entries = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            break
        entries.append(part)
    return entries


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


def _uuid_of(nvml: Any, handle: Any) -> str:
    return _decode(nvml.nvmlDeviceGetUUID(handle))


def resolve_nvml_uuid(
    nvml: Any, torch_index: int, visible_devices: str | None, torch_uuid: str | None = None
) -> str:
    """Return the NVML UUID of torch device ``torch_index``.

    Args:
        nvml: the ``pynvml`` module (or a fake with the same functions and errors).
        torch_index: the device index as torch numbers it (0 = first visible device).
        visible_devices: the ``CUDA_VISIBLE_DEVICES`` value, or ``None`` when unset.
        torch_uuid: the UUID torch reports for the device (without prefix), when CUDA is
            initialised; it wins over the environment.

    Raises:
        LookupError: no NVML device matches, or a UUID prefix matches several.
    """
    count = nvml.nvmlDeviceGetCount()
    all_uuids = [_uuid_of(nvml, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    if torch_uuid:
        for candidate in (torch_uuid, f"GPU-{torch_uuid}", f"MIG-{torch_uuid}"):
            try:
                return _uuid_of(nvml, nvml.nvmlDeviceGetHandleByUUID(candidate))
            except Exception:
                continue
        raise LookupError(f"no NVML device has torch's UUID {torch_uuid!r}")
    entries = parse_visible_devices(visible_devices)
    if entries is None:
        if not 0 <= torch_index < count:
            raise LookupError(f"torch device {torch_index} but NVML sees {count} device(s)")
        return all_uuids[torch_index]
    if not 0 <= torch_index < len(entries):
        raise LookupError(
            f"torch device {torch_index} but CUDA_VISIBLE_DEVICES={visible_devices!r} "
            f"makes {len(entries)} visible"
        )
    entry = entries[torch_index]
    if entry.isdigit():
        index = int(entry)
        if index >= count:
            raise LookupError(f"CUDA_VISIBLE_DEVICES entry {entry!r}: NVML sees {count} device(s)")
        return all_uuids[index]
    if entry.startswith("MIG-"):
        return _uuid_of(nvml, nvml.nvmlDeviceGetHandleByUUID(entry))
    if not entry.startswith("GPU-"):
        raise LookupError(
            f"CUDA_VISIBLE_DEVICES entry {entry!r} is not an index, GPU- or MIG- UUID"
        )
    matches = [u for u in all_uuids if u.startswith(entry)]
    if len(matches) != 1:
        what = "no" if not matches else f"{len(matches)}"
        raise LookupError(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {what} NVML device(s)")
    return matches[0]


@dataclass
class _State:
    available: bool = False
    reason: str | None = None
    memory_info_version: int = 2
    process_supported: bool = True


class NvmlProbe:
    """Reads device memory through NVML for one torch device.

    Args:
        torch_index: torch's device index.
        nvml: the ``pynvml`` module; by default imported here. Tests pass a fake that raises
            pynvml's own exception classes.
        visible_devices: ``CUDA_VISIBLE_DEVICES`` (``None`` = unset); default (``...``) reads
            the environment.
        torch_uuid: the device UUID from torch, when CUDA is initialised.
        pid: this process's PID as NVML would list it (default ``os.getpid()``; differs inside
            containers that do not share the host PID namespace, in which case
            ``process_device_bytes`` is ``None``).
        on_event: callback for ``probe_unavailable`` events.
        fallback_name: the device's name from torch, used when NVML's cannot be read.
    """

    def __init__(
        self,
        torch_index: int = 0,
        *,
        nvml: ModuleType | Any | None = None,
        visible_devices: Any = ...,
        torch_uuid: str | None = None,
        pid: int | None = None,
        on_event: EventCallback = ignore_event,
        fallback_name: str | None = None,
    ) -> None:
        self.torch_index = torch_index
        self._fallback_name = fallback_name
        self._nvml = nvml
        self._visible = (
            os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices is ... else visible_devices
        )
        self._torch_uuid = torch_uuid
        self._pid = os.getpid() if pid is None else pid
        self._on_event = on_event
        self._handle: Any = None
        self._state = _State()
        self._reported: set[str] = set()
        self.device_name: str | None = None
        self.device_uuid: str | None = None
        self.device_total_bytes: int | None = None

    @property
    def available(self) -> bool:
        """Whether NVML answers for this device."""
        return self._state.available

    @property
    def reason(self) -> str | None:
        """Why the source is unavailable (``None`` when available)."""
        return self._state.reason

    def _report(self, key: str, message: str, **data: Any) -> None:
        if key in self._reported:
            return
        self._reported.add(key)
        logger.warning("NVML: %s", message)
        self._on_event("probe_unavailable", f"NVML: {message}", {"source": "nvml", **data})

    def _unavailable(self, message: str) -> None:
        self._state.available = False
        self._state.reason = message
        self._report("source", message)

    def start(self) -> bool:
        """Initialise NVML and find the device. Returns whether the source is available."""
        nvml = self._nvml
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:
                self._unavailable(f"nvidia-ml-py is not importable ({exc})")
                return False
            self._nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            self._unavailable(_cause(exc) or f"nvmlInit failed: {exc} ({type(exc).__name__})")
            return False
        try:
            uuid = resolve_nvml_uuid(nvml, self.torch_index, self._visible, self._torch_uuid)
            self._handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            self.device_uuid = uuid
        except Exception as exc:
            cause = _cause(exc)
            self._unavailable(cause or f"cannot find torch device {self.torch_index}: {exc}")
            return False
        self._state.available = True
        self.device_name = self._read_name()
        return True

    def _read_name(self) -> str | None:
        """The device name; never makes the source unavailable (pynvml decodes the C string
        strictly and raises ``UnicodeDecodeError`` on bytes that are not UTF-8)."""
        try:
            return _decode(self._nvml.nvmlDeviceGetName(self._handle))
        except Exception as exc:
            name = self._fallback_name
            self._report(
                "name",
                f"device name unreadable ({type(exc).__name__}: {exc}); using "
                + (f"torch's {name!r}" if name else "none"),
                field="name",
            )
            return name

    def _checked(self, field: str, value: Any, limit: int | None) -> int | None:
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
        self._report(
            f"impossible:{field}",
            f"{field} reported as {what}; recorded as unknown",
            field=field,
            value=str(number),
        )
        return None

    def close(self) -> None:
        """Shut NVML down (when it was started)."""
        if self._nvml is not None and self._handle is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                logger.debug("nvmlShutdown failed", exc_info=True)
        self._handle = None
        self._state.available = False

    def _is_lost(self, exc: BaseException) -> bool:
        lost = getattr(self._nvml, "NVMLError_GpuIsLost", None)
        return lost is not None and isinstance(exc, lost)

    def _not_supported(self, exc: BaseException) -> bool:
        ns = getattr(self._nvml, "NVMLError_NotSupported", None)
        return ns is not None and isinstance(exc, ns)

    def read(self) -> dict[str, Any]:
        """One reading: the keys of ``_NVML_FIELDS``, ``None`` where unavailable. Never raises."""
        out: dict[str, Any] = dict.fromkeys(_NVML_FIELDS)
        if not self._state.available:
            return out
        nvml, handle = self._nvml, self._handle
        try:
            info = None
            if self._state.memory_info_version == 2:
                try:
                    info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                except Exception as exc:
                    if self._is_lost(exc) or _cause(exc):
                        raise
                    # blame v2 only when v1 answers: an error that v1 shares is the real cause
                    info = nvml.nvmlDeviceGetMemoryInfo(handle)
                    self._state.memory_info_version = 1
                    self._report(
                        "v2",
                        f"memory info v2 unavailable ({type(exc).__name__}: {exc}); using v1",
                        field="memory_info_v2",
                    )
            if info is None:
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            total = self._checked("device_total_bytes", info.total, None)
            free = self._checked("device_free_bytes", info.free, total)
            if self._state.memory_info_version == 2:
                used = self._checked("device_used_bytes", info.used, total)
            else:
                used = None if total is None or free is None else total - free
            out.update(
                device_total_bytes=total,
                device_used_bytes=used,
                device_free_bytes=free,
                nvml_memory_info_version=self._state.memory_info_version,
            )
            if total is not None:
                self.device_total_bytes = total
        except Exception as exc:
            cause = _cause(exc)
            if self._is_lost(exc):
                self._unavailable(f"device lost: {exc}")
            elif cause is not None:
                self._unavailable(cause)
            elif self._not_supported(exc):
                self._report("meminfo-ns", f"memory info not supported: {exc}", field="memory")
            else:
                self._unavailable(f"memory info failed: {type(exc).__name__}: {exc}")
            return out
        if self._state.process_supported:
            out["process_device_bytes"] = self._process_bytes()
        return out

    def _process_bytes(self) -> int | None:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception as exc:
            if self._is_lost(exc):
                self._unavailable(f"device lost: {exc}")
                return None
            cause = _cause(exc)
            if cause is not None:
                self._unavailable(cause)
                return None
            self._state.process_supported = False
            self._report(
                "procs", f"process list unavailable ({type(exc).__name__}: {exc})", field="process"
            )
            return None
        for proc in procs:
            if int(proc.pid) == self._pid:
                used = getattr(proc, "usedGpuMemory", None)
                if used is None:
                    self._report(
                        "proc-mem",
                        "per-process memory not available from the driver",
                        field="process",
                    )
                    return None
                return self._checked("process_device_bytes", used, self.device_total_bytes)
        self._report(
            "proc-pid",
            f"pid {self._pid} not in the device's process list (container PID namespace?)",
            field="process",
        )
        return None
