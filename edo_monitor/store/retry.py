"""How the store tries a write again: which database errors pass (:func:`is_transient`), how an
outage is told (:class:`Outage`: one warning line, no traceback, until the database works
again), and one unit of work tried a few times with a pause (:func:`retried`).

The run's writer thread (:class:`edo_monitor.store.writer.Writer`) keeps its batch and tries
again at each flush while the run goes on, then :data:`CLOSE_TRIES` times when it closes; the
run's own row (its insert when the run opens, its end) is one transaction tried the same number
of times, through :func:`retried`, with the same errors counted as passing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from edo_monitor.store.paths import shown_url

__all__ = ["CLOSE_TRIES", "Outage", "describe", "is_transient", "retried"]

logger = logging.getLogger(__name__)

#: tries of a write after the run (the writer's last flush, the run's end) while the database
#: keeps failing with a transient error
CLOSE_TRIES = 3
#: the pause between two such tries (seconds)
RETRY_PAUSE_S = 1.0

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """Whether a write that failed with ``exc`` may work when tried again: the database was
    locked, an I/O error, the server gone or the connection dropped (``OperationalError``, or
    any driver error SQLAlchemy saw invalidate the connection). A value the database refuses
    is not: trying it again fails again."""
    if isinstance(exc, OperationalError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def describe(exc: BaseException) -> str:
    """One line naming a database error: the driver's exception and its first line."""
    orig = getattr(exc, "orig", None) or exc
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"{type(orig).__name__}: {first}" if first else type(orig).__name__


class Outage:
    """The failed tries of one outage of the database, told once.

    Args:
        what: what was being written, for the log line (e.g. ``"history writer"``).
        url: the database, as the log shows it.
    """

    def __init__(self, what: str, url: Any) -> None:
        self.what = what
        self.url = url
        #: the first error (one line), the monotonic time of the first failed try, the tries
        self.first_error: str | None = None
        self.since_s = 0.0
        self.tries = 0

    @property
    def active(self) -> bool:
        """Whether a try failed and none has succeeded since."""
        return self.first_error is not None

    def failed(self, exc: BaseException, tried_at_s: float | None = None) -> None:
        """Count one failed try (``tried_at_s``: its monotonic start, default now); the first
        of an outage logs one warning line (no traceback: nothing is lost yet)."""
        if self.first_error is None:
            self.first_error = describe(exc)
            self.since_s = time.monotonic() if tried_at_s is None else tried_at_s
            self.tries = 1
            logger.warning(
                "%s cannot write to %s (%s); nothing is lost yet, retrying",
                self.what,
                self.url,
                self.first_error,
            )
        else:
            self.tries += 1

    def data(self) -> dict[str, Any]:
        """``tries``, ``outage_s`` (until now) and ``error`` (the first) of the outage."""
        return {
            "tries": self.tries,
            "outage_s": round(time.monotonic() - self.since_s, 3),
            "error": self.first_error,
        }

    def recovered(self, data: dict[str, Any] | None = None) -> None:
        """The database works again: log it (``data``: as :meth:`data` said it) and reset."""
        logger.info("%s: %s", self.what, reconnect_message(data or self.data()))
        self.first_error = None
        self.tries = 0


def reconnect_message(data: Mapping[str, Any]) -> str:
    """What a ``store_reconnected`` event and the log say (``data`` as :meth:`Outage.data`)."""
    return (
        f"the history database works again after {data['tries']} failed write(s) in "
        f"{data['outage_s']:.1f} s ({data['error']}); nothing was lost"
    )


def retried(
    engine: Engine,
    work: Callable[[Connection], T],
    *,
    what: str,
    tries: int = CLOSE_TRIES,
    pause_s: float = RETRY_PAUSE_S,
) -> T:
    """``work(conn)`` in one transaction of ``engine``, tried up to ``tries`` times while it
    fails with a transient error (:func:`is_transient`), ``pause_s`` apart; each try on a fresh
    connection (a dropped one is invalidated by SQLAlchemy). ``work`` must be safe to run again
    after a try whose commit was lost (an update, or an insert that looks for its row first).

    Returns:
        What ``work`` returned.

    Raises:
        Exception: what the last try raised (at once when it was not transient).
    """
    outage = Outage(what, shown_url(engine.url))
    for attempt in range(1, max(1, tries) + 1):
        tried_at_s = time.monotonic()
        try:
            with engine.begin() as conn:
                result = work(conn)
        except Exception as exc:
            if not is_transient(exc) or attempt >= tries:
                raise
            outage.failed(exc, tried_at_s)
            time.sleep(pause_s)
            continue
        if outage.active:
            outage.recovered()
        return result
    raise AssertionError("unreachable")  # the loop returns or raises
