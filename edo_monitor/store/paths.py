"""Where a history is: a path, URL or EDO_DB resolved to a URL; the file checked (missing,
unwritable, not a regular file); SQLite's read-only URIs."""

from __future__ import annotations

import errno
import logging
import os
import re
import sqlite3
import stat
from pathlib import Path
from urllib.parse import quote, unquote

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from edo_monitor.errors import ConfigError, StoreError

logger = logging.getLogger(__name__)


DEFAULT_DB = "edo-history.db"


#: How long a SQLite connection waits for a lock before giving up (seconds).
BUSY_TIMEOUT_S = 30.0

#: The files SQLite keeps beside a database ``NAME``: ``NAME-wal``, ``NAME-shm``, ``NAME-journal``.
COMPANION_SUFFIXES = {
    "-wal": "write-ahead log",
    "-shm": "WAL shared-memory index",
    "-journal": "rollback journal",
}


def resolve_db_url(db: str | os.PathLike[str] | None = None, *, readonly: bool = False) -> URL:
    """Turn ``db`` (path, URL or ``None``) into an SQLAlchemy URL.

    Args:
        db: a path, an SQLAlchemy URL, or ``None``.
        readonly: for a reader, whose missing folder is a missing database (``StoreError``, as
            a missing file) rather than a bad value.

    Raises:
        ConfigError: ``db`` is neither a string nor a path, the URL's scheme names no installed
            SQLAlchemy dialect, the string is not a URL, the path is a directory, or (writers)
            its folder does not exist.
        StoreError: (readers) the path's folder does not exist, or the URL is an in-memory
            SQLite database (no history can be there).

    An SQLite file's path comes back absolute (:func:`absolute_url`): what is opened later
    does not depend on the working folder.
    """
    if db is None:
        db = os.environ.get("EDO_DB") or DEFAULT_DB
    text_ = os.fspath(db) if isinstance(db, str | os.PathLike) else None
    if not isinstance(text_, str):
        raise ConfigError(
            f"db={db!r} is not a path or URL (got {type(db).__name__}); expected a file path "
            "(str or os.PathLike of str) or an SQLAlchemy URL string"
        )
    if not text_:
        raise ConfigError("db='' is empty; expected a file path or an SQLAlchemy URL")
    if "://" in text_:
        try:
            url = make_url(text_)
            url.get_dialect()
        except (ArgumentError, NoSuchModuleError, ValueError) as exc:
            raise ConfigError(
                f"db={masked_url(text_)!r} is not a usable database URL ({masked_url(str(exc))}); "
                "expected a file path or an "
                "SQLAlchemy URL such as 'sqlite:///runs.db' or 'postgresql://host/db'"
            ) from None
        if readonly and url.get_backend_name() == "sqlite" and _is_memory(url):
            # a new, empty database: doctor said "ok", runs "no runs recorded" (exit 0)
            raise StoreError(
                f"no history database at {text_!r}: an in-memory SQLite database holds no "
                "recorded runs; give the history's file path or URL"
            )
        if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
            _check_file_path(Path(url.database), text_, readonly)
        return absolute_url(url)
    path = Path(text_).expanduser()
    _check_file_path(path, text_, readonly)
    return absolute_url(URL.create("sqlite", database=str(path)))


_PASSWORD_IN_URL = re.compile(r"(://[^/@?#]*?:)[^/@?#]*@")
_PASSWORD_PARAMETER = re.compile(r"((?:^|[?&])password=)[^&#\s'\"]*", re.IGNORECASE)


def masked_url(text: str) -> str:
    """``text`` (a database URL, or a message holding one) with its password shown as ``***``:
    ``user:***@host`` and ``?password=***``, as SQLAlchemy's ``render_as_string(
    hide_password=True)`` shows a URL it parsed. For text it could not parse (an unknown scheme,
    a port that is not a number), which every other message already masked."""
    return _PASSWORD_PARAMETER.sub(r"\1***", _PASSWORD_IN_URL.sub(r"\1***@", text))


def shown_url(url: URL) -> str:
    """``url`` as messages and events show it: its password (in the URL or as a ``password``
    parameter) as ``***``."""
    return masked_url(url.render_as_string(hide_password=True))


