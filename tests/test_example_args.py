"""The examples' command lines, run as a user runs them (subprocesses): a bad argument is one
line on stderr naming the value, exit code 2, before anything is read or opened; a history
database that cannot be used is one line, exit code 1, before training; Ctrl-C during training
is one line, exit code 130, and the run is recorded as interrupted. Nothing prints a traceback."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edo_monitor.store.engine import open_engine
from edo_monitor.store.schema import SCHEMA_VERSION

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = ("train_embedding.py", "train_recommender.py")
pytestmark = pytest.mark.slow  # each case starts Python and imports torch: seconds

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def example(name: str) -> Path:
    script = EXAMPLES / name
    if not script.is_file():
        pytest.skip(f"{script} not found (tests run from a checkout)")
    return script


def run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(example(name)), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def assert_one_line(done: subprocess.CompletedProcess[str], code: int, *names: str) -> str:
    """Exit code ``code``, and stderr one line, no traceback, naming each of ``names``; for a
    bad argument nothing on stdout (the loading line came first: two lines where the README
    promises one)."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    for name in names:
        assert name in lines[0], (name, lines[0])
    if code == EXIT_USAGE:
        assert done.stdout == "", done.stdout
    return lines[0]


@pytest.fixture
def movielens(tmp_path: Path) -> Path:
    """A tiny ratings.csv: the recommender's bad arguments fail before it reads it anyway."""
    folder = tmp_path / "ml"
    folder.mkdir()
    rows = [f"{u},{m},{(u + m) % 5 + 1}.0,0" for u in range(4) for m in range(3)]
    (folder / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "\n".join(rows))
    return folder


def base_args(name: str, movielens: Path) -> list[str]:
    return ["--data", str(movielens)] if name == "train_recommender.py" else []


