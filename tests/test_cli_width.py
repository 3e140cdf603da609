"""The CLI's tables on a pipe: they honour ``COLUMNS`` (they were 200 characters wide whatever
it said; without it a pipe keeps the wide default), and ``show``'s modules table says which step
and time its figures are from (they can be from the first steps of a long run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from history_seed import T0, seed
from sqlalchemy.orm import Session

from edo_monitor.store.engine import open_engine
from edo_monitor.store.models import Event, ModuleStat

#: the width of a pipe without COLUMNS (the CLI's deliberate wide default)
PIPED_WIDTH = 200
LONG = "allocator retried " + " ".join(f"segment{i}" for i in range(12))


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded history, run 1 with an event whose message is longer than any terminal."""
    path = tmp_path_factory.mktemp("width") / "history.db"
    seed(path)
    engine = open_engine(path)
    with Session(engine) as s, s.begin():
        s.add(Event(run_id=1, time_s=T0 + 300, step=120, kind="warning", message=LONG, data={}))
        # run 2 (started at T0 + 10, 10 steps): both modules at step 3; run 3 (T0 + 20, 10
        # steps): one module's latest row at step 2, the other's at step 8
        for run_id, module, step, t in (
            (2, "emb", 3, T0 + 12.5),
            (2, "head", 3, T0 + 12.5),
            (3, "emb", 2, T0 + 21),
            (3, "head", 8, T0 + 27),
        ):
            s.add(
                ModuleStat(
                    run_id=run_id,
                    time_s=t,
                    step=step,
                    module=module,
                    kind="Embedding" if module == "emb" else "Linear",
                    params_bytes=4000 if module == "emb" else 40,
                    grads_bytes=0,
                    optimizer_state_bytes=0,
                    activations_bytes=0,
                )
            )
    engine.dispose()
    return path


def _cli(db: Path, *args: str, columns: str | None) -> list[str]:
    """The CLI's stdout lines, stdout a pipe, with ``COLUMNS`` set to ``columns`` (or unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "EDO_DB")}
    if columns is not None:
        env["COLUMNS"] = columns
    done = subprocess.run(
        [sys.executable, "-m", "edo_monitor.surfaces.cli", *args, "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("command", [["events", "1"], ["show", "1"], ["show", "1", "--modules"]])
@pytest.mark.parametrize("columns", ["80", "60", "120"])
def test_a_pipe_is_as_wide_as_columns_says(history: Path, command: list[str], columns: str) -> None:
    lines = _cli(history, *command, columns=columns)
    widest = max(len(line) for line in lines)
    assert widest <= int(columns), (widest, "\n".join(lines))
    if command[0] == "events":  # the long message is wrapped, not lost
        words = " ".join(" ".join(lines).replace("│", " ").split())
        assert "segment0" in words and "segment11" in words


def test_a_pipe_without_columns_keeps_the_wide_default(history: Path) -> None:
    """``edo-monitor events 1 > file`` keeps a long row on one line (up to 200 characters)."""
    for columns in (None, "", "wide", "0"):  # unset, empty or not a width: the default
        lines = _cli(history, "events", "1", columns=columns)
        widest = max(len(line) for line in lines)
        assert 80 < widest <= PIPED_WIDTH, (columns, widest)
        assert any("segment0" in line and "segment11" in line for line in lines), columns


def test_output_width_follows_rich_rule() -> None:
    """COLUMNS when set, else the terminal (``None``: Rich measures it), else the wide default."""
    from edo_monitor.surfaces.cli.common import PIPED_WIDTH as CLI_PIPED_WIDTH
    from edo_monitor.surfaces.cli.common import output_width

    assert CLI_PIPED_WIDTH == PIPED_WIDTH
    assert output_width({"COLUMNS": "80"}, tty=False) == 80
    assert output_width({"COLUMNS": "80"}, tty=True) == 80
    assert output_width({}, tty=True) is None
    assert output_width({}, tty=False) == PIPED_WIDTH
    assert output_width({"COLUMNS": "-5"}, tty=False) == PIPED_WIDTH


def _title(lines: list[str], start: str) -> str:
    return next(line.strip() for line in lines if line.strip().startswith(start))


@pytest.mark.parametrize("flag", [[], ["--modules"]])
def test_the_modules_table_names_its_step(history: Path, flag: list[str]) -> None:
    """One step for every module: the title names it, the run's steps and the time."""
    lines = _cli(history, "show", "2", *flag, columns="250")
    assert _title(lines, "modules") == (
        "modules at step 3 of 10 (t+2.5s, the latest accounting): bytes by category, largest first"
    )


@pytest.mark.parametrize("flag", [[], ["--modules"]])
def test_modules_from_different_steps_show_each_ones_step(history: Path, flag: list[str]) -> None:
    lines = _cli(history, "show", "3", *flag, columns="250")
    assert _title(lines, "modules") == (
        "modules, each at its latest accounting (steps 2-8 of 10, t+1.0s-7.0s): bytes by "
        "category, largest first"
    )
    header = next(line for line in lines if "module" in line and "placement" in line)
    assert header.split("┃")[7].strip() == "step"  # after placement
    rows = {
        cells[1].strip(): cells[7].strip()
        for cells in (ln.split("│") for ln in lines)
        if len(cells) > 8
    }
    assert rows == {"emb": "2", "head": "8"}


def test_a_recorded_run_says_its_module_figures_are_from_early_steps(tmp_path: Path) -> None:
    """A real watch() run whose batch grows: the modules' rows are recorded early (the first
    accounting with gradients, the activation profile); the title names the steps of the rows
    shown and the run's steps. The run goes on a few steps past the first accounting with
    gradients (at least 30 steps), whenever the sampler thread makes it: the rows shown are then
    from before the end however slow the machine."""
    import sqlite3

    torch = pytest.importorskip("torch")
    from torch import nn

    import edo_monitor

    path = tmp_path / "agent.db"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(2_000, 16), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    accounted_at = None
    with edo_monitor.watch(model, db=path, budget=64_000_000, interval_s=0.01) as mon:
        for i in range(3_000):
            model(torch.randint(0, 2_000, (16 * (i % 100 + 1),))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            rows = {r["module"]: r for r in mon.breakdown()}
            if accounted_at is None and all(rows.get(m, {}).get("grads_bytes") for m in "01"):
                accounted_at = i + 1
            if accounted_at is not None and i + 1 >= max(30, accounted_at + 5):
                break
    n_steps = i + 1
    assert accounted_at is not None, "no accounting with gradients in 3,000 steps"
    with sqlite3.connect(path) as conn:
        latest = conn.execute(
            "SELECT m.step FROM module_stats m JOIN (SELECT module, max(id) AS id FROM "
            "module_stats GROUP BY module) last ON m.id = last.id"
        ).fetchall()
    steps = sorted({step for (step,) in latest})
    assert steps[-1] < n_steps, (steps, n_steps)  # the case the title is for
    title = _title(_cli(path, "show", "1", "--modules", columns="250"), "modules")
    if len(steps) == 1:
        assert title.startswith(f"modules at step {steps[0]} of {n_steps} (t+"), title
    else:
        assert title.startswith(
            f"modules, each at its latest accounting (steps {steps[0]}-{steps[-1]} of {n_steps}, t+"
        ), title
