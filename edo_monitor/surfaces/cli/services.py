"""The long-running commands: metrics (Prometheus over a history) and daemon (every GPU)."""

from __future__ import annotations

import signal
import sys
from typing import Annotated, Any

import typer

from edo_monitor.surfaces.cli.common import DbOpt, _c, _handle_errors, app
from edo_monitor.surfaces.cli.options import Number


@app.command("metrics")
@_handle_errors
def metrics_cmd(
    db: DbOpt = None,
    port: Annotated[
        int,
        typer.Option(
            help="TCP port to serve /metrics on (0 = any free port).",
            parser=Number(int, 0, 65535),
        ),
    ] = 9400,
    host: Annotated[
        str, typer.Option(help="Address to bind (default loopback; 0.0.0.0 = every interface).")
    ] = "127.0.0.1",
) -> None:
    """Serve Prometheus metrics of every running run of the database on /metrics, until Ctrl-C.

    One central scrape for many runs: each scrape reads the latest sample of each running run
    (read-only). Labels: job, rank, device, run_id, run_name. Needs the [prometheus] extra.
    A database file that does not exist yet is waited for (never created), so it can start
    before the runs. Prints the URL it serves on one line; Ctrl-C stops it (exit code 130)."""
    from edo_monitor.exporters.prometheus import require_prometheus, serve_history

    require_prometheus()  # exit 1 with the install line before anything is opened

    def ready(server: Any) -> None:
        _c.out.print(f"serving {server.url}")
        sys.stdout.flush()

    serve_history(db, host, port, on_ready=ready)


@app.command("daemon")
@_handle_errors
def daemon_cmd(
    db: DbOpt = None,
    interval: Annotated[
        float,
        typer.Option(
            "--interval",
            help="Seconds between samples.",
            parser=Number(float, 0.01, 3600.0, "s"),
        ),
    ] = 1.0,
) -> None:
    """Record every GPU and every process on it (NVML) into the history, until SIGTERM/Ctrl-C.

    Each sample writes one row per GPU (used/total/free bytes, utilisation) and one per process
    on it (PID, name, bytes, and the run id when it is a watched run of this host); GPUs that
    appear or are lost are device events. Runs in the foreground (for a service manager: see
    docs/edo-monitor-daemon.service). SIGTERM stops it after writing everything (exit 0),
    Ctrl-C too (exit 130). No NVML: one line and exit code 1, nothing created."""
    from edo_monitor.surfaces.daemon import run_daemon

    def ready(daemon: Any) -> None:
        devices = ", ".join(f"{i}:{u}" for u, i in sorted(daemon.devices.items(), key=_second))
        _c.err.print(
            f"edo-monitor daemon: recording {len(daemon.devices)} GPU(s) [{devices}] every "
            f"{daemon.interval_s:g} s into {_shown_db(db)}"
        )

    result = run_daemon(db, interval_s=interval, on_ready=ready)
    _c.err.print(f"edo-monitor daemon: stopped; {result.summary()}")
    if result.signal == signal.SIGINT:
        raise KeyboardInterrupt


def _second(item: tuple[Any, Any]) -> Any:
    return item[1]


def _shown_db(db: str | None) -> str:
    from edo_monitor.store.paths import resolve_db_url, shown_url

    url = resolve_db_url(db)
    if url.get_backend_name() == "sqlite" and url.database:
        return url.database
    return shown_url(url)
