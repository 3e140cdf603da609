"""Files written where the user says (``edo-monitor export --out``, ``snapshot --out`` and
``--html``, the screenshot tool's ``--out``, the dashboard's CSV export): checked before
anything is read, never the history database or one of its companion files, and written through
a temporary file beside the target renamed into place (a reader sees the old file or the whole
new one, never half of one)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edo_monitor.errors import ConfigError, EdoMonitorError
from edo_monitor.store.paths import COMPANION_SUFFIXES

__all__ = ["OutputFile", "open_output", "output_target", "write_output"]


@dataclass(frozen=True)
class OutputFile:
    """A file the user named for a command to write: ``path`` with links resolved (checked by
    :func:`output_target`) and ``shown`` as the user typed it (what messages name)."""

    path: Path
    shown: str


def output_target(path: str | os.PathLike[str], db: str | None, option: str) -> OutputFile:
    """The file ``path`` (given as ``option``, e.g. ``"--out"``) names, links resolved. Call it
    before the history is opened: a reader changes a WAL database's ``-shm`` file.

    Every file written where the user says goes through here (the CLI's ``export --out``,
    ``snapshot --out``/``--html``, the screenshot tool's ``--out``, the dashboard's export).

    Raises:
        ConfigError: ``path`` is a folder, its folder does not exist, or it is the SQLite history
            database ``db`` (resolved as every command resolves ``--db``/``EDO_DB``) or one of its
            ``-wal``, ``-shm`` and ``-journal`` files, by name, through a link or as a hard link
            (overwriting the ``-wal`` of a database whose last transactions are still in it
            loses them). A ``db`` that cannot be opened as given (a missing folder, a
            companion file named as the database) still has its file protected; the command
            says what is wrong with it when it opens it.
    """
    target = Path(os.path.realpath(path))
    shown = os.fspath(path)
    if target.is_dir():
        raise ConfigError(f"{option} {shown!r} is a directory; expected a file path")
    if not target.parent.is_dir():
        raise ConfigError(f"{option} {shown!r}: folder {str(target.parent)!r} does not exist")
    for database in _database_paths(db):
        base = os.path.realpath(database)
        for suffix in ("", *COMPANION_SUFFIXES):
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


def _database_paths(db: str | os.PathLike[str] | None) -> list[Path]:
    """The SQLite file the history ``db`` names (none for a server or an in-memory database),
    and the database of a companion file when ``db`` names one (``x.db-wal``: ``x.db`` too)."""
    from sqlalchemy.engine import make_url

    from edo_monitor.store.paths import DEFAULT_DB, database_file, resolve_db_url

    try:
        path = database_file(resolve_db_url(db, readonly=True))
    except EdoMonitorError:  # not usable as given: its file, if it names one, is still kept
        text = os.fspath(db) if db is not None else os.environ.get("EDO_DB") or DEFAULT_DB
        if "://" not in text:
            path = Path(text).expanduser()
        else:
            try:
                url = make_url(text)
            except Exception:  # not a URL at all: no file
                return []
            if url.get_backend_name() != "sqlite" or not url.database:
                return []  # a server's database is no file here
            path = Path(url.database).expanduser()
    if path is None:
        return []
    paths = [path]
    for suffix in COMPANION_SUFFIXES:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            paths.append(path.with_name(path.name[: -len(suffix)]))
    return paths


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
