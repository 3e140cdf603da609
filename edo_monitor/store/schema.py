"""The history database's tables (SQLAlchemy 2 typed ORM).

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
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "ROLLUP_FIELDS",
    "ROLLUP_LEVEL_WIDTHS_S",
    "SCHEMA_VERSION",
    "Base",
    "Event",
    "Meta",
    "ModuleStat",
    "Run",
    "Sample",
    "sample_rollups",
]

SCHEMA_VERSION = 3

#: Run statuses written by the agent. ``crashed`` is never written: readers derive it from a
#: ``running`` run whose process is gone or whose heartbeat is stale.
RUN_STATUSES = ("running", "finished", "failed", "interrupted")


class Base(DeclarativeBase):
    """Declarative base of every edo-monitor table."""

    type_annotation_map = {int: BigInteger().with_variant(Integer(), "sqlite")}  # noqa: RUF012


class Meta(Base):
    """Key/value facts about the database itself (``schema_version``)."""

    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Run(Base):
    """One ``watch()`` block: who, where, what device, with which settings, and how it ended."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, index=True)
    name: Mapped[str] = mapped_column(String(200))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    started_at_s: Mapped[float] = mapped_column(Float, index=True)
    ended_at_s: Mapped[float | None] = mapped_column(Float)
    heartbeat_at_s: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16), index=True)
    error: Mapped[str | None] = mapped_column(Text)
    device_kind: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str | None] = mapped_column(String(200))
    device_uuid: Mapped[str | None] = mapped_column(String(100))
    device_total_bytes: Mapped[int | None]
    budget_bytes: Mapped[int | None]
    interval_s: Mapped[float] = mapped_column(Float)
    torch_version: Mapped[str] = mapped_column(String(64))
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    steps: Mapped[int] = mapped_column(default=0)
    samples_dropped: Mapped[int] = mapped_column(default=0)


_FLOAT_FIELDS = {"time_s", "fragmentation", "free_fraction"}
_STRING_FIELDS = {"device_kind"}


class Sample(Base):
    """One :class:`edo_monitor.readings.Reading`; the columns are its fields (same names)."""

    __tablename__ = "samples"
    __table_args__ = (Index("ix_samples_run_time", "run_id", "time_s"),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    time_s: Mapped[float] = mapped_column(Float)
    step: Mapped[int]
    device_kind: Mapped[str] = mapped_column(String(16))
    device_total_bytes: Mapped[int | None]
    device_used_bytes: Mapped[int | None]
    device_free_bytes: Mapped[int | None]
    process_device_bytes: Mapped[int | None]
    nvml_memory_info_version: Mapped[int | None]
    allocated_bytes: Mapped[int | None]
    reserved_bytes: Mapped[int | None]
    active_bytes: Mapped[int | None]
    inactive_split_bytes: Mapped[int | None]
    reserved_unallocated_bytes: Mapped[int | None]
    peak_allocated_bytes: Mapped[int | None]
    num_alloc_retries: Mapped[int | None]
    num_ooms: Mapped[int | None]
    fragmentation: Mapped[float | None] = mapped_column(Float)
    largest_inactive_block_bytes: Mapped[int | None]
    segment_count: Mapped[int | None]
    params_bytes: Mapped[int | None]
    grads_bytes: Mapped[int | None]
    optimizer_state_bytes: Mapped[int | None]
    activations_bytes: Mapped[int | None]
    host_tier_bytes: Mapped[int | None]
    budget_bytes: Mapped[int | None]
    in_use_bytes: Mapped[int | None]
    free_fraction: Mapped[float | None] = mapped_column(Float)
    process_rss_bytes: Mapped[int | None]
    host_available_bytes: Mapped[int | None]
    host_limit_bytes: Mapped[int | None]
    process_tree_bytes: Mapped[int | None]


class Event(Base):
    """Something that happened: a threshold crossing, a decision, an action, a refusal, an OOM,
    a probe becoming unavailable, dropped samples. ``data`` holds the kind's numbers (JSON)."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    time_s: Mapped[float] = mapped_column(Float)
    step: Mapped[int]
    kind: Mapped[str] = mapped_column(String(32), index=True)
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class ModuleStat(Base):
    """Bytes of one module (embedding tables, and modules with saved activations) at one moment.

    Written on the first sample, whenever a table's placement, dtype or bytes change, and at the
    end of the run; the latest row per module is its current state.
    """

    __tablename__ = "module_stats"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    time_s: Mapped[float] = mapped_column(Float)
    step: Mapped[int]
    module: Mapped[str] = mapped_column(String(500))
    kind: Mapped[str] = mapped_column(String(100))
    num_embeddings: Mapped[int | None]
    embedding_dim: Mapped[int | None]
    dtype: Mapped[str | None] = mapped_column(String(32))
    device: Mapped[str | None] = mapped_column(String(32))
    placement: Mapped[str | None] = mapped_column(String(16))
    params_bytes: Mapped[int] = mapped_column(default=0)
    grads_bytes: Mapped[int] = mapped_column(default=0)
    optimizer_state_bytes: Mapped[int] = mapped_column(default=0)
    activations_bytes: Mapped[int] = mapped_column(default=0)


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
    Base.metadata,
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
