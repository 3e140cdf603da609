"""The writer thread: drains a bounded queue into the history database in batches.

The training and sampler threads call the ``put_*`` methods, which never block: when the queue is
full the item is dropped and counted, and the writer records a ``samples_dropped`` event with the
count at its next flush. Each flush is one transaction (Core ``insert`` executemany per table) and
also writes the run's heartbeat, which readers use to tell a live run from a crashed one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Engine, insert, update
from sqlalchemy.exc import OperationalError

from edo_monitor.readings import Reading
from edo_monitor.store.schema import Event, ModuleStat, Run, Sample

__all__ = ["Writer"]

logger = logging.getLogger(__name__)

_STOP = object()
_TABLES = (("samples", Sample), ("events", Event), ("module_stats", ModuleStat))


class Writer:
    """Background writer for one run.

    Args:
        engine: an engine from :func:`edo_monitor.store.engine.open_engine` (read-write).
        run_id: ``runs.id`` every row belongs to.
        queue_size: capacity of the bounded queue (items: samples, events, module rows).
        flush_interval_s: longest time an item waits before it is written; also the heartbeat
            period.
        batch_size: a flush happens early once this many items are waiting.
    """

    def __init__(
        self,
        engine: Engine,
        run_id: int,
        *,
        queue_size: int = 10_000,
        flush_interval_s: float = 0.5,
        batch_size: int = 1_000,
    ) -> None:
        self.engine = engine
        self.run_id = run_id
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._dropped = 0
        self._dropped_recorded = 0
        self._thread = threading.Thread(target=self._loop, name="edo-writer", daemon=True)
        self._error_logged = False
        #: rows written so far, by table name (read by tests and benchmarks)
        self.written: dict[str, int] = {"samples": 0, "events": 0, "module_stats": 0}
        self.flushes = 0
        #: extra ``runs`` columns written with each heartbeat (e.g. ``{"steps": 12}``)
        self.run_values: dict[str, Any] = {}

    # -- producer side (any thread, never blocks) ----------------------------------------------
    @property
    def dropped(self) -> int:
        """Items dropped because the queue was full."""
        return self._dropped

    def _put(self, item: tuple[str, Any]) -> bool:
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self._dropped += 1
            return False

    def put_sample(self, reading: Reading) -> bool:
        """Queue one sample; False (and counted) when the queue is full."""
        return self._put(("samples", reading.as_dict()))

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
        while True:
            try:
                self._queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error(
                "history writer did not stop within %.0f s; some rows may be lost", timeout_s
            )

    @property
    def alive(self) -> bool:
        """Whether the writer thread runs."""
        return self._thread.is_alive()

    # -- consumer side ---------------------------------------------------------------------------
    def _loop(self) -> None:
        pending: dict[str, list[dict[str, Any]]] = {"samples": [], "events": [], "module_stats": []}
        count = 0
        deadline = time.monotonic() + self.flush_interval_s
        stop = False
        while not stop:
            timeout = max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
                if item is _STOP:
                    stop = True
                else:
                    table, row = item
                    pending[table].append(row)
                    count += 1
                    # drain whatever is already waiting without blocking
                    while count < self.batch_size:
                        item = self._queue.get_nowait()
                        if item is _STOP:
                            stop = True
                            break
                        table, row = item
                        pending[table].append(row)
                        count += 1
            except queue.Empty:
                pass
            if stop or count >= self.batch_size or time.monotonic() >= deadline:
                if self._flush(pending):
                    pending = {"samples": [], "events": [], "module_stats": []}
                    count = 0
                deadline = time.monotonic() + self.flush_interval_s

    def _flush(self, pending: dict[str, list[dict[str, Any]]]) -> bool:
        dropped = self._dropped
        new_drops = dropped - self._dropped_recorded
        now = time.time()
        if new_drops:
            pending["events"].append(
                {
                    "time_s": now,
                    "step": -1,
                    "kind": "samples_dropped",
                    "message": f"{new_drops} item(s) dropped (queue full or rows unwritable)",
                    "data": {"count": new_drops, "total": dropped},
                }
            )
        try:
            with self.engine.begin() as conn:
                for table, model in _TABLES:
                    for rows in _same_keys(pending[table]):
                        for r in rows:
                            r["run_id"] = self.run_id
                        conn.execute(insert(model), rows)
                values: dict[str, Any] = {**self.run_values, "heartbeat_at_s": now}
                if new_drops:
                    values["samples_dropped"] = dropped
                conn.execute(update(Run).where(Run.id == self.run_id).values(**values))
        except Exception as exc:  # the database must never take the training down
            if new_drops:
                pending["events"].pop()
            retry = isinstance(exc, OperationalError)  # locked, I/O, server gone: try again
            if not self._error_logged:
                logger.exception(
                    "history writer cannot write to %s; %s",
                    self.engine.url,
                    "retrying" if retry else "dropping the batch",
                )
                self._error_logged = True
            if not retry:  # bad rows never get better: drop them (counted) instead of looping
                self._dropped += sum(len(rows) for rows in pending.values())
                return True
            # keep the batch for the next try, but bounded: beyond 100k rows, drop the oldest
            for rows in pending.values():
                if len(rows) > 100_000:
                    excess = len(rows) - 100_000
                    del rows[:excess]
                    self._dropped += excess
            return False
        for table, rows in pending.items():
            self.written[table] += len(rows)
        self._dropped_recorded = dropped
        self.flushes += 1
        return True


def _same_keys(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split rows into runs with the same keys (one executemany needs one parameter shape)."""
    groups: dict[frozenset[str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(frozenset(row), []).append(row)
    return list(groups.values())
