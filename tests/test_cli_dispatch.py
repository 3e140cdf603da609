"""The console script builds only the command it runs (start-up), and that command behaves exactly
as in the full app: same output, errors and exit codes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from history_seed import seed
from test_cli import DB_COMMANDS, runner

from edo_monitor.surfaces.cli import app
from edo_monitor.surfaces.cli.dispatch import app_for


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dispatch") / "h.db"
    seed(path)
    return path


def test_only_the_named_command_is_built() -> None:
    for argv, name in (
        (["runs"], "runs"),
        (["--db", "x.db", "show", "1"], "show"),
        (["--db=x.db", "events", "--help"], "events"),
    ):
        slim = app_for(app, argv)
        assert [c.name for c in slim.registered_commands] == [name]
        group = typer.main.get_command(slim)
        assert isinstance(group, typer.core.TyperGroup) and list(group.commands) == [name]
    assert len(app.registered_commands) > 10  # the app itself is left whole
    # no command, help first, an unknown name or option: the full app (its help, its errors)
    for argv in ([], ["--help"], ["nosuch"], ["--bogus", "runs"], ["--db"]):
        assert app_for(app, argv) is app


def _argvs(db: Path) -> list[list[str]]:
    out = [["--db", str(db), "runs", "--help"], ["nosuch"], ["--help"]]
    for ok, bad, failing in DB_COMMANDS:
        for argv in (ok, bad, failing):
            if argv:
                out += [[*argv, "--db", str(db)], ["--db", str(db), *argv]]
    return out


def test_the_slim_app_answers_as_the_full_app(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # one present for both: a running run's duration is counted to now, and a second that
    # passed between the two invocations made them differ (CI: "1m01s" against "1m00s")
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    for argv in _argvs(db):
        full = runner.invoke(app, argv, prog_name="edo-monitor")
        slim = runner.invoke(app_for(app, argv), argv, prog_name="edo-monitor")
        assert (slim.exit_code, slim.stdout, slim.stderr) == (
            full.exit_code,
            full.stdout,
            full.stderr,
        ), argv


def test_console_script_runs_one_command(db: Path) -> None:
    """The real ``edo-monitor`` entry point (``main``) through the slim app."""
    code = (
        "import sys; from edo_monitor.surfaces.cli import main; sys.argv[0] = 'edo-monitor'; main()"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, "--db", str(db), "runs", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert '"embed-big"' in res.stdout
    res = subprocess.run(
        [sys.executable, "-c", code, "--db", str(db), "show", "99"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and res.stderr.startswith("edo-monitor: error:"), res.stderr
