"""A fresh PostgreSQL database for the test session (the ``pg_database`` fixture of conftest.py).

The database is made and dropped through one administrator connection to the server's own
database. That connection sits idle for the whole session, so an administrator (or a test) may
terminate it meanwhile (``pg_terminate_backend``): every statement on it is tried once more on a
new connection when the old one turns out closed, so the ``DROP DATABASE`` at the end still runs
and no database is left behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The server the ``postgres`` tests use (trust auth); ``EDO_TEST_PG_URL`` overrides it.
PG_SERVER_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def server_url() -> str:
    """The SQLAlchemy URL of the test server (``EDO_TEST_PG_URL`` or :data:`PG_SERVER_URL`)."""
    return os.environ.get("EDO_TEST_PG_URL") or PG_SERVER_URL


class AdminConnection:
    """An autocommit psycopg connection to ``dsn`` that is re-made when the server closed it.

    Args:
        dsn: a libpq connection string or ``postgresql://`` URL (no SQLAlchemy driver name).
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.reconnects = 0
        self._conn: Any = None
        self._conn = self._connect()

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=3)

    @property
    def backend_pid(self) -> int:
        """The server process of the current connection (for ``pg_terminate_backend``)."""
        return int(self._conn.info.backend_pid)

    def execute(self, sql: str) -> None:
        """Run ``sql``; once more on a new connection when the current one was closed.

        Raises:
            psycopg.Error: the statement failed for another reason, or failed again.
        """
        import psycopg

        try:
            self._conn.execute(sql)
        except psycopg.OperationalError:
            if not self._conn.closed:  # the server answered: not a lost connection
                raise
            self._conn = self._connect()
            self.reconnects += 1
            self._conn.execute(sql)

    def close(self) -> None:
        """Close the connection (quietly when it is already gone)."""
        self._conn.close()


@contextmanager
def fresh_database(admin: AdminConnection) -> Iterator[str]:
    """Create a uniquely named database through ``admin``; yield its name; drop it after (and
    close ``admin``), re-making the connection if the server closed it meanwhile."""
    name = f"edo_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield name
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()
