"""Start-up of the ``edo-monitor`` console script: build only the command that was asked for.

Typer turns every registered command into a Click command (its parameters, their help, a
pydantic adapter per option) each time the app is called, although one command runs: with the
fifteen commands of :mod:`edo_monitor.surfaces.cli` that is 15–19 ms of the ~0.5 s a history command
takes on the project's 2-core machine (``benchmarks/startup.py``). :func:`app_for` returns an app
that holds the global callback and the one command named on the command line, so the others are
never built; anything else (no command, ``--help`` before the command, an unknown name, an option
this module does not know before the command) gets the full app, so its help, suggestions and errors
are the full app's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import typer
from typer.main import get_command_name

__all__ = ["app_for"]

#: Options of the app's global callback that take a value (``edo-monitor --db X runs``).
_GLOBAL_VALUE_OPTIONS = frozenset({"--db"})


def _command_token(argv: Sequence[str]) -> str | None:
    """The first argument that names a command, skipping the global options; ``None`` when an
    argument before it is not a global option this module knows (``--help``, a typo)."""
    k = 0
    while k < len(argv):
        arg = argv[k]
        if arg in _GLOBAL_VALUE_OPTIONS:
            k += 2
            continue
        if any(arg.startswith(f"{opt}=") for opt in _GLOBAL_VALUE_OPTIONS):
            k += 1
            continue
        return None if arg.startswith("-") else arg
    return None


def app_for(app: typer.Typer, argv: Sequence[str]) -> typer.Typer:
    """``app`` with only the command that ``argv`` (the arguments after the program name) runs.

    Returns ``app`` itself when ``argv`` names no registered command (see the module docstring);
    else a shallow copy of it whose ``registered_commands`` is that one command: the same
    callback, settings, help and exit codes, so the command behaves exactly as in ``app``.
    """
    name = _command_token(argv)
    if name is None or app.registered_groups:
        return app
    chosen = [
        info
        for info in app.registered_commands
        if (info.name or (info.callback and get_command_name(info.callback.__name__))) == name
    ]
    if len(chosen) != 1:
        return app
    slim = copy.copy(app)
    slim.registered_commands = chosen
    return slim
