"""History database files as readers open them: paths with URI characters, a reader that never
creates a file, a WAL database in a folder the reader cannot write; a ``db`` of the wrong type and
a database URL whose driver is missing."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from history_seed import T0, UUIDS
from sqlalchemy.orm import Session

from edo_monitor.errors import ConfigError, MissingExtraError, StoreError
from edo_monitor.store.engine import open_engine
from edo_monitor.store.history import History
from edo_monitor.store.models import Run


def _one_run(path: Path, name: str = "r") -> None:
    """A history database at ``path`` (written by the writer engine) with one finished run."""
    engine = open_engine(path)
    with Session(engine) as s, s.begin():
        s.add(
            Run(
                uuid=UUIDS[0],
                name=name,
                host="h",
                pid=1,
                status="finished",
                started_at_s=T0,
                ended_at_s=T0 + 1,
                device_kind="cpu-budget",
                interval_s=1.0,
                torch_version="2.x",
                config={},
                tags=[],
            )
        )
    engine.dispose()


@pytest.mark.parametrize(
    "name", ["runs#1.db", "a?b.db", "100%25.db", "my runs.db", "résumé-日本.db"]
)
def test_paths_with_uri_characters_round_trip(tmp_path: Path, name: str) -> None:
    """Regression: readers opened ``file:{path}?mode=ro`` unescaped, so ``runs#1.db`` read (and
    created) a file named ``runs`` and ``100%25.db`` failed."""
    path = tmp_path / name
    _one_run(path, name="the-run")
    with History(path) as h:
        assert [r.name for r in h.runs()] == ["the-run"]
    with History(str(path)) as h:
        assert h.run("latest").uuid == UUIDS[0]
    assert {p.name for p in tmp_path.iterdir()} <= {name, f"{name}-wal", f"{name}-shm"}


def test_a_relative_path_beginning_file_colon_is_a_plain_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the path ``file:x.db`` (a name with a colon, not a URL) was read as an SQLite
    URI filename though SQLite reads one only with ``?uri=true``: the writer created ``./x.db``
    and failed ("unable to open database file"), and readers looked for a folder ``file:/…``.
    ``sqlite:///file:NAME?uri=true`` is still a URI filename."""
    monkeypatch.chdir(tmp_path)
    _one_run(Path("file:x.db"), name="plain")
    with History("file:x.db") as h:
        assert [r.name for r in h.runs()] == ["plain"]
    assert (tmp_path / "file:x.db").is_file() and not (tmp_path / "x.db").exists()
    engine = open_engine("sqlite:///file:y.db?uri=true")
    engine.dispose()
    assert (tmp_path / "y.db").is_file() and not (tmp_path / "file:y.db").exists()


