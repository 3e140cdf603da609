"""Prometheus metrics: ``watch(metrics_port=N)`` and ``edo-monitor metrics --db URL``.

Two sources feed one set of metric families (:data:`GAUGES`, :data:`COUNTERS`, documented in
``docs/metrics.md``), served on ``/metrics`` in Prometheus' text format by ``prometheus_client``:

* :class:`MonitorCollector` reads a live :class:`~edo_monitor.Monitor`'s latest reading and its
  counters (steps, actions, OOMs). It runs on the HTTP server's thread at scrape time; the
  training thread does no work for it.
* :class:`HistoryCollector` reads the latest sample of every running run from a history
  database (read-only, one short transaction per scrape), for one central scrape of many runs.

Each server has its own :class:`prometheus_client.CollectorRegistry` (never the process-wide
default one), so two watches in one process do not collide. ``prometheus_client`` is the
``[prometheus]`` extra; without it :func:`require_prometheus` raises a :class:`ConfigError` that
names the extra. This module never imports torch.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import socketserver
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from edo_monitor.checks import whole_number
from edo_monitor.errors import ConfigError, missing_extra
from edo_monitor.signals import stop_on_signals

logger = logging.getLogger(__name__)

#: Default host the servers bind to (loopback: nothing outside the machine can scrape it).
DEFAULT_METRICS_HOST = "127.0.0.1"
#: ``edo-monitor metrics``' default port.
DEFAULT_CENTRAL_PORT = 9400
#: The environment variable read when ``watch(metrics_port=)`` is not given.
METRICS_PORT_ENV = "EDO_METRICS_PORT"

#: what the help of a metric that only a CUDA run has ends with
CUDA_ONLY = "CUDA only: no sample in CPU-budget mode."
#: what the help of a metric that a CPU-budget run has only with ``budget=`` says
NEEDS_BUDGET = "no sample in CPU-budget mode without a budget"

#: Gauge name -> (Reading field, help). Bytes in bytes, ratios in [0, 1]. A help says when the
#: metric has no sample (a reading's ``None``): the driver's and the allocator's numbers in
#: CPU-budget mode, the budget and free ratio of a CPU-budget run without ``budget=``.
GAUGES: dict[str, tuple[str, str]] = {
    "edo_device_total_bytes": (
        "device_total_bytes",
        f"Device memory capacity (NVML, else torch.cuda.mem_get_info). {CUDA_ONLY}",
    ),
    "edo_device_used_bytes": (
        "device_used_bytes",
        "Device memory used by every process, CUDA contexts included (NVML, else "
        "torch.cuda.mem_get_info); the accounted bytes of CPU-budget mode are "
        f"edo_in_use_bytes. {CUDA_ONLY}",
    ),
    "edo_device_free_bytes": (
        "device_free_bytes",
        f"Device memory free (NVML, else torch.cuda.mem_get_info). {CUDA_ONLY}",
    ),
    "edo_process_device_bytes": (
        "process_device_bytes",
        f"Device memory used by this process (NVML, CUDA context included). {CUDA_ONLY}",
    ),
    "edo_allocated_bytes": (
        "allocated_bytes",
        f"Bytes in live tensors (caching allocator). {CUDA_ONLY}",
    ),
    "edo_reserved_bytes": (
        "reserved_bytes",
        f"Bytes the caching allocator holds from the driver. {CUDA_ONLY}",
    ),
    "edo_active_bytes": ("active_bytes", f"Bytes in active allocator blocks. {CUDA_ONLY}"),
    "edo_peak_allocated_bytes": (
        "peak_allocated_bytes",
        f"Peak allocated bytes so far (caching allocator). {CUDA_ONLY}",
    ),
    "edo_largest_inactive_block_bytes": (
        "largest_inactive_block_bytes",
        f"Largest free block inside reserved segments (last allocator snapshot). {CUDA_ONLY}",
    ),
    "edo_in_use_bytes": (
        "in_use_bytes",
        "The figure the policy compares to the budget: on CUDA the allocator's reserved bytes "
        "with a budget, the device's used bytes without one; in CPU-budget mode the accounted "
        "params, grads, optimizer state and saved activations.",
    ),
    "edo_budget_bytes": (
        "budget_bytes",
        "The capacity the policy measures against: the smaller of the device total and budget= "
        f"on CUDA; budget= in CPU-budget mode ({NEEDS_BUDGET}).",
    ),
    "edo_free_ratio": (
        "free_fraction",
        "(budget - in use) / budget: 1 all free, 0 full, below 0 when more is in use than the "
        "budget (CPU-budget mode: a reading estimates the step's peak, above an enforced budget "
        f"too); {NEEDS_BUDGET}.",
    ),
    "edo_fragmentation_ratio": (
        "fragmentation",
        "1 - largest free block / free bytes inside reserved segments, 0..1 (last allocator "
        f"snapshot). {CUDA_ONLY}",
    ),
    "edo_params_bytes": ("params_bytes", "Bytes of the model's parameters."),
    "edo_grads_bytes": ("grads_bytes", "Bytes of the parameters' gradients."),
    "edo_optimizer_state_bytes": ("optimizer_state_bytes", "Bytes of optimizer state."),
    "edo_activations_bytes": (
        "activations_bytes",
        "Bytes saved for backward alive (the peak between two samples); no sample with "
        "track_activations=False.",
    ),
    "edo_host_tier_bytes": ("host_tier_bytes", "Bytes moved to host memory by actions."),
    "edo_process_rss_bytes": ("process_rss_bytes", "Resident set size of the process."),
    "edo_host_available_bytes": ("host_available_bytes", "Host memory available."),
    "edo_reading_timestamp_seconds": ("time_s", "Unix time of the reading these come from."),
}

#: Counter name (without ``_total``) -> help.
COUNTERS: dict[str, str] = {
    "edo_steps": "Optimizer steps of the run.",
    "edo_actions": "Actions applied by the auto-tuner, by action; no sample before an action.",
    "edo_ooms": "Out-of-memory errors recorded.",
    "edo_alloc_retries": (
        f"cudaMalloc retries of the caching allocator (frees and retries). {CUDA_ONLY}"
    ),
}

LABELS = ("job", "rank", "device")
HISTORY_LABELS = (*LABELS, "run_id", "run_name")


def require_prometheus() -> Any:
    """Import ``prometheus_client`` (the ``[prometheus]`` extra).

    Raises:
        MissingExtraError: it is not installed (a ConfigError naming the extra to install).
    """
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError:
        raise missing_extra("Prometheus metrics", "prometheus_client", "prometheus") from None
    return prometheus_client


def _check_port(value: Any, name: str) -> int:
    return whole_number(value, name, 0, 65535, error=ConfigError)


def resolve_metrics_port(
    metrics_port: int | None, environ: Mapping[str, str] | None = None
) -> int | None:
    """The base port to serve on: ``metrics_port``, else ``$EDO_METRICS_PORT``, else ``None``.

    The environment is ambient (a cluster may set it for every job): a value that is no port is
    a warning and no endpoint, never a refused run.

    Raises:
        ConfigError: ``metrics_port`` not an int in 0..65535 (0 = any free port).
    """
    if metrics_port is not None:
        return _check_port(metrics_port, "metrics_port")
    env = os.environ if environ is None else environ
    raw = env.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        return _check_port(int(raw), METRICS_PORT_ENV)
    except (ValueError, ConfigError):
        logger.warning(
            "%s=%r is not a TCP port (an int in 0..65535): no metrics endpoint",
            METRICS_PORT_ENV,
            raw,
        )
        return None


def usable_metrics_port(metrics_port: int | None) -> int | None:
    """``watch()``'s port (:func:`resolve_metrics_port`), ``None`` when no endpoint can be served.

    Raises:
        ConfigError: ``metrics_port`` given and not a port, or given where the ``prometheus``
            extra is not installed (the message names it). ``$EDO_METRICS_PORT`` is ambient (a
            cluster may set it for every job): without the extra it is a warning, no endpoint.
    """
    port = resolve_metrics_port(metrics_port)
    if port is None:
        return None
    try:
        require_prometheus()
    except ConfigError as exc:
        if metrics_port is not None:
            raise
        logger.warning("%s set, but no metrics endpoint: %s", METRICS_PORT_ENV, exc)
        return None
    return port


def check_metrics_host(host: Any) -> str:
    """``host`` if it can name an address to bind (a string without control characters; ``""``
    binds every interface), checked before a run starts.

    Raises:
        ConfigError: not a string, or holding a control character (a NUL among them).
    """
    if not isinstance(host, str):
        raise ConfigError(
            f"metrics_host={host!r}; expected an address or host name as a string "
            f"(default {DEFAULT_METRICS_HOST!r})"
        )
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in host):
        raise ConfigError(f"metrics_host={host!r} holds a control character; expected an address")
    return host


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its machine: ``$LOCAL_RANK`` (set by torchrun), else 0."""
    raw = (os.environ if environ is None else environ).get("LOCAL_RANK", "").strip()
    try:
        return max(0, int(raw)) if raw else 0
    except ValueError:
        logger.warning("LOCAL_RANK=%r is not an int; using 0", raw)
        return 0


