"""Stopping a foreground command cleanly on SIGINT and SIGTERM (``edo-monitor metrics``,
``edo-monitor daemon``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["stop_on_signals"]


def stop_on_signals(stop: threading.Event, received: list[int]) -> Callable[[], None]:
    """Make SIGINT and SIGTERM set ``stop`` and append their number to ``received`` (main thread
    only; elsewhere nothing changes). The two signals are unblocked, and an inherited "ignore"
    replaced, so a service manager's SIGTERM and a Ctrl-C both reach the command.

    Returns:
        What puts the previous handlers and signal mask back.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    wanted = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous = {s: signal.signal(s, handler) for s in wanted}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)

    def restore() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in previous.items():
            signal.signal(s, h)

    return restore