def shown_database(url: URL) -> str:
    """The history as a user names it: an SQLite file's path (``url.database``, ``:memory:``
    too: the URL's string percent-encodes characters such as ``ü`` and ``:``), else
    :func:`shown_url`."""
    if url.get_backend_name() == "sqlite" and url.database:
        return url.database
    return shown_url(url)


def absolute_url(url: URL) -> URL:
    """``url`` with an SQLite file's relative path made absolute against the working folder
    now; other URLs (and in-memory SQLite) unchanged.

    Resolved once, where a history is opened: a program that changes its working folder later
    (an output folder per run) would otherwise have its writer stat, reconnect to and create
    a different file, and count every row after the change as not written ("the file was
    deleted"). The path is not normalised (``..`` and symbolic links mean what they meant).
    A URI filename (``file:NAME?...``) keeps its parameters.
    """
    if url.get_backend_name() != "sqlite" or _is_memory(url):
        return url
    database = url.database or ""
    if _is_uri_filename(url):
        name, sep, query = database[5:].partition("?")
        if name.startswith("/"):
            return url
        absolute = quote(str(Path(unquote(name)).expanduser().absolute()))
        return url.set(database=f"file:{absolute}{sep}{query}")
    path = Path(database).expanduser()
    return url if path.is_absolute() else url.set(database=str(path.absolute()))


def database_file(url: URL) -> Path | None:
    """The file an SQLite URL writes to; ``None`` for other databases and in-memory ones."""
    if url.get_backend_name() != "sqlite" or _is_memory(url):
        return None
    database = url.database or ""
    if _is_uri_filename(url):
        database = database[5:].partition("?")[0]
    return Path(database).expanduser()


def _is_uri_filename(url: URL) -> bool:
    """Whether an SQLite URL's database is a URI filename (``file:NAME?...`` with ``?uri=true``,
    as SQLAlchemy's pysqlite dialect passes ``uri=True`` to ``sqlite3.connect``); without it a
    name beginning ``file:`` is a plain file's (the path ``file:x.db``), and reading it as a
    URI wrote ``./x.db`` and then looked for the folder ``file:/…``."""
    return (url.database or "").startswith("file:") and url.query.get("uri") == "true"


def _is_memory(url: URL) -> bool:
    if url.get_backend_name() != "sqlite":
        return False
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file::memory:"):
        return True
    return "mode=memory" in database or url.query.get("mode") == "memory"


def check_writable(url: URL) -> None:
    """Check, before a run starts, that a writer can record into ``url``.

    An in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``, ``mode=memory``) is
    refused: every connection (the agent's writer thread has its own) sees a different, empty
    database, and nothing could read it after the run. A file must be writable, and so must its
    folder (SQLite creates its ``-wal``, ``-shm`` and journal files there). Other databases are
    checked when the run starts.

    Raises:
        ConfigError: an in-memory SQLite URL.
        StoreError: the file or its folder is read-only (permissions or a read-only mount).
    """
    if _is_memory(url):
        raise ConfigError(
            f"db={shown_url(url)!r} is an in-memory SQLite database: "
            "the agent's writer thread would see a different, empty database and nothing could "
            "read it after the run; give a file path (e.g. db='runs.db')"
        )
    check_file_writable(url)


def check_file_writable(url: URL) -> None:
    """Check that a writer can write the SQLite file of ``url`` and its folder (SQLite creates
    its ``-wal``, ``-shm`` and journal files there); nothing for other databases. Every writable
    open does this (:func:`edo_monitor.store.engine.open_engine`), so ``prune`` and the agent
    say the same thing, not SQLite's bare "unable to open database file".

    Raises:
        ConfigError: the file is an SQLite companion file (:func:`check_not_companion`).
        StoreError: the file or its folder is read-only for this process (permissions or a
            read-only mount).
    """
    path = database_file(url)
    if path is None:
        return
    check_not_companion(path, str(path))  # a URL made elsewhere skipped resolve_db_url
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise StoreError(
            f"history database {str(path)!r} is read-only for this process; make it writable "
            "or give another database path (db=, --db)"
        )
    folder = path.parent if str(path.parent) else Path(".")
    if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise StoreError(
            f"folder {str(folder)!r} of history database {str(path)!r} is read-only for this "
            "process (SQLite writes its -wal and -shm files next to the database); give a "
            "database path (db=, --db) in a writable folder"
        )


