"""The disk tier's file names, without torch (issue 24, item 4): which folder a run spills to,
a crashed run's leftover files and the lines that report them (``watch``'s start, ``edo-monitor
doctor``, which must not import torch). The file itself: :mod:`edo_monitor.nn.spill`.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "SPILL_PREFIX",
    "doctor_spill_lines",
    "leftover_spill_files",
    "leftover_words",
    "report_leftovers",
    "resolve_spill_dir",
]

logger = logging.getLogger(__name__)

SPILL_PREFIX = "edo-spill-"
_NAME = re.compile(rf"^{SPILL_PREFIX}(\d+)-[0-9a-f]+\.bin$")


def leftover_spill_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Spill files in ``folder`` whose process no longer runs (a crashed run's leftovers)."""
    p = Path(folder)
    if not p.is_dir():
        return []
    out = []
    for f in sorted(p.iterdir()):
        m = _NAME.match(f.name)
        if m and not psutil.pid_exists(int(m.group(1))):
            out.append(f)
    return out


def leftover_words(path: Path) -> str:
    """One line naming a crashed run's leftover ``path``, its size and how to free it."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return (
        f"leftover spill file {path} ({size} bytes) of a run that ended without removing it "
        "(a crash); delete it to free the disk"
    )


def resolve_spill_dir(spill_dir: str | os.PathLike[str] | None, db_url: Any) -> Path:
    """The disk tier's folder of a run: ``spill_dir`` as given, else ``<history file>.spill``
    beside an SQLite history, else ``<temp dir>/edo-spill`` (a server database, in memory).

    Raises:
        ConfigError: ``spill_dir`` is not a path (str or ``os.PathLike``), is empty, or names
            something that exists and is not a folder.
    """
    from edo_monitor.errors import ConfigError
    from edo_monitor.store.paths import database_file

    if spill_dir is None:
        db_file = database_file(db_url) if db_url is not None else None
        if db_file is not None:
            return Path(f"{db_file}.spill")
        return Path(tempfile.gettempdir()) / "edo-spill"
    if isinstance(spill_dir, bool) or not isinstance(spill_dir, str | os.PathLike):
        raise ConfigError(f"spill_dir={spill_dir!r} must be a folder path (str or os.PathLike)")
    if not os.fspath(spill_dir):
        raise ConfigError("spill_dir='' is empty; expected a folder path")
    path = Path(spill_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"spill_dir={os.fspath(spill_dir)!r} exists and is not a folder")
    return path


def report_leftovers(folder: str | os.PathLike[str], emit: Callable[..., Any]) -> list[Path]:
    """At a run's start: a warning and ``emit("spill_leftover", message, data)`` for each
    leftover spill file of a dead process in ``folder`` (see :func:`leftover_spill_files`)."""
    found = leftover_spill_files(folder)
    for path in found:
        words = leftover_words(path)
        logger.warning("%s", words)
        emit("spill_leftover", words, {"path": str(path)})
    return found


def doctor_spill_lines(db_url: Any) -> list[str]:
    """``edo-monitor doctor``'s lines: each leftover spill file in the default spill folder of
    the history ``db_url`` (:func:`resolve_spill_dir`), named with its size."""
    return [leftover_words(p) for p in leftover_spill_files(resolve_spill_dir(None, db_url))]
