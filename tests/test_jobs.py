"""Seeing a multi-rank job (issue 13, item 5): ``edo-monitor jobs``, ``edo-monitor job JOB`` and
the dashboard's job view (``j``), on a real SQLite file written by a real two-rank gloo job
(tests/ranks_worker.py, run once for this module): only rank 1 falls below the floor, and both
ranks offload the table at the same step."""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rich.console import Console
from test_cli import run
from test_ranks import run_ranks
from textual.pilot import Pilot
from textual.widgets import DataTable, Static
from tui_helpers import REFRESH_S, run_app, text_of, wait_for

import edo_monitor
from edo_monitor.store.history import History
from edo_monitor.tui.app import EXIT_OK, EdoTui
from edo_monitor.tui.job_screen import JobScreen

pytestmark = pytest.mark.slow  # the module's job: two Python processes importing torch


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real two-rank job written into ``history.db``: its results by rank and the path."""
    folder = tmp_path_factory.mktemp("job")
    db = folder / "history.db"
    results = run_ranks("pressure", str(db), 2, folder, "ladder=offload_embedding", "sync=4")
    return {"db": db, "results": results, "job_id": results[0]["job_id"]}


def _latest_free(db: Path, run_id: int) -> float:
    """The free fraction of the run's newest sample, read with sqlite3 (not through History)."""
    con = sqlite3.connect(db)
    try:
        (value,) = con.execute(
            "SELECT free_fraction FROM samples WHERE run_id = ? ORDER BY time_s DESC, id DESC "
            "LIMIT 1",
            (run_id,),
        ).fetchone()
    finally:
        con.close()
    return float(value)


def test_jobs_lists_the_job(job: dict[str, Any]) -> None:
    db, results = job["db"], job["results"]
    res = run("jobs", db=db)
    assert res.exit_code == 0, res.output
    [line] = [ln for ln in res.stdout.splitlines() if job["job_id"] in ln]
    for word in ("pressure", "finished", "2/2", "gloo", "40"):
        assert word in line
    [row] = json.loads(run("jobs", "--json", db=db).stdout)
    assert (row["id"], row["world_size"], row["ranks"], row["status"], row["min_steps"]) == (
        job["job_id"],
        2,
        [0, 1],
        "finished",
        40,
    )
    assert row["min_free_rank"] == 1
    assert row["min_free_fraction"] == pytest.approx(results[1]["min_free_fraction"])
    assert (row["action_count"], row["oom_count"]) == (2, 0)
    assert json.loads(run("jobs", "--json", "--status", "running", db=db).stdout) == []
    assert len(json.loads(run("jobs", "--json", "--since", "1h", db=db).stdout)) == 1


def test_runs_tells_the_ranks_of_the_job_apart(job: dict[str, Any]) -> None:
    """Both ranks' runs are named ``pressure``; ``runs`` showed nothing else to tell them apart.
    Its ``rank`` column now does."""
    res = run("runs", db=job["db"])
    assert res.exit_code == 0, res.output
    ranks = sorted(
        cells[3]
        for line in res.stdout.splitlines()
        if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) > 4
        and cells[2] == "pressure"
    )
    assert ranks == ["0", "1"]


def test_job_shows_ranks_the_tightest_and_the_same_action_at_the_same_step(
    job: dict[str, Any],
) -> None:
    db, results = job["db"], job["results"]
    res = run("job", job["job_id"][:8], db=db)  # a unique prefix opens it
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert out.startswith(f"job {job['job_id']} (pressure): finished")
    ranks = [ln for ln in out.splitlines() if ln.startswith("│") and "finished" in ln]
    assert len(ranks) == 2 and "◀ tightest" in ranks[1] and "◀ tightest" not in ranks[0]
    moves = [ln for ln in out.splitlines() if "offload_embedding on emb: saved 9.77 MiB" in ln]
    assert len(moves) == 2
    data = json.loads(run("job", "latest", "--json", db=db).stdout)
    assert data["job"]["id"] == job["job_id"] and data["tightest_rank"] == 1
    assert [(r["rank"], r["id"], r["tightest"]) for r in data["ranks"]] == [
        (0, results[0]["run_id"], False),
        (1, results[1]["run_id"], True),
    ]
    for r, res_ in zip(data["ranks"], results, strict=True):
        assert r["free_now_fraction"] == pytest.approx(_latest_free(db, res_["run_id"]))
        assert r["min_free_fraction"] == pytest.approx(res_["min_free_fraction"])
    a0, a1 = (
        [(a["kind"], a["step"], a["data"]["action"]) for a in r["actions"]] for r in data["ranks"]
    )
    assert a0 == a1 and len(a0) == 1 and a0[0][0] == "action" and a0[0][2] == "offload_embedding"


