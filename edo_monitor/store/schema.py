"""The history database's tables (SQLAlchemy Core ``Table`` objects in :data:`metadata`).

Readers (``History``, the CLI, the dashboard) use these tables alone, so a history command never
imports ``sqlalchemy.orm``. The agent's writer maps ORM classes onto the same tables
(:mod:`edo_monitor.store.models`).

Times are seconds since the Unix epoch, UTC, stored as floats (``*_s`` columns): they bucket and
compare cheaply in SQL. Byte counts are integers. ``SCHEMA_VERSION`` is recorded in the ``meta``
table; Alembic's revisions (``edo_monitor/store/migrations``) move a database between versions.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    cast,
    func,
    select,
)

from edo_monitor.probes.readings import SAMPLE_FIELDS

__all__ = [
    "CACHE_FIELDS",
    "DEVICE_EVENT_KINDS",
    "ROLLUP_FIELDS",
    "ROLLUP_LEVEL_WIDTHS_S",
    "RUNS_HIGH_ID_KEY",
    "RUN_NAME_MAX_CHARS",
    "SCHEMA_VERSION",
    "device_events_table",
    "device_samples_table",
    "events_table",
    "jobs_table",
    "meta_table",
    "metadata",
    "module_stats_table",
    "next_run_id",
    "process_samples_table",
    "runs_table",
    "sample_rollups",
    "samples_table",
    "snapshots_table",
]


SCHEMA_VERSION = 8

#: Run statuses written by the agent. ``crashed`` is never written: readers derive it from a
#: ``running`` run whose process is gone or whose heartbeat is stale.
RUN_STATUSES = ("running", "finished", "failed", "interrupted")


_INT = BigInteger().with_variant(Integer(), "sqlite")

#: Row-cache counters of a table in ``module_stats`` (totals since the table was cached) and,
#: summed over the run's cached tables since the previous sample, in ``samples`` (schema 4).
CACHE_FIELDS: tuple[str, ...] = (
    "cache_rows",
    "cache_lookups",
    "cache_lookup_hits",
    "cache_rows_loaded",
    "cache_rows_evicted",
    "cache_moved_bytes",
)

#: Every table of the history database (plain SQLAlchemy Core: readers need no ORM).
metadata = MetaData()

#: Key/value facts about the database itself (``schema_version``, ``rollup_through_id``).
meta_table = Table(
    "meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

#: ``meta`` key: the highest run id the database ever held, written when runs are deleted.
#: SQLite gives a new row the highest id + 1, so once the newest runs were pruned the next run
#: took a deleted run's id, and notes, ``compare`` commands and exported files naming that id
#: silently meant another run (:func:`next_run_id`).
RUNS_HIGH_ID_KEY = "runs_high_id"


def next_run_id() -> Any:
    """The id a new run takes on SQLite, as a scalar SQL expression evaluated inside its
    ``INSERT`` (atomic): one above both the highest id there and :data:`RUNS_HIGH_ID_KEY`.
    PostgreSQL's sequence never gives an id twice and needs none of it."""
    top = select(func.max(runs_table.c.id)).scalar_subquery()
    high = (
        select(cast(meta_table.c.value, Integer))
        .where(meta_table.c.key == RUNS_HIGH_ID_KEY)
        .scalar_subquery()
    )
    return func.max(func.coalesce(top, 0), func.coalesce(high, 0)) + 1


#: the longest run name the ``runs.name`` column holds (``watch(run_name=)`` refuses longer)
RUN_NAME_MAX_CHARS = 200

