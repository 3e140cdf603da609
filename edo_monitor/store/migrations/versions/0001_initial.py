"""Schema version 1: runs, samples, events, module_stats, meta.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

_SAMPLE_INTS = (
    "device_total_bytes",
    "device_used_bytes",
    "device_free_bytes",
    "process_device_bytes",
    "nvml_memory_info_version",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "reserved_unallocated_bytes",
    "peak_allocated_bytes",
    "num_alloc_retries",
    "num_ooms",
)
_SAMPLE_INTS_2 = (
    "largest_inactive_block_bytes",
    "segment_count",
    "params_bytes",
    "grads_bytes",
    "optimizer_state_bytes",
    "activations_bytes",
    "host_tier_bytes",
    "budget_bytes",
    "in_use_bytes",
)


def upgrade() -> None:
    """Create the version-1 tables (as ``schema.py`` declared them at version 1)."""
    op.create_table(
        "meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    op.create_table(
        "runs",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("uuid", sa.String(36), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", BIG, nullable=False),
        sa.Column("started_at_s", sa.Float, nullable=False),
        sa.Column("ended_at_s", sa.Float),
        sa.Column("heartbeat_at_s", sa.Float),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("device_kind", sa.String(16), nullable=False),
        sa.Column("device_name", sa.String(200)),
        sa.Column("device_uuid", sa.String(100)),
        sa.Column("device_total_bytes", BIG),
        sa.Column("budget_bytes", BIG),
        sa.Column("interval_s", sa.Float, nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("tags", sa.JSON, nullable=False),
        sa.Column("steps", BIG, nullable=False),
        sa.Column("samples_dropped", BIG, nullable=False),
    )
    op.create_index("ix_runs_uuid", "runs", ["uuid"], unique=True)
    op.create_index("ix_runs_started_at_s", "runs", ["started_at_s"])
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_table(
        "samples",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("run_id", BIG, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("time_s", sa.Float, nullable=False),
        sa.Column("step", BIG, nullable=False),
        sa.Column("device_kind", sa.String(16), nullable=False),
        *(sa.Column(c, BIG) for c in _SAMPLE_INTS),
        sa.Column("fragmentation", sa.Float),
        *(sa.Column(c, BIG) for c in _SAMPLE_INTS_2),
        sa.Column("free_fraction", sa.Float),
        sa.Column("process_rss_bytes", BIG),
        sa.Column("host_available_bytes", BIG),
    )
    op.create_index("ix_samples_run_time", "samples", ["run_id", "time_s"])
    op.create_table(
        "events",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("run_id", BIG, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("time_s", sa.Float, nullable=False),
        sa.Column("step", BIG, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
    )
    op.create_index("ix_events_run_id", "events", ["run_id"])
    op.create_index("ix_events_kind", "events", ["kind"])
    op.create_table(
        "module_stats",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("run_id", BIG, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("time_s", sa.Float, nullable=False),
        sa.Column("step", BIG, nullable=False),
        sa.Column("module", sa.String(500), nullable=False),
        sa.Column("kind", sa.String(100), nullable=False),
        sa.Column("num_embeddings", BIG),
        sa.Column("embedding_dim", BIG),
        sa.Column("dtype", sa.String(32)),
        sa.Column("device", sa.String(32)),
        sa.Column("placement", sa.String(16)),
        sa.Column("params_bytes", BIG, nullable=False),
        sa.Column("grads_bytes", BIG, nullable=False),
        sa.Column("optimizer_state_bytes", BIG, nullable=False),
        sa.Column("activations_bytes", BIG, nullable=False),
    )
    op.create_index("ix_module_stats_run_id", "module_stats", ["run_id"])
    op.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '1')")


def downgrade() -> None:
    """Drop every table."""
    for table in ("module_stats", "events", "samples", "runs", "meta"):
        op.drop_table(table)
