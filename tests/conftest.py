"""Shared fixtures: the shared data folder, temporary history databases (SQLite files, fresh
PostgreSQL schemas)."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# The CLI's tables take their width from COLUMNS (else the terminal's, else 200 when piped), and
# the tests read them as a pipe would: a width from the environment (a developer's shell, or
# pytest-xdist's workers, which set COLUMNS=80) wrapped their lines. Tests that want a width pass
# COLUMNS themselves.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


def _find_data_dir() -> Path | None:
    env = os.environ.get("EDO_DATA_DIR")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [parent / "shared" / "data" for parent in here.parents]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    return None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared data folder (``../shared/data`` beside the checkout, or ``$EDO_DATA_DIR``)."""
    found = _find_data_dir()
    if found is None:
        pytest.skip(
            "shared data folder not found (set EDO_DATA_DIR or put shared/data beside the checkout)"
        )
    return found


@pytest.fixture(scope="session")
def shakespeare_path(data_dir: Path) -> Path:
    """Tiny Shakespeare (``tinyshakespeare/input.txt``)."""
    path = data_dir / "tinyshakespeare" / "input.txt"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="session")
def movielens_dir(data_dir: Path) -> Path:
    """MovieLens small (``movielens-small/ratings.csv``)."""
    path = data_dir / "movielens-small"
    if not (path / "ratings.csv").is_file():
        pytest.skip(f"{path / 'ratings.csv'} is missing")
    return path


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A history database path in a fresh temporary folder (not created yet)."""
    return tmp_path / "history.db"


# -- PostgreSQL --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh, uniquely named PostgreSQL database for this test session (dropped at the end);
    its URL. Skips, with the reason, when psycopg is missing or no server is reachable."""
    try:
        import psycopg
    except ImportError:
        pytest.skip("psycopg is not installed (pip install 'edo-monitor[postgres]')")
    from pg_admin import AdminConnection, fresh_database, server_url
    from sqlalchemy.engine import make_url

    server = make_url(server_url())
    dsn = server.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        admin = AdminConnection(dsn)
    except psycopg.Error as exc:
        pytest.skip(f"no PostgreSQL server reachable at {server!r}: {exc}".strip())
    with fresh_database(admin) as name:  # dropped even if the admin connection was terminated
        yield server.set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def pg_url(pg_database: str) -> Iterator[str]:
    """A PostgreSQL URL whose tables live in a schema of their own, fresh for this test
    (``search_path`` set through the URL's ``options``), dropped after it."""
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(pg_database)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    yield url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def history_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A history database that does not exist yet: an SQLite file path, then a fresh
    PostgreSQL schema (tests using it run on both backends)."""
    if request.param == "sqlite":
        return str(tmp_path / "history.db")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    """SIGTERM's default action for the test (a watched run installs its handler only over the
    default one), and the handler before it put back after."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
