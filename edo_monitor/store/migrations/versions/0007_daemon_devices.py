"""Schema version 7: the system-wide daemon's tables (``edo-monitor daemon``).

* ``device_samples`` — one GPU at one daemon sample: NVML index, UUID, name, total / used / free
  bytes, memory-info version, utilisation fractions, number of processes listed;
* ``process_samples`` — one process on one GPU at one daemon sample: PID, name, kind, bytes, and
  the watched run it is (``run_id``, ``SET NULL`` when the run is deleted);
* ``device_events`` — GPUs appearing or lost, NVML stopping, the daemon starting and stopping.

Nothing existing changes; older databases get the empty tables.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Create the three tables and their indexes; record schema version 7."""
    op.create_table(
        "device_samples",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("time_s", sa.Float, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("device_index", sa.Integer, nullable=False),
        sa.Column("device_uuid", sa.String(100), nullable=False),
        sa.Column("device_name", sa.String(200)),
        sa.Column("device_total_bytes", BIG),
        sa.Column("device_used_bytes", BIG),
        sa.Column("device_free_bytes", BIG),
        sa.Column("nvml_memory_info_version", sa.Integer),
        sa.Column("utilization_gpu_fraction", sa.Float),
        sa.Column("utilization_memory_fraction", sa.Float),
        sa.Column("process_count", sa.Integer),
    )
    op.create_index("ix_device_samples_time_s", "device_samples", ["time_s"])
    op.create_table(
        "process_samples",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("time_s", sa.Float, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("device_index", sa.Integer, nullable=False),
        sa.Column("device_uuid", sa.String(100), nullable=False),
        sa.Column("pid", BIG, nullable=False),
        sa.Column("process_name", sa.String(255)),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("process_device_bytes", BIG),
        sa.Column("run_id", BIG, sa.ForeignKey("runs.id", ondelete="SET NULL")),
    )
    op.create_index("ix_process_samples_time_s", "process_samples", ["time_s"])
    op.create_index("ix_process_samples_run_id", "process_samples", ["run_id"])
    op.create_table(
        "device_events",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("time_s", sa.Float, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("device_index", sa.Integer),
        sa.Column("device_uuid", sa.String(100)),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
    )
    op.create_index("ix_device_events_time_s", "device_events", ["time_s"])
    op.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")


def downgrade() -> None:
    """Drop the three tables; back to schema version 6."""
    for table in ("device_events", "process_samples", "device_samples"):
        op.drop_table(table)
    op.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")
