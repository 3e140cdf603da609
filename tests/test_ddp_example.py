"""The README's two-rank example, run as written: ``torchrun --nproc-per-node 2
examples/train_embedding.py --ddp`` (real torchrun, two gloo ranks on the CPU), then ``edo-monitor
jobs`` and ``edo-monitor job latest`` on what it wrote."""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from readme_blocks import readme_blocks

ROOT = Path(__file__).resolve().parents[1]
HEADING = "A job of several ranks: `torchrun`"
pytestmark = pytest.mark.slow


def _readme_commands() -> list[str]:
    [block] = readme_blocks(HEADING, "bash")
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.timeout(600)
def test_the_readme_ddp_example_applies_one_action_at_one_step_on_both_ranks(
    tmp_path: Path,
) -> None:
    if not (ROOT / "examples" / "train_embedding.py").is_file():
        pytest.skip("examples/ not found (tests run from a checkout)")
    launch, jobs, job, tui = _readme_commands()
    assert launch == ".venv/bin/torchrun --nproc-per-node 2 examples/train_embedding.py --ddp"
    assert (jobs, job, tui) == (
        ".venv/bin/edo-monitor jobs",
        ".venv/bin/edo-monitor job latest",
        ".venv/bin/edo-tui",
    )
    # the README's folder layout in a fresh folder: examples/ and .venv/ (this interpreter's
    # environment, whose bin holds torchrun and edo-monitor), the history written there
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE", "EDO_DB")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)

    def sh(command: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*shlex.split(command), *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=540,
        )

    done = sh(launch)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] run " in done.stdout and "status finished" in done.stdout
    db = tmp_path / "edo-history.db"
    con = sqlite3.connect(db)
    try:
        runs = con.execute(
            "SELECT id, rank, status, steps, job_id FROM runs ORDER BY rank"
        ).fetchall()
        actions = {
            rank: con.execute(
                "SELECT step, kind, data FROM events WHERE run_id = ? AND kind IN "
                "('action', 'action_refused', 'action_failed') ORDER BY id",
                (run_id,),
            ).fetchall()
            for run_id, rank, *_ in runs
        }
        crossings = {
            rank: con.execute(
                "SELECT count(*) FROM events WHERE run_id = ? AND kind = 'threshold_crossed' "
                "AND json_extract(data, '$.direction') = 'below'",
                (run_id,),
            ).fetchone()[0]
            for run_id, rank, *_ in runs
        }
    finally:
        con.close()
    assert [(r[1], r[2], r[3]) for r in runs] == [(0, "finished", 40), (1, "finished", 40)]
    assert runs[0][4] == runs[1][4] is not None  # one job
    assert crossings == {0: 0, 1: 1}  # only the heavier rank crossed the floor
    assert [len(a) for a in actions.values()] == [1, 1], actions
    (s0, k0, d0), (s1, k1, d1) = actions[0][0], actions[1][0]
    d0, d1 = json.loads(d0), json.loads(d1)
    assert k0 == k1 == "action" and s0 == s1  # the same step on both ranks
    assert d0["action"] == d1["action"] == "checkpoint_activations"
    assert d0["target"] == d1["target"] == "module.blocks.0,module.blocks.1"
    assert d0["proposed_by_rank"] == d1["proposed_by_rank"] == 1
    # the README's next two commands on what the job wrote
    listed = sh(jobs, "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["id"], row["status"], row["ranks"], row["min_free_rank"]) == (
        runs[0][4],
        "finished",
        [0, 1],
        1,
    )
    shown = sh(job)
    assert shown.returncode == 0, shown.stderr
    assert f"job {runs[0][4]} (train_embedding-ddp): finished" in shown.stdout
    assert shown.stdout.count("checkpoint_activations on module.blocks.0,module.blocks.1") == 2
