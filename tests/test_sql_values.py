"""``edo-monitor sql`` values as each output prints them, and ``--timeout`` over the whole
command.

Regression: the table printed a blob as Python's ``repr`` of its bytes, laid out by Rich: a
2 MB blob took 4.4 s, a 20 MB one with ``--timeout 2`` was still running after 60 s (the time
limit watched only SQLite's steps, and the query was done at once), a 1 GB one grew to 16 GB of
memory; ``--csv`` wrote ``b'\\x00\\xffA'``. Now the table shows ``<blob N bytes>`` and cuts long
texts, ``--csv`` and ``--json`` give a blob as hex, and the deadline is checked before each row.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from history_seed import seed

from edo_monitor.surfaces.cli.common import RefusedError
from edo_monitor.surfaces.cli.sql import _Query

EXIT_ERROR = 1


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sql") / "h.db"
    seed(path)
    return path


def sql(db: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("edo-monitor")), "sql", *args, "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def test_a_large_blob_is_a_placeholder_in_the_table_at_once(db: Path) -> None:
    start = time.monotonic()
    done = sql(db, "SELECT randomblob(20000000) AS b, 7 AS n", "--timeout", "2", timeout_s=30)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 20
    lines = done.stdout.splitlines()
    assert "│ <blob 20,000,000 bytes> │ 7 │" in lines and lines[-1] == "1 row(s)"


def test_blobs_and_long_texts_in_each_output(db: Path) -> None:
    query = "SELECT x'00ff41' AS b, x'' AS e, printf('%.250c', 'a') AS t, NULL AS z"
    table = sql(db, query)
    assert table.returncode == 0, table.stderr
    row = next(ln for ln in table.stdout.splitlines() if "<blob" in ln)
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:2] == ["<blob 3 bytes>", "<blob 0 bytes>"] and cells[3] == "NULL"
    assert "a" * 201 not in table.stdout  # the text is cut to 200 characters
    from edo_monitor.surfaces.cli.sql import _cell

    assert _cell("a" * 250) == "a" * 200 + "… (250 characters)"
    assert _cell(memoryview(b"\0" * 2_000_000)) == "<blob 2,000,000 bytes>"  # psycopg's bytea
    as_csv = sql(db, query, "--csv")
    assert list(csv.reader(io.StringIO(as_csv.stdout))) == [
        ["b", "e", "t", "z"],
        ["00ff41", "", "a" * 250, ""],
    ]
    as_json = sql(db, query, "--json")
    assert json.loads(as_json.stdout) == [{"b": "00ff41", "e": "", "t": "a" * 250, "z": None}]


def test_the_timeout_counts_the_printing_of_the_rows(db: Path) -> None:
    """The deadline is the command's: rows still to come after it are not read (before, a
    page of 500 rows was read at once and printing them was never checked)."""
    query = (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 100) SELECT x FROM c"
    )
    with _Query(str(db), query, 0.3) as q:
        _, rows = q.rows()
        assert next(rows) == (1,)
        time.sleep(0.5)  # a slow terminal, a large row being laid out
        with pytest.raises(RefusedError, match=r"ran past --timeout 0.3 s"):
            next(rows)
    with _Query(str(db), query, 0) as q:  # 0: no limit
        _, rows = q.rows()
        assert [r for (r,) in rows] == list(range(1, 101))
