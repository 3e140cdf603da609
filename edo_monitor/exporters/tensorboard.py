"""Readings and events into TensorBoard: what ``watch(..., tensorboard=)`` writes.

For people who look at TensorBoard rather than a terminal. A :class:`TensorBoardSink` belongs
to one :class:`~edo_monitor.Monitor`:

* each reading's main numbers (:data:`SCALAR_FIELDS`, those the reading has: allocator fields
  only on CUDA, ``free_fraction`` only with a budget) become scalars tagged ``edo/<column>`` —
  the ``samples`` table's column names — at the reading's ``step`` (plus
  :attr:`TensorBoardSink.step_offset`, below) with its ``time_s`` as wall time. They are written
  as rank-0 float32 tensors (``add_scalar(new_style=True)``: ``DT_FLOAT``, one ``float_val``),
  the one tensor form TensorBoard's default fast loader
  (tensorboard-data-server, ``data_compat.rs``) reads as a scalar besides ``simple_value`` —
  it drops double-precision ones, which only ``--load_fast=false`` shows. float32 holds integers
  exactly up to 2^24 (16 MiB as a byte count); above that a value is rounded to within a
  relative 6e-8 (2^-24: at most 8 bytes at 158 MiB, 512 bytes at 8 GiB). The history keeps the
  exact ints. TensorBoard's scalars dashboard shows them; ``EventAccumulator.Tensors(tag)``
  reads them back;
* each event (``decision``, ``action``, ``threshold_crossed``, ``oom`` ...) becomes text tagged
  ``edo/events/<kind>`` (torch's ``add_text`` stores it as ``edo/events/<kind>/text_summary``)
  at the step it was recorded at (plus the same offset): its message as inline code (TensorBoard
  renders text as Markdown, and ``cache_embedding`` would turn italic).

Threads: the training thread only appends events to a bounded queue (never waits on I/O); the
sampler thread writes them and the readings; the end of the run writes what is left, flushes,
and closes a writer the sink opened from a folder (one passed in is flushed, not closed). A
failing write goes to ``on_error`` (the monitor logs the first of a kind and records one
``agent_error`` event) and never reaches the training.

The step offset: a run counts its steps from 0, and the history keeps them so. A framework
callback that resumes a fit from a checkpoint (Lightning's ``fit(ckpt_path=)``, the Hugging Face
``Trainer``'s ``train(resume_from_checkpoint=)``) starts a new run whose step 0 is the
framework's step N; when the scalars go into the framework logger's own run (Lightning's
``tensorboard=True``, the ``Trainer``'s ``logging_dir``) they must sit on its x-axis, so the
callback sets :attr:`TensorBoardSink.step_offset` to N and every scalar and event is written at
``step + N``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edo_monitor.errors import ConfigError, missing_extra
from edo_monitor.probes.readings import Reading

__all__ = ["EVENT_TAG_PREFIX", "SCALAR_FIELDS", "TAG_PREFIX", "TensorBoardSink", "summary_writer"]

logger = logging.getLogger(__name__)

#: every tag starts with this: one section in TensorBoard
TAG_PREFIX = "edo/"
#: events: ``edo/events/<kind>`` (``add_text`` appends ``/text_summary``)
EVENT_TAG_PREFIX = "edo/events/"
#: the reading fields written as scalars (``edo/<field>``), when not ``None``
SCALAR_FIELDS: tuple[str, ...] = (
    "in_use_bytes",
    "free_fraction",
    "budget_bytes",
    "device_used_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "fragmentation",
    "params_bytes",
    "grads_bytes",
    "optimizer_state_bytes",
    "activations_bytes",
    "host_tier_bytes",
)
#: events waiting for the sampler thread beyond this are dropped (and counted)
MAX_PENDING_EVENTS = 10_000


def summary_writer() -> type:
    """``torch.utils.tensorboard.SummaryWriter`` (the ``[tensorboard]`` extra).

    Raises:
        ConfigError: the ``tensorboard`` package is not installed (the message names the extra).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise missing_extra("tensorboard=", "tensorboard", "tensorboard", exc) from None
    return SummaryWriter


def _check_log_dir(log_dir: str) -> None:
    """Refuse, before the run starts, a log folder that cannot be made: under a file, or in a
    read-only folder (the writer made later failed with a traceback from inside TensorBoard).
    Creates nothing.

    Raises:
        ConfigError: naming the path in the way.
    """
    probe = Path(log_dir).expanduser()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"tensorboard={log_dir!r} cannot be a log folder: {str(probe)!r} is a file; "
            "expected a folder path"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"tensorboard={log_dir!r} cannot be written: the folder {str(probe)!r} is read-only "
            "for this process"
        )


