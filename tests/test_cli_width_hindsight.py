"""``explain`` and ``job`` on an 80-column terminal never cut what names a row (``ListTable``):
a remedy and its target, a stage of the staged plan and its action, a rank and its run id.

Regressions: at ``COLUMNS=80`` ``explain`` printed ``checkpoint_activat…`` for a remedy and
``mixed_pre…`` for a stage's action, and ``job`` cut its ranks table's columns (``sta…``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from history_seed import JOB_IDS, seed_with_jobs
from test_cli_width import _cli as cli_lines

COLUMNS = 80


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded history (five runs; run 1 crossed the floor), runs 1-2 the ranks of one job
    and 3-4 of another."""
    path = tmp_path_factory.mktemp("hindsight-width") / "history.db"
    seed_with_jobs(path)
    return path


def _cli(db: Path, *args: str) -> str:
    """The CLI's stdout (a pipe) at ``COLUMNS=80``; exit code 0."""
    return "".join(line + "\n" for line in cli_lines(db, *args, columns=str(COLUMNS)))


def _cells(output: str) -> list[list[str]]:
    """The rows of every table printed (with or without an outer edge), as stripped cells."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")]
        for line in output.splitlines()
        if "│" in line
    ]


def _fits(output: str) -> None:
    widest = max(len(line) for line in output.splitlines())
    assert widest <= COLUMNS, (widest, output)
    assert "…" not in output, output  # nothing is cut


def test_explain_prints_every_remedy_and_stage_whole(history: Path) -> None:
    output = _cli(history, "explain", "1")
    incidents = json.loads(_cli(history, "explain", "1", "--json"))["incidents"]
    remedies = [(r["action"], r["target"]) for i in incidents for r in i["remedies"]]
    stages = [
        (str(s["stage"]), s["action"])
        for i in incidents
        if i["staged_plan"]
        for s in i["staged_plan"]["stages"]
    ]
    assert remedies and stages
    assert any(len(action) > 18 for action, _ in remedies)  # was cut at 80 columns
    assert any(len(action) > 10 for _, action in stages)
    _fits(output)
    rows = [tuple(row[:2]) for row in _cells(output)]
    for row in remedies + stages:
        assert row in rows, (row, output)


@pytest.mark.parametrize("job", JOB_IDS)
def test_job_prints_every_rank_and_run_whole(history: Path, job: str) -> None:
    output = _cli(history, "job", job)
    ranks = json.loads(_cli(history, "job", job, "--json"))["ranks"]
    expected = [(str(r["rank"]), str(r["id"])) for r in ranks]
    assert len(expected) == 2
    _fits(output)
    ranks_tables, _, actions_table = output.partition("actions (every rank)")
    rows = [tuple(row[:2]) for row in _cells(ranks_tables)]
    # every table of the fold starts with the keys, whole, one row per rank
    assert rows and rows == expected * (len(rows) // len(expected)), output
    words = " ".join(" ".join(row) for row in _cells(output))
    for r in ranks:  # the other columns: given way, not lost
        assert r["status"] in words and r["host"] in words, r
    for rank in ranks:  # the actions: step, rank and kind whole
        for e in rank["actions"]:
            assert [str(e["step"]), str(rank["rank"]), e["kind"]] in [
                row[:3] for row in _cells(actions_table)
            ], (e, output)
