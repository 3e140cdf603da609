"""What ``edo-monitor`` and ``edo-tui`` are pointed at and what they print (issue 21, item 3),
run as a user runs them: real subprocesses of the console scripts.

- A ``--db`` that is not a regular file (FIFO, device) is one line, exit 2, at once (a FIFO hung
  every reader forever); a path too long is named in words with the limit; a zero-byte file is
  not a history (exit 1; it read as "no runs recorded", exit 0).
- Every Click-level error is one ``edo-monitor: error:`` line and exit 2 (out-of-range values
  printed Click's four-line usage block); ``nan``, infinities and out-of-range numbers are
  refused naming the value and the allowed range.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edo_monitor.store.engine import open_engine

EXIT_ERROR, EXIT_USAGE = 1, 2


def script(name: str) -> list[str]:
    exe = Path(sys.executable).with_name(name)
    if exe.exists():
        return [str(exe)]
    module = "edo_monitor.surfaces.cli" if name == "edo-monitor" else "edo_monitor.tui.app"
    return [sys.executable, "-m", module]


def run(name: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*script(name), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def one_line(done: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """Exit ``code`` and one stderr line (no usage block, no traceback) holding ``words``."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_at_once_by_every_reader(tmp_path: Path) -> None:
    fifo = tmp_path / "h.db"
    os.mkfifo(fifo)
    line = one_line(run("edo-monitor", "runs", "--db", str(fifo), timeout_s=20), EXIT_USAGE)
    assert line.startswith("edo-monitor: error:") and "FIFO" in line and "h.db" in line
    one_line(run("edo-tui", str(fifo), timeout_s=20), EXIT_USAGE, "edo-tui: error:", "FIFO")


def test_a_device_is_not_a_history() -> None:
    done = run("edo-monitor", "runs", "--db", os.devnull)
    one_line(done, EXIT_USAGE, "device", "not a regular file")


def test_a_zero_byte_file_is_not_a_history_but_a_writer_may_start_one(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    one_line(
        run("edo-monitor", "runs", "--db", str(path)), EXIT_ERROR, "not an edo-monitor history"
    )
    assert path.stat().st_size == 0  # a reader never writes
    open_engine(path).dispose()  # a writer (watch()) makes the schema in it
    assert run("edo-monitor", "runs", "--db", str(path)).returncode == 0


def test_a_path_too_long_is_said_in_words(tmp_path: Path) -> None:
    done = run("edo-monitor", "runs", "--db", str(tmp_path / ("a" * 10_000)))
    line = one_line(done, EXIT_USAGE, "too long", "255")
    assert "Errno" not in line and len(line) < 300


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("runs", "--limit", "-1"), ("--limit", "-1", "allowed: 1 to")),
        (("show", "latest", "--max-events", "-1"), ("--max-events", "allowed: 0 to")),
        (("explain", "latest", "--top", "-3"), ("--top", "-3", "allowed: 1 to")),
        (("metrics", "--port", "70000"), ("--port", "70000", "allowed: 0 to 65535")),
        (("runs", "--bogus"), ("--bogus",)),
        # the allowed values as a list, not a Python tuple ("('running', 'finished', ...)")
        (("runs", "--status", "bogus"), ("'bogus'", "expected one of running, finished, ")),
        (("runs", "--since", "yesterday"), ("'yesterday'", "expected seconds or a number with")),
        (
            ("estimate", "--num-embeddings", "100000000000000000000000000", "--embedding-dim", "4"),
            ("--num-embeddings", "out of range", "allowed: 1 to 9223372036854775807"),
        ),
        (("daemon", "--interval", "nan"), ("--interval", "not a number")),
        (("daemon", "--interval", "inf"), ("--interval", "infinite")),
        (("daemon", "--interval", "1e999"), ("--interval", "infinite")),
    ],
)
def test_every_bad_option_value_is_one_error_line(
    tmp_path: Path, args: tuple[str, ...], words: tuple[str, ...]
) -> None:
    db = () if args[0] == "estimate" else ("--db", str(tmp_path / "h.db"))  # estimate reads none
    done = run("edo-monitor", *args[:1], *db, *args[1:])
    line = one_line(done, EXIT_USAGE, *words)
    assert line.startswith("edo-monitor: error:") and "Usage:" not in done.stderr


