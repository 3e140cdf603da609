"""How a run that ``sys.exit`` leaves ends: a clean exit is ``finished``, another exit status
``failed`` naming it, SIGTERM still ``interrupted``; any exception of the user's, one that cannot
be printed too, propagates as it is and ends the run ``failed`` (real training loops, real SQLite
files, a real child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from watch_helpers import agent_threads, make_model, run_row, train

import edo_monitor
from edo_monitor.signals import Terminated


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        (None, "finished", None),  # sys.exit()
        (0, "finished", None),  # sys.exit(0): early stopping
        (False, "finished", None),  # exit status 0 too
        (3, "failed", "SystemExit: exit code 3"),
        (True, "failed", "SystemExit: exit code 1"),
        ("no more data", "failed", "SystemExit: exit code 1: no more data"),
    ],
)
def test_sys_exit_in_the_block_ends_the_run_by_its_exit_status(
    db_path: Path, code: object, status: str, error: str | None
) -> None:
    """``sys.exit(0)`` inside the block (early stopping) recorded the run ``failed``, error
    ``SystemExit: 0``."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(SystemExit) as raised, edo_monitor.watch(model, db=db_path) as mon:
        train(model, opt, 3)
        sys.exit(code)
    assert raised.value.code is code  # the exit goes on as it came
    assert agent_threads() == []
    assert mon.status == status
    run = run_row(db_path)
    assert (run["status"], run["error"], run["steps"]) == (status, error, 3)


def test_a_training_generator_its_consumer_stopped_ends_the_run_finished(db_path: Path) -> None:
    """Regression: a generator holding the block (yielding each step's loss), stopped by its
    consumer's ``break``, recorded the run ``failed``, error ``GeneratorExit:`` (Python closes
    the generator with it): a clean early stop, as ``sys.exit(0)``."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters())

    def losses() -> Iterator[float]:
        with edo_monitor.watch(model, db=db_path):
            while True:
                loss = model(torch.randint(0, 5_000, (32,))).logsumexp(-1).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                yield loss.item()

    for step, _ in enumerate(losses(), 1):
        if step == 4:
            break
    run = run_row(db_path)
    assert (run["status"], run["error"], run["steps"]) == ("finished", None, 4)


def test_sigterm_is_still_interrupted_though_a_system_exit(db_path: Path) -> None:
    """:class:`Terminated` is a ``SystemExit(143)``: it stays ``interrupted`` / ``SIGTERM``, not
    a ``failed`` exit status."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(SystemExit) as raised, edo_monitor.watch(model, db=db_path):
        train(model, opt, 2)
        raise Terminated()
    assert raised.value.code == 143
    run = run_row(db_path)
    assert (run["status"], run["error"], run["steps"]) == ("interrupted", "SIGTERM", 2)


def test_stop_with_a_clean_exit_records_finished(db_path: Path) -> None:
    """``Monitor.stop(exc)`` (the integrations' end) reads a clean exit as the block does."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    mon = edo_monitor.watch(model, db=db_path).start()
    train(model, opt, 2)
    mon.stop(SystemExit(0))
    run = run_row(db_path)
    assert (run["status"], run["error"], run["steps"]) == ("finished", None, 2)


@pytest.mark.parametrize(
    ("exit_call", "returncode", "status", "error"),
    [
        ("sys.exit(0)", 0, "finished", None),
        ("sys.exit(4)", 4, "failed", "SystemExit: exit code 4"),
    ],
)
def test_a_program_that_stops_early_exits_as_before_and_records_its_end(
    db_path: Path, tmp_path: Path, exit_call: str, returncode: int, status: str, error: str | None
) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, torch, edo_monitor
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with edo_monitor.watch(model, db={str(db_path)!r}, interval_s=0.05):
                for step in range(100):
                    model(torch.randint(0, 100, (16,))).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    if step == 4:  # the validation loss stopped improving
                        {exit_call}
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == returncode, done.stderr
    assert "Traceback" not in done.stderr
    run = run_row(db_path)
    assert (run["status"], run["error"], run["steps"]) == (status, error, 5)


_FORKING = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    import edo_monitor
    from edo_monitor.nn.spill import run_spill_file

    db, folder = sys.argv[1], sys.argv[2]
    spill = run_spill_file(folder).path  # this process's spill file (its atexit removes it)
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    with edo_monitor.watch(model, db=db) as mon:
        for i in range(6):
            model(torch.randint(0, 100, (4,))).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 2:
                if os.fork() == 0:
                    raise RuntimeError("the child fails")  # out of the block, then exit 1
                os.wait()
                with edo_monitor.History(db) as h:
                    seen["after_child"] = h.run(mon.run_id).status
                seen["spill_kept"] = spill.exists()
    print(json.dumps({**seen, "status": mon.status, "steps": mon.steps}))
    """
)


def test_a_forked_child_leaving_the_block_leaves_the_parents_run_alone(tmp_path: Path) -> None:
    """Regression: a child forked inside the block (a data worker, a checkpoint writer) that
    left it through an exception ended the parent's running run ``failed`` with the child's
    error (one that left cleanly, ``finished``, and the parent's later crash then read as
    finished), and its exit removed the parent's spill file. The run and its files are the
    parent's."""
    out = subprocess.run(
        [sys.executable, "-c", _FORKING, str(tmp_path / "h.db"), str(tmp_path / "spill")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "after_child": "running",
        "spill_kept": True,
        "status": "finished",
        "steps": 6,
    }
    assert "RuntimeError: the child fails" in out.stderr  # the child's own exit, as it was


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() fails")


@pytest.mark.parametrize(
    ("raised", "error"),
    [
        # __str__ raised: the agent's RuntimeError took the user's place, the run stayed
        # "running" and the agent's threads alive
        (
            _UnprintableError("x"),
            "_UnprintableError: <str() of the _UnprintableError raised RuntimeError>",
        ),
        # a file name os.fsdecode gave (not UTF-8): the end row was refused, "running"
        (
            ValueError("bad file " + os.fsdecode(b"shard-\xe9.bin")),
            r"ValueError: bad file shard-\udce9.bin",
        ),
        (
            SystemExit(_UnprintableError()),
            "SystemExit: exit code 1: <str() of the _UnprintableError raised",
        ),
    ],
)
def test_any_exception_of_the_user_propagates_and_is_recorded_failed(
    db_path: Path, raised: BaseException, error: str
) -> None:
    model = make_model()
    with pytest.raises(type(raised)) as got, edo_monitor.watch(model, db=db_path):
        raise raised
    assert got.value is raised
    assert agent_threads() == []
    run = run_row(db_path)
    assert run["status"] == "failed"
    assert run["error"].startswith(error), run["error"]
