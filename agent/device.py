"""The watched device and its probes: :class:`Device`.

Which device the run watches (the model's first CUDA parameter, the current CUDA device of a
process already using CUDA, else the host in CPU-budget mode), the probes that read it (host
always; NVML and the caching allocator on CUDA: DESIGN.md §3 rule 4, hardware only in the
probes), the budget the policy measures against, and on CUDA the per-process memory fraction
that enforces a ``budget=`` (reset when the run ends).
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from edo_monitor.probes.host import HostProbe

__all__ = ["Device"]

logger = logging.getLogger(__name__)


class Device:
    """The device of one run and its probes.

    Args:
        budget_bytes_requested: the user's ``budget=`` in bytes (``None``: none).
        snapshot_interval_s: seconds between allocator snapshots (CUDA; 0 = never).
        on_event: ``(kind, message, data)``: the probes' events (NVML missing ...).

    Attributes:
        kind: ``"cuda"`` or ``"cpu-budget"``.
        index: the CUDA device index (``None`` in CPU-budget mode).
        budget_bytes: the capacity the policy measures against: ``min(device total, budget=)`` on
            CUDA (``torch.cuda.get_device_properties().total_memory``), ``budget=`` on a CPU.
        name, uuid, total_bytes: what the run records (NVML's name and UUID, else torch's;
            ``None`` in CPU-budget mode but the name).
        probes: ``"host"`` (:class:`HostProbe`), and on CUDA ``"nvml"`` (``NvmlProbe``) and
            ``"cuda"`` (``AllocatorProbe``).
    """

    def __init__(
        self,
        budget_bytes_requested: int | None,
        *,
        snapshot_interval_s: float,
        on_event: Callable[[str, str, Mapping[str, Any] | None], None],
    ) -> None:
        self.budget_bytes_requested = budget_bytes_requested
        self.snapshot_interval_s = snapshot_interval_s
        self._on_event = on_event
        self.kind = "cpu-budget"
        self.index: int | None = None
        self.budget_bytes: int | None = budget_bytes_requested
        self.name = f"host CPU ({platform.machine() or 'unknown'})"  # cpu-budget: modelled
        self.uuid: str | None = None
        self.total_bytes: int | None = None
        self.probes: dict[str, Any] = {}
        self._fraction_set = False

    def detect(self, model: nn.Module | None) -> None:
        """Set :attr:`kind` and :attr:`index` from the model's parameters (or, without a model,
        from a process that has already initialised CUDA)."""
        cuda_index = None
        if model is not None:
            for p in model.parameters():
                if p.is_cuda:
                    cuda_index = p.device.index if p.device.index is not None else 0
                    break
        elif torch.cuda.is_initialized() and torch.cuda.is_available():
            # is_initialized first: is_available() may initialise the driver (it queries the
            # device count), which can break a DataLoader that forks later
            cuda_index = torch.cuda.current_device()
        if cuda_index is not None:
            self.kind = "cuda"
            self.index = cuda_index

    def open_probes(self) -> None:
        """Start the probes; on CUDA read the device's name, UUID and total memory and, with a
        budget, set the per-process memory fraction."""
        host = HostProbe(on_event=self._on_event)
        host.start()  # process tree and cgroup on their own thread
        self.probes["host"] = host
        if self.kind != "cuda":
            return
        from edo_monitor.probes.cuda import AllocatorProbe
        from edo_monitor.probes.nvml import NvmlProbe

        props = torch.cuda.get_device_properties(self.index)
        torch_uuid = str(getattr(props, "uuid", "") or "") or None
        nvml = NvmlProbe(
            self.index or 0,
            torch_uuid=torch_uuid,
            on_event=self._on_event,
            fallback_name=props.name,
        )
        nvml.start()
        self.probes["nvml"] = nvml
        self.probes["cuda"] = AllocatorProbe(
            self.index or 0,
            snapshot_interval_s=self.snapshot_interval_s,
            on_event=self._on_event,
        )
        self.name = nvml.device_name or props.name
        self.uuid = nvml.device_uuid or (f"GPU-{torch_uuid}" if torch_uuid else None)
        self.total_bytes = int(props.total_memory)
        self.budget_bytes = self.total_bytes
        if self.budget_bytes_requested is not None:
            self.budget_bytes = min(self.total_bytes, self.budget_bytes_requested)
            torch.cuda.set_per_process_memory_fraction(
                self.budget_bytes / self.total_bytes, self.index
            )
            self._fraction_set = True

    def reset_fraction(self) -> None:
        """Give back the whole device: undo the per-process memory fraction (safe to call twice,
        and when none was set)."""
        if self._fraction_set:
            try:
                torch.cuda.set_per_process_memory_fraction(1.0, self.index)
            except Exception:
                logger.debug("could not reset the memory fraction", exc_info=True)
            self._fraction_set = False

    def close_probes(self) -> None:
        """Stop the NVML and host probes."""
        nvml = self.probes.get("nvml")
        if nvml is not None:
            nvml.close()
        host = self.probes.get("host")
        if host is not None:
            host.close()
