"""History API on a database seeded through the ORM, with runs of every status."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from history_seed import INTERVAL, N_SAMPLES, T0, sample_row, seed
from sqlalchemy import insert, text

from edo_monitor.errors import ConfigError, RunNotFoundError, StoreError
from edo_monitor.store.engine import open_engine
from edo_monitor.store.history import History
from edo_monitor.store.models import Sample
from edo_monitor.store.prune import FOREIGN_RUN_GRACE_S, prune
from edo_monitor.store.queries import _PEAK_COLUMNS, _tail_stats_sql
from edo_monitor.store.schema import ROLLUP_LEVEL_WIDTHS_S, SCHEMA_VERSION


@pytest.fixture()
def seeded(history_db: str) -> tuple[Path | str, dict[str, Any]]:
    """The seeded database on each backend: an SQLite file, then a PostgreSQL schema."""
    return history_db, seed(history_db)


@pytest.fixture()
def seeded_sqlite(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """The seeded database as an SQLite file (tests that open the file themselves)."""
    path = tmp_path / "h.db"
    return path, seed(path)


def _reference(rows: list[dict[str, Any]], col: str, width: float, m: int) -> dict[int, tuple]:
    """Per bucket (count, min, max, mean) computed in Python from every row."""
    out: dict[int, list] = {}
    for r in rows:
        b = int(r["time_s"] / width) // m
        out.setdefault(b, []).append(r[col])
    res = {}
    for b, vals in out.items():
        v = [x for x in vals if x is not None]
        res[b] = (
            len(vals),
            min(v) if v else None,
            max(v) if v else None,
            sum(v) / len(v) if v else None,
        )
    return res


def _reference_from_start(
    rows: list[dict[str, Any]], col: str, lo: float, span: float, n: int
) -> dict[int, tuple]:
    """Like :func:`_reference` for ``n`` buckets of ``span / n`` seconds counted from ``lo``."""
    width = span / n
    shifted = [{**r, "time_s": min(int((r["time_s"] - lo) / width), n - 1) + 0.5} for r in rows]
    return _reference(shifted, col, 1.0, 1)


def test_runs_every_status_and_filters(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, _ = seeded
    with History(path) as h:
        runs = h.runs()
        assert {r.status for r in runs} == {
            "finished",
            "failed",
            "interrupted",
            "running",
            "crashed",
        }
        dead = next(r for r in runs if r.name == "dead")
        assert dead.stored_status == "running" and dead.status == "crashed"
        assert [r.name for r in h.runs(status="crashed")] == ["dead"]
        assert {r.name for r in h.runs(tag="a")} == {"embed-big"}
        assert {r.name for r in h.runs(name="embed")} == {"embed-big", "embed-small"}
        assert {r.name for r in h.runs(name="e*-s*")} == {"embed-small"}
        assert {r.name for r in h.runs(since=time.time() - 3600)} == {"live", "dead"}
        with pytest.raises(ConfigError, match="not a run status"):
            h.runs(status="exploded")


def test_run_summary_numbers(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, facts = seeded
    with History(path) as h:
        r = h.run(1)
        assert r.sample_count == N_SAMPLES
        assert r.peak_in_use_bytes == facts["peak"]
        assert r.min_free_fraction == pytest.approx(facts["min_free"])
        assert (r.action_count, r.oom_count, r.event_count) == (1, 1, 4)
        assert r.duration_s == pytest.approx(N_SAMPLES * INTERVAL)
        assert r.steps_per_s == pytest.approx(r.steps / r.duration_s)
        assert h.run(2).sample_count == 300


def test_all_digit_reference_is_an_id_never_a_uuid_prefix(
    seeded_sqlite: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Regression: ``show 0`` opened the run whose uuid starts with 0."""
    import shutil
    import sqlite3

    path = tmp_path / "copy.db"
    shutil.copy(seeded_sqlite[0], path)
    con = sqlite3.connect(path)
    con.execute("UPDATE runs SET uuid = '01234567-89ab-cdef-0123-456789abcdef' WHERE id = 2")
    con.commit()
    con.close()
    with History(path) as h:
        for ref in ("0", "0123", 123):
            with pytest.raises(RunNotFoundError, match=r"no run with id \d+$"):
                h.run(ref)
        assert h.run("01234567-").id == 2
        assert h.run("2").id == 2