# (arguments, the text the line must hold besides the value, allowed values named)
BAD_ARGUMENTS = [
    (["--budget", "abc"], ["--budget", "'abc'", "positive size"]),
    (["--budget", "0"], ["--budget", "'0'", "positive size"]),
    # a negative size: argparse (before Python 3.14) took "-5MiB" for an unknown option and said
    # "argument --budget: expected one argument", naming neither the value nor what is allowed
    (["--budget", "-5MiB"], ["--budget", "'-5MiB' is negative", "positive size"]),
    # an option after --budget is still an option, not its value
    (["--budget", "--db", "{tmp}/x.db"], ["--budget", "expected one argument"]),
    # watch() refuses it: it was refused after the text was read, leaving an empty database
    (["--budget", "9999999999999999999999"], ["--budget", "less than 2**63 bytes"]),
    (["--forecast", "0"], ["--forecast", "'0'", "1 or more"]),
    (["--db", "{tmp}/nodir/x.db"], ["--db", "nodir", "does not exist"]),
    (["--db", "{tmp}"], ["--db", "is a directory"]),
]


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize(("args", "names"), BAD_ARGUMENTS, ids=lambda v: " ".join(v))
def test_bad_arguments_of_both_examples(
    name: str, args: list[str], names: list[str], tmp_path: Path, movielens: Path
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = run(name, *base_args(name, movielens), *args, cwd=tmp_path)
    assert_one_line(done, EXIT_USAGE, *names)
    assert list(tmp_path.glob("*.db")) == []  # checked before anything was opened


EMBEDDING_BAD_ARGUMENTS = [
    (["--interval", "0"], ["--interval", "'0'", "> 0"]),
    (["--interval", "-1"], ["--interval", "'-1'", "> 0"]),
    (["--interval", "nan"], ["--interval", "'nan'", "> 0"]),
    (["--steps", "0"], ["--steps", "'0'", "1 or more"]),
    (["--steps", "-1"], ["--steps", "'-1'", "1 or more"]),
    (["--steps", "ten"], ["--steps", "'ten'", "1 or more"]),
    (["--text", "/nonexistent.txt"], ["--text", "'/nonexistent.txt'", "does not exist"]),
    (["--text", "{tmp}"], ["--text", "is a folder"]),
    (["--device", "tpu"], ["--device", "'tpu'", "cpu, cuda or cuda:N"]),
    (["--ramp", "steep"], ["--ramp", "'steep'", "doubling", "linear"]),
    (["--ddp"], ["--ddp", "torchrun"]),  # not started by torchrun (no RANK)
    # the forecast needs the tuner: it ran, recording forecast_steps=5 that nothing acted on
    (["--forecast", "5", "--no-tune"], ["--forecast", "--no-tune", "give one of them"]),
]


@pytest.mark.parametrize(("args", "names"), EMBEDDING_BAD_ARGUMENTS, ids=lambda v: " ".join(v))
def test_bad_arguments_of_the_main_example(
    args: list[str], names: list[str], tmp_path: Path
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = run("train_embedding.py", *args, cwd=tmp_path)
    assert_one_line(done, EXIT_USAGE, *names)
    assert not (tmp_path / "edo-history.db").exists()


def test_a_budget_below_the_model_is_one_line_before_the_text_is_read(tmp_path: Path) -> None:
    """It was refused by watch() after the text was read and the dataset built, naming
    ``enforce=False``, which the example has no flag for."""
    done = run("train_embedding.py", "--budget", "1MiB", "--steps", "3", cwd=tmp_path)
    assert "Traceback" not in done.stderr and done.returncode == EXIT_USAGE, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line == (
        "train_embedding.py: error: --budget 1 MiB is smaller than the model's parameters "
        "(24.92 MiB); give a larger budget (the default, 158 MiB, is the pressure demo)"
    )
    assert "reading the text" not in done.stdout and "enforce" not in done.stderr
    assert not (tmp_path / "edo-history.db").exists()


def test_a_text_too_short_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    """Regression: ``--text empty.txt`` said "the text has 0 tokens; need more than 4", naming
    neither the flag nor the file. A data error (the file had to be read): exit 1."""
    empty = tmp_path / "empty.txt"
    empty.write_text("three short words")
    done = run("train_embedding.py", "--text", str(empty), cwd=tmp_path)
    line = assert_one_line(done, EXIT_ERROR)
    assert line == f"--text {str(empty)!r} has 3 words; need more than 4", line


def test_cuda_without_cuda_is_a_bad_argument(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    done = run("train_embedding.py", "--device", "cuda", cwd=tmp_path)
    line = assert_one_line(done, EXIT_USAGE, "--device", "'cuda'", "--device cpu")
    assert "without CUDA" in line or "no CUDA device" in line


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--epochs", "0"], ["--epochs", "'0'", "1 or more"]),
        (["--batch-size", "-5"], ["--batch-size", "'-5'", "1 or more"]),
        (["--data", "/nonexistent"], ["--data", "'/nonexistent'", "ratings.csv"]),
    ],
    ids=lambda v: " ".join(v),
)
def test_bad_arguments_of_the_recommender(
    args: list[str], names: list[str], tmp_path: Path, movielens: Path
) -> None:
    done = run("train_recommender.py", "--data", str(movielens), *args, cwd=tmp_path)
    assert_one_line(done, EXIT_USAGE, *names)


def test_forecast_without_budget_is_a_bad_argument_of_the_recommender(
    tmp_path: Path, movielens: Path
) -> None:
    """``--forecast 5`` without ``--budget`` was silently ignored (no tuner runs without one)."""
    done = run("train_recommender.py", "--data", str(movielens), "--forecast", "5", cwd=tmp_path)
    line = assert_one_line(done, EXIT_USAGE, "--forecast needs --budget")
    assert line.startswith("train_recommender.py: error: ")
    assert list(tmp_path.glob("*.db")) == []


def test_a_budget_below_the_recommenders_model_is_one_line_exit_2(
    tmp_path: Path, movielens: Path
) -> None:
    """``--budget 1KiB`` logged a WARNING and trained anyway (exit 0). 4 users x 3 items, dim 64:
    (4 + 3) x (64 + 1) floats = 1,820 bytes of parameters."""
    done = run("train_recommender.py", "--data", str(movielens), "--budget", "1KiB", cwd=tmp_path)
    line = assert_one_line(done, EXIT_USAGE)
    assert line == (
        "train_recommender.py: error: --budget 1 KiB is smaller than the model's parameters "
        "(1.78 KiB); give a larger budget (8MiB runs the auto-tuner on MovieLens small)"
    )
    assert "training" not in done.stdout and "WARNING" not in done.stderr


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("", "ratings.csv is empty; expected MovieLens ratings: userId,movieId,rating,timestamp"),
        (
            "a,b\n1,2\n",
            "ratings.csv: no column userId, movieId, rating in its header line (a,b); expected "
            "MovieLens ratings: userId,movieId,rating,timestamp",
        ),
        ("userId,movieId,rating\n1,2,4\n1,3,four\n", "ratings.csv line 3: rating 'four' is not"),
        ("userId,movieId,rating\n1,2,4\n", "ratings.csv has 1 rating(s); need at least 2"),
    ],
    ids=["empty", "another header", "not a number", "one rating"],
)
def test_ratings_that_cannot_be_trained_on_are_one_line_exit_1(
    tmp_path: Path, content: str, says: str
) -> None:
    """An empty file ended in ``ZeroDivisionError`` at ``rmse``, another header in
    ``KeyError: 'userId'``: data errors, found by reading the file (exit 1)."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "ratings.csv").write_text(content)
    done = run("train_recommender.py", "--data", str(folder), cwd=tmp_path)
    line = assert_one_line(done, EXIT_ERROR)
    assert line.startswith(f"{folder / 'ratings.csv'}") and says in line, line


def newer_database(path: Path) -> Path:
    open_engine(path).dispose()
    with sqlite3.connect(path) as con:
        con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.close()
    return path


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("kind", ["not a database", "newer schema"])
def test_a_database_that_cannot_be_used_is_one_line_exit_1(
    name: str, kind: str, tmp_path: Path, movielens: Path
) -> None:
    if kind == "not a database":
        db = tmp_path / "notes.db"
        db.write_text("not a database, " * 100)
        reason = "not an SQLite database"
    else:
        db = newer_database(tmp_path / "future.db")
        reason = f"schema version 99 (meta table) and Alembic revision '{SCHEMA_VERSION:04d}'"
    before = db.read_bytes()
    done = run(name, *base_args(name, movielens), "--db", str(db), cwd=tmp_path)
    line = assert_one_line(done, EXIT_ERROR, str(db), reason)
    assert line.startswith(f"{name}: error: ")
    assert "training on" not in done.stdout  # stopped before the slow work
    assert db.read_bytes() == before  # refused, not changed


def test_ctrl_c_during_training_is_one_line_exit_130_and_the_run_interrupted(
    tmp_path: Path,
) -> None:
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"word{i % 97} next{i % 13}" for i in range(5_000)))
    db = tmp_path / "h.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(example("train_embedding.py")),
            "--text",
            str(text),
            "--db",
            str(db),
            "--steps",
            "1000000",
            "--budget",
            "1GiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        # as from a terminal: a test run started in the background (CI's, a `cmd &`) passes
        # SIGINT on ignored, and Python then never raises KeyboardInterrupt for it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # training has started when the first step is printed
            if line.startswith("step ") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in err, err
    assert err.strip().splitlines() == ["train_embedding.py: interrupted"], err
    assert proc.returncode == EXIT_INTERRUPTED
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("interrupted",)]
    con.close()