class TensorBoardSink:
    """Writes one run's readings (scalars) and events (text) to a TensorBoard ``SummaryWriter``.

    Args:
        target: a ``torch.utils.tensorboard.SummaryWriter``, or a log folder (str or
            ``os.PathLike``; ``~`` is the home folder) in which :meth:`open` makes one.
        on_error: called with each exception a write raises (any thread); never raised here.

    Raises:
        ConfigError: ``target`` is neither, or the ``tensorboard`` package is missing.
    """

    def __init__(self, target: Any, *, on_error: Callable[[BaseException], None]) -> None:
        writer_cls = summary_writer()
        self._writer_cls = writer_cls
        self._log_dir: str | None = None
        self.writer: Any = None
        if isinstance(target, (str, os.PathLike)):
            given = os.fspath(target)
            if not given:
                raise ConfigError("tensorboard='' is not a folder; expected a log folder path")
            _check_log_dir(given)
            self._log_dir = os.path.expanduser(given)  # "~/tb": the home's, as the check's
        elif isinstance(target, writer_cls):
            self.writer = target
        else:
            raise ConfigError(
                f"tensorboard={target!r} is neither a torch.utils.tensorboard.SummaryWriter nor "
                "a log folder (str or path)"
            )
        self._owned = self._log_dir is not None
        self._on_error = on_error
        self._events: deque[tuple[str, str, int, float]] = deque()
        self._lock = threading.Lock()  # one writer at a time (sampler, then the end of the run)
        self._closed = False
        #: events dropped because MAX_PENDING_EVENTS were waiting
        self.events_dropped = 0
        #: added to every reading's and event's step when written: the framework's step at the
        #: run's step 0 (a resumed fit's, set by the integrations; 0 otherwise)
        self.step_offset = 0

    @property
    def log_dir(self) -> str | None:
        """The folder the event files go to (``None`` before :meth:`open` for a folder that
        could not be opened)."""
        if self.writer is not None:
            return str(self.writer.get_logdir())
        return self._log_dir

    def open(self, rank: int | None = None) -> None:
        """Make the writer for a log folder (the run starts); errors go to ``on_error``. A rank
        of a multi-rank job (``rank`` not ``None``) writes into the folder's ``rank<N>``, so
        TensorBoard shows each rank as a run of its own; a ``SummaryWriter`` passed in is used
        as it is."""
        if self.writer is not None or self._log_dir is None:
            return
        if rank is not None:
            self._log_dir = os.path.join(self._log_dir, f"rank{rank}")
        try:
            self.writer = self._writer_cls(log_dir=self._log_dir)
        except Exception as exc:
            self._on_error(exc)

    def add_event(self, kind: str, message: str, step: int) -> None:
        """Queue an event as text for the sampler thread (any thread; never blocks)."""
        if self._closed:
            return
        if len(self._events) >= MAX_PENDING_EVENTS:
            self.events_dropped += 1
            return
        self._events.append((kind, message, step, time.time()))

    def add_reading(self, reading: Reading) -> None:
        """Write the events waiting, then ``reading``'s scalars (the sampler thread)."""
        with self._lock:
            if self.writer is None or self._closed:
                return
            try:
                self._write_events()
                for name in SCALAR_FIELDS:
                    value = getattr(reading, name)
                    if value is None:
                        continue
                    self.writer.add_scalar(
                        TAG_PREFIX + name,
                        float(value),
                        global_step=reading.step + self.step_offset,
                        walltime=reading.time_s,
                        new_style=True,  # DT_FLOAT: the fast loader drops DT_DOUBLE
                    )
            except Exception as exc:
                self._on_error(exc)

    def _write_events(self) -> None:
        while self._events:
            kind, message, step, wall_s = self._events.popleft()
            self.writer.add_text(
                EVENT_TAG_PREFIX + kind,
                "`" + message.replace("`", "'") + "`",
                global_step=step + self.step_offset,
                walltime=wall_s,
            )

    def close(self) -> None:
        """Write the events still waiting, flush, and close a writer made from a folder (the run
        ends; idempotent). Errors go to ``on_error``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.writer is None:
                return
            try:
                self._write_events()
                if self.events_dropped:
                    logger.warning(
                        "edo-monitor: %d event(s) not written to TensorBoard (more than %d "
                        "waiting)",
                        self.events_dropped,
                        MAX_PENDING_EVENTS,
                    )
                if self._owned:
                    self.writer.close()  # flushes
                else:
                    self.writer.flush()
            except Exception as exc:
                self._on_error(exc)