@pytest.mark.parametrize(("value", "word"), [("1e999", "infinite"), ("nan", "not a number")])
def test_edo_tui_refuses_a_refresh_that_is_not_finite(value: str, word: str) -> None:
    done = run("edo-tui", "--refresh-s", value)
    one_line(done, EXIT_USAGE, "edo-tui: error:", word)


def test_edo_tui_without_a_terminal_is_one_line_and_exits(tmp_path: Path) -> None:
    """stdin from /dev/null, output to pipes: it drew into them at full CPU and never exited."""
    done = run("edo-tui", str(tmp_path / "h.db"), "--run", "9", timeout_s=30)
    one_line(done, EXIT_USAGE, "edo-tui: error:", "standard input is not a terminal")
    assert not (tmp_path / "h.db").exists()


@pytest.mark.parametrize("args", [("--bogus",), ("--run",), ("a.db", "b.db")])
def test_edo_tui_usage_errors_are_one_line(args: tuple[str, ...]) -> None:
    """As edo-monitor's: no usage block (argparse printed it first: two lines)."""
    one_line(run("edo-tui", *args), EXIT_USAGE, "edo-tui: error:")


def test_metrics_without_prometheus_client_is_exit_1_with_the_install_line(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from edo_monitor.surfaces.cli import main\n"
        f"sys.argv = ['edo-monitor', 'metrics', '--db', {str(tmp_path / 'h.db')!r}]\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    one_line(done, EXIT_ERROR, "edo-monitor: error:", "pip install 'edo-monitor[prometheus]'")


#: (the modules made absent, what needs them, the extra named)
_OPTIONAL = {
    "prometheus": (
        ("prometheus_client",),
        "from edo_monitor.exporters.prometheus import require_prometheus as f; f()",
    ),
    "tensorboard": (
        ("tensorboard", "torch.utils.tensorboard"),
        "from edo_monitor.integrations.tensorboard import summary_writer as f; f()",
    ),
    "pandas": (("pandas",), "from edo_monitor.store.records import _pandas as f; f()"),
    "lightning": (
        ("lightning", "lightning.pytorch", "pytorch_lightning"),
        "import edo_monitor.integrations.lightning",
    ),
    "transformers": (("transformers",), "import edo_monitor.integrations.transformers"),
}


@pytest.mark.parametrize("extra", sorted(_OPTIONAL))
def test_every_missing_optional_package_is_one_error_with_its_install_line(extra: str) -> None:
    """Each optional feature, its package absent: one MissingExtraError (a ConfigError and an
    ImportError) naming ``pip install 'edo-monitor[EXTRA]'``."""
    modules, use = _OPTIONAL[extra]
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
        + "from edo_monitor.errors import ConfigError, MissingExtraError\n"
        + "try:\n"
        + f"    {use}\n"
        + "except MissingExtraError as exc:\n"
        + "    assert isinstance(exc, (ConfigError)) and isinstance(exc, ImportError)\n"
        + "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"pip install 'edo-monitor[{extra}]'" in done.stdout, done.stdout


@pytest.mark.parametrize("command", ["runs", "doctor"])
def test_an_older_schema_is_said_once(tmp_path: Path, command: str) -> None:
    """Reading an older-schema history printed its notice twice, in two wordings."""
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from edo_monitor.store.models import Meta
    from edo_monitor.store.schema import SCHEMA_VERSION

    path = tmp_path / "old.db"
    engine = open_engine(path)
    with Session(engine) as session, session.begin():  # both version records, as a migration
        session.merge(Meta(key="schema_version", value=str(SCHEMA_VERSION - 1)))
        session.execute(
            text(f"UPDATE alembic_version SET version_num = '{SCHEMA_VERSION - 1:04d}'")
        )
    engine.dispose()
    done = run("edo-monitor", command, "--db", str(path))
    assert done.returncode == 0, done.stderr
    line = one_line(done, 0, "older than", str(SCHEMA_VERSION - 1))
    assert "old.db" in line


def test_a_truncated_history_is_a_damaged_database_not_another_kind_of_file(
    tmp_path: Path,
) -> None:
    """A real history cut in half said "'trunc.db' is not an SQLite database (database disk
    image is malformed)"; it is one, damaged. Still exit 1, as any database that cannot be used."""
    import torch

    import edo_monitor

    good = tmp_path / "good.db"
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with edo_monitor.watch(model, opt, db=good, interval_s=0.01) as mon:
        for _ in range(200):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    data = good.read_bytes()
    trunc = tmp_path / "trunc.db"
    trunc.write_bytes(data[: len(data) // 2])
    for command in ("doctor", "runs"):
        line = one_line(
            run("edo-monitor", command, "--db", str(trunc)),
            EXIT_ERROR,
            "trunc.db",
            "is a damaged SQLite database (database disk image is malformed)",
        )
        assert "not an SQLite database" not in line


def test_version_is_printed() -> None:
    """``edo-monitor --version`` was "No such option"."""
    import edo_monitor

    done = run("edo-monitor", "--version")
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"edo-monitor {edo_monitor.__version__}\n",
        "",
    )


@pytest.mark.parametrize("command", ["doctor", "runs"])
@pytest.mark.parametrize("url", ["sqlite:///:memory:", "sqlite://"])
def test_an_in_memory_url_is_no_history(command: str, url: str) -> None:
    """Regression: a reader opened a new, empty in-memory database: ``doctor`` said the
    database was fine and ``runs`` "no runs recorded", both exit 0."""
    one_line(run("edo-monitor", command, "--db", url), 1, "no history database", "in-memory")


def _positional_cases() -> list[tuple[str, list[str], str]]:
    """(command, argv, argument) for every positional argument of every ``edo-monitor``
    command: the others given a valid value, that one ``-1``."""
    import typer

    from edo_monitor.surfaces.cli import app

    cases = []
    for name, command in sorted(typer.main.get_command(app).commands.items()):
        arguments = [p for p in command.params if p.param_type_name == "argument"]
        for k, target in enumerate(arguments):
            argv = [name, *("-1" if i == k else "1" for i in range(len(arguments)))]
            cases.append((name, argv, (target.name or "").upper()))
    return cases


POSITIONAL_CASES = _positional_cases()


@pytest.mark.parametrize(
    ("command", "argv", "argument"),
    POSITIONAL_CASES,
    ids=[" ".join(c[1]) for c in POSITIONAL_CASES],
)
def test_a_negative_number_given_positionally_is_a_bad_value_of_its_argument(
    tmp_path: Path, command: str, argv: list[str], argument: str
) -> None:
    """Regression: ``explain -1`` (and ``show -1``) said ``No such option: -1``, where
    ``explain 1 --event -1`` said ``-1 is out of range``: Click reads any ``-…`` word as an
    option. Now every positional argument is refused naming the value and what it allows,
    before anything is opened (no database needed)."""
    db = tmp_path / "none.db"
    line = one_line(
        run("edo-monitor", *argv, "--db", str(db)),
        EXIT_USAGE,
        f"Invalid value for '{argument}': -1 is out of range; allowed: ",
    )
    if argument.startswith("RUN"):
        assert "id (1 or more), uuid prefix" in line and "'latest'" in line
    assert not db.exists()


def test_run_commands_and_their_negative_numbers(tmp_path: Path) -> None:
    assert {argv[0] for _, argv, arg in POSITIONAL_CASES if arg.startswith("RUN")} >= {
        "compare",
        "events",
        "explain",
        "export",
        "replay",
        "show",
        "snapshot",
    }
    db = str(tmp_path / "none.db")
    one_line(run("edo-monitor", "show", "-2.5", "--json", "--db", db), EXIT_USAGE, "'RUN': -2.5 ")
    # an unknown option that is not a number is Click's error, as before
    one_line(run("edo-monitor", "show", "1", "-x", "--db", db), EXIT_USAGE, "No such option: -x")
    one_line(run("edo-monitor", "runs", "-1", "--db", db), EXIT_USAGE, "No such option: -1")
