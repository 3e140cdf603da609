"""A run's samples out of the history as rows: every column, in id order, a page at a time (the
``export`` command's csv / json / jsonl and the dashboard's ``e``)."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from typing import Any, TextIO

from edo_monitor.store.history import History
from edo_monitor.store.queries import NUMERIC_SAMPLE_COLUMNS
from edo_monitor.store.records import RunInfo

__all__ = ["EXPORT_COLUMNS", "sample_rows", "write_samples_csv"]

#: a sample row's keys, in the order a CSV file has its columns
EXPORT_COLUMNS: tuple[str, ...] = ("id", "time_s", "device_kind", *NUMERIC_SAMPLE_COLUMNS)


def sample_rows(
    history: History, run: RunInfo, *, page_rows: int = 10_000
) -> Iterator[dict[str, Any]]:
    """The samples of ``run``, oldest first, each a dict with every key of
    :data:`EXPORT_COLUMNS` (``None`` where the reading had no value, or the file's schema has
    no such column); read ``page_rows`` at a time, so a long run does not fill memory.

    Raises:
        RunNotFoundError: the run is gone (pruned meanwhile).
    """
    # a file of an older schema lacks the newer columns: not recorded, so None (never asked
    # for: the query would fail)
    present = history.sample_columns
    after = 0
    while True:
        page = history.samples_since(run.id, after, columns=present, limit=page_rows)
        if not page:
            return
        for s in page:  # a run's samples all have the run's device kind
            yield {
                "id": s.id,
                "time_s": s.time_s,
                "device_kind": run.device_kind,
                **{c: s.values.get(c) for c in NUMERIC_SAMPLE_COLUMNS},
                "step": s.step,
            }
        after = page[-1].id


def write_samples_csv(history: History, run: RunInfo, stream: TextIO) -> int:
    """Write the samples of ``run`` to ``stream`` as CSV (a header of :data:`EXPORT_COLUMNS`,
    an empty field for no value); returns the rows written."""
    writer = csv.DictWriter(stream, fieldnames=EXPORT_COLUMNS)
    writer.writeheader()
    written = 0
    for row in sample_rows(history, run):
        writer.writerow(row)
        written += 1
    return written
