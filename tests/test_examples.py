"""The examples on the shared data (``../shared/data`` or ``$EDO_DATA_DIR``; the fixtures skip
with the reason when it is absent): the recommender on MovieLens, the main example on a text file
given with ``--text``. Each runs as a user runs it, in a subprocess."""

from __future__ import annotations

import csv
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = pytest.mark.slow


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = EXAMPLES / name
    if not script.is_file():
        pytest.skip(f"{script} not found (tests run from a checkout)")
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600
    )


def test_recommender_on_movielens(movielens_dir: Path, tmp_path: Path) -> None:
    # the data, counted here: ratings, distinct users and distinct movies
    with (movielens_dir / "ratings.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    n, users, items = len(rows), len({r["userId"] for r in rows}), len({r["movieId"] for r in rows})
    db = tmp_path / "rec.db"
    done = run_example(
        "train_recommender.py",
        "--data",
        str(movielens_dir),
        "--db",
        str(db),
        "--epochs",
        "2",
        "--dim",
        "16",
    )
    assert done.returncode == 0, done.stderr
    assert f"{n:,} ratings, {users:,} users x {items:,} items, dim 16" in done.stdout
    train_rmse = [float(x) for x in re.findall(r"train RMSE ([\d.]+)", done.stdout)]
    assert len(train_rmse) == 2 and train_rmse[1] < train_rmse[0]  # it learns
    # 90 % of the ratings in batches of 1024, twice
    steps = 2 * -(-int(0.9 * n) // 1024)
    con = sqlite3.connect(db)
    assert con.execute("SELECT name, status, steps FROM runs").fetchall() == [
        ("recommender", "finished", steps)
    ]
    tables = con.execute(
        "SELECT module, num_embeddings, embedding_dim, params_bytes FROM module_stats "
        "WHERE kind = 'Embedding' GROUP BY module ORDER BY module"
    ).fetchall()
    con.close()
    assert tables == [
        ("item_bias", items, 1, items * 4),
        ("items", items, 16, items * 16 * 4),
        ("user_bias", users, 1, users * 4),
        ("users", users, 16, users * 16 * 4),
    ]


def test_main_example_trains_on_a_text_file(shakespeare_path: Path, tmp_path: Path) -> None:
    text = shakespeare_path.read_text(encoding="utf-8", errors="replace")
    # the example's tokens: words, numbers, single punctuation marks; a position per token after
    # the first 4 (the context)
    tokens = re.findall(r"[A-Za-z_]+|[0-9]+|[^\sA-Za-z0-9_]", text)
    db = tmp_path / "text.db"
    done = run_example(
        "train_embedding.py",
        "--text",
        str(shakespeare_path),
        "--db",
        str(db),
        "--steps",
        "6",
        "--budget",
        "1GiB",
    )
    assert done.returncode == 0, done.stderr
    assert f"training on {len(tokens) - 4:,} positions of {shakespeare_path};" in done.stdout
    # fewer than 10 steps: the summary's loss averages say over how many (they said "10")
    assert re.search(r"\(first 6 steps\) -> [\d.]+ \(last 6\)", done.stdout), done.stdout
    con = sqlite3.connect(db)
    assert con.execute("SELECT name, status, steps FROM runs").fetchall() == [
        ("train_embedding", "finished", 6)
    ]
    con.close()


def test_recommenders_cache_line_is_the_recorded_runs(movielens_dir: Path, tmp_path: Path) -> None:
    """Regression: the test RMSE the example returned was evaluated after the ``watch`` block had
    closed, and the ``cache items:`` line, printed next to ``run 1: N steps``, counted those
    lookups too: 598 rows loaded and evicted more than the history held for the run, and its
    "hit rate" was the unique ids' where ``edo-monitor show`` gives the lookups' (93.2 % beside
    94.6 %). The line now gives the run's figures, as the history holds them."""
    db = tmp_path / "rec.db"
    done = run_example(
        "train_recommender.py",
        "--data",
        str(movielens_dir),
        "--db",
        str(db),
        "--budget",
        "8MiB",
        "--no-compare",
        "--epochs",
        "2",
    )
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("cache items: ")]
    # the budget converts the item table from the first readings on
    figures = re.fullmatch(
        r"cache items: (\d+) of \d+ rows on the device, hit rate ([\d.]+)%(.*), ([\d,]+) rows "
        r"loaded, ([\d,]+) evicted, ([\d.]+) MiB host->device, ([\d.]+) MiB device->host",
        line,
    )
    assert figures, line
    rows, hit_rate, which, loaded, evicted, h2d, d2h = figures.groups()
    con = sqlite3.connect(db)
    # what `edo-monitor show` and the dashboard sum: the samples' increments
    sums = con.execute(
        "SELECT sum(cache_lookups), sum(cache_lookup_hits), sum(cache_rows_loaded), "
        "sum(cache_rows_evicted), sum(cache_moved_bytes) FROM samples "
        "WHERE cache_rows IS NOT NULL"
    ).fetchone()
    # and the table's totals in its last module_stats row
    totals = con.execute(
        "SELECT cache_rows, cache_lookups, cache_lookup_hits, cache_rows_loaded, "
        "cache_rows_evicted, cache_moved_bytes FROM module_stats WHERE module = 'items' "
        "AND cache_rows IS NOT NULL ORDER BY id DESC LIMIT 1"
    ).fetchone()
    con.close()
    lookups, hits, db_loaded, db_evicted, moved = sums
    assert totals == (int(rows), *sums)
    assert (int(loaded.replace(",", "")), int(evicted.replace(",", ""))) == (
        db_loaded,
        db_evicted,
    )
    assert hit_rate == f"{100 * hits / lookups:.1f}"
    # h2d + d2h, each printed to 0.01 MiB, is the bytes moved either way
    assert abs(float(h2d) + float(d2h) - moved / 2**20) <= 0.011
    # the unique ids' rate is there, named, after the one `show` gives
    assert re.fullmatch(r" of lookups \([\d.]+% of each batch's unique ids\)", which), line
