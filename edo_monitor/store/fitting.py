"""Values a database cannot store, made storable, so that one value never costs a batch.

* An integer outside SQLite's signed 64 bits (a driver's "not available" marker that got
  through) becomes ``NULL``: :func:`null_out_of_range`, after the flush failed with
  ``OverflowError``.
* A string in a row table is fitted before every insert (:func:`fit_text`): a NUL character
  (PostgreSQL's text cannot hold one) becomes U+FFFD, a lone surrogate (no UTF-8 holds one) its
  escape, and a string longer than its ``VARCHAR``
  (PostgreSQL refuses it; SQLite would keep it) is clipped to the column's length, its last
  character an ellipsis. Both backends store the same value. JSON columns are left alone:
  PostgreSQL's ``json`` keeps an escaped NUL and has no length.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from sqlalchemy import String

from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.schema import metadata

__all__ = ["fit_text", "null_out_of_range"]

#: SQLite's INTEGER is a signed 64-bit integer
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _fits(value: Any) -> bool:
    return not isinstance(value, int) or _INT64_MIN <= value <= _INT64_MAX


def null_out_of_range(pending: dict[str, list[Any]], tables: list[str]) -> int:
    """Replace integers SQLite cannot store by ``None`` in the pending rows (samples, as
    ``Reading`` objects, and the dict rows of ``tables``); how many."""
    nulled = 0
    samples = pending["samples"]
    for i, reading in enumerate(samples):
        bad = {f: None for f in SAMPLE_FIELDS if not _fits(getattr(reading, f))}
        if bad:
            samples[i] = dataclasses.replace(reading, **bad)
            nulled += len(bad)
    for table in tables:
        for row in pending[table]:
            for key, value in row.items():
                if not _fits(value):
                    row[key] = None
                    nulled += 1
    return nulled


@cache
def _lengths(table: str) -> dict[str, int | None]:
    """``table``'s string columns: name → ``VARCHAR`` length (``None``: ``TEXT``, no limit)."""
    columns = metadata.tables[table].columns
    return {c.name: c.type.length for c in columns if isinstance(c.type, String)}


def _without_surrogates(text: str) -> str:
    """``text`` with each lone surrogate (``os.fsdecode`` of a file name that is not UTF-8:
    ``'\\udce9'``; no UTF-8 encodes it, so the row was refused) written as its escape, the six
    characters ``\\udce9``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def fit_text(table: str, rows: list[dict[str, Any]]) -> int:
    """Fit the strings of ``rows`` (dicts about to be inserted into ``table``) to their columns,
    in place: NUL → U+FFFD, a lone surrogate → its escape (``\\udce9``), longer than the column
    → clipped to its length ending in "…". Returns how many values were changed."""
    lengths = _lengths(table)
    fitted = 0
    for row in rows:
        for key, value in row.items():
            if not isinstance(value, str) or key not in lengths:
                continue
            fit = value.replace("\x00", "\ufffd")
            if not fit.isascii():
                fit = _without_surrogates(fit)
            limit = lengths[key]
            if limit is not None and len(fit) > limit:
                fit = fit[: limit - 1] + "…"
            if fit != value:
                row[key] = fit
                fitted += 1
    return fitted
