"""Schema version 6: multi-rank jobs (issue 13, item 1).

A ``jobs`` table (one row per ``torch.distributed`` job: its id, name, world size, backend and
where the id came from) and four ``runs`` columns, the run's place in its job: ``job_id``
(indexed), ``rank``, ``world_size``, ``local_rank``. Older runs read ``NULL`` (not in a process
group). The columns are added with plain ``ALTER TABLE ... ADD COLUMN``, without a foreign key:
on SQLite a foreign key would need a batch rebuild of ``runs``, whose ``DROP TABLE`` with
foreign keys on cascades into every sample, event and module row.

Revision ID: 0006
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0004"
branch_labels = None
depends_on = None

BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Create ``jobs``, add the rank columns to ``runs``; schema 6."""
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(100), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("world_size", BIG, nullable=False),
        sa.Column("backend", sa.String(32)),
        sa.Column("id_source", sa.String(32), nullable=False),
        sa.Column("created_at_s", sa.Float, nullable=False),
    )
    op.create_index("ix_jobs_created_at_s", "jobs", ["created_at_s"])
    op.add_column("runs", sa.Column("job_id", sa.String(100)))
    op.add_column("runs", sa.Column("rank", BIG))
    op.add_column("runs", sa.Column("world_size", BIG))
    op.add_column("runs", sa.Column("local_rank", BIG))
    op.create_index("ix_runs_job_id", "runs", ["job_id"])
    op.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")


def downgrade() -> None:
    """Drop the rank columns and ``jobs``; back to schema version 4."""
    op.drop_index("ix_runs_job_id", "runs")
    with op.batch_alter_table("runs") as batch:
        for name in ("local_rank", "world_size", "rank", "job_id"):
            batch.drop_column(name)
    op.drop_index("ix_jobs_created_at_s", "jobs")
    op.drop_table("jobs")
    op.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
