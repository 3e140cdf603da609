"""Schema version 3: host memory as the process can use it, and its process tree.

Two ``samples`` columns (and their ``sample_rollups`` summaries):

* ``host_limit_bytes`` — the smaller of the machine's total memory and the process's cgroup limit
  (a container's memory limit);
* ``process_tree_bytes`` — PSS of the process and its descendants (forking DataLoader workers),
  shared pages counted once.

Older samples read ``NULL`` in both (not measured). Existing rollup blocks get the summary of "no
values": ``min``/``max`` ``NULL``, ``sum`` 0, ``n`` 0, so later samples fold into them as usual.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

#: the sample columns this revision adds (appended to schema.ROLLUP_FIELDS at version 3)
FIELDS = ("host_limit_bytes", "process_tree_bytes")


def upgrade() -> None:
    """Add the columns to ``samples`` and ``sample_rollups``; record schema version 3."""
    with op.batch_alter_table("samples") as batch:
        for f in FIELDS:
            batch.add_column(sa.Column(f, BIG))
    with op.batch_alter_table("sample_rollups") as batch:
        for f in FIELDS:
            batch.add_column(sa.Column(f"{f}_min", BIG))
            batch.add_column(sa.Column(f"{f}_max", BIG))
            batch.add_column(sa.Column(f"{f}_sum", sa.Float, server_default="0"))
            batch.add_column(sa.Column(f"{f}_n", sa.Integer, nullable=False, server_default="0"))
    op.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")


def downgrade() -> None:
    """Drop the columns; back to schema version 2."""
    with op.batch_alter_table("sample_rollups") as batch:
        for f in FIELDS:
            for suffix in ("_min", "_max", "_sum", "_n"):
                batch.drop_column(f"{f}{suffix}")
    with op.batch_alter_table("samples") as batch:
        for f in FIELDS:
            batch.drop_column(f)
    op.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