def test_job_references_and_exit_codes(job: dict[str, Any], tmp_path: Path) -> None:
    db, results = job["db"], job["results"]
    res = run("job", "nope", db=db)
    assert res.exit_code == 1 and "no job with id or id prefix 'nope'" in res.stderr
    res = run("jobs", "--status", "bogus", db=db)
    assert res.exit_code == 2 and "is not a job status" in res.stderr
    res = run("jobs", db=tmp_path / "missing.db")
    assert res.exit_code == 1 and not (tmp_path / "missing.db").exists()
    # a run that is a rank says which job
    shown = run("show", str(results[1]["run_id"]), db=db)
    assert shown.exit_code == 0
    assert f"{job['job_id']} (rank 1 of 2; edo-monitor job {job['job_id']})" in shown.stdout
    # a database without jobs
    plain_db = tmp_path / "plain.db"
    model = torch.nn.Embedding(10, 2)
    with edo_monitor.watch(model, db=plain_db, interval_s=0.05):
        pass
    res = run("jobs", db=plain_db)
    assert res.exit_code == 0 and res.stdout.startswith("no jobs recorded")
    assert run("job", "latest", db=plain_db).exit_code == 1
    assert "job JOB" in run("--help").stdout


def _shown(widget: Static) -> str:
    console = Console(width=max(60, widget.size.width), file=io.StringIO(), record=True)
    console.print(widget.content)
    return console.export_text()


def _add_one_rank_job(db: Path, folder: Path) -> str:
    """A second job in the file: this process as a gloo group of one (newest job)."""
    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Embedding(100, 4)
        with edo_monitor.watch(model, db=db, interval_s=0.02, run_name="solo") as mon:
            pass
    finally:
        dist.destroy_process_group()
    assert mon.job_id is not None
    return mon.job_id


def test_job_view_shows_ranks_side_by_side(
    job: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    db = tmp_path / "history.db"
    shutil.copy(job["db"], db)
    results = job["results"]
    app = EdoTui(db, run=str(results[1]["run_id"]), refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: app.run_screen.loaded)
        await pilot.press("j")  # from rank 1's run: its job
        screen = app.job_screen
        assert app.screen is screen and isinstance(screen, JobScreen)
        await wait_for(pilot, lambda: screen.loads >= 1)
        header = text_of(screen.query_one("#jobs-header", Static))
        assert header.startswith(f"job {job['job_id']} (pressure): finished, 2 of 2 rank(s)")
        assert "tightest: rank 1 (min free -" in header
        text = _shown(screen.query_one("#job-body", Static))
        head = next(ln for ln in text.splitlines() if "rank 0" in ln)
        assert head.index("rank 0") < head.index("rank 1  ◀ tightest")  # side by side
        free_now = next(ln for ln in text.splitlines() if ln.startswith("free now"))
        frees = [f"{100 * _latest_free(db, r['run_id']):.1f} %" for r in results]
        assert free_now.index(frees[0]) < free_now.rindex(frees[1])
        moves = [ln for ln in text.splitlines() if "offload_embedding on emb" in ln]
        assert len(moves) == 1 and moves[0].count("offload_embedding on emb") == 2  # both ranks
        step = next(e.step for e in History(db).events(results[0]["run_id"], kind="action"))
        assert text.count(f"step {step} ") == 2
        table = screen.query_one("#jobs", DataTable)
        assert table.row_count == 1
        # a second job appears live; Enter on it shows it
        solo = _add_one_rank_job(db, tmp_path)
        await wait_for(pilot, lambda: table.row_count == 2)
        row = table.get_row_index(solo)
        await pilot.press("down" if row == 1 else "up")
        # the cursor stays where the user put it across refreshes (it snapped back to the job
        # shown at every refresh, so another job could not be chosen)
        loads = screen.loads
        await wait_for(pilot, lambda: screen.loads >= loads + 2)
        assert table.cursor_row == row
        await pilot.press("enter")
        await wait_for(
            pilot,
            lambda: text_of(screen.query_one("#jobs-header", Static)).startswith(f"job {solo}"),
        )
        text = _shown(screen.query_one("#job-body", Static))
        # one rank, no budget: no free fraction (N/A, not zero), so no tightest rank
        assert "rank 0" in text and "rank 1" not in text and "tightest" not in text
        assert next(ln for ln in text.splitlines() if ln.startswith("free now")).split() == [
            "free",
            "now",
            "N/A",
        ]
        # from the runs view `j` keeps the chosen job; `l` and `q` as everywhere
        await pilot.press("r")
        await pilot.press("j")
        assert app.screen is screen and screen.chosen == solo
        await pilot.press("q")

    run_app(app, body)
    assert app.exit_code == EXIT_OK


def test_job_view_without_jobs_says_what_a_job_is(tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    model = torch.nn.Embedding(10, 2)
    with edo_monitor.watch(model, db=db, interval_s=0.05):
        pass
    app = EdoTui(db, refresh_s=REFRESH_S)

    async def body(pilot: Pilot[None]) -> None:
        await pilot.press("j")
        screen = app.job_screen
        await wait_for(pilot, lambda: screen.loads >= 1)
        assert text_of(screen.query_one("#job-body", Static)).startswith("No multi-rank jobs in")
        await pilot.press("q")

    run_app(app, body)
    assert app.exit_code == EXIT_OK