def per_rank_port(base_port: int, environ: Mapping[str, str] | None = None) -> int:
    """``base_port + local rank`` (0 stays 0: any free port).

    Raises:
        ConfigError: the sum is above 65535.
    """
    if base_port == 0:
        return 0
    return _check_port(base_port + local_rank(environ), "metrics_port + LOCAL_RANK")


def _global_rank() -> int:
    """The process group's rank when torch.distributed is imported and initialised, else 0."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        logger.debug("could not read the process group's rank", exc_info=True)
    return 0


def _families(
    label_names: tuple[str, ...],
    entries: Iterable[tuple[tuple[str, ...], Mapping[str, Any], Mapping[str, Any]]],
) -> Iterator[Any]:
    """Metric families from ``(label values, reading fields, counters)`` triples.

    ``counters`` holds ``steps``, ``ooms``, ``alloc_retries`` (numbers or None) and ``actions``
    (action name -> count). ``None`` values are left out (no sample rather than a fake 0).
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    entries = list(entries)
    for name, (field, doc) in GAUGES.items():
        fam = GaugeMetricFamily(name, doc, labels=label_names)
        for labels, fields, _ in entries:
            value = fields.get(field)
            if value is not None:
                fam.add_metric(labels, float(value))
        yield fam
    for key in ("steps", "ooms", "alloc_retries"):
        name = f"edo_{key}"
        fam = CounterMetricFamily(name, COUNTERS[name], labels=label_names)
        for labels, _, counters in entries:
            value = counters.get(key)
            if value is not None:
                fam.add_metric(labels, float(value))
        yield fam
    fam = CounterMetricFamily(
        "edo_actions", COUNTERS["edo_actions"], labels=(*label_names, "action")
    )
    for labels, _, counters in entries:
        for action, count in sorted((counters.get("actions") or {}).items()):
            fam.add_metric((*labels, str(action)), float(count))
    yield fam


