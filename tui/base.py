"""What every dashboard screen shares: the app as screens see it (:class:`Dashboard`), the
polled-read base (:class:`_PolledScreen`), updates skipped once a screen is gone, errors shown
on screen. Every database read runs in a thread worker and hands its result back to the UI
thread with ``call_from_thread`` (:func:`_call_ui`); the UI thread only draws. Every worker's
body runs through :func:`_guarded`: whatever it raises, a read error or bad data a reader or the
drawing of its result trips on, is the view's error line, never the app's end."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from textual import work
from textual.app import App
from textual.css.query import NoMatches
from textual.screen import Screen

from edo_monitor.errors import ConfigError, EdoMonitorError
from edo_monitor.tui.data import (
    DataSource,
)

logger = logging.getLogger(__name__)

#: Errors a read may raise that are shown on screen instead of a traceback.
READ_ERRORS = (EdoMonitorError, SQLAlchemyError, OSError, ImportError)

#: Exit codes of ``edo-tui`` (the scheme of ``edo-monitor``; :mod:`edo_monitor.tui.app`).
EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class Dashboard(Protocol):
    """What a screen needs from the dashboard app (:class:`edo_monitor.tui.app.EdoTui` has it):
    screens are typed against this, so they never import the app that imports them."""

    source: DataSource
    refresh_s: float

    def open_run(self, run_ref: str | int | None) -> None:
        """Show the live view of run ``run_ref`` (``None``: the latest)."""


_F = TypeVar("_F", bound=Callable[..., None])


def _present(screen: Screen[Any]) -> bool:
    """``screen`` can be drawn on: mounted, still in the app's DOM (not popped or being
    removed), and the app running (not exiting)."""
    try:
        app = screen.app
    except Exception:  # no active app (it has exited)
        return False
    return (
        screen.is_mounted
        and screen.is_attached
        and not screen._closing  # popped: its widgets are being removed
        and not screen._closed
        and app.is_running
    )


def _while_shown(method: _F) -> _F:
    """The one guard of everything that reaches a screen from outside a key press: its refresh
    timers, its worker threads' hand-backs (:func:`_call_ui`), resize and resume messages.

    The call is skipped (quietly, at debug level) when the screen is not there to draw on — not
    yet mounted, popped or being torn down, or the app exiting — and a query that finds nothing
    (``NoMatches``: the screen's widgets being built or removed) ends it quietly instead of
    reaching Textual's crash handler."""

    @functools.wraps(method)
    def wrapper(self: Screen[None], *args: Any) -> None:
        if not _present(self):
            logger.debug("%s skipped: screen not shown", method.__name__)
            return
        try:
            method(self, *args)
        except NoMatches:  # the screen is being built or torn down
            logger.debug("%s skipped: screen closing", method.__name__)

    return wrapper  # type: ignore[return-value]


def _call_ui(screen: Screen[Any] | App[Any], callback: Callable[..., Any], *args: Any) -> None:
    """Hand a worker thread's result to the UI thread (``call_from_thread``); nothing when the
    app has stopped meanwhile (``call_from_thread`` raises ``RuntimeError`` then)."""
    app = screen if isinstance(screen, App) else screen.app
    try:
        app.call_from_thread(callback, *args)
    except RuntimeError:
        if app.is_running:  # raised by the callback itself: not ours to hide
            raise
        logger.debug("%s dropped: the app has stopped", getattr(callback, "__name__", callback))


def _guarded(
    screen: Screen[Any] | App[Any], show_error: Callable[[str, int], Any], body: Callable[[], Any]
) -> None:
    """Run a worker's ``body``: its read and the hand-back of the result to the UI thread (an
    exception the UI-thread callback raises comes back through ``call_from_thread``). Whatever
    it raises is shown by ``show_error(message, code)`` on the UI thread (:func:`_failure`)
    instead of failing the worker, which would end the whole app (``WorkerFailed``)."""
    try:
        body()
    except Exception as exc:
        _call_ui(screen, show_error, *_failure(exc))


def _failure(exc: BaseException) -> tuple[str, int]:
    """The error line a view shows for ``exc`` and the exit code it stands for: a read error
    (:data:`READ_ERRORS`) its message, 1 (2 for a :class:`ConfigError`); anything else (bad data
    in the history that a reader or the view trips on: a bug) ``internal error (Type: message)``,
    :data:`EXIT_INTERNAL`, its traceback logged."""
    if isinstance(exc, READ_ERRORS):
        logger.debug("read failed", exc_info=exc)
        return _message_for(exc), _code_for(exc)
    logger.error("internal error in a view's background work", exc_info=exc)
    return f"internal error ({type(exc).__name__}: {exc})", EXIT_INTERNAL


def _code_for(exc: BaseException) -> int:
    """The exit code an error shown on screen stands for: 2 for a database argument that is not
    usable as given (:class:`ConfigError`), else 1 (the database or run cannot be read)."""
    return 2 if isinstance(exc, ConfigError) else 1


def _message_for(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ImportError):
        text = f"cannot open the history database: its driver is not installed ({exc})"
    elif isinstance(exc, SQLAlchemyError):
        text = f"cannot read the history database: {getattr(exc, 'orig', None) or exc}"
    return text


class _PolledScreen(Screen[None]):
    """A view that reads the database in a worker thread when shown, when it comes back and on
    its refresh timer, and draws on the UI thread: subclasses give :meth:`read` (worker thread)
    and ``_apply(request, result)`` / ``_show_error(message, code)`` (UI thread), and may give
    :meth:`read_request` (what the next read needs, taken on the UI thread)."""

    def __init__(self, screen_id: str) -> None:
        super().__init__(id=screen_id)
        #: a read is in flight
        self.busy = False
        #: completed reads
        self.loads = 0
        #: exit code of the error shown (``None``: none)
        self.error_code: int | None = None

    @property
    def tui(self) -> Dashboard:
        """The app, typed."""
        return self.app  # type: ignore[return-value]

    @_while_shown
    def on_screen_resume(self) -> None:
        """Read again when the view comes back."""
        self.reload()

    @_while_shown
    def reload(self) -> None:
        """Read again (in a worker), unless a read is in flight or the view is hidden."""
        if self.busy or not self.is_current:
            return
        self.busy = True
        self._read(self.read_request())

    def read_request(self) -> Any:
        """What the next read needs (UI thread); ``None`` by default."""
        return None

    def read(self, request: Any) -> Any:
        """The read (worker thread); raises one of ``READ_ERRORS`` when it cannot be done (any
        other exception is shown too, as an internal error: :func:`_guarded`)."""
        raise NotImplementedError

    @work(thread=True, group="view-read", exclusive=True)
    def _read(self, request: Any) -> None:
        def body() -> None:
            _call_ui(self, self._apply, request, self.read(request))

        _guarded(self, self._show_error, body)

    def _show_error(self, message: str, code: int) -> None:
        raise NotImplementedError

    def _apply(self, request: Any, result: Any) -> None:
        raise NotImplementedError
