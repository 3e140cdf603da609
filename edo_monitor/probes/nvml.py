"""NVML probe: whole-device memory, utilisation and processes, through ``pynvml`` (nvidia-ml-py).

Two layers. :class:`~edo_monitor.probes.nvml_device.NvmlDevice` reads one device handle and owns
every piece of fault handling (what each fault does: :mod:`edo_monitor.probes.nvml_device`); the
agent's :class:`NvmlProbe` here (one torch device: its memory and this process's share) and the
system-wide daemon (:mod:`edo_monitor.surfaces.daemon`: every device and every process) both read
through it.

Calls here: ``nvmlInit`` (through :func:`~edo_monitor.probes.nvml_device.nvml_module`);
``nvmlDeviceGetHandleByIndex`` / ``nvmlDeviceGetHandleByUUID`` and ``nvmlDeviceGetUUID`` to find
the device; the device's own queries are :class:`~edo_monitor.probes.nvml_device.NvmlDevice`'s.

Device mapping: the torch device index counts the devices CUDA makes visible, in
``CUDA_VISIBLE_DEVICES`` order (entries are NVML indices, full UUIDs or unique UUID prefixes,
``GPU-…`` or ``MIG-…``). Once CUDA is initialised, the device's UUID from
``torch.cuda.get_device_properties(i).uuid`` is used instead; both are mapped to an NVML handle
by UUID. Before that, integer entries are read as NVML (PCI bus) indices, which matches CUDA's
order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are all the same model.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

from edo_monitor.probes import EventCallback, ignore_event
from edo_monitor.probes.nvml_device import NvmlDevice, _cause, _decode, nvml_module

__all__ = [
    "NvmlProbe",
    "parse_visible_devices",
    "resolve_nvml_uuid",
]

logger = logging.getLogger(__name__)

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


class NvmlProbe:
    """Reads device memory through NVML for one torch device (the agent's probe).

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
        self._device: NvmlDevice | None = None
        self._reason: str | None = None
        self._reported: set[str] = set()
        self._started = False
        self.device_name: str | None = None
        self.device_uuid: str | None = None

    @property
    def available(self) -> bool:
        """Whether NVML answers for this device."""
        return self._device is not None and self._device.available

    @property
    def reason(self) -> str | None:
        """Why the source is unavailable (``None`` when available)."""
        return self._device.reason if self._device is not None else self._reason

    @property
    def device_total_bytes(self) -> int | None:
        """The device's total memory from the last good reading (bytes)."""
        return self._device.device_total_bytes if self._device is not None else None

    def _unavailable(self, message: str) -> None:
        self._reason = message
        if "source" not in self._reported:
            self._reported.add("source")
            logger.warning("NVML: %s", message)
            self._on_event("probe_unavailable", f"NVML: {message}", {"source": "nvml"})

    def start(self) -> bool:
        """Initialise NVML and find the device. Returns whether the source is available."""
        nvml, reason = nvml_module(self._nvml)
        if nvml is None:
            self._unavailable(reason or "NVML unavailable")
            return False
        self._nvml = nvml
        self._started = True
        try:
            uuid = resolve_nvml_uuid(nvml, self.torch_index, self._visible, self._torch_uuid)
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception as exc:
            cause = _cause(exc)
            self._unavailable(cause or f"cannot find torch device {self.torch_index}: {exc}")
            return False
        self.device_uuid = uuid
        self._device = NvmlDevice(
            nvml,
            handle,
            uuid=uuid,
            on_event=self._on_event,
            fallback_name=self._fallback_name,
        )
        self.device_name = self._device.read_name()
        return True

    def close(self) -> None:
        """Shut NVML down (when it was started)."""
        if self._started:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                logger.debug("nvmlShutdown failed", exc_info=True)
            self._started = False
        if self._device is not None:
            self._device.close()

    def read(self) -> dict[str, Any]:
        """One reading: the keys of ``_NVML_FIELDS``, ``None`` where unavailable. Never raises."""
        out: dict[str, Any] = dict.fromkeys(_NVML_FIELDS)
        device = self._device
        if device is None or not device.available:
            return out
        out.update(device.read_memory())
        if device.available and out["nvml_memory_info_version"] is not None:  # memory answered
            out["process_device_bytes"] = self._process_bytes(device)
        return out

    def _process_bytes(self, device: NvmlDevice) -> int | None:
        procs = device.read_processes(("compute",), pid=self._pid)
        if procs is None:
            return None
        for proc in procs:
            if proc.pid == self._pid:
                if proc.driver_na:
                    device.report(
                        "proc-mem",
                        "per-process memory not available from the driver",
                        field="process",
                    )
                return proc.process_device_bytes
        device.report(
            "proc-pid",
            f"pid {self._pid} not in the device's process list (container PID namespace?)",
            field="process",
        )
        return None
