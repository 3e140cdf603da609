"""Files written where the user says (``edo-monitor export --out``, ``snapshot --out`` and
``--html``, the screenshot tool's ``--out``, the dashboard's CSV export): checked before
anything is read, never the history database or one of its companion files. A regular file (or
a new one) is written through a temporary file beside the target renamed into place (a reader
sees the old file or the whole new one, never half of one); a FIFO, a character device
(``/dev/null``, a terminal) or a file descriptor's path (``/dev/stdout``, ``/dev/fd/3``) is
written in place, as a shell's ``>`` writes it, never replaced by a regular file."""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edo_monitor.errors import ConfigError, EdoMonitorError
from edo_monitor.store.paths import COMPANION_SUFFIXES, _short, path_too_long

__all__ = ["OutputFile", "open_output", "output_target", "write_output"]

logger = logging.getLogger(__name__)

#: A process's folder of open file descriptors (``/dev/fd`` and ``/dev/stdout`` lead there).
_PROC_FD = re.compile(r"/proc/(?:self|thread-self|\d+)(?:/task/\d+)?/fd")

#: The longest part of the target's name put into the temporary file's name (``.NAME.XXXX.tmp``
#: must fit the file system's name limit, 255 characters, where ``NAME`` itself fits).
_TMP_NAME_CHARS = 100


@dataclass(frozen=True)
class OutputFile:
    """A file the user named for a command to write: ``path`` with links resolved (checked by
    :func:`output_target`) and ``shown`` as the user typed it (what messages name).

    ``in_place``: the target is a FIFO, a character device or a file descriptor's path, written
    in place (``path`` is then the path as typed: ``/dev/stdout`` resolves to no file when
    standard output is a pipe)."""

    path: Path
    shown: str
    in_place: bool = False


def output_target(path: str | os.PathLike[str], db: str | None, option: str) -> OutputFile:
    """The file ``path`` (given as ``option``, e.g. ``"--out"``) names, links resolved. Call it
    before the history is opened: a reader changes a WAL database's ``-shm`` file.

    Every file written where the user says goes through here (the CLI's ``export --out``,
    ``snapshot --out``/``--html``, the screenshot tool's ``--out``, the dashboard's export).

    What is already there decides how it is written (:func:`open_output`): a regular file is
    replaced whole (a temporary file renamed over it); a FIFO, a character device (``/dev/null``,
    ``/dev/tty``) or a path that leads to a file descriptor of a process (``/dev/stdout``,
    ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``, whatever that descriptor is: a pipe, a
    terminal or a regular file) is opened and written in place, truncated as a shell's ``>``
    does, and is never replaced by a regular file (as root, ``--out /dev/null`` made
    ``/dev/null`` a regular file). A socket and a block device are refused: a socket cannot be
    opened as a file, and writing an export over a disk is never what was meant.

    Raises:
        ConfigError: ``path`` is empty, holds a NUL character, is too long for its file system
            (a name or the whole path), is a folder, a socket or a block device, its folder does
            not exist, or it is the SQLite history database ``db`` (resolved as every command
            resolves ``--db``/``EDO_DB``) or one of its ``-wal``, ``-shm`` and ``-journal``
            files, by name, through a link or as a hard link (overwriting the ``-wal`` of a
            database whose last transactions are still in it loses them). A ``db`` that cannot
            be opened as given (a missing folder, a companion file named as the database)
            still has its file protected; the command says what is wrong with it when it opens
            it.
        EdoMonitorError: the path cannot be looked at (a folder in it without permission): one
            line naming it and the system's reason.
    """
    shown = os.fspath(path)
    if not shown:
        raise ConfigError(f"{option} '' is empty; expected a file path")
    if "\0" in shown:
        raise ConfigError(
            f"{option} {_short(shown)!r} holds a NUL character (\\0); expected a file path "
            "without one"
        )
    try:
        mode: int | None = os.stat(shown).st_mode
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise ConfigError(
                f"{option} {_short(shown)!r}: the path is too long "
                f"({path_too_long(Path(os.path.abspath(shown)))})"
            ) from None
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{option} {shown!r}: too many levels of symbolic links; expected a file path"
            ) from None
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):  # a new file: checked below
            raise _cannot_write(shown, exc) from None
        mode = None
    target = Path(os.path.realpath(shown))
    if mode is not None and stat.S_ISDIR(mode):
        raise ConfigError(f"{option} {shown!r} is a directory; expected a file path")
    if mode is not None and (stat.S_ISSOCK(mode) or stat.S_ISBLK(mode)):
        kind = "a socket" if stat.S_ISSOCK(mode) else "a block device (a disk)"
        raise ConfigError(
            f"{option} {shown!r} is {kind}; expected a regular file, a FIFO or a character "
            "device such as /dev/null or /dev/stdout"
        )
    in_place = mode is not None and (not stat.S_ISREG(mode) or _leads_to_descriptor(shown))
    if not in_place and not target.parent.is_dir():
        raise ConfigError(f"{option} {shown!r}: folder {str(target.parent)!r} does not exist")
    for database in _database_paths(db):
        base = os.path.realpath(database)
        for suffix in ("", *COMPANION_SUFFIXES):
            protected = base + suffix
            same = str(target) == protected
            if not same and mode is not None and os.path.exists(protected):
                same = os.path.samefile(shown, protected)  # hard links, descriptors
            if same:
                what = " itself" if not suffix else f"'s {suffix} file"
                raise ConfigError(
                    f"{option} {shown!r} is the history database{what} ({protected}); choose "
                    "another file"
                )
    if in_place:
        return OutputFile(Path(shown), shown, in_place=True)
    return OutputFile(target, shown)


