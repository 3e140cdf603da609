"""A run's status as readers report it, ``crashed`` included.

The agent writes ``running`` at start and ``finished`` / ``failed`` / ``interrupted`` at the end.
A process that dies writes nothing more, so a reader calls a ``running`` run ``crashed`` when its
process is gone (same host, PID no longer alive) or its heartbeat is older than
:func:`stale_after_s`.
"""

from __future__ import annotations

import socket
import time

__all__ = ["effective_status", "on_this_host", "process_alive_here", "stale_after_s"]

_HOSTNAME = socket.gethostname()


def stale_after_s(interval_s: float) -> float:
    """Seconds without a heartbeat after which a ``running`` run counts as crashed:
    ``max(30, 10 × interval_s)`` (the writer beats at least every second)."""
    return max(30.0, 10.0 * interval_s)


def effective_status(
    status: str,
    *,
    host: str,
    pid: int,
    heartbeat_at_s: float | None,
    interval_s: float,
    now_s: float | None = None,
) -> str:
    """``status`` as stored, except ``running`` → ``crashed`` when the run's process is gone.

    Args:
        status: the stored status. host, pid: where the agent ran (``runs.host``, ``runs.pid``).
        heartbeat_at_s: the writer's last heartbeat (Unix seconds, UTC).
        interval_s: the run's sampling interval, for the staleness bound.
        now_s: the present (Unix seconds); ``time.time()`` by default.
    """
    if status != "running":
        return status
    if host == _HOSTNAME and not process_alive_here(host, pid):
        return "crashed"
    now = time.time() if now_s is None else now_s
    if heartbeat_at_s is not None and now - heartbeat_at_s > stale_after_s(interval_s):
        return "crashed"
    return status


def on_this_host(host: str) -> bool:
    """Whether ``host`` (``runs.host``) is this host."""
    return host == _HOSTNAME


def process_alive_here(host: str, pid: int) -> bool:
    """Whether process ``pid`` of ``host`` is alive on this host (``False`` for another host;
    ``True`` when the process exists but may not be inspected)."""
    if host != _HOSTNAME:
        return False
    import psutil  # only for running runs on this host: readers of finished runs skip its import

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
