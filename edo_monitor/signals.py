"""Signals: stopping a foreground command cleanly on SIGINT and SIGTERM (``edo-monitor metrics``,
``edo-monitor daemon``), and ending a watched run cleanly on SIGTERM (:func:`terminate_on_sigterm`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Terminated", "stop_on_signals", "terminate_on_sigterm"]


def stop_on_signals(stop: threading.Event, received: list[int]) -> Callable[[], None]:
    """Make SIGINT and SIGTERM set ``stop`` and append their number to ``received`` (main thread
    only; elsewhere nothing changes). The two signals are unblocked, and an inherited "ignore"
    replaced, so a service manager's SIGTERM and a Ctrl-C both reach the command.

    The handler itself takes no lock: it appends the number and writes a byte to a pipe, and a
    thread of this function's sets ``stop``. Setting the event in the handler deadlocked: Python
    runs a handler in the main thread between two bytecodes, and when those were inside
    ``stop.wait()`` (which holds the event's lock there) ``stop.set()`` waited forever for the
    lock its own thread held (the daemon at 0.02 s, stopped by a SIGINT, hung in CI).

    Returns:
        What puts the previous handlers and signal mask back (and ends the thread).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    wanted = (signal.SIGINT, signal.SIGTERM)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)
        with contextlib.suppress(BlockingIOError):  # full of earlier signals: stop is being set
            os.write(write_fd, b"s")

    def setter() -> None:
        while os.read(read_fd, 512):  # b"": the write end closed by restore()
            stop.set()

    thread = threading.Thread(target=setter, name="edo-monitor-signals", daemon=True)
    thread.start()
    previous = {s: signal.signal(s, handler) for s in wanted}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)

    def restore() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in previous.items():
            signal.signal(s, h)
        os.close(write_fd)
        thread.join()
        os.close(read_fd)

    return restore


class Terminated(SystemExit):
    """SIGTERM arrived during a ``watch()`` block (a scheduler, ``timeout``, ``torchrun``
    stopping its workers). A :class:`SystemExit` with code 143 (128 + SIGTERM, what the shell
    reports for a process SIGTERM killed): ``finally`` blocks and the block's exit run, the run is
    recorded ``interrupted`` (not ``crashed``, as a process killed outright reads), and the
    process ends with the same exit status as before if nothing catches it."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)

    def __str__(self) -> str:
        return "SIGTERM"


def terminate_on_sigterm() -> Callable[[], None]:
    """While a watched run lasts, turn SIGTERM into :class:`Terminated` raised in the main thread
    — only when the process has no SIGTERM handler of its own (the default action, which kills
    the process without running any Python: the run would read ``crashed``; or the handler of a
    run that ended, which acts as it) and this is the main thread. A handler the user or a
    framework installed (Lightning's, say) is left alone.

    Returns:
        What puts the default action back (only if the handler is still this one). From then on
        the handler, should a framework that saved it put it back (Lightning restores the
        handlers it found at the fit's start, after the run ended), acts as the default action:
        it puts that back and sends the signal again, so the process ends as it would have.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    current = signal.getsignal(signal.SIGTERM)
    before = getattr(current, "edo_run_ended", None)
    # an ended run's handler, put back by a framework after a run that raised (Lightning's
    # teardown, with no callback hook after it): the default action, so this run takes it
    if current is not signal.SIG_DFL and not (before is not None and before.is_set()):
        return lambda: None
    ended = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if not ended.is_set():
            raise Terminated()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    handler.edo_run_ended = ended  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        ended.set()
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return restore
