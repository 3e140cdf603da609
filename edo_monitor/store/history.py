"""Reading past (and live) runs: the ``History`` API behind the CLI and the TUI.

Everything returned is a plain frozen dataclass or a list of them; times are Unix seconds (UTC),
byte counts ints, fractions floats in [0, 1]. ``None`` means "not recorded".

Downsampling happens in SQL. ``samples(run, max_points=N)`` splits the time range into at most
``N`` buckets and returns, per bucket and column, min / max / mean and the sample count, so a peak
is never averaged away. On SQLite databases with schema version ≥ 2 the buckets are assembled from
``sample_rollups`` (pre-aggregated, epoch-aligned time blocks of 16, 256 and 4096 s): the bucket
width is a whole number of blocks of the coarsest level that fits, so whole blocks add up to
exactly the answer a ``GROUP BY`` over every sample would give, while reading a few thousand rows
instead of millions. Samples newer than the rollups (``id > meta.rollup_through_id``) and the
partial blocks at the edges of a ``start``/``end`` window are read raw and merged. Buckets
narrower than the smallest level (a window shorter than ``16 s × max_points``) are computed from
the samples themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, func, inspect, select, text
from sqlalchemy.engine import URL

from edo_monitor.errors import ConfigError, JobNotFoundError, RunNotFoundError, missing_extra
from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.engine import (
    is_postgres,
    open_engine,
    run_mark,
    run_mark_key,
    schema_version,
    sql_dialect,
)
from edo_monitor.store.schema import (
    ROLLUP_FIELDS,
    ROLLUP_LEVEL_WIDTHS_S,
    SCHEMA_VERSION,
    device_events_table,
    device_samples_table,
    events_table,
    jobs_table,
    process_samples_table,
    runs_table,
)
from edo_monitor.store.status import effective_status

__all__ = [
    "NUMERIC_SAMPLE_COLUMNS",
    "UUID_REF_LEN",
    "CacheSummary",
    "DeviceEventInfo",
    "DeviceInfo",
    "EventInfo",
    "History",
    "JobInfo",
    "MetricComparison",
    "ModuleInfo",
    "Peak",
    "ProcessInfo",
    "RunComparison",
    "RunInfo",
    "SampleRow",
    "SampleSeries",
    "prune",
    "to_pandas",
]

logger = logging.getLogger(__name__)

#: Sample columns that ``samples(columns=…)`` accepts (every numeric column but ``time_s``).
NUMERIC_SAMPLE_COLUMNS: tuple[str, ...] = tuple(
    f for f in SAMPLE_FIELDS if f not in ("time_s", "device_kind")
)
_ROLLUP_SET = frozenset(ROLLUP_FIELDS)
#: Above this many samples newer than the rollups, read the whole window raw instead.
_MAX_TAIL_ROWS = 200_000
_PEAK_COLUMNS = (
    "in_use_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "process_device_bytes",
    "device_used_bytes",
    "process_rss_bytes",
)
_RUN_COLUMNS = [c.name for c in runs_table.columns]
RunRef = int | str
#: The ``runs`` columns of schema 6 (a multi-rank job); a reader of an older file reads them NULL.
_RANK_COLUMNS = ("job_id", "rank", "world_size", "local_rank")
#: Shortest uuid prefix the CLI prints as a run reference (8 hex digits, the dash, 4 more).
UUID_REF_LEN = 13


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


# -- result types ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunInfo:
    """One run as a reader sees it: the stored row plus summaries of its samples and events.

    ``status`` is the effective status (``crashed`` for a ``running`` run whose process is gone
    or whose heartbeat is stale); ``stored_status`` is what the agent last wrote.
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
    """One row of ``events``."""

    id: int
    run_id: int
    time_s: float
    step: int
    kind: str
    message: str
    data: dict[str, Any]


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

    ``last_id`` is the largest sample id in the database when the series was read (same
    snapshot): every sample of the run in the window with ``id <= last_id`` is in the series, and
    ``History.samples_since(run, last_id)`` returns exactly the ones written after it.
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


# -- helpers -----------------------------------------------------------------------------------


#: The statuses a run (or a job, summed up over its runs) can have.
STATUSES = ("running", "finished", "failed", "interrupted", "crashed")


def _statuses(status: str | Iterable[str] | None, what: str) -> set[str]:
    """The statuses asked for, as a set (empty: any).

    Raises:
        ConfigError: a status not in :data:`STATUSES`.
    """
    wanted = {status} if isinstance(status, str) else set(status or ())
    if wanted - set(STATUSES):
        raise ConfigError(
            f"status={status!r} is not a {what} status; expected one of {sorted(STATUSES)}"
        )
    return wanted


def _to_epoch(value: float | datetime | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} is not a time; expected Unix seconds or a datetime")
    return float(value)


def _merge(acc: dict[int, list[Any]], b: int, part: Sequence[Any], ncols: int) -> None:
    """Merge one partial aggregate ``(n, tmin, tmax, [min, max, sum, cnt] * ncols)``."""
    cur = acc.get(b)
    if cur is None:
        acc[b] = list(part)
        return
    cur[0] += part[0]
    cur[1] = min(cur[1], part[1])
    cur[2] = max(cur[2], part[2])
    for j in range(ncols):
        k = 3 + 4 * j
        lo, hi = part[k], part[k + 1]
        if lo is not None:
            cur[k] = lo if cur[k] is None else min(cur[k], lo)
        if hi is not None:
            cur[k + 1] = hi if cur[k + 1] is None else max(cur[k + 1], hi)
        cur[k + 2] = (cur[k + 2] or 0.0) + (part[k + 2] or 0.0)
        cur[k + 3] += part[k + 3]


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


