"""``edo-monitor``: questions about recorded runs, from a terminal or a script.

Every command takes ``--db PATH|URL`` (default: ``$EDO_DB``, else ``./edo-history.db``). Listing
commands take ``--json`` for scripts. A run is named by its id, a uuid prefix of at least one
non-digit character (``runs`` prints prefixes that always open their run), or ``latest``.
A multi-rank job is named by its id (as ``jobs`` prints it), a unique prefix of it, or
``latest``: ``edo-monitor job JOB`` (a separate command, so a job id is never read as a run).

Exit codes (:data:`EXIT_CODES`, also in ``edo-monitor --help``):
    0    success
    1    runtime or data error: no such run or job, no database to read (missing file or
         folder), a database that cannot be used (not a database, newer schema, unreadable), a
         write refused by ``sql``, ``sql`` ran past its ``--timeout``, ``doctor`` found a
         problem, no NVML for ``daemon``, another ``daemon`` recording this host into the
         database, an optional package not installed (the message gives the install line)
    2    usage: unknown option, bad or out-of-range value (a size, a duration, a format, a column
         name, nan or an infinity), a db path that is not a regular file or is too long, the
         daemon's db (the database it creates) in a folder that does not exist; one
         ``edo-monitor: error:`` line, checked before anything is opened
    3    unexpected internal error (reported in one line; set ``EDO_DEBUG=1`` for the traceback)
    130  interrupted (Ctrl-C)

No command creates a file it was not asked to write: readers open the database read-only (SQLite
itself adds the ``-wal``/``-shm`` companions of a WAL database whose folder is writable), and a
command that fails creates no database.
"""

from __future__ import annotations

import logging
import sys

# each module registers its commands on the app when imported, in the order --help lists them
from edo_monitor.surfaces.cli import advice, export, sql  # noqa: F401

# isort: split
from edo_monitor.surfaces.cli import data, runs, services  # noqa: F401
from edo_monitor.surfaces.cli.common import EXIT_CODES, app

__all__ = ["EXIT_CODES", "app", "main"]


def main() -> None:
    """Console-script entry point (``edo-monitor``)."""
    logging.basicConfig(level=logging.WARNING, format="edo-monitor: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from edo_monitor.surfaces.cli.dispatch import app_for

    app_for(app, sys.argv[1:])()  # only the command asked for is built (start-up)
