"""The dashboard's data layer: everything ``edo-tui`` reads from the history database.

The app never touches SQL itself; it asks a :class:`DataSource`. Reads run in Textual worker
threads, so every method here may block (a few milliseconds normally) and is thread-safe (one
SQLAlchemy engine, a short-lived connection per call). The database is always opened read-only.

Long runs are downsampled in SQL to about the chart's width (:meth:`DataSource.series`); while a
run is live only what is new is read (:meth:`DataSource.poll`, ``id > last seen``) and folded into
the in-memory buckets of :class:`Series`, so a refresh costs the same on a run of a million samples
as on a run of ten.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Integer, and_, case, cast, func, select
from sqlalchemy.orm import Session

from edo_monitor.errors import ConfigError, RunNotFoundError, StoreError
from edo_monitor.store.engine import open_engine, resolve_db_url
from edo_monitor.store.schema import Event, ModuleStat, Run, Sample
from edo_monitor.store.status import effective_status

__all__ = [
    "DEFAULT_FLOOR",
    "TERMINAL_STATUSES",
    "DataSource",
    "EventRow",
    "ModuleRow",
    "Poll",
    "RunInfo",
    "RunSummary",
    "SampleRow",
    "Series",
]

logger = logging.getLogger(__name__)

#: The policy's default floor (free fraction below which it acts), used when a run records none.
DEFAULT_FLOOR = 0.20
#: Statuses after which a run never changes again.
TERMINAL_STATUSES = frozenset({"finished", "failed", "interrupted"})

#: Sample columns the live view needs for its gauges.
_GAUGE_COLUMNS = (
    "id",
    "time_s",
    "step",
    "in_use_bytes",
    "budget_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "free_fraction",
    "fragmentation",
    "device_total_bytes",
)


@dataclass(frozen=True)
class RunInfo:
    """One row of ``runs``, with the status readers report (``crashed`` derived)."""

    id: int
    uuid: str
    name: str
    status: str
    stored_status: str
    host: str
    pid: int
    started_at_s: float
    ended_at_s: float | None
    heartbeat_at_s: float | None
    device_kind: str
    device_name: str | None
    device_total_bytes: int | None
    budget_bytes: int | None
    interval_s: float
    steps: int
    samples_dropped: int
    error: str | None
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        """True when the run can no longer change (finished, failed, interrupted)."""
        return self.status in TERMINAL_STATUSES

    def end_s(self, now_s: float | None = None) -> float:
        """When the run ended: its end time, its last heartbeat if crashed, else now."""
        if self.ended_at_s is not None:
            return self.ended_at_s
        if self.status == "crashed" and self.heartbeat_at_s is not None:
            return self.heartbeat_at_s
        return time.time() if now_s is None else now_s

    def elapsed_s(self, now_s: float | None = None) -> float:
        """Seconds from start to end (or to now while running)."""
        return max(0.0, self.end_s(now_s) - self.started_at_s)

    @property
    def floor(self) -> float:
        """The free-fraction floor the run's policy used (``config['floor']``), else 20 %."""
        for key in ("floor", "floor_fraction", "free_floor"):
            value = self.config.get(key) if isinstance(self.config, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return DEFAULT_FLOOR


@dataclass(frozen=True)
class RunSummary:
    """A run with the numbers the runs table shows."""

    run: RunInfo
    peak_bytes: int | None
    min_free_fraction: float | None
    ooms: int
    actions: int


@dataclass(frozen=True)
class SampleRow:
    """The latest sample's gauge fields."""

    id: int
    time_s: float
    step: int
    in_use_bytes: int | None
    budget_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    free_fraction: float | None
    fragmentation: float | None
    device_total_bytes: int | None


@dataclass(frozen=True)
class EventRow:
    """One row of ``events``."""

    id: int
    time_s: float
    step: int
    kind: str
    message: str
    data: dict[str, Any]


@dataclass(frozen=True)
class ModuleRow:
    """The latest ``module_stats`` row of one module."""

    id: int
    module: str
    kind: str
    num_embeddings: int | None
    embedding_dim: int | None
    dtype: str | None
    device: str | None
    placement: str | None
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes over all categories."""
        return (
            self.params_bytes
            + self.grads_bytes
            + self.optimizer_state_bytes
            + self.activations_bytes
        )


class Series:
    """The chart's data: time buckets of (max in-use, max allocated, max reserved).

    Built from SQL's downsampling of the whole run, then extended in memory with each poll's new
    samples; when the buckets grow past twice ``max_points`` neighbours merge, so the series stays
    about the chart's width however long the run.
    """

    def __init__(self, t0_s: float, width_s: float, max_points: int) -> None:
        """Start an empty series whose first bucket starts at ``t0_s``."""
        self.t0_s = t0_s
        self.width_s = max(width_s, 1e-9)
        self.max_points = max(2, max_points)
        self.index: list[int] = []
        self.time_s: list[float] = []
        self.in_use: list[int | None] = []
        self.allocated: list[int | None] = []
        self.reserved: list[int | None] = []
        self.last_id = 0

    def __len__(self) -> int:
        return len(self.index)

    def add_bucket(
        self,
        index: int,
        time_s: float,
        in_use: int | None,
        allocated: int | None,
        reserved: int | None,
    ) -> None:
        """Append one bucket (or fold into the last one when ``index`` is the same)."""
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
        for sample_id, time_s, in_use, allocated, reserved in rows:
            bucket = int((time_s - self.t0_s) // self.width_s)
            self.add_bucket(bucket, time_s, in_use, allocated, reserved)
            self.last_id = max(self.last_id, sample_id)
            count += 1
        while len(self.index) > 2 * self.max_points:
            self._coarsen()
        return count

    def _coarsen(self) -> None:
        old = list(
            zip(self.index, self.time_s, self.in_use, self.allocated, self.reserved, strict=True)
        )
        self.width_s *= 2
        self.index, self.time_s, self.in_use, self.allocated, self.reserved = [], [], [], [], []
        for index, time_s, in_use, allocated, reserved in old:
            self.add_bucket(index // 2, time_s, in_use, allocated, reserved)


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


@dataclass
class Poll:
    """What one refresh read: the run row, the new samples, events and module rows."""

    run: RunInfo
    latest: SampleRow | None
    new_samples: list[tuple[Any, ...]]
    new_events: list[EventRow]
    new_modules: list[ModuleRow]


class DataSource:
    """Read-only access to one history database for the dashboard.

    Args:
        db: a file path or SQLAlchemy URL; ``None`` means the agent's default (``EDO_DB`` or
            ``./edo-history.db``).

    The database is opened on first use; :meth:`open` raises :class:`StoreError` or
    :class:`ConfigError` with a message meant for the screen (missing file, not a database, a
    newer schema, an unreachable server, a bad URL), and may be called again later (a file that
    did not exist yet may have been created by then).
    """

    def __init__(self, db: str | os.PathLike[str] | None = None) -> None:
        """Remember ``db``; nothing is opened yet."""
        self.db = db
        self._engine: Engine | None = None

    @property
    def label(self) -> str:
        """The database as shown to the user (path or URL without password)."""
        try:
            url = resolve_db_url(self.db)
        except ConfigError:
            return str(self.db)
        if url.get_backend_name() == "sqlite" and url.database:
            return url.database
        return url.render_as_string(hide_password=True)

    def open(self) -> Engine:
        """Open the database read-only (once); see the class docstring for the errors."""
        if self._engine is None:
            try:
                self._engine = open_engine(self.db, readonly=True)
            except ImportError as exc:  # the URL's driver (psycopg, pymysql…) is missing
                raise StoreError(
                    f"cannot open {self.label}: its database driver is not installed ({exc})"
                ) from None
            logger.debug("opened %s read-only", self.label)
        return self._engine

    def close(self) -> None:
        """Release the engine's connections."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    # -- runs -------------------------------------------------------------------------------

    @staticmethod
    def _run_info(row: Run, now_s: float | None = None) -> RunInfo:
        status = effective_status(
            row.status,
            host=row.host,
            pid=row.pid,
            heartbeat_at_s=row.heartbeat_at_s,
            interval_s=row.interval_s,
            now_s=now_s,
        )
        return RunInfo(
            id=row.id,
            uuid=row.uuid,
            name=row.name,
            status=status,
            stored_status=row.status,
            host=row.host,
            pid=row.pid,
            started_at_s=row.started_at_s,
            ended_at_s=row.ended_at_s,
            heartbeat_at_s=row.heartbeat_at_s,
            device_kind=row.device_kind,
            device_name=row.device_name,
            device_total_bytes=row.device_total_bytes,
            budget_bytes=row.budget_bytes,
            interval_s=row.interval_s,
            steps=row.steps or 0,
            samples_dropped=row.samples_dropped or 0,
            error=row.error,
            config=dict(row.config or {}),
            tags=list(row.tags or []),
        )

    def run(self, run_id: int) -> RunInfo:
        """The run with this id (its status derived now)."""
        with Session(self.open()) as session:
            row = session.get(Run, run_id)
            if row is None:
                raise RunNotFoundError(f"no run with id {run_id}")
            return self._run_info(row)

    def resolve(self, ref: str | int | None) -> RunInfo | None:
        """Find a run by id, uuid prefix or ``latest``; ``None``/``latest`` with no runs → ``None``.

        ``None`` means the default run: the latest running one, else the latest.

        Raises:
            RunNotFoundError: ``ref`` matched no run, or several.
        """
        with Session(self.open()) as session:
            if ref is None or str(ref).lower() == "latest":
                rows = list(
                    session.execute(
                        select(Run).order_by(Run.started_at_s.desc(), Run.id.desc())
                    ).scalars()
                )
                if not rows:
                    return None
                infos = [self._run_info(r) for r in rows]
                if ref is None:
                    for info in infos:
                        if info.status == "running":
                            return info
                return infos[0]
            text = str(ref).strip()
            if re.fullmatch(r"\d+", text):
                row = session.get(Run, int(text))
                if row is not None:
                    return self._run_info(row)
            matches = list(
                session.execute(select(Run).where(Run.uuid.startswith(text.lower()))).scalars()
            )
            if len(matches) == 1:
                return self._run_info(matches[0])
            if not matches:
                raise RunNotFoundError(
                    f"no run matches {text!r} (an id, a uuid prefix or 'latest')"
                )
            raise RunNotFoundError(f"{text!r} matches {len(matches)} runs; give more of the uuid")

    def summaries(self) -> list[RunSummary]:
        """Every run with its peak in-use bytes, lowest free fraction, OOMs and action count."""
        with Session(self.open()) as session:
            runs = list(session.execute(select(Run).order_by(Run.started_at_s, Run.id)).scalars())
            if not runs:
                return []
            peaks = {
                run_id: (peak, min_free)
                for run_id, peak, min_free in session.execute(
                    select(
                        Sample.run_id, func.max(Sample.in_use_bytes), func.min(Sample.free_fraction)
                    ).group_by(Sample.run_id)
                )
            }
            counts = {
                run_id: (int(ooms or 0), int(actions or 0))
                for run_id, ooms, actions in session.execute(
                    select(
                        Event.run_id,
                        func.sum(case((Event.kind == "oom", 1), else_=0)),
                        func.sum(case((Event.kind == "action", 1), else_=0)),
                    ).group_by(Event.run_id)
                )
            }
            now = time.time()
            out = []
            for row in runs:
                peak, min_free = peaks.get(row.id, (None, None))
                ooms, actions = counts.get(row.id, (0, 0))
                out.append(RunSummary(self._run_info(row, now), peak, min_free, ooms, actions))
            return out

    # -- one run ----------------------------------------------------------------------------

    def series(self, run_id: int, max_points: int) -> Series:
        """The run's in-use / allocated / reserved bytes, downsampled in SQL to ``max_points``
        buckets of equal time (each bucket's maximum, so peaks are never hidden)."""
        engine = self.open()
        with engine.connect() as conn:
            t0, t1, last_id = conn.execute(
                select(func.min(Sample.time_s), func.max(Sample.time_s), func.max(Sample.id)).where(
                    Sample.run_id == run_id
                )
            ).one()
            if t0 is None:
                return Series(time.time(), 1.0, max_points)
            width = max((t1 - t0) / max(1, max_points - 1), 1e-6)
            # CAST truncates toward zero; time_s >= t0, so this is floor() on every backend.
            bucket = cast((Sample.time_s - t0) / width, Integer).label("b")
            rows = conn.execute(
                select(
                    bucket,
                    func.min(Sample.time_s),
                    func.max(Sample.in_use_bytes),
                    func.max(Sample.allocated_bytes),
                    func.max(Sample.reserved_bytes),
                )
                .where(Sample.run_id == run_id)
                .group_by(bucket)
                .order_by(bucket)
            ).all()
        series = Series(t0, width, max_points)
        for b, time_s, in_use, allocated, reserved in rows:
            series.add_bucket(int(b), time_s, in_use, allocated, reserved)
        series.last_id = int(last_id or 0)
        return series

    def latest_sample(self, run_id: int) -> SampleRow | None:
        """The run's newest sample (gauge fields only)."""
        with self.open().connect() as conn:
            row = conn.execute(
                select(*[getattr(Sample, c) for c in _GAUGE_COLUMNS])
                .where(Sample.run_id == run_id)
                .order_by(Sample.time_s.desc(), Sample.id.desc())
                .limit(1)
            ).first()
        return SampleRow(*row) if row is not None else None

    def events(self, run_id: int, after_id: int = 0, limit: int | None = None) -> list[EventRow]:
        """The run's events with ``id > after_id``, oldest first (the newest ``limit``)."""
        query = select(Event).where(and_(Event.run_id == run_id, Event.id > after_id))
        if limit is not None:
            query = query.order_by(Event.id.desc()).limit(limit)
        else:
            query = query.order_by(Event.id)
        with Session(self.open()) as session:
            rows = [
                EventRow(e.id, e.time_s, e.step, e.kind, e.message, dict(e.data or {}))
                for e in session.execute(query).scalars()
            ]
        rows.sort(key=lambda e: e.id)
        return rows

    def modules(self, run_id: int, after_id: int = 0) -> list[ModuleRow]:
        """The latest row per module among rows with ``id > after_id``."""
        latest = (
            select(func.max(ModuleStat.id))
            .where(and_(ModuleStat.run_id == run_id, ModuleStat.id > after_id))
            .group_by(ModuleStat.module)
        )
        cols = [
            ModuleStat.id,
            ModuleStat.module,
            ModuleStat.kind,
            ModuleStat.num_embeddings,
            ModuleStat.embedding_dim,
            ModuleStat.dtype,
            ModuleStat.device,
            ModuleStat.placement,
            ModuleStat.params_bytes,
            ModuleStat.grads_bytes,
            ModuleStat.optimizer_state_bytes,
            ModuleStat.activations_bytes,
        ]
        with self.open().connect() as conn:
            rows = conn.execute(
                select(*cols).where(ModuleStat.id.in_(latest)).order_by(ModuleStat.module)
            ).all()
        return [ModuleRow(*row) for row in rows]

    def poll(
        self, run_id: int, after_sample_id: int, after_event_id: int, after_module_id: int
    ) -> Poll:
        """Everything new since the given ids, plus the run row (for its status)."""
        run = self.run(run_id)
        with self.open().connect() as conn:
            new_samples = [
                tuple(r)
                for r in conn.execute(
                    select(
                        Sample.id,
                        Sample.time_s,
                        Sample.in_use_bytes,
                        Sample.allocated_bytes,
                        Sample.reserved_bytes,
                    )
                    .where(and_(Sample.run_id == run_id, Sample.id > after_sample_id))
                    .order_by(Sample.id)
                )
            ]
        latest = self.latest_sample(run_id) if new_samples else None
        return Poll(
            run=run,
            latest=latest,
            new_samples=new_samples,
            new_events=self.events(run_id, after_event_id),
            new_modules=self.modules(run_id, after_module_id),
        )

    def export_csv(self, run_id: int, directory: str | os.PathLike[str] = ".") -> Path:
        """Write the run's samples (every column, oldest first) to ``edo-run-<id>-<name>.csv``.

        Returns the path written. Rows are streamed, so a long run does not fill memory.
        """
        run = self.run(run_id)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run.name).strip("_") or "run"
        path = Path(directory) / f"edo-run-{run.id}-{safe}.csv"
        columns = [c.name for c in Sample.__table__.columns if c.name != "run_id"]
        table = Sample.__table__
        query = select(*[table.c[c] for c in columns]).where(table.c.run_id == run_id)
        with self.open().connect() as conn, path.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(columns)
            result = conn.execution_options(yield_per=10_000).execute(
                query.order_by(table.c.time_s, table.c.id)
            )
            for part in result.partitions():
                writer.writerows(part)
        logger.info("exported run %d to %s", run.id, path)
        return path
