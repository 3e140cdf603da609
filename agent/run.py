"""The run's record in the history database and its lifecycle: :class:`RunRecord`,
:class:`RunSummary`, and the registry of watched models.

:class:`RunRecord` opens the database engine, inserts the ``runs`` row when the run starts,
starts the writer thread (:class:`edo_monitor.store.writer.Writer`) that every other part hands
rows to, and records how the run ended (status, error, steps, rows not written). The registry
keeps one open ``watch()`` per model object in a process.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from sqlalchemy import Connection, insert, select, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from torch import nn

from edo_monitor.errors import AlreadyWatchedError, StoreError
from edo_monitor.store.dialect import is_postgres
from edo_monitor.store.engine import close_engine, insert_job, open_engine
from edo_monitor.store.fitting import fit_text
from edo_monitor.store.models import Run
from edo_monitor.store.paths import shown_database
from edo_monitor.store.retry import describe, is_transient, retried
from edo_monitor.store.schema import next_run_id
from edo_monitor.store.writer import Writer
from edo_monitor.units import format_bytes

__all__ = ["RunRecord", "RunSummary", "claim_model", "release_model"]

logger = logging.getLogger(__name__)

_watched_lock = threading.Lock()
_watched: dict[int, weakref.ref[nn.Module]] = {}


def claim_model(model: nn.Module | None) -> None:
    """Mark ``model`` watched by an open block.

    Raises:
        AlreadyWatchedError: another open ``watch()`` block watches the same model object.
    """
    if model is None:
        return
    with _watched_lock:
        ref = _watched.get(id(model))
        if ref is not None and ref() is model:
            raise AlreadyWatchedError(
                f"model {type(model).__name__} (id {id(model):#x}) is already "
                "watched by an open watch() block; watch each model once"
            )
        _watched[id(model)] = weakref.ref(model)


def release_model(model: nn.Module | None) -> None:
    """Forget ``model`` (the block that watched it has ended)."""
    if model is None:
        return
    with _watched_lock:
        ref = _watched.get(id(model))
        if ref is not None and ref() is model:
            del _watched[id(model)]


@dataclass(frozen=True)
class RunSummary:
    """What :meth:`Monitor.summary` reports.

    Attributes:
        run_id, run_uuid, run_name, status, device_kind, db_url: identify the run.
        steps: optimizer steps (or ``Monitor.step()`` calls) seen.
        samples: readings taken. samples_dropped: rows (samples, events, module rows) not
            written to the history: queue full, refused by the database, unwritable when the run
            ended (disk full), or held back because the database file was deleted or replaced.
        samples_written: samples the history database holds for the run.
        rows_not_written: ``samples_dropped`` by table (``samples``, ``events``,
            ``module_stats``).
        recorded_status: the status the database holds for the run after it ended (``None``:
            the end could not be recorded, so the stored run still says ``running``).
        store_problem: why rows were not written (``None`` when every row was).
        budget_bytes: the capacity the policy measures against (``None`` without a budget on a
            CPU).
        peak_in_use_bytes, peak_allocated_bytes, peak_reserved_bytes, peak_activations_bytes:
            peaks over the run's readings (``None`` where the source was unavailable); on CUDA
            the allocated peak is also the allocator's own peak stat once the run raised it, so
            it holds a peak between two readings.
        min_free_fraction: lowest ``free_fraction`` seen.
        events: count of events by kind (the writer's own too: ``samples_dropped``,
            ``store_reconnected``). actions: the ``action`` events' data, in order.
        agent_errors: failures inside the agent by ``"where:ExceptionType"`` (the hooks, the
            sampler ...), every occurrence counted; each kind is one ``agent_error`` event.
        job_id, rank, world_size: the run's place in a multi-rank job (``None`` outside an
            initialised process group).
    """

    run_id: int
    run_uuid: str
    run_name: str
    status: str
    device_kind: str
    db_url: str
    steps: int
    samples: int
    samples_dropped: int
    budget_bytes: int | None
    peak_in_use_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_activations_bytes: int | None
    min_free_fraction: float | None
    events: dict[str, int] = field(default_factory=dict)
    actions: tuple[dict[str, Any], ...] = ()
    agent_errors: dict[str, int] = field(default_factory=dict)
    samples_written: int = 0
    rows_not_written: dict[str, int] = field(default_factory=dict)
    recorded_status: str | None = None
    store_problem: str | None = None
    job_id: str | None = None
    rank: int | None = None
    world_size: int | None = None

    def __str__(self) -> str:
        """A readable multi-line summary (what ``print(monitor.summary())`` shows)."""
        mff = self.min_free_fraction
        lines = [
            f"run {self.run_id} ({self.run_name}): {self.status}, {self.device_kind}, "
            f"budget {format_bytes(self.budget_bytes)}"
            + (
                f", rank {self.rank} of {self.world_size} in job {self.job_id}"
                if self.job_id is not None
                else ""
            ),
            f"steps {self.steps}, samples {self.samples} ({self.samples_written} written, "
            f"{self.samples_dropped} row(s) not written)",
            f"peak in use {format_bytes(self.peak_in_use_bytes)}, allocated "
            f"{format_bytes(self.peak_allocated_bytes)}, reserved "
            f"{format_bytes(self.peak_reserved_bytes)}, activations "
            f"{format_bytes(self.peak_activations_bytes)}",
            f"min free {'N/A' if mff is None else f'{mff:.1%}'}",
            f"events {self.events or 'none'}",
        ]
        if self.agent_errors:
            lines.append(f"agent errors (training went on) {self.agent_errors}")
        lines += [
            f"action {a.get('action')} on {a.get('target')}: {_saved(a)}" for a in self.actions
        ]
        if self.samples_dropped or self.store_problem:
            nw = self.rows_not_written
            lines.append(
                f"NOT WRITTEN to the history: {nw.get('samples', 0)} sample(s), "
                f"{nw.get('events', 0)} event(s), {nw.get('module_stats', 0)} module row(s)"
                + (f" ({self.store_problem})" if self.store_problem else "")
            )
        if self.status not in ("running", "created") and self.recorded_status != self.status:
            lines.append(
                f"the database still records this run as {self.recorded_status or 'running'}"
            )
        lines.append(f"database {self.database}")
        return "\n".join(lines)

    @property
    def database(self) -> str:
        """The history as a user names it: an SQLite file's path (:attr:`db_url` leaves spaces
        as they are and percent-encodes other characters: ``%C3%BC`` for ``ü``), else
        :attr:`db_url` (its password hidden)."""
        from sqlalchemy.engine import make_url

        return shown_database(make_url(self.db_url))


class RunRecord:
    """The run's row in ``runs``, its engine and its writer thread.

    Args:
        db_url: the history database (a SQLAlchemy URL, checked writable by the caller).
        run_uuid: the run's UUID (``runs.uuid``).
        queue_size: capacity of the writer's queue (items beyond it are dropped and counted).

    Attributes:
        run_id: ``runs.id`` (``-1`` until :meth:`open`).
        engine: the writer engine (``None`` until :meth:`open`).
        writer: the writer thread (``None`` until :meth:`open`).
        recorded_status: the status the database holds after :meth:`close` (``None``: the end
            could not be recorded).
    """

    def __init__(self, db_url: URL, run_uuid: str, *, queue_size: int) -> None:
        self.db_url = db_url
        self.run_uuid = run_uuid
        self.queue_size = queue_size
        self.run_id = -1
        self.engine: Any = None
        self.writer: Writer | None = None
        #: when the run ended (set by :meth:`close_writer`; ``None`` before)
        self.ended_at_s: float | None = None
        self.recorded_status: str | None = None

    def open(
        self,
        values: dict[str, Any],
        on_problem: Callable[[str], None],
        job: dict[str, Any] | None = None,
    ) -> int:
        """Open the engine (creating or upgrading the schema), insert the ``runs`` row with
        ``values`` (the ``Run`` columns besides uuid, host, times, status, torch version and
        counters) and start the writer thread. With ``job`` (the ``jobs`` columns but
        ``created_at_s``), the job's row is inserted first unless another rank did, in the same
        transaction.

        The transaction is tried again on a transient error (a dropped connection, a locked
        file: :func:`edo_monitor.store.retry.retried`, as the writer does); a try whose commit
        went through unanswered is found by the run's UUID, not inserted twice.

        Returns:
            The new ``runs.id``.

        Raises:
            StoreError: the database cannot be opened or the row cannot be inserted.
        """
        self.engine = open_engine(self.db_url)
        now = time.time()

        def insert_run(conn: Connection) -> int:
            done = conn.execute(select(Run.id).where(Run.uuid == self.run_uuid)).scalar()
            if done is not None:  # an earlier try committed; its answer was lost
                return int(done)
            if job is not None:
                insert_job(conn, {**job, "created_at_s": now})
            # SQLite: never a pruned run's id (PostgreSQL's sequence never reuses one)
            fresh_id = {} if is_postgres(conn) else {"id": next_run_id()}
            result = conn.execute(
                insert(Run).values(
                    **fresh_id,
                    uuid=self.run_uuid,
                    host=socket.gethostname(),
                    started_at_s=now,
                    heartbeat_at_s=now,
                    status="running",
                    torch_version=torch.__version__,
                    steps=0,
                    samples_dropped=0,
                    **values,
                )
            )
            return int(result.inserted_primary_key[0])

        try:
            self.run_id = retried(self.engine, insert_run, what="edo-monitor: the run's row")
        except SQLAlchemyError as exc:
            raise StoreError(
                f"cannot record the run in history database {self.db_url.database or self.db_url}"
                f": {getattr(exc, 'orig', None) or exc}"
            ) from None
        self.writer = Writer(
            self.engine, self.run_id, queue_size=self.queue_size, on_problem=on_problem
        )
        self.writer.start()
        return self.run_id

    def close_writer(self, steps: int) -> None:
        """Flush and stop the writer thread, the run's step count written with the last batch.
        The run ended now (:meth:`record_end` records this time): a flush that waits for a
        locked database does not stretch its duration."""
        self.ended_at_s = time.time()
        if self.writer is not None:
            self.writer.run_values["steps"] = steps
            self.writer.close()

    def record_end(self, status: str, error: str | None, steps: int) -> None:
        """Write how the run ended (after :meth:`close_writer`) and dispose of the engine.

        The update is tried again on a transient error (a dropped connection, a failover, a
        locked file), as the writer's last flush is (:func:`edo_monitor.store.retry.retried`).
        Never raises: a failure is logged, and :attr:`recorded_status` stays ``None``.
        """
        writer = self.writer
        if writer is not None and writer.file_lost:
            # the file was deleted or replaced: the run's row is not there to update
            logger.warning(
                "edo-monitor: the end of run %d is not recorded: %s", self.run_id, writer.problem
            )
        elif self.engine is not None and self.run_id >= 0:
            end = {
                "status": status,
                "error": error,
                "ended_at_s": self.ended_at_s or time.time(),
                "steps": steps,
                "samples_dropped": writer.dropped if writer else 0,
            }
            fit_text("runs", [end])  # the user's exception text: a surrogate, a NUL, any length

            def update_run(conn: Connection) -> int:
                stmt = update(Run).where(Run.id == self.run_id)
                return conn.execute(stmt.values(**end, heartbeat_at_s=time.time())).rowcount

            try:
                if retried(self.engine, update_run, what="edo-monitor: the end of the run") == 1:
                    self.recorded_status = status
            except Exception as exc:
                if is_transient(exc):  # the database stayed unreachable: one line, as outages are
                    logger.warning(
                        "edo-monitor: could not record the end of run %d (%s)",
                        self.run_id,
                        describe(exc),
                    )
                else:  # a refusal of the row: the traceback says why
                    logger.exception("edo-monitor: could not record the end of run %d", self.run_id)
        if self.engine is not None:
            close_engine(self.engine)  # the run's rows in the file itself, not only its -wal


def _saved(action: dict[str, Any]) -> str:
    """An applied action's saving as the summary says it: measured, or the estimate until a
    measurement came (``checkpoint_activations``: the next recorded forward)."""
    took = f"in {action.get('duration_s', 0.0):.3f} s"
    measured = action.get("measured_saved_bytes")
    if measured is not None:
        return (
            f"saved {format_bytes(measured)} measured on the next forward (estimated "
            f"{format_bytes(action.get('saved_bytes'))}) {took}"
        )
    if (action.get("details") or {}).get("after_is_estimate"):
        return f"saved {format_bytes(action.get('saved_bytes'))} (estimate) {took}"
    return f"saved {format_bytes(action.get('saved_bytes'))} {took}"
