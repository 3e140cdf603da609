"""The screenshot tool (``python -m edo_monitor.tui.screenshot``) exits as ``edo-tui`` would on
the view it saved: it writes the SVG of an error (for a bug report) but no longer exits 0 for
it, and says so in one line on stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tui_helpers import db  # noqa: F401 (the fixture)

PROG = [sys.executable, "-m", "edo_monitor.tui.screenshot"]


def _shoot(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "EDO_DB"}
    return subprocess.run(
        [*PROG, *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )


def _svg(path: Path) -> str:
    return path.read_text(encoding="utf-8").replace("&#160;", " ").replace("&#x27;", "'")


def test_a_run_that_is_not_there_is_saved_and_exits_1(
    db: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    """``--run 3`` of a database with two runs: the picture says so, exit 1 (edo-tui's)."""
    out = tmp_path / "run3.svg"
    done = _shoot(tmp_path, str(db), "--run", "3", "--out", str(out), "--size", "120x40")
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "no run with id 3" in _svg(out)
    assert done.stdout == f"{out}\n"
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "exit code 1" in lines[0] and "no run with id 3" in lines[0], lines[0]
    assert str(out) in lines[0]


def test_a_database_that_is_not_there_is_saved_and_exits_1(tmp_path: Path) -> None:
    """A path with no database, both views: the error in the picture, exit 1, no file made."""
    missing = tmp_path / "nothing.db"
    for view in ("live", "runs"):
        out = tmp_path / f"{view}.svg"
        done = _shoot(tmp_path, str(missing), "--view", view, "--out", str(out))
        assert done.returncode == 1, (view, done.returncode, done.stderr)
        assert "no history database at" in _svg(out)
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert "exit code 1" in done.stderr and "no history database at" in done.stderr
    assert not missing.exists()


def test_an_unusable_database_argument_exits_2(tmp_path: Path) -> None:
    """Not a path nor a usable URL: edo-tui's usage error, 2 (the picture still written)."""
    out = tmp_path / "bad.svg"
    done = _shoot(tmp_path, "nosuchdialect://x", "--out", str(out))
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "not a usable database URL" in _svg(out)
    assert len(done.stderr.splitlines()) == 1 and "exit code 2" in done.stderr


def test_a_run_that_is_there_exits_0_quietly(
    db: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    out = tmp_path / "run1.svg"
    done = _shoot(tmp_path, str(db), "--run", "1", "--out", str(out), "--size", "120x40")
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and "old-finished" in _svg(out)


def test_help_describes_the_tool_and_its_exit_codes() -> None:
    done = subprocess.run([*PROG, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert text.startswith("usage: python -m edo_monitor.tui.screenshot ")
    assert "SVG" in text and "edo-tui" in text
    assert "Exit codes" in text
    for code in ("0 a run", "1 the view shows", "2 usage", "3 internal error"):
        assert code in text, code