class History:
    """Read access to the history database.

    Args:
        db: path, SQLAlchemy URL or ``None`` (``EDO_DB``, else ``./edo-history.db``); or an
            existing :class:`sqlalchemy.Engine`.
        readonly: open read-only (the default; a missing file is an error). ``False`` opens as a
            writer, which creates or upgrades the database (used by ``prune``).

    Raises:
        ConfigError: bad ``db``.
        StoreError: missing file (read-only), not an edo-monitor database, newer schema.
    """

    def __init__(
        self, db: str | os.PathLike[str] | URL | Engine | None = None, *, readonly: bool = True
    ) -> None:
        if isinstance(db, Engine):
            self.engine = db
            self._owns_engine = False
        else:
            self.engine = open_engine(db, readonly=readonly)
            self._owns_engine = True
        self.readonly = readonly
        with self._read() as conn:
            self.schema_version: int | None = schema_version(conn)
            inspector = inspect(conn)
            tables = set(inspector.get_table_names())
            present = (
                {c["name"] for c in inspector.get_columns("samples")}
                if "samples" in tables
                else set(SAMPLE_FIELDS)
            )
            run_present = (
                {c["name"] for c in inspector.get_columns("runs")}
                if "runs" in tables
                else {c.name for c in runs_table.columns}
            )
        #: the ``runs`` columns this file has (a file of an older schema lacks the rank ones)
        self._run_cols = [c for c in runs_table.columns if c.name in run_present]
        self._has_jobs = "jobs" in tables
        #: the sample columns a default read returns: those of ROLLUP_FIELDS this file has (a
        #: file of an older schema lacks the newer ones)
        self._default_columns = tuple(f for f in ROLLUP_FIELDS if f in present)
        self._empty = "runs" not in tables
        self._has_rollups = "sample_rollups" in tables
        self._has_devices = "device_samples" in tables  # schema 7: the daemon's tables
        self._pg = is_postgres(self.engine)
        self._sql = sql_dialect(self.engine)

    # -- lifecycle ---------------------------------------------------------------------------
    @contextmanager
    def _read(self) -> Iterator[Connection]:
        """A connection reading one consistent snapshot (one transaction on SQLite)."""
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "sqlite":
                conn.exec_driver_sql("SELECT 1")  # autobegin (writer engines: BEGIN IMMEDIATE)
                if not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
                    conn.exec_driver_sql("BEGIN")
            elif self.engine.dialect.name == "postgresql":
                # one snapshot for every statement (rollups, mark and raw tail agree)
                conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            yield conn

    def close(self) -> None:
        """Release the database connections (when this object opened them)."""
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def outdated(self) -> str | None:
        """A sentence saying the database's schema is older than this edo-monitor's, else None."""
        if self.schema_version is not None and self.schema_version < SCHEMA_VERSION:
            return (
                f"history database has schema version {self.schema_version}, older than "
                f"{SCHEMA_VERSION}; it is read as it is and upgraded when next written to"
            )
        return None

    # -- runs --------------------------------------------------------------------------------
    def runs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        since: float | datetime | None = None,
        name: str | None = None,
        tag: str | None = None,
        limit: int | None = None,
    ) -> list[RunInfo]:
        """Runs, newest first.

        Args:
            status: keep runs with this effective status (or any of these): ``running``,
                ``finished``, ``failed``, ``interrupted``, ``crashed``.
            since: keep runs started at or after this time (Unix seconds or datetime).
            name: keep runs whose name matches (``*`` and ``?`` wildcards; else a substring).
            tag: keep runs carrying this tag.
            limit: at most this many runs (after filtering).

        Raises:
            ConfigError: an unknown status or a bad ``since``.
        """
        wanted = _statuses(status, "run")
        since_s = _to_epoch(since, "since")
        if self._empty:
            return []
        stmt = select(*self._run_cols).order_by(
            runs_table.c.started_at_s.desc(), runs_table.c.id.desc()
        )
        if since_s is not None:
            stmt = stmt.where(runs_table.c.started_at_s >= since_s)
        if name:
            wild = any(ch in name for ch in "*?")
            pattern = name.replace("*", "%").replace("?", "_") if wild else f"%{name}%"
            stmt = stmt.where(runs_table.c.name.like(pattern))
        with self._read() as conn:
            rows = [dict(r._mapping) for r in conn.execute(stmt)]
        if tag is not None:
            rows = [r for r in rows if tag in (r["tags"] or [])]
        infos = [self._base_info(r) for r in rows]
        if wanted:
            infos = [i for i in infos if i.status in wanted]
        if limit is not None:
            infos = infos[:limit]
        return self._with_stats(infos)

    def run(self, ref: RunRef, *, stats: bool = True) -> RunInfo:
        """One run by id (int or digits), uuid prefix, or ``"latest"`` (most recently started).

        Args:
            ref: the run reference.
            stats: also summarise its samples and events (count, first/last sample time, peaks,
                minimum free fraction, event/action/OOM counts). ``False`` returns the stored row
                only (status, steps, heartbeat, …; one indexed lookup), with those fields left at
                their defaults (0 / ``None``): what a live viewer polling the status needs.

        Raises:
            RunNotFoundError: no run matches, or a uuid prefix matches several.
        """
        info = self._base_info(self._find(ref))
        return self._with_stats([info])[0] if stats else info

    def uuid_references(self) -> dict[int, str]:
        """For every run id, a uuid prefix that opens exactly that run with :meth:`run`.

        A prefix is at least :data:`UUID_REF_LEN` characters (13: ``"90455722-7c1e"``, the dash
        included, so it is never all digits and never read as a run id) and longer where another
        run's uuid starts the same way. A uuid that is all digits cannot be told from a run id at
        any length, and one that is not hexadecimal or is a prefix of another is no prefix
        reference either: their reference is the run id.
        """
        if self._empty:
            return {}
        with self._read() as conn:
            rows = sorted(
                (
                    (str(u).lower(), i)
                    for i, u in conn.execute(select(runs_table.c.id, runs_table.c.uuid))
                ),
            )
        refs: dict[int, str] = {}
        for k, (u, run_id) in enumerate(rows):
            need = UUID_REF_LEN
            for j in (k - 1, k + 1):  # sorted: the longest shared prefix is with a neighbour
                if 0 <= j < len(rows):
                    other = rows[j][0]
                    common = next(
                        (n for n, (a, b) in enumerate(zip(u, other, strict=False)) if a != b),
                        min(len(u), len(other)),
                    )
                    need = max(need, common + 1)
            ref = u[:need]
            hexa = re.fullmatch(r"[0-9a-f-]{1,36}", ref) is not None
            usable = hexa and not ref.isdigit() and len(ref) == need
            refs[run_id] = ref if usable else str(run_id)
        return refs

    def _find(self, ref: RunRef) -> dict[str, Any]:
        if self._empty:
            raise RunNotFoundError(f"no run {ref!r}: the history database has no runs")
        cols = self._run_cols
        with self._read() as conn:
            if isinstance(ref, bool):
                raise RunNotFoundError(f"{ref!r} is not a run reference")
            if isinstance(ref, int) or (isinstance(ref, str) and ref.strip().isdigit()):
                if not 0 <= int(ref) < 2**63:  # no row has it (ids are int64 in SQL)
                    raise RunNotFoundError(f"no run with id {int(ref)}")
                row = conn.execute(select(*cols).where(runs_table.c.id == int(ref))).first()
                if row is not None:
                    return dict(row._mapping)
                # all digits is an id, never a uuid prefix: "show 0" must not open the run whose
                # uuid starts with 0
                raise RunNotFoundError(f"no run with id {int(ref)}")
            ref_s = str(ref).strip()
            if ref_s.lower() == "latest":
                row = conn.execute(
                    select(*cols)
                    .order_by(runs_table.c.started_at_s.desc(), runs_table.c.id.desc())
                    .limit(1)
                ).first()
                if row is None:
                    raise RunNotFoundError("no run 'latest': the history database has no runs")
                return dict(row._mapping)
            if not re.fullmatch(r"[0-9a-fA-F-]{1,36}", ref_s):
                raise RunNotFoundError(
                    f"no run {ref_s!r}: expected a run id, a uuid prefix or 'latest'"
                )
            found = conn.execute(
                select(*cols).where(runs_table.c.uuid.like(ref_s.lower() + "%")).limit(6)
            ).all()
        if not found:
            raise RunNotFoundError(f"no run with id or uuid prefix {ref_s!r}")
        if len(found) > 1:
            shown = ", ".join(f"{r.id} ({r.uuid[:12]})" for r in found[:5])
            raise RunNotFoundError(
                f"uuid prefix {ref_s!r} matches several runs: {shown}; give more characters"
            )
        return dict(found[0]._mapping)

    def _base_info(self, r: Mapping[str, Any]) -> RunInfo:
        status = effective_status(
            r["status"],
            host=r["host"],
            pid=r["pid"],
            heartbeat_at_s=r["heartbeat_at_s"],
            interval_s=r["interval_s"],
        )
        end = r["ended_at_s"]
        if end is None:
            end = r["heartbeat_at_s"] if status != "running" else time.time()
        duration = max(0.0, (end or r["started_at_s"]) - r["started_at_s"])
        return RunInfo(
            id=r["id"],
            uuid=r["uuid"],
            name=r["name"],
            host=r["host"],
            pid=r["pid"],
            status=status,
            stored_status=r["status"],
            started_at_s=r["started_at_s"],
            ended_at_s=r["ended_at_s"],
            heartbeat_at_s=r["heartbeat_at_s"],
            duration_s=duration,
            error=r["error"],
            device_kind=r["device_kind"],
            device_name=r["device_name"],
            device_uuid=r["device_uuid"],
            device_total_bytes=r["device_total_bytes"],
            budget_bytes=r["budget_bytes"],
            interval_s=r["interval_s"],
            torch_version=r["torch_version"],
            config=dict(r["config"] or {}),
            tags=list(r["tags"] or []),
            steps=r["steps"],
            samples_dropped=r["samples_dropped"],
            **{c: r.get(c) for c in _RANK_COLUMNS},
        )

    def _with_stats(self, infos: list[RunInfo]) -> list[RunInfo]:
        if not infos:
            return infos
        ids = [i.id for i in infos]
        stats = self._sample_stats(ids)
        placeholders = ", ".join(str(int(i)) for i in ids)
        with self._read() as conn:
            ev = conn.execute(
                text(
                    "SELECT run_id, count(*), sum(CASE WHEN kind = 'action' THEN 1 ELSE 0 END), "
                    "sum(CASE WHEN kind = 'oom' THEN 1 ELSE 0 END) "
                    f"FROM events WHERE run_id IN ({placeholders}) GROUP BY run_id"
                )
            ).all()
        events = {r[0]: (int(r[1]), int(r[2] or 0), int(r[3] or 0)) for r in ev}
        out = []
        for info in infos:
            s = stats.get(info.id, {})
            n_ev, n_act, n_oom = events.get(info.id, (0, 0, 0))
            out.append(
                dataclasses.replace(
                    info,
                    sample_count=int(s.get("n") or 0),
                    first_sample_s=s.get("tmin"),
                    last_sample_s=s.get("tmax"),
                    **{f"peak_{c}": _int_or_none(s.get(f"{c}_max")) for c in _PEAK_COLUMNS},
                    min_free_fraction=s.get("free_fraction_min"),
                    event_count=n_ev,
                    action_count=n_act,
                    oom_count=n_oom,
                )
            )
        return out

    def _sample_stats(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        cols = [*_PEAK_COLUMNS, "free_fraction"]
        placeholders = ", ".join(str(int(i)) for i in ids)
        d = self._sql
        agg = ", ".join(f"min({c}), max({c}), {d.total(c)}, count({c})" for c in cols)
        parts: dict[int, dict[int, list[Any]]] = {}
        with self._read() as conn:
            marks = self._pg_marks(conn, ids) if self._has_rollups and self._pg else None
            mark = self._mark(conn) if self._has_rollups and not self._pg else None
            if marks is not None:  # PostgreSQL: each run has its own mark
                top = len(ROLLUP_LEVEL_WIDTHS_S) - 1
                r_agg = ", ".join(
                    f"min({c}_min), max({c}_max), {d.total(f'{c}_sum')}, sum({c}_n)" for c in cols
                )
                in_rollups = ", ".join(str(int(i)) for i in marks) or "NULL"
                results = list(
                    conn.execute(
                        text(
                            f"SELECT run_id, sum(n), min(time_min_s), max(time_max_s), {r_agg} "
                            f"FROM sample_rollups WHERE level = {top} AND run_id IN "
                            f"({in_rollups}) GROUP BY run_id"
                        )
                    ).all()
                )
                for run_id in ids:
                    results += conn.execute(
                        text(
                            f"SELECT run_id, count(*), min(time_s), max(time_s), {agg} FROM "
                            f"{d.samples_above('m')}run_id = :r GROUP BY run_id"
                        ),
                        {"r": run_id, "m": marks.get(run_id, 0)},
                    ).all()
            elif mark is not None:
                top = len(ROLLUP_LEVEL_WIDTHS_S) - 1
                r_agg = ", ".join(
                    f"min({c}_min), max({c}_max), total({c}_sum), sum({c}_n)" for c in cols
                )
                q1 = (
                    f"SELECT run_id, sum(n), min(time_min_s), max(time_max_s), {r_agg} "
                    f"FROM sample_rollups WHERE level = {top} AND run_id IN ({placeholders}) "
                    "GROUP BY run_id"
                )
                q2 = _tail_stats_sql(agg, placeholders)
                results = [
                    *conn.execute(text(q1)).all(),
                    *conn.execute(text(q2), {"mark": mark}).all(),
                ]
            else:
                q = (
                    f"SELECT run_id, count(*), min(time_s), max(time_s), {agg} FROM samples "
                    f"WHERE run_id IN ({placeholders}) GROUP BY run_id"
                )
                results = list(conn.execute(text(q)).all())
        for row in results:
            _merge(parts.setdefault(row[0], {}), 0, [*row[1:]], len(cols))
        out: dict[int, dict[str, Any]] = {}
        for run_id, acc in parts.items():
            v = acc[0]
            d: dict[str, Any] = {"n": v[0], "tmin": v[1], "tmax": v[2]}
            for j, c in enumerate(cols):
                d[f"{c}_min"] = v[3 + 4 * j]
                d[f"{c}_max"] = v[4 + 4 * j]
            out[run_id] = d
        return out

    def _pg_marks(self, conn: Any, ids: Sequence[int]) -> dict[int, int]:
        """PostgreSQL: the rollup marks of those of ``ids`` whose rollups are usable (not more
        than ``_MAX_TAIL_ROWS`` samples behind)."""
        out = {}
        for run_id in ids:
            m = self._mark(conn, run_id)
            if m is not None:
                out[run_id] = m
        return out

    def _mark(self, conn: Any, run_id: int | None = None) -> int | None:
        """Samples with ``id`` up to the returned mark are in the rollups (on PostgreSQL: of run
        ``run_id``); ``None``: the rollups are too far behind, read the samples raw."""
        if self._pg:
            assert run_id is not None
            mark = run_mark(conn, run_id)
            behind = conn.execute(
                text(
                    f"SELECT count(*) FROM (SELECT 1 FROM {self._sql.samples_above('m')}"
                    f"run_id = :r LIMIT {_MAX_TAIL_ROWS + 1}) AS tail"
                ),
                {"r": run_id, "m": mark},
            ).scalar()
            return None if int(behind or 0) > _MAX_TAIL_ROWS else mark
        row = conn.execute(text("SELECT value FROM meta WHERE key = 'rollup_through_id'")).first()
        mark = int(row[0]) if row else 0
        top = conn.execute(text("SELECT max(id) FROM samples")).scalar() or 0
        if top - mark > _MAX_TAIL_ROWS:
            return None  # rollups far behind (e.g. rows written by another tool): read raw
        return mark

    # -- jobs --------------------------------------------------------------------------------
    def jobs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        since: float | datetime | None = None,
        limit: int | None = None,
    ) -> list[JobInfo]:
        """Multi-rank jobs (``torch.distributed``), newest first (by ``created_at_s``).

        Args:
            status: keep jobs with this summed-up status (or any of these): ``running``,
                ``finished``, ``failed``, ``interrupted``, ``crashed`` (see :class:`JobInfo`).
            since: keep jobs created at or after this time (Unix seconds or datetime).
            limit: at most this many jobs (after filtering).

        Returns:
            One :class:`JobInfo` per job (``[]`` for a database of schema < 6).

        Raises:
            ConfigError: an unknown status or a bad ``since``.
        """
        wanted = _statuses(status, "job")
        since_s = _to_epoch(since, "since")
        if self._empty or not self._has_jobs:
            return []
        stmt = select(*jobs_table.columns).order_by(
            jobs_table.c.created_at_s.desc(), jobs_table.c.id.desc()
        )
        if since_s is not None:
            stmt = stmt.where(jobs_table.c.created_at_s >= since_s)
        with self._read() as conn:
            rows = [dict(r._mapping) for r in conn.execute(stmt)]
        infos = self._job_infos(rows)
        if wanted:
            infos = [i for i in infos if i.status in wanted]
        return infos if limit is None else infos[:limit]

    def job(self, ref: str) -> JobInfo:
        """One job by its id, a prefix of it that matches one job, or ``"latest"`` (most
        recently created).

        Raises:
            JobNotFoundError: no job matches, or a prefix matches several.
        """
        return self._job_infos([self._find_job(ref)])[0]

    def job_runs(self, ref: str, *, stats: bool = True) -> list[RunInfo]:
        """The runs of job ``ref`` (as :meth:`job` takes it), one per rank, by rank (then by
        start, for an elastic restart's second run of a rank).

        Args:
            ref: the job reference.
            stats: summarise each run's samples and events as :meth:`run` does (peaks, minimum
                free fraction, action and OOM counts); ``False``: the stored rows only.

        Raises:
            JobNotFoundError: no job matches, or a prefix matches several.
        """
        job_id = self._find_job(ref)["id"]
        stmt = (
            select(*self._run_cols)
            .where(runs_table.c.job_id == job_id)
            .order_by(runs_table.c.rank, runs_table.c.started_at_s, runs_table.c.id)
        )
        with self._read() as conn:
            rows = [dict(r._mapping) for r in conn.execute(stmt)]
        infos = [self._base_info(r) for r in rows]
        return self._with_stats(infos) if stats else infos

    def _find_job(self, ref: str) -> dict[str, Any]:
        if self._empty or not self._has_jobs:
            raise JobNotFoundError(f"no job {ref!r}: the history database has no jobs")
        if not isinstance(ref, str) or not ref.strip():
            raise JobNotFoundError(f"{ref!r} is not a job reference; expected a job id or prefix")
        ref_s = ref.strip()
        cols = jobs_table.columns
        with self._read() as conn:
            row = conn.execute(select(*cols).where(jobs_table.c.id == ref_s)).first()
            if row is not None:
                return dict(row._mapping)
            if ref_s.lower() == "latest":
                row = conn.execute(
                    select(*cols)
                    .order_by(jobs_table.c.created_at_s.desc(), jobs_table.c.id.desc())
                    .limit(1)
                ).first()
                if row is None:
                    raise JobNotFoundError("no job 'latest': the history database has no jobs")
                return dict(row._mapping)
            escaped = ref_s.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            found = conn.execute(
                select(*cols).where(jobs_table.c.id.like(escaped + "%", escape="\\")).limit(6)
            ).all()
        if not found:
            raise JobNotFoundError(f"no job with id or id prefix {ref_s!r}")
        if len(found) > 1:
            shown = ", ".join(str(r.id) for r in found[:5])
            raise JobNotFoundError(
                f"job id prefix {ref_s!r} matches several jobs: {shown}; give more characters"
            )
        return dict(found[0]._mapping)

    def _job_infos(self, rows: list[dict[str, Any]]) -> list[JobInfo]:
        """Each job row with the summary of its runs (one read of their rows)."""
        if not rows:
            return []
        ids = [r["id"] for r in rows]
        with self._read() as conn:
            runs = [
                dict(r._mapping)
                for r in conn.execute(select(*self._run_cols).where(runs_table.c.job_id.in_(ids)))
            ]
        by_job: dict[str, list[RunInfo]] = {}
        for r in runs:
            by_job.setdefault(r["job_id"], []).append(self._base_info(r))
        out = []
        for row in rows:
            members = by_job.get(row["id"], [])
            statuses = {m.status for m in members}
            status = None
            if members:
                status = next(
                    (s for s in ("running", "crashed", "failed", "interrupted") if s in statuses),
                    "finished",
                )
            # where each run ended: its recorded end, else (crashed: nothing wrote one) its
            # last heartbeat, as the run's own duration counts it; a crashed rank's job used to
            # have no end, and its duration grew with the clock
            ends = [
                None
                if m.status == "running"
                else m.ended_at_s
                if m.ended_at_s is not None
                else m.started_at_s + m.duration_s
                for m in members
            ]
            out.append(
                JobInfo(
                    id=row["id"],
                    name=row["name"],
                    world_size=int(row["world_size"]),
                    backend=row["backend"],
                    id_source=row["id_source"],
                    created_at_s=row["created_at_s"],
                    run_count=len(members),
                    ranks=tuple(sorted(m.rank for m in members if m.rank is not None)),
                    hosts=tuple(sorted({m.host for m in members})),
                    status=status,
                    started_at_s=min((m.started_at_s for m in members), default=None),
                    ended_at_s=(
                        None
                        if not members or status == "running" or None in ends
                        else max(e for e in ends if e is not None)
                    ),
                    min_steps=min((m.steps for m in members), default=None),
                )
            )
        return out

    # -- samples -----------------------------------------------------------------------------
    def samples(
        self,
        run: RunRef,
        *,
        start: float | datetime | None = None,
        end: float | datetime | None = None,
        columns: Sequence[str] | None = None,
        max_points: int | None = 1000,
    ) -> SampleSeries:
        """A run's samples in ``[start, end]``, downsampled in SQL to at most ``max_points``.

        Args:
            run: run reference (see :meth:`run`).
            start, end: window (Unix seconds or datetime; both inclusive); default the whole run.
            columns: sample columns (default: every numeric quantity, ``ROLLUP_FIELDS``, that the
                file has; any of :data:`NUMERIC_SAMPLE_COLUMNS` may be asked for).
            max_points: most buckets to return; ``None`` returns every sample.

        Raises:
            RunNotFoundError: no such run. ConfigError: unknown column, ``max_points < 1``.
        """
        cols = self._columns(columns)
        if max_points is not None and max_points < 1:
            raise ConfigError(f"max_points={max_points!r} must be ≥ 1 (or None for every sample)")
        run_id = self._find(run)["id"]
        lo = _to_epoch(start, "start")
        hi = _to_epoch(end, "end")
        with self._read() as conn:
            last_id = int(conn.execute(text("SELECT max(id) FROM samples")).scalar() or 0)
            series = self._samples_in(conn, run_id, cols, lo, hi, max_points)
        return dataclasses.replace(series, last_id=last_id)

    def _samples_in(
        self,
        conn: Any,
        run_id: int,
        cols: tuple[str, ...],
        lo: float | None,
        hi: float | None,
        max_points: int | None,
    ) -> SampleSeries:
        first = conn.execute(
            text("SELECT min(time_s) FROM samples WHERE run_id = :r"), {"r": run_id}
        ).scalar()
        last = conn.execute(
            text("SELECT max(time_s) FROM samples WHERE run_id = :r"), {"r": run_id}
        ).scalar()
        if first is None:
            return _raw_series(run_id, cols, [])
        lo = first if lo is None else max(lo, first)
        hi = last if hi is None else min(hi, last)
        if hi < lo:
            return _raw_series(run_id, cols, [])
        raw_sql = (
            f"SELECT id, time_s, {', '.join(cols)} FROM samples WHERE run_id = :r "
            "AND time_s >= :lo AND time_s <= :hi ORDER BY time_s, id"
        )
        params = {"r": run_id, "lo": lo, "hi": hi}
        if max_points is None:
            return _raw_series(run_id, cols, conn.execute(text(raw_sql), params).all())
        if self._pg:
            # count first: PostgreSQL's (run_id, time_s) index has no id in it, so the ordered
            # LIMIT below would sort every sample of a long run before giving the first rows
            n = conn.execute(
                text(
                    "SELECT count(*) FROM (SELECT 1 FROM samples WHERE run_id = :r AND "
                    f"time_s >= :lo AND time_s <= :hi LIMIT {max_points + 1}) AS few"
                ),
                params,
            ).scalar()
            few = conn.execute(text(raw_sql), params).all() if n <= max_points else []
        else:
            few = conn.execute(text(raw_sql + f" LIMIT {max_points + 1}"), params).all()
            n = len(few)
        if n <= max_points:
            return _raw_series(run_id, cols, few)
        # the coarsest rollup level whose blocks fit in a bucket; none: buckets narrower than
        # the smallest level, computed from the samples themselves
        want = (hi - lo) / max_points
        level = max((i for i, w in enumerate(ROLLUP_LEVEL_WIDTHS_S) if w <= want), default=None)
        mark = self._mark(conn, run_id) if self._has_rollups and level is not None else None
        if level is None or mark is None or any(c not in _ROLLUP_SET for c in cols):
            return self._bucketed_raw(conn, run_id, cols, lo, hi, max_points)
        return self._bucketed_rollups(conn, run_id, cols, lo, hi, max_points, level, mark)

    def _columns(self, columns: Sequence[str] | None) -> tuple[str, ...]:
        if columns is None:
            return self._default_columns
        if isinstance(columns, str):
            columns = [columns]
        bad = [c for c in columns if c not in NUMERIC_SAMPLE_COLUMNS]
        if bad:
            raise ConfigError(
                f"columns={bad!r}: not sample columns; expected any of "
                f"{', '.join(NUMERIC_SAMPLE_COLUMNS)}"
            )
        return tuple(dict.fromkeys(columns))

    def _bucketed_raw(
        self, conn: Any, run_id: int, cols: Sequence[str], lo: float, hi: float, max_points: int
    ) -> SampleSeries:
        width = (hi - lo) / max_points
        # buckets counted from `lo`; the last sample (time == hi) joins the last bucket
        d = self._sql
        bucket = d.least(d.trunc("(time_s - :lo) / :w"), str(max_points - 1))
        agg = ", ".join(f"min({c}), max({c}), {d.total(c)}, count({c})" for c in cols)
        q = (
            f"SELECT {bucket} AS b, count(*), min(time_s), max(time_s), {agg} FROM samples "
            "WHERE run_id = :r AND time_s >= :lo AND time_s <= :hi GROUP BY b ORDER BY b"
        )
        rows = conn.execute(text(q), {"r": run_id, "lo": lo, "hi": hi, "w": width}).all()
        acc = {r[0]: list(r[1:]) for r in rows}
        return _bucket_series(run_id, cols, acc, width)

    def _bucketed_rollups(
        self,
        conn: Any,
        run_id: int,
        cols: Sequence[str],
        lo: float,
        hi: float,
        max_points: int,
        level: int,
        mark: int,
    ) -> SampleSeries:
        width = ROLLUP_LEVEL_WIDTHS_S[level]
        b_lo, b_hi = int(lo // width), int(hi // width)
        # whole buckets of m blocks each, at most max_points of them
        m = max(1, math.ceil((hi - lo) / max_points / width))
        while b_hi // m - b_lo // m + 1 > max_points:
            m += 1
        ncols = len(cols)
        acc: dict[int, list[Any]] = {}
        d = self._sql
        r_agg = ", ".join(
            f"min({c}_min), max({c}_max), {d.total(f'{c}_sum')}, sum({c}_n)" for c in cols
        )
        q_roll = (
            f"SELECT block / :m AS b, sum(n), min(time_min_s), max(time_max_s), {r_agg} "
            "FROM sample_rollups WHERE run_id = :r AND level = :lvl "
            "AND block >= :b_lo AND block <= :b_hi AND time_min_s >= :lo AND time_max_s <= :hi "
            "GROUP BY b"
        )
        params = {"r": run_id, "lvl": level, "b_lo": b_lo, "b_hi": b_hi, "lo": lo, "hi": hi}
        for row in conn.execute(text(q_roll), {**params, "m": m}):
            _merge(acc, row[0], row[1:], ncols)
        # edge blocks that are only partly inside [lo, hi]: their samples in the window, raw
        edges = conn.execute(
            text(
                "SELECT block FROM sample_rollups WHERE run_id = :r AND level = :lvl "
                "AND block IN (:b_lo, :b_hi) AND (time_min_s < :lo OR time_max_s > :hi)"
            ),
            params,
        ).scalars()
        agg = ", ".join(f"min({c}), max({c}), {d.total(c)}, count({c})" for c in cols)
        blk_expr = d.trunc(f"time_s / {width}")
        bucket = f"{blk_expr} / :m"
        q_edge = (
            f"SELECT {bucket} AS b, count(*), min(time_s), max(time_s), {agg} FROM samples "
            "WHERE run_id = :r AND time_s >= :t0 AND time_s <= :t1 AND id <= :mark "
            f"AND {blk_expr} = :blk GROUP BY b"
        )
        for blk in set(edges):
            t0 = max(lo, blk * width)
            t1 = min(hi, (blk + 1) * width)
            for row in conn.execute(
                text(q_edge),
                {"r": run_id, "t0": t0, "t1": t1, "mark": mark, "m": m, "blk": blk},
            ):
                _merge(acc, row[0], row[1:], ncols)
        # samples newer than the rollups
        q_tail = (
            f"SELECT {bucket} AS b, count(*), min(time_s), max(time_s), {agg} FROM "
            f"{d.samples_above('mark')}{d.plus}run_id = :r AND time_s >= :lo "
            "AND time_s <= :hi GROUP BY b"
        )
        for row in conn.execute(
            text(q_tail), {"r": run_id, "lo": lo, "hi": hi, "mark": mark, "m": m}
        ):
            _merge(acc, row[0], row[1:], ncols)
        return _bucket_series(run_id, cols, acc, float(width * m))

    def peak(self, run: RunRef, column: str = "in_use_bytes") -> Peak:
        """The largest value of ``column`` in a run, with the time and step of its first sample.

        Raises:
            RunNotFoundError: no such run. ConfigError: unknown column.
        """
        (col,) = self._columns([column])
        run_id = self._find(run)["id"]
        with self._read() as conn:
            value = self._sample_max(conn, run_id, col)
            if value is None:
                return Peak(run_id, col, None, None, None)
            lo, hi = None, None
            mark = self._mark(conn, run_id) if self._has_rollups and col in _ROLLUP_SET else None
            if mark is not None:
                # narrow down through the rollup levels to one smallest-level block
                for level in range(len(ROLLUP_LEVEL_WIDTHS_S) - 1, -1, -1):
                    w = ROLLUP_LEVEL_WIDTHS_S[level]
                    extra = "" if lo is None else "AND block >= :b0 AND block <= :b1"
                    blk = conn.execute(
                        text(
                            "SELECT block FROM sample_rollups WHERE run_id = :r AND level = :l "
                            f"AND {col}_max = :v {extra} ORDER BY block LIMIT 1"
                        ),
                        {
                            "r": run_id,
                            "l": level,
                            "v": value,
                            "b0": None if lo is None else int(lo // w),
                            "b1": None if hi is None else int(hi // w),
                        },
                    ).scalar()
                    if blk is None:
                        lo = hi = None
                        break
                    lo, hi = blk * w, (blk + 1) * w
            where = "run_id = :r AND " + (
                "time_s >= :lo AND time_s <= :hi AND " if lo is not None else ""
            )
            row = conn.execute(
                text(
                    f"SELECT time_s, step FROM samples WHERE {where}{col} = :v "
                    "ORDER BY time_s LIMIT 1"
                ),
                {"r": run_id, "lo": lo, "hi": hi, "v": value},
            ).first()
            if row is None and lo is not None:  # the peak is in the raw tail
                row = conn.execute(
                    text(
                        f"SELECT time_s, step FROM samples WHERE run_id = :r AND {col} = :v "
                        "ORDER BY time_s LIMIT 1"
                    ),
                    {"r": run_id, "v": value},
                ).first()
        return Peak(run_id, col, value, row[0] if row else None, row[1] if row else None)

    def _sample_max(self, conn: Any, run_id: int, col: str) -> Any:
        mark = self._mark(conn, run_id) if self._has_rollups and col in _ROLLUP_SET else None
        if mark is None:
            return conn.execute(
                text(f"SELECT max({col}) FROM samples WHERE run_id = :r"), {"r": run_id}
            ).scalar()
        top = len(ROLLUP_LEVEL_WIDTHS_S) - 1
        a = conn.execute(
            text(f"SELECT max({col}_max) FROM sample_rollups WHERE run_id = :r AND level = {top}"),
            {"r": run_id},
        ).scalar()
        b = conn.execute(
            text(
                f"SELECT max({col}) FROM {self._sql.samples_above('m')}{self._sql.plus}run_id = :r"
            ),
            {"r": run_id, "m": mark},
        ).scalar()
        vals = [v for v in (a, b) if v is not None]
        return max(vals) if vals else None

    # -- incremental reads (live viewers) ------------------------------------------------------
    def samples_since(
        self,
        run: RunRef,
        after_id: int = 0,
        *,
        columns: Sequence[str] | None = None,
        limit: int | None = 10_000,
    ) -> list[SampleRow]:
        """Raw samples of a run with ``id > after_id``, oldest first (feed the last id back in).

        Raises:
            RunNotFoundError: no such run. ConfigError: unknown column.
        """
        cols = self._columns(columns)
        run_id = run if isinstance(run, int) and not isinstance(run, bool) else None
        if run_id is None:
            run_id = self._find(run)["id"]
        sel = ", ".join(c for c in cols if c != "step")
        # walk the rowid from after_id (never an index scan of the whole table)
        q = (
            f"SELECT id, time_s, step{', ' + sel if sel else ''} FROM samples"
            f"{self._sql.not_indexed} WHERE id > :a AND {self._sql.plus}run_id = :r ORDER BY id"
        )
        if limit is not None:
            q += f" LIMIT {int(limit)}"
        names = [c for c in cols if c != "step"]
        with self._read() as conn:
            rows = conn.execute(text(q), {"a": after_id, "r": run_id}).all()
        out = []
        for r in rows:
            values = dict(zip(names, r[3:], strict=True))
            if "step" in cols:
                values["step"] = r[2]
            out.append(SampleRow(r[0], r[1], r[2], values))
        return out

    def events_since(self, run: RunRef, after_id: int = 0) -> list[EventInfo]:
        """Events of a run with ``id > after_id``, oldest first.

        Raises:
            RunNotFoundError: no such run.
        """
        return self._events(run, None, after_id)

    # -- events, modules ---------------------------------------------------------------------
    def events(self, run: RunRef, *, kind: str | Sequence[str] | None = None) -> list[EventInfo]:
        """A run's events in time order, optionally only of ``kind`` (one or several).

        Raises:
            RunNotFoundError: no such run.
        """
        return self._events(run, kind, None)

    def _events(
        self, run: RunRef, kind: str | Sequence[str] | None, after_id: int | None
    ) -> list[EventInfo]:
        run_id = run if isinstance(run, int) and not isinstance(run, bool) else None
        if run_id is None or after_id is None:
            run_id = self._find(run)["id"]
        stmt = select(*events_table.columns).where(events_table.c.run_id == run_id)
        if kind is not None:
            kinds = [kind] if isinstance(kind, str) else list(kind)
            stmt = stmt.where(events_table.c.kind.in_(kinds))
        if after_id is not None:
            stmt = stmt.where(events_table.c.id > after_id).order_by(events_table.c.id)
        else:
            stmt = stmt.order_by(events_table.c.time_s, events_table.c.id)
        with self._read() as conn:
            return [
                EventInfo(r.id, r.run_id, r.time_s, r.step, r.kind, r.message, dict(r.data or {}))
                for r in conn.execute(stmt)
            ]

    # -- the daemon's rows (edo-monitor daemon) -----------------------------------------------
    def devices(self, *, within_s: float = 300.0, host: str | None = None) -> list[DeviceInfo]:
        """Every GPU at the latest daemon sample of each host, with its processes.

        Args:
            within_s: hosts whose latest sample is at most this many seconds older than the
                newest sample of any host (a daemon stopped long ago is not shown).
            host: only this host.

        Returns:
            By host, then NVML index; each device's processes largest first. ``[]`` when no
            daemon has written (or the file predates schema 7).
        """
        if not self._has_devices:
            return []
        ds, ps, runs = device_samples_table, process_samples_table, runs_table
        with self._read() as conn:
            newest = conn.execute(select(func.max(ds.c.time_s))).scalar()
            if newest is None:
                return []
            stmt = (
                select(ds.c.host, func.max(ds.c.time_s))
                .where(ds.c.time_s >= newest - within_s)
                .group_by(ds.c.host)
                .order_by(ds.c.host)
            )
            if host is not None:
                stmt = stmt.where(ds.c.host == host)
            out: list[DeviceInfo] = []
            for h, t in conn.execute(stmt).all():
                procs: dict[str, list[ProcessInfo]] = {}
                rows = conn.execute(
                    select(
                        ps.c.device_uuid,
                        ps.c.pid,
                        ps.c.process_name,
                        ps.c.kind,
                        ps.c.process_device_bytes,
                        ps.c.run_id,
                        runs.c.name,
                    )
                    .select_from(ps.outerjoin(runs, runs.c.id == ps.c.run_id))
                    .where(ps.c.time_s == t, ps.c.host == h)
                    .order_by(ps.c.id)
                )
                for r in rows:
                    procs.setdefault(r[0], []).append(ProcessInfo(*r[1:]))
                devs = conn.execute(
                    select(*ds.columns)
                    .where(ds.c.time_s == t, ds.c.host == h)
                    .order_by(ds.c.device_index, ds.c.id)
                )
                for d in devs:
                    mine = sorted(
                        procs.get(d.device_uuid, ()),
                        key=lambda p: -(p.process_device_bytes or 0),
                    )
                    out.append(
                        DeviceInfo(
                            d.time_s,
                            d.host,
                            d.device_index,
                            d.device_uuid,
                            d.device_name,
                            d.device_total_bytes,
                            d.device_used_bytes,
                            d.device_free_bytes,
                            d.utilization_gpu_fraction,
                            d.utilization_memory_fraction,
                            d.process_count,
                            tuple(mine),
                        )
                    )
        return out

    def device_events(
        self, *, limit: int | None = 100, kind: str | Sequence[str] | None = None
    ) -> list[DeviceEventInfo]:
        """The daemon's events (GPUs appearing or lost, NVML faults, starts and stops), the
        newest ``limit`` in time order; ``[]`` before schema 7."""
        if not self._has_devices:
            return []
        de = device_events_table
        stmt = select(*de.columns).order_by(de.c.time_s.desc(), de.c.id.desc())
        if kind is not None:
            stmt = stmt.where(de.c.kind.in_([kind] if isinstance(kind, str) else list(kind)))
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._read() as conn:
            found = [
                DeviceEventInfo(
                    r.id,
                    r.time_s,
                    r.host,
                    r.device_index,
                    r.device_uuid,
                    r.kind,
                    r.message,
                    dict(r.data or {}),
                )
                for r in conn.execute(stmt)
            ]
        return found[::-1]

    def cache_summary(self, run: RunRef) -> CacheSummary | None:
        """The run's row caches summed over its samples; ``None`` when no sample had a cache
        (or the file predates schema 4).

        Raises:
            RunNotFoundError: no such run.
        """
        run_id = self._find(run)["id"]
        if "cache_rows" not in self._default_columns:
            return None
        q = text(
            "SELECT count(*), sum(cache_lookups), sum(cache_lookup_hits), sum(cache_rows_loaded), "
            "sum(cache_rows_evicted), sum(cache_moved_bytes), min(step), max(step), max(id) "
            "FROM samples WHERE run_id = :r AND cache_rows IS NOT NULL"
        )
        with self._read() as conn:
            n, lookups, hits, loaded, evicted, moved, first, last, last_id = conn.execute(
                q, {"r": run_id}
            ).one()
            if not n:
                return None
            rows_now = conn.execute(
                text("SELECT cache_rows FROM samples WHERE id = :i"), {"i": last_id}
            ).scalar()
        return CacheSummary(
            run_id,
            int(lookups or 0),
            int(hits or 0),
            int(loaded or 0),
            int(evicted or 0),
            int(moved or 0),
            int(first),
            int(last),
            int(rows_now or 0),
        )

    def modules(self, run: RunRef) -> list[ModuleInfo]:
        """The latest ``module_stats`` row of each module of a run, largest total first.

        Raises:
            RunNotFoundError: no such run.
        """
        run_id = self._find(run)["id"]
        q = text(
            "SELECT m.* FROM module_stats m JOIN (SELECT module, max(id) AS id FROM module_stats "
            "WHERE run_id = :r GROUP BY module) last ON m.id = last.id"
        )
        fields = [f.name for f in dataclasses.fields(ModuleInfo)]
        with self._read() as conn:
            rows = conn.execute(q, {"r": run_id}).mappings().all()
        mods = [ModuleInfo(**{k: r.get(k) for k in fields if k in r}) for r in rows]
        return sorted(mods, key=lambda m: (-m.total_bytes, m.module))

    # -- comparison --------------------------------------------------------------------------
    def compare(self, a: RunRef, b: RunRef) -> RunComparison:
        """Two runs side by side: peaks, minimum free fraction, steps/s, counts, actions.

        Raises:
            RunNotFoundError: either run does not exist.
        """
        ra, rb = self.run(a), self.run(b)

        def metric(name: str, unit: str) -> MetricComparison:
            va, vb = getattr(ra, name), getattr(rb, name)
            return MetricComparison(name, unit, va, vb)

        metrics = [
            metric("duration_s", "s"),
            metric("steps", "steps"),
            metric("steps_per_s", "steps/s"),
            metric("sample_count", "samples"),
            *(metric(f"peak_{c}", "bytes") for c in _PEAK_COLUMNS),
            metric("min_free_fraction", "fraction"),
            metric("budget_bytes", "bytes"),
            metric("action_count", "events"),
            metric("oom_count", "events"),
            metric("event_count", "events"),
            metric("samples_dropped", "samples"),
        ]
        return RunComparison(
            a=ra,
            b=rb,
            metrics=metrics,
            actions_a=self.events(ra.id, kind="action"),
            actions_b=self.events(rb.id, kind="action"),
        )


def _tail_stats_sql(agg: str, placeholders: str) -> str:
    """Per-run statistics of the samples newer than the rollups (``id > :mark``).

    A rowid range search from the mark: ``NOT INDEXED`` and ``+run_id`` (in the ``WHERE`` and
    the ``GROUP BY``) keep SQLite from walking the whole ``(run_id, time_s)`` index to get the
    rows in ``run_id`` order, which costs ~0.1 s per million samples on every live refresh.
    """
    return (
        f"SELECT run_id, count(*), min(time_s), max(time_s), {agg} FROM samples NOT INDEXED "
        f"WHERE id > :mark AND +run_id IN ({placeholders}) GROUP BY +run_id"
    )


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)


def _raw_series(run_id: int, cols: Sequence[str], rows: Sequence[Any]) -> SampleSeries:
    s = SampleSeries(run_id, tuple(cols), False, None)
    for r in rows:
        s.time_s.append(r[1])
        s.time_end_s.append(r[1])
        s.count.append(1)
    for j, c in enumerate(cols):
        vals = [r[2 + j] for r in rows]
        s.min[c] = vals
        s.max[c] = vals
        s.mean[c] = [None if v is None else float(v) for v in vals]
    return s


def _bucket_series(
    run_id: int, cols: Sequence[str], acc: Mapping[int, Sequence[Any]], width: float
) -> SampleSeries:
    s = SampleSeries(run_id, tuple(cols), True, width)
    keys = sorted(acc)
    for k in keys:
        v = acc[k]
        s.count.append(int(v[0]))
        s.time_s.append(v[1])
        s.time_end_s.append(v[2])
    for j, c in enumerate(cols):
        base = 3 + 4 * j
        s.min[c] = [acc[k][base] for k in keys]
        s.max[c] = [acc[k][base + 1] for k in keys]
        s.mean[c] = [
            (acc[k][base + 2] / acc[k][base + 3]) if acc[k][base + 3] else None for k in keys
        ]
    return s


_KEEP_MAX = (*_PEAK_COLUMNS,)
_KEEP_MIN = ("free_fraction",)


def prune(
    history: History,
    *,
    older_than_s: float | None = None,
    keep_last: int | None = None,
    downsample_older_than_s: float | None = None,
    bucket_s: float = 60.0,
    dry_run: bool = False,
    vacuum: bool = False,
    now_s: float | None = None,
) -> dict[str, Any]:
    """Delete old runs and/or thin old samples; runs whose effective status is ``running`` are
    never touched. ``history`` must be writable (``readonly=False``) unless ``dry_run``.

    Args:
        older_than_s: delete runs started more than this many seconds ago.
        keep_last: keep only this many most recently started runs.
        downsample_older_than_s: in samples older than this (seconds), keep per run and
            ``bucket_s`` bucket only the first and last sample and the samples holding the
            bucket's maximum of each peak column (in use, allocated, reserved, process, device
            used, RSS) and its minimum free fraction. Peaks therefore survive.
        bucket_s: downsampling bucket width (seconds, > 0).
        dry_run: count only; change nothing.
        vacuum: run SQLite ``VACUUM`` afterwards to return freed pages to the disk.
        now_s: the present (Unix seconds), default ``time.time()``.

    Returns:
        ``{"runs_deleted", "run_ids_deleted", "samples_deleted", "runs_downsampled",
        "snapshots_deleted"}`` (snapshots thinned in downsampled runs: see
        :func:`edo_monitor.store.snapshot_store.thin_snapshots`).

    Raises:
        ConfigError: ``bucket_s <= 0`` or a negative ``keep_last``.
        StoreError: the history is read-only and ``dry_run`` is False.
    """
    from edo_monitor.errors import StoreError
    from edo_monitor.store.engine import rebuild_rollups, roll_up
    from edo_monitor.store.snapshot_store import delete_runs_snapshots, thin_snapshots

    if bucket_s <= 0:
        raise ConfigError(f"bucket_s={bucket_s!r} must be > 0")
    if keep_last is not None and keep_last < 0:
        raise ConfigError(f"keep_last={keep_last!r} must be ≥ 0")
    if history.readonly and not dry_run:
        raise StoreError("prune needs a writable history (History(db, readonly=False))")
    now = time.time() if now_s is None else now_s
    runs = history.runs()  # newest first
    doomed: set[int] = set()
    if older_than_s is not None:
        doomed |= {r.id for r in runs if r.started_at_s < now - older_than_s}
    if keep_last is not None:
        doomed |= {r.id for r in runs[keep_last:]}
    doomed -= {r.id for r in runs if r.status == "running"}
    report: dict[str, Any] = {
        "runs_deleted": len(doomed),
        "run_ids_deleted": sorted(doomed),
        "samples_deleted": 0,
        "runs_downsampled": 0,
        "snapshots_deleted": 0,
    }
    thin = []
    if downsample_older_than_s is not None:
        cut = now - downsample_older_than_s
        thin = [
            r.id
            for r in runs
            if r.id not in doomed
            and r.status != "running"
            and r.first_sample_s is not None
            and r.first_sample_s < cut
        ]
    ids = ", ".join(str(i) for i in sorted(doomed)) or "NULL"
    with history._read() as conn:
        report["samples_deleted"] = int(
            conn.execute(text(f"SELECT count(*) FROM samples WHERE run_id IN ({ids})")).scalar()
            or 0
        )
        if dry_run:
            report["runs_downsampled"] = len(thin)
            return report
        delete_runs_snapshots(conn, ids)  # schema 8: before the events they link to
        conn.execute(text(f"DELETE FROM runs WHERE id IN ({ids})"))
        for table in ("samples", "events", "module_stats", "sample_rollups"):
            if table != "sample_rollups" or history._has_rollups:  # FK cascade, made explicit
                conn.execute(text(f"DELETE FROM {table} WHERE run_id IN ({ids})"))
        for run_id in thin:
            bucket = history._sql.trunc("time_s / :w")
            keeps = [
                f"SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY {bucket} "
                f"ORDER BY {order}) AS rn FROM samples WHERE run_id = :r AND time_s < :cut) "
                "AS k WHERE rn = 1"
                for order in (
                    "time_s, id",
                    "time_s DESC, id DESC",
                    *(f"{c} DESC NULLS LAST, id" for c in _KEEP_MAX),
                    *(f"{c} ASC NULLS LAST, id" for c in _KEEP_MIN),
                )
            ]
            res = conn.execute(
                text(
                    "DELETE FROM samples WHERE run_id = :r AND time_s < :cut AND id NOT IN "
                    f"({' UNION '.join(keeps)})"
                ),
                {"r": run_id, "cut": cut, "w": bucket_s},
            )
            if res.rowcount:
                report["samples_deleted"] += res.rowcount
                report["runs_downsampled"] += 1
        if thin:  # schema 8: old snapshots thinned with the samples
            report["snapshots_deleted"] = thin_snapshots(conn, thin, cut)
        if doomed and history._has_jobs:  # jobs none of whose runs is left
            conn.execute(
                text(
                    "DELETE FROM jobs WHERE NOT EXISTS "
                    "(SELECT 1 FROM runs WHERE runs.job_id = jobs.id)"
                )
            )
        if history._pg:  # the deleted runs' rollup marks
            for run_id in sorted(doomed):
                conn.execute(text("DELETE FROM meta WHERE key = :k"), {"k": run_mark_key(run_id)})
        if history._has_rollups:
            roll_up(conn)  # fold in what is waiting; resets the mark if ids went down
            rebuild_rollups(conn, thin)
        conn.commit()
    if vacuum and history.engine.dialect.name == "sqlite":
        with history.engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            raw.execute("VACUUM")  # type: ignore[union-attr]
    logger.info("prune: %s", report)
    return report
