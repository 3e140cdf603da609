"""What every ``edo-monitor`` command shares at the Click level: number options that refuse
``nan``, infinities and values out of range in words, a negative number given as a positional
argument refused as its value (Click read ``explain -1`` as an unknown option ``-1``), and one
format for every Click-level error (an unknown option, a bad or out-of-range value): one
``edo-monitor: error: ...`` line on stderr and exit code 2, as for every other bad value (Click
printed a four-line usage block).
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer 0.2x carries its own copy of Click, whose exceptions its commands raise
    from typer._click import exceptions as click
except ImportError:  # older typer: Click itself
    import click  # type: ignore[no-redef]

__all__ = [
    "INT64_MAX",
    "RUN_HELP",
    "CliCommand",
    "CliGroup",
    "Number",
    "check_run_reference",
    "int64",
    "out_of_range",
]

#: Click 8.2's "no arguments: show the help" error; older Click (the lowest versions allowed)
#: shows the help itself, so nothing is caught there.
_NO_ARGS_IS_HELP: Any = getattr(click, "NoArgsIsHelpError", ())

#: The largest count a history database (SQLite/PostgreSQL INTEGER) or a tensor dimension holds.
INT64_MAX = 2**63 - 1

#: Exit code of a usage error (the CLI's scheme: see ``edo_monitor.surfaces.cli``).
EXIT_USAGE = 2


class Number:
    """An int or float option within ``low..high`` (inclusive; ``None``: unbounded).

    Given to ``typer.Option(parser=...)``. Refuses with ``ValueError``, naming the value: text
    that is not a number of the kind, ``nan`` ("not a number"), an infinity, and a value out of
    range (saying the allowed range, with ``unit``).
    """

    def __init__(
        self, kind: type, low: float | None = None, high: float | None = None, unit: str = ""
    ) -> None:
        """``kind`` is ``int`` or ``float``."""
        self.kind = kind
        self.low = low
        self.high = high
        self.unit = unit
        self.name = "integer" if kind is int else "number"
        self.__name__ = self.name  # typer's parser= takes a callable with a name

    def allowed(self) -> str:
        """The allowed range in words, e.g. ``0 to 65535`` or ``at least 1``."""
        unit = f" {self.unit}" if self.unit else ""
        if self.low is not None and self.high is not None:
            return (
                f"{_plain(self.low)}{unit} to {_plain(self.high)}{unit}"
                if self.kind is float
                else (f"{self.low} to {self.high}{unit}")
            )
        if self.low is not None:
            return f"at least {self.low}{unit}"
        if self.high is not None:
            return f"at most {self.high}{unit}"
        return f"any {self.name}"

    def __call__(self, value: Any) -> Any:
        """The number ``value`` stands for (fails with a one-line reason otherwise)."""
        if isinstance(value, self.kind) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            try:
                number = int(text, 10) if self.kind is int else float(text)
            except ValueError:
                raise ValueError(
                    f"{value!r} is not {'an integer' if self.kind is int else 'a number'}"
                ) from None
        if isinstance(number, float) and math.isnan(number):
            raise ValueError(f"{value!r} is not a number (nan); allowed: {self.allowed()}")
        if isinstance(number, float) and math.isinf(number):
            raise ValueError(f"{value!r} is infinite; allowed: {self.allowed()}")
        if (self.low is not None and number < self.low) or (
            self.high is not None and number > self.high
        ):
            raise ValueError(f"{value} is out of range; allowed: {self.allowed()}")
        return number


def _plain(number: float) -> str:
    """``number`` as a person writes it: ``0.01``, ``3600``, ``2147483`` (``:g`` alone wrote a
    whole number of a million or more as ``2.14748e+06``)."""
    if float(number).is_integer() and abs(number) >= 1e6:
        return str(int(number))
    return f"{number:g}"


def int64(low: int = 1) -> Number:
    """The one range check of every option that takes an id or a count the history compares
    with its 64-bit ``INTEGER`` columns (``--event``, ``--limit``, ``--max-events``,
    ``--keep-last``, ``--top``, a table's rows): a whole number from ``low`` to
    :data:`INT64_MAX`. A larger one reached the database driver: SQLite's "Python int too large
    to convert to SQLite INTEGER" and PostgreSQL's "bigint out of range" were internal errors;
    a lower one (``--event 0``, ``-1``) was looked up and not found, where ``explain --event``
    refused it (exit 2) naming what is allowed."""
    return Number(int, low, INT64_MAX)


#: A negative number as typed (``-1``, ``-2.5``, ``-1e3``): Click takes it for an option.
_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

#: What names a run: the help of a ``RUN`` argument, and what its refusal says is allowed.
RUN_HELP = "Run id (1 or more), uuid prefix (as 'runs' prints it), or 'latest'."


def out_of_range(value: str, help_text: str | None) -> str:
    """The refusal of ``value`` (a negative number) given to an argument whose help is
    ``help_text``: ``-1 is out of range; allowed: run id (1 or more), …``."""
    allowed = (help_text or "").strip().rstrip(".")
    allowed = allowed[:1].lower() + allowed[1:]
    return f"{value} is out of range" + (f"; allowed: {allowed}" if allowed else "")


def check_run_reference(text: str, help_text: str | None = RUN_HELP) -> str:
    """``text`` as a run reference (an id, a uuid prefix or ``latest``), checked as every
    command checks one before anything is opened: ``edo-monitor``'s ``RUN`` arguments (``show
    -1`` and ``show -- -1`` alike), ``edo-tui --run`` and the screenshot tool's ``--run``.

    Raises:
        ValueError: ``text`` is a negative number (``-1``, ``-2.5``): a bad value, not a run
            that is not there; the message names it and what is allowed (:func:`out_of_range`
            with ``help_text``).
    """
    if _NEGATIVE_NUMBER.fullmatch(text):
        raise ValueError(out_of_range(text, help_text))
    return text


class CliCommand(TyperCommand):
    """An ``edo-monitor`` command whose positional arguments are named alike everywhere, and
    whose positional argument given a negative number is refused as a bad value of that
    argument.

    Names: each argument's metavar is its name in capitals (``RUN``, ``RUN_A``, ``JOB``), so the
    usage line, the help's list of arguments and every error about it (``Missing argument
    'RUN_B'``, ``Invalid value for 'RUN'``) name it the same way, whatever typer's version (one
    showed ``{run_b}`` in the usage and another ``RUN_B``, while a missing one was ``'run_b'``).

    Negative numbers: ``explain -1`` said ``No such option: -1`` where ``explain 1 --event -1``
    said ``-1 is out of range``, naming the value and what the argument allows (its help). Click
    reads any word that starts with ``-`` as an option; when the unknown option is a negative
    number, the command line is read again with Click's ``ignore_unknown_options`` (the number
    then lands in its argument) and the argument that got it is refused with Click's own
    ``BadParameter``. Every other unknown option is Click's error as before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name == "argument" and param.metavar is None:
                param.metavar = shown_name(param)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        given = list(args)  # Click's parser consumes the list it reads
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if not _NEGATIVE_NUMBER.fullmatch(exc.option_name):
                raise
            unknown = exc
        ctx.ignore_unknown_options = True
        try:
            super().parse_args(ctx, given)
        except click.BadParameter:
            raise  # the argument's own check refused the number (its message names it)
        except click.UsageError:
            raise unknown from None
        finally:
            ctx.ignore_unknown_options = False
        for param in self.get_params(ctx):
            value = ctx.params.get(param.name or "")
            if (
                param.param_type_name == "argument"
                and isinstance(value, str)
                and _NEGATIVE_NUMBER.fullmatch(value)
            ):
                raise click.BadParameter(
                    out_of_range(value, getattr(param, "help", None)),
                    ctx=ctx,
                    param=param,
                    param_hint=repr(param.metavar or shown_name(param)),  # as the usage names it
                )
        raise unknown  # the number was not an argument's (a command without one)


def shown_name(param: Any) -> str:
    """How the usage line names a positional argument: its name in capitals (``run_b``:
    ``RUN_B``)."""
    return (param.name or "").upper()


class CliGroup(TyperGroup):
    """The ``edo-monitor`` group: every Click-level error is one ``edo-monitor: error:`` line
    and exit code 2 (help for ``edo-monitor`` alone is still shown as help)."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Run the command line; with ``standalone_mode`` exit with the code."""
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # bare `edo-monitor`: the help, as before
            exc.show()
            code = exc.exit_code
        except click.ClickException as exc:
            sys.stderr.write(f"edo-monitor: error: {one_line(exc)}\n")
            code = EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code
        except typer.Abort:
            sys.stderr.write("edo-monitor: interrupted\n")
            code = 130
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def one_line(exc: click.ClickException) -> str:
    """A Click error's message on one line (Click names the option; typer's validation wrapper
    adds a ``Value error,`` of its own, which is dropped)."""
    return " ".join(exc.format_message().replace("Value error, ", "").split())
