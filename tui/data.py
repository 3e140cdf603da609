"""The dashboard's data layer: a thin adapter over :class:`edo_monitor.store.history.History`.

The app never touches SQL itself; it asks a :class:`DataSource`, which asks ``History`` (read-only).
Reads run in Textual worker threads, so every method here may block (milliseconds normally) and is
thread-safe (``History`` uses one SQLAlchemy engine and a short-lived connection per call).

Long runs are downsampled in SQL to about the chart's width (``History.samples(max_points=…)``,
served from the rollup tables on SQLite); while a run is live only what is new is read
(``History.samples_since`` / ``events_since``) and folded into the in-memory buckets of
:class:`Series`, so a refresh costs the same on a run of a million samples as on a run of ten.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edo_monitor.errors import ConfigError, StoreError
from edo_monitor.exporters.samples_file import write_samples_csv
from edo_monitor.hindsight.jobs import JobReport, job_report
from edo_monitor.hindsight.run_config import DEFAULT_FLOOR, recorded_floor
from edo_monitor.store.history import History
from edo_monitor.store.paths import resolve_db_url, shown_database
from edo_monitor.store.records import (
    DeviceEventInfo,
    DeviceInfo,
    EventInfo,
    JobInfo,
    ModuleInfo,
    RunInfo,
)

__all__ = [
    "DEFAULT_FLOOR",
    "GAUGE_COLUMNS",
    "SERIES_COLUMNS",
    "TERMINAL_STATUSES",
    "DataSource",
    "DeviceEventInfo",
    "DeviceInfo",
    "Devices",
    "EventInfo",
    "JobInfo",
    "JobReport",
    "Jobs",
    "Latest",
    "ModuleInfo",
    "Poll",
    "RunInfo",
    "Series",
    "elapsed_s",
    "run_floor",
]

logger = logging.getLogger(__name__)

#: Statuses after which a run never changes again.
TERMINAL_STATUSES = frozenset({"finished", "failed", "interrupted"})
#: Sample columns the chart draws.
SERIES_COLUMNS = ("in_use_bytes", "allocated_bytes", "reserved_bytes")
#: Sample columns the gauges and header show.
GAUGE_COLUMNS = (
    "step",
    "in_use_bytes",
    "budget_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "free_fraction",
    "fragmentation",
)


def run_floor(run: RunInfo) -> float | None:
    """The free-fraction floor the run's policy used, as ``explain`` reads it
    (:func:`edo_monitor.hindsight.run_config.recorded_floor`: the agent's record, never a user's
    config value); ``None`` for a run without a policy: no floor to draw or to colour by."""
    return recorded_floor(run.config)


def elapsed_s(run: RunInfo, now_s: float | None = None) -> float:
    """Seconds from the run's start to its end, its last heartbeat (crashed), or now (running)."""
    if run.ended_at_s is not None:
        end = run.ended_at_s
    elif run.status != "running" and run.heartbeat_at_s is not None:
        end = run.heartbeat_at_s
    else:
        end = time.time() if now_s is None else now_s
    return max(0.0, end - run.started_at_s)


@dataclass(frozen=True)
class Latest:
    """The newest sample's gauge fields (``None``: not available from its source)."""

    time_s: float
    step: int
    in_use_bytes: int | None
    budget_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    free_fraction: float | None
    fragmentation: float | None

    @classmethod
    def from_values(cls, time_s: float, values: Any) -> Latest:
        """Build from a mapping (or ``History.SampleRow``) of :data:`GAUGE_COLUMNS`."""
        return cls(time_s, *(values[c] for c in GAUGE_COLUMNS))


