"""Where the screenshot tool (``python -m edo_monitor.tui.screenshot``) and the dashboard's CSV
export write: through the CLI's one mechanism (``edo_monitor.surfaces.cli.output``), so never
over the history database or its companion files, a folder or into a missing folder, and
through a temporary file renamed into place; and the sizes the tool accepts.

Regressions: ``--out copy.db`` replaced the history database with the SVG (exit 0, the runs
lost); ``--out FOLDER`` and ``--out /proc/x.svg`` were tracebacks; ``--out /missing/x.svg``
created the folder; ``--size 0x0`` and ``10x5`` saved a meaningless picture.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from textual.pilot import Pilot
from tui_helpers import REFRESH_S, db, loaded, run_app, wait_for  # noqa: F401 (the fixture)

from edo_monitor.errors import ConfigError
from edo_monitor.tui.app import EdoTui
from edo_monitor.tui.data import DataSource

PROG = [sys.executable, "-m", "edo_monitor.tui.screenshot"]
NAME = "python -m edo_monitor.tui.screenshot"


def _shoot(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "EDO_DB"}
    return subprocess.run(
        [*PROG, *args], capture_output=True, text=True, timeout=180, cwd=cwd, env=env
    )


def _one_line(done: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The one stderr line of a refusal (no traceback), with exit code ``code``."""
    assert done.returncode == code, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{NAME}: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert done.stdout == ""
    return lines[0]


@pytest.mark.parametrize("name", ["history.db", "history.db-wal", "history.db-shm", "link.db"])
def test_out_is_never_the_history_database(
    db: Path,  # noqa: F811 (the fixture)
    name: str,
) -> None:
    """The database itself (by name, relative to the working folder, or through a link) and
    each companion file: refused before anything is opened, the database as it was."""
    folder = db.parent
    (folder / "link.db").symlink_to(db)
    before = db.read_bytes()
    companions = {p.name: p.read_bytes() for p in folder.glob("history.db-*")}
    done = _shoot(folder, "history.db", "--out", name)
    _one_line(done, 2, f"--out {name!r} is the history database", "choose another file")
    assert db.read_bytes() == before
    assert {p.name: p.read_bytes() for p in folder.glob("history.db-*")} == companions
    assert not list(folder.glob("*.svg")) and not list(folder.glob(".*.tmp"))


def test_out_is_never_a_hard_link_of_the_database_nor_its_journal(
    db: Path,  # noqa: F811 (the fixture)
) -> None:
    folder = db.parent
    os.link(db, folder / "same.svg")
    before = db.read_bytes()
    _one_line(_shoot(folder, str(db), "--out", "same.svg"), 2, "is the history database itself")
    assert db.read_bytes() == before
    journal = folder / "history.db-journal"  # a rollback journal (not there: by name)
    _one_line(_shoot(folder, str(db), "--out", str(journal)), 2, "history database's -journal file")
    assert not journal.exists()


def test_out_a_folder_or_in_a_missing_folder_is_one_line(tmp_path: Path) -> None:
    """Was a 20-line IsADirectoryError traceback; a missing folder was created."""
    (tmp_path / "pictures").mkdir()
    done = _shoot(tmp_path, "nothing.db", "--out", "pictures")
    _one_line(done, 2, "--out 'pictures' is a directory; expected a file path")
    missing = tmp_path / "missing"
    done = _shoot(tmp_path, "nothing.db", "--out", str(missing / "x.svg"))
    _one_line(done, 2, f"folder {str(missing)!r} does not exist")
    assert not missing.exists()
    assert not (tmp_path / "nothing.db").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_out_that_cannot_be_written_is_one_line_exit_1(tmp_path: Path) -> None:
    """Was a FileNotFoundError traceback: ``/proc`` takes no new file."""
    done = _shoot(tmp_path, "nothing.db", "--out", "/proc/edo-shot.svg", "--size", "80x24")
    _one_line(done, 1, "cannot write '/proc/edo-shot.svg'")