def test_reader_never_creates_a_file(tmp_path: Path) -> None:
    for name in ("missing.db", "x#y.db", "a?b.db", "sub/none.db"):
        with pytest.raises(StoreError, match="no history database"):
            History(tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def _as_nobody(fn: Any) -> Any:
    """Run ``fn()`` as an unprivileged user and return its result (or its error, as
    ``(type name, message)``): in a forked child that drops root to ``nobody``, or here when
    this process is not root (then permissions hold already)."""
    import json
    import os
    import pwd

    def call() -> Any:
        try:
            return ["ok", fn()]
        except Exception as exc:
            return ["error", type(exc).__name__, str(exc)]

    if os.geteuid() != 0:
        return call()
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root and there is no user 'nobody' to drop to")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 0
        try:
            os.close(r)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os.write(w, json.dumps(call()).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the unprivileged child failed"
    return json.loads(data)


def test_wal_database_in_a_folder_the_reader_cannot_write(tmp_path: Path) -> None:
    """A finished WAL database in a read-only folder is read (immutably: no ``-shm`` needed,
    nothing created, bytes unchanged); one whose ``-wal`` still holds data cannot be, and the
    error says why (the folder, the missing ``-shm``), never that a SELECT writes."""
    import shutil
    import tempfile

    from edo_monitor.store.paths import readonly_uri

    # a folder an unprivileged user can reach (pytest's tmp_path is private to root)
    shared = Path(tempfile.mkdtemp(prefix="edo-ro-"))
    try:
        shared.chmod(0o755)
        folder = shared / "results"
        folder.mkdir()
        finished = folder / "finished.db"
        _one_run(tmp_path / "src.db", name="done")
        shutil.copy(tmp_path / "src.db", finished)  # writer closed: everything in the main file
        assert finished.read_bytes()[18:20] == b"\x02\x02"  # WAL mode
        # a killed run: its last transaction is still in the -wal file
        live = sqlite3.connect(tmp_path / "live.db")
        live.execute("PRAGMA journal_mode = WAL")
        live.execute("PRAGMA wal_autocheckpoint = 0")
        live.execute("CREATE TABLE t (x)")
        live.execute("INSERT INTO t VALUES (1)")
        live.commit()
        shutil.copy(tmp_path / "live.db", folder / "killed.db")
        shutil.copy(tmp_path / "live.db-wal", folder / "killed.db-wal")
        live.close()
        for f in folder.iterdir():
            f.chmod(0o644)
        folder.chmod(0o555)  # nobody may write here (root still can: hence _as_nobody)
        before = {f.name: f.read_bytes() for f in folder.iterdir()}

        def read_finished() -> list[str]:
            with History(finished) as h:
                return [r.name for r in h.runs()]

        assert _as_nobody(read_finished) == ["ok", ["done"]]
        assert _as_nobody(lambda: "immutable=1" in readonly_uri(finished)) == ["ok", True]

        import json

        from typer.testing import CliRunner

        from edo_monitor.surfaces.cli import app

        def doctor_journal_mode(path: Path) -> str:
            res = CliRunner().invoke(app, ["--db", str(path), "doctor", "--json"])
            return json.loads(res.stdout)["journal_mode"]

        # SQLite says "delete" of a file opened immutable; doctor showed that as its mode
        assert doctor_journal_mode(tmp_path / "src.db") == "wal"  # (its imports made here too)
        assert _as_nobody(lambda: doctor_journal_mode(finished)) == ["ok", "wal"]
        res = _as_nobody(lambda: History(folder / "killed.db").schema_version)
        assert res[:2] == ["error", "StoreError"]
        assert "killed.db-shm" in res[2] and str(folder) in res[2] and "not writable" in res[2]
        assert "write a readonly" not in res[2]
        assert {f.name: f.read_bytes() for f in folder.iterdir()} == before  # nothing created
    finally:
        for d in (shared / "results", shared):
            if d.exists():
                d.chmod(0o755)
        shutil.rmtree(shared)


@pytest.mark.parametrize("bad", [123, 1.5, b"h.db", ["h.db"]])
def test_a_db_of_the_wrong_type_is_one_clear_error(bad: Any, tmp_path: Path) -> None:
    """Regression: ``History(123)`` and ``watch(model, db=123)`` raised ``TypeError: expected str,
    bytes or os.PathLike object, not int`` from deep inside; now the value and what is allowed."""
    import torch

    import edo_monitor

    want = rf"^db={bad!r} is not a path or URL \(got {type(bad).__name__}\); expected a file path"
    with pytest.raises(ConfigError, match=want.replace("[", r"\[")):
        History(bad)
    with pytest.raises(ConfigError, match=want.replace("[", r"\[")):
        edo_monitor.watch(torch.nn.Linear(2, 2), db=bad)


def test_a_postgresql_url_without_its_driver_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: ``runs --db postgresql://...`` without psycopg said only "its driver is not
    installed"; now it gives the ``pip install 'edo-monitor[postgres]'`` line, as every other
    optional feature does (the CLI's exit code 1). As if psycopg were not installed: its import
    fails."""
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'edo-monitor\[postgres\]'"):
        History("postgresql://127.0.0.1:1/x")


@pytest.mark.parametrize(
    "url",
    [
        "postgres://u:secretpw@127.0.0.1/db",  # Heroku's scheme: no such SQLAlchemy dialect
        "postgresql+psycopg://postgres:secretpw@127.0.0.1:notaport/db",
        "postgresq+psycopg://u:secretpw@h/d",
        "postgresql+psycopg://127.0.0.1:1/d?password=secretpw&connect_timeout=1",
    ],
)
def test_a_database_password_never_shows_in_an_error(url: str, tmp_path: Path) -> None:
    """Regression: a URL SQLAlchemy could not parse or load was echoed whole, password and all
    (every other message masked it), and a ``?password=`` parameter was never masked."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "edo_monitor.surfaces.cli", "--db", url, "runs"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode != 0 and "error:" in done.stderr
    assert "secretpw" not in done.stderr + done.stdout and "***" in done.stderr
    # one line (psycopg's connection refused has its hint on a second: it was printed there)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    with pytest.raises((ConfigError, StoreError)) as err:
        History(url)
    assert "secretpw" not in str(err.value) and "***" in str(err.value)