class Series:
    """The chart's data: time buckets of (max in-use, max allocated, max reserved) bytes.

    Built from ``History``'s SQL downsampling of the whole run, then extended in memory with each
    poll's new samples; when the buckets grow past twice ``max_points`` neighbours merge, so the
    series stays about the chart's width however long the run. Buckets keep maxima, so a peak is
    never hidden and folding a sample in twice changes nothing.
    """

    def __init__(self, t0_s: float, width_s: float, max_points: int) -> None:
        """Start an empty series whose first bucket starts at ``t0_s``."""
        self.t0_s = t0_s
        self.width_s = max(width_s, 1e-6)
        self.max_points = max(2, max_points)
        self.index: list[int] = []
        self.time_s: list[float] = []
        self.in_use: list[int | None] = []
        self.allocated: list[int | None] = []
        self.reserved: list[int | None] = []
        self.last_id = 0
        #: held while the series changes and while a snapshot is taken (workers read it)
        self.lock = threading.Lock()

    def snapshot(self) -> tuple[list[float], list[int | None], list[int | None], list[int | None]]:
        """Copies of (time_s, in_use, allocated, reserved), consistent with each other."""
        with self.lock:
            return list(self.time_s), list(self.in_use), list(self.allocated), list(self.reserved)

    def __len__(self) -> int:
        return len(self.index)

    def add(
        self, time_s: float, in_use: int | None, allocated: int | None, reserved: int | None
    ) -> None:
        """Fold one sample (or bucket maximum) at ``time_s`` in."""
        index = int((time_s - self.t0_s) // self.width_s)
        if self.index and index <= self.index[-1]:
            self.in_use[-1] = _max(self.in_use[-1], in_use)
            self.allocated[-1] = _max(self.allocated[-1], allocated)
            self.reserved[-1] = _max(self.reserved[-1], reserved)
            return
        self.index.append(index)
        self.time_s.append(time_s)
        self.in_use.append(in_use)
        self.allocated.append(allocated)
        self.reserved.append(reserved)

    def extend(self, rows: Iterable[Sequence[Any]]) -> int:
        """Fold new samples ``(id, time_s, in_use, allocated, reserved)`` in; returns how many."""
        count = 0
        with self.lock:
            for sample_id, time_s, in_use, allocated, reserved in rows:
                self.add(time_s, in_use, allocated, reserved)
                self.last_id = max(self.last_id, sample_id)
                count += 1
            while len(self.index) > 2 * self.max_points:
                self._coarsen()
        return count

    def _coarsen(self) -> None:
        old = list(zip(self.time_s, self.in_use, self.allocated, self.reserved, strict=True))
        self.width_s *= 2
        self.index, self.time_s, self.in_use, self.allocated, self.reserved = [], [], [], [], []
        for row in old:
            self.add(*row)


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


@dataclass(frozen=True)
class Devices:
    """What the devices view shows: every GPU at the daemon's latest sample of each host (with
    its processes and their runs), and the daemon's latest events."""

    devices: list[DeviceInfo]
    events: list[DeviceEventInfo]
    read_at_s: float


@dataclass(frozen=True)
class Jobs:
    """What the job view shows: every job (newest first) and the chosen one's ranks."""

    jobs: list[JobInfo]
    #: the chosen job's report (``None``: no jobs recorded)
    report: JobReport | None
    read_at_s: float


@dataclass
class Poll:
    """What one refresh read: the run, its newest sample, new samples and events, and its
    modules (``None`` when nothing new was written, so they were not read again)."""

    run: RunInfo
    latest: Latest | None
    new_samples: list[tuple[Any, ...]]
    new_events: list[EventInfo]
    modules: list[ModuleInfo] | None


class DataSource:
    """Read-only access to one history database for the dashboard (through ``History``).

    Args:
        db: a file path or SQLAlchemy URL; ``None`` means the agent's default (``EDO_DB`` or
            ``./edo-history.db``).

    The database is opened on first use; :meth:`open` raises :class:`StoreError` or
    :class:`ConfigError` with a message meant for the screen (missing file, not a database, a
    newer schema, an unreachable server, a missing driver, a bad URL), and may be called again
    later (a file that did not exist yet may have been created by then).
    """

    def __init__(self, db: str | os.PathLike[str] | None = None) -> None:
        """Remember ``db``; nothing is opened yet."""
        self.db = db
        self._history: History | None = None
        self._lock = threading.Lock()

    @property
    def label(self) -> str:
        """The database as shown to the user (path, or URL without password)."""
        try:
            url = resolve_db_url(self.db)
        except ConfigError:
            return str(self.db)
        return shown_database(url)

    def open(self) -> History:
        """Open the database read-only (once); see the class docstring for the errors."""
        with self._lock:
            if self._history is not None and self._history.replaced():  # rm, a new history
                logger.info("%s was removed or replaced; opening it again", self.label)
                self._history.close()
                self._history = None
            if self._history is None:
                try:
                    self._history = History(self.db, readonly=True)
                except ImportError as exc:  # the URL's driver (psycopg, pymysql…) is missing
                    raise StoreError(
                        f"cannot open {self.label}: its database driver is not installed ({exc})"
                    ) from None
                logger.debug("opened %s read-only", self.label)
            return self._history

    def close(self) -> None:
        """Release the database's connections."""
        with self._lock:
            if self._history is not None:
                self._history.close()
                self._history = None

    # -- runs -------------------------------------------------------------------------------

    def resolve(self, ref: str | int | None) -> RunInfo | None:
        """A run by id, uuid prefix or ``latest``; ``None`` means the latest running run, else
        the latest run. Returns ``None`` when ``ref`` is ``None``/``latest`` and there are no runs.

        Raises:
            RunNotFoundError: ``ref`` matched no run, or several.
        """
        history = self.open()
        if ref is None:
            running = history.runs(status="running", limit=1)
            if running:
                return running[0]
        if ref is None or str(ref).strip().lower() == "latest":
            latest = history.runs(limit=1)
            return latest[0] if latest else None
        return history.run(ref)

    def run(self, run_id: int) -> RunInfo:
        """The run with this id, its status derived now."""
        return self.open().run(run_id)

    def runs(self) -> list[RunInfo]:
        """Every run, newest first, with peak bytes, lowest free fraction, OOM and action counts."""
        return self.open().runs()

    # -- one run ----------------------------------------------------------------------------

    def series(self, run: RunInfo, max_points: int) -> Series:
        """The run's in-use / allocated / reserved bytes, downsampled in SQL to ``max_points``
        buckets of equal time (each bucket's maximum, so peaks are never hidden)."""
        history = self.open()
        data = history.samples(run.id, columns=SERIES_COLUMNS, max_points=max_points)
        if not len(data):
            out = Series(run.started_at_s, max(run.interval_s, 1e-3), max_points)
            out.last_id = data.last_id  # where samples_since continues (same snapshot)
            return out
        t0, t1 = data.time_s[0], data.time_end_s[-1]
        width = data.bucket_s or max((t1 - t0) / max_points, run.interval_s / 4, 1e-3)
        out = Series(t0, width, max_points)
        columns = [data.max[c] for c in SERIES_COLUMNS]
        for i, time_s in enumerate(data.time_s):
            out.add(time_s, columns[0][i], columns[1][i], columns[2][i])
        out.last_id = data.last_id
        return out

    def latest(self, run: RunInfo) -> Latest | None:
        """The run's newest sample (gauge fields)."""
        if run.last_sample_s is None:
            return None
        data = self.open().samples(
            run.id, start=run.last_sample_s, columns=GAUGE_COLUMNS, max_points=None
        )
        if not len(data):
            return None
        return Latest.from_values(data.time_s[-1], {c: data.min[c][-1] for c in GAUGE_COLUMNS})

    def events(self, run_id: int) -> list[EventInfo]:
        """The run's events, oldest first."""
        return self.open().events(run_id)

    def modules(self, run_id: int) -> list[ModuleInfo]:
        """The latest row of each module of the run, largest first."""
        return self.open().modules(run_id)

    def poll(self, run_id: int, after_sample_id: int, after_event_id: int) -> Poll:
        """Everything new since the given ids, the run (for its status) and its modules."""
        history = self.open()
        run = history.run(run_id, stats=False)  # status, steps, heartbeat: the row is enough
        rows = history.samples_since(run_id, after_sample_id, columns=(*GAUGE_COLUMNS,), limit=None)
        new_samples = [
            (r.id, r.time_s, r["in_use_bytes"], r["allocated_bytes"], r["reserved_bytes"])
            for r in rows
        ]
        latest = Latest.from_values(rows[-1].time_s, rows[-1]) if rows else None
        new_events = history.events_since(run_id, after_event_id)
        # module rows are written with samples (or events): nothing new, nothing to re-read
        modules = history.modules(run_id) if rows or new_events else None
        return Poll(run, latest, new_samples, new_events, modules)

    # -- the daemon's rows -------------------------------------------------------------------

    def devices(self, events: int = 6) -> Devices:
        """Every GPU at the daemon's latest sample (``History.devices``) and its ``events``
        latest events (``History.device_events``)."""
        history = self.open()
        return Devices(history.devices(), history.device_events(limit=events), time.time())

    # -- multi-rank jobs --------------------------------------------------------------------

    def jobs(self, chosen: str | None = None) -> Jobs:
        """Every job, newest first (``History.jobs``), and the report of job ``chosen`` (a job
        id; ``None``, or an id no longer listed: the newest job) with its ranks' free fraction
        now and lowest and their actions (:func:`edo_monitor.hindsight.jobs.job_report`)."""
        history = self.open()
        jobs = history.jobs()
        if not jobs:
            return Jobs([], None, time.time())
        ids = {j.id for j in jobs}
        ref = chosen if chosen in ids else jobs[0].id
        return Jobs(jobs, job_report(history, ref), time.time())

    def export_csv(self, run: RunInfo, directory: str | os.PathLike[str] = ".") -> Path:
        """Write the run's samples to ``edo-run-<id>-<name>.csv``, as ``edo-monitor export RUN
        --format csv`` writes them (:func:`edo_monitor.exporters.samples_file.write_samples_csv`:
        every column, in id order, a page at a time), and through the same checks and temporary
        file renamed into place (:mod:`edo_monitor.surfaces.cli.output`). Returns the path
        written.

        Raises:
            ConfigError: the file would be the history database or one of its companion files,
                a folder, or ``directory`` does not exist.
            EdoMonitorError: the file cannot be written (a file already there is left as it was).
        """
        from edo_monitor.surfaces.cli.output import open_output, output_target

        # a file name of at most ~100 bytes (a 300-character run name was "File name too long")
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run.name).strip("_")[:80] or "run"
        path = Path(directory) / f"edo-run-{run.id}-{safe}.csv"
        db = None if self.db is None else os.fspath(self.db)
        target = output_target(path, db, "the export file")
        history = self.open()
        with open_output(target) as fh:
            write_samples_csv(history, run, fh)
        logger.info("exported run %d to %s", run.id, path)
        return path