def _leads_to_descriptor(path: str) -> bool:
    """Whether ``path`` or a link on the way to its file is an entry of a process's
    ``/proc/PID/fd`` folder (``/dev/stdout`` is a link to ``/proc/self/fd/1``): such a path is
    an open file descriptor, whose file the process that holds it writes (replacing a regular
    file it names would leave that process writing into a file with no name)."""
    current = os.path.abspath(path)
    for _ in range(40):  # the system's own limit on links followed
        folder = os.path.realpath(os.path.dirname(current))
        if _PROC_FD.fullmatch(folder):
            return True
        entry = os.path.join(folder, os.path.basename(current))
        if not os.path.islink(entry):
            return False
        current = os.path.abspath(os.path.join(folder, os.readlink(entry)))
    return False


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

    A target written in place (``out.in_place``: a FIFO, a character device, a file
    descriptor's path; see :func:`output_target`) is opened as a shell's ``>`` opens it (write
    only, truncated; a FIFO waits for its reader) and written directly: no temporary file, no
    rename, and what the block wrote before an error stays written.

    Raises:
        EdoMonitorError: the folder or the file cannot be written (read-only, no permission, a
            full disk; any ``OSError`` inside the block): one line naming ``shown`` (what the
            user typed) and the system's reason, not the temporary file's name.
        BrokenPipeError: (in place) the reader of a FIFO or pipe went away; the CLI exits 0,
            as when the reader of its standard output goes away.
    """
    if out.in_place:
        with _open_in_place(out, binary=binary) as stream:
            yield stream
        return
    target = out.path
    try:
        fd, tmp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name[:_TMP_NAME_CHARS]}.", suffix=".tmp"
        )
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


@contextmanager
def _open_in_place(out: OutputFile, *, binary: bool) -> Iterator[IO[Any]]:
    """:func:`open_output` of a target written in place (the same errors)."""
    try:
        if binary:
            stream: IO[Any] = open(out.path, "wb")  # noqa: SIM115 (closed below)
        else:
            stream = open(out.path, "w", newline="", encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise _cannot_write(out.shown, exc) from None
    logger.debug("writing %r in place (not a regular file)", out.shown)
    try:
        with stream:
            yield stream
    except BrokenPipeError:  # the reader of the pipe went away: as when stdout's reader does
        raise
    except OSError as exc:  # the block's writes, the last flush
        raise _cannot_write(out.shown, exc) from None


def write_output(out: OutputFile, data: bytes) -> None:
    """Write ``data`` to ``out`` through :func:`open_output` (the same errors)."""
    with open_output(out, binary=True) as f:
        f.write(data)


def _cannot_write(shown: str, exc: OSError) -> EdoMonitorError:
    reason = exc.strerror or type(exc).__name__
    return EdoMonitorError(f"cannot write {shown!r}: {reason}")
