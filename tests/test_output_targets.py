"""Files the CLI writes where the user says (``export --out``, ``snapshot --out``/``--html``,
one ``output_target``/``open_output`` for all) that are not regular files.

Regression: the target was always replaced by a temporary file renamed over it, so a FIFO
became a regular file its reader never saw and, as root, ``--out /dev/null`` replaced
``/dev/null`` with a regular file; ``--out /dev/stdout`` failed with "No such file or
directory" when standard output was a pipe. Now a FIFO, a character device and a file
descriptor's path are written in place, as a shell's ``>`` writes them. ``--out ""`` was
reported as "--out '.' is a directory", and a name too long for the file system as a raw
``OSError: [Errno 36]`` line.

The FIFO test comes first: it shows the fault without touching ``/dev``; the ``/dev/null``
test puts the device back if a broken build replaced it (the tests run as root here).
"""

from __future__ import annotations

import csv
import io
import os
import pickle
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_runner import runner
from history_seed import N_SAMPLES, seed
from sqlalchemy import insert, select

from edo_monitor.measure.snapshots import build_cpu_snapshot, encode
from edo_monitor.store.engine import close_engine, open_engine
from edo_monitor.store.schema import events_table, snapshots_table
from edo_monitor.surfaces.cli import app


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded history, with a memory snapshot at run 1's first event."""
    path = tmp_path_factory.mktemp("targets") / "h.db"
    seed(path)
    snapshot = build_cpu_snapshot([("emb", "params", 4096)], budget_bytes=65536)
    blob, raw_bytes = encode(snapshot)
    engine = open_engine(path)
    try:
        with engine.begin() as conn:
            event_id = conn.execute(
                select(events_table.c.id).where(events_table.c.run_id == 1).limit(1)
            ).scalar_one()
            conn.execute(
                insert(snapshots_table).values(
                    run_id=1, time_s=1.0, step=0, event_id=event_id, phase="at",
                    source="cpu-budget", encoding="pickle+zlib", raw_bytes=raw_bytes,
                    stored_bytes=len(blob), allocated_bytes=4096, reserved_bytes=4096,
                    blob=blob,
                )
            )  # fmt: skip
    finally:
        close_engine(engine)
    return path


def run(*args: str, db: Path) -> Any:
    return runner.invoke(app, [*args, "--db", str(db)])


def _cli(db: Path, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """The command in a process of its own (its standard output is what ``kwargs`` say)."""
    return subprocess.run(
        [sys.executable, "-m", "edo_monitor.surfaces.cli", "--db", str(db), *args],
        timeout=120,
        check=False,
        **kwargs,
    )


@pytest.mark.parametrize("command", [["export", "1"], ["snapshot", "1"]])
def test_a_fifo_is_written_in_place_for_its_reader(
    db: Path, tmp_path: Path, command: list[str]
) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    fifo = folder / "stream"
    os.mkfifo(fifo)
    got = tmp_path / "got"
    with got.open("wb") as sink:  # a file: the reader never waits on us reading its output
        reader = subprocess.Popen(["cat", str(fifo)], stdout=sink)
    try:
        res = run(*command, "--out", str(fifo), db=db)
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced by a regular file"
        assert res.exit_code == 0, res.stderr
        assert reader.wait(timeout=60) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    data = got.read_bytes()
    if command[0] == "export":
        assert len(list(csv.DictReader(io.StringIO(data.decode())))) == N_SAMPLES
    else:
        assert pickle.loads(data)["segments"]
    assert [p.name for p in folder.iterdir()] == ["stream"]  # no temporary file beside it


def test_dev_stdout_is_standard_output_a_pipe_or_the_file_it_is(db: Path, tmp_path: Path) -> None:
    """``--out /dev/stdout`` writes standard output whatever it is: a pipe (the path resolves
    to no file: "No such file or directory") or a regular file, written in place (the shell's
    file, not a new one renamed over its name)."""
    piped = _cli(db, "export", "1", "--out", "/dev/stdout", capture_output=True)
    assert piped.returncode == 0, piped.stderr
    assert len(list(csv.DictReader(io.StringIO(piped.stdout.decode())))) == N_SAMPLES
    assert piped.stderr.decode() == "wrote run 1 as csv to /dev/stdout\n"

    out = tmp_path / "run.csv"
    with out.open("wb") as f:
        inode = os.fstat(f.fileno()).st_ino
        to_file = _cli(db, "export", "1", "--out", "/dev/stdout", stdout=f, stderr=subprocess.PIPE)
    assert to_file.returncode == 0, to_file.stderr
    assert out.stat().st_ino == inode, "the shell's file was replaced"
    assert out.read_bytes() == piped.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.csv"]


@pytest.fixture
def dev_null_kept() -> Iterator[None]:
    """Put ``/dev/null`` and ``/dev/full`` back as the character devices they are if the test
    (a broken build, as root) replaced them, so one failure does not break the machine."""
    try:
        yield
    finally:
        for path, minor in (("/dev/null", 3), ("/dev/full", 7)):
            if not stat.S_ISCHR(os.lstat(path).st_mode) and os.geteuid() == 0:
                os.unlink(path)
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
                os.chmod(path, 0o666)


@pytest.mark.usefixtures("dev_null_kept")
def test_a_character_device_is_written_in_place_never_replaced(db: Path) -> None:
    for command in (["export", "1"], ["snapshot", "1"]):
        res = run(*command, "--out", "/dev/null", db=db)
        assert res.exit_code == 0, res.stderr
        assert stat.S_ISCHR(os.lstat("/dev/null").st_mode), command
        res = run(*command, "--out", "/dev/full", db=db)  # its writes fail: one line, exit 1
        assert stat.S_ISCHR(os.lstat("/dev/full").st_mode), command
        assert res.exit_code == 1, res.stderr
        assert (
            res.stderr == "edo-monitor: error: cannot write '/dev/full': No space left on device\n"
        )


@pytest.mark.parametrize("option", ["--out", "--html"])
def test_an_empty_output_path_is_named_as_empty(db: Path, option: str) -> None:
    command = ["export", "1"] if option == "--out" else ["snapshot", "1"]
    res = run(*command, option, "", db=db)
    assert res.exit_code == 2
    assert res.stderr == f"edo-monitor: error: {option} '' is empty; expected a file path\n"


def test_a_name_too_long_is_one_line_naming_the_option(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 characters: refused (exit 2) naming ``--out`` and the limit; 250 characters fit
    the file system and are written (its temporary file's name, ``.NAME.XXXXXXXX.tmp``, did
    not fit: exit 1)."""
    monkeypatch.chdir(tmp_path)
    res = run("export", "1", "--out", "a" * 300, db=db)
    assert res.exit_code == 2, res.stderr
    assert res.stderr.startswith("edo-monitor: error: --out 'aaa"), res.stderr
    assert "the path is too long (a name in it has 300 characters, more than the 255" in (
        res.stderr
    )
    assert len(res.stderr.splitlines()) == 1 and "Errno" not in res.stderr
    res = run("export", "1", "--out", "b" * 250, db=db)
    assert res.exit_code == 0, res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["b" * 250]