#: Fallbacks of the path limits where the system does not say (Linux's PATH_MAX, NAME_MAX).
_PATH_MAX, _NAME_MAX = 4096, 255


def _short(shown: str, keep: int = 60) -> str:
    """``shown`` for a message: a path of 10,000 characters is cut in the middle."""
    return shown if len(shown) <= keep else f"{shown[: keep // 2]}…{shown[-keep // 2 :]}"


def path_too_long(path: Path) -> str:
    """Why the system answered "File name too long" for ``path``, in words: a name in it longer
    than the file system's limit, or the whole path longer than the system's."""
    path_max, name_max = _path_limits(path)
    longest = max((len(part) for part in path.parts), default=0)
    if longest > name_max:
        return (
            f"a name in it has {longest} characters, more than the {name_max} this file system "
            "allows"
        )
    return f"it has {len(os.fspath(path))} characters, more than the {path_max} this system allows"


def _path_limits(path: Path) -> tuple[int, int]:
    """(PATH_MAX, NAME_MAX) of the nearest existing folder above ``path``."""
    for folder in (*path.parents, Path(".")):
        try:
            return (
                int(os.pathconf(folder, "PC_PATH_MAX")),
                int(os.pathconf(folder, "PC_NAME_MAX")),
            )
        except (OSError, ValueError):
            continue
    return _PATH_MAX, _NAME_MAX


def check_not_companion(path: Path, shown: str) -> None:
    """Refuse ``path`` as a history database when it is the name of a file SQLite keeps beside
    another database (``NAME-wal``, ``NAME-shm``, ``NAME-journal``), whether or not ``NAME``
    exists or the file does.

    A database written into ``w.db-wal`` is lost the moment anything opens ``w.db``: SQLite
    takes that file for ``w.db``'s write-ahead log and replaces it (a daemon given the ``-wal``
    a reader left behind recorded for hours into it). Read as a database, a companion file is
    not one (its log or index format), and opening it makes companions of its own
    (``w.db-wal-shm``). Writers and readers alike refuse it, before SQLite sees it.

    Raises:
        ConfigError: naming the path, what the file is and the database it belongs to.
    """
    name = path.name
    for suffix, what in COMPANION_SUFFIXES.items():
        if name.endswith(suffix) and len(name) > len(suffix):
            base = path.with_name(name[: -len(suffix)])
            raise ConfigError(
                f"db={_short(shown, 300)!r} is the {suffix} file ({what}) of SQLite database "
                f"{_short(str(base), 300)!r}, not a history database: SQLite keeps that file for "
                f"{base.name!r} (whether or not it exists now) and overwrites or deletes it when "
                f"{base.name!r} is opened; give the database's own path (e.g. "
                f"{_short(str(base), 300)!r}) or a name that does not end in {suffix}"
            )


def _check_file_path(path: Path, shown: str, readonly: bool = False) -> None:
    """The one check of a history path, for readers and writers alike, before SQLite sees it.

    Raises:
        ConfigError: the path holds a NUL character, the path (or a name in it) is longer than
            the system allows, it is an SQLite companion file (:func:`check_not_companion`),
            or it names a directory, a FIFO, a socket or a device (SQLite would block forever
            on a FIFO).
        StoreError: (readers) its folder does not exist.
    """
    if "\0" in os.fspath(path):  # no file system allows one (os.stat raises ValueError)
        raise ConfigError(
            f"db={_short(shown)!r} holds a NUL character (\\0); expected a file path without one"
        )
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        raise ConfigError(
            f"db={_short(shown)!r}: the path is too long ({path_too_long(path)})"
        ) from None
    check_not_companion(path, shown)
    if mode is not None and stat.S_ISDIR(mode):
        raise ConfigError(f"db={shown!r} is a directory; expected a database file path")
    if mode is not None and not stat.S_ISREG(mode):
        kind = (
            "a FIFO (named pipe)"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file"
        )
        raise ConfigError(
            f"db={shown!r} is {kind}, not a regular file; expected a database file path"
        )
    if not path.parent.exists():
        if readonly:
            raise StoreError(
                f"no history database at {shown!r}: folder {str(path.parent)!r} does not exist"
            )
        raise ConfigError(f"db={shown!r}: folder {str(path.parent)!r} does not exist")


