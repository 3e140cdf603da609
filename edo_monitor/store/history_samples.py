"""The history's sample queries: series (raw or bucketed from rollups), peaks, tails, events."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import inspect, select, text

from edo_monitor.errors import ConfigError, StoreError
from edo_monitor.store.queries import (
    _PEAK_COLUMNS,
    _ROLLUP_SET,
    NUMERIC_SAMPLE_COLUMNS,
    RunRef,
    _bucket_series,
    _count,
    _merge,
    _raw_series,
    _to_epoch,
    names_asked,
)
from edo_monitor.store.records import (
    CacheSummary,
    EventInfo,
    MetricComparison,
    ModuleInfo,
    Peak,
    RunComparison,
    SampleRow,
    SampleSeries,
)
from edo_monitor.store.schema import (
    ROLLUP_LEVEL_WIDTHS_S,
    SCHEMA_VERSION,
    events_table,
)


class _SampleQueries:
    """The history's sample queries: series (raw or bucketed from rollups), peaks, tails, events."""

    # -- samples -----------------------------------------------------------------------------
    def samples(
        self,
        run: RunRef,
        *,
        start: float | datetime | None = None,
        end: float | datetime | None = None,
        columns: Sequence[str] | None = None,
        max_points: int | None = 1000,
    ) -> SampleSeries:
        """A run's samples in ``[start, end]``, downsampled in SQL to at most ``max_points``.

        Args:
            run: run reference (see :meth:`run`).
            start, end: window (Unix seconds or datetime, a naive one UTC; both inclusive);
                default the whole run.
            columns: sample columns (default: every numeric quantity, ``ROLLUP_FIELDS``, that the
                file has; any of :data:`NUMERIC_SAMPLE_COLUMNS` that the file has, see
                :attr:`sample_columns`, may be asked for).
            max_points: most buckets to return; ``None`` returns every sample.

        Raises:
            RunNotFoundError: no such run. ConfigError: unknown column, ``max_points`` not an
                int >= 1 or None. StoreError: a column this file's schema does not have.
        """
        cols = self._columns(columns)
        max_points = _count(max_points, "max_points", 1)
        run_id = self._find(run)["id"]
        lo = _to_epoch(start, "start")
        hi = _to_epoch(end, "end")
        with self._read() as conn:
            # the run's own newest id, not the table's: another run's higher ids commit before
            # this run's open batch (PostgreSQL), and SQLite gives ids freed by prune again;
            # a cursor above the run's next rows would skip them for good
            last_id = int(
                conn.execute(
                    text("SELECT max(id) FROM samples WHERE run_id = :r"), {"r": run_id}
                ).scalar()
                or 0
            )
            series = self._samples_in(conn, run_id, cols, lo, hi, max_points)
        return dataclasses.replace(series, last_id=last_id)

    def _samples_in(
        self,
        conn: Any,
        run_id: int,
        cols: tuple[str, ...],
        lo: float | None,
        hi: float | None,
        max_points: int | None,
    ) -> SampleSeries:
        first = conn.execute(
            text("SELECT min(time_s) FROM samples WHERE run_id = :r"), {"r": run_id}
        ).scalar()
        last = conn.execute(
            text("SELECT max(time_s) FROM samples WHERE run_id = :r"), {"r": run_id}
        ).scalar()
        if first is None:
            return _raw_series(run_id, cols, [])
        lo = first if lo is None else max(lo, first)
        hi = last if hi is None else min(hi, last)
        if hi < lo:
            return _raw_series(run_id, cols, [])
        raw_sql = (
            f"SELECT id, time_s, {', '.join(cols)} FROM samples WHERE run_id = :r "
            "AND time_s >= :lo AND time_s <= :hi ORDER BY time_s, id"
        )
        params = {"r": run_id, "lo": lo, "hi": hi}
        if max_points is None:
            return _raw_series(run_id, cols, conn.execute(text(raw_sql), params).all())
        if self._pg:
            # count first: PostgreSQL's (run_id, time_s) index has no id in it, so the ordered
            # LIMIT below would sort every sample of a long run before giving the first rows
            n = conn.execute(
                text(
                    "SELECT count(*) FROM (SELECT 1 FROM samples WHERE run_id = :r AND "
                    f"time_s >= :lo AND time_s <= :hi LIMIT {max_points + 1}) AS few"
                ),
                params,
            ).scalar()
            few = conn.execute(text(raw_sql), params).all() if n <= max_points else []
        else:
            few = conn.execute(text(raw_sql + f" LIMIT {max_points + 1}"), params).all()
            n = len(few)
        if n <= max_points:
            return _raw_series(run_id, cols, few)
        # the coarsest rollup level whose blocks fit in a bucket; none: buckets narrower than
        # the smallest level, computed from the samples themselves
        want = (hi - lo) / max_points
        level = max((i for i, w in enumerate(ROLLUP_LEVEL_WIDTHS_S) if w <= want), default=None)
        mark = self._mark(conn, run_id) if self._has_rollups and level is not None else None
        if level is None or mark is None or any(c not in _ROLLUP_SET for c in cols):
            return self._bucketed_raw(conn, run_id, cols, lo, hi, max_points)
        return self._bucketed_rollups(conn, run_id, cols, lo, hi, max_points, level, mark)

    def _columns(self, columns: Sequence[str] | None) -> tuple[str, ...]:
        if columns is None:
            return self._default_columns
        if isinstance(columns, str):
            columns = [columns]
        if not columns:
            raise ConfigError(
                f"columns={columns!r} is empty; expected one or more of "
                f"{', '.join(NUMERIC_SAMPLE_COLUMNS)} (or None: every column)"
            )
        bad = [c for c in columns if c not in NUMERIC_SAMPLE_COLUMNS]
        if bad:
            raise ConfigError(
                f"columns={bad!r}: not sample columns; expected any of "
                f"{', '.join(NUMERIC_SAMPLE_COLUMNS)}"
            )
        have = self.sample_columns
        lacking = [c for c in columns if c not in have]
        if lacking:
            names = ", ".join(lacking)
            raise StoreError(
                f"this history database has no sample column {names}: it has schema version "
                f"{self.schema_version} (this edo-monitor writes {SCHEMA_VERSION}), which did not "
                f"record {'it' if len(lacking) == 1 else 'them'} (History.sample_columns: the "
                "columns it has)"
            )
        return tuple(dict.fromkeys(columns))

    @property
    def sample_columns(self) -> tuple[str, ...]:
        """The sample columns of :data:`NUMERIC_SAMPLE_COLUMNS` that this database's ``samples``
        table has, in that order (a file of an older schema lacks the newer ones: readers
        leave it as it is). Asking :meth:`samples`, :meth:`samples_since` or :meth:`peak` for
        another one raises :class:`StoreError`."""
        cols: tuple[str, ...] | None = self.__dict__.get("_sample_columns")
        if cols is None:
            with self._read() as conn:
                found = inspect(conn)
                present = (
                    {c["name"] for c in found.get_columns("samples")}
                    if found.has_table("samples")
                    else set(NUMERIC_SAMPLE_COLUMNS)  # no table yet: a writer makes it whole
                )
            cols = tuple(c for c in NUMERIC_SAMPLE_COLUMNS if c in present)
            self._sample_columns = cols
        return cols

    def _bucketed_raw(
        self, conn: Any, run_id: int, cols: Sequence[str], lo: float, hi: float, max_points: int
    ) -> SampleSeries:
        width = (hi - lo) / max_points
        # buckets counted from `lo`; the last sample (time == hi) joins the last bucket
        d = self._sql
        bucket = d.least(d.trunc("(time_s - :lo) / :w"), str(max_points - 1))
        agg = ", ".join(f"min({c}), max({c}), {d.total(c)}, count({c})" for c in cols)
        q = (
            f"SELECT {bucket} AS b, count(*), min(time_s), max(time_s), {agg} FROM samples "
            "WHERE run_id = :r AND time_s >= :lo AND time_s <= :hi GROUP BY b ORDER BY b"
        )
        rows = conn.execute(text(q), {"r": run_id, "lo": lo, "hi": hi, "w": width}).all()
        acc = {r[0]: list(r[1:]) for r in rows}
        return _bucket_series(run_id, cols, acc, width)

    def _bucketed_rollups(
        self,
        conn: Any,
        run_id: int,
        cols: Sequence[str],
        lo: float,
        hi: float,
        max_points: int,
        level: int,
        mark: int,
    ) -> SampleSeries:
        width = ROLLUP_LEVEL_WIDTHS_S[level]
        b_lo, b_hi = int(lo // width), int(hi // width)
        # whole buckets of m blocks each, at most max_points of them
        m = max(1, math.ceil((hi - lo) / max_points / width))
        while b_hi // m - b_lo // m + 1 > max_points:
            m += 1
        ncols = len(cols)
        acc: dict[int, list[Any]] = {}
        d = self._sql
        r_agg = ", ".join(
            f"min({c}_min), max({c}_max), {d.total(f'{c}_sum')}, sum({c}_n)" for c in cols
        )
        q_roll = (
            f"SELECT block / :m AS b, sum(n), min(time_min_s), max(time_max_s), {r_agg} "
            "FROM sample_rollups WHERE run_id = :r AND level = :lvl "
            "AND block >= :b_lo AND block <= :b_hi AND time_min_s >= :lo AND time_max_s <= :hi "
            "GROUP BY b"
        )
        params = {"r": run_id, "lvl": level, "b_lo": b_lo, "b_hi": b_hi, "lo": lo, "hi": hi}
        for row in conn.execute(text(q_roll), {**params, "m": m}):
            _merge(acc, row[0], row[1:], ncols)
        # edge blocks that are only partly inside [lo, hi]: their samples in the window, raw
        edges = conn.execute(
            text(
                "SELECT block FROM sample_rollups WHERE run_id = :r AND level = :lvl "
                "AND block IN (:b_lo, :b_hi) AND (time_min_s < :lo OR time_max_s > :hi)"
            ),
            params,
        ).scalars()
        agg = ", ".join(f"min({c}), max({c}), {d.total(c)}, count({c})" for c in cols)
        blk_expr = d.trunc(f"time_s / {width}")
        bucket = f"{blk_expr} / :m"
        q_edge = (
            f"SELECT {bucket} AS b, count(*), min(time_s), max(time_s), {agg} FROM samples "
            "WHERE run_id = :r AND time_s >= :t0 AND time_s <= :t1 AND id <= :mark "
            f"AND {blk_expr} = :blk GROUP BY b"
        )
        for blk in set(edges):
            t0 = max(lo, blk * width)
            t1 = min(hi, (blk + 1) * width)
            for row in conn.execute(
                text(q_edge),
                {"r": run_id, "t0": t0, "t1": t1, "mark": mark, "m": m, "blk": blk},
            ):
                _merge(acc, row[0], row[1:], ncols)
        # samples newer than the rollups
        q_tail = (
            f"SELECT {bucket} AS b, count(*), min(time_s), max(time_s), {agg} FROM "
            f"{d.samples_above('mark')}{d.plus}run_id = :r AND time_s >= :lo "
            "AND time_s <= :hi GROUP BY b"
        )
        for row in conn.execute(
            text(q_tail), {"r": run_id, "lo": lo, "hi": hi, "mark": mark, "m": m}
        ):
            _merge(acc, row[0], row[1:], ncols)
        return _bucket_series(run_id, cols, acc, float(width * m))

    def peak(self, run: RunRef, column: str = "in_use_bytes") -> Peak:
        """The largest value of ``column`` in a run, with the time and step of its first sample.

        Raises:
            RunNotFoundError: no such run. ConfigError: unknown column. StoreError: a column
                this file's schema does not have.
        """
        if not isinstance(column, str) or column not in NUMERIC_SAMPLE_COLUMNS:
            raise ConfigError(
                f"column={column!r}: not a sample column; expected one of "
                f"{', '.join(NUMERIC_SAMPLE_COLUMNS)}"
            )
        (col,) = self._columns([column])
        run_id = self._find(run)["id"]
        with self._read() as conn:
            value = self._sample_max(conn, run_id, col)
            if value is None:
                return Peak(run_id, col, None, None, None)
            lo, hi = None, None
            mark = self._mark(conn, run_id) if self._has_rollups and col in _ROLLUP_SET else None
            if mark is not None:
                # narrow down through the rollup levels to one smallest-level block
                for level in range(len(ROLLUP_LEVEL_WIDTHS_S) - 1, -1, -1):
                    w = ROLLUP_LEVEL_WIDTHS_S[level]
                    extra = "" if lo is None else "AND block >= :b0 AND block <= :b1"
                    blk = conn.execute(
                        text(
                            "SELECT block FROM sample_rollups WHERE run_id = :r AND level = :l "
                            f"AND {col}_max = :v {extra} ORDER BY block LIMIT 1"
                        ),
                        {
                            "r": run_id,
                            "l": level,
                            "v": value,
                            "b0": None if lo is None else int(lo // w),
                            "b1": None if hi is None else int(hi // w),
                        },
                    ).scalar()
                    if blk is None:
                        lo = hi = None
                        break
                    lo, hi = blk * w, (blk + 1) * w
            where = "run_id = :r AND " + (
                "time_s >= :lo AND time_s <= :hi AND " if lo is not None else ""
            )
            row = conn.execute(
                text(
                    f"SELECT time_s, step FROM samples WHERE {where}{col} = :v "
                    "ORDER BY time_s LIMIT 1"
                ),
                {"r": run_id, "lo": lo, "hi": hi, "v": value},
            ).first()
            if row is None and lo is not None:  # the peak is in the raw tail
                row = conn.execute(
                    text(
                        f"SELECT time_s, step FROM samples WHERE run_id = :r AND {col} = :v "
                        "ORDER BY time_s LIMIT 1"
                    ),
                    {"r": run_id, "v": value},
                ).first()
        return Peak(run_id, col, value, row[0] if row else None, row[1] if row else None)

    def _sample_max(self, conn: Any, run_id: int, col: str) -> Any:
        mark = self._mark(conn, run_id) if self._has_rollups and col in _ROLLUP_SET else None
        if mark is None:
            return conn.execute(
                text(f"SELECT max({col}) FROM samples WHERE run_id = :r"), {"r": run_id}
            ).scalar()
        top = len(ROLLUP_LEVEL_WIDTHS_S) - 1
        a = conn.execute(
            text(f"SELECT max({col}_max) FROM sample_rollups WHERE run_id = :r AND level = {top}"),
            {"r": run_id},
        ).scalar()
        b = conn.execute(
            text(
                f"SELECT max({col}) FROM {self._sql.samples_above('m')}{self._sql.plus}run_id = :r"
            ),
            {"r": run_id, "m": mark},
        ).scalar()
        vals = [v for v in (a, b) if v is not None]
        return max(vals) if vals else None

    # -- incremental reads (live viewers) ------------------------------------------------------
    def samples_since(
        self,
        run: RunRef,
        after_id: int = 0,
        *,
        columns: Sequence[str] | None = None,
        limit: int | None = 10_000,
    ) -> list[SampleRow]:
        """Raw samples of a run with ``id > after_id``, oldest first (feed the last id back in).

        Raises:
            RunNotFoundError: no such run. ConfigError: unknown column; ``after_id`` not an
                int >= 0, ``limit`` not an int >= 0 or None. StoreError: a column this file's
                schema does not have (see :attr:`sample_columns`).
        """
        cols = self._columns(columns)
        after_id = _count(after_id, "after_id", 0, none=False)
        limit = _count(limit, "limit", 0)
        run_id = run if isinstance(run, int) and not isinstance(run, bool) else None
        if run_id is None:
            run_id = self._find(run)["id"]
        sel = ", ".join(c for c in cols if c != "step")
        # walk the rowid from after_id (never an index scan of the whole table)
        q = (
            f"SELECT id, time_s, step{', ' + sel if sel else ''} FROM samples"
            f"{self._sql.not_indexed} WHERE id > :a AND {self._sql.plus}run_id = :r ORDER BY id"
        )
        if limit is not None:
            q += f" LIMIT {int(limit)}"
        names = [c for c in cols if c != "step"]
        with self._read() as conn:
            if after_id == 0 and not self._pg and not self._has_sample(conn, run_id):
                return []  # a run with no sample yet: no walk of every row of the table
            rows = conn.execute(text(q), {"a": after_id, "r": run_id}).all()
        out = []
        for r in rows:
            values = dict(zip(names, r[3:], strict=True))
            if "step" in cols:
                values["step"] = r[2]
            out.append(SampleRow(r[0], r[1], r[2], values))
        return out

    @staticmethod
    def _has_sample(conn: Any, run_id: int) -> bool:
        """Whether the run has a sample (one seek of the ``(run_id, time_s)`` index)."""
        found = conn.execute(
            text("SELECT 1 FROM samples WHERE run_id = :r LIMIT 1"), {"r": run_id}
        ).first()
        return found is not None

    def events_since(self, run: RunRef, after_id: int = 0) -> list[EventInfo]:
        """Events of a run with ``id > after_id``, oldest first.

        Raises:
            RunNotFoundError: no such run. ConfigError: ``after_id`` not an int >= 0.
        """
        return self._events(run, None, _count(after_id, "after_id", 0, none=False))

    # -- events, modules ---------------------------------------------------------------------
    def events(self, run: RunRef, *, kind: str | Sequence[str] | None = None) -> list[EventInfo]:
        """A run's events in time order, optionally only of ``kind`` (one or several; a kind
        the run has none of gives none: ``edo-monitor events --kind`` names the run's kinds).

        Raises:
            RunNotFoundError: no such run. ConfigError: ``kind`` neither a string, an iterable
                of strings nor ``None``.
        """
        return self._events(run, kind, None)

    def _events(
        self, run: RunRef, kind: str | Sequence[str] | None, after_id: int | None
    ) -> list[EventInfo]:
        run_id = run if isinstance(run, int) and not isinstance(run, bool) else None
        if run_id is None or after_id is None:
            run_id = self._find(run)["id"]
        stmt = select(*events_table.columns).where(events_table.c.run_id == run_id)
        kinds = names_asked(kind, "kind", "an event kind")
        if kinds:
            stmt = stmt.where(events_table.c.kind.in_(sorted(kinds)))
        if after_id is not None:
            stmt = stmt.where(events_table.c.id > after_id).order_by(events_table.c.id)
        else:
            stmt = stmt.order_by(events_table.c.time_s, events_table.c.id)
        with self._read() as conn:
            return [
                EventInfo(r.id, r.run_id, r.time_s, r.step, r.kind, r.message, dict(r.data or {}))
                for r in conn.execute(stmt)
            ]

    def cache_summary(self, run: RunRef) -> CacheSummary | None:
        """The run's row caches summed over its samples; ``None`` when no sample had a cache
        (or the file predates schema 4).

        Raises:
            RunNotFoundError: no such run.
        """
        run_id = self._find(run)["id"]
        if "cache_rows" not in self._default_columns:
            return None
        q = text(
            "SELECT count(*), sum(cache_lookups), sum(cache_lookup_hits), sum(cache_rows_loaded), "
            "sum(cache_rows_evicted), sum(cache_moved_bytes), min(step), max(step), max(id) "
            "FROM samples WHERE run_id = :r AND cache_rows IS NOT NULL"
        )
        with self._read() as conn:
            n, lookups, hits, loaded, evicted, moved, first, last, last_id = conn.execute(
                q, {"r": run_id}
            ).one()
            if not n:
                return None
            rows_now = conn.execute(
                text("SELECT cache_rows FROM samples WHERE id = :i"), {"i": last_id}
            ).scalar()
        return CacheSummary(
            run_id,
            int(lookups or 0),
            int(hits or 0),
            int(loaded or 0),
            int(evicted or 0),
            int(moved or 0),
            int(first),
            int(last),
            int(rows_now or 0),
        )

    def modules(self, run: RunRef) -> list[ModuleInfo]:
        """The latest ``module_stats`` row of each module of a run, largest total first.

        Raises:
            RunNotFoundError: no such run.
        """
        run_id = self._find(run)["id"]
        q = text(
            "SELECT m.* FROM module_stats m JOIN (SELECT module, max(id) AS id FROM module_stats "
            "WHERE run_id = :r GROUP BY module) last ON m.id = last.id"
        )
        fields = [f.name for f in dataclasses.fields(ModuleInfo)]
        with self._read() as conn:
            rows = conn.execute(q, {"r": run_id}).mappings().all()
        mods = [ModuleInfo(**{k: r.get(k) for k in fields if k in r}) for r in rows]
        return sorted(mods, key=lambda m: (-m.total_bytes, m.module))

    # -- comparison --------------------------------------------------------------------------
    def compare(self, a: RunRef, b: RunRef) -> RunComparison:
        """Two runs side by side: peaks, minimum free fraction, steps/s, counts, actions.

        Raises:
            RunNotFoundError: either run does not exist.
        """
        ra, rb = self.run(a), self.run(b)

        def metric(name: str, unit: str) -> MetricComparison:
            va, vb = getattr(ra, name), getattr(rb, name)
            return MetricComparison(name, unit, va, vb)

        metrics = [
            metric("duration_s", "s"),
            metric("steps", "steps"),
            metric("steps_per_s", "steps/s"),
            metric("sample_count", "samples"),
            *(metric(f"peak_{c}", "bytes") for c in _PEAK_COLUMNS),
            metric("min_free_fraction", "fraction"),
            metric("budget_bytes", "bytes"),
            metric("action_count", "events"),
            metric("oom_count", "events"),
            metric("event_count", "events"),
            metric("samples_dropped", "samples"),
        ]
        return RunComparison(
            a=ra,
            b=rb,
            metrics=metrics,
            actions_a=self.events(ra.id, kind="action"),
            actions_b=self.events(rb.id, kind="action"),
        )
