"""The CLI's tables on a narrow terminal never cut what names a row: the run id and uuid prefix
of ``runs``, the job id of ``jobs``, an event's id (``ListTable``). The other columns give way;
a table wider than the terminal folds into several tables, each with the key columns.

Regressions: at ``COLUMNS=80`` ``runs`` cut every column to 2-3 characters (uuid ``a8…``); at 120
the uuid prefix read ``9045572…`` (``runs`` prints a 13-character or longer prefix that always
opens the run); at 160 ``jobs`` cut a job id (``70be85fc-2a7b-4c2d-a…``) that ``job`` takes as
``jobs`` prints it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from history_seed import JOB_IDS, UUIDS, seed_with_jobs
from rich.console import Console
from test_cli_width import _cli as cli_lines

from edo_monitor.surfaces.cli.common import Col, ListTable

#: the seeded runs' references as ``runs`` prints them (ids 1-5)
REFERENCES = {
    1: "90455722-7c1e-4c",
    2: "90455722-7c1e-40",
    3: "a3c2f1e0-0000",
    4: "a3d00000-0000",
    5: "0e0e0e0e-0000",
}


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded history (five runs), runs 1-2 the ranks of one job and 3-4 of another."""
    path = tmp_path_factory.mktemp("keys") / "history.db"
    seed_with_jobs(path)
    return path


def _cli(db: Path, *args: str, columns: int) -> str:
    """The CLI's stdout (a pipe) with ``COLUMNS`` set; exit code 0."""
    return "".join(line + "\n" for line in cli_lines(db, *args, columns=str(columns)))