def test_out_replaces_a_file_there_whole(
    db: Path,  # noqa: F811 (the fixture)
) -> None:
    """An SVG already at ``--out`` is replaced by the new picture (a link to it: its file); no
    temporary file is left beside it."""
    folder = db.parent
    old = folder / "old.svg"
    old.write_text("old picture")
    (folder / "shot.svg").symlink_to(old)
    done = _shoot(folder, str(db), "--run", "1", "--out", "shot.svg", "--size", "100x30")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "shot.svg\n"
    assert (folder / "shot.svg").is_symlink()
    assert old.read_text(encoding="utf-8").startswith("<svg") and "old-finished" in old.read_text(
        encoding="utf-8"
    )
    assert not list(folder.glob(".*.tmp"))


@pytest.mark.parametrize("size", ["0x0", "10x5", "79x24", "80x23", "1001x45", "140x501"])
def test_a_size_outside_the_dashboards_range_is_refused(tmp_path: Path, size: str) -> None:
    done = _shoot(tmp_path, "nothing.db", "--size", size, "--out", "x.svg")
    _one_line(
        done,
        2,
        f"argument --size: {size} is out of range; allowed: 80 to 1000 columns by 24 to 500 rows",
    )
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.parametrize("size", ["140", "axb", "140x45x2", "-80x24", ""])
def test_a_size_that_is_not_one_is_refused(tmp_path: Path, size: str) -> None:
    done = _shoot(tmp_path, "nothing.db", f"--size={size}", "--out", "x.svg")
    _one_line(done, 2, f"argument --size: {size!r} is not a size; expected COLUMNSxROWS")


def test_the_api_checks_out_and_size_too(
    db: Path,  # noqa: F811 (the fixture)
) -> None:
    """``take``/``screenshot`` refuse as the command line does (``ConfigError``), before the
    database is opened."""
    import asyncio

    from edo_monitor.tui.screenshot import MIN_SIZE, take

    before = db.read_bytes()
    with pytest.raises(ConfigError, match="is the history database itself"):
        asyncio.run(take(str(db), db, run="1"))
    with pytest.raises(ConfigError, match=r"--size 10x5 is out of range; allowed: 80 to 1000"):
        asyncio.run(take(str(db), db.parent / "x.svg", size=(10, 5)))
    assert db.read_bytes() == before
    shot = asyncio.run(take(str(db), db.parent / "small.svg", run="1", size=MIN_SIZE))
    assert shot.exit_code == 0 and shot.path.read_text(encoding="utf-8").startswith("<svg")


# -- the dashboard's CSV export (e) ------------------------------------------------------------


def test_the_export_never_writes_over_the_database(
    db: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    """A database whose file is the name the export picks (``edo-run-1-old-finished.csv`` in
    the export folder): refused, the database as it was."""
    path = db.with_name("edo-run-1-old-finished.csv")
    for companion in db.parent.glob(f"{db.name}-*"):
        companion.unlink()
    db.rename(path)
    before = path.read_bytes()
    source = DataSource(str(path))
    try:
        run = source.resolve("1")
        with pytest.raises(ConfigError, match=r"the export file .* is the history database"):
            source.export_csv(run, tmp_path)
    finally:
        source.close()
    assert path.read_bytes() == before


def test_the_export_into_a_missing_folder_says_so(
    db: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    """``e`` with an export folder that is not there: a notification naming it, nothing made."""
    missing = tmp_path / "gone"
    app = EdoTui(db, run="1", refresh_s=REFRESH_S, export_dir=missing)

    async def body(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: loaded(app))
        await pilot.press("e")
        await wait_for(pilot, lambda: any("export failed" in n.message for n in app._notifications))
        failed = next(n.message for n in app._notifications if "export failed" in n.message)
        assert f"folder {str(missing)!r} does not exist" in failed, failed

    run_app(app, body)
    assert app.last_export is None and not missing.exists()
