"""The sample record: one :class:`Reading` per sampler tick.

Field names are DESIGN.md §2's vocabulary; they are also the ``samples`` table's columns. ``None``
means "not available from this source now" (no NVML, CUDA not initialised yet, CPU-budget mode),
never zero.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["SAMPLE_FIELDS", "Reading"]


@dataclass(frozen=True)
class Reading:
    """One sample of memory from every vantage point.

    Sources: ``device_*`` and ``process_device_bytes`` from NVML (``nvmlDeviceGetMemoryInfo`` v2
    or v1, see ``nvml_memory_info_version``; ``nvmlDeviceGetComputeRunningProcesses``), else
    ``torch.cuda.mem_get_info``; allocator fields from ``torch.cuda.memory_stats()``
    (``.all.current`` / ``.all.peak`` keys); ``fragmentation``, ``largest_inactive_block_bytes``
    and ``segment_count`` from ``torch.cuda.memory_snapshot()`` (taken less often); category
    bytes from :func:`edo_monitor.measure.accounting.account` and the saved-tensor hooks; host
    fields from psutil and the process's cgroup (the smaller of machine and cgroup; the process tree
    by PSS, see :mod:`edo_monitor.probes.host`). ``in_use_bytes`` is what counts against
    ``budget_bytes``; ``free_fraction`` is ``(budget_bytes - in_use_bytes) / budget_bytes``.
    ``time_s``: Unix epoch seconds, UTC.

    Row caches (:class:`edo_monitor.nn.CachedEmbedding` / ``CachedEmbeddingBag``, from
    ``CachedTable.stats()``), summed over the run's cached tables, ``None`` when it has none:
    ``cache_rows`` is the device cache's rows now; the others count since the previous sample
    (so they add up over samples and rollups): ``cache_lookups`` looked-up ids (repeats too),
    ``cache_lookup_hits`` those found in the cache (hit rate = hits / lookups),
    ``cache_rows_loaded`` rows loaded host→device (misses), ``cache_rows_evicted`` rows written
    back and dropped, ``cache_moved_bytes`` weight and optimizer-state bytes moved either way.
    """

    time_s: float
    step: int
    device_kind: str
    device_total_bytes: int | None = None
    device_used_bytes: int | None = None
    device_free_bytes: int | None = None
    process_device_bytes: int | None = None
    nvml_memory_info_version: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    active_bytes: int | None = None
    inactive_split_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    fragmentation: float | None = None
    largest_inactive_block_bytes: int | None = None
    segment_count: int | None = None
    params_bytes: int | None = None
    grads_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    activations_bytes: int | None = None
    host_tier_bytes: int | None = None
    budget_bytes: int | None = None
    in_use_bytes: int | None = None
    free_fraction: float | None = None
    process_rss_bytes: int | None = None
    host_available_bytes: int | None = None
    host_limit_bytes: int | None = None
    process_tree_bytes: int | None = None
    cache_rows: int | None = None
    cache_lookups: int | None = None
    cache_lookup_hits: int | None = None
    cache_rows_loaded: int | None = None
    cache_rows_evicted: int | None = None
    cache_moved_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (the ``samples`` row without ``run_id``)."""
        return {f: getattr(self, f) for f in SAMPLE_FIELDS}

    @classmethod
    def of(cls, time_s: float, step: int, device_kind: str, **fields: Any) -> Reading:
        """The same reading as ``Reading(time_s, step, device_kind, **fields)``, built without the
        frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field: about 12 µs for
        the 37 fields here, against about 1 µs), for bulk paths such as
        :func:`edo_monitor.hindsight.replay`, which builds one per recorded sample.

        Raises:
            TypeError: a name that is not a field (as the constructor does).
        """
        values = {
            **_DEFAULTS,
            **fields,
            "time_s": time_s,
            "step": step,
            "device_kind": device_kind,
        }
        if len(values) != len(SAMPLE_FIELDS):  # a name that is not a field added a key
            raise TypeError(f"Reading has no fields {sorted(fields.keys() - _DEFAULTS.keys())}")
        reading = object.__new__(cls)
        object.__setattr__(reading, "__dict__", values)
        return reading


SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Reading))
#: every field's default (the three without one are set by :meth:`Reading.of` itself)
_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(Reading) if f.default is not dataclasses.MISSING
}
