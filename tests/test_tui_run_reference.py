"""``edo-tui --run`` and the screenshot tool's ``--run`` check a run reference as every
``edo-monitor`` command checks its ``RUN`` (one check: ``check_run_reference``).

Regression: ``edo-monitor show -1`` was exit 2 ``-1 is out of range; allowed: run id (1 or
more)…``, but ``edo-tui --run -1`` and ``screenshot --run -1`` exit 1 ``no run with id or uuid
prefix '-1'`` (and ``edo-monitor show -- -1`` too: the CLI refused only what Click took for an
option).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tui_helpers import db  # noqa: F401 (the fixture)

ALLOWED = "allowed: run id (1 or more), uuid prefix (as 'runs' prints it), or 'latest'"

PROGRAMS = {
    "edo-tui": [sys.executable, "-m", "edo_monitor.tui.app"],
    "python -m edo_monitor.tui.screenshot": [sys.executable, "-m", "edo_monitor.tui.screenshot"],
    "edo-monitor": [sys.executable, "-m", "edo_monitor.surfaces.cli"],
}


def _run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "EDO_DB"}
    return subprocess.run(
        [*PROGRAMS[name], *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _refusal(done: subprocess.CompletedProcess[str], prog: str) -> str:
    """The one stderr line of a usage error (exit 2), its text after ``prog: error: ``."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("value", ["-1", "-2.5", "-0"])
def test_a_negative_run_is_the_same_bad_value_everywhere(
    db: Path,  # noqa: F811 (the fixture)
    value: str,
) -> None:
    """The same words from the dashboard, the screenshot tool and the CLI (both ways of giving
    the CLI a negative number), exit 2, nothing opened or written."""
    folder = db.parent
    before = sorted(p.name for p in folder.iterdir())
    expected = f"{value} is out of range; {ALLOWED}"
    lines = [
        _refusal(_run("edo-tui", str(db), "--run", value, cwd=folder), "edo-tui"),
        _refusal(_run("edo-tui", str(db), f"--run={value}", cwd=folder), "edo-tui"),
        _refusal(
            _run(
                "python -m edo_monitor.tui.screenshot",
                str(db),
                "--run",
                value,
                "--out",
                "x.svg",
                cwd=folder,
            ),
            "python -m edo_monitor.tui.screenshot",
        ),
        _refusal(_run("edo-monitor", "show", value, "--db", str(db), cwd=folder), "edo-monitor"),
        _refusal(
            _run("edo-monitor", "show", "--db", str(db), "--", value, cwd=folder), "edo-monitor"
        ),
    ]
    for line in lines:
        assert expected in line, line
    for line in lines[:3]:
        assert f"argument --run: {expected}" in line, line
    for line in lines[3:]:
        assert f"Invalid value for 'RUN': {expected}" in line, line
    assert sorted(p.name for p in folder.iterdir()) == before  # no SVG, no -wal/-shm


def test_compare_checks_both_runs_the_same_way(tmp_path: Path) -> None:
    done = _run("edo-monitor", "compare", "1", "--db", "none.db", "--", "-3", cwd=tmp_path)
    line = _refusal(done, "edo-monitor")
    assert "Invalid value for 'RUN_B': -3 is out of range; allowed: second run: id (1 or more)" in (
        line
    )


def test_a_run_reference_is_still_taken_as_it_was(
    db: Path,  # noqa: F811 (the fixture)
) -> None:
    """An id, ``latest`` and a uuid prefix pass the check (the screenshot of run 1: exit 0);
    a number with no run is still "no run" (exit 1), as ``edo-monitor show 9`` says."""
    from edo_monitor.surfaces.cli.options import check_run_reference
    from edo_monitor.tui.app import parse_args

    for ref in ("1", "latest", "a0000001", "0"):
        assert check_run_reference(ref) == ref
        assert parse_args([str(db), "--run", ref]).run == ref
    out = db.parent / "one.svg"
    done = _run(
        "python -m edo_monitor.tui.screenshot",
        str(db),
        "--run",
        "9",
        "--out",
        str(out),
        cwd=db.parent,
    )
    assert done.returncode == 1 and "no run with id 9" in done.stderr, done.stderr
