"""What a history reader hands back: one frozen dataclass per run, job, event, module, device and
sample series, and their pandas conversion."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from edo_monitor.errors import missing_extra


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise missing_extra("to_pandas()", "pandas", "pandas") from None
    return pandas


def to_pandas(items: Iterable[Any]) -> Any:
    """A ``pandas.DataFrame`` with one row per dataclass in ``items``.

    Raises:
        ImportError: pandas is not installed (it is the optional extra ``edo-monitor[pandas]``).
    """
    pd = _pandas()
    return pd.DataFrame([dataclasses.asdict(i) for i in items])


@dataclass(frozen=True)
class RunInfo:
    """One run as a reader sees it: the stored row plus summaries of its samples and events.

    ``status`` is the effective status (``crashed`` for a ``running`` run whose process is gone
    or whose heartbeat is stale); ``stored_status`` is what the agent last wrote.
    ``samples_dropped`` (the ``runs`` column's name) counts every row the writer did not write,
    of every table (samples, events, module rows, snapshots), not samples alone.
    """

    id: int
    uuid: str
    name: str
    host: str
    pid: int
    status: str
    stored_status: str
    started_at_s: float
    ended_at_s: float | None
    heartbeat_at_s: float | None
    duration_s: float
    error: str | None
    device_kind: str
    device_name: str | None
    device_uuid: str | None
    device_total_bytes: int | None
    budget_bytes: int | None
    interval_s: float
    torch_version: str
    config: dict[str, Any]
    tags: list[str]
    steps: int
    samples_dropped: int
    sample_count: int = 0
    first_sample_s: float | None = None
    last_sample_s: float | None = None
    peak_in_use_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_process_device_bytes: int | None = None
    peak_device_used_bytes: int | None = None
    peak_process_rss_bytes: int | None = None
    min_free_fraction: float | None = None
    event_count: int = 0
    action_count: int = 0
    oom_count: int = 0
    #: the multi-rank job this run is one rank of (``None``: not in a process group)
    job_id: str | None = None
    #: the rank in the job's process group, its size, and the rank on this host
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None

    @property
    def steps_per_s(self) -> float | None:
        """Optimizer steps per second of run time (``None`` for a zero-length run)."""
        return self.steps / self.duration_s if self.duration_s > 0 else None


@dataclass(frozen=True)
class JobInfo:
    """One multi-rank job: its stored row and a summary of its ranks' runs.

    ``status`` sums up the ranks' effective statuses: ``running`` while any rank runs, else
    ``crashed`` / ``failed`` / ``interrupted`` when any rank ended so (in that order), else
    ``finished``; ``None`` when no run of the job is recorded.
    """

    id: str
    name: str
    world_size: int
    backend: str | None
    #: ``"torchelastic"`` (torchrun's TORCHELASTIC_RUN_ID) or ``"process_group"`` (rank 0's
    #: UUID, broadcast to the other ranks when ``watch()`` was entered)
    id_source: str
    created_at_s: float
    #: runs recorded for the job (one per rank; more after an elastic restart)
    run_count: int = 0
    #: the recorded runs' ranks, ascending (a rank that never entered ``watch()`` is missing)
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    status: str | None = None
    started_at_s: float | None = None
    #: when the last run ended (a crashed run: its last heartbeat); ``None`` while one runs
    ended_at_s: float | None = None
    #: the fewest steps any rank recorded (ranks of a synchronous job step together)
    min_steps: int | None = None


@dataclass(frozen=True)
class EventInfo:
    """One row of ``events``. ``step`` is the training step it happened at, ``-1`` for the
    history writer's own events (``samples_dropped``, ``store_reconnected``), which no step
    owns: :attr:`step_shown` is then ``"-"``."""

    id: int
    run_id: int
    time_s: float
    step: int
    kind: str
    message: str
    data: dict[str, Any]

    @property
    def step_shown(self) -> str:
        """The step as tables show it: ``"-"`` for an event no step owns."""
        return "-" if self.step < 0 else str(self.step)


@dataclass(frozen=True)
class ModuleInfo:
    """The latest ``module_stats`` row of one module (bytes by category)."""

    id: int
    run_id: int
    time_s: float
    step: int
    module: str
    kind: str
    num_embeddings: int | None
    embedding_dim: int | None
    dtype: str | None
    device: str | None
    placement: str | None
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    #: row cache (``CachedEmbedding`` tables; ``None`` otherwise or in files before schema 4):
    #: device rows now, and since the table was cached: looked-up ids, those that hit, rows
    #: loaded and evicted, weight + optimizer-state bytes moved host↔device
    cache_rows: int | None = None
    cache_lookups: int | None = None
    cache_lookup_hits: int | None = None
    cache_rows_loaded: int | None = None
    cache_rows_evicted: int | None = None
    cache_moved_bytes: int | None = None

    @property
    def cache_hit_fraction(self) -> float | None:
        """Looked-up ids found in the device cache / all looked-up ids (``None``: no lookups)."""
        if not self.cache_lookups or self.cache_lookup_hits is None:
            return None
        return self.cache_lookup_hits / self.cache_lookups

    @property
    def total_bytes(self) -> int:
        """Sum of the four categories (bytes)."""
        return (
            self.params_bytes
            + self.grads_bytes
            + self.optimizer_state_bytes
            + self.activations_bytes
        )


@dataclass(frozen=True)
class ProcessInfo:
    """One process on a GPU at a daemon sample (a ``process_samples`` row), with the name of
    the watched run it is (``run_id``/``run_name``; ``None``: not a watched run)."""

    pid: int
    process_name: str | None
    kind: str
    process_device_bytes: int | None
    run_id: int | None
    run_name: str | None


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU at a daemon sample (a ``device_samples`` row) and its processes, largest first.

    Bytes from ``nvmlDeviceGetMemoryInfo``, fractions in [0, 1] from
    ``nvmlDeviceGetUtilizationRates``; ``None``: not available from NVML.
    """

    time_s: float
    host: str
    device_index: int
    device_uuid: str
    device_name: str | None
    device_total_bytes: int | None
    device_used_bytes: int | None
    device_free_bytes: int | None
    utilization_gpu_fraction: float | None
    utilization_memory_fraction: float | None
    process_count: int | None
    processes: tuple[ProcessInfo, ...] = ()

    @property
    def used_fraction(self) -> float | None:
        """``device_used_bytes / device_total_bytes`` (``None`` when either is unknown)."""
        if not self.device_total_bytes or self.device_used_bytes is None:
            return None
        return self.device_used_bytes / self.device_total_bytes


@dataclass(frozen=True)
class DeviceEventInfo:
    """One row of ``device_events`` (kinds: :data:`edo_monitor.store.schema.DEVICE_EVENT_KINDS`)."""

    id: int
    time_s: float
    host: str
    device_index: int | None
    device_uuid: str | None
    kind: str
    message: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Peak:
    """The largest value of one sample column in a run, and when it happened."""

    run_id: int
    column: str
    value: float | None
    time_s: float | None
    step: int | None


@dataclass(frozen=True)
class SampleRow:
    """One raw sample (incremental reads): its id, time, step and the requested columns."""

    id: int
    time_s: float
    step: int
    values: Mapping[str, Any]

    def __getitem__(self, column: str) -> Any:
        return self.values[column]


@dataclass(frozen=True)
class SampleSeries:
    """Samples of one run, column-wise, possibly downsampled into time buckets.

    Position ``i`` of every list is one bucket (or one sample when ``downsampled`` is False, in
    which case min = max = mean = the value and ``count`` is 1). ``time_s`` is the first sample
    time in the bucket, ``time_end_s`` the last. ``bucket_s`` is the bucket width (seconds; None
    when not downsampled).

    ``last_id`` is the run's largest sample id when the series was read (same snapshot; 0 for a
    run without samples): every sample of the run in the window with ``id <= last_id`` is in the
    series, and ``History.samples_since(run, last_id)`` returns exactly the ones written after
    it. Not the table's largest id: on PostgreSQL another run's higher ids can commit while this
    run's batch is open, and SQLite gives the ids of pruned samples to new ones; the run's own
    ids grow in commit order on both.
    """

    run_id: int
    columns: tuple[str, ...]
    downsampled: bool
    bucket_s: float | None
    time_s: list[float] = field(default_factory=list)
    time_end_s: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    min: dict[str, list[Any]] = field(default_factory=dict)
    max: dict[str, list[Any]] = field(default_factory=dict)
    mean: dict[str, list[float | None]] = field(default_factory=dict)
    last_id: int = 0

    def __len__(self) -> int:
        return len(self.time_s)

    def rows(self) -> Iterator[dict[str, Any]]:
        """One flat dict per bucket: ``time_s``, ``time_end_s``, ``count``, and
        ``<column>`` (the mean; the value itself when not downsampled), ``<column>_min``,
        ``<column>_max``."""
        for i in range(len(self.time_s)):
            row: dict[str, Any] = {
                "time_s": self.time_s[i],
                "time_end_s": self.time_end_s[i],
                "count": self.count[i],
            }
            for c in self.columns:
                row[c] = self.min[c][i] if not self.downsampled else self.mean[c][i]
                row[f"{c}_min"] = self.min[c][i]
                row[f"{c}_max"] = self.max[c][i]
            yield row

    def to_pandas(self) -> Any:
        """The rows as a ``pandas.DataFrame``.

        Raises:
            ImportError: pandas is not installed.
        """
        return _pandas().DataFrame(list(self.rows()))


@dataclass(frozen=True)
class MetricComparison:
    """One line of a comparison: a metric of run A and run B (``delta`` = B − A)."""

    name: str
    unit: str
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        """``b - a``, or None when either is missing."""
        return None if self.a is None or self.b is None else self.b - self.a


@dataclass(frozen=True)
class RunComparison:
    """Two runs side by side: summary metrics and each run's actions."""

    a: RunInfo
    b: RunInfo
    metrics: list[MetricComparison]
    actions_a: list[EventInfo]
    actions_b: list[EventInfo]


@dataclass(frozen=True)
class CacheSummary:
    """A run's row caches over its samples (sums of the samples' ``cache_*`` increments).

    Attributes:
        run_id: the run.
        lookups, lookup_hits: looked-up ids of cached tables, and those found on the device.
        rows_loaded, rows_evicted: rows moved host→device (misses) and written back.
        moved_bytes: weight and optimizer-state bytes moved either way.
        first_step, last_step: steps of the first and last sample with a cache.
        rows_now: the cache rows of the last sample with a cache.
    """

    run_id: int
    lookups: int
    lookup_hits: int
    rows_loaded: int
    rows_evicted: int
    moved_bytes: int
    first_step: int
    last_step: int
    rows_now: int

    @property
    def hit_fraction(self) -> float | None:
        """``lookup_hits / lookups`` (``None`` without lookups)."""
        return self.lookup_hits / self.lookups if self.lookups else None

    @property
    def moved_bytes_per_step(self) -> float | None:
        """``moved_bytes`` per step between the first and the last sample with a cache."""
        steps = self.last_step - self.first_step
        return self.moved_bytes / steps if steps > 0 else None
