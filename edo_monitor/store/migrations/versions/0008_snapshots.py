"""Schema version 8: memory snapshots of incidents (``watch(snapshots=True)``).

* ``snapshots`` — one memory snapshot in the format of ``torch.cuda.memory._snapshot()``,
  compressed, taken at an incident (an OOM, a crossing below the floor, before / after an
  action) and linked to its event (``event_id``, ``CASCADE``) and run (``run_id``, ``CASCADE``).

Nothing existing changes; older databases get the empty table.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Create ``snapshots`` and its indexes; record schema version 8."""
    op.create_table(
        "snapshots",
        sa.Column("id", BIG, primary_key=True, autoincrement=True),
        sa.Column("run_id", BIG, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("time_s", sa.Float, nullable=False),
        sa.Column("step", BIG, nullable=False),
        sa.Column("event_id", BIG, sa.ForeignKey("events.id", ondelete="CASCADE")),
        sa.Column("phase", sa.String(16), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("encoding", sa.String(32), nullable=False),
        sa.Column("raw_bytes", BIG, nullable=False),
        sa.Column("stored_bytes", BIG, nullable=False),
        sa.Column("allocated_bytes", BIG),
        sa.Column("reserved_bytes", BIG),
        sa.Column("blob", sa.LargeBinary, nullable=False),
    )
    op.create_index("ix_snapshots_run_id", "snapshots", ["run_id"])
    op.create_index("ix_snapshots_event_id", "snapshots", ["event_id"])
    op.execute("UPDATE meta SET value = '8' WHERE key = 'schema_version'")


def downgrade() -> None:
    """Drop ``snapshots``; back to schema version 7."""
    op.drop_table("snapshots")
    op.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