class MonitorCollector:
    """Collects a live monitor's latest reading and counters at scrape time (server thread).

    Args:
        monitor: a started :class:`edo_monitor.Monitor` (read: ``latest``, ``steps``,
            ``run_uuid``, ``device_kind``, ``device_index``; ``job_id`` and ``rank`` when set).
    """

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor
        job = getattr(monitor, "job_id", None) or monitor.run_uuid
        rank = getattr(monitor, "rank", None)
        rank = _global_rank() if rank is None else int(rank)
        device = f"cuda:{monitor.device_index or 0}" if monitor.device_kind == "cuda" else "cpu"
        self.labels: tuple[str, ...] = (str(job), str(rank), device)

    def collect(self) -> Iterator[Any]:
        """Prometheus' collector protocol: the metric families of the latest reading."""
        m = self.monitor
        reading = m.latest
        fields = reading.as_dict() if reading is not None else {}
        actions = Counter(
            str(a.get("action"))
            for a in list(m._log.actions)
            if a.get("status", "applied") == "applied"
        )
        counters = {
            "steps": m.steps,
            "ooms": m._log.counts.get("oom", 0),
            "alloc_retries": fields.get("num_alloc_retries"),
            "actions": actions,
        }
        yield from _families(LABELS, [(self.labels, fields, counters)])


