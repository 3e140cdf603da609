"""What every ``edo-monitor`` command shares: the typer app, the ``--db`` option, the one-line
error handling and exit codes, and the formatting of bytes, times and JSON."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import sqlite3
import sys
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from edo_monitor.errors import (
    ConfigError,
    EdoMonitorError,
    MissingExtraError,
    RunNotFoundError,
    StoreError,
)
from edo_monitor.list_table import Col as Col  # the commands' tables
from edo_monitor.list_table import ListTable as ListTable
from edo_monitor.surfaces.cli.options import (
    RUN_HELP,
    CliCommand,
    CliGroup,
    check_run_reference,
)

__all__ = ["app"]

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
#: The exit codes of every command (``edo-monitor --help`` lists them).
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_ERROR: "runtime or data error (no such run, job or database, unusable database, refused "
    "write, sql timeout, doctor problem, no NVML for daemon)",
    EXIT_USAGE: "usage error (bad option or value, or a sql statement that does not compile)",
    EXIT_INTERNAL: "internal error",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
_EXIT_HELP = "; ".join(f"{code} {what}" for code, what in EXIT_CODES.items())


class _App(typer.Typer):
    """The app: every command is a :class:`CliCommand` (a negative number given to a positional
    argument is refused as its value, not as an unknown option)."""

    def command(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs.setdefault("cls", CliCommand)
        return super().command(*args, **kwargs)


app = _App(
    name="edo-monitor",
    help=(
        "Questions about recorded edo-monitor runs (history database). RUN is a run id, a uuid "
        "prefix as 'runs' prints it, or 'latest'. A multi-rank job (torch.distributed) is one run "
        "per rank: 'jobs' lists jobs, 'job JOB' shows one (JOB: a job id as 'jobs' prints it, a "
        f"unique prefix of it, or 'latest'). Exit codes: {_EXIT_HELP}."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    cls=CliGroup,
)


class _PipedConsole(Console):
    """A Rich console whose reader may go away (``edo-monitor show 1 | head``): the rest of the
    output is dropped and the command exits 0, as every command does on a broken pipe (Rich's own
    handler exits 1, which the CLI documents as a runtime or data error)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more reaches the closed pipe at exit
        raise BrokenPipeError  # _handle_errors: exit 0


#: the width of tables written to a file or a pipe when ``COLUMNS`` is not set: wide on purpose
#: (Rich's own default there is 80), so ``edo-monitor show 1 > run.txt`` or ``| grep`` keeps
#: each row on one line instead of wrapping module names and numbers over several
PIPED_WIDTH = 200


def output_width(
    environ: Mapping[str, str] | None = None, *, tty: bool | None = None
) -> int | None:
    """The width of the CLI's tables: ``COLUMNS`` when it is set to a positive whole number (as
    Rich reads it, on a terminal or not), else the terminal's own (``None``: Rich measures it),
    else :data:`PIPED_WIDTH` for a file or a pipe."""
    environ = os.environ if environ is None else environ
    columns = environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    is_tty = sys.stdout.isatty() if tty is None else tty
    return None if is_tty else PIPED_WIDTH


class _Consoles:
    """Rich consoles made on first use (so they see the current stdout/stderr, e.g. in tests);
    ``COLUMNS`` wide when it is set, else the terminal's width, else wide (:data:`PIPED_WIDTH`)
    when the output is not a terminal, so piped tables are not squeezed."""

    # markup and emoji codes off: names, tags, messages and module names are the user's text
    # (``bert[lr=1e-4]``, ``sweep[/bs64]``, ``:fire:``) and are printed as they are

    @property
    def out(self) -> Console:
        width = output_width()
        return _PipedConsole(
            highlight=False, soft_wrap=False, width=width, markup=False, emoji=False
        )

    @property
    def err(self) -> Console:
        return Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


_c = _Consoles()

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="EDO_DB",
        help="History database: a file path or an SQLAlchemy URL [default: ./edo-history.db]",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (for scripts).")]


def checked_run(param: typer.CallbackParam, value: str) -> str:
    """The callback of every ``RUN`` argument: :func:`check_run_reference` (a negative number is
    a bad value, exit 2, naming what the argument's help allows)."""
    try:
        return check_run_reference(value, param.help)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


RunArg = Annotated[str, typer.Argument(help=RUN_HELP, callback=checked_run)]

F = TypeVar("F", bound=Callable[..., Any])


class RefusedError(EdoMonitorError):
    """A request the CLI refuses (exit code 1)."""


class _InterruptedError(Exception):
    """Ctrl-C during ``sql`` (exit code 130)."""


def _fail(message: str, code: int) -> typer.Exit:
    _c.err.print(f"edo-monitor: error: {message}")
    return typer.Exit(code)


