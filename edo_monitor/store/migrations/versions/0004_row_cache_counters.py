"""Schema version 4: row-cache counters (issue 12, item 5).

Six ``samples`` columns (and their ``sample_rollups`` summaries), summed over the run's cached
tables since the previous sample, and the same six in ``module_stats``, a cached table's totals
since it was cached (see :data:`edo_monitor.store.schema.CACHE_FIELDS`): ``cache_rows``,
``cache_lookups``, ``cache_lookup_hits``, ``cache_rows_loaded``, ``cache_rows_evicted``,
``cache_moved_bytes``.

Older rows read ``NULL`` (no cache, or not recorded). Existing rollup blocks get the summary of
"no values": ``min``/``max`` ``NULL``, ``sum`` 0, ``n`` 0, so later samples fold into them.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

#: the columns this revision adds (schema.CACHE_FIELDS at version 4; written out, as a revision
#: must not change when the code does)
FIELDS = (
    "cache_rows",
    "cache_lookups",
    "cache_lookup_hits",
    "cache_rows_loaded",
    "cache_rows_evicted",
    "cache_moved_bytes",
)


def upgrade() -> None:
    """Add the columns to ``samples``, ``sample_rollups`` and ``module_stats``; schema 4."""
    with op.batch_alter_table("samples") as batch:
        for f in FIELDS:
            batch.add_column(sa.Column(f, BIG))
    with op.batch_alter_table("sample_rollups") as batch:
        for f in FIELDS:
            batch.add_column(sa.Column(f"{f}_min", BIG))
            batch.add_column(sa.Column(f"{f}_max", BIG))
            batch.add_column(sa.Column(f"{f}_sum", sa.Float, server_default="0"))
            batch.add_column(sa.Column(f"{f}_n", sa.Integer, nullable=False, server_default="0"))
    with op.batch_alter_table("module_stats") as batch:
        for f in FIELDS:
            batch.add_column(sa.Column(f, BIG))
    op.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")


def downgrade() -> None:
    """Drop the columns; back to schema version 3."""
    with op.batch_alter_table("module_stats") as batch:
        for f in FIELDS:
            batch.drop_column(f)
    with op.batch_alter_table("sample_rollups") as batch:
        for f in FIELDS:
            for suffix in ("_min", "_max", "_sum", "_n"):
                batch.drop_column(f"{f}{suffix}")
    with op.batch_alter_table("samples") as batch:
        for f in FIELDS:
            batch.drop_column(f)
    op.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
