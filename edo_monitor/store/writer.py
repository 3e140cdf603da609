"""The writer thread: drains a bounded queue into the history database in batches.

The training and sampler threads call the ``put_*`` methods, which never block: when the queue is
full the item is dropped and counted, and the writer records a ``samples_dropped`` event with the
count at its next flush. Each flush is one transaction and also writes the run's heartbeat,
which readers use to tell a live run from a crashed one.

Samples wait as the ``Reading`` objects themselves, become tuples in ``SAMPLE_FIELDS`` order at
the flush, and are written with :func:`edo_monitor.store.engine.write_samples` (one positional
DBAPI ``executemany``, and the rollups folded in from the same tuples); every sample has the same
columns. Events and module rows, whose keys vary, are written with Core ``insert`` executemany,
one per group of rows with the same keys. The writer keeps one connection between flushes
(replaced after an error).

Nothing is lost without being counted (:attr:`Writer.not_written`, by table): rows dropped because
the queue was full, rows the database refused (a value it cannot store), rows still waiting when
the writer gives up at :meth:`Writer.close` on a database that keeps failing (disk full, server
gone: a transient error, :func:`edo_monitor.store.retry.is_transient`, tried again on every flush
until then), and rows held back because the database file was deleted or replaced while the run
went on. An SQLite file's identity (device and inode) is taken when the writer starts and
checked before every flush: writing on into a deleted or replaced file would "succeed" into a
file nobody can read, so from then on rows are counted, not written, and the problem is logged
once (:attr:`Writer.problem`). The count goes into ``runs.samples_dropped`` whenever a flush
succeeds and into the log at ``close()``.

A database that fails and then works again (a PostgreSQL connection terminated by an
administrator or a failover, an SQLite file locked for a while) loses nothing: the batch is kept,
the writer logs one warning line (no traceback: nothing was lost) and, in the first transaction
that succeeds again, writes a ``store_reconnected`` event (``data``: the failed tries, the
seconds without the database, the first error). A traceback is logged only where rows are lost
(a batch the database refuses).

An integer that SQLite cannot store (2**63 or more, a driver's "not available" marker that got
through) makes the flush fail with ``OverflowError``: such values are replaced by ``NULL`` (each
counted in :attr:`Writer.values_nulled`, logged once) and the flush is tried again; a string
with a NUL character or longer than its column is stored fitted (:mod:`edo_monitor.store.fitting`,
counted in :attr:`Writer.values_fitted`). One bad value never stops the history.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from operator import attrgetter
from typing import Any, ClassVar

from sqlalchemy import Connection, Engine, bindparam, insert, update

from edo_monitor.errors import StoreError
from edo_monitor.probes.readings import SAMPLE_FIELDS, Reading
from edo_monitor.store.engine import write_samples
from edo_monitor.store.fitting import fit_text, null_out_of_range
from edo_monitor.store.models import (
    Event,
    ModuleStat,
    Run,
    Snapshot,
)
from edo_monitor.store.paths import database_file, shown_url
from edo_monitor.store.retry import CLOSE_TRIES, Outage, describe, is_transient
from edo_monitor.store.retry import reconnect_message as _reconnect_message

__all__ = ["Writer"]

logger = logging.getLogger(__name__)

_TABLES = (("events", Event), ("module_stats", ModuleStat), ("snapshots", Snapshot))
#: a Reading's values in ``SAMPLE_FIELDS`` order, as one tuple (C speed, no dict per sample)
_SAMPLE_VALUES = attrgetter(*SAMPLE_FIELDS)


class Writer:
    """Background writer for one run.

    Args:
        engine: an engine from :func:`edo_monitor.store.engine.open_engine` (read-write).
        run_id: ``runs.id`` every row belongs to (``None`` in :class:`DeviceWriter`: rows of no
            run).
        queue_size: capacity of the bounded queue (items: samples, events, module rows).
        flush_interval_s: longest time an item waits before it is written; also the heartbeat
            period.
        batch_size: a flush happens early once this many items are waiting.
        on_problem: called once (from the writer thread) with a message when the database file
            is deleted or replaced, or when the writer gives up with rows unwritten.

    The queue is two ``collections.deque`` (samples; events and module rows) whose ``append`` and
    ``popleft`` are atomic: a ``put_*`` costs a length check and an append, with no lock, and the
    writer thread is woken only when a batch is ready (else it wakes at the flush interval).
    """

    #: tables whose rows wait as dicts and are inserted with Core executemany: (name, ORM class)
    ROW_TABLES: tuple[tuple[str, Any], ...] = _TABLES
    #: how the log names each table's rows
    LABELS: ClassVar[dict[str, str]] = {
        "samples": "sample(s)",
        "events": "event(s)",
        "module_stats": "module row(s)",
        "snapshots": "snapshot(s)",
    }

    def __init__(
        self,
        engine: Engine,
        run_id: int | None,
        *,
        queue_size: int = 10_000,
        flush_interval_s: float = 1.0,
        batch_size: int = 1_000,
        on_problem: Any = None,
    ) -> None:
        self.engine = engine
        self._on_problem = on_problem
        self.run_id = run_id
        self.flush_interval_s = flush_interval_s
        self.batch_size = max(1, batch_size)
        self.queue_size = max(1, queue_size)
        self._samples: deque[Reading] = deque()
        self._others: deque[tuple[str, dict[str, Any]]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._conn: Connection | None = None
        self._dropped = 0
        self._dropped_recorded = 0
        self._thread = threading.Thread(target=self._loop, name="edo-writer", daemon=True)
        self._error_logged = False
        self._last_error = ""
        #: the outage in progress (failed tries since the last write that worked)
        self._outage = Outage("history writer", engine.url)
        #: outages the writer recovered from without losing rows (a ``store_reconnected`` each)
        self.reconnects = 0
        #: the writer's own events written so far, by kind (``samples_dropped``,
        #: ``store_reconnected``; the daemon's are device events)
        self.own_events: dict[str, int] = {}
        self._closed = False
        #: the batch the thread is writing (its ``pending``), and the lock under which a flush
        #: commits it or :meth:`close`, out of time, counts it: one or the other, never both
        self._in_flight: dict[str, list[Any]] = {}
        self._commit_lock = threading.Lock()
        self._abandoned = False
        self._names = ("samples", *(name for name, _ in self.ROW_TABLES))
        #: rows written so far, by table name (read by tests and benchmarks)
        self.written: dict[str, int] = dict.fromkeys(self._names, 0)
        self.flushes = 0
        #: extra ``runs`` columns written with each heartbeat (e.g. ``{"steps": 12}``)
        self.run_values: dict[str, Any] = {}
        #: rows not written, by table (queue full, refused, unwritable at close, file gone)
        self.not_written: dict[str, int] = dict.fromkeys(self._names, 0)
        #: values replaced by NULL because SQLite cannot store them (integers beyond 64 bits)
        self.values_nulled = 0
        #: strings stored fitted to their column (NUL → U+FFFD, clipped to the column's length)
        self.values_fitted = 0
        #: why rows are not being written (``None`` while all is well)
        self.problem: str | None = None
        #: the database file was deleted or replaced during the run
        self.file_lost = False
        self._path = database_file(engine.url)
        self._identity = self._file_identity()

    # -- producer side (any thread, never blocks) ----------------------------------------------
    @property
    def dropped(self) -> int:
        """Items not written, all tables (see :attr:`not_written`)."""
        return self._dropped

    def _count(self, table: str, n: int) -> None:
        if n:
            self.not_written[table] += n
            self._dropped += n

    def _file_identity(self) -> tuple[int, int] | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _file_problem(self) -> str | None:
        """Why the database file is no longer the one the run started in (``None``: it is)."""
        if self._identity is None or self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return f"history database {str(self._path)!r} was deleted during the run"
        except OSError as exc:
            return f"history database {str(self._path)!r} cannot be checked: {exc}"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"history database {str(self._path)!r} was replaced by another file mid-run"
        return None

    def _set_problem(self, message: str) -> None:
        if self.problem is not None:
            return
        self.problem = message
        logger.warning("history writer: %s; rows from now on are counted, not written", message)
        if self._on_problem is not None:
            try:
                self._on_problem(message)
            except Exception:
                logger.debug("on_problem callback failed", exc_info=True)

    def _waiting(self) -> int:
        return len(self._samples) + len(self._others)

    def put_sample(self, reading: Reading) -> bool:
        """Queue one sample; False (and counted) when the queue is full."""
        samples = self._samples
        waiting = len(samples) + len(self._others)
        if waiting >= self.queue_size or self._closed:
            self.not_written["samples"] += 1
            self._dropped += 1
            return False
        samples.append(reading)
        if waiting + 1 >= self.batch_size and not self._wake.is_set():
            self._wake.set()
        return True

    def _put(self, item: tuple[str, dict[str, Any]]) -> bool:
        waiting = self._waiting()
        if waiting >= self.queue_size or self._closed:
            self.not_written[item[0]] += 1
            self._dropped += 1
            return False
        self._others.append(item)
        if waiting + 1 >= self.batch_size and not self._wake.is_set():
            self._wake.set()
        return True

    def put_event(
        self,
        kind: str,
        message: str,
        *,
        step: int,
        data: Mapping[str, Any] | None = None,
        time_s: float | None = None,
    ) -> bool:
        """Queue one event; False (and counted) when the queue is full."""
        row = {
            "time_s": time.time() if time_s is None else time_s,
            "step": step,
            "kind": kind,
            "message": message,
            "data": dict(data or {}),
        }
        return self._put(("events", row))

    def put_snapshot(self, row: Mapping[str, Any], *, event_kind: str, event_time_s: float) -> bool:
        """Queue one ``snapshots`` row (its columns but ``run_id`` and ``event_id``), linked at
        the flush to the event of ``event_kind`` queued with ``time_s=event_time_s`` (events are
        inserted before snapshots, in the same or an earlier flush)."""
        return self._put(("snapshots", {**row, "_event": (event_kind, event_time_s)}))

    def put_module_stat(self, row: Mapping[str, Any]) -> bool:
        """Queue one ``module_stats`` row (keys are that table's columns, without run_id)."""
        return self._put(("module_stats", dict(row)))

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write everything queued, then stop the thread (waits at most ``timeout_s``)."""
        if not self._thread.is_alive():
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abandon(timeout_s)
        self._report_not_written()

    def _abandon(self, timeout_s: float) -> None:
        """The thread is still in a flush after ``timeout_s`` (a lock another connection holds,
        a server that does not answer): count its batch and everything queued as not written,
        and make sure that batch is not committed later. They were lost uncounted when the
        process exited under the thread (``samples_dropped`` 0 for 62 samples missing)."""
        with self._commit_lock:
            self._abandoned = self._closed = True
            for table, rows in self._in_flight.items():
                self._count(table, len(rows))
            self._count_queued()
        self._set_problem(
            f"the database did not take the run's last rows within {timeout_s:g} s "
            f"({self._last_error or 'a write still waiting'})"
        )

    def _report_not_written(self) -> None:
        """Log what was not written (always, when anything was)."""
        if not self._dropped:
            return
        logger.warning(
            "history: %s not written to %s%s",
            ", ".join(f"{self.not_written[t]} {what}" for t, what in self.LABELS.items()),
            shown_url(self.engine.url),
            f" ({self.problem})" if self.problem else "",
        )

    @property
    def alive(self) -> bool:
        """Whether the writer thread runs."""
        return self._thread.is_alive()

    # -- consumer side ---------------------------------------------------------------------------
    def _drain(self, pending: dict[str, list[Any]], room: int) -> int:
        """Move up to ``room`` waiting items into ``pending``; returns how many (none once
        :meth:`close` gave up waiting: it counted them)."""
        with self._commit_lock:
            return 0 if self._abandoned else self._move(pending, room)

    def _move(self, pending: dict[str, list[Any]], room: int) -> int:
        if room <= 0:
            return 0
        samples = self._samples
        n = min(len(samples), room)
        if n:
            pop = samples.popleft
            pending["samples"] += [pop() for _ in range(n)]
        others = self._others
        m = min(len(others), room - n)
        for _ in range(m):
            table, row = others.popleft()
            pending[table].append(row)
        return n + m

    def _connection(self) -> Connection:
        """The writer's own connection, kept between flushes (no pool round trip per flush)."""
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            self._conn = self.engine.connect()
        return self._conn

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # already broken: nothing to give back
                logger.debug("closing the writer's connection failed", exc_info=True)

    def _loop(self) -> None:
        try:
            self._run()
        finally:
            self._closed = True  # from now on a put is counted, not queued
            self._release()

    def _pending(self) -> dict[str, list[Any]]:
        return {name: [] for name in self._names}

    def _run(self) -> None:
        pending = self._in_flight = self._pending()
        count = 0
        failed = False
        tries_left = CLOSE_TRIES  # flushes tried after close() while it fails
        deadline = time.monotonic() + self.flush_interval_s
        while True:
            stopping = self._stopping
            full = count + self._waiting() >= self.batch_size
            if not stopping and (failed or not full):
                self._wake.wait(max(0.0, deadline - time.monotonic()))
                self._wake.clear()
            count += self._drain(pending, self.batch_size - count)
            last = stopping and not self._waiting()
            if last or count >= self.batch_size or time.monotonic() >= deadline:
                failed = not self._flush(pending)
                deadline = time.monotonic() + self.flush_interval_s
                if self._abandoned:  # close() counted the batch and the queues
                    return
                if failed and stopping:  # closing: a few more tries, then give up (counted)
                    tries_left -= 1
                    if tries_left <= 0:
                        self._give_up(pending)
                        return
                    time.sleep(min(self.flush_interval_s, 1.0))
                    continue
                if not failed:
                    with self._commit_lock:
                        pending = self._in_flight = self._pending()
                    count = 0
                if last:
                    return

    def _count_queued(self) -> None:
        """Count every row still queued as not written, and empty the queues."""
        self._count("samples", len(self._samples))
        self._samples.clear()
        while self._others:
            table, _ = self._others.popleft()
            self._count(table, 1)

    def _count_batch(self, pending: dict[str, list[Any]]) -> None:
        """Count the thread's batch ``pending`` as not written, unless :meth:`close` gave up
        waiting for it and counted it already."""
        with self._commit_lock:
            if not self._abandoned:
                for table, rows in pending.items():
                    self._count(table, len(rows))

    def _give_up(self, pending: dict[str, list[Any]]) -> None:
        """Count every row still pending or waiting as not written (the database kept failing)."""
        self._set_problem(f"the database kept failing ({self._last_error})")  # may queue one
        self._count_batch(pending)
        for rows in pending.values():
            rows.clear()
        self._count_queued()

    def _flush(self, pending: dict[str, list[Any]]) -> bool:
        problem = self.problem or self._file_problem()
        if problem is not None:  # a deleted or replaced file: count the rows, write nothing
            self.file_lost = True
            self._set_problem(problem)
            self._count_batch(pending)
            return True
        try:
            return self._write(pending)
        except OverflowError as exc:  # an integer SQLite cannot store: NULL it, try again
            self._release()
            nulled = null_out_of_range(pending, [name for name, _ in self.ROW_TABLES])
            self.values_nulled += nulled
            logger.warning(
                "history writer: %d value(s) beyond SQLite's 64-bit integers written as NULL (%s)",
                nulled,
                exc,
            )
            if not nulled:  # not ours to fix: drop the batch, counted
                self._count_batch(pending)
                return True
            try:
                return self._write(pending)
            except OverflowError:
                self._count_batch(pending)
                return True

    def _fit(self, table: str, rows: list[dict[str, Any]]) -> None:
        fitted = fit_text(table, rows)
        if fitted and not self.values_fitted:
            logger.warning(
                "history writer: a %s string holding a NUL character or longer than its "
                "column was stored fitted (NUL as U+FFFD, clipped with an ellipsis)",
                table,
            )
        self.values_fitted += fitted

    # -- what differs between the run's writer and the daemon's (overridden by DeviceWriter) --
    def _drop_row(self, now: float, new_drops: int, total: int) -> tuple[str, dict[str, Any]]:
        """The row recording ``new_drops`` more dropped items: ``(table, row)``."""
        return "events", {
            "time_s": now,
            "step": -1,
            "kind": "samples_dropped",
            "message": f"{new_drops} item(s) dropped (queue full or rows unwritable)",
            "data": {"count": new_drops, "total": total},
        }

    def _reconnect_row(self, now: float, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The row recording that the database works again after failed tries: ``(table,
        row)``; ``data`` holds ``tries``, ``outage_s`` and ``error``."""
        return "events", {
            "time_s": now,
            "step": -1,
            "kind": "store_reconnected",
            "message": _reconnect_message(data),
            "data": data,
        }

    def _prepare(self, conn: Connection, table: str, rows: list[dict[str, Any]]) -> None:
        """Complete ``rows`` of ``table`` before their insert (inside the flush's transaction)."""
        for r in rows:
            r["run_id"] = self.run_id
        if table == "snapshots":
            from edo_monitor.store.snapshot_store import link_events

            link_events(conn, self.run_id, rows)

    def _after_rows(self, conn: Connection, now: float, new_drops: int, total: int) -> None:
        """Last statement of a flush's transaction: the run's heartbeat (and drop count)."""
        values: dict[str, Any] = {**self.run_values, "heartbeat_at_s": now}
        if new_drops:
            values["samples_dropped"] = total
        conn.execute(_heartbeat(tuple(values)), {**values, "edo_run_id": self.run_id})

    def _write(self, pending: dict[str, list[Any]]) -> bool:
        dropped = self._dropped
        new_drops = dropped - self._dropped_recorded
        now = time.time()
        tried_at = time.monotonic()  # a locked database fails only after the busy timeout
        drop_table = back_table = None
        own: list[dict[str, Any]] = []  # the writer's own rows in this flush
        if new_drops:
            drop_table, drop_row = self._drop_row(now, new_drops, dropped)
            pending[drop_table].append(drop_row)
            own.append(drop_row)
        outage = self._outage.active
        try:
            conn = self._connection()
            with conn.begin() as transaction:
                if outage:  # in the transaction that shows the database works again
                    back = self._outage.data()  # the lock is held from here on: it is over
                    back_table, back_row = self._reconnect_row(now, back)
                    pending[back_table].append(back_row)
                    own.append(back_row)
                if pending["samples"]:
                    tuples = list(map(_SAMPLE_VALUES, pending["samples"]))
                    write_samples(conn, self.run_id, tuples)  # type: ignore[arg-type]
                for table, model in self.ROW_TABLES:
                    self._fit(table, pending[table])
                    for rows in _same_keys(pending[table]):
                        self._prepare(conn, table, rows)
                        conn.execute(insert(model), rows)
                self._after_rows(conn, now, new_drops, dropped)
                with self._commit_lock:
                    if self._abandoned:  # close() gave up waiting and counted these rows
                        transaction.rollback()
                        return True
                    transaction.commit()
        except OverflowError:
            _unappend(pending, back_table, drop_table)
            raise
        except Exception as exc:  # the database must never take the training down
            self._last_error = describe(exc)
            self._release()  # the next try starts on a fresh connection
            _unappend(pending, back_table, drop_table)
            # locked, I/O, server gone: tried again; bad rows never get better: drop them
            # (counted) instead of looping
            if not is_transient(exc):
                if not self._error_logged:  # rows are lost: the whole story, once
                    if isinstance(exc, StoreError):  # ours, whole in its message (a damaged file)
                        logger.error("history writer: %s; dropping the batch", exc)
                    else:
                        logger.exception(
                            "history writer cannot write to %s; dropping the batch",
                            self.engine.url,
                        )
                    self._error_logged = True
                self._count_batch(pending)
                return True
            self._outage.failed(exc, tried_at)  # one line per outage; nothing is lost yet
            # keep the batch for the next try, but bounded: beyond 100k rows, drop the oldest
            with self._commit_lock:
                for table, rows in pending.items():
                    if len(rows) > 100_000 and not self._abandoned:
                        excess = len(rows) - 100_000
                        del rows[:excess]
                        self._count(table, excess)
            return False
        for table, rows in pending.items():
            self.written[table] += len(rows)
        for row in own:
            self.own_events[row["kind"]] = self.own_events.get(row["kind"], 0) + 1
        self._dropped_recorded = dropped
        self.flushes += 1
        if outage:
            self._outage.recovered(back)
            self.reconnects += 1
        return True


def _unappend(pending: dict[str, list[Any]], *tables: str | None) -> None:
    """Take back the rows a failed flush appended (last first: the reconnect row, the drop
    row)."""
    for table in tables:
        if table is not None:
            pending[table].pop()


def _heartbeat(columns: tuple[str, ...]) -> Any:
    """``UPDATE runs SET <columns> WHERE id = :edo_run_id``, built once per set of columns (a
    statement object SQLAlchemy has seen is executed from its compiled cache, ~4x cheaper)."""
    stmt = _HEARTBEATS.get(columns)
    if stmt is None:
        if len(_HEARTBEATS) > 64:
            _HEARTBEATS.clear()
        stmt = _HEARTBEATS[columns] = (
            update(Run)
            .where(Run.id == bindparam("edo_run_id"))
            .values({c: bindparam(c) for c in columns})
        )
    return stmt


_HEARTBEATS: dict[tuple[str, ...], Any] = {}


def _same_keys(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split rows into runs with the same keys (one executemany needs one parameter shape)."""
    groups: dict[frozenset[str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(frozenset(row), []).append(row)
    return list(groups.values())