def _handle_errors(func: F) -> F:
    """Turn the errors a user can cause into one line on stderr and the documented exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except BrokenPipeError:  # the reader went away (`edo-monitor export 1 | head`)
            sys.stderr.close()
            raise typer.Exit(EXIT_OK) from None
        except (KeyboardInterrupt, _InterruptedError):
            # the way to stop metrics, daemon and a long sql: not an error (as the examples')
            _c.err.print("edo-monitor: interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except MissingExtraError as exc:  # the command was right; a package is missing
            raise _fail(str(exc), EXIT_ERROR) from None
        except ConfigError as exc:
            raise _fail(str(exc), EXIT_USAGE) from None
        except (RunNotFoundError, StoreError, RefusedError) as exc:
            raise _fail(str(exc), EXIT_ERROR) from None
        except EdoMonitorError as exc:
            raise _fail(str(exc), EXIT_ERROR) from None
        except (OSError, sqlite3.Error) as exc:
            raise _fail(f"{type(exc).__name__}: {exc}", EXIT_ERROR) from None
        except Exception as exc:
            if os.environ.get("EDO_DEBUG"):
                raise
            raise _fail(
                f"internal error ({type(exc).__name__}: {exc}); rerun with EDO_DEBUG=1 for details",
                EXIT_INTERNAL,
            ) from None

    return wrapper  # type: ignore[return-value]


def _print_version(value: bool) -> None:
    if value:
        from edo_monitor import __version__

        sys.stdout.write(f"edo-monitor {__version__}\n")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    db: DbOpt = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
        ),
    ] = False,
) -> None:
    """Questions about recorded edo-monitor runs (history database); exit codes: see --help."""
    if db is not None:  # `edo-monitor --db X cmd`: the command's own --db/EDO_DB default
        before = os.environ.get("EDO_DB")
        os.environ["EDO_DB"] = db
        ctx.call_on_close(functools.partial(_restore_env, "EDO_DB", before))


def _restore_env(name: str, value: str | None) -> None:
    """Put an environment variable back as it was (the global ``--db`` sets ``EDO_DB`` for one
    command only: an in-process caller, a test or a notebook, keeps its own environment)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# -- formatting helpers ------------------------------------------------------------------------


def _bytes(value: Any) -> str:
    from edo_monitor.units import format_bytes

    return format_bytes(value)


def _when(ts: float | None) -> str:
    from edo_monitor.units import format_utc

    return format_utc(ts)


def _dur(seconds: float | None) -> str:
    """``7.25`` → ``"7.2s"``, ``119.9`` → ``"2m00s"``: from a minute on, rounded to the whole
    second (halves up), as the dashboard rounds them; ``None`` → ``"-"``."""
    if seconds is None:
        return "-"
    if seconds < 59.95:  # what .1f prints as 60.0s and more is a minute
        return f"{seconds:.1f}s"
    minutes, sec = divmod(math.floor(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{sec:02d}s"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _parse_duration(value: str, name: str) -> float:
    """Seconds from ``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"2w"`` or a plain number."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", value or "")
    if not m:
        raise ConfigError(
            f"{name}={value!r} is not a duration; expected seconds or a number with a unit such as "
            "'45s', '90m', '12h', '30d' or '2w'"
        )
    scale = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[m.group(2)]
    return float(m.group(1)) * scale


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    return str(obj)


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (``inf``, ``nan``) as ``None``: JSON has no such
    numbers (``json.dumps`` wrote ``Infinity`` and ``NaN``, which strict parsers and ``jq``
    reject)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_text(obj: Any, *, indent: int | None = None) -> str:
    """``obj`` as strict JSON: non-finite floats as ``null`` (:func:`_finite`), bytes as hex,
    other unknown objects as their ``str``."""
    return json.dumps(_finite(obj), indent=indent, default=_json_default, allow_nan=False)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json_text(obj, indent=2) + "\n")


def _info_dict(info: Any) -> dict[str, Any]:
    import dataclasses

    d = dataclasses.asdict(info)
    if hasattr(info, "steps_per_s"):
        d["steps_per_s"] = info.steps_per_s
    return d


def _require_database(db: str | None) -> None:
    """Raise StoreError (exit 1) unless ``db`` is an existing SQLite file (or a server URL)."""
    from edo_monitor.store.paths import readonly_uri, resolve_db_url

    url = resolve_db_url(db, readonly=True)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        readonly_uri(url.database)  # the same "no history database at …" as every reader


def _history(db: str | None, *, readonly: bool = True) -> Any:
    from edo_monitor.store.history import History

    # an older schema is said once, by the engine's warning (every reader's; it names the file)
    return History(db, readonly=readonly)


# -- commands ----------------------------------------------------------------------------------


# -- multi-rank jobs ---------------------------------------------------------------------------


# -- sql ---------------------------------------------------------------------------------------


# -- prune -------------------------------------------------------------------------------------


# -- doctor ------------------------------------------------------------------------------------


# -- estimate ----------------------------------------------------------------------------------