#: One ``watch()`` block: who, where, what device, with which settings, and how it ended.
runs_table = Table(
    "runs",
    metadata,
    Column("id", _INT, primary_key=True, autoincrement=True),
    Column("uuid", String(36), nullable=False, unique=True, index=True),
    Column("name", String(RUN_NAME_MAX_CHARS), nullable=False),
    Column("host", String(255), nullable=False),
    Column("pid", _INT, nullable=False),
    Column("started_at_s", Float, nullable=False, index=True),
    Column("ended_at_s", Float),
    Column("heartbeat_at_s", Float),
    Column("status", String(16), nullable=False, index=True),
    Column("error", Text),
    Column("device_kind", String(16), nullable=False),
    Column("device_name", String(200)),
    Column("device_uuid", String(100)),
    Column("device_total_bytes", _INT),
    Column("budget_bytes", _INT),
    Column("interval_s", Float, nullable=False),
    Column("torch_version", String(64), nullable=False),
    Column("config", JSON, nullable=False, default=dict),
    Column("tags", JSON, nullable=False, default=list),
    Column("steps", _INT, nullable=False, default=0),
    Column("samples_dropped", _INT, nullable=False, default=0),
    # schema 6: the run's place in a multi-rank job (NULL: not in an initialised process group).
    # No foreign key to ``jobs``: on SQLite adding one would rebuild ``runs``, and dropping the
    # old table with foreign keys on cascades into every sample. Each rank writes its job row
    # (insert-or-ignore) in the transaction that inserts its run.
    Column("job_id", String(100), index=True),
    Column("rank", _INT),
    Column("world_size", _INT),
    Column("local_rank", _INT),
)

