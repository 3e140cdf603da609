"""A fake NVML with pynvml's own functions, structs and exception classes.

Only the hardware is faked: every error raised here is the class the real ``pynvml`` raises for
that condition (``NVMLError_NotSupported``, ``NVMLError_GpuIsLost``, ``NVMLLibraryMismatchError``
…), so the probe's error handling meets the real thing's semantics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml


@dataclass
class FakeGpu:
    """One device. ``name`` may be ``bytes`` (the driver's raw ``char[]``); bytes that are not
    UTF-8 make ``nvmlDeviceGetName`` raise ``UnicodeDecodeError`` as pynvml's strict
    ``.decode()`` does. ``processes`` are ``(pid, usedGpuMemory)``: ``None`` is what pynvml gives
    for ``NVML_VALUE_NOT_AVAILABLE``; a raw ``2**64 - 1`` models a binding that passes the
    driver's value through. ``graphics_processes`` are the same for
    ``nvmlDeviceGetGraphicsRunningProcesses``. ``utilization`` is ``(gpu %, memory %)`` for
    ``nvmlDeviceGetUtilizationRates``, ``None`` where the board does not support it
    (``NVMLError_NotSupported``, as MIG devices). ``process_error`` / ``utilization_error``: an
    NVML error code both process-list calls / the utilisation call raise (e.g.
    ``NVML_ERROR_NO_PERMISSION``, ``NVML_ERROR_UNKNOWN``). A lost device
    (``lost_after_reads`` reached) raises ``NVMLError_GpuIsLost`` from every query, the handle and
    UUID lookups included, as a GPU that fell off the bus does."""

    uuid: str
    name: str | bytes = "NVIDIA H200"
    total: int = 150_000_000_000
    used: int = 10_000_000_000
    reserved: int = 500_000_000
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    mig: bool = False
    memory_not_supported: bool = False
    lost_after_reads: int | None = None
    reads: int = 0
    graphics_processes: list[tuple[int, int | None]] = field(default_factory=list)
    utilization: tuple[int, int] | None = (50, 20)
    process_error: int | None = None
    utilization_error: int | None = None

    @property
    def lost(self) -> bool:
        """Whether the device has been lost (after ``lost_after_reads`` memory reads)."""
        return self.lost_after_reads is not None and self.reads >= self.lost_after_reads


class FakeNvml:
    """Implements the pynvml calls the probe and the daemon use, over a list of :class:`FakeGpu`
    (``gpus`` may change while it is used: a GPU appended appears, one removed is no longer
    enumerated).

    Args:
        gpus: devices in NVML (PCI bus) order.
        library_missing: ``nvmlInit`` raises ``NVMLError_LibraryNotFound``.
        driver_mismatch: ``nvmlInit`` raises ``NVMLError_LibRmVersionMismatch``.
        has_v2: the driver exports ``nvmlDeviceGetMemoryInfo_v2`` (else pynvml raises
            ``NVMLError_FunctionNotFound``).
        v2_binding_error: the binding itself fails on the versioned call with an error that is
            not an ``NVMLError`` (``NVMLLibraryMismatchError``), as pynvml's version-mismatch
            wrapper does.
        mismatch_after_reads: after this many memory reads (all devices), every device query
            raises ``NVMLError_LibRmVersionMismatch``: the kernel driver was replaced under a
            running process (an upgrade without a reboot); ``nvmlDeviceGetCount`` fails the same
            way. ``0``: from the first query, with ``nvmlInit`` succeeding.
    """

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        library_missing: bool = False,
        driver_mismatch: bool = False,
        has_v2: bool = True,
        v2_binding_error: bool = False,
        mismatch_after_reads: int | None = None,
    ) -> None:
        self.mismatch_after_reads = mismatch_after_reads
        self.gpus = gpus
        self.library_missing = library_missing
        self.driver_mismatch = driver_mismatch
        self.has_v2 = has_v2
        self.v2_binding_error = v2_binding_error
        self.initialised = False
        self.shutdowns = 0

    def _err(self, code: int) -> pynvml.NVMLError:
        return pynvml.NVMLError(code)  # pynvml maps the code to its subclass in __new__

    def nvmlInit(self) -> None:
        if self.library_missing:
            raise self._err(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if self.driver_mismatch:
            raise self._err(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def _check(self) -> None:
        if not self.initialised:
            raise self._err(pynvml.NVML_ERROR_UNINITIALIZED)

    def _check_driver(self) -> None:
        after = self.mismatch_after_reads
        if after is not None and sum(g.reads for g in self.gpus) >= after:
            raise self._err(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        self._check_driver()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise self._err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._maybe_lost(self.gpus[index])
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._check()
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise self._err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        self._maybe_lost(handle)
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        self._check()
        name = handle.name
        return name.decode() if isinstance(name, bytes) else name  # pynvml's convertStrBytes

    def _maybe_lost(self, gpu: FakeGpu) -> None:
        if gpu.lost:
            raise self._err(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version: int | None = None) -> Any:
        self._check()
        self._check_driver()
        self._maybe_lost(handle)
        if handle.memory_not_supported:
            raise self._err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version:
            if self.v2_binding_error:
                raise pynvml.NVMLLibraryMismatchError("versioned function missing")
            if not self.has_v2:
                raise self._err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        handle.reads += 1
        free = handle.total - handle.used - (handle.reserved if version else 0)
        if version:
            return SimpleNamespace(
                version=version, total=handle.total, reserved=handle.reserved, free=free,
                used=handle.used,
            )  # fmt: skip
        return SimpleNamespace(
            total=handle.total, free=handle.total - handle.used, used=handle.used
        )

    def _process_list(self, handle: FakeGpu, processes: list[tuple[int, int | None]]) -> list[Any]:
        self._check()
        self._check_driver()
        self._maybe_lost(handle)
        if handle.mig:
            raise self._err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if handle.process_error is not None:
            raise self._err(handle.process_error)
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in processes]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[Any]:
        return self._process_list(handle, handle.processes)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeGpu) -> list[Any]:
        return self._process_list(handle, handle.graphics_processes)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> Any:
        self._check()
        self._check_driver()
        self._maybe_lost(handle)
        if handle.utilization_error is not None:
            raise self._err(handle.utilization_error)
        if handle.mig or handle.utilization is None:
            raise self._err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gpu, memory = handle.utilization
        return SimpleNamespace(gpu=gpu, memory=memory)
