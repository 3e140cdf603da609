"""``edo-monitor runs``' table: the rank column of a job's ranks (the CLI on real histories)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from history_seed import seed
from test_cli import run


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """The seeded history: five runs, none of them in a job."""
    path = tmp_path / "seeded.db"
    seed(path)
    return path


def runs_header(output: str) -> list[str]:
    """The column names of ``runs``' table (its header line, split on the box's bars)."""
    header = next(line for line in output.splitlines() if "status" in line and "uuid" in line)
    return [c.strip() for c in header.strip("┃│ ").replace("│", "┃").split("┃")]


def test_runs_shows_the_rank_when_a_listed_run_is_one_rank_of_a_job(
    db: Path, tmp_path: Path
) -> None:
    """The ranks of a DDP job share its name, and ``runs`` showed no rank: they could not be
    told apart (``runs --json``, ``jobs``, ``job`` and ``show`` carry it). A ``rank`` column
    now follows the name when a listed run has one (``-`` for a run outside a job)."""
    import torch.distributed as dist
    from torch import nn

    import edo_monitor

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of someone else's")
    ranked = tmp_path / "ranked.db"
    with edo_monitor.watch(nn.Linear(2, 1), db=ranked, run_name="solo"):
        pass
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with edo_monitor.watch(nn.Linear(2, 1), db=ranked, run_name="ddp") as mon:
            assert mon.rank == 0
    finally:
        dist.destroy_process_group()
    res = run("runs", db=ranked)
    assert res.exit_code == 0, res.output
    assert runs_header(res.output)[:5] == ["id", "uuid", "name", "rank", "status"]
    rows = {
        cells[2]: cells[3]
        for line in res.output.splitlines()
        if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) > 4
    }
    assert rows == {"ddp": "0", "solo": "-"}
    assert [r["rank"] for r in json.loads(run("runs", "--json", db=ranked).stdout)] == [0, None]
    # only runs outside a job (the seeded ones, or the filter leaving the ranked one out): no
    # column, the table stays as narrow as it was
    assert "rank" not in runs_header(run("runs", db=db).output)
    assert "rank" not in runs_header(run("runs", "--name", "solo", db=ranked).output)


def test_durations_of_a_minute_and_more_round_to_the_second_as_the_dashboard_does() -> None:
    """``show`` printed ``1m59s`` for 119.9 s (truncated) where the dashboard shows ``0:02:00``."""
    from edo_monitor.surfaces.cli.common import _dur

    assert [_dur(s) for s in (7.25, 59.94, 59.96, 119.5, 119.9, 3599.6)] == [
        "7.2s",
        "59.9s",
        "1m00s",
        "2m00s",
        "2m00s",
        "1h00m",
    ]
