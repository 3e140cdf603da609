"""Every ``edo-monitor`` command names its positional arguments one way: in the usage line, the
help's list of arguments and every error about one (``CliCommand``: the metavar is the name in
capitals).

Regression: ``edo-monitor compare 1`` said ``Missing argument 'run_b'.`` (the Python parameter's
name) while the usage and the app's help name arguments ``RUN`` and ``JOB``.
"""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from edo_monitor.surfaces.cli import app


def _missing_cases() -> list[tuple[list[str], str]]:
    """(argv, argument) for every required positional argument of every command: the ones
    before it given, it left out."""
    cases = []
    for name, command in sorted(typer.main.get_command(app).commands.items()):
        arguments = [p for p in command.params if p.param_type_name == "argument"]
        for k, target in enumerate(arguments):
            if target.required:
                cases.append(([name, *("1" for _ in range(k))], (target.name or "").upper()))
    return cases


MISSING = _missing_cases()


def test_the_commands_with_arguments_are_all_there() -> None:
    assert {argv[0] for argv, _ in MISSING} >= {
        "compare",
        "events",
        "explain",
        "export",
        "job",
        "replay",
        "show",
        "snapshot",
        "sql",
    }
    assert (["compare", "1"], "RUN_B") in MISSING


@pytest.mark.parametrize(("argv", "argument"), MISSING, ids=[" ".join(c[0]) for c in MISSING])
def test_a_missing_argument_is_named_as_the_usage_names_it(argv: list[str], argument: str) -> None:
    runner = CliRunner()
    done = runner.invoke(app, argv)
    assert done.exit_code == 2, done.output
    # stdout is empty: output is stderr, with Click 8.1's runner (which mixes the two) too
    assert done.output == f"edo-monitor: error: Missing argument '{argument}'.\n"
    usage = next(
        line
        for line in runner.invoke(app, [argv[0], "--help"]).stdout.splitlines()
        if "Usage:" in line
    )
    shown = usage.partition("[OPTIONS]")[2]  # the arguments, after the command's name
    assert re.search(rf"\b{argument}\b", shown), usage  # {RUN_B} (typer 0.2x) or RUN_B
    assert not re.search(rf"\b{argument.lower()}\b", shown), usage


def test_a_bad_value_names_the_argument_the_same_way() -> None:
    """The negative-number refusal and a missing argument say ``'RUN_B'`` alike."""
    done = CliRunner().invoke(app, ["compare", "1", "-2"])
    assert done.exit_code == 2
    assert done.output.startswith("edo-monitor: error: Invalid value for 'RUN_B': -2 is out of")