class HistoryCollector:
    """Collects the latest sample of every running run in a history database at scrape time.

    One read-only transaction per scrape: the running runs (``runs.status = 'running'`` whose
    process is alive or whose heartbeat is fresh), the newest sample of each (the
    ``(run_id, time_s)`` index), and their action and OOM event counts.

    Args:
        history: an open :class:`edo_monitor.store.history.History` (read-only).
    """

    def __init__(self, history: Any, opener: Callable[[], Any] | None = None) -> None:
        self.history = history
        self._opener = opener

    def _history(self) -> Any:
        """The history, opened on first use when it was not there yet, and again when its file
        was removed or replaced (``None``: not there now)."""
        if self.history is not None and self._opener is not None and self.history.replaced():
            logger.info("edo-monitor metrics: the history database was removed or replaced")
            self.history.close()
            self.history = None
        if self.history is None and self._opener is not None:
            from edo_monitor.errors import StoreError

            try:
                self.history = self._opener()
            except StoreError:  # not created yet, or created but not written yet
                return None
            logger.info("edo-monitor metrics: the history database is there now")
        return self.history

    def entries(self) -> list[tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]]:
        """``(labels, latest sample fields, counters)`` of each running run."""
        from sqlalchemy import inspect, select, text

        from edo_monitor.store.schema import events_table
        from edo_monitor.store.status import effective_status

        out = []
        history = self._history()
        if history is None:
            return []
        with history._read() as conn:
            if not inspect(conn).has_table("runs"):  # a database no run has written to yet
                return []
            runs = [
                dict(r._mapping)
                for r in conn.execute(text("SELECT * FROM runs WHERE status = 'running'"))
            ]
            for run in runs:
                status = effective_status(
                    run["status"],
                    host=run["host"],
                    pid=run["pid"],
                    heartbeat_at_s=run["heartbeat_at_s"],
                    interval_s=run["interval_s"],
                )
                if status != "running":
                    continue
                row = conn.execute(
                    text(
                        "SELECT * FROM samples WHERE run_id = :r "
                        "ORDER BY time_s DESC, id DESC LIMIT 1"
                    ),
                    {"r": run["id"]},
                ).first()
                fields = dict(row._mapping) if row is not None else {}
                counts = conn.execute(
                    text(
                        "SELECT kind, COUNT(*) FROM events WHERE run_id = :r "
                        "AND kind IN ('oom', 'action') GROUP BY kind"
                    ),
                    {"r": run["id"]},
                ).all()
                kinds = dict(counts)
                actions: Counter[str] = Counter()
                if kinds.get("action"):
                    data = conn.execute(
                        select(events_table.c.data).where(
                            events_table.c.run_id == run["id"], events_table.c.kind == "action"
                        )
                    ).scalars()
                    actions.update(str((d or {}).get("action")) for d in data)
                # the run's own columns only: its config holds the user's keys too (a user's
                # "rank" or "job_id" there set these labels); the row keeps no device index
                job = run.get("job_id") or run["uuid"]
                rank = run.get("rank")
                if rank is None:
                    rank = 0
                device = "cuda" if run["device_kind"] == "cuda" else "cpu"
                steps = max(run["steps"] or 0, fields.get("step") or 0)
                counters = {
                    "steps": steps,
                    "ooms": kinds.get("oom", 0),
                    "alloc_retries": fields.get("num_alloc_retries"),
                    "actions": actions,
                }
                labels = (str(job), str(rank), device, str(run["id"]), str(run["name"]))
                out.append((labels, fields, counters))
        return out

    def collect(self) -> Iterator[Any]:
        """Prometheus' collector protocol: the metric families of every running run."""
        yield from _families(HISTORY_LABELS, self.entries())


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


def _server_class(host: str, port: int) -> type[_Server]:
    """:class:`_Server` for ``host``'s address family: an IPv6 address or a name that resolves
    only to one gets an IPv6 socket (the IPv4 one refused ``::1``); ``""`` binds every IPv4
    interface, as before.

    Raises:
        OSError: ``host`` does not resolve (``socket.gaierror``).
    """
    if not host:
        return _Server
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    if family == _Server.address_family:
        return _Server
    return type("_Server6", (_Server,), {"address_family": family})


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics: " + format, *args)


