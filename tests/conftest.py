"""Shared fixtures: the shared data folder, temporary history databases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


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