def _cells(output: str) -> list[list[str]]:
    """The body rows of every table printed, as stripped cells."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")]
        for line in output.splitlines()
        if line.startswith("│")
    ]


def _fits(output: str, columns: int) -> None:
    widest = max(len(line) for line in output.splitlines())
    assert widest <= columns, (widest, output)
    assert "…" not in output, output  # nothing is cut


def test_the_seeded_references_are_what_runs_prints(history: Path) -> None:
    from edo_monitor.store.history import History

    with History(history, readonly=True) as h:
        assert h.uuid_references() == REFERENCES
    assert all(UUIDS[i - 1].startswith(ref) for i, ref in REFERENCES.items())


@pytest.mark.parametrize("columns", [80, 120])
def test_runs_never_cuts_the_id_or_the_uuid_prefix(history: Path, columns: int) -> None:
    output = _cli(history, "runs", columns=columns)
    _fits(output, columns)
    rows = _cells(output)
    # every table of the fold starts with the keys, whole, one row per run
    keyed = [(row[0], row[1]) for row in rows]
    expected = [(str(i), REFERENCES[i]) for i in (5, 4, 3, 2, 1)]
    assert len(keyed) % 5 == 0 and keyed == expected * (len(keyed) // 5), output
    words = " ".join(" ".join(row) for row in rows)
    for value in ("embed-big", "interrupted", "cpu-budget", "858.31 MiB", "10.0%", "50m00s"):
        assert value in words, value  # the other columns: given way, not lost
    for n, _ in enumerate(json.loads(_cli(history, "runs", "--json", columns=columns))):
        assert f"│ {REFERENCES[5 - n]} " in output


def test_runs_that_fit_are_one_table(history: Path) -> None:
    output = _cli(history, "runs", columns=200)
    assert sum(line.startswith("┏") for line in output.splitlines()) == 1
    assert len(_cells(output)) == 5


def test_a_printed_reference_opens_its_run(history: Path) -> None:
    """What ``runs`` prints at 80 columns is what ``show`` takes."""
    output = _cli(history, "runs", columns=80)
    for run_id, ref in REFERENCES.items():
        assert ref in output
        shown = json.loads(_cli(history, "show", ref, "--json", columns=80))
        assert shown["run"]["id"] == run_id


@pytest.mark.parametrize("columns", [80, 120, 160])
def test_jobs_never_cuts_the_job_id(history: Path, columns: int) -> None:
    output = _cli(history, "jobs", columns=columns)
    _fits(output, columns)
    rows = _cells(output)
    assert {row[0] for row in rows if row[0]} == set(JOB_IDS), output
    words = " ".join(" ".join(row) for row in rows)
    for value in ("pretrain-0", "pretrain-1", "nccl", "2/2"):
        assert value in words, value
    for job_id in JOB_IDS:  # named as jobs prints it
        shown = json.loads(_cli(history, "job", job_id, "--json", columns=columns))
        assert json.dumps(shown).count(job_id) >= 1


@pytest.mark.parametrize("columns", [40, 80])
def test_events_never_cut_the_event_id(history: Path, columns: int) -> None:
    """The id is what ``explain --event`` and ``snapshot --event`` take."""
    from edo_monitor.store.history import History

    with History(history, readonly=True) as h:
        ids = [e.id for e in h.events(1)]
    output = _cli(history, "events", "1", columns=columns)
    _fits(output, columns)
    assert [row[0] for row in _cells(output) if row[0]] == [str(i) for i in ids] * (
        len([row for row in _cells(output) if row[0]]) // len(ids)
    )


def test_show_never_cuts_the_uuid(history: Path) -> None:
    """``show`` at 80 columns: the run's whole uuid on one line (its value column folds long
    text over lines instead of cutting it)."""
    output = _cli(history, "show", "1", columns=80)
    _fits(output, 80)
    assert UUIDS[0] in output


def test_a_terminal_too_narrow_for_a_table_shows_each_row_as_lines(history: Path) -> None:
    """Where the keys and one column do not fit: ``header: value`` lines, nothing cut."""
    output = _cli(history, "runs", columns=30)
    _fits(output, 30)
    for run_id, ref in REFERENCES.items():
        assert f"id: {run_id}\nuuid: {ref}\n" in output
    assert "name: embed-big" in output and "status: interrupted" in output


def _render(table: ListTable, width: int) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(table)
    console.file.close()
    return console.export_text()


def test_list_table_folds_by_the_columns_full_widths() -> None:
    """The fold keeps the columns' order, each part the keys and the columns that fit whole;
    a single column wider than the line folds its text over lines (no ``…``)."""
    table = ListTable(Col("id", "right", key=True), Col("a"), Col("b"), Col("c"), title="t")
    table.add_row("12345", "x" * 20, "y" * 20, "z" * 50)
    assert table.layout(200) == [{0: 5, 1: 20, 2: 20, 3: 50}]
    assert table.layout(60) == [{0: 5, 1: 20, 2: 20}, {0: 5, 3: 48}]
    assert table.layout(40) == [{0: 5, 1: 20}, {0: 5, 2: 20}, {0: 5, 3: 28}]
    assert table.layout(19) is None  # the keys (5 wide) and a column of 8 need 20
    text = _render(table, 40)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 40
    assert text.count("12345") == 3  # the keys in every part
    assert [line.strip() for line in text.splitlines()].count("t") == 1  # the title, once
    assert "z" * 50 in "".join(re.findall(r"│ (z+) *│", text))  # folded over lines, whole


def test_list_table_wraps_words_before_it_folds() -> None:
    """Text that can wrap at its words wraps in one table (the widest column gives way first,
    never below its longest word); the keys keep their width."""
    table = ListTable(Col("id", key=True), Col("kind"), Col("message"))
    table.add_row("7", "threshold_crossed", "free below the floor of 20% at step 120")
    assert table.layout(80) == [{0: 2, 1: 17, 2: 39}]
    assert table.layout(50) == [{0: 2, 1: 17, 2: 21}]
    assert table.layout(40) == [{0: 2, 1: 17, 2: 11}]
    text = _render(table, 40)
    assert "free below" in text and "threshold_crossed" in text and "…" not in text
    assert table.layout(36) == [{0: 2, 1: 17, 2: 7}]  # the longest words: "message", "floor"
    assert table.layout(30) == [{0: 2, 1: 17}, {0: 2, 2: 21}]  # then it folds


def test_list_table_shows_rows_as_lines_where_no_table_fits() -> None:
    table = ListTable(Col("id", "right", key=True), Col("a"), Col("b"), Col("c"), title="t")
    table.add_row("12345", "x" * 20, "y" * 20, "z" * 50)
    narrow = _render(table, 19)  # a word longer than the line folds, never cut
    assert [line.rstrip() for line in narrow.splitlines()] == [
        "t",
        "id: 12345",
        "a:",
        "x" * 19,
        "x",
        "b:",
        "y" * 19,
        "y",
        "c:",
        *["z" * 19] * 2,
        "z" * 12,
    ]


def test_list_table_checks_its_rows() -> None:
    table = ListTable(Col("id", key=True), Col("a"))
    with pytest.raises(ValueError, match="1 cells for 2 columns"):
        table.add_row("1")
