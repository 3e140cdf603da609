"""Schema version 2: ``sample_rollups``, per-time-block summaries of samples for fast downsampling.

Each row holds, for one run, level and epoch-aligned time block (16 s, 256 s, 4096 s wide),
the sample count, first/last time, and min / max / sum / non-null count of every numeric sample
column. ``History.samples(max_points=…)`` reads these instead of every sample, so a peak stays a
peak and a run of ten million samples downsamples in milliseconds. Existing samples are folded in
here; writers keep the table current (``edo_monitor.store.engine.roll_up``).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

#: frozen copy of the columns this revision summarises (schema.ROLLUP_FIELDS at version 2)
FIELDS = (
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
)
FLOATS = {"fragmentation", "free_fraction"}
WIDTHS_S = (16, 256, 4096)


def upgrade() -> None:
    """Create ``sample_rollups``, fold in the existing samples, record schema version 2."""
    cols: list[sa.Column] = []
    for f in FIELDS:
        kind = sa.Float if f in FLOATS else BIG
        cols += [
            sa.Column(f"{f}_min", kind),
            sa.Column(f"{f}_max", kind),
            sa.Column(f"{f}_sum", sa.Float),
            sa.Column(f"{f}_n", sa.Integer, nullable=False, server_default="0"),
        ]
    op.create_table(
        "sample_rollups",
        sa.Column(
            "run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("level", sa.Integer, nullable=False),
        sa.Column("block", sa.Integer, nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("time_min_s", sa.Float, nullable=False),
        sa.Column("time_max_s", sa.Float, nullable=False),
        *cols,
        sa.PrimaryKeyConstraint("run_id", "level", "block", name="pk_sample_rollups"),
        sqlite_with_rowid=False,
    )
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        from edo_monitor.store.rollups import roll_up

        roll_up(bind, fields=FIELDS, widths_s=WIDTHS_S)
    op.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")


def downgrade() -> None:
    """Drop ``sample_rollups`` and the rollup mark; back to schema version 1."""
    op.drop_table("sample_rollups")
    op.execute("DELETE FROM meta WHERE key = 'rollup_through_id'")
    op.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