def test_run_references(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, facts = seeded
    with History(path) as h:
        assert h.run("1").id == 1
        assert h.run(facts["uuids"][2][:8]).id == 3
        assert h.run("latest").name in {"live", "dead"}
        with pytest.raises(RunNotFoundError, match="no run with id 99"):
            h.run(99)
        with pytest.raises(RunNotFoundError, match="uuid prefix"):
            h.run("zzz-not-hex")
        # other scripts' digits are not ids ("\u0967" is Devanagari one: it opened run 1)
        with pytest.raises(RunNotFoundError, match="expected a run id, a uuid prefix"):
            h.run("\u0967")

        # a prefix shared by several uuids is ambiguous; an all-digit one is an id
        with pytest.raises(RunNotFoundError, match="several runs"):
            h.run("a3")
        with pytest.raises(RunNotFoundError, match=r"no run with id 90455722$"):
            h.run("90455722")
        assert h.run("90455722-7c1e-4c").id == 1
        # ids beyond SQL's int64 name no run (they raised OverflowError from the driver)
        for huge in ("99999999999999999999999", 2**63, -1):
            with pytest.raises(RunNotFoundError, match=rf"^no run with id {huge}$"):
                h.run(huge)


def test_uuid_references_always_open_their_run(seeded: tuple[Path, dict[str, Any]]) -> None:
    """Regression: ``runs`` printed 8-character uuid prefixes, and an all-digit one
    (``90455722``) was read as a run id. References are at least 13 characters (the dash
    included) and longer where two uuids share more."""
    path, _ = seeded
    with History(path) as h:
        refs = h.uuid_references()
        assert refs == {
            1: "90455722-7c1e-4c",  # shares "90455722-7c1e-4" with run 2
            2: "90455722-7c1e-40",
            3: "a3c2f1e0-0000",
            4: "a3d00000-0000",
            5: "0e0e0e0e-0000",
        }
        for run_id, ref in refs.items():
            assert h.run(ref).id == run_id
        # regression: the runs a prefix matches were shown by 12 characters, "90455722-7c"
        # for both: no more characters to give could be read from them
        with pytest.raises(RunNotFoundError) as err:
            h.run("90455722-7c")
        assert str(err.value) == (
            "uuid prefix '90455722-7c' matches several runs: 1 (90455722-7c1e-4c), "
            "2 (90455722-7c1e-40); give more characters"
        )


@pytest.mark.parametrize("max_points", [1000, 100, 37, 5])
def test_downsampling_matches_every_sample(
    seeded: tuple[Path, dict[str, Any]], max_points: int
) -> None:
    path, facts = seeded
    rows = facts["rows"]
    with History(path) as h:
        s = h.samples(1, columns=["in_use_bytes", "free_fraction"], max_points=max_points)
    assert s.downsampled and 1 <= len(s) <= max_points
    assert sum(s.count) == N_SAMPLES
    span = rows[-1]["time_s"] - rows[0]["time_s"]
    levels = [w for w in ROLLUP_LEVEL_WIDTHS_S if w <= span / max_points]
    if levels:  # from the rollups: whole blocks of the coarsest level that fits
        width = max(levels)
        m = round(s.bucket_s / width)
        assert s.bucket_s == width * m
        ref = _reference(rows, "in_use_bytes", width, m)
    else:  # buckets narrower than the smallest level: from the samples, counted from the first
        assert max_points == 1000 and s.bucket_s == span / max_points
        ref = _reference_from_start(rows, "in_use_bytes", rows[0]["time_s"], span, max_points)
    assert len(ref) == len(s)
    for i, b in enumerate(sorted(ref)):
        n, lo, hi, mean = ref[b]
        assert s.count[i] == n
        assert s.min["in_use_bytes"][i] == lo and s.max["in_use_bytes"][i] == hi
        assert s.mean["in_use_bytes"][i] == pytest.approx(mean)
    assert max(x for x in s.max["in_use_bytes"] if x is not None) == facts["peak"]
    assert min(s.min["free_fraction"]) == pytest.approx(facts["min_free"])


def test_window_and_raw_and_columns(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, facts = seeded
    rows = facts["rows"]
    lo, hi = T0 + 333.3, T0 + 2111.1
    inside = [r for r in rows if lo <= r["time_s"] <= hi]
    with History(path) as h:
        s = h.samples(1, start=lo, end=hi, columns=["in_use_bytes"], max_points=50)
        assert sum(s.count) == len(inside)
        assert max(x for x in s.max["in_use_bytes"] if x) == max(
            r["in_use_bytes"] for r in inside if r["in_use_bytes"] is not None
        )
        raw = h.samples(1, start=lo, end=lo + 10, max_points=1000)
        assert not raw.downsampled and len(raw) == 20
        assert raw.min["params_bytes"] == [400_000_000] * 20
        everything = h.samples(1, max_points=None, columns=["step"])
        assert len(everything) == N_SAMPLES
        assert h.samples(3).time_s == []  # a run without samples
        with pytest.raises(ConfigError, match="not sample columns"):
            h.samples(1, columns=["bogus"])
        for bogus in ("bogus", ["in_use_bytes"]):  # peak takes one column: named as such
            with pytest.raises(ConfigError, match=r"^column=.*: not a sample column; expected"):
                h.peak(1, bogus)  # type: ignore[arg-type]
        # an empty list was raw SQL (near "FROM": syntax error)
        for empty in ([], ()):
            for max_points in (10, None):
                with pytest.raises(ConfigError, match=r"columns=.* is empty; expected one"):
                    h.samples(1, columns=empty, max_points=max_points)
            with pytest.raises(ConfigError, match=r"is empty"):
                h.samples_since(1, 0, columns=empty)
        with pytest.raises(ConfigError, match="max_points"):
            h.samples(1, max_points=0)
        # a column outside the rollups takes the raw GROUP BY path and agrees on the count
        s2 = h.samples(1, columns=["nvml_memory_info_version"], max_points=40)
        assert sum(s2.count) == N_SAMPLES and len(s2) <= 40


def test_peak_events_modules_compare(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, facts = seeded
    with History(path) as h:
        p = h.peak(1)
        assert p.value == facts["peak"]
        first = next(r for r in facts["rows"] if r["in_use_bytes"] == facts["peak"])
        assert p.time_s == pytest.approx(first["time_s"]) and p.step == first["step"]
        assert h.peak(1, "free_fraction").value == pytest.approx(
            max(r["free_fraction"] for r in facts["rows"])
        )
        assert [e.kind for e in h.events(1)] == ["threshold_crossed", "decision", "action", "oom"]
        assert [e.kind for e in h.events(1, kind="action")] == ["action"]
        assert h.events(1, kind="action")[0].data["bytes_saved"] == 123456
        mods = h.modules(1)
        assert [m.module for m in mods] == ["emb", "head"]
        assert mods[0].params_bytes == 200 and mods[0].total_bytes == 800  # latest row
        c = h.compare(1, 2)
        names = {m.name: m for m in c.metrics}
        assert names["peak_in_use_bytes"].a == facts["peak"]
        assert names["sample_count"].delta == 300 - N_SAMPLES
        assert [e.data["action"] for e in c.actions_b] == ["release_cache"]


def test_incremental_reads(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, _ = seeded
    with History(path) as h:
        first = h.samples_since(1, 0, columns=["in_use_bytes"], limit=100)
        assert len(first) == 100 and all(r.id > 0 for r in first)
        nxt = h.samples_since(1, first[-1].id, limit=None)
        assert len(first) + len(nxt) == N_SAMPLES
        assert h.samples_since(1, nxt[-1].id) == []
        evs = h.events_since(1, 0)
        assert len(evs) == 4 and h.events_since(1, evs[1].id) == evs[2:]


def test_live_tail_is_seen_and_rolled_up_later(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    seed(path)
    engine = open_engine(path)
    rng = random.Random(1)
    extra = [sample_row(1, N_SAMPLES + i, rng) for i in range(10)]
    extra[3]["in_use_bytes"] = 10**12
    with engine.begin() as conn:
        conn.execute(insert(Sample), extra)  # fewer than ROLLUP_MIN_ROWS: stays raw
    engine.dispose()
    with History(path) as h:
        assert h.run(1).sample_count == N_SAMPLES + 10
        assert h.run(1).peak_in_use_bytes == 10**12
        s = h.samples(1, columns=["in_use_bytes"], max_points=20)
        assert sum(s.count) == N_SAMPLES + 10 and max(s.max["in_use_bytes"]) == 10**12
        assert h.peak(1).value == 10**12


def test_prune(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, facts = seeded
    with History(path) as h:
        before = h.run(1)
    now = T0 + 20_000
    with History(path, readonly=False) as h:
        dry = prune(h, keep_last=3, dry_run=True, now_s=now)
        assert dry["runs_deleted"] == 2
        # a dry run of downsampling says what would go (it said 0 samples, 0 snapshots)
        dry = prune(h, downsample_older_than_s=0, bucket_s=60, now_s=now, dry_run=True)
        rep = prune(h, downsample_older_than_s=0, bucket_s=60, now_s=now)
        assert dry == rep
        assert rep["runs_downsampled"] >= 1 and rep["samples_deleted"] > N_SAMPLES // 2
    with History(path) as h:
        after = h.run(1)
        assert after.sample_count < before.sample_count
        assert after.peak_in_use_bytes == before.peak_in_use_bytes == facts["peak"]
        assert after.min_free_fraction == pytest.approx(before.min_free_fraction)
        s = h.samples(1, columns=["in_use_bytes"], max_points=10)
        assert sum(s.count) == after.sample_count and max(s.max["in_use_bytes"]) == facts["peak"]
    with History(path, readonly=False) as h:
        rep = prune(h, older_than_s=0, now_s=time.time() + 10)  # all but the live run
        assert rep["runs_deleted"] == 4
    with History(path) as h:
        assert [r.name for r in h.runs()] == ["live"]
        with pytest.raises(RunNotFoundError):
            h.run(1)
    with History(path) as h, pytest.raises(StoreError, match="writable"):
        prune(h, keep_last=0)


def test_missing_and_empty(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no history database"):
        History(tmp_path / "none.db")
    empty = tmp_path / "empty.db"
    empty.touch()  # SQLite would read it as an empty database: it is not a history (issue 21)
    with pytest.raises(StoreError, match=r"not an edo-monitor history database.*0 bytes"):
        History(empty)
    assert empty.stat().st_size == 0
    open_engine(empty).dispose()  # a writer makes the schema in it: then it is an empty history
    with History(empty) as h:
        assert h.runs() == []
        with pytest.raises(RunNotFoundError, match="no runs"):
            h.run("latest")
    # regression: after close() it answered, its engine opening connections again
    with pytest.raises(StoreError, match=r"empty\.db was closed; open a new one"):
        h.runs()


def test_alembic_revision_newer_than_the_code_is_refused(
    seeded_sqlite: tuple[Path, dict[str, Any]],
) -> None:
    """Regression: a database whose ``alembic_version`` is newer than the code but whose
    ``meta`` row is not was accepted and written to."""
    path, _ = seeded_sqlite
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT version_num FROM alembic_version").fetchone() == (
            f"{SCHEMA_VERSION:04d}",
        )
        newer = f"{SCHEMA_VERSION + 1:04d}"
        con.execute("UPDATE alembic_version SET version_num = ?", (newer,))
    before = path.read_bytes()
    for readonly in (False, True):
        with pytest.raises(StoreError) as err:
            open_engine(path, readonly=readonly)
        assert f"schema version {SCHEMA_VERSION} (meta table)" in str(err.value)
        assert f"Alembic revision '{newer}'" in str(err.value)
        assert f"this edo-monitor's schema version is {SCHEMA_VERSION}" in str(err.value)
    with sqlite3.connect(path) as con:  # a revision this code does not know at all
        con.execute("UPDATE alembic_version SET version_num = 'f00d'")
    with pytest.raises(StoreError, match="Alembic revision 'f00d'"):
        open_engine(path)
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (5,)
    assert len(path.read_bytes()) == len(before)


def test_to_pandas_needs_pandas(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, _ = seeded
    with History(path) as h:
        s = h.samples(1, columns=["in_use_bytes"], max_points=10)
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="edo-monitor\\[pandas\\]"):
            s.to_pandas()
    else:
        assert len(s.to_pandas()) == len(s)


# -- live viewers ------------------------------------------------------------------------------


def test_run_without_stats_is_the_row(seeded: tuple[Path, dict[str, Any]]) -> None:
    path, _ = seeded
    with History(path) as h:
        full = h.run(1)
        row = h.run(1, stats=False)
        assert full.sample_count == N_SAMPLES and full.event_count == 4
        assert (row.id, row.status, row.steps, row.heartbeat_at_s) == (
            full.id,
            full.status,
            full.steps,
            full.heartbeat_at_s,
        )
        assert row.sample_count == 0 and row.peak_in_use_bytes is None and row.event_count == 0
        assert row == dataclasses.replace(
            full,
            sample_count=0,
            first_sample_s=None,
            last_sample_s=None,
            **{f"peak_{c}": None for c in _PEAK_COLUMNS},
            min_free_fraction=None,
            event_count=0,
            action_count=0,
            oom_count=0,
            duration_s=row.duration_s,
        )


def test_tail_statistics_walk_the_rowid(seeded_sqlite: tuple[Path, dict[str, Any]]) -> None:
    """Regression: grouping the not-yet-rolled-up samples by the bare run_id made SQLite walk
    the whole (run_id, time_s) index (0.1 s per million samples, on every live refresh)."""
    path, _ = seeded_sqlite
    con = sqlite3.connect(path)
    sql = _tail_stats_sql("max(in_use_bytes)", "1, 2")
    plan = " | ".join(r[3] for r in con.execute(f"EXPLAIN QUERY PLAN {sql}", {"mark": 100}))
    assert "SEARCH samples USING INTEGER PRIMARY KEY (rowid>?)" in plan
    assert "ix_samples_run_time" not in plan
    got = dict(
        (r[0], r[1]) for r in con.execute(sql.replace("max(in_use_bytes)", "1"), {"mark": 0})
    )
    assert got == {1: N_SAMPLES, 2: 300}
    con.close()


def test_series_says_where_samples_since_continues(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    seed(path)
    with History(path) as h:
        s = h.samples(1, columns=["in_use_bytes"], max_points=50)
        own = "SELECT max(id) FROM samples WHERE run_id = 1"  # the run's, not the table's
        top = sqlite3.connect(path).execute(own).fetchone()[0]
        assert s.last_id == top and h.samples_since(1, s.last_id) == []
    engine = open_engine(path)
    rng = random.Random(2)
    with engine.begin() as conn:
        conn.execute(insert(Sample), [sample_row(1, N_SAMPLES + k, rng) for k in range(3)])
    engine.dispose()
    with History(path) as h:
        new = h.samples_since(1, s.last_id)
        assert [r.id for r in new] == [top + 1, top + 2, top + 3]
        assert h.samples(1, columns=["in_use_bytes"], max_points=50).last_id == top + 3
        assert h.samples(1, start=T0 + 10**6, columns=["step"]).last_id == top + 3  # empty window


def test_downsampling_keeps_the_row_cache_counts_whole(
    seeded_sqlite: tuple[Path, dict[str, Any]],
) -> None:
    """Regression: the samples' row-cache counters count since the previous sample; thinning
    deleted those counts, so ``show`` read a 94.4 % hit rate as 70.8 % after ``prune
    --downsample-older-than``. A thinned sample's counts now move to the next sample kept."""
    path, _ = seeded_sqlite
    with sqlite3.connect(path) as conn:  # counts on every sample of the finished run
        conn.execute(
            "UPDATE samples SET cache_lookups = 10 + id % 7, cache_lookup_hits = id % 7, "
            "cache_rows_loaded = 10, cache_rows_evicted = id % 3, cache_moved_bytes = 128 "
            "WHERE run_id = 1"
        )
    sums = (
        "SELECT count(*), sum(cache_lookups), sum(cache_lookup_hits), sum(cache_rows_loaded), "
        "sum(cache_rows_evicted), sum(cache_moved_bytes) FROM samples WHERE run_id = 1"
    )
    with sqlite3.connect(path) as conn:
        before = conn.execute(sums).fetchone()
    with History(path, readonly=False) as h:
        prune(h, downsample_older_than_s=0, bucket_s=60, now_s=T0 + 20_000)
    with sqlite3.connect(path) as conn:
        after = conn.execute(sums).fetchone()
    assert after[0] < before[0] // 2  # thinned
    assert after[1:] == before[1:]


def test_downsampling_keeps_the_row_caches_first_sample(
    seeded_sqlite: tuple[Path, dict[str, Any]],
) -> None:
    """Regression: a cache made mid-run (its first sample inside a bucket) lost its first sample
    to thinning; the counts moved on, but ``show``'s row-cache steps began later ("steps 2-300"
    read "steps 144-300"), so its bytes per step doubled. That sample is kept."""
    path, _ = seeded_sqlite
    with sqlite3.connect(path) as conn:
        (start,) = conn.execute(
            "SELECT min(id) + 1001 FROM samples WHERE run_id = 1"  # not a bucket's first
        ).fetchone()
        conn.execute(
            "UPDATE samples SET cache_rows = 100, cache_lookups = 10, cache_lookup_hits = 7, "
            "cache_rows_loaded = 3, cache_rows_evicted = 1, cache_moved_bytes = 128 "
            "WHERE run_id = 1 AND id >= ?",
            (start,),
        )
    with History(path) as h:
        before = h.cache_summary(1)
    with History(path, readonly=False) as h:
        prune(h, downsample_older_than_s=0, bucket_s=60, now_s=T0 + 20_000)
    with History(path) as h:
        assert h.cache_summary(1) == before
        assert h.run(1).sample_count < N_SAMPLES // 2  # thinned


def test_a_run_info_is_a_run_reference_and_other_objects_are_named(
    seeded: tuple[Path, dict[str, Any]],
) -> None:
    """Regression: ``h.samples(h.run("latest"))`` raised ``no run 'RunInfo(id=1, …'`` with the
    whole repr (900 characters). A ``RunInfo`` now stands for its id; another object's error
    names its type."""
    path, _ = seeded
    with History(path) as h:
        info = h.run(1)
        assert h.run(info).id == 1
        assert len(h.events(info)) == len(h.events(1)) > 0
        assert sum(h.samples(info, columns=["step"], max_points=10).count) == N_SAMPLES
        with pytest.raises(RunNotFoundError) as caught:
            h.run(1.0)  # type: ignore[arg-type]
        assert str(caught.value) == (
            "a float is not a run reference; expected a run id, a uuid prefix or 'latest'"
        )


def test_an_integer_of_another_type_is_a_run_id(seeded: tuple[Path, dict[str, Any]]) -> None:
    """Regression: an id taken from ``to_pandas()`` (``numpy.int64``) or a 0-d tensor was
    refused as "not a run reference"; any integer type is the run id it holds."""
    np = pytest.importorskip("numpy")
    path, _ = seeded
    with History(path) as h:
        assert h.run(np.int64(2)).id == h.run(torch.tensor(2)).id == 2
        assert len(h.events(np.int32(1))) == len(h.events(1)) > 0
        with pytest.raises(RunNotFoundError, match="no run with id 99"):
            h.run(np.int64(99))
        with pytest.raises(RunNotFoundError, match="is not a run reference"):
            h.run(np.bool_(True))  # type: ignore[arg-type]


def test_prune_keeps_a_run_whose_process_lives_though_its_heartbeat_is_stale(
    seeded_sqlite: tuple[Path, dict[str, Any]],
) -> None:
    """Regression: a run whose process was stopped (SIGSTOP, a debugger, swapping) for longer
    than the heartbeat bound reads ``crashed``, and ``prune --keep-last 0`` deleted it and all it
    had recorded while the process lived on to write again. Its process on this host is alive
    (run 4: this test's own pid), so prune leaves it; run 5's process is gone."""
    path, _ = seeded_sqlite
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET heartbeat_at_s = ? WHERE id = 4", (time.time() - 3600,))
    with History(path, readonly=False) as h:
        assert [h.run(i).status for i in (4, 5)] == ["crashed", "crashed"]
        report = prune(h, keep_last=0)
    assert report["run_ids_deleted"] == [1, 2, 3, 5]
    with History(path) as h:
        assert [r.id for r in h.runs()] == [4]


def test_prune_keeps_another_hosts_running_run_for_a_day_after_its_heartbeat(
    seeded_sqlite: tuple[Path, dict[str, Any]],
) -> None:
    """Regression: a run recording into a shared database from another host reads ``crashed``
    while a network partition holds its heartbeat back, and ``prune --keep-last 0`` deleted it
    (its rows after the partition then failed: all it recorded was lost). This host cannot ask
    whether that process lives, so prune keeps such a run until its heartbeat is a day old."""
    path, _ = seeded_sqlite
    now = time.time()
    with sqlite3.connect(path) as conn:
        for run_id, beat_s in ((4, now - 60), (5, now - FOREIGN_RUN_GRACE_S - 60)):
            conn.execute(
                "UPDATE runs SET status = 'running', host = 'elsewhere', heartbeat_at_s = ? "
                "WHERE id = ?",
                (beat_s, run_id),
            )
    with History(path, readonly=False) as h:
        assert [h.run(i).status for i in (4, 5)] == ["crashed", "crashed"]
        report = prune(h, keep_last=0, now_s=now)
    assert report["run_ids_deleted"] == [1, 2, 3, 5]
    with History(path) as h:
        assert [r.id for r in h.runs()] == [4]


def test_name_filters_take_only_star_and_question_mark_as_wildcards_on_every_backend(
    seeded: tuple[Path | str, dict[str, Any]],
) -> None:
    """Regression: the filter went to SQL ``LIKE`` unescaped, so ``_`` and ``%`` were wildcards
    too (``my_run`` matched ``myXrun``), and letter case was ignored for ASCII alone on SQLite
    and not at all on PostgreSQL."""
    path, _ = seeded
    engine = open_engine(path)
    with engine.begin() as conn:
        for run_id, name in ((1, "my_run"), (2, "myXrun"), (3, "100%done"), (5, "Über-Lauf")):
            conn.execute(text("UPDATE runs SET name = :n WHERE id = :i"), {"n": name, "i": run_id})
    engine.dispose()
    with History(path) as h:

        def names(pattern: str) -> list[str]:
            return sorted(r.name for r in h.runs(name=pattern))

        assert names("my_run") == ["my_run"]
        assert names("MY_*") == ["my_run"]
        assert names("my?run") == ["myXrun", "my_run"]
        assert names("100%") == ["100%done"]
        assert names("über") == ["Über-Lauf"]
        assert names("LIVE") == ["live"]


def test_a_naive_datetime_is_utc_as_the_cli_prints_times(
    seeded_sqlite: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: ``start=datetime(...)`` without a zone was read as local time, so a window
    copied from ``show`` (UTC) found nothing under ``TZ=America/New_York``."""
    from datetime import datetime, timezone

    path, _ = seeded_sqlite
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:

        def naive(t: float) -> datetime:
            return datetime.fromtimestamp(t, tz=timezone.utc).replace(tzinfo=None)

        with History(path) as h:
            by_seconds = h.samples(1, start=T0 + 100, end=T0 + 200, columns=["step"])
            by_dates = h.samples(1, start=naive(T0 + 100), end=naive(T0 + 200), columns=["step"])
            assert len(by_seconds) > 0 and by_dates.time_s == by_seconds.time_s
            assert {r.id for r in h.runs(since=naive(T0))} == {r.id for r in h.runs(since=T0)}
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