def readonly_uri(path: str | os.PathLike[str]) -> str:
    """The SQLite URI that opens the history file ``path`` for reading only.

    The absolute path is percent-encoded (``#``, ``?``, ``%``, spaces and non-ASCII characters
    round-trip exactly; ``mode=ro`` never creates the file). A database in WAL mode whose folder
    this process cannot write, and whose ``-shm`` file is missing, cannot be opened the usual way
    (SQLite must create the ``-shm`` file to read it): when it has no ``-wal`` data either (a
    finished run: everything is in the main file) it is opened ``immutable=1``, which needs
    neither file.

    Raises:
        ConfigError: the file is an SQLite companion file (:func:`check_not_companion`).
        StoreError: the file is missing or not readable, or it is a WAL database whose ``-wal``
            file holds data but whose ``-shm`` file is missing in a folder this process cannot
            write (the message names the folder and the file).
    """
    p = Path(os.path.abspath(os.fspath(path)))
    check_not_companion(p, str(path))
    if not p.exists():
        if not p.parent.is_dir():
            raise StoreError(
                f"no history database at {str(path)!r}: folder {str(p.parent)!r} does not exist"
            )
        raise StoreError(f"no history database at {str(path)!r} (nothing has been recorded yet)")
    if not os.access(p, os.R_OK):
        raise StoreError(f"cannot read history database {str(path)!r}: permission denied")
    if p.stat().st_size == 0:  # SQLite reads an empty file as an empty database: not a history
        raise StoreError(
            f"{str(path)!r} is not an edo-monitor history database: it is an empty file "
            "(0 bytes), with none of the history's tables"
        )
    uri = f"file:{quote(str(p))}?mode=ro"
    wal, shm = Path(f"{p}-wal"), Path(f"{p}-shm")
    if _is_wal(p) and not shm.exists() and not os.access(p.parent, os.W_OK | os.X_OK):
        wal_bytes = wal.stat().st_size if wal.exists() else 0
        if wal_bytes:
            raise StoreError(
                f"cannot read history database {str(path)!r}: {wal_bytes} bytes of its data are "
                f"still in {wal.name!r} (a run that did not close it), and SQLite must create "
                f"{shm.name!r} to read them, but folder {str(p.parent)!r} is not writable by this "
                "user; ask its owner to open it once (any edo-monitor command does), or copy the "
                "database with its -wal file to a folder you can write"
            )
        uri += "&immutable=1"  # finished: every page is in the main file, nothing can change it
        logger.info("reading %r immutably: its folder is not writable", str(path))
    return uri


def _is_wal(path: Path) -> bool:
    """Whether the SQLite file's header says WAL mode (read and write versions 2)."""
    try:
        with path.open("rb") as f:
            header = f.read(20)
    except OSError:
        return False
    return header[:16] == b"SQLite format 3\x00" and header[18:20] == b"\x02\x02"


def _connect_readonly(uri: str, shown: str) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # reads the schema now
    except sqlite3.OperationalError as exc:
        raise _readonly_error(shown, exc) from None
    return conn


def _readonly_error(shown: str, exc: sqlite3.Error) -> Exception:
    """An error a read-only open ran into, said as what it is (never "a write")."""
    reason = str(exc)
    if "readonly" in reason or "unable to open" in reason or "disk I/O" in reason:
        folder = os.path.dirname(os.path.abspath(shown))
        return StoreError(
            f"cannot read history database {shown!r}: SQLite needs to create or update its "
            f"'-shm' (shared memory) file beside it, and cannot ({reason}); is folder "
            f"{folder!r} writable by this user? Copy the database with its -wal file to a "
            "folder you can write, or ask its owner to open it once"
        )
    return exc