class MetricsServer:
    """``/metrics`` for one collector, on its own registry and its own ``edo-metrics`` thread.

    Args:
        collector: an object with ``collect()`` yielding metric families.
        host: address to bind (default loopback).
        port: TCP port (0 = any free port; :attr:`port` says which).

    Raises:
        ConfigError: ``prometheus_client`` is missing.
        OSError: the address cannot be bound (port in use, unknown host).
    """

    def __init__(self, collector: Any, host: str = DEFAULT_METRICS_HOST, port: int = 0) -> None:
        prometheus_client = require_prometheus()
        self.registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        app = prometheus_client.make_wsgi_app(self.registry)
        try:
            server_class = _server_class(host, port)
            self._httpd = make_server(
                host, port, app, server_class=server_class, handler_class=_QuietHandler
            )
        except OSError as exc:  # name the address (a resolver error names nothing)
            reason = exc.strerror or str(exc)
            raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {reason}") from None
        self.host = host
        self.port: int = int(self._httpd.server_port)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="edo-metrics",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``, fetchable from this machine: a bind to every interface
        (``""``, ``0.0.0.0``, ``::``) is shown with the loopback address, an IPv6 address in
        brackets (``http://[::1]:9400/metrics``)."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and join the thread (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_for_monitor(monitor: Any, base_port: int, host: str) -> MetricsServer | None:
    """Serve ``monitor``'s metrics on ``base_port + local rank``; ``None`` (and a warning) when
    that port cannot be used — out of range once the local rank is added, or the address cannot
    be bound: a training run never fails because of its metrics."""
    try:
        port = per_rank_port(base_port)
    except ConfigError:
        rank = local_rank()
        logger.warning(
            "edo-monitor: cannot serve metrics on port %d + LOCAL_RANK %d = %d, above 65535; "
            "training goes on without them",
            base_port,
            rank,
            base_port + rank,
        )
        return None
    try:
        server = MetricsServer(MonitorCollector(monitor), host, port)
    except OSError as exc:
        # the error names the address already (MetricsServer)
        logger.warning("edo-monitor: %s; training goes on without them", exc.strerror or exc)
        return None
    logger.info("edo-monitor: metrics of run %d on %s", monitor.run_id, server.url)
    return server


def serve_history(
    db: str | None,
    host: str,
    port: int,
    *,
    on_ready: Callable[[MetricsServer], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve the latest readings of every running run of ``db`` until ``stop`` is set, SIGTERM
    (returns) or Ctrl-C (raises ``KeyboardInterrupt`` once the server is closed).

    Called from the main thread, it handles SIGINT and SIGTERM itself for as long as it serves
    (unblocking them, and replacing an inherited "ignore"), so a service manager's SIGTERM and a
    Ctrl-C both stop it cleanly; the previous handlers are put back.

    An SQLite file that does not exist yet (in a folder that does) is waited for: the server
    serves no runs until a run creates it, so it can be started before the jobs it serves; it
    never creates the file.

    Raises:
        ConfigError: ``prometheus_client`` missing, bad ``db``. StoreError: unusable database
            (its folder missing, not a database ...).
        OSError: the address cannot be bound. KeyboardInterrupt: after Ctrl-C (SIGINT).
    """
    from edo_monitor.store.history import History
    from edo_monitor.store.paths import resolve_db_url

    require_prometheus()
    url = resolve_db_url(db, readonly=True)  # StoreError: the folder is missing
    path = url.database if url.get_backend_name() == "sqlite" else None
    history = None
    if path is None or path == ":memory:" or os.path.exists(path):
        history = History(db, readonly=True)
    else:
        logger.warning("no history database at %r yet: no runs served until one creates it", path)
    stop = stop or threading.Event()
    received: list[int] = []
    restore = stop_on_signals(stop, received)
    collector = HistoryCollector(history, opener=lambda: History(db, readonly=True))
    try:
        with MetricsServer(collector, host, port) as server:
            if on_ready is not None:
                on_ready(server)
            while not stop.wait(1.0):
                pass
    finally:
        restore()
        if collector.history is not None:
            collector.history.close()
    if signal.SIGINT in received:
        raise KeyboardInterrupt
