"""SQL helpers shared by the history's queries: status and time filters, sample columns, the
merge of raw tails into rollup buckets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from edo_monitor.checks import whole_number, whole_number_or_none
from edo_monitor.errors import ConfigError
from edo_monitor.probes.readings import SAMPLE_FIELDS
from edo_monitor.store.records import (
    SampleSeries,
)
from edo_monitor.store.schema import (
    ROLLUP_FIELDS,
)

#: Sample columns that ``samples(columns=…)`` accepts (every numeric column but ``time_s``).
NUMERIC_SAMPLE_COLUMNS: tuple[str, ...] = tuple(
    f for f in SAMPLE_FIELDS if f not in ("time_s", "device_kind")
)


_ROLLUP_SET = frozenset(ROLLUP_FIELDS)


#: Above this many samples newer than the rollups, read the whole window raw instead.
_MAX_TAIL_ROWS = 200_000


_PEAK_COLUMNS = (
    "in_use_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "process_device_bytes",
    "device_used_bytes",
    "process_rss_bytes",
)


RunRef = int | str


#: The statuses a run (or a job, summed up over its runs) can have.
STATUSES = ("running", "finished", "failed", "interrupted", "crashed")


def names_asked(value: str | Iterable[str] | None, name: str, what: str) -> set[str]:
    """``value`` (a filter's argument: one name, several, or ``None`` for any) as a set (empty:
    any).

    Raises:
        ConfigError: neither a string, an iterable of strings nor ``None`` (``kind=5`` was a
            raw ``TypeError``), naming ``name`` and ``what`` one name is.
    """
    if value is None:
        return set()
    if isinstance(value, str):
        return {value}
    try:
        names = set(value)
    except TypeError:
        names = {value}
    if not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"{name}={value!r}; expected {what} (a string), several (an iterable of strings) or "
            "None (any)"
        )
    return names


def _statuses(status: str | Iterable[str] | None, what: str) -> set[str]:
    """The statuses asked for, as a set (empty: any).

    Raises:
        ConfigError: a status not in :data:`STATUSES`.
    """
    wanted = names_asked(status, "status", f"a {what} status")
    if wanted - set(STATUSES):
        raise ConfigError(
            f"status={status!r} is not a {what} status; expected one of "
            + ", ".join(sorted(STATUSES))
        )
    return wanted


def _to_epoch(value: float | datetime | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime):  # a naive one is UTC, as every time the CLI prints
        if value.tzinfo is None:  # (timestamp() took it as local time: off by the zone)
            value = value.replace(tzinfo=timezone.utc)
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # nan
        raise ConfigError(f"{name}={value!r} is not a time; expected Unix seconds or a datetime")
    return float(value)


#: Counts above this are clamped to it: more rows than any table holds, and ``count + 1`` still
#: fits SQL's 64-bit integers.
_MAX_COUNT = 2**62


def _count(value: Any, name: str, minimum: int, *, none: bool = True) -> int | None:
    """A count argument (``max_points``, ``limit``, ``after_id``) checked before it reaches SQL:
    an int ``>= minimum`` (NumPy's ints too, not a bool), or ``None`` when ``none``; one larger than
    :data:`_MAX_COUNT` is clamped to it (it means "all" as well).

    Raises:
        ConfigError: anything else (a float such as nan, inf or 2.5, a string, a bool, too
            small), naming the value and what is allowed.
    """
    if none:
        count = whole_number_or_none(value, name, minimum, error=ConfigError)
    else:
        count = whole_number(value, name, minimum, error=ConfigError)
    return None if count is None else min(count, _MAX_COUNT)


def _merge(acc: dict[int, list[Any]], b: int, part: Sequence[Any], ncols: int) -> None:
    """Merge one partial aggregate ``(n, tmin, tmax, [min, max, sum, cnt] * ncols)``."""
    cur = acc.get(b)
    if cur is None:
        acc[b] = list(part)
        return
    cur[0] += part[0]
    cur[1] = min(cur[1], part[1])
    cur[2] = max(cur[2], part[2])
    for j in range(ncols):
        k = 3 + 4 * j
        lo, hi = part[k], part[k + 1]
        if lo is not None:
            cur[k] = lo if cur[k] is None else min(cur[k], lo)
        if hi is not None:
            cur[k + 1] = hi if cur[k + 1] is None else max(cur[k + 1], hi)
        cur[k + 2] = (cur[k + 2] or 0.0) + (part[k + 2] or 0.0)
        cur[k + 3] += part[k + 3]


def _tail_stats_sql(agg: str, placeholders: str) -> str:
    """Per-run statistics of the samples newer than the rollups (``id > :mark``).

    A rowid range search from the mark: ``NOT INDEXED`` and ``+run_id`` (in the ``WHERE`` and
    the ``GROUP BY``) keep SQLite from walking the whole ``(run_id, time_s)`` index to get the
    rows in ``run_id`` order, which costs ~0.1 s per million samples on every live refresh.
    """
    return (
        f"SELECT run_id, count(*), min(time_s), max(time_s), {agg} FROM samples NOT INDEXED "
        f"WHERE id > :mark AND +run_id IN ({placeholders}) GROUP BY +run_id"
    )


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)


def _raw_series(run_id: int, cols: Sequence[str], rows: Sequence[Any]) -> SampleSeries:
    s = SampleSeries(run_id, tuple(cols), False, None)
    for r in rows:
        s.time_s.append(r[1])
        s.time_end_s.append(r[1])
        s.count.append(1)
    for j, c in enumerate(cols):
        vals = [r[2 + j] for r in rows]
        s.min[c] = vals
        s.max[c] = vals
        s.mean[c] = [None if v is None else float(v) for v in vals]
    return s


def _bucket_series(
    run_id: int, cols: Sequence[str], acc: Mapping[int, Sequence[Any]], width: float
) -> SampleSeries:
    s = SampleSeries(run_id, tuple(cols), True, width)
    keys = sorted(acc)
    for k in keys:
        v = acc[k]
        s.count.append(int(v[0]))
        s.time_s.append(v[1])
        s.time_end_s.append(v[2])
    for j, c in enumerate(cols):
        base = 3 + 4 * j
        s.min[c] = [acc[k][base] for k in keys]
        s.max[c] = [acc[k][base + 1] for k in keys]
        s.mean[c] = [
            (acc[k][base + 2] / acc[k][base + 3]) if acc[k][base + 3] else None for k in keys
        ]
    return s
