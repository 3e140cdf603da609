"""Alembic environment for the history database.

Built for :func:`edo_monitor.store.engine.alembic_config`: the migrations run on the connection
passed in ``config.attributes["connection"]`` (inside its transaction), or on a connection to
``sqlalchemy.url``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

config = context.config


def _run(connection: object) -> None:
    context.configure(connection=connection, target_metadata=None, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the revisions on the given connection, or on a new one to ``sqlalchemy.url``."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"), literal_binds=True, target_metadata=None
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
