"""Files the CLI writes where the user says (``export --out``, ``snapshot --out`` and
``--html``): checked before anything is read, never the history database or one of its companion
files, and written through a temporary file beside the target renamed into place (a reader sees
the old file or the whole new one, never half of one)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edo_monitor.errors import ConfigError, EdoMonitorError

__all__ = ["OutputFile", "open_output", "output_target", "write_output"]


@dataclass(frozen=True)
class OutputFile:
    """A file the user named for a command to write: ``path`` with links resolved (checked by
    :func:`output_target`) and ``shown`` as the user typed it (what messages name)."""

    path: Path
    shown: str


def output_target(path: Path, db: str | None, option: str) -> OutputFile:
    """The file ``path`` (given as ``option``, e.g. ``"--out"``) names, links resolved. Call it
    before the history is opened: a reader changes a WAL database's ``-shm`` file.

    Raises:
        ConfigError: ``path`` is a folder, its folder does not exist, or it is the SQLite history
            database ``db`` (resolved as every command resolves ``--db``/``EDO_DB``) or one of its
            ``-wal``, ``-shm`` and ``-journal`` files, by name, through a link or as a hard link
            (overwriting the ``-wal`` of a database whose last transactions are still in it
            loses them).
    """
    from edo_monitor.store.paths import resolve_db_url

    target = Path(os.path.realpath(path))
    shown = str(path)
    if target.is_dir():
        raise ConfigError(f"{option} {shown!r} is a directory; expected a file path")
    if not target.parent.is_dir():
        raise ConfigError(f"{option} {shown!r}: folder {str(target.parent)!r} does not exist")
    url = resolve_db_url(db, readonly=True)
    database = url.database if url.get_backend_name() == "sqlite" else None
    if database and database != ":memory:":
        base = os.path.realpath(database)
        for suffix in ("", "-wal", "-shm", "-journal"):
            protected = base + suffix
            same = str(target) == protected
            if not same and target.exists() and os.path.exists(protected):
                same = os.path.samefile(target, protected)  # hard links
            if same:
                what = " itself" if not suffix else f"'s {suffix} file"
                raise ConfigError(
                    f"{option} {shown!r} is the history database{what} ({protected}); choose "
                    "another file"
                )
    return OutputFile(target, shown)


@contextmanager
def open_output(out: OutputFile, *, binary: bool = False) -> Iterator[IO[Any]]:
    """A stream into a temporary file beside ``out.path``; when the block ends without an error
    the file gets the mode a new file would have and is renamed over ``out.path``; otherwise it
    is removed and ``out.path`` is left as it was.

    Raises:
        EdoMonitorError: the folder or the file cannot be written (read-only, no permission, a
            full disk; any ``OSError`` inside the block): one line naming ``shown`` (what the
            user typed) and the system's reason, not the temporary file's name.
    """
    target = out.path
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise _cannot_write(out.shown, exc) from None
    tmp = Path(tmp_name)
    done = False
    try:
        if binary:
            stream: IO[Any] = os.fdopen(fd, "wb")
        else:
            stream = os.fdopen(fd, "w", newline="", encoding="utf-8")
        with stream:
            yield stream
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as open() would make it (mkstemp makes 0600)
        os.replace(tmp, target)
        done = True
    except OSError as exc:  # the block's writes, the mode, the rename
        raise _cannot_write(out.shown, exc) from None
    finally:
        if not done:
            tmp.unlink(missing_ok=True)


def write_output(out: OutputFile, data: bytes) -> None:
    """Write ``data`` to ``out`` through :func:`open_output` (the same errors)."""
    with open_output(out, binary=True) as f:
        f.write(data)


def _cannot_write(shown: str, exc: OSError) -> EdoMonitorError:
    reason = exc.strerror or type(exc).__name__
    return EdoMonitorError(f"cannot write {shown!r}: {reason}")