#: Schema 6: one multi-rank job (a ``torch.distributed`` process group); its ranks' runs carry
#: its ``id`` in ``runs.job_id``, one run per rank.
jobs_table = Table(
    "jobs",
    metadata,
    # TORCHELASTIC_RUN_ID (torchrun), or rank 0's UUID agreed through the process group
    Column("id", String(100), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("world_size", _INT, nullable=False),
    Column("backend", String(32)),
    # "torchelastic" or "process_group": where the id came from
    Column("id_source", String(32), nullable=False),
    # when the first rank recorded the job
    Column("created_at_s", Float, nullable=False, index=True),
)

_FLOAT_FIELDS = {"time_s", "fragmentation", "free_fraction"}


def _run_row_columns(*, run_index: bool) -> list[Column[Any]]:
    """``id``, ``run_id`` (cascading foreign key; indexed alone when ``run_index``), ``time_s``
    and ``step``: the first columns of every per-run table."""
    return [
        Column("id", _INT, primary_key=True, autoincrement=True),
        Column(
            "run_id",
            _INT,
            ForeignKey("runs.id", ondelete="CASCADE"),
            nullable=False,
            index=run_index or None,
        ),
        Column("time_s", Float, nullable=False),
        Column("step", _INT, nullable=False),
    ]


#: One :class:`edo_monitor.probes.readings.Reading` per row; the columns are its fields (same
#: names).
samples_table = Table(
    "samples",
    metadata,
    *_run_row_columns(run_index=False),
    Column("device_kind", String(16), nullable=False),
    *(
        Column(name, Float if name in _FLOAT_FIELDS else _INT)
        for name in SAMPLE_FIELDS
        if name not in ("time_s", "step", "device_kind")
    ),
    Index("ix_samples_run_time", "run_id", "time_s"),
)

#: Something that happened: a threshold crossing, a decision, an action, a refusal, an OOM, a
#: probe becoming unavailable, dropped samples. ``data`` holds the kind's numbers (JSON).
events_table = Table(
    "events",
    metadata,
    *_run_row_columns(run_index=True),
    Column("kind", String(32), nullable=False, index=True),
    Column("message", Text, nullable=False),
    Column("data", JSON, nullable=False, default=dict),
)

#: Bytes of one module (embedding tables, and modules with saved activations) at one moment.
#: Written on the first sample, whenever a table's placement, dtype, bytes or row-cache counters
#: change, and at the end of the run; the latest row per module is its current state. The
#: ``cache_*`` columns are a cached table's counters since it was cached (``NULL``: no cache).
module_stats_table = Table(
    "module_stats",
    metadata,
    *_run_row_columns(run_index=True),
    Column("module", String(500), nullable=False),
    Column("kind", String(100), nullable=False),
    Column("num_embeddings", _INT),
    Column("embedding_dim", _INT),
    Column("dtype", String(32)),
    Column("device", String(32)),
    Column("placement", String(16)),
    Column("params_bytes", _INT, nullable=False, default=0),
    Column("grads_bytes", _INT, nullable=False, default=0),
    Column("optimizer_state_bytes", _INT, nullable=False, default=0),
    Column("activations_bytes", _INT, nullable=False, default=0),
    *(Column(name, _INT) for name in CACHE_FIELDS),
)


#: Sample columns summarised in ``sample_rollups`` (every numeric ``samples`` column but time).
ROLLUP_FIELDS: tuple[str, ...] = (
    "step",
    "device_total_bytes",
    "device_used_bytes",
    "device_free_bytes",
    "process_device_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "reserved_unallocated_bytes",
    "peak_allocated_bytes",
    "num_alloc_retries",
    "num_ooms",
    "fragmentation",
    "largest_inactive_block_bytes",
    "segment_count",
    "params_bytes",
    "grads_bytes",
    "optimizer_state_bytes",
    "activations_bytes",
    "host_tier_bytes",
    "budget_bytes",
    "in_use_bytes",
    "free_fraction",
    "process_rss_bytes",
    "host_available_bytes",
    "host_limit_bytes",
    "process_tree_bytes",
    *CACHE_FIELDS,
)

#: Width (seconds) of a rollup block at each level: level ``L`` block ``k`` holds the samples with
#: ``CAST(time_s / ROLLUP_LEVEL_WIDTHS_S[L] AS INTEGER) = k`` (epoch-aligned powers of two, so the
#: blocks of a level tile time and a coarser block is exactly 16 finer ones). Downsampling to
#: buckets narrower than the smallest level reads the samples themselves.
ROLLUP_LEVEL_WIDTHS_S: tuple[int, ...] = (16, 256, 4096)


def _rollup_columns() -> list[Column[Any]]:
    cols: list[Column[Any]] = []
    for name in ROLLUP_FIELDS:
        kind = Float if name in _FLOAT_FIELDS else BigInteger().with_variant(Integer(), "sqlite")
        cols += [
            Column(f"{name}_min", kind),
            Column(f"{name}_max", kind),
            Column(f"{name}_sum", Float),
            Column(f"{name}_n", Integer, nullable=False, server_default="0"),
        ]
    return cols


#: Schema version 2: per-run, per-level, per-time-block min / max / sum / count of every numeric
#: sample column, for downsampling in SQL without scanning every sample (see
#: :meth:`edo_monitor.store.history.History.samples`). It summarises the samples with
#: ``id <= meta['rollup_through_id']``; later samples are read raw. Maintained by writer engines
#: (:func:`edo_monitor.store.engine.write_samples`, :func:`edo_monitor.store.engine.roll_up`).
sample_rollups = Table(
    "sample_rollups",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("level", Integer, nullable=False),
    Column("block", Integer, nullable=False),
    Column("n", Integer, nullable=False),
    Column("time_min_s", Float, nullable=False),
    Column("time_max_s", Float, nullable=False),
    *_rollup_columns(),
    PrimaryKeyConstraint("run_id", "level", "block", name="pk_sample_rollups"),
    sqlite_with_rowid=False,
)


# -- schema version 7: the system-wide daemon (``edo-monitor daemon``,
# edo_monitor/surfaces/daemon.py) ----

#: One GPU at one daemon sample: every device of a sample shares its ``time_s``. ``device_index``
#: is NVML's (PCI bus order, not ``CUDA_VISIBLE_DEVICES``'); ``device_uuid`` identifies the GPU.
#: Bytes from ``nvmlDeviceGetMemoryInfo`` (v2: ``used`` excludes the driver's reserved memory);
#: ``utilization_*_fraction`` from ``nvmlDeviceGetUtilizationRates`` (share of NVML's last sample
#: period a kernel ran / device memory was read or written), ``NULL`` where not supported;
#: ``process_count``: processes listed (``NULL``: the lists could not be read).
device_samples_table = Table(
    "device_samples",
    metadata,
    Column("id", _INT, primary_key=True, autoincrement=True),
    Column("time_s", Float, nullable=False, index=True),
    Column("host", String(255), nullable=False),
    Column("device_index", Integer, nullable=False),
    Column("device_uuid", String(100), nullable=False),
    Column("device_name", String(200)),
    Column("device_total_bytes", _INT),
    Column("device_used_bytes", _INT),
    Column("device_free_bytes", _INT),
    Column("nvml_memory_info_version", Integer),
    Column("utilization_gpu_fraction", Float),
    Column("utilization_memory_fraction", Float),
    Column("process_count", Integer),
)

#: One process on one GPU at one daemon sample (same ``time_s`` as its device's row).
#: ``process_device_bytes``: its memory on the device, CUDA context included (``usedGpuMemory``;
#: ``NULL`` when the driver gives N/A). ``kind``: ``compute``, ``graphics`` or
#: ``compute+graphics``. ``process_name`` from psutil (``NULL`` when the PID is not visible here:
#: NVML lists host PIDs). ``run_id``: the watched run this process is (same host and PID, the run
#: running at ``time_s``), else ``NULL``.
process_samples_table = Table(
    "process_samples",
    metadata,
    Column("id", _INT, primary_key=True, autoincrement=True),
    Column("time_s", Float, nullable=False, index=True),
    Column("host", String(255), nullable=False),
    Column("device_index", Integer, nullable=False),
    Column("device_uuid", String(100), nullable=False),
    Column("pid", _INT, nullable=False),
    Column("process_name", String(255)),
    Column("kind", String(32), nullable=False),
    Column("process_device_bytes", _INT),
    Column("run_id", _INT, ForeignKey("runs.id", ondelete="SET NULL"), index=True),
)

#: What the daemon noticed: :data:`DEVICE_EVENT_KINDS`. ``device_uuid`` / ``device_index``
#: are ``NULL`` for events of NVML as a whole or of the daemon itself.
device_events_table = Table(
    "device_events",
    metadata,
    Column("id", _INT, primary_key=True, autoincrement=True),
    Column("time_s", Float, nullable=False, index=True),
    Column("host", String(255), nullable=False),
    Column("device_index", Integer),
    Column("device_uuid", String(100)),
    Column("kind", String(32), nullable=False),
    Column("message", Text, nullable=False),
    Column("data", JSON, nullable=False, default=dict),
)

#: ``device_events.kind`` values: the daemon started / stopped, a GPU appeared (at start or
#: later) or was lost (``NVMLError_GpuIsLost``, or gone from NVML's list), a device or NVML as a
#: whole stopped answering (driver/library mismatch …), one query of a device failed
#: (``probe_unavailable``, as the agent's), rows dropped (queue full or unwritable), the
#: database working again after failed writes (``store_reconnected``, nothing lost).
DEVICE_EVENT_KINDS = (
    "daemon_started",
    "daemon_stopped",
    "device_appeared",
    "device_lost",
    "device_unavailable",
    "nvml_unavailable",
    "probe_unavailable",
    "samples_dropped",
    "store_reconnected",
)


# -- schema version 8: memory snapshots of incidents (edo_monitor/measure/snapshots.py)
# ----------------

#: One memory snapshot in the format of ``torch.cuda.memory._snapshot()`` (a dict with
#: ``segments`` and ``device_traces``), taken at an incident and linked to its event: an OOM,
#: a crossing below the floor, before / after an action. ``blob`` is the pickle compressed as
#: ``encoding`` says (``"pickle+zlib"``); ``raw_bytes`` / ``stored_bytes``: the pickle's size
#: and the blob's. ``source``: ``"cuda"`` (the allocator's own snapshot) or ``"cpu-budget"``
#: (built from what the agent accounts). ``phase``: ``"at"`` the event, ``"before"`` /
#: ``"after"`` an action. ``allocated_bytes``: the active blocks' bytes; ``reserved_bytes``:
#: the segments' bytes. ``event_id`` is ``NULL`` when the event row could not be written.
snapshots_table = Table(
    "snapshots",
    metadata,
    *_run_row_columns(run_index=True),
    Column("event_id", _INT, ForeignKey("events.id", ondelete="CASCADE"), index=True),
    Column("phase", String(16), nullable=False),
    Column("source", String(16), nullable=False),
    Column("encoding", String(32), nullable=False),
    Column("raw_bytes", _INT, nullable=False),
    Column("stored_bytes", _INT, nullable=False),
    Column("allocated_bytes", _INT),
    Column("reserved_bytes", _INT),
    Column("blob", LargeBinary, nullable=False),
)
