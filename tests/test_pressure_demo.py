"""The pressure demo (examples/train_embedding.py), short: the tuner saves the run; without it
the same budget ends in an out-of-memory error."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_embedding.py"
pytestmark = pytest.mark.slow


def run_example(db: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    if not EXAMPLE.is_file():
        pytest.skip(f"{EXAMPLE} not found (tests run from a checkout)")
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--db", str(db), "--steps", "40", *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )


# the tuned run trains behind the row cache, whose exact Adam catch-up of reloaded rows costs more
# CPU than the offload did; on a shared 2-core machine both runs take minutes
@pytest.mark.timeout(1200)
def test_tuned_run_survives_and_untuned_run_runs_out_of_memory(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    tuned = run_example(db)
    assert tuned.returncode == 0, tuned.stderr
    first, last = map(float, re.search(r"loss\s+([\d.]+) .* -> ([\d.]+)", tuned.stdout).groups())
    assert last < first
    # the first rung that plans: a device row cache over the host table (sized to get back to
    # the re-arm level; shrunk again if the pressure returns)
    assert "action           cache_embedding on features: saved" in tuned.stdout

    con = sqlite3.connect(db)
    (run_id,) = con.execute("SELECT id FROM runs WHERE status='finished'").fetchone()
    events = con.execute(
        "SELECT kind, step, data FROM events WHERE run_id=? ORDER BY id", (run_id,)
    ).fetchall()
    kinds = [k for k, _, _ in events]
    # the sampler keeps reading while a decision waits for the step boundary, so a crossing may
    # be recorded between a decision and its action (it was, once, in a loaded CI run)
    acting = [k for k in kinds if k != "threshold_crossed"]
    assert kinds[0] == "threshold_crossed" and acting[:2] == ["decision", "action"]
    crossed_below = json.loads(events[0][2])
    assert crossed_below["direction"] == "below" and crossed_below["free_fraction"] < 0.20
    i_action = kinds.index("action")
    action = json.loads(events[i_action][2])
    # the table (weight + grad + Adam's two states) left the device; the cache rows (weight and
    # states: a row cache has no dense gradient) stay; x dim x 4 bytes
    kept = action["details"]["cache_rows"]
    saved = (100_003 * 4 - kept * 3) * 64 * 4
    assert action["saved_bytes"] == saved == action["estimated_saving_bytes"]
    # applied at most one step after the reading that crossed the floor
    assert events[i_action][1] - action["decided_at_step"] <= 1
    back_above = [json.loads(d)["direction"] for k, _, d in events[1:] if k == "threshold_crossed"]
    assert "above" in back_above  # back above the re-arm level
    last = con.execute(
        "SELECT free_fraction FROM samples WHERE run_id=? ORDER BY id DESC LIMIT 1", (run_id,)
    ).fetchone()[0]
    assert last > 0.20

    untuned = run_example(db, "--no-tune")
    assert untuned.returncode == 1
    assert "CPU-budget out of memory. Tried to allocate" in untuned.stderr
    status, error = con.execute(
        "SELECT status, error FROM runs WHERE name='train_embedding-no-tune'"
    ).fetchone()
    assert status == "failed" and error.startswith("BudgetOutOfMemoryError")
    oom = con.execute(
        "SELECT data FROM events WHERE kind='oom' AND run_id="
        "(SELECT id FROM runs WHERE name='train_embedding-no-tune')"
    ).fetchone()
    parsed = json.loads(oom[0])["parsed"]
    assert parsed["backend"] == "cpu-budget"
    assert parsed["total_bytes"] == 158 * 1024 * 1024
    assert json.loads(oom[0])["top_consumers"][0]["module"] == "features"


def test_the_example_says_what_it_does_before_importing_torch(tmp_path: Path) -> None:
    """Importing PyTorch takes seconds: the example's first line comes before it (issue 10, 12).

    ``python -v`` writes each import to stderr, merged here into the same pipe as stdout (the
    example flushes its line), so the order of the two is the order they happened in.
    """
    proc = subprocess.Popen(
        [sys.executable, "-v", str(EXAMPLE), "--db", str(tmp_path / "h.db")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("import 'torch'"):
                break
    finally:
        proc.kill()
        proc.wait()
    said = [i for i, line in enumerate(lines) if line.startswith("train_embedding: loading")]
    torch_at = [i for i, line in enumerate(lines) if line.startswith("import 'torch'")]
    assert torch_at, "torch was never imported"
    assert said and said[0] < torch_at[0]


@pytest.mark.timeout(1200)
def test_forecasting_acts_before_the_crossing_and_free_memory_never_goes_below_the_floor(
    tmp_path: Path,
) -> None:
    """The demo with a linear batch ramp and ``--forecast 10`` (issue 14, item 2): the policy
    caches the table (and shrinks the cache later) ahead of each forecast crossing."""
    db = tmp_path / "forecast.db"
    run = run_example(db, "--ramp", "linear", "--forecast", "10", "--interval", "0.1")
    assert run.returncode == 0, run.stderr
    con = sqlite3.connect(db)
    (run_id,) = con.execute("SELECT id FROM runs WHERE status='finished'").fetchone()
    (min_free,) = con.execute(
        "SELECT min(free_fraction) FROM samples WHERE run_id=?", (run_id,)
    ).fetchone()
    assert min_free >= 0.20
    events = [
        (kind, step, json.loads(data))
        for kind, step, data in con.execute(
            "SELECT kind, step, data FROM events WHERE run_id=? ORDER BY id", (run_id,)
        )
    ]
    kinds = [k for k, _, _ in events]
    assert "threshold_crossed" not in kinds
    forecast = next(d for k, _, d in events if k == "forecast")
    outcome = next(d for k, _, d in events if k == "forecast_outcome")
    action_step, action = next((s, d) for k, s, d in events if k == "action")
    assert forecast["forecast"] == outcome["forecast"] == 1
    assert forecast["category_slopes"]["activations_bytes"] > 0  # the batch grows
    # without the actions taken since, free memory would have crossed the floor: it came true,
    # after some steps of warning, and the first action came before that crossing
    assert outcome["came_true"] is True and outcome["lead_steps"] >= 1
    assert action["action"] == "cache_embedding" and action_step < outcome["crossing_step"]
    # every decision that frees memory acted on a forecast (a grow_cache gives rows back when
    # the cache freed more than the forecast needed: the dropped dense gradient is a margin)
    freeing = [d for k, _, d in events if k == "decision" and d["action"] != "grow_cache"]
    assert freeing and all("forecast" in d for d in freeing)
    # judged outcomes all came true (the last forecast may be open when the run ends)
    judged = [d["came_true"] for k, _, d in events if k == "forecast_outcome"]
    assert all(j is True for j in judged[:-1]) and judged[-1] in (True, None)


def test_out_of_memory_in_the_first_step_prints_no_loss(tmp_path: Path) -> None:
    """Regression: a budget the parameters fit in (24.92 MiB) but not the first step's gradients
    and Adam state ran out of memory at step 0 and printed ``loss 0.000 (first 0 steps) -> 0.000
    (last 0)``, a loss no step computed; ``min free`` already said ``N/A`` when it had nothing."""
    if not EXAMPLE.is_file():
        pytest.skip(f"{EXAMPLE} not found (tests run from a checkout)")
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"word{i % 97} next{i % 13}" for i in range(5_000)))
    db = tmp_path / "oom0.db"
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--text",
            str(text),
            "--db",
            str(db),
            "--budget",
            "26MiB",
            "--steps",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "out of memory at step 0: CPU-budget out of memory." in done.stderr
    summary = done.stdout[done.stdout.index("== edo-monitor summary ==") :].splitlines()
    assert re.fullmatch(r"steps +0 in [\d.]+ s", summary[3]), summary
    assert summary[4] == "loss             N/A (no step finished)", summary
    con = sqlite3.connect(db)
    assert con.execute("SELECT status, steps FROM runs").fetchall() == [("failed", 0)]
    con.close()
